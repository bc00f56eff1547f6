package ipc

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"runtime"
	"slices"
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
// its handler holds, and the P its goroutine holds. So:
//
//   - One lane at a time follows each CPU, and at most GOMAXPROCS-1 lanes
//     are bound at once, so that lane threads kept from running cannot
//     hold every P. A peer that names a CPU another lane has, or one past
//     that count, is not followed until one is free again; the lanes past
//     it when GOMAXPROCS falls follow their peers no more.
//   - A bound lane whose peer has asked nothing for a second gives its
//     CPU back when that lets a lane waiting for one bind: one refused
//     that CPU, or, with as many lanes bound as may be, one refused a CPU
//     no lane has, since the bound lanes last changed
//     (ServerStats.IdleLanes counts them). The quiet peer's lane binds
//     again at its next request if a CPU is free then.
//   - The server watches its bound lanes, every 5 ms while it has any,
//     from a thread kept off their CPUs. A lane thread that has answered
//     one request for 2 ms or more since the watch first saw it, runnable
//     then and now, and ran for less than a quarter of that time, is let
//     go at once: it may run on the process's other CPUs for the rest of
//     that request, and its lane follows that peer no more
//     (ServerStats.StarvedLanes counts them, and a warning names the
//     peer). A process two of whose lanes were let go so is followed no
//     more on any of its connections, those open (let go at the watch's
//     next look) and those it makes later, for as long as it lives; nor
//     are a user's processes once eight of their lanes were, for the
//     server's life. Whatever kept the CPU busy counts, the peer's own
//     threads or another's. (A process the server has no room to
//     remember, past 1,024, or one that has exited while a child of it
//     holds its connection, is held to its user's count alone.) A
//     handler that waits, for a lock say, is not let go: only a thread
//     that could run and did not. A thread whose state the watch cannot
//     read (no /proc) is let go too, rather than left unwatched.
//
// The watch is a goroutine, and looks late when the Go scheduler runs it
// late (tens of milliseconds on a loaded machine): a look that comes more
// than 25 ms after the last judges only a thread the kernel counted
// waiting to run for half the time at least (its schedstat), not one the
// server's own stop held. A garbage collection that starts while a lane
// thread is kept from running waits for that thread's P, with every
// other goroutine stopped, the watch's included: a peer that can keep
// its CPU from others (a real-time thread) can so stop the whole process,
// twice per peer process and eight times per user at most, for as long
// as it keeps the CPU.
// Follow only the CPUs of peers trusted to name them and to keep them
// free meanwhile.
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
// goroutine ran on it next); unbound, the thread has its CPUs back and
// returns to the runtime. A lane that ends unbinds its thread; one the
// kernel would not unbind ends with the goroutine.
type laneCPU struct {
	bound   int32       // as Peer.follow: 0 unbound, else the CPU + 1
	ignored int32       // the last CPU + 1 asked for that home does not hold
	home    unix.CPUSet // the thread's CPUs before it was bound
	locked  bool        // the goroutine is locked to its thread

	// The last CPU + 1 that Server.takeLane refused, and the bound lanes'
	// generation then: not asked for again until they change, or for
	// laneRetryEvery requests (GOMAXPROCS may have risen).
	refused    int32
	refusedGen uint64
	retry      int
}

// laneRetryEvery is how many requests a lane refused a CPU lets go by
// before it asks again, the bound lanes unchanged.
const laneRetryEvery = 256

// apply binds or unbinds the calling thread as p asked, if it asked for a
// change. A binding the kernel refuses (the CPU went offline, say), or
// that another lane's holds up (see Server.takeLane), is tried again at
// the next request.
func (l *laneCPU) apply(p *Peer) {
	if p.watch.idle.Load() {
		// The watch took the lane's CPU back while its peer asked
		// nothing: unbound, it binds again below if a CPU is free.
		if l.bound != 0 {
			if l.unbind(p); l.bound != 0 {
				return
			}
		}
		p.watch.idle.Store(false)
	}
	want := p.follow.Load()
	if p.watch.letGo.Load() {
		want = 0
	}
	if want != 0 {
		c := p.starves.Load()
		if c == nil {
			c = p.srv.starveCountsOf(p) // unbound: it may wait for the lock
			p.starves.Store(c)
		}
		if c.out() {
			want = 0
		}
	}
	if want == 0 {
		// A CPU ignored before may be usable by the next binding (back
		// online, a wider cpuset): ask again then.
		l.ignored = 0
		if l.bound != 0 {
			l.unbind(p)
		}
		l.stopWaiting(p)
		return
	}
	if want == l.bound || want == l.ignored {
		return
	}
	cpu := int(want - 1)
	if l.bound != 0 {
		if !l.home.IsSet(cpu) {
			l.ignored = want
			return
		}
		// Moving: the thread lets go of its CPU first, so that it never
		// takes the lanes' lock where it may be kept from running.
		if l.unbind(p); l.bound != 0 {
			return
		}
	}
	gen := p.srv.lanesGen.Load()
	if want == l.refused && gen == l.refusedGen && l.retry < laneRetryEvery {
		l.retry++
		return
	}
	if !l.locked {
		// A CPU the thread may not use is not waited for (see quiet).
		var now unix.CPUSet
		if unix.SchedGetaffinity(0, &now) == nil && !now.IsSet(cpu) {
			l.ignored = want
			l.stopWaiting(p)
			return
		}
	}
	if !p.srv.takeLane(p, cpu) {
		l.refused, l.refusedGen, l.retry = want, gen, 0
		return
	}
	l.refused = 0
	if !l.locked {
		runtime.LockOSThread()
		if err := unix.SchedGetaffinity(0, &l.home); err != nil {
			p.srv.dropLane(p)
			runtime.UnlockOSThread()
			return
		}
		l.locked = true
	}
	if !l.home.IsSet(cpu) {
		p.srv.dropLane(p)
		l.ignored = want
		l.unbind(p)
		return
	}
	var one unix.CPUSet
	one.Set(cpu)
	if err := unix.SchedSetaffinity(0, &one); err != nil {
		p.srv.log.Debug("ipc: lane cannot follow its caller", "peer", p.id, "cpu", cpu, "err", err)
		p.srv.dropLane(p)
		l.unbind(p)
		return
	}
	l.bound, l.ignored = want, 0
	p.watch.bound(&l.home, cpu)
}

// stopWaiting has the server forget that the lane, unbound, waits for a
// CPU it was refused.
func (l *laneCPU) stopWaiting(p *Peer) {
	if l.refused != 0 {
		p.srv.dropLane(p)
		l.refused = 0
	}
}

// unbind gives the thread its CPUs back and unlocks it. If the kernel
// refuses, the thread stays as it is, locked, until the next request.
func (l *laneCPU) unbind(p *Peer) {
	if l.locked {
		if l.bound != 0 {
			// Unwatched first, so that no let-go narrows the thread
			// after its CPUs are back; the lanes' lock only after, when
			// it can run.
			p.watch.unwatch()
			if unix.SchedSetaffinity(0, &l.home) != nil {
				p.watch.tid.Store(int32(unix.Gettid()))
				return
			}
			p.srv.dropLane(p)
		}
		runtime.UnlockOSThread()
		l.locked = false
	}
	l.bound = 0
}

// end is unbind for a lane that ends: a thread the kernel would not
// unbind ends with the lane's goroutine, unwatched.
func (l *laneCPU) end(p *Peer) {
	if c := p.starves.Load(); c != nil {
		defer p.srv.releaseStarveCounts(c)
	}
	l.stopWaiting(p)
	if l.bound != 0 {
		l.unbind(p)
	}
	if l.bound != 0 {
		p.watch.unwatch()
		p.srv.dropLane(p)
	}
}

// laneCheckEvery is how often the server looks at its bound lanes, while
// it has any. A bound lane's thread that has answered one request for at
// least laneStarvedAfter, runnable when it started and at the end, and
// run for less than 1/laneStarvedShare of that time, is kept from
// running: it is let go. A request normally takes microseconds: one that
// spans a look is already rare.
const (
	laneCheckEvery   = 5 * time.Millisecond
	laneStarvedAfter = 2 * time.Millisecond
	laneStarvedShare = 4
	// laneCheckLate is how much later than laneCheckEvery a look may come
	// and still judge by the thread's CPU clock alone: one later still may
	// have measured a stall of the server's own too (stopped, traced),
	// when the lane's thread could not run either, whoever held its CPU.
	// A later look judges only if the kernel counted the thread waiting
	// to run for half the time at least, which such a stall is not.
	laneCheckLate = 4 * laneCheckEvery
)

// laneIdleAfter is how long a bound lane's peer may ask nothing before
// the lane gives its CPU back, if that lets a waiting lane bind (quiet).
var laneIdleAfter = time.Second

// laneWatch is what the server's checker needs of a bound lane. The lane
// takes no lock here while it is bound (a thread kept from running would
// hold it), and the checker waits for none.
type laneWatch struct {
	// busy is odd while the lane's thread answers a request while bound.
	busy atomic.Uint64
	// letGo is set once the lane's thread was let go: it follows the peer
	// no more.
	letGo atomic.Bool
	// idle is set once the lane gave its CPU back while its peer asked
	// nothing: it unbinds, and may bind again.
	idle atomic.Bool
	// evicted is set once the lane was let go for a reason other than its
	// CPU's load: it leaves the bound lanes at the first look that can.
	evicted atomic.Bool
	// binds counts the lane's bindings.
	binds atomic.Uint64
	tid   atomic.Int32 // the lane's thread while it is watched, else 0
	cpu   atomic.Int32 // the CPU it is bound to
	home  unix.CPUSet  // its CPUs before; written only while tid is 0
	// mu is held by the checker from reading tid until it is done with
	// the thread, and by the lane to set tid to 0 (a thread may end, and
	// its id be reused, only then).
	mu sync.Mutex

	// The checker's own, from its last look at the request it saw.
	looked   time.Time     // when it last looked at the lane at all
	seen     uint64        // busy
	ran      time.Duration // the thread's CPU time then
	at       time.Time     // when
	runnable bool          // whether it was runnable
	waited   time.Duration // its wait to run, as the kernel had counted it
	counted  bool          // whether the kernel said (threadWaited)
	// And since when its peer has asked nothing: since quietSince, busy
	// was quietAt and the lane's binding quietBinds.
	quietAt, quietBinds uint64
	quietSince          time.Time
}

// bound has the server watch the calling thread, bound to cpu, which
// the lane has taken (Server.takeLane); home is the CPUs it had before.
// Watched only once bound, so that whatever the watch does to the thread
// comes after the binding.
func (w *laneWatch) bound(home *unix.CPUSet, cpu int) {
	w.home = *home
	w.cpu.Store(int32(cpu))
	w.binds.Add(1)
	// A release the watch made as the lane left the CPU before (it waits
	// for w.mu to leave) was of that binding, not this one.
	w.idle.Store(false)
	w.tid.Store(int32(unix.Gettid()))
}

// unwatch stops the watch of the lane's thread, about to be unbound or to
// end: the checker does not touch the thread from then on. The lane's CPU
// is still its own (Server.dropLane).
func (w *laneWatch) unwatch() {
	w.mu.Lock()
	w.tid.Store(0)
	w.mu.Unlock()
}

// evict has the lane's thread follow its peer no more, for a reason other
// than its CPU's load: its thread may run elsewhere from now on (it waits
// for a request, or answers one) and unbinds before its next wait, and
// its CPU is free for another lane at once. It reports false if the lane
// is binding or unbinding, or a lock is taken: then try again later.
func (w *laneWatch) evict(p *Peer, why string) bool {
	if !w.mu.TryLock() {
		return false
	}
	var say func()
	defer w.unlock(&say) // held until the CPU is let go: the lane may not take another meanwhile
	tid := int(w.tid.Load())
	if tid == 0 {
		return false
	}
	if !w.letGo.Load() {
		w.evicted.Store(true)
		say = w.letGoFor(p, tid, why)
	}
	return p.srv.tryDropLane(p)
}

// giveUp lets the lane's thread go as a starved one is, without counting
// it against its peer: while it answers a request it may be kept from
// running, so it stays among the bound lanes until it unbinds, after the
// request. Nothing if it was let go already or is not watched.
func (w *laneWatch) giveUp(p *Peer, why string) {
	if !w.mu.TryLock() {
		return
	}
	var say func()
	defer w.unlock(&say)
	if tid := int(w.tid.Load()); tid != 0 && !w.letGo.Load() {
		say = w.letGoFor(p, tid, why)
	}
}

// letGoFor lets thread tid, the lane's, go for why, not its CPU's load,
// and returns what to log once w.mu, which the caller holds, is released.
func (w *laneWatch) letGoFor(p *Peer, tid int, why string) (say func()) {
	w.letGo.Store(true)
	w.release(tid)
	cpu := w.cpu.Load()
	return func() { p.srv.log.Info("ipc: a lane follows its peer no more", "peer", p.id, "cpu", cpu, "why", why) }
}

// unlock releases w.mu and then logs what was to be said under it: a log
// that blocks (a full pipe) must not hold up the lane, which takes w.mu
// to unbind.
func (w *laneWatch) unlock(say *func()) {
	w.mu.Unlock()
	if *say != nil {
		(*say)()
	}
}

// release lets thread tid, the lane's, run on the CPUs it had before it
// was bound, but the one it was bound to: the kernel moves a thread that
// may still run where it waits only when it gets round to it. Call it
// with w.mu held.
func (w *laneWatch) release(tid int) {
	wide := w.home
	wide.Clear(int(w.cpu.Load()))
	if wide.Count() == 0 {
		return
	}
	_ = unix.SchedSetaffinity(tid, &wide) // else when it unbinds, before its next wait
}

// look is the checker's look at p's lane: it lets the lane's thread go
// if, between two looks at least laneStarvedAfter apart at the request it
// answers, it was runnable at both and ran for less than
// 1/laneStarvedShare of the time, and either no look between them came
// late (laneCheckLate) or the kernel counted the thread waiting to run
// for at least half the time. (The kernel counts a thread's wait to run
// only once it runs again: the sign of a thread kept from running at all
// is a CPU clock that does not move. A thread held by a stop of the
// server's own was not waiting to run: its wait does not grow.)
func (w *laneWatch) look(p *Peer) {
	last := w.looked
	w.looked = time.Now()
	busy := w.busy.Load()
	if busy%2 == 0 {
		w.seen = busy
		w.quiet(p, busy, w.looked.Sub(last) > laneCheckEvery+laneCheckLate)
		return
	}
	if !w.mu.TryLock() {
		return // the lane is unwatching itself
	}
	var say func()
	defer w.unlock(&say)
	tid := int(w.tid.Load())
	if tid == 0 || w.letGo.Load() {
		return
	}
	ran, err := threadCPUTime(tid)
	now, r := time.Now(), false
	if err == nil {
		r, err = threadRunnable(tid)
	}
	if err != nil {
		// Not watched, it would not be let go if it starved: it follows
		// its peer no more instead (tid is alive while w.mu is held).
		w.letGo.Store(true)
		w.release(tid)
		say = func() {
			p.srv.log.Warn("ipc: cannot watch a lane thread; it follows its peer no more", "peer", p.id, "err", err)
		}
		return
	}
	if w.busy.Load() != busy {
		w.seen = 0
		return
	}
	waited, counted := threadWaited(tid)
	from := func() { // measure from now
		w.seen, w.ran, w.at, w.runnable, w.waited, w.counted = busy, ran, now, r, waited, counted
	}
	if busy != w.seen {
		from() // a request not seen before
		return
	}
	over := now.Sub(w.at)
	if now.Sub(last) > laneCheckEvery+laneCheckLate && (!counted || !w.counted || waited-w.waited < over/2 ||
		(ran-w.ran)*(laneStarvedShare-1) >= waited-w.waited) {
		// A look that comes late: the server itself may not have run
		// (stopped, traced), nor the lane's thread, whoever had its
		// CPU. Measured again from now, unless the kernel counted the
		// thread waiting to run for half the time at least, and its
		// run was less than 1/laneStarvedShare of the time the kernel
		// accounted for (run and wait): a stall of the server's own
		// held it without a wait, and is not counted against it.
		from()
		return
	}
	if over < laneStarvedAfter {
		return
	}
	if !r || !w.runnable || ran-w.ran >= over/laneStarvedShare {
		from()
		return
	}
	w.letGo.Store(true)
	p.srv.starvedLanes.Add(1) // before the thread may run, and answer
	var proc, user int32
	if c := p.starves.Load(); c != nil { // set before the lane bound
		proc, user = c.add()
	}
	cpu, ran := int(w.cpu.Load()), ran-w.ran
	w.release(tid)
	say = func() {
		log := p.srv.log
		log.Warn("ipc: a lane thread bound to the CPU its peer named could not run there; it follows that peer no more",
			"peer", p.id, "cpu", cpu, "over", over, "ran", ran)
		if proc == laneStarvedPerProcess {
			log.Warn("ipc: lanes of this process were kept from their CPUs again; it is followed no more",
				"pid", p.cred.PID, "lanes", proc)
		}
		if user == laneStarvedPerUser {
			log.Warn("ipc: lanes of this user's processes were kept from their CPUs too often; they are followed no more",
				"uid", p.cred.UID, "lanes", user)
		}
	}
}

// quiet is the checker's look at p's lane between two requests, busy
// counting them: a lane whose peer has asked nothing for laneIdleAfter
// gives its CPU back if a lane waits for it (see Server.helps). Its
// thread may run anywhere again at once, and it unbinds at its next
// request, after which it binds again if a CPU is free. A look that comes
// late (laneCheckLate) measures the quiet again from now: the server may
// not have run (stopped, traced), nor the lane's thread, with the peer's
// requests waiting in the lane.
func (w *laneWatch) quiet(p *Peer, busy uint64, late bool) {
	now, binds := time.Now(), w.binds.Load()
	if late || busy != w.quietAt || binds != w.quietBinds || w.quietSince.IsZero() {
		w.quietAt, w.quietBinds, w.quietSince = busy, binds, now
		return
	}
	if now.Sub(w.quietSince) < laneIdleAfter {
		return
	}
	if !w.mu.TryLock() {
		return
	}
	var say func()
	defer w.unlock(&say)
	tid := int(w.tid.Load())
	if tid == 0 || w.letGo.Load() || w.idle.Load() || w.busy.Load() != busy {
		return // unbinding, let go, given back, or asked something meanwhile
	}
	s := p.srv
	if !s.lanesMu.TryLock() {
		return // at the next look
	}
	defer s.lanesMu.Unlock()
	cpu := int(w.cpu.Load())
	if !s.helps(cpu) || unix.SchedSetaffinity(tid, &w.home) != nil {
		return
	}
	w.idle.Store(true)
	s.removeLane(p)
	s.idleLanes.Add(1)
	quiet := now.Sub(w.quietSince)
	say = func() { s.log.Debug("ipc: a quiet lane gives its CPU back", "peer", p.id, "cpu", cpu, "quiet", quiet) }
}

// laneStarvedPerProcess is how many lanes of one process may be let go
// for their CPU's load before the server follows that process no more.
// Once may be chance (a CPU hog that came and went); again, it is the
// process's way, or its CPU's.
const laneStarvedPerProcess = 2

// laneStarvedPerUser is the same for all the processes of one user: one
// that forks a child for each connection gets two let-gos per child, and
// the processes the server remembers are bounded (maxStarvedProcs).
const laneStarvedPerUser = 8

// maxStarvedProcs bounds how many processes the server remembers: those
// with a peer whose lane follows or may follow, and those that had a lane
// let go. Those that have exited are forgotten when it is reached; past
// it, a let-go counts against its user only.
var maxStarvedProcs = 1024

// starvedSearchEvery is how often, at most, the server searches a full
// table of processes for those that have exited.
const starvedSearchEvery = time.Second

// procKey names a process beyond the life of its pid: its pid and its
// start time (see startOf).
type procKey struct {
	pid   int
	start string
}

// procStarves is what the server remembers of a process: its lanes let go
// for their CPU's load, and how many of its peers hold the count. One
// that no peer holds and that had none let go is forgotten.
type procStarves struct {
	n     atomic.Int32
	peers int // guarded by Server.mu
}

// starveCounts are the counts of lanes let go for their CPU's load that a
// peer shares with the other peers of its process (nil: the server had no
// room to remember the process; see maxStarvedProcs) and of its user.
// Whatever kept the CPU busy counts, the peer's own threads or another's:
// either way its lane could not run where the peer asked. A peer that
// keeps its CPU from others would otherwise have a lane kept from running
// (and, should a garbage collection start then, the whole server stopped)
// once more with each connection it makes, or each process it forks.
type starveCounts struct {
	proc *procStarves
	key  procKey
	user *atomic.Int32
}

// out reports whether the peer's process, or its user, had so many lanes
// let go that the server follows it no more: on any of its connections,
// those open (the watch lets their lanes go at its next look) and those
// made later, for as long as the process lives, or the server for a user.
func (c *starveCounts) out() bool {
	return c.user.Load() >= laneStarvedPerUser || c.proc != nil && c.proc.n.Load() >= laneStarvedPerProcess
}

// add counts a lane let go, and returns the new counts (0 for a process
// not remembered).
func (c *starveCounts) add() (proc, user int32) {
	if c.proc != nil {
		proc = c.proc.n.Add(1)
	}
	return proc, c.user.Add(1)
}

// starveCountsOf returns p's counts, those of its process and user, which
// p holds until releaseStarveCounts. Called by p's lane, unbound, before
// it first binds.
func (s *Server) starveCountsOf(p *Peer) *starveCounts {
	pid, uid := p.cred.PID, p.cred.UID
	start := startOf(pid)
	// If the process has exited, its pid may be another's by now. Its
	// identity is closed once the connection has ended, and then says
	// nothing: the end is looked at after it.
	if start != nil && (!p.ident.alive() || p.Err() != nil) {
		start = nil
	}
	key := procKey{pid, string(start)}
	s.mu.Lock()
	if s.starvedUsers == nil {
		s.starved, s.starvedUsers = map[procKey]*procStarves{}, map[int]*atomic.Int32{}
	}
	full := false
	if now := time.Now(); start != nil && s.starved[key] == nil && len(s.starved) >= maxStarvedProcs && now.After(s.starvedSearch) {
		// Forget the processes that have exited, asking the kernel
		// without the lock; if none has, not again for a while, or
		// until one is forgotten otherwise.
		s.starvedSearch = now.Add(starvedSearchEvery)
		known := slices.Collect(maps.Keys(s.starved))
		s.mu.Unlock()
		known = slices.DeleteFunc(known, func(k procKey) bool { return !procExited(k) })
		s.mu.Lock()
		for _, k := range known {
			delete(s.starved, k)
		}
		if len(s.starved) < maxStarvedProcs {
			s.starvedSearch = time.Time{}
		}
	}
	if start != nil && s.starved[key] == nil && len(s.starved) >= maxStarvedProcs {
		start, full = nil, !s.starvedFull
		s.starvedFull = true
	}
	c := &starveCounts{key: key, user: s.starvedUsers[uid]}
	if c.user == nil {
		c.user = new(atomic.Int32)
		s.starvedUsers[uid] = c.user
	}
	if start != nil {
		if c.proc = s.starved[key]; c.proc == nil {
			c.proc = new(procStarves)
			s.starved[key] = c.proc
		}
		c.proc.peers++
	}
	s.mu.Unlock()
	if full {
		s.log.Warn("ipc: lanes let go for their CPU's load now count against their users only",
			"processes", maxStarvedProcs)
	}
	return c
}

// releaseStarveCounts lets go of counts a peer held (its lane has ended):
// a process that no peer holds and that had no lane let go is forgotten.
func (s *Server) releaseStarveCounts(c *starveCounts) {
	if c.proc == nil {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	c.proc.peers--
	if c.proc.peers == 0 && c.proc.n.Load() == 0 && s.starved[c.key] == c.proc {
		delete(s.starved, c.key)
		s.starvedSearch = time.Time{}
	}
}

// procExited reports whether the process k names has exited: its pid
// is gone, or another process's. One that cannot be read for another
// reason (out of descriptors, say) is taken to live.
func procExited(k procKey) bool {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(k.pid) + "/stat")
	if err != nil {
		return errors.Is(err, fs.ErrNotExist) || errors.Is(err, unix.ESRCH)
	}
	start := statStart(b)
	return start != nil && string(start) != k.start
}

// threadCPUTime returns the CPU time thread tid of this process has used,
// to the nanosecond (its CPUCLOCK_SCHED clock: see clock_getcpuclockid).
func threadCPUTime(tid int) (time.Duration, error) {
	const perThreadSched = 2 | 4 // CPUCLOCK_SCHED | CPUCLOCK_PERTHREAD_MASK
	var ts unix.Timespec
	if err := unix.ClockGettime(int32(^tid<<3|perThreadSched), &ts); err != nil {
		return 0, err
	}
	return time.Duration(ts.Nano()), nil
}

// threadRunnable reports whether thread tid of this process is running or
// waiting to run (state R in its stat), not waiting for something else.
var threadRunnable = func(tid int) (bool, error) {
	b, err := os.ReadFile("/proc/self/task/" + strconv.Itoa(tid) + "/stat")
	if err != nil {
		return false, err
	}
	i := bytes.LastIndexByte(b, ')') // the command may hold anything
	if i < 0 || i+2 >= len(b) {
		return false, fmt.Errorf("ipc: stat of thread %d: %q", tid, b)
	}
	return b[i+2] == 'R', nil
}

// threadWaited returns how long thread tid of this process has waited to
// run, as the kernel counts it (the run_delay of its schedstat), and
// whether the kernel said: a kernel that does not count it leaves the
// lateness of the watch's looks unexplained.
func threadWaited(tid int) (time.Duration, bool) {
	b, err := os.ReadFile("/proc/self/task/" + strconv.Itoa(tid) + "/schedstat")
	if err != nil {
		return 0, false
	}
	f := bytes.Fields(b)
	if len(f) < 2 {
		return 0, false
	}
	ns, err := strconv.ParseInt(string(f[1]), 10, 64)
	if err != nil || ns < 0 {
		return 0, false
	}
	return time.Duration(ns), true
}

// takeLane has p's lane take cpu, unless another lane has it or as many
// lanes as GOMAXPROCS-1 have one: a lane thread that its CPU's load keeps
// from running holds its P meanwhile, and one P must be left for the rest
// of the process (the watch included). It starts the watch if it does
// not run. A lane calls it only while its thread is not bound.
func (s *Server) takeLane(p *Peer, cpu int) bool {
	s.laneTakes.Add(1)
	s.lanesMu.Lock()
	defer s.lanesMu.Unlock()
	lanes := s.boundLanes()
	if len(lanes) >= runtime.GOMAXPROCS(0)-1 || slices.ContainsFunc(lanes, func(l boundLane) bool { return l.cpu == cpu }) {
		if s.waiting == nil {
			s.waiting = map[*Peer]int{}
		}
		s.waiting[p] = cpu // a quiet lane may give its CPU back for it
		return false
	}
	next := append(slices.Clip(lanes), boundLane{p, cpu})
	s.setLanes(next)
	if !s.checking {
		s.checking = true
		s.wg.Add(1) // on a lane's goroutine, itself counted
		go s.checkLanes()
	}
	return true
}

// helps reports whether a bound lane giving cpu back would let a lane
// that waits bind: the lanes left would be fewer than GOMAXPROCS-1, and
// one waits for cpu or for a CPU no lane has. Call it with lanesMu held.
func (s *Server) helps(cpu int) bool {
	lanes := s.boundLanes()
	if len(lanes)-1 >= runtime.GOMAXPROCS(0)-1 {
		return false // as many lanes as may be, or more, without it
	}
	for _, want := range s.waiting {
		if want == cpu || !slices.ContainsFunc(lanes, func(l boundLane) bool { return l.cpu == want }) {
			return true
		}
	}
	return false
}

// dropLane lets go of the CPU p's lane took, if it took one, and of its
// wait for one.
func (s *Server) dropLane(p *Peer) {
	s.lanesMu.Lock()
	defer s.lanesMu.Unlock()
	s.removeLane(p)
}

// tryDropLane is dropLane for the watch, which waits for no lock: it
// reports false if the lock is taken.
func (s *Server) tryDropLane(p *Peer) bool {
	if !s.lanesMu.TryLock() {
		return false
	}
	defer s.lanesMu.Unlock()
	s.removeLane(p)
	return true
}

// removeLane takes p's lane out of the bound ones, and out of those that
// wait for a CPU. Call it with lanesMu held.
func (s *Server) removeLane(p *Peer) {
	delete(s.waiting, p)
	lanes := s.boundLanes()
	if i := slices.IndexFunc(lanes, func(l boundLane) bool { return l.p == p }); i >= 0 {
		s.setLanes(slices.Delete(slices.Clone(lanes), i, i+1))
	}
}

// setLanes makes next the bound lanes, a new generation of them. The
// lanes that waited for a CPU wait no more: each asks again at its next
// request (its refusal was for the generation before), and waits again if
// refused, while one that has stopped asking is not given way to again.
// Call it with lanesMu held.
func (s *Server) setLanes(next []boundLane) {
	s.lanes.Store(&next)
	s.lanesGen.Add(1)
	clear(s.waiting)
}

// boundLane is a lane whose thread is bound, with its CPU.
type boundLane struct {
	p   *Peer
	cpu int
}

// boundLanes returns the lanes bound now, oldest first: a slice nobody
// changes, which the checker reads without the lanes' lock (a lane
// holding it, unbound, may still be kept from running where it was).
func (s *Server) boundLanes() []boundLane {
	if l := s.lanes.Load(); l != nil {
		return *l
	}
	return nil
}

// checkLanes looks at the watched lanes every laneCheckEvery until there
// are none, a closing server's too (its lanes end). It keeps its own
// thread off the CPUs the lanes are bound to, which their peers may keep
// busy: the kernel would keep it from running there too. It has the
// lanes past GOMAXPROCS-1 follow their peers no more (GOMAXPROCS fell
// since they were bound), and those of a process or user with too many
// let-gos (see starveCounts).
func (s *Server) checkLanes() {
	defer s.wg.Done()
	t := time.NewTicker(laneCheckEvery)
	defer t.Stop()
	var away awayFrom
	defer away.end()
	closing := s.closing
	for {
		select {
		case <-closing:
			// Close waits for the lanes: they are watched until they
			// have ended, so that none kept from running delays it.
			closing = nil
		case <-t.C:
		}
		if h := laneLooking.Load(); h != nil {
			(*h)()
		}
		lanes := s.boundLanes()
		if len(lanes) == 0 {
			// Under the lock, so that a lane bound meanwhile finds the
			// checker still running or starts another; a lane holding
			// it has the next look do.
			if !s.lanesMu.TryLock() {
				continue
			}
			done := len(s.boundLanes()) == 0
			s.checking = !done
			s.lanesMu.Unlock()
			if done {
				return
			}
			continue
		}
		var busy unix.CPUSet
		for _, l := range lanes {
			busy.Set(l.cpu)
		}
		away.set(&busy)
		for _, l := range lanes {
			if c := l.p.starves.Load(); c != nil && c.out() {
				// Bound before its process (or user) had its let-gos.
				const why = "lanes of its process or user were kept from their CPUs too often"
				if l.p.watch.busy.Load()%2 == 0 {
					l.p.watch.evict(l.p, why) // waits for a request: nothing holds it
				} else {
					l.p.watch.giveUp(l.p, why) // perhaps kept from running: still counted bound
				}
				continue
			}
			l.p.watch.look(l.p)
		}
		lanes = s.boundLanes() // less those given back
		for _, l := range lanes {
			if l.p.watch.evicted.Load() {
				s.tryDropLane(l.p) // its lock was taken when it was evicted
			}
		}
		lanes = s.boundLanes()
		if extra := len(lanes) - (runtime.GOMAXPROCS(0) - 1); extra > 0 {
			for _, l := range lanes[len(lanes)-extra:] {
				l.p.watch.evict(l.p, "GOMAXPROCS fell")
			}
		}
		s.laneChecks.Add(1)
	}
}

// laneLooking, when set (by this package's tests), runs in the watch
// before each of its looks.
var laneLooking atomic.Pointer[func()]

// awayFrom keeps the calling goroutine's thread off a set of CPUs, where
// it may still run elsewhere.
type awayFrom struct {
	locked bool
	home   unix.CPUSet // the thread's CPUs before
	now    unix.CPUSet // those it has
}

// set keeps the thread off the CPUs in busy, or lets it run on all it had
// if that would leave it none. A change the kernel refuses is tried
// again at the next call.
func (a *awayFrom) set(busy *unix.CPUSet) {
	if !a.locked {
		runtime.LockOSThread()
		if unix.SchedGetaffinity(0, &a.home) != nil {
			runtime.UnlockOSThread()
			return
		}
		a.now, a.locked = a.home, true
	}
	want := a.home
	for i := range cpuSetSize {
		if busy.IsSet(i) {
			want.Clear(i)
		}
	}
	if want.Count() == 0 {
		want = a.home
	}
	if want != a.now && unix.SchedSetaffinity(0, &want) == nil {
		a.now = want
	}
}

// end gives the thread its CPUs back and unlocks it; a thread the kernel
// would not give them back to ends with its goroutine.
func (a *awayFrom) end() {
	if a.locked && (a.now == a.home || unix.SchedSetaffinity(0, &a.home) == nil) {
		runtime.UnlockOSThread()
	}
}
