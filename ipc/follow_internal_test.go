package ipc

import (
	"context"
	"errors"
	"log/slog"
	"os"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// A hint the lane's thread could not use when it came is ignored, and
// costs no system call while the peer repeats it; once the peer has named
// no CPU, the same hint is tried again, and binds if the CPU has become
// usable meanwhile (back online, a wider cpuset).
func TestLaneTriesAnIgnoredCPUAgain(t *testing.T) {
	var all unix.CPUSet
	require.NoError(t, unix.SchedGetaffinity(0, &all))
	if !all.IsSet(0) || !all.IsSet(1) {
		t.Skip("needs a process that may use CPUs 0 and 1")
	}
	// This goroutine's thread stands for a lane's: its CPUs are {0} when
	// the peer first names CPU 1, and {0, 1} afterwards.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	defer func() { require.NoError(t, unix.SchedSetaffinity(0, &all)) }()
	var zero unix.CPUSet
	zero.Set(0)
	require.NoError(t, unix.SchedSetaffinity(0, &zero))

	p := &Peer{srv: &Server{log: slog.New(slog.DiscardHandler)}}
	var l laneCPU
	step := func(cpu int) int32 {
		p.Follow(cpu)
		l.apply(p)
		return l.bound - 1
	}
	assert.Equal(t, int32(-1), step(1), "CPU 1 is not usable yet")
	assert.False(t, l.locked, "an ignored hint leaves the thread to the runtime")
	require.NoError(t, unix.SchedSetaffinity(0, &all))
	assert.Equal(t, int32(-1), step(1), "repeated, the hint is still ignored")
	assert.Equal(t, int32(-1), step(-1))
	assert.Equal(t, int32(1), step(1), "after a request that names none, the hint binds")
	assert.True(t, l.locked)
	assert.Equal(t, int32(-1), step(-1))
	assert.False(t, l.locked, "unbound, the thread goes back to the runtime")
}

// The watch may evict a lane (GOMAXPROCS fell) at any moment, as the lane
// binds its thread too: a lane evicted so never waits for its next
// request bound to the CPU it named.
func TestAnEvictedLaneNeverWaitsBound(t *testing.T) {
	var all unix.CPUSet
	require.NoError(t, unix.SchedGetaffinity(0, &all))
	if !all.IsSet(0) || !all.IsSet(1) {
		t.Skip("needs a process that may use CPUs 0 and 1")
	}
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(3))
	s := &Server{log: slog.New(slog.DiscardHandler), closing: make(chan struct{})}
	defer func() { close(s.closing); s.wg.Wait() }()
	p := &Peer{srv: s}
	var stop atomic.Bool
	evicting := make(chan struct{})
	go func() {
		defer close(evicting)
		for !stop.Load() {
			p.watch.evict(p, "test")
		}
	}()
	defer func() { stop.Store(true); <-evicting }()

	runtime.LockOSThread() // this goroutine's thread stands for a lane's
	defer runtime.UnlockOSThread()
	defer func() { require.NoError(t, unix.SchedSetaffinity(0, &all)) }()
	var one unix.CPUSet
	one.Set(1)
	var l laneCPU
	for range 500 {
		p.Follow(1)
		l.apply(p)
		// The lane would wait now: the eviction comes during the
		// binding, or while it waits.
		for end := time.Now().Add(10 * time.Second); !p.watch.letGo.Load(); runtime.Gosched() {
			require.True(t, time.Now().Before(end), "a bound lane was not evicted in 10 s")
		}
		var set unix.CPUSet
		p.watch.mu.Lock() // once the eviction is done with the thread
		err := unix.SchedGetaffinity(0, &set)
		p.watch.mu.Unlock()
		require.NoError(t, err)
		require.NotEqual(t, one, set, "an evicted lane waits bound to its CPU")
		p.Follow(-1)
		l.apply(p)
		require.Zero(t, l.bound)
		p.watch.letGo.Store(false) // follow again
	}
	assert.Empty(t, s.boundLanes(), "no CPU held")
}

// A watch that cannot read a bound lane thread's state (no /proc, say)
// lets the thread go, as it would a starved one, rather than leave it
// bound and unwatched.
func TestALaneTheWatchCannotReadIsLetGo(t *testing.T) {
	defer func(f func(int) (bool, error)) { threadRunnable = f }(threadRunnable)
	threadRunnable = func(int) (bool, error) { return false, errors.New("no /proc here") }
	var home unix.CPUSet
	require.NoError(t, unix.SchedGetaffinity(0, &home))
	runtime.LockOSThread() // this goroutine's thread stands for a lane's
	defer runtime.UnlockOSThread()
	defer func() { require.NoError(t, unix.SchedSetaffinity(0, &home)) }()

	p := &Peer{srv: &Server{log: slog.New(slog.DiscardHandler)}}
	p.watch.bound(&home, 0)
	p.watch.busy.Add(1) // answering a request
	p.watch.look(p)
	assert.True(t, p.watch.letGo.Load(), "a lane thread the watch cannot read follows its peer no more")
	assert.Zero(t, p.srv.Stats().StarvedLanes, "not counted as starved")
}

// A quiet lane that cannot take the lanes' lock gives nothing back, and
// counts nothing: a lane waiting for its CPU would not see the change. It
// gives its CPU back, counted, at the look after.
func TestAQuietLaneCountsOnlyTheCPUItGaveBack(t *testing.T) {
	var home unix.CPUSet
	if err := unix.SchedGetaffinity(0, &home); err != nil || home.Count() < 2 {
		t.Skip("needs a process that may use 2 CPUs")
	}
	defer SetLaneIdleAfter(0)()
	runtime.LockOSThread() // stands for the lane's thread
	defer runtime.UnlockOSThread()
	s := &Server{log: slog.New(slog.DiscardHandler), waiting: map[*Peer]int{}}
	p, waiter := &Peer{srv: s}, &Peer{srv: s}
	cpu := -1
	for i := range cpuSetSize {
		if home.IsSet(i) {
			cpu = i
		}
	}
	lanes := []boundLane{{p, cpu}}
	s.lanes.Store(&lanes)
	p.watch.bound(&home, cpu)
	s.waiting[waiter] = cpu

	s.lanesMu.Lock() // as the waiting lane's next takeLane holds it
	p.watch.quiet(p, 0, false)
	p.watch.quiet(p, 0, false)
	s.lanesMu.Unlock()
	assert.Zero(t, s.idleLanes.Load())
	assert.False(t, p.watch.idle.Load())
	assert.Len(t, s.boundLanes(), 1)

	gen := s.lanesGen.Load()
	p.watch.quiet(p, 0, false)
	assert.Equal(t, uint64(1), s.idleLanes.Load())
	assert.True(t, p.watch.idle.Load())
	assert.Empty(t, s.boundLanes())
	assert.NotEqual(t, gen, s.lanesGen.Load(), "a lane that waits asks again")
	var now unix.CPUSet
	require.NoError(t, unix.SchedGetaffinity(0, &now))
	assert.Equal(t, home, now, "the thread may run where it could before")
}

// A lane evicted for a fallen GOMAXPROCS whose lanes' lock was taken at
// that moment leaves the bound lanes at a later look, even once it is no
// longer past the cap (another lane left meanwhile): it follows its peer
// no more, and would keep its CPU from others until its peer asked again.
func TestAnEvictedLaneLeavesTheBoundLanesOnceItCan(t *testing.T) {
	var home unix.CPUSet
	require.NoError(t, unix.SchedGetaffinity(0, &home))
	if home.Count() < 2 {
		t.Skip("needs a process that may use 2 CPUs")
	}
	runtime.LockOSThread() // this goroutine's thread stands for the lanes'
	defer runtime.UnlockOSThread()
	defer func() { require.NoError(t, unix.SchedSetaffinity(0, &home)) }()
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(2))
	s := &Server{log: slog.New(slog.DiscardHandler), closing: make(chan struct{})}
	a, c := &Peer{srv: s}, &Peer{srv: s}
	a.watch.bound(&home, 0)
	c.watch.bound(&home, 1)
	s.setLanes([]boundLane{{a, 0}, {c, 1}})

	s.lanesMu.Lock() // as a lane's takeLane would hold it
	assert.False(t, c.watch.evict(c, "test"), "the lanes' lock is taken")
	s.lanesMu.Unlock()
	require.True(t, c.watch.letGo.Load())
	s.dropLane(a) // a leaves: c is no longer past the cap

	s.checking = true
	s.wg.Add(1)
	go s.checkLanes()
	defer func() { close(s.closing); s.dropLane(c); s.wg.Wait() }()
	// The watch ends once no lane is bound.
	for end := time.Now().Add(10 * time.Second); LaneCheckerRunning(s); runtime.Gosched() {
		require.True(t, time.Now().Before(end), "the evicted lane still held its CPU after 10s (bound lanes: %d)", len(s.boundLanes()))
	}
	assert.Empty(t, s.boundLanes())
}

// A quiet lane gives its CPU back only if a waiting lane could then bind:
// not while the lanes left would still be as many as GOMAXPROCS-1 allows
// (it fell), nor for a lane that waits for another bound lane's CPU.
func TestAQuietLaneHelpsOnlyALaneThatCouldBind(t *testing.T) {
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(2))
	s := &Server{}
	a, b, c := &Peer{srv: s}, &Peer{srv: s}, &Peer{srv: s}
	for _, tc := range []struct {
		maxprocs int
		lanes    []boundLane
		wants    int
		helps    bool
	}{
		{3, []boundLane{{a, 0}, {c, 1}}, 0, true},  // b waits for a's CPU
		{3, []boundLane{{a, 0}, {c, 1}}, 1, false}, // b waits for c's
		{2, []boundLane{{a, 0}}, 1, true},          // b waits for the slot
		{2, []boundLane{{a, 0}, {c, 1}}, 0, false}, // GOMAXPROCS fell: c still fills it
		{2, []boundLane{{a, 0}, {c, 1}}, 2, false}, // likewise
		{3, []boundLane{{a, 0}}, 1, true},          // a waiting lane not bound yet
	} {
		runtime.GOMAXPROCS(tc.maxprocs)
		s.lanesMu.Lock()
		s.setLanes(tc.lanes)
		s.waiting = map[*Peer]int{b: tc.wants}
		assert.Equal(t, tc.helps, s.helps(0), "GOMAXPROCS %d, %d lanes, b waits for CPU %d", tc.maxprocs, len(tc.lanes), tc.wants)
		s.lanesMu.Unlock()
	}
}

// A lane bound anew is not marked as having given its CPU back: a mark the
// watch made as the lane left its CPU before (the lane waits for the
// watch's lock to leave it) was of that binding, and the watch gives back
// no CPU of a lane so marked.
func TestABindingClearsAnIdleMarkOfTheOneBefore(t *testing.T) {
	var home unix.CPUSet
	require.NoError(t, unix.SchedGetaffinity(0, &home))
	p := &Peer{srv: &Server{}}
	p.watch.bound(&home, 0)
	p.watch.idle.Store(true) // by the watch, as the lane moved
	p.watch.unwatch()
	p.watch.bound(&home, 1)
	assert.False(t, p.watch.idle.Load())
}

// The server remembers a bounded number of processes: when it is full,
// the processes that have exited are forgotten to make room, and if none
// has, a peer's let-gos count against its user only (and the server says
// so, once), and it does not search again until it forgets a process.
func TestTheProcessesLanesStarvedForAreForgottenOnceGone(t *testing.T) {
	defer func(n int) { maxStarvedProcs = n }(maxStarvedProcs)
	maxStarvedProcs = 2
	self, parent := os.Getpid(), os.Getppid()
	key := func(pid int) procKey { return procKey{pid, string(startOf(pid))} }
	require.NotEmpty(t, key(self).start)
	require.NotEmpty(t, key(parent).start)
	var log logLines
	s := &Server{log: slog.New(&log), starvedUsers: map[int]*atomic.Int32{}}
	p := selfPeer(s, os.Getuid())
	starved := func() *procStarves { v := new(procStarves); v.n.Store(1); return v }

	gone := procKey{parent, key(parent).start + "0"} // its pid, another's start: exited
	s.starved = map[procKey]*procStarves{key(parent): starved(), gone: starved()}
	c := s.starveCountsOf(p)
	assert.NotContains(t, s.starved, gone, "the process that exited made room")
	assert.Same(t, s.starved[key(self)], c.proc, "the peer's process is counted")
	assert.Zero(t, log.count("count against their users only"))

	s.starved = map[procKey]*procStarves{key(parent): starved(), {1, string(startOf(1))}: starved()}
	c2 := s.starveCountsOf(p)
	assert.Nil(t, c2.proc, "a process counted with no room")
	assert.Same(t, c.user, c2.user, "its user still is")
	assert.False(t, s.starvedSearch.IsZero(), "not searched again for a while")
	s.starved[gone] = s.starved[key(parent)] // exited, but not searched for
	delete(s.starved, key(parent))
	assert.Nil(t, s.starveCountsOf(p).proc, "searched again with no process forgotten")
	assert.Equal(t, 1, log.count("count against their users only"), "said once")

	s.starved[key(parent)] = &procStarves{peers: 1}
	s.releaseStarveCounts(&starveCounts{proc: s.starved[key(parent)], key: key(parent)})
	assert.NotContains(t, s.starved, key(parent), "forgotten with its last peer")
	assert.NotNil(t, s.starveCountsOf(p).proc, "a process forgotten: searched again")
	assert.NotContains(t, s.starved, gone)

	// And once a while has passed.
	s.starved = map[procKey]*procStarves{key(parent): starved(), gone: starved()}
	s.starvedSearch = time.Now().Add(-time.Millisecond)
	assert.NotNil(t, s.starveCountsOf(p).proc, "searched again after a while")
	assert.NotContains(t, s.starved, gone)
}

// A peer whose connection has ended is held to its user's count alone:
// its process may have exited, and its pid be another's, which the ended
// connection's identity no longer tells.
func TestAPeerWhoseConnectionEndedIsHeldToItsUsersCount(t *testing.T) {
	s := &Server{log: slog.New(slog.DiscardHandler)}
	p := selfPeer(s, 4242)
	p.err = errors.New("ended")
	c := s.starveCountsOf(p)
	assert.Nil(t, c.proc)
	assert.NotNil(t, c.user)
}

// A process is remembered while a peer of it holds its count, and after
// only if a lane of it was let go.
func TestAProcessIsForgottenWithItsLastPeerUnlessALaneOfItWasLetGo(t *testing.T) {
	s := &Server{log: slog.New(slog.DiscardHandler)}
	key := procKey{os.Getpid(), string(startOf(os.Getpid()))}
	a, b := s.starveCountsOf(selfPeer(s, 4242)), s.starveCountsOf(selfPeer(s, 4242))
	s.releaseStarveCounts(a)
	assert.Contains(t, s.starved, key, "a peer holds it still")
	s.releaseStarveCounts(b)
	assert.NotContains(t, s.starved, key, "no peer holds it, and none of its lanes was let go")

	c := s.starveCountsOf(selfPeer(s, 4242))
	c.add()
	s.releaseStarveCounts(c)
	assert.Contains(t, s.starved, key, "a lane of it was let go")
	assert.Equal(t, int32(1), s.starveCountsOf(selfPeer(s, 4242)).proc.n.Load(), "for its later peers")
}

// A process has exited if its pid is gone or another's; one whose stat
// cannot be read for another reason is taken to live.
func TestProcExited(t *testing.T) {
	self := os.Getpid()
	assert.False(t, procExited(procKey{self, string(startOf(self))}))
	assert.True(t, procExited(procKey{self, string(startOf(self)) + "0"}), "another start")
	assert.True(t, procExited(procKey{1 << 30, "1"}), "no such pid")
}

// A peer's let-go counts against every peer of its process, those there
// and those to come, and past laneStarvedPerProcess they are followed no
// more; the user's count holds the others back only at laneStarvedPerUser.
func TestAProcessesPeersShareItsCounts(t *testing.T) {
	s := &Server{log: slog.New(slog.DiscardHandler)}
	a := s.starveCountsOf(selfPeer(s, 4242))
	a.add()
	b := s.starveCountsOf(selfPeer(s, 4242))
	assert.False(t, b.out(), "one let-go")
	a.add()
	assert.True(t, b.out(), "two let-gos of the process, counted on another of its peers")
	assert.True(t, s.starveCountsOf(selfPeer(s, 4242)).out(), "a later peer of the process")
}

// All the lanes of one user's processes let go laneStarvedPerUser times
// in all have the server follow that user's processes no more, whichever
// process each is (a process that forks a child per connection gets two
// let-gos per child). Another user's are still followed.
func TestAUserWhoseLanesStarvedTooOftenIsFollowedNoMore(t *testing.T) {
	const uid, other = 4242, 4343
	s := &Server{log: slog.New(slog.DiscardHandler)}
	mine, theirs := s.starveCountsOf(selfPeer(s, uid)), s.starveCountsOf(selfPeer(s, other))
	// Children that have exited, one let-go each: no process to count.
	child := s.starveCountsOf(&Peer{srv: s, cred: Cred{PID: 1 << 30, UID: uid}, ident: identity{pid: 1 << 30}})
	require.Nil(t, child.proc)
	for range laneStarvedPerUser - 1 {
		child.add()
	}
	assert.False(t, mine.out(), "one let-go short")
	child.add()
	assert.True(t, mine.out(), "a peer of the user")
	assert.True(t, s.starveCountsOf(selfPeer(s, uid)).out(), "a peer of the user that comes later")
	assert.False(t, theirs.out(), "another user's peer")
}

// The watch's messages are written once it has let go of the lane's lock:
// a log that blocks must not hold up the lane, which takes that lock to
// unbind.
func TestTheWatchLogsWithoutTheLanesLock(t *testing.T) {
	entered, release := make(chan struct{}, 1), make(chan struct{})
	defer close(release)
	s := &Server{log: slog.New(&blockingLog{entered: entered, release: release})}
	p := selfPeer(s, os.Getuid())
	// This thread stands for the lane's; its CPUs are put back.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	require.NoError(t, unix.SchedGetaffinity(0, &p.watch.home))
	defer func(home unix.CPUSet) { require.NoError(t, unix.SchedSetaffinity(0, &home)) }(p.watch.home)
	p.watch.tid.Store(int32(unix.Gettid()))
	go p.watch.evict(p, "a test")
	select {
	case <-entered:
	case <-time.After(10 * time.Second):
		t.Fatal("no message")
	}
	free := make(chan struct{})
	go func() { p.watch.unwatch(); close(free) }()
	select {
	case <-free:
	case <-time.After(10 * time.Second):
		t.Fatal("the lane's lock is held while the watch's message waits for the log")
	}
}

// selfPeer is a peer of this process, as user uid sees it.
func selfPeer(s *Server, uid int) *Peer {
	pid := os.Getpid()
	return &Peer{srv: s, cred: Cred{PID: pid, UID: uid}, ident: identity{pid: pid, start: startOf(pid)}}
}

// logLines is a slog handler that keeps the messages it is given.
type logLines struct {
	mu   sync.Mutex
	msgs []string
}

func (l *logLines) Enabled(context.Context, slog.Level) bool { return true }
func (l *logLines) Handle(_ context.Context, r slog.Record) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.msgs = append(l.msgs, r.Message)
	return nil
}
func (l *logLines) WithAttrs([]slog.Attr) slog.Handler { return l }
func (l *logLines) WithGroup(string) slog.Handler      { return l }

// count reports how many messages had sub in them.
func (l *logLines) count(sub string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, m := range l.msgs {
		if strings.Contains(m, sub) {
			n++
		}
	}
	return n
}

// blockingLog is a slog handler whose first record says so on entered
// and waits for release, as a log writing to a full pipe would.
type blockingLog struct {
	entered chan struct{}
	release chan struct{}
}

func (b *blockingLog) Enabled(context.Context, slog.Level) bool { return true }
func (b *blockingLog) Handle(context.Context, slog.Record) error {
	select {
	case b.entered <- struct{}{}:
		<-b.release
	default:
	}
	return nil
}
func (b *blockingLog) WithAttrs([]slog.Attr) slog.Handler { return b }
func (b *blockingLog) WithGroup(string) slog.Handler      { return b }
