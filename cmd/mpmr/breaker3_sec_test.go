package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/instance"
	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/ipc"
)

// The local user who plants files in /dev/shm.
const b3secUID = 44203

// b3secToolBounded runs mpmr with args and reports whether it returned within
// bound. If it did not, unblock is called until it does (so the test
// leaves no goroutine behind), and ok is false.
func b3secToolBounded(t *testing.T, bound time.Duration, unblock func(), args ...string) (out, errOut string, status int, ok bool) {
	t.Helper()
	type result struct {
		out, errOut string
		status      int
	}
	done := make(chan result, 1)
	go func() {
		o, e, s := tool(t, args...)
		done <- result{o, e, s}
	}()
	select {
	case r := <-done:
		return r.out, r.errOut, r.status, true
	case <-time.After(bound):
	}
	for {
		unblock()
		select {
		case r := <-done:
			return r.out, r.errOut, r.status, false
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// b3secPlantFIFO makes a FIFO of another user at path, as anyone may in
// /dev/shm (mode 1777), and returns what lets a reader blocked opening
// it go on: opening it for writing, then closing it.
func b3secPlantFIFO(t *testing.T, path string) func() {
	t.Helper()
	require.NoError(t, syscall.Mkfifo(path, 0o666))
	t.Cleanup(func() { os.Remove(path) })
	require.NoError(t, os.Lchown(path, b3secUID, b3secUID))
	return func() {
		if fd, err := syscall.Open(path, syscall.O_WRONLY|syscall.O_NONBLOCK, 0); err == nil {
			syscall.Close(fd)
		}
	}
}

// The runtimes open every file another user could have planted with
// O_NONBLOCK ("O_NONBLOCK only kept a FIFO from hanging the open",
// ipc.RunDir.OpenFile; ofd.ClaimFile), and refuse what is not a regular
// file of the instance's user. The operator tool opens the control
// segment's name in the backend directory (/dev/shm, writable by
// everyone) with a plain blocking open: a FIFO that another user
// planted there under the instance's predictable name
// (mpmr.PREFIX.uUID.HASH.ctl) hangs "mpmr ls", "dump", "stats" and
// "clean" run by the operator, forever, instead of the ErrPermission
// refusal the README promises for a file of another user.
func TestBreaker3SecToolHangsOnAFIFOAtTheSegmentName(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: to give a file to another user")
	}
	b := testenv.Tmpfs(t)
	for _, cmd := range []string{"ls", "dump", "stats", "clean"} {
		t.Run(cmd, func(t *testing.T) {
			rundir := testenv.RunDir(t)
			prefix := testenv.Prefix(t)
			dir := filepath.Join(rundir, prefix)
			require.NoError(t, os.MkdirAll(dir, 0o700))
			// This user's instance whose primary died after describing
			// itself and before its segment was made (or whose segment
			// is gone): the name is free in /dev/shm.
			info := instance.Info{Prefix: prefix, PID: 1, Backend: hugetlb.Tmpfs.String(), BackendDir: b.Dir,
				Segment: instance.SegmentPath(b.Dir, instanceName(rundir, prefix))}
			js, err := json.Marshal(info)
			require.NoError(t, err)
			require.NoError(t, os.WriteFile(filepath.Join(dir, instance.InfoFile), js, 0o600))
			require.NoError(t, os.WriteFile(filepath.Join(dir, instance.PrimaryLockFile), nil, 0o600))
			unblock := b3secPlantFIFO(t, info.Segment)

			args := []string{"-rundir", rundir, cmd}
			if cmd != "ls" {
				args = append(args, prefix)
			}
			out, errOut, status, ok := b3secToolBounded(t, 5*time.Second, unblock, args...)
			if !ok {
				t.Fatalf("mpmr %s, run by root, hung for 5 s opening the FIFO that uid %d planted at %s "+
					"(it returned only once the test opened the FIFO for writing; status %d)\n%s%s",
					cmd, b3secUID, info.Segment, status, out, errOut)
			}
			t.Logf("mpmr %s returned in time (status %d):\n%s%s", cmd, status, out, errOut)
			if cmd == "clean" {
				// clean leaves another user's file alone, and says so.
				assert.Contains(t, out+errOut, "left alone")
				fi, err := os.Lstat(info.Segment)
				require.NoError(t, err, "the planted FIFO")
				assert.Equal(t, os.ModeNamedPipe, fi.Mode().Type(), "the planted FIFO")
			} else {
				// The others refuse the file as another user's.
				assert.Contains(t, out+errOut, ipc.ErrPermission.Error())
			}
			if cmd == "dump" || cmd == "stats" {
				assert.NotZero(t, status, "mpmr %s of a segment it refused", cmd)
			}
		})
	}
}
