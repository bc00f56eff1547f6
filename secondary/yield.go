package secondary

import (
	"runtime"

	"golang.org/x/sys/unix"
)

// Yield lets others use this CPU for a moment: the goroutines of this
// process that wait for a P (runtime.Gosched), then the threads of any
// process that the kernel has queued on this CPU (sched_yield(2)), such
// as the primary's thread woken to answer a miss, or the thread that
// carries an answer to another queue of this process. A queue that polls
// without blocking should call it between bursts of work: a thread woken
// on a CPU that a poller keeps busy otherwise waits for the poller's time
// slice to end, which takes milliseconds. With nobody waiting it costs a
// system call.
func Yield() {
	runtime.Gosched()
	_, _, _ = unix.Syscall(unix.SYS_SCHED_YIELD, 0, 0, 0) // cannot fail on Linux
}
