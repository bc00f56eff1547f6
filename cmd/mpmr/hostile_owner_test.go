package main

import (
	"encoding/json"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sync/atomic"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/instance"
	"github.com/mpmr/mpmr/internal/sys/ofd"
	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/ipc"
)

// The instance's own user, hostile, against the operator (root) who runs
// the tool on that user's instance: whatever that user put in the
// runtime directory or under the instance's names, the tool must not
// follow, open, dial or remove anything else with root's rights.
const hostileOwnerUID = 44204

// hostileInstance lays out a dead instance of hostileOwnerUID, as that
// user could: its runtime directory, a description and a primary lock,
// and a control segment made by a primary that died while starting. It
// returns the -rundir, the instance's directory, its prefix and the
// segment's path.
func hostileInstance(t *testing.T) (rundir, dir, prefix, seg string) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: to give files to another user")
	}
	b := testenv.Tmpfs(t)
	rundir = filepath.Join(t.TempDir(), "run")
	prefix = testenv.Prefix(t)
	dir = filepath.Join(rundir, prefix)
	require.NoError(t, os.MkdirAll(dir, 0o700))
	seg = instance.SegmentPath(b.Dir, instance.Name(prefix, hostileOwnerUID, dir))
	lock := filepath.Join(t.TempDir(), "slots.lock")
	h := testproc.Start(t, "segment", []string{seg, lock})
	h.Expect("created", 0)
	require.NoError(t, h.Wait(0))
	t.Cleanup(func() { os.Remove(seg) })
	info := instance.Info{Prefix: prefix, PID: 1, Backend: hugetlb.Tmpfs.String(), BackendDir: b.Dir, Segment: seg}
	js, err := json.Marshal(info)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(dir, instance.InfoFile), js, 0o600))
	require.NoError(t, os.WriteFile(filepath.Join(dir, instance.PrimaryLockFile), nil, 0o600))
	for _, p := range []string{rundir, dir, filepath.Join(dir, instance.InfoFile), filepath.Join(dir, instance.PrimaryLockFile), seg} {
		require.NoError(t, os.Lchown(p, hostileOwnerUID, hostileOwnerUID))
	}
	return rundir, dir, prefix, seg
}

// looksLive holds the primary lock of the instance in dir, as its live
// primary would, until the test ends.
func looksLive(t *testing.T, dir string) {
	t.Helper()
	held, err := os.OpenFile(filepath.Join(dir, instance.PrimaryLockFile), os.O_RDWR, 0)
	require.NoError(t, err)
	t.Cleanup(func() { held.Close() })
	require.NoError(t, ofd.TryLock(held, 0, true))
}

// countingSocket listens on a seqpacket socket at path (root's) until the
// test ends, and counts the connections made to it.
func countingSocket(t *testing.T, path string) *atomic.Int64 {
	t.Helper()
	l, err := net.Listen("unixpacket", path)
	require.NoError(t, err)
	t.Cleanup(func() { l.Close() })
	var dialled atomic.Int64
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			dialled.Add(1)
			c.Close()
		}
	}()
	return &dialled
}

// clean removes the segment's files only once it has proved them the
// instance user's and dead; the same holds for the lock file beside the
// segment, whatever is at its name.
func TestCleanRemovesNothingButTheInstanceUsersDeadFiles(t *testing.T) {
	for _, planted := range []struct {
		what  string
		plant func(t *testing.T, path string)
	}{
		{"a file of another user", func(t *testing.T, path string) {
			require.NoError(t, os.WriteFile(path, nil, 0o600))
			require.NoError(t, os.Lchown(path, hostileOwnerUID+1, hostileOwnerUID+1))
		}},
		{"a directory of root", func(t *testing.T, path string) { require.NoError(t, os.Mkdir(path, 0o755)) }},
		{"a file a live process holds locked", func(t *testing.T, path string) {
			f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
			require.NoError(t, err)
			t.Cleanup(func() { f.Close() })
			require.NoError(t, ofd.TryLock(f, 0, true))
			require.NoError(t, os.Lchown(path, hostileOwnerUID, hostileOwnerUID))
		}},
	} {
		t.Run(planted.what, func(t *testing.T) {
			rundir, _, prefix, seg := hostileInstance(t)
			lock := seg + ".lock"
			planted.plant(t, lock)
			t.Cleanup(func() { os.Remove(lock) })

			out, errOut, _ := tool(t, "-rundir", rundir, "clean", prefix)
			_, err := os.Lstat(lock)
			assert.NoError(t, err, "clean, run by root, removed %s at %s:\n%s%s", planted.what, lock, out, errOut)
			_, err = os.Lstat(seg)
			assert.ErrorIs(t, err, os.ErrNotExist, "the dead instance's segment is removed:\n%s%s", out, errOut)
		})
	}
}

// The slots' lock file is opened through the checked runtime directory,
// never through a link the instance's user put at its name: here one to a
// FIFO in a directory only root may enter, which a writer waits on.
func TestToolDoesNotFollowTheInstanceUsersLinkAtTheSlotsLock(t *testing.T) {
	rundir, dir, prefix, _ := hostileInstance(t)
	fifo := filepath.Join(rootOnly(t), "fifo")
	require.NoError(t, syscall.Mkfifo(fifo, 0o600))
	link := filepath.Join(dir, instance.SlotsLockFile)
	require.NoError(t, os.Symlink(fifo, link))
	require.NoError(t, os.Lchown(link, hostileOwnerUID, hostileOwnerUID))

	for _, cmd := range []string{"ls", "dump", "stats", "clean"} {
		t.Run(cmd, func(t *testing.T) {
			opened := make(chan struct{})
			go func() { // a writer waits until something opens the FIFO for reading
				if fd, err := syscall.Open(fifo, syscall.O_WRONLY, 0); err == nil {
					syscall.Close(fd)
				}
				close(opened)
			}()
			defer func() { // let the writer go if the tool did not
				if fd, err := syscall.Open(fifo, syscall.O_RDONLY|syscall.O_NONBLOCK, 0); err == nil {
					<-opened
					syscall.Close(fd)
				}
			}()
			args := []string{"-rundir", rundir, cmd}
			if cmd != "ls" {
				args = append(args, prefix)
			}
			out, errOut, _ := tool(t, args...)
			select {
			case <-opened:
				t.Errorf("mpmr %s, run by root, opened %s through uid %d's link %s:\n%s%s",
					cmd, fifo, hostileOwnerUID, link, out, errOut)
			default:
			}
		})
	}
}

// stats dials the socket it checked, not whatever the instance's user
// has put at its name by the time it dials: here the name keeps changing
// between a socket of that user and a link to a socket only root may
// reach.
func TestStatsDialsTheSocketItChecked(t *testing.T) {
	rundir, dir, prefix, _ := hostileInstance(t)
	looksLive(t, dir)
	// A socket only root may reach.
	private := filepath.Join(rootOnly(t), "svc.sock")
	dialled := countingSocket(t, private)
	// A socket of the instance's user, which the check passes.
	own := filepath.Join(dir, "own.sock")
	lo, err := net.Listen("unixpacket", own)
	require.NoError(t, err)
	defer lo.Close()
	require.NoError(t, os.Lchown(own, hostileOwnerUID, hostileOwnerUID))

	sock := filepath.Join(dir, ipc.SocketName)
	stop := make(chan struct{})
	swapped := make(chan struct{})
	go func() {
		defer close(swapped)
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			// The user's own swap: a second name for its socket, or a link
			// to root's, renamed over ipc.sock in turn.
			tmp := filepath.Join(dir, "tmp")
			if i%2 == 0 {
				_ = os.Link(own, tmp)
			} else {
				_ = os.Symlink(private, tmp)
				_ = os.Lchown(tmp, hostileOwnerUID, hostileOwnerUID)
			}
			_ = os.Rename(tmp, sock)
		}
	}()
	for range 60 {
		tool(t, "-rundir", rundir, "stats", "-timeout", "20ms", prefix)
	}
	close(stop)
	<-swapped
	assert.Zero(t, dialled.Load(), "mpmr stats, run by root, connected to %s through the link uid %d swapped in", private, hostileOwnerUID)
}

// Nor a second name the instance's user gave to a socket of root's (a
// hard link, where the system lets users link files they do not own):
// the primary runs as the instance's user, so only a socket of that user
// is dialled.
func TestStatsDoesNotDialRootsSocketLinkedIn(t *testing.T) {
	rundir, dir, prefix, _ := hostileInstance(t)
	looksLive(t, dir)
	public := filepath.Join(t.TempDir(), "svc.sock") // root's, in a directory anyone may search
	dialled := countingSocket(t, public)
	require.NoError(t, os.Link(public, filepath.Join(dir, ipc.SocketName)))

	out, errOut, _ := tool(t, "-rundir", rundir, "stats", "-timeout", "200ms", prefix)
	assert.Zero(t, dialled.Load(), "mpmr stats, run by root, connected to root's socket linked in by uid %d:\n%s%s",
		hostileOwnerUID, out, errOut)
	assert.Contains(t, out+errOut, ipc.ErrPermission.Error())
}

// Root's clean of a user's dead instance makes no file for that user: not
// in the backend directory the instance's description names, here one of
// root's (0755) that the user may not write, where a file made for the
// user would be the user's to open and fill (with hugepages, on
// hugetlbfs).
func TestRootsCleanMakesNoFileForTheInstancesUser(t *testing.T) {
	rundir, dir, prefix, seg := hostileInstance(t)
	target := filepath.Join(filepath.Dir(seg), "root-only-"+prefix)
	require.NoError(t, os.Mkdir(target, 0o755))
	t.Cleanup(func() { os.RemoveAll(target) })
	name := instance.Name(prefix, hostileOwnerUID, dir)
	moved := instance.SegmentPath(target, name)
	require.NoError(t, os.Rename(seg, moved), "a segment the user made there when it could")
	js, err := json.Marshal(instance.Info{Prefix: prefix, PID: 1, Backend: hugetlb.Tmpfs.String(), BackendDir: target, Segment: moved})
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(dir, instance.InfoFile), js, 0o600))
	life := instance.LifePath(target, name)
	var made []string
	t.Cleanup(ofd.SetBeforeLock(func() { // at every claim clean locks
		if fi, err := os.Stat(life); err == nil {
			made = append(made, fmt.Sprintf("owner uid %d, mode %04o", fi.Sys().(*syscall.Stat_t).Uid, fi.Mode().Perm()))
		}
	}))

	var got cleanOut
	toolJSON(t, &got, "-rundir", rundir, "clean", prefix)
	assert.Empty(t, made, "root's clean made %s in %s, a directory of root's", life, target)
	assert.NotContains(t, got.Removed, life, "clean removed a life file it made itself")
	assert.Contains(t, got.Removed, moved, "the dead instance's segment goes")
	assert.NoFileExists(t, life)
}
