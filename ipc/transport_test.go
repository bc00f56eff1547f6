package ipc_test

import (
	"context"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/internal/sys/sock"
	"github.com/mpmr/mpmr/ipc"
)

func TestValidatePrefix(t *testing.T) {
	for _, p := range []string{"a", "mpmr", "test-1_x.y", strings.Repeat("x", 64), "A.b"} {
		assert.NoError(t, ipc.ValidatePrefix(p), "%q", p)
	}
	for _, p := range []string{"", ".", "..", "a..b", "a/b", "/abs", "sp ace", "é", strings.Repeat("x", 65), "a\x00"} {
		assert.ErrorIs(t, ipc.ValidatePrefix(p), ipc.ErrBadPrefix, "%q", p)
	}
}

func TestRuntimeDir(t *testing.T) {
	t.Run("XDG_RUNTIME_DIR first", func(t *testing.T) {
		t.Setenv("XDG_RUNTIME_DIR", "/run/user/1234")
		d, err := ipc.RuntimeDir("inst")
		require.NoError(t, err)
		assert.Equal(t, "/run/user/1234/mpmr/inst", d)
		p, err := ipc.SocketPath("inst")
		require.NoError(t, err)
		assert.Equal(t, "/run/user/1234/mpmr/inst/"+ipc.SocketName, p)
	})
	t.Run("relative XDG_RUNTIME_DIR is ignored", func(t *testing.T) {
		t.Setenv("XDG_RUNTIME_DIR", "run/user")
		d, err := ipc.RuntimeDir("inst")
		require.NoError(t, err)
		want := "/run/mpmr/inst"
		if uid := os.Geteuid(); uid != 0 {
			want = filepath.Join(os.TempDir(), "mpmr-"+strconv.Itoa(uid), "inst")
		}
		assert.Equal(t, want, d)
	})
	t.Run("bad prefix", func(t *testing.T) {
		_, err := ipc.RuntimeDir("../etc")
		assert.ErrorIs(t, err, ipc.ErrBadPrefix)
		_, err = ipc.SocketPath("")
		assert.ErrorIs(t, err, ipc.ErrBadPrefix)
	})
}

func TestListenCreatesAPrivateSocket(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "a", "b")
	path := filepath.Join(dir, ipc.SocketName)
	l, err := ipc.Listen(path)
	require.NoError(t, err)
	defer l.Close()

	di, err := os.Stat(dir)
	require.NoError(t, err)
	assert.Equal(t, os.FileMode(0o700), di.Mode().Perm(), "directory mode")
	fi, err := os.Lstat(path)
	require.NoError(t, err)
	assert.Equal(t, os.ModeSocket, fi.Mode().Type())
	assert.Equal(t, os.FileMode(0o600), fi.Mode().Perm(), "socket mode")

	require.NoError(t, l.Close())
	_, err = os.Lstat(path)
	assert.ErrorIs(t, err, os.ErrNotExist, "Close removes the socket file")
	assert.NoError(t, l.Close(), "Close is idempotent")
}

func TestListenOnALiveSocketFails(t *testing.T) {
	s := startServer(t, newHandler())
	_, err := ipc.Listen(s.path)
	assert.ErrorIs(t, err, ipc.ErrAddressInUse)
	c := dial(t, s.path, ipc.ClientConfig{})
	require.NoError(t, c.Call(ctxBound(t), ipc.KindDetach, &ipc.Detach{}, nil), "the live server still serves")
}

func TestListenReplacesAStaleSocket(t *testing.T) {
	path := filepath.Join(t.TempDir(), ipc.SocketName)
	dead, err := sock.Listen(path, false) // a server that ended without removing its file
	require.NoError(t, err)
	require.NoError(t, dead.Close())
	_, err = ipc.Dial(ctxBound(t), path)
	require.ErrorIs(t, err, ipc.ErrNotListening)

	s := startServerOn(t, listen(t, path), newHandler())
	c := dial(t, s.path, ipc.ClientConfig{})
	assert.NoError(t, c.Call(ctxBound(t), ipc.KindDetach, &ipc.Detach{}, nil))
}

func listen(t testing.TB, path string) *ipc.Listener {
	t.Helper()
	l, err := ipc.Listen(path)
	require.NoError(t, err)
	return l
}

func TestListenRefusesToReplaceWhatIsNotASocket(t *testing.T) {
	path := filepath.Join(t.TempDir(), ipc.SocketName)
	require.NoError(t, os.WriteFile(path, []byte("precious"), 0o600))
	_, err := ipc.Listen(path)
	assert.ErrorIs(t, err, ipc.ErrAddressInUse)
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	assert.Equal(t, "precious", string(b))
}

func TestListenRefusesAnUnsafeDirectory(t *testing.T) {
	dir := t.TempDir()
	require.NoError(t, os.Chmod(dir, 0o777))
	_, err := ipc.Listen(filepath.Join(dir, ipc.SocketName))
	assert.ErrorIs(t, err, ipc.ErrUnsafeDir)
	require.NoError(t, os.Chmod(dir, os.ModeSticky|0o777)) // like /tmp
	l, err := ipc.Listen(filepath.Join(dir, ipc.SocketName))
	require.NoError(t, err)
	l.Close()
}

func TestCloseLeavesAReplacementSocketAlone(t *testing.T) {
	path := filepath.Join(t.TempDir(), ipc.SocketName)
	old := listen(t, path)
	require.NoError(t, os.Remove(path)) // an operator cleaned up...
	repl := listen(t, path)             // ...and another server took the path
	defer repl.Close()
	require.NoError(t, old.Close())
	_, err := os.Lstat(path)
	assert.NoError(t, err, "the old listener must not remove the new socket")
}

func TestDialWithNobodyListening(t *testing.T) {
	_, err := ipc.Dial(context.Background(), filepath.Join(t.TempDir(), "none.sock"))
	assert.ErrorIs(t, err, ipc.ErrNotListening)
}
