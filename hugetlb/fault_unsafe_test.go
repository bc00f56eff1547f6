package hugetlb_test

import (
	"fmt"
	"unsafe"

	"golang.org/x/sys/unix"
)

// kernelSigaction is struct sigaction as rt_sigaction(2) takes it on
// linux/amd64.
type kernelSigaction struct {
	handler  uintptr
	flags    uint64
	restorer uintptr
	mask     uint64
}

// dieOnFault restores the default action for SIGSEGV, so that touching an
// inaccessible address kills this process with SIGSEGV, as it would a C
// program. Left alone, the Go runtime catches the signal and exits with
// status 2 after printing "unexpected fault address", which would make the
// test depend on the runtime's wording. Core dumps are turned off first.
// Only a helper process about to touch memory on purpose calls it.
func dieOnFault() error {
	if err := unix.Prctl(unix.PR_SET_DUMPABLE, 0, 0, 0, 0); err != nil {
		return fmt.Errorf("prctl(PR_SET_DUMPABLE): %w", err)
	}
	var dfl kernelSigaction // SIG_DFL, no flags
	_, _, e := unix.RawSyscall6(unix.SYS_RT_SIGACTION, uintptr(unix.SIGSEGV), uintptr(unsafe.Pointer(&dfl)), 0,
		unsafe.Sizeof(dfl.mask), 0, 0)
	if e != 0 {
		return fmt.Errorf("rt_sigaction(SIGSEGV, SIG_DFL): %w", e)
	}
	return nil
}
