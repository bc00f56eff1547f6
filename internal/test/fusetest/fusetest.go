// Package fusetest mounts a FUSE file system served by a helper process,
// which a test stops (SIGSTOP) to stand in for a file system that does not
// answer: a hung network mount, a FUSE server stopped or in a debugger.
// It needs root and /dev/fuse.
package fusetest

import (
	"fmt"
	"os"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/internal/test/testproc"
)

// FUSE protocol numbers (linux/fuse.h).
const (
	OpForget       = 2
	OpGetattr      = 3
	OpRelease      = 18
	OpInit         = 26
	OpOpendir      = 27
	OpReleasedir   = 29
	OpInterrupt    = 36
	OpDestroy      = 38
	OpBatchForget  = 42
	replyHeaderLen = 16
)

// Helper is the server: it mounts a FUSE file system at args[0] and serves
// an empty root directory whose attributes are never cached, so that
// every stat under it asks this process. It says "ready" once mounted;
// when its input ends it unmounts. Register it with testproc under a name
// of the test binary's choosing, and give Mount that name.
func Helper(args []string) int { return Serve(args, serveEmpty) }

// Serve is Helper with another server: serve answers the requests read
// from the FUSE device fd (see Reply and the encoding helpers).
func Serve(args []string, serve func(fd int)) int {
	dev, err := os.OpenFile("/dev/fuse", os.O_RDWR, 0)
	if err != nil {
		testproc.Say("mount-failed %v", err)
		return 3
	}
	opts := fmt.Sprintf("fd=%d,rootmode=40000,user_id=0,group_id=0,allow_other", dev.Fd())
	if err := syscall.Mount("fusetest", args[0], "fuse", syscall.MS_NOSUID|syscall.MS_NODEV, opts); err != nil {
		testproc.Say("mount-failed %v", err)
		return 3
	}
	go serve(int(dev.Fd()))
	testproc.Say("ready")
	testproc.EachCommand(func(testproc.Line) {})
	_ = syscall.Unmount(args[0], syscall.MNT_DETACH)
	return 0
}

// Mount mounts Helper's file system, started as the helper the test
// binary registered as name (with env added to its environment), on a
// fresh directory, and returns the directory and the server. The file
// system is unmounted at cleanup, after the server has ended. It skips
// the test without root or /dev/fuse.
func Mount(t *testing.T, name string, env ...string) (string, *testproc.Proc) {
	t.Helper()
	dir := t.TempDir()
	return dir, MountAt(t, dir, name, env...)
}

// MountAt is Mount on the directory dir, which must exist.
func MountAt(t *testing.T, dir, name string, env ...string) *testproc.Proc {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: to mount a FUSE file system")
	}
	if _, err := os.Stat("/dev/fuse"); err != nil {
		t.Skipf("a FUSE file system stands in for a hung one here, and this machine has no /dev/fuse: %v", err)
	}
	t.Cleanup(func() { _ = syscall.Unmount(dir, syscall.MNT_DETACH) })
	fuse := testproc.Start(t, name, []string{dir}, env...)
	line := fuse.Expect("", 0)
	require.Equal(t, "ready", line, "the FUSE server: %s", fuse.Stderr())
	var st syscall.Stat_t
	require.NoError(t, syscall.Stat(dir, &st), "the FUSE server answers")
	return fuse
}

// LE appends the little-endian encoding of each of v (uint16, uint32,
// uint64) to b.
func LE(b []byte, v ...any) []byte {
	for _, x := range v {
		switch x := x.(type) {
		case uint16:
			b = append(b, byte(x), byte(x>>8))
		case uint32:
			b = append(b, byte(x), byte(x>>8), byte(x>>16), byte(x>>24))
		case uint64:
			for i := range 8 {
				b = append(b, byte(x>>(8*i)))
			}
		}
	}
	return b
}

// U32 and U64 decode little-endian words.
func U32(b []byte) uint32 {
	return uint32(b[0]) | uint32(b[1])<<8 | uint32(b[2])<<16 | uint32(b[3])<<24
}

// U64 decodes a little-endian 64-bit word.
func U64(b []byte) uint64 { return uint64(U32(b)) | uint64(U32(b[4:]))<<32 }

// InitReply is the body of the answer to FUSE_INIT request req (the whole
// request, header included).
func InitReply(req []byte) []byte {
	maxRA := U32(req[40+8:])
	body := LE(nil, uint32(7), uint32(31), maxRA, uint32(0), uint16(16), uint16(12), uint32(1<<20), uint32(1),
		uint16(0), uint16(0), uint32(0), uint32(0))
	return append(body, make([]byte, 64-len(body))...)
}

// Reply writes the answer to the request with id unique.
func Reply(fd int, unique uint64, errno int32, body []byte) {
	out := LE(nil, uint32(replyHeaderLen+len(body)), uint32(errno), unique)
	_, _ = syscall.Write(fd, append(out, body...))
}

func serveEmpty(fd int) {
	buf := make([]byte, 1<<20+4096)
	for {
		n, err := syscall.Read(fd, buf)
		if err == syscall.EINTR || err == syscall.ENOENT || err == syscall.EAGAIN {
			continue
		}
		if err != nil || n < 40 {
			return
		}
		op, unique := U32(buf[4:]), U64(buf[8:])
		reply := func(errno int32, body []byte) { Reply(fd, unique, errno, body) }
		switch op {
		case OpForget, OpBatchForget, OpInterrupt:
		case OpInit:
			reply(0, InitReply(buf[:n]))
		case OpGetattr:
			// attr_valid 0: never cached.
			body := LE(nil, uint64(0), uint32(0), uint32(0))
			body = LE(body, uint64(1), uint64(0), uint64(0), uint64(0), uint64(0), uint64(0), // ino size blocks a/m/ctime
				uint32(0), uint32(0), uint32(0), uint32(syscall.S_IFDIR|0o755), uint32(2), // nsecs, mode, nlink
				uint32(0), uint32(0), uint32(0), uint32(4096), uint32(0)) // uid gid rdev blksize flags
			reply(0, body)
		case OpOpendir:
			reply(0, LE(nil, uint64(1), uint32(0), uint32(0)))
		case OpReleasedir, OpRelease:
			reply(0, nil)
		case OpDestroy:
			reply(0, nil)
			return
		default:
			reply(-int32(syscall.ENOSYS), nil)
		}
	}
}
