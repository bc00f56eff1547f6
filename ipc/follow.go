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

// Follow asks that p's call lane wait for its requests on cpu: its thread
// is bound to that CPU before it waits for the next request (a handler
// that runs off the lane may ask after that wait began: then before the
// one after). A negative cpu lets the thread run where it could before.
// A CPU the thread could not use before it was bound is ignored until a
// request names none, and so is a peer without a lane. A bound lane does
// not poll (ServerConfig.Spin): it would poll on the CPU each answer hands
// back to its caller.
//
// The lane's thread answers all of the peer's inline requests, from any
// of its threads, wherever it is bound; one that is bound to a CPU
// something else keeps busy waits for its turn there, and so do the locks
// its handler holds. Follow only the CPUs of peers trusted to name them.
func (p *Peer) Follow(cpu int) {
	switch {
	case cpu < 0:
		p.follow.Store(0)
	case cpu < cpuSetSize:
		p.follow.Store(int32(cpu) + 1)
	}
}

// cpuSetSize is how many CPUs a unix.CPUSet can name.
const cpuSetSize = len(unix.CPUSet{}) * 64

// laneCPU keeps a lane thread's binding. While bound, the lane's goroutine
// is locked to its thread (binding an unlocked thread would bind whatever
// goroutine ran on it next), so that the thread ends with the goroutine if
// the lane ends bound; unbound, the thread has its CPUs back and returns
// to the runtime.
type laneCPU struct {
	bound   int32       // as Peer.follow: 0 unbound, else the CPU + 1
	ignored int32       // the last CPU + 1 asked for that home does not hold
	home    unix.CPUSet // the thread's CPUs before it was bound
	locked  bool        // the goroutine is locked to its thread
}

// apply binds or unbinds the calling thread as p asked, if it asked for a
// change. A binding the kernel refuses (the CPU went offline, say) is
// tried again at the next request.
func (l *laneCPU) apply(p *Peer) {
	want := p.follow.Load()
	if want == 0 {
		// A CPU ignored before may be usable by the next binding (back
		// online, a wider cpuset): ask again then.
		l.ignored = 0
		if l.bound != 0 {
			l.unbind()
		}
		return
	}
	if want == l.bound || want == l.ignored {
		return
	}
	if !l.locked {
		runtime.LockOSThread()
		if err := unix.SchedGetaffinity(0, &l.home); err != nil {
			runtime.UnlockOSThread()
			return
		}
		l.locked = true
	}
	cpu := int(want - 1)
	if !l.home.IsSet(cpu) {
		l.ignored = want
		if l.bound == 0 {
			l.unbind()
		}
		return
	}
	var one unix.CPUSet
	one.Set(cpu)
	if err := unix.SchedSetaffinity(0, &one); err != nil {
		p.srv.log.Debug("ipc: lane cannot follow its caller", "peer", p.id, "cpu", cpu, "err", err)
		if l.bound == 0 {
			l.unbind()
		}
		return
	}
	l.bound, l.ignored = want, 0
}

// unbind gives the thread its CPUs back and unlocks it. If the kernel
// refuses, the thread stays as it is, locked, until the next request.
func (l *laneCPU) unbind() {
	if l.locked {
		if l.bound != 0 && unix.SchedSetaffinity(0, &l.home) != nil {
			return
		}
		runtime.UnlockOSThread()
		l.locked = false
	}
	l.bound = 0
}
