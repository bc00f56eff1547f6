package main

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/mpmr/mpmr/internal/instance"
	"github.com/mpmr/mpmr/internal/sys/ofd"
	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/ipc"
)

// The local user who squats the operator's runtime directory.
const breakerSquatterUID = 44202

// squattedInstance lays out what a squatter can make before the operator
// (root here) runs mpmr on -rundir: the runtime directory (/tmp/mrt in
// the README's examples) and an instance directory in it, both the
// squatter's, with an instance.json and a primary.lock of the squatter's
// choosing. It returns the -rundir and the instance directory.
func squattedInstance(t *testing.T, prefix string, info instance.Info, lock func(path string)) (string, string) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: to give files to another user")
	}
	tmp := t.TempDir()
	require.NoError(t, os.Chmod(filepath.Dir(tmp), 0o755))
	require.NoError(t, os.Chmod(tmp, os.ModeSticky|0o777)) // like /tmp
	rundir := filepath.Join(tmp, "mrt")
	dir := filepath.Join(rundir, prefix)
	require.NoError(t, os.MkdirAll(dir, 0o755))
	b, err := json.Marshal(info)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(dir, instance.InfoFile), b, 0o644))
	lock(filepath.Join(dir, instance.PrimaryLockFile))
	for _, p := range []string{rundir, dir, filepath.Join(dir, instance.InfoFile), filepath.Join(dir, instance.PrimaryLockFile)} {
		require.NoError(t, os.Lchown(p, breakerSquatterUID, breakerSquatterUID))
	}
	return rundir, dir
}

// rootOnly returns a directory only root may enter, like /etc/ssl/private.
func rootOnly(t *testing.T) string {
	t.Helper()
	d := t.TempDir()
	require.NoError(t, os.Chmod(d, 0o700))
	return d
}

// The runtimes refuse a runtime directory another user could have made
// (README, Robustness: "another user who pre-creates /tmp/mpmr-UID gets the
// primary refused instead of hosting it"), and open files in it without
// following links. The operator's tool does neither: it reads, dials,
// maps and creates whatever a squatter's directory names, with the
// operator's privileges.
func TestBreakerToolTrustsASquattedRuntimeDirectory(t *testing.T) {
	t.Run("clean creates a file through the squatter's symlink", func(t *testing.T) {
		target := filepath.Join(rootOnly(t), "nologin")
		prefix := testenv.Prefix(t)
		rundir, _ := squattedInstance(t, prefix, instance.Info{Prefix: prefix, PID: 1},
			func(lock string) { require.NoError(t, os.Symlink(target, lock)) })

		out, errOut, status := tool(t, "-rundir", rundir, "clean", prefix)
		_, err := os.Lstat(target)
		assert.ErrorIs(t, err, os.ErrNotExist,
			"mpmr clean, run by root, created %s through the squatter's primary.lock symlink (status %d)\n%s%s",
			target, status, out, errOut)
		assert.NotEqual(t, 0, status, "clean went ahead in another user's runtime directory:\n%s", out)
		assert.Contains(t, errOut, ipc.ErrPermission.Error())
	})

	t.Run("stats dials the socket the squatter names", func(t *testing.T) {
		// A root-only service's socket, out of the squatter's reach.
		svc := filepath.Join(rootOnly(t), "svc.sock")
		l, err := unix.Socket(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC|unix.SOCK_NONBLOCK, 0)
		require.NoError(t, err)
		defer unix.Close(l)
		require.NoError(t, unix.Bind(l, &unix.SockaddrUnix{Name: svc}))
		require.NoError(t, unix.Listen(l, 8))
		prefix := testenv.Prefix(t)
		var held *os.File
		rundir, _ := squattedInstance(t, prefix, instance.Info{Prefix: prefix, PID: 1, Socket: svc},
			func(lock string) {
				// The squatter's process holds its lock: the instance looks live.
				var err error
				held, err = os.OpenFile(lock, os.O_RDWR|os.O_CREATE, 0o644)
				require.NoError(t, err)
				require.NoError(t, ofd.TryLock(held, 0, true))
			})
		defer held.Close()

		out, errOut, status := tool(t, "-rundir", rundir, "stats", "-timeout", "300ms", prefix)
		// A connection the tool made waits to be accepted, whether or not
		// it is still open.
		if c, _, err := unix.Accept4(l, unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC); err == nil {
			unix.Close(c)
			t.Errorf("mpmr stats, run by root, connected to %s because the squatter's instance.json said so "+
				"(status %d)\n%s%s", svc, status, out, errOut)
		} else {
			require.ErrorIs(t, err, unix.EAGAIN, "accept")
		}
		assert.Contains(t, out+errOut, ipc.ErrPermission.Error())
	})

	t.Run("dump prints the bytes of a file the squatter names", func(t *testing.T) {
		secret := filepath.Join(rootOnly(t), "shadow")
		content := []byte("root:$6$s3cr3t!:19000:0:99999:7:::\n")
		require.NoError(t, os.WriteFile(secret, append(content, make([]byte, 8192)...), 0o600))
		prefix := testenv.Prefix(t)
		rundir, _ := squattedInstance(t, prefix, instance.Info{Prefix: prefix, PID: 1, Segment: secret},
			func(lock string) { require.NoError(t, os.WriteFile(lock, nil, 0o644)) })

		out, errOut, _ := tool(t, "-rundir", rundir, "dump", prefix)
		all := out + errOut
		// The header's first word, as "bad magic 0x%016x" prints it.
		leaked := fmt.Sprintf("%016x", binary.LittleEndian.Uint64(content[:8]))
		assert.NotContains(t, all, leaked,
			"mpmr dump, run by root, mapped %s (named by the squatter) and printed its first bytes %q", secret, content[:8])
		assert.Contains(t, all, ipc.ErrPermission.Error())
	})

	t.Run("ls follows the squatter's symlinks", func(t *testing.T) {
		secret := filepath.Join(rootOnly(t), "token")
		require.NoError(t, os.WriteFile(secret, []byte("Xs3cr3t"), 0o600))
		prefix := testenv.Prefix(t)
		rundir, dir := squattedInstance(t, prefix, instance.Info{Prefix: prefix, PID: 1},
			func(lock string) { require.NoError(t, os.WriteFile(lock, nil, 0o644)) })
		info := filepath.Join(dir, instance.InfoFile)
		require.NoError(t, os.Remove(info))
		require.NoError(t, os.Symlink(secret, info))
		require.NoError(t, os.Lchown(info, breakerSquatterUID, breakerSquatterUID))

		out, errOut, _ := tool(t, "-rundir", rundir, "ls")
		all := out + errOut
		assert.NotContains(t, all, "'X'", "mpmr ls, run by root, read %s through the squatter's symlink "+
			"and printed its first byte:\n%s", secret, all)
		assert.True(t, strings.Contains(all, ipc.ErrPermission.Error()) || !strings.Contains(all, prefix),
			"ls lists the squatter's instance as one of this user's:\n%s", all)
	})
}

// Backend directories are shared by every user: once a dead instance's
// segment is gone, anyone may put a file under its name (here: the dead
// primary's own bytes, given to another user, as a forger would copy them
// out of a dump). The runtimes refuse a segment that is not their user's
// (secondary: "is not a regular file of the primary's uid"; clean: "only
// if it is a regular file of the instance's user"), but dump, ls and stats
// map it and show what it says as this instance's state.
func TestBreakerToolShowsAnotherUsersSegmentAsTheInstances(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: to give files to another user")
	}
	b := testenv.Tmpfs(t)
	rundir := testenv.RunDir(t)
	h, prefix := startDeadable(t, b, rundir)
	var addr uint64
	_, err := fmt.Sscanf(h.ask("alloc 2"), "region %d", &addr)
	require.NoError(t, err)
	parseKey(t, h.ask("mr %d", addr))
	h.kill()
	seg := instance.SegmentPath(b.Dir, instanceName(rundir, prefix))
	require.NoError(t, os.Chown(seg, breakerSquatterUID, breakerSquatterUID))

	out, errOut, status := tool(t, "-rundir", rundir, "dump", prefix)
	assert.NotEqual(t, 0, status, "dump showed uid %d's file %s as the instance's segment:\n%s",
		breakerSquatterUID, seg, firstLines(out, 12))
	assert.Contains(t, out+errOut, ipc.ErrPermission.Error())

	out, errOut, _ = tool(t, "-rundir", rundir, "ls")
	assert.Contains(t, out+errOut, ipc.ErrPermission.Error(), "ls says nothing of the segment's owner:\n%s", out)
}

func firstLines(s string, n int) string {
	l := strings.SplitN(s, "\n", n+1)
	return strings.Join(l[:min(n, len(l))], "\n")
}
