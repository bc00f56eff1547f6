package ipc

import (
	"bytes"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

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
// its handler holds. So the server watches its bound lanes, every 5 ms
// while it has any: a thread that has been answering one request since
// the last look, and waited to run for more than 1 ms of that time, is let
// go at once (it may run on the process's other CPUs for the rest of that
// request), and its lane follows that peer no more
// (ServerStats.StarvedLanes counts them, and a warning names the peer).
// A handler that waits, for a lock say, is not let go: only a thread that
// could run and did not. The watch is a goroutine, which needs a P: while
// as many lane threads as GOMAXPROCS are kept from their CPUs at once,
// each holding its P, it waits for one of them to run. Follow only the
// CPUs of peers trusted to name them and to keep them free meanwhile.
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
	if p.watch.letGo.Load() {
		want = 0
	}
	if want == 0 {
		// A CPU ignored before may be usable by the next binding (back
		// online, a wider cpuset): ask again then.
		l.ignored = 0
		if l.bound != 0 {
			l.unbind(p)
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
			l.unbind(p)
		}
		return
	}
	var one unix.CPUSet
	one.Set(cpu)
	if err := unix.SchedSetaffinity(0, &one); err != nil {
		p.srv.log.Debug("ipc: lane cannot follow its caller", "peer", p.id, "cpu", cpu, "err", err)
		if l.bound == 0 {
			l.unbind(p)
		}
		return
	}
	l.bound, l.ignored = want, 0
	p.watch.bound(p, unix.Gettid(), cpu, &l.home)
}

// unbind gives the thread its CPUs back and unlocks it. If the kernel
// refuses, the thread stays as it is, locked, until the next request.
func (l *laneCPU) unbind(p *Peer) {
	if l.locked {
		if l.bound != 0 {
			p.watch.unbound(p)
			if unix.SchedSetaffinity(0, &l.home) != nil {
				p.watch.bound(p, unix.Gettid(), int(l.bound-1), &l.home)
				return
			}
		}
		runtime.UnlockOSThread()
		l.locked = false
	}
	l.bound = 0
}

// laneCheckEvery is how often the server looks at its bound lanes, while
// it has any; laneStarved is how long a bound lane's thread may wait to
// run, between two looks at one request, before it is let go. A request
// normally takes microseconds: one that spans a look is already rare.
const (
	laneCheckEvery = 5 * time.Millisecond
	laneStarved    = time.Millisecond
)

// laneWatch is what the server's checker needs of a bound lane.
type laneWatch struct {
	// busy is odd while the lane's thread answers a request while bound.
	busy atomic.Uint64
	// letGo is set once the lane's thread was let go: it follows the peer
	// no more.
	letGo atomic.Bool

	mu   sync.Mutex
	tid  int         // the lane's thread while it is bound, else 0
	cpu  int         // the CPU it is bound to
	home unix.CPUSet // its CPUs before

	// The checker's own, from its last look.
	seen   uint64        // busy
	waited time.Duration // the thread's wait to run so far, -1 if unread
}

// bound records that the lane's thread tid is bound to cpu, having had
// home before, and has the server watch it.
func (w *laneWatch) bound(p *Peer, tid, cpu int, home *unix.CPUSet) {
	w.mu.Lock()
	w.tid, w.cpu, w.home = tid, cpu, *home
	w.mu.Unlock()
	p.srv.watchLane(p, true)
}

// unbound records that the lane's thread is no longer bound (or is about
// to end): the checker must not touch it from now on.
func (w *laneWatch) unbound(p *Peer) {
	w.mu.Lock()
	w.tid = 0
	w.mu.Unlock()
	p.srv.watchLane(p, false)
}

// look is the checker's look at p's lane: it lets the lane's thread go if
// it has answered the same request since the last look and waited to run
// for more than laneStarved meanwhile.
func (w *laneWatch) look(p *Peer) {
	busy := w.busy.Load()
	if busy%2 == 0 {
		w.seen = busy
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.tid == 0 || w.letGo.Load() {
		return
	}
	waited, err := runWait(w.tid)
	if err != nil || w.busy.Load() != busy {
		w.seen = 0
		return
	}
	if busy != w.seen || w.waited < 0 {
		w.seen, w.waited = busy, waited // a request not seen before: from now
		return
	}
	if waited-w.waited < laneStarved {
		w.waited = waited
		return
	}
	w.letGo.Store(true)
	wide := w.home
	wide.Clear(w.cpu)
	if wide.Count() > 0 {
		// Off the CPU it waits for: the kernel moves a thread that may
		// still run where it waits only when it gets round to it.
		if err := unix.SchedSetaffinity(w.tid, &wide); err != nil {
			p.srv.log.Warn("ipc: cannot let a starved lane thread go", "peer", p.id, "cpu", w.cpu, "err", err)
		}
	}
	p.srv.starvedLanes.Add(1)
	p.srv.log.Warn("ipc: a lane thread bound to the CPU its peer named could not run there; it follows that peer no more",
		"peer", p.id, "cpu", w.cpu, "waited", waited-w.waited)
}

// runWait returns how long thread tid of this process has waited to run,
// runnable, in all: the second field of its schedstat.
func runWait(tid int) (time.Duration, error) {
	b, err := os.ReadFile("/proc/self/task/" + strconv.Itoa(tid) + "/schedstat")
	if err != nil {
		return 0, err
	}
	f := bytes.Fields(b)
	if len(f) < 2 {
		return 0, fmt.Errorf("ipc: schedstat of thread %d: %q", tid, b)
	}
	ns, err := strconv.ParseInt(string(f[1]), 10, 64)
	return time.Duration(ns), err
}

// watchLane adds p to the lanes the checker looks at, or takes it out,
// and starts the checker when the first comes.
func (s *Server) watchLane(p *Peer, on bool) {
	s.lanesMu.Lock()
	defer s.lanesMu.Unlock()
	if !on {
		delete(s.boundLanes, p)
		return
	}
	if s.boundLanes == nil {
		s.boundLanes = map[*Peer]struct{}{}
	}
	s.boundLanes[p] = struct{}{}
	if !s.checking {
		s.checking = true
		s.wg.Add(1) // under a lane's goroutine, itself counted
		go s.checkLanes()
	}
}

// checkLanes looks at the bound lanes every laneCheckEvery until there are
// none or the server closes.
func (s *Server) checkLanes() {
	defer s.wg.Done()
	t := time.NewTicker(laneCheckEvery)
	defer t.Stop()
	var lanes []*Peer
	for {
		select {
		case <-s.closing:
		case <-t.C:
		}
		s.lanesMu.Lock()
		if len(s.boundLanes) == 0 || s.isClosing() {
			s.checking = false
			s.lanesMu.Unlock()
			return
		}
		lanes = lanes[:0]
		for p := range s.boundLanes {
			lanes = append(lanes, p)
		}
		s.lanesMu.Unlock()
		for _, p := range lanes {
			p.watch.look(p)
		}
		s.laneChecks.Add(1)
		clear(lanes)
	}
}

// isClosing reports whether the server is closing.
func (s *Server) isClosing() bool {
	select {
	case <-s.closing:
		return true
	default:
		return false
	}
}
