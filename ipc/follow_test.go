package ipc_test

import (
	"context"
	"fmt"
	"math"
	"os"
	"runtime"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/ipc"
)

// lastCPU returns the highest-numbered CPU this process may use, skipping
// t when it may use only one.
func lastCPU(t *testing.T) int {
	cpus := testenv.NeedCPUs(t, 2)
	return cpus[len(cpus)-1]
}

// threadsBoundTo counts this process's threads whose affinity is exactly
// cpu.
func threadsBoundTo(t *testing.T, cpu int) int {
	all, _ := testenv.ThreadsBoundTo(t, cpu)
	return all
}

// followHandler answers create requests inline, following the CPU the
// request names as the primary does. Its answers' length less one is the
// id of the lane thread that answered (see laneTID).
func followHandler() *handler {
	h := newHandler()
	h.handle = func(_ context.Context, p *ipc.Peer, kind ipc.Kind, body *ipc.Decoder) (any, error, bool) {
		if kind != ipc.KindCreateMR {
			return nil, nil, false
		}
		var m ipc.CreateMR
		if err := body.Decode(&m); err != nil {
			return nil, err, true
		}
		p.Follow(int(m.CPU) - 1)
		return &ipc.CreateMRReply{Start: m.Addr, End: m.Addr + 1 + uint64(unix.Gettid()), LKey: 7}, nil, true
	}
	return h
}

// A lane's thread waits on the CPU its caller names, from the request after
// the one that named it on, and runs anywhere again once a request names
// none. CPUs the process may not use are ignored; a caller that names
// another CPU at every request is still answered at every request.
func TestLaneFollowsItsCallersCPU(t *testing.T) {
	cpu := lastCPU(t)
	s := startServer(t, followHandler(), withHello, withInline)
	c := laneClient(t, s, true, ipc.ClientConfig{})
	call := func(hint uint32) {
		t.Helper()
		var r ipc.CreateMRReply
		require.NoError(t, c.Call(ctxBound(t), ipc.KindCreateMR, &ipc.CreateMR{Addr: 0x1000, CPU: hint}, &r))
		require.Equal(t, uint32(7), r.LKey)
	}
	// The binding is made after an answer and before the next request
	// is read: the second answer says the first request's is in place.
	twice := func(hint uint32) { call(hint); call(hint) }

	require.Zero(t, threadsBoundTo(t, cpu), "no thread bound before")
	twice(uint32(cpu) + 1)
	assert.Equal(t, 1, threadsBoundTo(t, cpu), "the lane's thread follows its caller")
	twice(0)
	assert.Zero(t, threadsBoundTo(t, cpu), "a caller bound to no CPU frees the lane's thread")

	twice(uint32(cpu) + 1)
	twice(1000 + 1) // a CPU no machine here has
	twice(math.MaxUint32)
	assert.Equal(t, 1, threadsBoundTo(t, cpu), "CPUs the process may not use are ignored")

	for i := range 200 {
		call(uint32(i%2*cpu) + 1) // CPU 0, the last, 0, ...
	}
	call(uint32(cpu) + 1)
	// The watch's thread keeps off the lane's CPU: it may be bound to the
	// last one since the lane was on CPU 0, until its next look.
	waitLooks(t, s, 2)
	assert.Equal(t, 1, threadsBoundTo(t, cpu), "the thread follows the last caller")
	twice(0)
	watchEnds(t, s)
	assert.Zero(t, threadsBoundTo(t, cpu))
}

// A lane's thread returns to the CPUs it had, not to those of the thread
// that made the server: a server made on a thread bound to one CPU (a
// program's main lcore) still follows its callers to the others, and lets
// its lanes run anywhere again.
func TestLaneFollowsFromAServerMadeOnABoundThread(t *testing.T) {
	cpu := lastCPU(t)
	var all unix.CPUSet
	require.NoError(t, unix.SchedGetaffinity(0, &all))
	first := testenv.NeedCPUs(t, 2)[0]
	var s *testServer
	func() {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		var one unix.CPUSet
		one.Set(first)
		require.NoError(t, unix.SchedSetaffinity(0, &one))
		defer func() { require.NoError(t, unix.SchedSetaffinity(0, &all)) }()
		s = startServer(t, followHandler(), withHello, withInline)
	}()
	c := laneClient(t, s, true, ipc.ClientConfig{})
	twice := func(hint uint32) {
		t.Helper()
		for range 2 {
			require.NoError(t, c.Call(ctxBound(t), ipc.KindCreateMR, &ipc.CreateMR{Addr: 0x1000, CPU: hint}, &ipc.CreateMRReply{}))
		}
	}
	before := threadsBoundTo(t, first)
	twice(uint32(cpu) + 1)
	assert.Equal(t, 1, threadsBoundTo(t, cpu), "the lane follows its caller to a CPU the server's maker may not use")
	twice(0)
	watchEnds(t, s) // its thread keeps off the lane's CPU while it runs
	assert.Zero(t, threadsBoundTo(t, cpu))
	assert.Equal(t, before, threadsBoundTo(t, first), "unbound, the lane's thread may use every CPU again")
}

// A lane bound to its caller's CPU does not poll for the next request,
// however long Spin is: it would poll on the very CPU it hands back to its
// caller with each answer. It blocks in the kernel at once.
func TestBoundLaneDoesNotPoll(t *testing.T) {
	cpu := lastCPU(t)
	s := startServer(t, followHandler(), withHello, withInline, func(c *ipc.ServerConfig) { c.Spin = time.Minute })
	c := laneClient(t, s, true, ipc.ClientConfig{})
	twice := func(hint uint32) { // the second answer says the first request's binding is in place
		t.Helper()
		for range 2 {
			var r ipc.CreateMRReply
			require.NoError(t, c.Call(ctxBound(t), ipc.KindCreateMR, &ipc.CreateMR{Addr: 0x1000, CPU: hint}, &r))
		}
	}
	twice(uint32(cpu) + 1)
	// Unbound at the end, as the test found it, pass or fail: a thread
	// that ends bound may be the process's main thread, which the runtime
	// parks for good, bound.
	defer func() {
		twice(0)
		assert.Zero(t, threadsBoundTo(t, cpu))
	}()
	tids := testenv.ThreadIDsBoundTo(t, cpu)
	require.Len(t, tids, 1, "the lane's thread follows its caller")
	// Polling, the thread alternates between polls, yields and the
	// runtime's hand-offs for Spin; waiting, it blocks in one receive.
	deadline := time.Now().Add(10 * time.Second)
	for {
		if n, ok := testenv.ThreadSyscall(t, tids[0]); ok && (n == unix.SYS_RECVFROM || n == unix.SYS_RECVMSG) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the bound lane thread %d is not waiting in a receive 10 s after its answer: it polls", tids[0])
		}
		runtime.Gosched()
	}
}

// Addresses the handlers of the starving tests tell apart.
const (
	addrStarve     = 0x2000 // keep the thread busy until it is let go
	addrWait       = 0x3000 // block until released
	addrStarveHold = 0x4000 // addrStarve, then addrWait
)

// starveHandler is followHandler with addresses of its own. A request for
// addrStarve, naming the CPU its lane's thread is bound to, keeps the
// thread busy until it may no longer run there (the lane was let go), for
// at most bound/2, and answers LKey 1 if so, 0 if not (at once if the
// thread is not bound there: it may run elsewhere too); one for addrWait
// says it started on started and blocks until release is closed; one for
// addrStarveHold does the one and then the other.
func starveHandler(started chan<- struct{}, release <-chan struct{}) *handler {
	h := followHandler()
	follow := h.handle
	h.handle = func(ctx context.Context, p *ipc.Peer, kind ipc.Kind, body *ipc.Decoder) (any, error, bool) {
		reply, err, ok := follow(ctx, p, kind, body)
		r, _ := reply.(*ipc.CreateMRReply)
		if err != nil || r == nil {
			return reply, err, ok
		}
		var m ipc.CreateMR
		if err := body.Decode(&m); err != nil {
			return nil, err, true
		}
		if r.Start == addrStarve || r.Start == addrStarveHold {
			// Bound to the CPU it names, by the requests before. Not the
			// thread's CPUs as the handler starts: the watch may have let
			// it go already, before it ran.
			r.LKey = 0
			for end := time.Now().Add(bound / 2); m.CPU > 0 && time.Now().Before(end); {
				var set unix.CPUSet
				if unix.SchedGetaffinity(0, &set) != nil {
					continue
				}
				if !set.IsSet(int(m.CPU) - 1) {
					r.LKey = 1
					break
				}
				if set.Count() > 1 {
					break // not bound: nothing to let go
				}
			}
		}
		if r.Start == addrWait || r.Start == addrStarveHold {
			started <- struct{}{}
			<-release
		}
		return r, nil, true
	}
	return h
}

func init() {
	testproc.Register("spin", helperSpin)
	testproc.Register("starver", helperStarver)
}

// helperSpin keeps the CPU its first argument names busy from as many
// threads as its second says, says "spinning", and spins until its input
// ends.
func helperSpin(args []string) int {
	cpu, _ := strconv.Atoi(args[0])
	n, _ := strconv.Atoi(args[1])
	runtime.GOMAXPROCS(n + 1)
	var one unix.CPUSet
	one.Set(cpu)
	var spin atomic.Bool
	spin.Store(true)
	var ready sync.WaitGroup
	for range n {
		ready.Add(1)
		go func() {
			runtime.LockOSThread()
			if err := unix.SchedSetaffinity(0, &one); err != nil {
				fmt.Fprintln(os.Stderr, err)
				os.Exit(3)
			}
			ready.Done()
			for spin.Load() { // until the process ends
			}
		}()
	}
	ready.Wait()
	testproc.Say("spinning")
	for testproc.Commands().Scan() {
	}
	return 0
}

// spinOn keeps cpu busy from n threads of another process until stop is
// called (it returns once that process has ended) or the test ends.
func spinOn(t *testing.T, cpu, n int) (stop func()) {
	h := testproc.Start(t, "spin", []string{strconv.Itoa(cpu), strconv.Itoa(n)})
	h.Expect("spinning", 0)
	return func() {
		h.Kill()
		_ = h.Wait(0) // killed: no error worth a look
	}
}

// A lane thread bound to its caller's CPU that cannot run there, because
// something else keeps that CPU busy, is let go while it answers: it may
// run on the process's other CPUs, and the lane follows that peer no
// more, so that the locks its handler takes are not held on a CPU the
// peer keeps busy. Another peer's lane still follows. Here seven threads
// of another process spin on the CPU: the handler's thread, busy too,
// gets an eighth of it.
func TestAStarvedBoundLaneIsLetGo(t *testing.T) {
	cpu := lastCPU(t)
	s := startServer(t, starveHandler(nil, nil), withHello, withInline)
	c := laneClient(t, s, true, ipc.ClientConfig{})
	twice := func(c *ipc.Client, hint uint32) { createOn(t, c, 0x1000, hint); createOn(t, c, 0x1000, hint) }

	twice(c, uint32(cpu)+1)
	require.Equal(t, 1, threadsBoundTo(t, cpu), "the lane's thread follows its caller")
	starveOnce(t, c, cpu)
	assert.Equal(t, uint64(1), s.Stats().StarvedLanes)
	twice(c, uint32(cpu)+1)
	assert.Zero(t, threadsBoundTo(t, cpu), "the lane follows the peer that starved it no more")

	other := laneClient(t, s, true, ipc.ClientConfig{})
	twice(other, uint32(cpu)+1)
	assert.Equal(t, 1, threadsBoundTo(t, cpu), "another peer's lane still follows")
	twice(other, 0)
	assert.Zero(t, threadsBoundTo(t, cpu))
}

// A lane thread kept from its CPU is let go though the watch looks late
// every time (a loaded machine runs it late): the kernel counted the
// thread waiting to run for most of the time between two looks, which no
// stop of the server's own (stopped, traced) does. The hook has each look
// come 30 ms after the last, later than a look may come and still judge
// by the thread's CPU clock alone.
func TestAStarvedLaneIsLetGoThoughTheWatchLooksLate(t *testing.T) {
	cpu := lastCPU(t)
	defer ipc.SetLaneLookingHook(func() { time.Sleep(30 * time.Millisecond) })() // the watch's lateness
	s := startServer(t, starveHandler(nil, nil), withHello, withInline)
	c := laneClient(t, s, true, ipc.ClientConfig{})
	createOn(t, c, 0x1000, uint32(cpu)+1)
	createOn(t, c, 0x1000, uint32(cpu)+1)
	require.Equal(t, 1, threadsBoundTo(t, cpu), "the lane's thread follows its caller")
	starveOnce(t, c, cpu)
	assert.Equal(t, uint64(1), s.Stats().StarvedLanes)
}

// createOn asks for the MR at addr over c, naming CPU hint (0: none), and
// returns the key the handler answered.
func createOn(t *testing.T, c *ipc.Client, addr uint64, hint uint32) uint32 {
	t.Helper()
	var r ipc.CreateMRReply
	require.NoError(t, c.Call(ctxBound(t), ipc.KindCreateMR, &ipc.CreateMR{Addr: addr, CPU: hint}, &r))
	return r.LKey
}

// starveOnce has c's lane, bound to cpu, answer a request while seven
// threads of another process keep cpu busy: it must be let go.
func starveOnce(t *testing.T, c *ipc.Client, cpu int) {
	t.Helper()
	defer spinOn(t, cpu, 7)()
	assert.Equal(t, uint32(1), createOn(t, c, addrStarve, uint32(cpu)+1),
		"a lane thread kept from its CPU for %v was not let go", bound/2)
}

// A process whose lanes were let go twice is followed no more, on any of
// its connections, those it had open and those it makes later: each new
// connection would otherwise bring a lane to starve (and, should a garbage
// collection start meanwhile, the whole server to stop) once more. Once
// may be chance: another connection is still followed after the first.
func TestAProcessWhoseLanesStarvedTwiceIsFollowedNoMore(t *testing.T) {
	cpu := lastCPU(t)
	s := startServer(t, starveHandler(nil, nil), withHello, withInline)
	twice := func(c *ipc.Client, hint uint32) { createOn(t, c, 0x1000, hint); createOn(t, c, 0x1000, hint) }
	open := laneClient(t, s, true, ipc.ClientConfig{})
	twice(open, 0)

	for i := range 2 {
		c := laneClient(t, s, true, ipc.ClientConfig{})
		twice(c, uint32(cpu)+1)
		require.Equal(t, 1, threadsBoundTo(t, cpu), "connection %d's lane follows its caller", i+1)
		starveOnce(t, c, cpu)
		twice(c, uint32(cpu)+1)
		assert.Zero(t, threadsBoundTo(t, cpu), "connection %d's lane follows no more", i+1)
	}
	assert.Equal(t, uint64(2), s.Stats().StarvedLanes)

	later := laneClient(t, s, true, ipc.ClientConfig{})
	twice(later, uint32(cpu)+1)
	assert.Zero(t, threadsBoundTo(t, cpu), "a connection the process made after its second let-go is followed")
	twice(open, uint32(cpu)+1)
	assert.Zero(t, threadsBoundTo(t, cpu), "a connection the process had open is followed")
}

// A bound lane thread whose handler waits (for a lock, say) is not let go
// however long it waits: only a thread kept from running is.
func TestABoundLaneThatWaitsIsNotLetGo(t *testing.T) {
	cpu := lastCPU(t)
	started, release := make(chan struct{}), make(chan struct{})
	s := startServer(t, starveHandler(started, release), withHello, withInline)
	c := laneClient(t, s, true, ipc.ClientConfig{})
	call := func(addr uint64, hint uint32) {
		t.Helper()
		require.NoError(t, c.Call(ctxBound(t), ipc.KindCreateMR, &ipc.CreateMR{Addr: addr, CPU: hint}, &ipc.CreateMRReply{}))
	}
	twice := func(hint uint32) { call(0x1000, hint); call(0x1000, hint) }
	twice(uint32(cpu) + 1)
	require.Equal(t, 1, threadsBoundTo(t, cpu), "the lane's thread follows its caller")
	let := sync.OnceFunc(func() { close(release) })
	defer func() {
		let() // first, should the test fail with the handler waiting
		twice(0)
		assert.Zero(t, threadsBoundTo(t, cpu))
	}()

	answered := make(chan struct{})
	go func() { defer close(answered); call(addrWait, uint32(cpu)+1) }()
	waitFor(t, started, "the waiting request's handler")
	// Three looks at the lane while the handler waits.
	waitLooks(t, s, 3)
	let()
	waitFor(t, answered, "the answer")
	twice(uint32(cpu) + 1)
	assert.Equal(t, 1, threadsBoundTo(t, cpu), "the lane still follows its caller")
	assert.Zero(t, s.Stats().StarvedLanes)
}

// A lane bound when its process is marked (its second lane let go) is let
// go at the watch's next look: waiting for a request, it would otherwise
// answer the next one on the CPU its peer named, and may starve there
// once more. Two lanes are bound at once here (GOMAXPROCS 3).
func TestALaneBoundWhenItsProcessIsMarkedIsLetGo(t *testing.T) {
	cpus := testenv.NeedCPUs(t, 2)
	first, last := cpus[0], cpus[len(cpus)-1]
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(3))
	s := startServer(t, starveHandler(nil, nil), withHello, withInline)
	open, tid := boundLane(t, s, first)
	for i := range 2 {
		c := laneClient(t, s, true, ipc.ClientConfig{})
		require.Equal(t, last, laneCPUOf(t, c, last), "connection %d's lane follows its caller", i+1)
		starveOnce(t, c, last)
		require.Equal(t, -1, laneCPUOf(t, c, last), "connection %d's lane follows no more", i+1)
	}
	require.True(t, eventually(func() bool { return ipc.StarvedLetGos(s.Server, os.Getpid()) == 2 }), "both let-gos counted")
	waitUntil(t, func() bool {
		var set unix.CPUSet
		return unix.SchedGetaffinity(tid, &set) == nil && (set.Count() > 1 || !set.IsSet(first))
	}, "the open lane, bound when its process was marked, was not let go")
	assert.Equal(t, -1, laneCPUOf(t, open, first), "the open lane follows its caller still")
	assert.Equal(t, uint64(2), s.Stats().StarvedLanes)
}

// helperStarver connects to the socket args[0] names, says hello, has its
// lane follow CPU args[1], asks for addrStarve there, and exits.
func helperStarver(args []string) int {
	cpu, _ := strconv.Atoi(args[1])
	ctx, cancel := context.WithTimeout(context.Background(), bound)
	defer cancel()
	c, err := dialHello(ctx, args[0])
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 3
	}
	defer c.Close()
	for _, addr := range []uint64{0x1000, addrStarve} {
		if err := c.Call(ctx, ipc.KindCreateMR, &ipc.CreateMR{Addr: addr, CPU: uint32(cpu) + 1}, nil); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 3
		}
	}
	return 0
}

// Processes of one user that each connect once, name a CPU something keeps
// busy and exit (a parent forking a child per connection) have their lanes
// let go laneStarvedPerUser times in all; after that the user's processes
// are followed no more, the test's own included.
func TestTheLanesOfOneUsersProcessesStarveAtMostItsShare(t *testing.T) {
	cpu := lastCPU(t)
	s := startServer(t, starveHandler(nil, nil), withHello, withInline)
	func() {
		defer spinOn(t, cpu, 7)()
		for range ipc.LaneStarvedPerUser + 2 {
			require.NoError(t, testproc.Start(t, "starver", []string{s.path, strconv.Itoa(cpu)}).Wait(bound))
		}
	}()
	assert.Equal(t, uint64(ipc.LaneStarvedPerUser), s.Stats().StarvedLanes)
	c := laneClient(t, s, true, ipc.ClientConfig{})
	assert.Equal(t, -1, laneCPUOf(t, c, cpu), "a lane of the user's followed")
}

// A let-go counts as the watch makes it, while the request its lane was
// let go in still runs (its answer may wait long for room in a lane whose
// peer does not read it): the process's other lanes must not bind and
// starve meanwhile. Two lanes may be bound at once here (GOMAXPROCS 3).
func TestALetGoCountsWhileItsRequestRuns(t *testing.T) {
	cpus := testenv.NeedCPUs(t, 2)
	first, last := cpus[0], cpus[len(cpus)-1]
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(3))
	started, release := make(chan struct{}, 1), make(chan struct{})
	s := startServer(t, starveHandler(started, release), withHello, withInline)
	a := laneClient(t, s, true, ipc.ClientConfig{})
	require.Equal(t, last, laneCPUOf(t, a, last))
	answered := make(chan error, 1)
	func() {
		defer spinOn(t, last, 7)()
		go func() {
			answered <- a.Call(context.Background(), ipc.KindCreateMR, &ipc.CreateMR{Addr: addrStarveHold, CPU: uint32(last) + 1}, nil)
		}()
		waitFor(t, started, "a's lane let go, its request running on")
	}()
	assert.Equal(t, 1, ipc.StarvedLetGos(s.Server, os.Getpid()), "a's let-go, its request still running")

	b := laneClient(t, s, true, ipc.ClientConfig{})
	require.Equal(t, first, laneCPUOf(t, b, first), "one let-go of the process: another lane follows")
	starveOnce(t, b, first)
	c := laneClient(t, s, true, ipc.ClientConfig{})
	assert.Equal(t, -1, laneCPUOf(t, c, first), "two let-gos of the process, one of them still answering: a third lane follows")
	close(release)
	require.NoError(t, waitFor(t, answered, "a's answer"))
	assert.Equal(t, uint64(2), s.Stats().StarvedLanes)
}

// A process whose lanes were never let go is forgotten once its last
// connection ends: the server remembers only the processes it serves and
// those whose lanes it let go.
func TestAProcessIsForgottenWithItsLastConnection(t *testing.T) {
	cpu := lastCPU(t)
	s := startServer(t, followHandler(), withHello, withInline)
	c := laneClient(t, s, true, ipc.ClientConfig{})
	require.Equal(t, cpu, laneCPUOf(t, c, cpu))
	assert.Equal(t, 1, ipc.ProcessesRemembered(s.Server), "the process of a lane that followed")
	laneCPUOf(t, c, -1)
	require.NoError(t, c.Close())
	require.True(t, eventually(func() bool { return ipc.ProcessesRemembered(s.Server) == 0 }),
		"a process none of whose lanes was let go is remembered after its last connection ended")
}

// A lane that answers a request when its process is marked may be kept
// from running as much as the lanes that were: it is let go, and stays
// among the bound lanes (their number keeps a P for the rest of the
// server) until it unbinds after the request. Two lanes may be bound at
// once here (GOMAXPROCS 3).
func TestALaneBusyWhenItsProcessIsMarkedStaysBoundUntilItUnbinds(t *testing.T) {
	cpus := testenv.NeedCPUs(t, 2)
	first, last := cpus[0], cpus[len(cpus)-1]
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(3))
	started, release := make(chan struct{}, 1), make(chan struct{})
	let := sync.OnceFunc(func() { close(release) })
	defer let() // first, should the test fail with the handler waiting
	s := startServer(t, starveHandler(started, release), withHello, withInline)
	a, tid := boundLane(t, s, first)
	answered := make(chan error, 1)
	go func() {
		answered <- a.Call(context.Background(), ipc.KindCreateMR, &ipc.CreateMR{Addr: addrWait, CPU: uint32(first) + 1}, nil)
	}()
	waitFor(t, started, "a's request")
	for i := range 2 {
		// The lane let go before has answered, and gives its CPU back as
		// its thread next runs: only a's lane is bound then.
		waitUntil(t, func() bool { return ipc.BoundLanes(s.Server) == 1 }, "a's lane the only one bound")
		c := laneClient(t, s, true, ipc.ClientConfig{})
		require.Equal(t, last, laneCPUOf(t, c, last), "connection %d's lane follows its caller", i+1)
		starveOnce(t, c, last)
	}
	waitUntil(t, func() bool {
		var set unix.CPUSet
		return unix.SchedGetaffinity(tid, &set) == nil && (set.Count() > 1 || !set.IsSet(first))
	}, "a's lane, busy when its process was marked, was not let go")
	// The second connection's lane gives its CPU back as its thread next
	// runs; a's stays.
	waitUntil(t, func() bool { return !slices.Contains(ipc.BoundLaneCPUs(s.Server), last) }, "the second connection's lane unbound")
	assert.Equal(t, []int{first}, ipc.BoundLaneCPUs(s.Server), "a's lane left the bound lanes while it answers")
	let()
	require.NoError(t, waitFor(t, answered, "a's answer"))
	assert.Equal(t, -1, laneCPUOf(t, a, first))
	assert.Zero(t, ipc.BoundLanes(s.Server), "a's lane unbound after its request")
}

// A let-go counts against its peer's process even when the peer hangs up
// on the request its lane starved in: the lane counts it once it has
// answered, whether or not the answer can go.
func TestALetGoCountsWhenThePeerHangsUpOnTheStarvedRequest(t *testing.T) {
	cpu := lastCPU(t)
	started, release := make(chan struct{}, 1), make(chan struct{})
	s := startServer(t, starveHandler(started, release), withHello, withInline)
	c := laneClient(t, s, true, ipc.ClientConfig{})
	createOn(t, c, 0x1000, uint32(cpu)+1)
	createOn(t, c, 0x1000, uint32(cpu)+1)
	require.Equal(t, 1, threadsBoundTo(t, cpu), "the lane's thread follows its caller")
	func() {
		defer spinOn(t, cpu, 7)()
		go func() {
			_ = c.Call(context.Background(), ipc.KindCreateMR, &ipc.CreateMR{Addr: addrStarveHold, CPU: uint32(cpu) + 1}, nil)
		}()
		waitFor(t, started, "the starving request's handler")
	}()
	require.Equal(t, uint64(1), s.Stats().StarvedLanes, "the lane was let go")
	require.NoError(t, c.Close())
	close(release) // the answer finds the lane gone
	require.True(t, eventually(func() bool { return ipc.StarvedLetGos(s.Server, os.Getpid()) == 1 }),
		"the let-go counted against the process")
}

// threadsWithCPUs counts this process's threads whose affinity is exactly
// set.
func threadsWithCPUs(t *testing.T, set unix.CPUSet) int {
	t.Helper()
	tasks, err := os.ReadDir("/proc/self/task")
	require.NoError(t, err)
	n := 0
	for _, task := range tasks {
		tid, err := strconv.Atoi(task.Name())
		require.NoError(t, err)
		var s unix.CPUSet
		if unix.SchedGetaffinity(tid, &s) == nil && s == set {
			n++
		}
	}
	return n
}

// The thread that watches the bound lanes keeps off their CPUs, which
// their peers may keep busy, and has its CPUs back once no lane is bound.
func TestTheLaneWatchKeepsOffTheLanesCPUs(t *testing.T) {
	cpu := lastCPU(t)
	var home unix.CPUSet
	require.NoError(t, unix.SchedGetaffinity(0, &home))
	away := home
	away.Clear(cpu)
	s := startServer(t, followHandler(), withHello, withInline)
	c := laneClient(t, s, true, ipc.ClientConfig{})
	before := threadsWithCPUs(t, away)
	require.Equal(t, cpu, laneCPUOf(t, c, cpu), "the lane's thread follows its caller")
	waitLooks(t, s, 2)
	assert.Equal(t, before+1, threadsWithCPUs(t, away), "the watching thread keeps off the lane's CPU")

	require.Equal(t, -1, laneCPUOf(t, c, -1))
	watchEnds(t, s)
	assert.Equal(t, before, threadsWithCPUs(t, away), "the watching thread has its CPUs back")
}

// laneCPUOf asks c's lane to follow cpu (none if negative) twice, and
// returns the CPU that lane's thread is bound to then, or -1 if it may
// run on more than one: the binding each request asks for is in place
// before the next is read.
func laneCPUOf(t *testing.T, c *ipc.Client, cpu int) int {
	t.Helper()
	var r ipc.CreateMRReply
	for range 2 {
		require.NoError(t, c.Call(ctxBound(t), ipc.KindCreateMR, &ipc.CreateMR{Addr: 0x1000, CPU: uint32(cpu + 1)}, &r))
	}
	var set unix.CPUSet
	require.NoError(t, unix.SchedGetaffinity(laneTID(r), &set))
	if set.Count() != 1 {
		return -1
	}
	for i := range len(set) * 64 {
		if set.IsSet(i) {
			return i
		}
	}
	return -1
}

// waitUntil waits for done to report true, failing t with what (and
// bound) if it does not within bound.
func waitUntil(t *testing.T, done func() bool, what string) {
	t.Helper()
	for end := time.Now().Add(bound); !done(); runtime.Gosched() {
		require.True(t, time.Now().Before(end), "%s for %v", what, bound)
	}
}

// waitLooks waits for s to look at its bound lanes n more times.
func waitLooks(t *testing.T, s *testServer, n uint64) {
	t.Helper()
	from := ipc.LaneChecks(s.Server)
	waitUntil(t, func() bool { return ipc.LaneChecks(s.Server) >= from+n }, "the server did not look at its bound lanes")
}

// laneTID returns the id of the lane thread that made r, an answer of
// followHandler's.
func laneTID(r ipc.CreateMRReply) int { return int(r.End - r.Start - 1) }

// watchEnds waits for s's watch of its bound lanes to end, once none is
// bound: its thread keeps off their CPUs meanwhile.
func watchEnds(t *testing.T, s *testServer) {
	t.Helper()
	waitUntil(t, func() bool { return !ipc.LaneCheckerRunning(s.Server) }, "the watch ran on after the last lane was unbound")
}

// One lane follows each CPU, and no more lanes are bound than leaves the
// process a P: a lane thread kept from running holds its P, and with every
// P so held nothing else in the process runs, the watch included. A peer
// not followed for that is followed once the CPU is free again.
func TestBoundLanesLeaveAPAndShareNoCPU(t *testing.T) {
	cpus := testenv.NeedCPUs(t, 2)
	first, last := cpus[0], cpus[len(cpus)-1]
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(2))
	s := startServer(t, followHandler(), withHello, withInline)
	clients := [3]*ipc.Client{}
	for i := range clients {
		clients[i] = laneClient(t, s, true, ipc.ClientConfig{})
	}
	require.Equal(t, last, laneCPUOf(t, clients[0], last), "the first lane follows its caller")
	defer func() {
		for _, c := range clients {
			laneCPUOf(t, c, -1)
		}
		watchEnds(t, s)
		assert.Zero(t, threadsBoundTo(t, last))
		assert.Zero(t, threadsBoundTo(t, first))
	}()
	assert.Equal(t, -1, laneCPUOf(t, clients[1], last), "a second lane does not follow its caller to a CPU a lane has")
	assert.Equal(t, -1, laneCPUOf(t, clients[2], first), "with GOMAXPROCS 2, a second lane bound would leave no P")
	// The third asks no more: a lane binds after its answer has gone, so
	// the last request it made while refused could otherwise take the
	// first lane's CPU slot as it is given back, before the second asks.
	require.Equal(t, -1, laneCPUOf(t, clients[2], -1), "the third lane asks for no CPU")

	require.Equal(t, -1, laneCPUOf(t, clients[0], -1), "the first lane let go of its CPU")
	assert.Equal(t, last, laneCPUOf(t, clients[1], last), "the second lane follows once the CPU is free (lanes let go starved: %d)", s.Stats().StarvedLanes)
}

// Lanes bound past GOMAXPROCS-1 when GOMAXPROCS falls (a program's call,
// or the runtime following its cgroup's CPU limit) follow their peers no
// more, the last bound first.
func TestLanesPastAFallenGOMAXPROCSAreLetGo(t *testing.T) {
	cpus := testenv.NeedCPUs(t, 2)
	first, last := cpus[0], cpus[len(cpus)-1]
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(3))
	s := startServer(t, followHandler(), withHello, withInline)
	a, b := laneClient(t, s, true, ipc.ClientConfig{}), laneClient(t, s, true, ipc.ClientConfig{})
	defer func() {
		laneCPUOf(t, a, -1)
		laneCPUOf(t, b, -1)
		watchEnds(t, s)
		assert.Zero(t, threadsBoundTo(t, last))
		assert.Zero(t, threadsBoundTo(t, first))
	}()
	require.Equal(t, last, laneCPUOf(t, a, last), "with GOMAXPROCS 3, two lanes follow")
	require.Equal(t, first, laneCPUOf(t, b, first), "with GOMAXPROCS 3, two lanes follow")

	runtime.GOMAXPROCS(2)
	waitLooks(t, s, 2)
	// The evicted lane lets go of its CPU at once, whether or not its peer
	// asks anything again: once the first lane is unbound, another may
	// take it.
	require.Equal(t, last, laneCPUOf(t, a, last), "the lane bound first still follows")
	require.Equal(t, -1, laneCPUOf(t, a, -1))
	c := laneClient(t, s, true, ipc.ClientConfig{})
	assert.Equal(t, first, laneCPUOf(t, c, first), "the evicted lane left its CPU to others")
	laneCPUOf(t, c, -1)
	assert.Equal(t, -1, laneCPUOf(t, b, first), "the lane bound last follows its peer no more")
	assert.Zero(t, s.Stats().StarvedLanes, "not for want of its CPU")
}

// A lane refused a CPU (another lane has it) does not ask for it again at
// every request: only once the bound lanes change, or every so often.
func TestARefusedLaneDoesNotAskAtEveryRequest(t *testing.T) {
	cpu := lastCPU(t)
	s := startServer(t, followHandler(), withHello, withInline)
	a, b := laneClient(t, s, true, ipc.ClientConfig{}), laneClient(t, s, true, ipc.ClientConfig{})
	require.Equal(t, cpu, laneCPUOf(t, a, cpu))
	defer func() {
		laneCPUOf(t, a, -1)
		laneCPUOf(t, b, -1)
	}()
	from := ipc.LaneTakes(s.Server)
	for range 50 {
		require.Equal(t, -1, laneCPUOf(t, b, cpu), "a CPU another lane has")
	}
	assert.LessOrEqual(t, ipc.LaneTakes(s.Server)-from, uint64(2), "asked for at each of 100 requests")
	require.Equal(t, -1, laneCPUOf(t, a, -1))
	assert.Equal(t, cpu, laneCPUOf(t, b, cpu), "asked again once the CPU is free")
}

// boundTo returns the CPU thread tid is bound to, or -1 if it may run on
// more than one.
func boundTo(t *testing.T, tid int) int {
	t.Helper()
	var set unix.CPUSet
	require.NoError(t, unix.SchedGetaffinity(tid, &set))
	for i := range len(set) * 64 {
		if set.Count() == 1 && set.IsSet(i) {
			return i
		}
	}
	return -1
}

// boundLane makes a client of s whose lane is bound to cpu, and returns
// it with the lane's thread.
func boundLane(t *testing.T, s *testServer, cpu int) (c *ipc.Client, tid int) {
	t.Helper()
	c = laneClient(t, s, true, ipc.ClientConfig{})
	require.Equal(t, cpu, laneCPUOf(t, c, cpu))
	var r ipc.CreateMRReply
	require.NoError(t, c.Call(ctxBound(t), ipc.KindCreateMR, &ipc.CreateMR{Addr: 0x1000, CPU: uint32(cpu + 1)}, &r))
	return c, laneTID(r)
}

// quietPair starts a server whose quiet lanes give way after idle, with a
// client a whose lane is bound to the last CPU (tid is its thread) and a
// client b that has a lane; when the test ends, both lanes are unbound
// and the watch has ended.
func quietPair(t *testing.T, idle time.Duration) (s *testServer, cpu int, a *ipc.Client, tid int, b *ipc.Client) {
	t.Helper()
	cpu = lastCPU(t)
	t.Cleanup(ipc.SetLaneIdleAfter(idle))
	s = startServer(t, followHandler(), withHello, withInline)
	a, tid = boundLane(t, s, cpu)
	b = laneClient(t, s, true, ipc.ClientConfig{})
	t.Cleanup(func() {
		laneCPUOf(t, a, -1)
		laneCPUOf(t, b, -1)
		watchEnds(t, s)
	})
	return s, cpu, a, tid, b
}

// refusedUnlessGivenBack checks that b's lane, asking for cpu, which a
// quiet lane holds, is refused it, unless the watch (which looks every
// 5 ms) looked between b's requests and the quiet lane gave the CPU back
// at once: then b follows its peer there, and the give-back was counted
// already (the watch counts it under the lock a lane takes to bind).
func refusedUnlessGivenBack(t *testing.T, s *testServer, b *ipc.Client, cpu int) {
	t.Helper()
	if got := laneCPUOf(t, b, cpu); got != -1 {
		require.Equal(t, cpu, got, "a CPU another lane has")
		require.NotZero(t, s.Stats().IdleLanes, "a CPU another lane has, and did not give back")
	}
}

// A lane whose peer asks nothing for a while gives its CPU back to a lane
// that was refused one meanwhile, and follows its own peer again once a
// CPU is free; a quiet lane nobody waits for keeps its CPU.
func TestAnIdleLaneGivesItsCPUToALaneWaitingForOne(t *testing.T) {
	const idle = 50 * time.Millisecond
	s, cpu, a, tid, b := quietPair(t, idle)

	waitLooks(t, s, uint64(3*idle/(5*time.Millisecond)))
	require.Equal(t, cpu, boundTo(t, tid), "a quiet lane nobody waits for keeps its CPU")

	refusedUnlessGivenBack(t, s, b, cpu)
	waitUntil(t, func() bool { return s.Stats().IdleLanes != 0 }, "the quiet lane kept its CPU from a lane waiting for it")
	assert.Equal(t, -1, boundTo(t, tid), "the quiet lane's thread may run anywhere again")
	assert.Equal(t, cpu, laneCPUOf(t, b, cpu), "the waiting lane follows its peer once the CPU is free")
	assert.Equal(t, -1, laneCPUOf(t, a, cpu), "the lane that gave the CPU back waits for it in turn")
	require.Equal(t, -1, laneCPUOf(t, b, -1))
	assert.Equal(t, cpu, laneCPUOf(t, a, cpu), "and follows its peer again once it is free")
	assert.Zero(t, s.Stats().StarvedLanes)
}

// A quiet lane is judged by the looks that come in time. A look that comes
// late may have measured a stall of the server's own (stopped, traced),
// when the lane's thread could not take its peer's requests either: the
// quiet is measured again from then, and a lane that waits for the CPU
// does not get it at that look.
func TestALateLookDoesNotGiveAQuietLanesCPUAway(t *testing.T) {
	const idle = 300 * time.Millisecond
	s, cpu, _, _, b := quietPair(t, idle)

	var step atomic.Int32 // 1: stall before the next look; 2: report before the one after
	stalling, asked := make(chan struct{}), make(chan struct{})
	type state struct {
		idle  uint64
		bound []int
	}
	after := make(chan state, 1)
	defer ipc.SetLaneLookingHook(func() {
		switch step.Load() {
		case 1:
			step.Store(2)
			close(stalling)
			<-asked
			time.Sleep(3 * idle) // the server's own stall, as its watch sees it
		case 2:
			step.Store(0)
			after <- state{s.Stats().IdleLanes, ipc.BoundLaneCPUs(s.Server)}
		}
	})()
	release := sync.OnceFunc(func() { close(asked) })
	defer release()    // should the test end early: the watch must not wait
	waitLooks(t, s, 2) // the quiet measured from a look in time
	step.Store(1)
	<-stalling
	require.Equal(t, -1, laneCPUOf(t, b, cpu), "a CPU another lane has, while the watch cannot look")
	release()
	st := <-after
	assert.Zero(t, st.idle, "the quiet lane gave its CPU away at a look that came late")
	assert.Equal(t, []int{cpu}, st.bound, "lanes bound after the late look")
}

// A quiet lane keeps its CPU unless giving it back lets a lane that waits
// bind: not for a lane that has ended, nor for one that names a CPU the
// process may not use, nor for one that waits for another lane's CPU.
func TestAQuietLaneKeepsItsCPUUnlessThatHelpsALaneWaiting(t *testing.T) {
	cpus := testenv.NeedCPUs(t, 2)
	first, last := cpus[0], cpus[len(cpus)-1]
	const idle = 20 * time.Millisecond
	defer ipc.SetLaneIdleAfter(idle)()
	quietLooks := uint64(3 * idle / (5 * time.Millisecond))
	// keeps checks that s's lane on thread tid keeps cpu while quiet.
	keeps := func(t *testing.T, s *testServer, tid, cpu int) {
		t.Helper()
		waitLooks(t, s, quietLooks)
		assert.Zero(t, s.Stats().IdleLanes)
		assert.Equal(t, cpu, boundTo(t, tid), "a quiet lane keeps its CPU")
	}

	t.Run("the waiting lane ended", func(t *testing.T) {
		s := startServer(t, followHandler(), withHello, withInline)
		a, tid := boundLane(t, s, last)
		defer func() { laneCPUOf(t, a, -1); watchEnds(t, s) }()
		b := laneClient(t, s, true, ipc.ClientConfig{})
		require.Equal(t, -1, laneCPUOf(t, b, last))
		require.Equal(t, 1, ipc.LanesWaiting(s.Server))
		require.NoError(t, b.Close())
		waitUntil(t, func() bool { return ipc.LanesWaiting(s.Server) == 0 }, "a lane that ended still waited for a CPU")
		keeps(t, s, tid, last)
	})
	t.Run("the waiting lane names a CPU it may not use", func(t *testing.T) {
		defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(2))
		s := startServer(t, followHandler(), withHello, withInline)
		a, tid := boundLane(t, s, last)
		b := laneClient(t, s, true, ipc.ClientConfig{})
		defer func() { laneCPUOf(t, a, -1); laneCPUOf(t, b, -1); watchEnds(t, s) }()
		require.Equal(t, -1, laneCPUOf(t, b, 1000), "no machine here has CPU 1000")
		assert.Zero(t, ipc.LanesWaiting(s.Server), "ignored, not waited for")
		keeps(t, s, tid, last)
	})
	t.Run("the waiting lane names another lane's CPU", func(t *testing.T) {
		defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(3))
		s := startServer(t, followHandler(), withHello, withInline)
		a, tid := boundLane(t, s, first)
		c, _ := boundLane(t, s, last)
		b := laneClient(t, s, true, ipc.ClientConfig{})
		defer func() { laneCPUOf(t, a, -1); laneCPUOf(t, b, -1); laneCPUOf(t, c, -1); watchEnds(t, s) }()
		require.Equal(t, -1, laneCPUOf(t, b, last), "c has it")
		waitUntil(t, func() bool { return s.Stats().IdleLanes != 0 }, "c, quiet, kept the CPU b waits for")
		waitLooks(t, s, quietLooks)
		assert.Equal(t, uint64(1), s.Stats().IdleLanes, "c gave its CPU back, and only c")
		assert.Equal(t, first, boundTo(t, tid), "a quiet lane whose CPU nobody waits for keeps it")
		assert.Equal(t, last, laneCPUOf(t, b, last))
	})
}

// A lane that was refused a CPU and then asks nothing more waits for it
// no longer once the lanes change: a quiet lane gives its CPU back for it
// once, not again each time it has been quiet for a while.
func TestALaneThatStoppedAskingIsNotWaitedForAgain(t *testing.T) {
	const idle = 20 * time.Millisecond
	s, cpu, a, _, b := quietPair(t, idle)
	refusedUnlessGivenBack(t, s, b, cpu)
	waitUntil(t, func() bool { return s.Stats().IdleLanes != 0 }, "the quiet lane kept its CPU from a lane waiting for it")
	// b asks nothing more: a takes its CPU back.
	require.Equal(t, cpu, laneCPUOf(t, a, cpu), "the CPU was free again")
	waitLooks(t, s, uint64(3*idle/(5*time.Millisecond)))
	assert.Equal(t, uint64(1), s.Stats().IdleLanes, "given back again for a lane that asked nothing since")
}

// A lane thread kept from its CPU while the server closes is still let go:
// Close waits for the lanes, and would wait for that one as long as its
// CPU stays busy.
func TestAStarvedLaneIsLetGoWhileTheServerCloses(t *testing.T) {
	cpu := lastCPU(t)
	h := starveHandler(nil, nil)
	starve := h.handle
	running, result := make(chan struct{}), make(chan uint32, 1)
	h.handle = func(ctx context.Context, p *ipc.Peer, kind ipc.Kind, body *ipc.Decoder) (any, error, bool) {
		var m ipc.CreateMR
		if kind == ipc.KindCreateMR && body.Decode(&m) == nil && m.Addr == addrStarve {
			close(running)
		}
		reply, err, ok := starve(ctx, p, kind, body)
		if r, _ := reply.(*ipc.CreateMRReply); r != nil && r.Start == addrStarve {
			result <- r.LKey
		}
		return reply, err, ok
	}
	s := startServer(t, h, withHello, withInline)
	c := laneClient(t, s, true, ipc.ClientConfig{})
	require.Equal(t, cpu, laneCPUOf(t, c, cpu))
	defer spinOn(t, cpu, 7)()
	go func() {
		_ = c.Call(context.Background(), ipc.KindCreateMR, &ipc.CreateMR{Addr: addrStarve, CPU: uint32(cpu) + 1}, nil)
	}()
	<-running
	require.NoError(t, s.Close())
	assert.Equal(t, uint32(1), <-result, "a lane thread kept from its CPU while the server closed was not let go in %v", bound/2)
	assert.Equal(t, uint64(1), s.Stats().StarvedLanes)
}
