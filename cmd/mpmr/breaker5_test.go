package main

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/internal/sys/ofd"
	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/internal/test/testproc"
)

// breaker5ToolUID is the other local user that runs the tool.
const breaker5ToolUID = 44205

func init() {
	// breaker5-tool [UID ARGS...]: mpmr ARGS run as user UID.
	testproc.Register("breaker5-tool", func(args []string) int {
		uid, err := strconv.Atoi(args[0])
		if err == nil {
			err = testenv.BecomeUser(uid)
		}
		if err != nil {
			os.Stderr.WriteString(err.Error() + "\n")
			return 99
		}
		return run(args[1:], os.Stdout, os.Stderr)
	})
}

// Issue 15, Deliver 4: "no empty placeholders" (it names "raw": null).
// mpmr stats -json of a dead instance prints "processes": null.
func TestBreaker5StatsJSONOfADeadInstanceHasNoNull(t *testing.T) {
	b := testenv.Tmpfs(t)
	rundir := testenv.RunDir(t)
	h, prefix := startDeadable(t, b, rundir)
	h.kill()

	for _, cmd := range []string{"stats", "dump"} {
		out, stderr, status := tool(t, "-json", "-rundir", rundir, cmd, prefix)
		require.Zero(t, status, stderr)
		var v any
		require.NoError(t, json.Unmarshal([]byte(out), &v))
		walkJSON("", v, func(path, k string) {}, func(path string, x any) {
			assert.NotNil(t, x, "mpmr %s -json of a dead instance: %s is null\n%s", cmd, path, out)
		})
	}
}

// Issue 15, Deliver 3: "Name permission problems as such (which path,
// which owner, which uid we are) with their own sentinel; keep
// ErrNoPrimary for nothing is listening." The secondary does now; the
// operator's tool, run by a user who may not enter a live instance's
// directory, still says there is no instance ("wrong -rundir?"), and ls
// lists nothing at all.
func TestBreaker5ToolNamesPermissionProblemsOfAnotherUser(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("running the tool as another user needs root")
	}
	b := testenv.Tmpfs(t)
	rundir := testenv.RunDir(t)
	require.NoError(t, os.Chmod(rundir, 0o755)) // like the README's /tmp/mrt
	_, cfg := startPrimary(t, b, rundir)
	instDir := filepath.Join(rundir, cfg.Prefix)

	asUser := func(args ...string) (string, int) {
		cmd := testproc.Command(context.Background(), "breaker5-tool",
			append([]string{strconv.Itoa(breaker5ToolUID)}, args...)...)
		out, err := cmd.CombinedOutput()
		code := cmd.ProcessState.ExitCode()
		require.NotEqual(t, 99, code, "becoming uid %d: %v\n%s", breaker5ToolUID, err, out)
		return string(out), code
	}
	for _, c := range []string{"dump", "stats", "clean"} {
		t.Run(c, func(t *testing.T) {
			out, code := asUser("-rundir", rundir, c, cfg.Prefix)
			assert.NotZero(t, code, out)
			assert.Contains(t, out, "permission", "a permission problem is named as such:\n%s", out)
			assert.Contains(t, out, instDir, "with the path")
			assert.Contains(t, out, "uid "+strconv.Itoa(breaker5ToolUID), "and the uid the tool runs as")
			assert.NotContains(t, out, "no instance", "the instance is there, and live")
		})
	}
	t.Run("ls", func(t *testing.T) {
		out, _ := asUser("-rundir", rundir, "ls")
		assert.False(t, strings.HasPrefix(out, "no instances"),
			"a live instance this user may not enter is not 'no instances':\n%s", out)
	})
}

// The same on a live instance that has registered nothing yet (a primary
// just started, before its first pool): its dump must not carry nulls
// either.
func TestBreaker5DumpJSONOfAFreshLiveInstanceHasNoNull(t *testing.T) {
	b := testenv.Tmpfs(t)
	rundir := testenv.RunDir(t)
	_, cfg := startPrimary(t, b, rundir)
	for _, cmd := range []string{"dump", "stats"} {
		out, stderr, status := tool(t, "-json", "-rundir", rundir, cmd, cfg.Prefix)
		require.Zero(t, status, stderr)
		var v any
		require.NoError(t, json.Unmarshal([]byte(out), &v))
		walkJSON("", v, func(path, k string) {}, func(path string, x any) {
			assert.NotNil(t, x, "mpmr %s -json of a fresh live instance: %s is null", cmd, path)
		})
	}
}

// A name in a shared runtime directory that links into a directory the
// tool's user may not search (anyone can plant one in /tmp) is a
// permission problem, said as such, for every command that opens an
// instance: not a crash, not "no instance".
func TestToolNamesALinkIntoAPrivateDirectory(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("running the tool as another user needs root")
	}
	rundir := testenv.RunDir(t)
	require.NoError(t, os.Chmod(rundir, 0o755))
	secret := t.TempDir()
	require.NoError(t, os.Chmod(secret, 0o700))
	require.NoError(t, os.Mkdir(filepath.Join(secret, "x"), 0o755))
	link := filepath.Join(rundir, "planted")
	require.NoError(t, os.Symlink(filepath.Join(secret, "x"), link))
	for _, c := range []string{"dump", "stats", "clean"} {
		t.Run(c, func(t *testing.T) {
			cmd := testproc.Command(context.Background(), "breaker5-tool",
				strconv.Itoa(breaker5ToolUID), "-rundir", rundir, c, "planted")
			out, _ := cmd.CombinedOutput()
			code := cmd.ProcessState.ExitCode()
			require.NotEqual(t, 99, code, "becoming uid %d:\n%s", breaker5ToolUID, out)
			assert.NotContains(t, string(out), "panic", "%s", out)
			assert.NotZero(t, code, "%s", out)
			assert.Contains(t, string(out), "permission", "a permission problem is named as such:\n%s", out)
			assert.Contains(t, string(out), link, "with the path")
		})
	}
}

// lifeHeld says "not held" only for what is no primary's life file (no
// file, a link, a FIFO, a file others could hold); a path it cannot look
// at is an error, which makes clean refuse instead of removing a live
// primary's files.
func TestLifeHeldRefusesToGuess(t *testing.T) {
	dir := t.TempDir()
	me := os.Geteuid()
	file := filepath.Join(dir, "life")
	require.NoError(t, os.WriteFile(file, nil, ofd.PrivateMode))
	require.NoError(t, os.Chmod(file, ofd.PrivateMode))
	require.NoError(t, os.Symlink(file, filepath.Join(dir, "link")))
	require.NoError(t, syscall.Mkfifo(filepath.Join(dir, "fifo"), 0o600))
	for _, name := range []string{"missing", "link", "fifo", "life"} {
		held, err := lifeHeld(filepath.Join(dir, name), me)
		assert.NoError(t, err, name)
		assert.False(t, held, name)
	}
	f, err := os.OpenFile(file, os.O_WRONLY, 0)
	require.NoError(t, err)
	defer f.Close()
	require.NoError(t, ofd.TryLock(f, 0, true))
	held, err := lifeHeld(file, me)
	require.NoError(t, err)
	assert.True(t, held, "a file whose lock a live description holds")
	held, err = lifeHeld(file, me+1)
	require.NoError(t, err)
	assert.False(t, held, "another user's file is no life file of this one")
	_, err = lifeHeld(filepath.Join(dir, strings.Repeat("n", 300)), me)
	assert.Error(t, err, "a name it cannot look at is not 'not held'")

	// Locked, but a file others could have held: open to them, one its
	// owner may read (and so may have handed on), or with data.
	for _, spoil := range []func() error{
		func() error { return os.Chmod(file, 0o644) },
		func() error { return os.Chmod(file, 0o600) },
		func() error { _, err := f.Write([]byte("x")); return err },
	} {
		require.NoError(t, os.Chmod(file, ofd.PrivateMode))
		require.NoError(t, f.Truncate(0))
		require.NoError(t, spoil())
		held, err := lifeHeld(file, me)
		require.NoError(t, err)
		assert.False(t, held)
	}
}
