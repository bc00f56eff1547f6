// Package futex wraps the Linux futex system call for words in shared
// memory.
//
// The operations use shared futexes (no FUTEX_PRIVATE_FLAG): the kernel keys
// the wait queue on the backing file page, so a waiter in one process is
// woken by a waker in another process that maps the same file. EINTR and
// EAGAIN are handled here: both mean "look at the word again", which is what
// every caller has to do after any return anyway.
package futex

import (
	"errors"
	"os"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

const (
	opWait = 0 // FUTEX_WAIT
	opWake = 1 // FUTEX_WAKE
)

// ErrTimeout is returned by Wait when the timeout elapsed before a wake-up.
var ErrTimeout = errors.New("futex: wait timed out")

// Wait sleeps while *addr == val, for at most timeout (forever when timeout
// is negative). It returns nil when the caller should look at the word again:
// after a wake-up, a changed value, an interrupted sleep or a spurious
// wake-up. It returns ErrTimeout when the timeout elapsed, and any other
// error (EFAULT, EINVAL) wrapped.
//
// Wait enters the Go scheduler's blocking-syscall path, so a sleeping waiter
// does not hold a P.
func Wait(addr *uint32, val uint32, timeout time.Duration) error {
	var tsp unsafe.Pointer
	var ts unix.Timespec
	if timeout >= 0 {
		ts = unix.NsecToTimespec(int64(timeout))
		tsp = unsafe.Pointer(&ts)
	}
	_, _, e := unix.Syscall6(unix.SYS_FUTEX, uintptr(unsafe.Pointer(addr)), opWait,
		uintptr(val), uintptr(tsp), 0, 0)
	switch e {
	case 0, unix.EAGAIN, unix.EINTR:
		return nil
	case unix.ETIMEDOUT:
		return ErrTimeout
	default:
		return os.NewSyscallError("futex wait", e)
	}
}

// Wake wakes at most n waiters sleeping on addr, in any process, and
// returns how many were woken. Waking never blocks, so it uses the raw
// system call.
func Wake(addr *uint32, n int) (int, error) {
	r, _, e := unix.RawSyscall6(unix.SYS_FUTEX, uintptr(unsafe.Pointer(addr)), opWake,
		uintptr(n), 0, 0, 0)
	if e != 0 {
		return 0, os.NewSyscallError("futex wake", e)
	}
	return int(r), nil
}
