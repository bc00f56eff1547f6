package ipc_test

import (
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/ipc"
)

// Users the directory tests act as. No account needs to exist: the kernel
// checks numeric uids.
const (
	victimUID   = 42001
	squatterUID = 42002
)

func init() { testproc.Register("as-user", helperAsUser) }

// helperAsUser becomes uid args[0] (gid the same) and does args[1] with
// the rest, printing "result ERR":
//
//	mkdir PATH MODE   makes a directory and sets its mode (octal)
//	listen PATH       listens at PATH (and stops)
//	open DIR          opens DIR as a primary's runtime directory
func helperAsUser(args []string) int {
	uid, _ := strconv.Atoi(args[0])
	if err := testenv.BecomeUser(uid); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 3
	}
	var err error
	switch args[1] {
	case "mkdir":
		mode, _ := strconv.ParseUint(args[3], 8, 32)
		if err = os.Mkdir(args[2], 0o700); err == nil {
			err = os.Chmod(args[2], fileMode(uint32(mode)))
		}
	case "listen":
		var l *ipc.Listener
		if l, err = ipc.Listen(args[2]); err == nil {
			l.Close()
		}
	case "open":
		var d *ipc.RunDir
		if d, err = ipc.OpenRunDir(args[2], ipc.RunDirOptions{Create: true}); err == nil {
			d.Close()
		}
	default:
		err = fmt.Errorf("unknown operation %q", args[1])
	}
	testproc.Say("result %v", err)
	return 0
}

// fileMode turns permission bits with the sticky bit into an os.FileMode.
func fileMode(m uint32) os.FileMode {
	fm := os.FileMode(m & 0o777)
	if m&0o1000 != 0 {
		fm |= os.ModeSticky
	}
	return fm
}

func requireRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: to act as other users (setuid) and give files to them (chown)")
	}
}

// asUser runs one operation of helperAsUser as uid and returns its result.
func asUser(t *testing.T, uid int, args ...string) string {
	t.Helper()
	h := testproc.Start(t, "as-user", append([]string{strconv.Itoa(uid)}, args...))
	line := strings.TrimPrefix(h.Expect("result ", 0), "result ")
	require.NoError(t, h.Wait(0))
	return line
}

// sharedTmp returns a fresh directory like /tmp: root's, mode 1777.
func sharedTmp(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	// The test's own temporary directory is private: let others through.
	require.NoError(t, os.Chmod(filepath.Dir(dir), 0o755))
	require.NoError(t, os.Chmod(dir, os.ModeSticky|0o777))
	return dir
}

// Another user pre-creates the directory a victim's runtime directory
// goes in, open to all: the victim must refuse to create anything in it.
func TestSquattedRuntimeDirectoryIsRefused(t *testing.T) {
	requireRoot(t)
	tmp := sharedTmp(t)
	squat := filepath.Join(tmp, "mpmr-"+strconv.Itoa(victimUID))
	require.Equal(t, "<nil>", asUser(t, squatterUID, "mkdir", squat, "1777"))

	inst := filepath.Join(squat, "inst")
	for _, op := range [][]string{{"listen", filepath.Join(inst, ipc.SocketName)}, {"open", inst}} {
		line := asUser(t, victimUID, op...)
		assert.Contains(t, line, ipc.ErrPermission.Error(), "%s", op[0])
		for _, want := range []string{squat + " is owned by another user", "owner uid " + strconv.Itoa(squatterUID),
			"mode 1777", "runs as uid " + strconv.Itoa(victimUID), "remove it"} {
			assert.Contains(t, line, want, "%s", op[0])
		}
	}
	_, err := os.Lstat(inst)
	assert.ErrorIs(t, err, fs.ErrNotExist, "nothing was created in the squatted directory")

	// Its rightful owner's directory in the same place is accepted.
	require.NoError(t, os.RemoveAll(squat))
	require.Equal(t, "<nil>", asUser(t, victimUID, "mkdir", squat, "700"))
	assert.Equal(t, "<nil>", asUser(t, victimUID, "open", inst))
	assert.Equal(t, "<nil>", asUser(t, victimUID, "listen", filepath.Join(inst, ipc.SocketName)))
}

// chown gives path (not following a link) to uid.
func chown(t *testing.T, path string, uid int) {
	t.Helper()
	require.NoError(t, os.Lchown(path, uid, uid))
}

func TestOpenRunDirChecksEveryComponent(t *testing.T) {
	requireRoot(t)
	other := squatterUID
	mk := func(t *testing.T, path string, mode os.FileMode, owner int) string {
		t.Helper()
		require.NoError(t, os.MkdirAll(path, 0o700))
		require.NoError(t, os.Chmod(path, mode))
		chown(t, path, owner)
		return path
	}
	cases := []struct {
		name   string
		setup  func(t *testing.T, base string) string // returns the runtime directory
		opts   ipc.RunDirOptions
		refuse string // a part of the ErrPermission message; "" for success
	}{
		{"parent of another user", func(t *testing.T, base string) string {
			return filepath.Join(mk(t, filepath.Join(base, "p"), 0o755, other), "inst")
		}, ipc.RunDirOptions{Create: true}, "p is owned by another user"},
		{"parent writable by all", func(t *testing.T, base string) string {
			return filepath.Join(mk(t, filepath.Join(base, "p"), 0o777, 0), "inst")
		}, ipc.RunDirOptions{Create: true}, "p is writable by other users"},
		{"parent group-writable", func(t *testing.T, base string) string {
			return filepath.Join(mk(t, filepath.Join(base, "p"), 0o770, 0), "inst")
		}, ipc.RunDirOptions{Create: true}, "mode 0770"},
		{"sticky parent of root, like /tmp", func(t *testing.T, base string) string {
			return filepath.Join(mk(t, filepath.Join(base, "p"), os.ModeSticky|0o777, 0), "inst")
		}, ipc.RunDirOptions{Create: true}, ""},
		{"sticky parent of another user", func(t *testing.T, base string) string {
			return filepath.Join(mk(t, filepath.Join(base, "p"), os.ModeSticky|0o777, other), "inst")
		}, ipc.RunDirOptions{Create: true}, "p is owned by another user"},
		{"a grandparent of another user", func(t *testing.T, base string) string {
			mk(t, filepath.Join(base, "g"), 0o755, other)
			return filepath.Join(mk(t, filepath.Join(base, "g", "p"), 0o755, 0), "inst")
		}, ipc.RunDirOptions{Create: true}, "g is owned by another user"},
		{"missing parents are made", func(t *testing.T, base string) string {
			return filepath.Join(base, "a", "b", "inst")
		}, ipc.RunDirOptions{Create: true}, ""},
		{"link of another user on the way", func(t *testing.T, base string) string {
			mk(t, filepath.Join(base, "real"), 0o755, 0)
			require.NoError(t, os.Symlink(filepath.Join(base, "real"), filepath.Join(base, "link")))
			chown(t, filepath.Join(base, "link"), other)
			return filepath.Join(base, "link", "inst")
		}, ipc.RunDirOptions{Create: true}, "link is a symbolic link owned by another user"},
		{"link of our own to a safe directory", func(t *testing.T, base string) string {
			mk(t, filepath.Join(base, "real"), 0o755, 0)
			require.NoError(t, os.Symlink("real", filepath.Join(base, "link")))
			return filepath.Join(base, "link", "inst")
		}, ipc.RunDirOptions{Create: true}, ""},
		{"link of our own into another user's directory", func(t *testing.T, base string) string {
			mk(t, filepath.Join(base, "theirs"), 0o755, other)
			require.NoError(t, os.Symlink(filepath.Join(base, "theirs"), filepath.Join(base, "link")))
			return filepath.Join(base, "link", "inst")
		}, ipc.RunDirOptions{Create: true}, "theirs is owned by another user"},
		{"instance directory is a link", func(t *testing.T, base string) string {
			mk(t, filepath.Join(base, "elsewhere"), 0o700, 0)
			require.NoError(t, os.Symlink(filepath.Join(base, "elsewhere"), filepath.Join(base, "inst")))
			return filepath.Join(base, "inst")
		}, ipc.RunDirOptions{Create: true}, "not a directory but a symbolic link"},
		{"instance directory of another user", func(t *testing.T, base string) string {
			return mk(t, filepath.Join(base, "inst"), 0o700, other)
		}, ipc.RunDirOptions{Create: true}, "inst is owned by another user"},
		{"instance directory of root's, for a secondary", func(t *testing.T, base string) string {
			return mk(t, filepath.Join(base, "inst"), 0o711, 0)
		}, ipc.RunDirOptions{}, ""},
		{"instance directory of another user, for a secondary", func(t *testing.T, base string) string {
			return mk(t, filepath.Join(base, "inst"), 0o711, other)
		}, ipc.RunDirOptions{}, "inst is owned by another user"},
		{"instance directory of a trusted user, for a secondary", func(t *testing.T, base string) string {
			return mk(t, filepath.Join(base, "inst"), 0o711, other)
		}, ipc.RunDirOptions{TrustUIDs: []int{other}}, ""},
		{"a trusted user is not trusted by a primary", func(t *testing.T, base string) string {
			return mk(t, filepath.Join(base, "inst"), 0o700, other)
		}, ipc.RunDirOptions{Create: true, TrustUIDs: []int{other}}, "inst is owned by another user"},
		{"instance directory writable by others, even sticky", func(t *testing.T, base string) string {
			return mk(t, filepath.Join(base, "inst"), os.ModeSticky|0o777, 0)
		}, ipc.RunDirOptions{Create: true}, "inst is writable by other users"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			base := t.TempDir()
			dir := c.setup(t, base)
			d, err := ipc.OpenRunDir(dir, c.opts)
			if c.refuse != "" {
				require.ErrorIs(t, err, ipc.ErrPermission)
				assert.Contains(t, err.Error(), c.refuse)
				assert.Contains(t, err.Error(), "runs as uid 0")
				if c.opts.Create && strings.Contains(c.refuse, "owned by another user") {
					assert.Contains(t, err.Error(), "owner uid "+strconv.Itoa(other))
					assert.NotContains(t, err.Error(), "TrustUIDs", "a primary has no trust list to offer")
				}
				return
			}
			require.NoError(t, err)
			defer d.Close()
			real, err := filepath.EvalSymlinks(dir)
			require.NoError(t, err)
			assert.Equal(t, real, d.Path(), "the real path")
			fi, err := os.Stat(dir)
			require.NoError(t, err)
			if c.opts.Create && !strings.Contains(c.name, "link of our own") {
				assert.Equal(t, os.FileMode(0o700), fi.Mode().Perm(), "created private")
			}
		})
	}
	t.Run("missing, for a secondary", func(t *testing.T) {
		_, err := ipc.OpenRunDir(filepath.Join(t.TempDir(), "inst"), ipc.RunDirOptions{})
		assert.ErrorIs(t, err, fs.ErrNotExist)
		assert.NotErrorIs(t, err, ipc.ErrPermission, "nothing there is not a refusal")
	})
}

func TestRunDirFiles(t *testing.T) {
	requireRoot(t)
	d, err := ipc.OpenRunDir(filepath.Join(t.TempDir(), "inst"), ipc.RunDirOptions{Create: true})
	require.NoError(t, err)
	defer d.Close()

	f, err := d.OpenFile("a", os.O_RDWR|os.O_CREATE, 0o600)
	require.NoError(t, err)
	f.Close()
	require.NoError(t, os.Symlink("/etc/passwd", filepath.Join(d.Path(), "link")))
	_, err = d.OpenFile("link", os.O_RDONLY, 0)
	assert.ErrorIs(t, err, ipc.ErrPermission, "a link is not followed")
	require.NoError(t, syscall.Mkfifo(filepath.Join(d.Path(), "fifo"), 0o600))
	_, err = d.OpenFile("fifo", os.O_RDONLY, 0)
	assert.ErrorIs(t, err, ipc.ErrPermission, "a FIFO is refused, without hanging the open")
	require.NoError(t, os.WriteFile(filepath.Join(d.Path(), "theirs"), nil, 0o644))
	chown(t, filepath.Join(d.Path(), "theirs"), squatterUID)
	_, err = d.OpenFile("theirs", os.O_RDONLY, 0)
	assert.ErrorIs(t, err, ipc.ErrPermission, "a file of another user is refused")
	_, err = d.OpenFile("../a", os.O_RDONLY, 0)
	assert.Error(t, err)

	require.NoError(t, d.Rename("a", "b"))
	st, err := d.Stat("b")
	require.NoError(t, err)
	assert.Equal(t, uint32(syscall.S_IFREG), st.Mode&syscall.S_IFMT)
	require.NoError(t, d.Remove("b"))
	_, err = d.Stat("b")
	assert.ErrorIs(t, err, fs.ErrNotExist)

	require.NoError(t, d.Check())
	// Renamed away and replaced: the path no longer names what was opened.
	require.NoError(t, os.Rename(d.Path(), d.Path()+".old"))
	require.NoError(t, os.Mkdir(d.Path(), 0o700))
	assert.ErrorIs(t, d.Check(), ipc.ErrPermission)
	require.NoError(t, os.Remove(d.Path()))
	require.NoError(t, os.Rename(d.Path()+".old", d.Path()))
	require.NoError(t, d.Check())
	require.NoError(t, os.Chmod(d.Path(), 0o777))
	assert.ErrorIs(t, d.Check(), ipc.ErrPermission, "opened to everyone since")
}

// RemoveDir removes the runtime directory itself when it is empty, and
// nothing else: a parent swapped for a link between the check of the path
// and the removal (the race a parent's owner can run against root cleaning
// the instance) must not have it remove what the link leads to.
func TestRunDirRemoveDir(t *testing.T) {
	requireRoot(t)
	base := t.TempDir()
	parent := filepath.Join(base, "parent")
	d, err := ipc.OpenRunDir(filepath.Join(parent, "inst"), ipc.RunDirOptions{Create: true})
	require.NoError(t, err)
	defer d.Close()
	f, err := d.OpenFile("a", os.O_RDWR|os.O_CREATE, 0o600)
	require.NoError(t, err)
	f.Close()
	assert.Error(t, d.RemoveDir(), "not empty")
	assert.DirExists(t, d.Path())
	require.NoError(t, d.Remove("a"))

	decoy := filepath.Join(base, "elsewhere", "inst")
	require.NoError(t, os.MkdirAll(decoy, 0o700))
	ipc.SetAfterCheckHook(func() {
		require.NoError(t, os.Rename(parent, parent+".real"))
		require.NoError(t, os.Symlink(filepath.Join(base, "elsewhere"), parent))
	})
	t.Cleanup(func() { ipc.SetAfterCheckHook(nil) })
	err = d.RemoveDir()
	assert.DirExists(t, decoy, "what the swapped path leads to is left alone (%v)", err)
	assert.NoDirExists(t, filepath.Join(parent+".real", "inst"), "the runtime directory itself goes, wherever it is")
}
