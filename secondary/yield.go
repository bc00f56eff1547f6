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
// on a CPU that a poller keeps busy may otherwise wait for the poller's
// time slice to end, milliseconds.
//
// It is not free. With nobody waiting it took 5–10 µs on a 2-vCPU virtual
// machine (the system call alone about 2 µs there), and 20–30 µs from a
// goroutine locked to its thread (Queue.BindCPU), whose runtime.Gosched
// hands its P to another thread and takes it back; with a thread waiting,
// it lasts as long as the kernel lets that thread run. Call it every few
// hundred microseconds of work, not for each packet.
func Yield() {
	runtime.Gosched()
	_, _, _ = unix.Syscall(unix.SYS_SCHED_YIELD, 0, 0, 0) // cannot fail on Linux
}
