package ipc

import (
	"runtime"

	"golang.org/x/sys/unix"
)

// A call answered on the caller's CPU.
//
// The kernel wakes a thread on an idle CPU when it can, and on a VM a CPU
// that idles takes longest of anything in a round trip to wake. A caller
// bound to one CPU (a datapath thread, as DPDK binds its lcores) blocks
// there while it waits: if the peer's lane thread is bound to that CPU
// too, the request hands the CPU to the lane thread, and the answer hands
// it back, and no other CPU is woken on either way. Peer.Follow asks for
// that binding; serveLane applies it between requests.

// Follow asks that p's call lane wait for its requests on cpu from its next
// request on: its thread is bound to that CPU once the current answer has
// gone. A handler calls it for a request whose caller says it is bound to
// cpu; a negative cpu (the caller is bound to none) lets the thread run
// anywhere the server's process may again. A CPU the process could not use
// when the server was made is ignored, and so is a peer without a lane.
func (p *Peer) Follow(cpu int) {
	if cpu >= 0 && (cpu >= cpuSetSize || !p.srv.cpus.IsSet(cpu)) {
		return
	}
	p.follow.Store(int32(max(cpu, -1)) + 1)
}

// cpuSetSize is how many CPUs a unix.CPUSet can name.
const cpuSetSize = len(unix.CPUSet{}) * 64

// laneCPU keeps a lane thread's binding: where it is, and whether the
// goroutine is locked to its thread (binding an unlocked thread would bind
// whatever goroutine ran on it next).
type laneCPU struct {
	bound  int32 // as Peer.follow: 0 unbound, else the CPU + 1
	locked bool
}

// apply binds the calling thread as p asked, if it asked for a change. A
// binding the kernel refuses (the CPU went offline, say) is dropped.
func (l *laneCPU) apply(p *Peer) {
	want := p.follow.Load()
	if want == l.bound {
		return
	}
	if !l.locked {
		// For good: the thread ends with the lane's goroutine, and its
		// binding with it.
		runtime.LockOSThread()
		l.locked = true
	}
	set := p.srv.cpus
	if want > 0 {
		set.Zero()
		set.Set(int(want - 1))
	}
	if err := unix.SchedSetaffinity(0, &set); err != nil {
		p.srv.log.Debug("ipc: lane cannot follow its caller", "peer", p.id, "cpu", want-1, "err", err)
		p.follow.CompareAndSwap(want, 0)
		want = 0
		if unix.SchedSetaffinity(0, &p.srv.cpus) != nil {
			return // bound as before: try again at the next change
		}
	}
	l.bound = want
}
