package primary_test

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/mpmr/mpmr/cache"
	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/primary"
	"github.com/mpmr/mpmr/secondary"
	"github.com/mpmr/mpmr/verbs"
)

// Breaker 13: Close under live queues leaves the control segment's range
// as private zeros (shm.Segment.CloseUnderReaders). What reads a zero
// segment, what decides between zeros and munmap, and what the zeros cost.

func init() {
	// b13-primary-close PREFIX RUNDIR CASE: a primary of its own, closed,
	// then CASE; "bad ..." for a wrong answer, "done" at the end.
	testproc.Register("b13-primary-close", b13PrimaryClose)
	// b13-secondary-close PREFIX RUNDIR ADDR CASE: the same for a
	// secondary of the test's primary.
	testproc.Register("b13-secondary-close", b13SecondaryClose)
	// b13-sec-hit PREFIX RUNDIR ADDR: attaches, warms a queue on ADDR
	// ("warm KEY"), then runs commands: "close" -> "> closed", "hit" ->
	// "> hit KEY OK", "> local KEY ERR" (the embedded cache.Local's
	// Lookup, as a lookup racing Close makes it) and "> regpool ERR"
	// (Queue.RegisterMempool of ADDR's page).
	testproc.Register("b13-sec-hit", b13SecHit)
	// b13-cycles PREFIX RUNDIR ADDR ROUNDS MODE: attach / queue / Close
	// ROUNDS times under an address-space limit (RLIMIT_AS) that leaves
	// room for a few segments; MODE "after" closes the queue right after
	// the secondary, "before" closes it first (the documented order).
	testproc.Register("b13-cycles", b13Cycles)
	// b13-close-free PREFIX RUNDIR ADDR LEN: four queues look up
	// [ADDR, +LEN) through their cache.Local; "close" -> "closing", the
	// secondary closes under them, "> closed"; the queues go on until
	// "exit".
	testproc.Register("b13-close-free", b13CloseFree)
}

func b13CloseFree(args []string) int {
	addr, _ := strconv.ParseUint(args[2], 0, 64)
	n, _ := strconv.ParseUint(args[3], 0, 64)
	s, err := secondary.Attach(secondary.Config{Prefix: args[0], RuntimeDir: args[1], Logger: quiet})
	if err != nil {
		testproc.Say("attach-failed %v", err)
		return 3
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var warmed sync.WaitGroup
	for g := range 4 {
		q := s.NewQueue()
		wg.Add(1)
		warmed.Add(1)
		go func() {
			defer wg.Done()
			keys := make([]uint32, 4)
			addrs := make([]uintptr, 4)
			for i := 0; ; i++ {
				if i == 1000 {
					warmed.Done()
				}
				select {
				case <-stop:
					return
				default:
				}
				a := uintptr(addr + uint64(g*4096+i*64)%n)
				_, _ = q.Local.Lookup(a)
				for j := range addrs {
					addrs[j] = a + uintptr(j)*8
				}
				_, _ = q.Local.LookupBurst(addrs, keys)
				_, _ = q.Local.LookupRange(a, 8)
			}
		}()
	}
	warmed.Wait()
	testproc.Say("ready")
	testproc.EachCommand(func(c testproc.Line) {
		switch c.Name {
		case "close":
			testproc.Say("closing")
			if err := s.Close(); err != nil {
				testproc.Say("> err %v", err)
			} else {
				testproc.Say("> closed")
			}
		case "exit":
			close(stop)
			wg.Wait()
			testproc.Say("> bye")
		}
	})
	return 0
}

func b13PrimaryClose(args []string) int {
	p, err := primary.Start(primary.Config{Prefix: args[0], RuntimeDir: args[1], Backend: hugetlb.Tmpfs, MemoryPages: 16, Logger: quiet})
	if err != nil {
		testproc.Say("start-failed %v", err)
		return 3
	}
	r, err := p.Alloc(p.Backend().PageSize)
	if err != nil {
		testproc.Say("alloc-failed %v", err)
		return 3
	}
	testproc.Say("ready")
	switch args[2] {
	case "newqueue":
		// The documented order: queues closed first, so Close unmaps.
		// A queue made afterwards (a datapath thread started late, or
		// one that lost the race with Close's check for live queues).
		q0 := p.NewQueue()
		if _, err := q0.Lookup(r.Addr); err != nil {
			testproc.Say("bad lookup before close: %v", err)
		}
		q0.Close()
		_ = p.Close()
		testproc.Say("closed")
		q := p.NewQueue()
		testproc.Say("made")
		if k, err := q.Lookup(r.Addr); err == nil {
			testproc.Say("bad lookup after close: key %d", k)
		}
	case "stale", "stale-after-free":
		// A queue left open across Close: Close deregisters every MR and
		// releases the memory. Its lookups afterwards must not hand out
		// the key of an MR that no longer exists.
		q := p.NewQueue()
		k, err := q.Lookup(r.Addr)
		if err != nil {
			testproc.Say("bad lookup before close: %v", err)
		}
		if args[2] == "stale-after-free" {
			// One invalidation seen first: the queue remembers generation 1.
			r2, err := p.Alloc(p.Backend().PageSize)
			if err == nil {
				_, err = q.Lookup(r2.Addr) // registered, so that freeing it invalidates
			}
			if err == nil {
				err = p.Free(r2)
			}
			if err != nil {
				testproc.Say("bad alloc/free: %v", err)
			}
			if _, err := q.Lookup(r.Addr); err != nil {
				testproc.Say("bad lookup before close: %v", err)
			}
		}
		gen := p.Global().DevGen()
		_ = p.Close()
		if k2, err := q.Lookup(r.Addr); err == nil {
			testproc.Say("bad Lookup after Close: key %d (the one before: %d, generation before Close %d)", k2, k, gen)
		}
		if k2, ok := q.Hit(r.Addr); ok {
			testproc.Say("bad Hit after Close: key %d", k2)
		}
		if k2, err := q.LookupRange(r.Addr, 64); err == nil {
			testproc.Say("bad LookupRange after Close: key %d", k2)
		}
		keys := make([]uint32, 4)
		if n, err := q.LookupBurst([]uintptr{r.Addr, r.Addr + 64, r.Addr + 128, r.Addr + 192}, keys); err == nil || n > 0 {
			testproc.Say("bad LookupBurst after Close: %d answered (%v), keys %v", n, err, keys[:n])
		}
		if err := q.RegisterMempool(chunkPool{{Addr: r.Addr, Len: 4096}}); err == nil {
			testproc.Say("bad RegisterMempool after Close: nil")
		}
	case "shared":
		// A read section of the global lock (Shared, as a lookup's
		// lookupLocked takes one) that Close overtakes. With a queue
		// open, Close leaves zeros: the read section must end with an
		// error, not a panic.
		q := p.NewQueue()
		if _, err := q.Lookup(r.Addr); err != nil {
			testproc.Say("bad lookup before close: %v", err)
		}
		in, leave, left := make(chan struct{}), make(chan struct{}), make(chan error, 1)
		go func() {
			left <- p.Global().Shared(func() {
				close(in)
				<-leave
			})
		}()
		<-in
		_ = p.Close()
		testproc.Say("closed")
		close(leave)
		err := <-left
		testproc.Say("left %v", err)
		if err == nil {
			testproc.Say("bad read section overtaken by Close counted")
		}
	case "accessors":
		// What else reads the segment, after a Close under an open queue:
		// nothing may panic or hang on the zeros.
		q := p.NewQueue()
		if _, err := q.Lookup(r.Addr); err != nil {
			testproc.Say("bad lookup before close: %v", err)
		}
		_ = p.Close()
		_ = p.Stats()
		if _, err := p.Dump(); err == nil {
			testproc.Say("bad Dump after Close: nil")
		}
		g := p.Global()
		_ = g.Stats()
		_, _ = g.Dump()
		_ = g.LockState()
		_ = g.DevGen()
		_, _ = g.Repair()
		_, _ = g.Collect()
		_ = q.Stats()
		q.Flush()
		_, _ = q.Lookup(r.Addr)
		q.Close()
	default:
		testproc.Say("bad case %q", args[2])
	}
	testproc.Say("done")
	return 0
}

func b13SecondaryClose(args []string) int {
	addr, _ := strconv.ParseUint(args[2], 0, 64)
	s, err := secondary.Attach(secondary.Config{Prefix: args[0], RuntimeDir: args[1], Logger: quiet})
	if err != nil {
		testproc.Say("attach-failed %v", err)
		return 3
	}
	testproc.Say("ready")
	switch args[3] {
	case "newqueue":
		q0 := s.NewQueue()
		if _, err := q0.Lookup(uintptr(addr)); err != nil {
			testproc.Say("bad lookup before close: %v", err)
		}
		q0.Close()
		_ = s.Close()
		testproc.Say("closed")
		q := s.NewQueue()
		testproc.Say("made")
		if _, err := q.Lookup(uintptr(addr)); !errors.Is(err, secondary.ErrClosed) {
			testproc.Say("bad lookup after close: %v", err)
		}
		if k, ok := q.Hit(uintptr(addr)); ok {
			testproc.Say("bad hit after close: %d", k)
		}
	case "accessors":
		q := s.NewQueue()
		if _, err := q.Lookup(uintptr(addr)); err != nil {
			testproc.Say("bad lookup before close: %v", err)
		}
		_ = s.Close()
		_ = s.Stats()
		g := s.Global()
		_ = g.Stats()
		_, _ = g.Dump()
		_ = g.LockState()
		_ = s.Dropped()
		if _, err := s.Pool("nope"); err == nil {
			testproc.Say("bad Pool after Close: nil")
		}
		_, _ = q.Local.Lookup(uintptr(addr) + 1<<30)
		q.Close()
	default:
		testproc.Say("bad case %q", args[3])
	}
	testproc.Say("done")
	return 0
}

func b13SecHit(args []string) int {
	addr, _ := strconv.ParseUint(args[2], 0, 64)
	s, err := secondary.Attach(secondary.Config{Prefix: args[0], RuntimeDir: args[1], Logger: quiet})
	if err != nil {
		testproc.Say("attach-failed %v", err)
		return 3
	}
	q := s.NewQueue()
	k, err := q.Lookup(uintptr(addr))
	if err != nil {
		testproc.Say("attach-failed lookup: %v", err)
		return 3
	}
	testproc.Say("ready")
	testproc.Say("warm %d gen=%d", k, s.Global().DevGen())
	testproc.EachCommand(func(c testproc.Line) {
		switch c.Name {
		case "close":
			if err := s.Close(); err != nil {
				testproc.Say("> err %v", err)
			} else {
				testproc.Say("> closed")
			}
		case "hit":
			k, ok := q.Hit(uintptr(addr))
			testproc.Say("> hit %d %t", k, ok)
			k, err := q.Local.Lookup(uintptr(addr))
			testproc.Say("> local %d %v", k, err)
			testproc.Say("> regpool %v", q.RegisterMempool(chunkPool{{Addr: uintptr(addr), Len: 4096}}))
		}
	})
	return 0
}

// vmSize returns this process's VmSize in bytes.
func vmSize() uint64 {
	b, _ := os.ReadFile("/proc/self/status")
	for _, ln := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(ln, "VmSize:"); ok {
			n, _ := strconv.ParseUint(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
			return n << 10
		}
	}
	return 0
}

func b13Cycles(args []string) int {
	addr, _ := strconv.ParseUint(args[2], 0, 64)
	rounds, _ := strconv.Atoi(args[3])
	after := args[4] == "after"
	cfg := secondary.Config{Prefix: args[0], RuntimeDir: args[1], Logger: quiet}
	// One attachment first, closed in order, to measure what one costs.
	s, err := secondary.Attach(cfg)
	if err != nil {
		testproc.Say("attach-failed %v", err)
		return 3
	}
	attached := vmSize()
	_ = s.Close()
	// Room for the attachment and four segments' worth more.
	limit := attached + 4*64<<20
	if err := unix.Setrlimit(unix.RLIMIT_AS, &unix.Rlimit{Cur: limit, Max: unix.RLIM_INFINITY}); err != nil {
		testproc.Say("attach-failed setrlimit %v", err)
		return 3
	}
	testproc.Say("ready attached=%d limit=%d", attached, limit)
	for i := range rounds {
		s, err := secondary.Attach(cfg)
		if err != nil {
			testproc.Say("bad round %d: attach: %v (VmSize %d MiB, limit %d MiB)", i, err, vmSize()>>20, limit>>20)
			break
		}
		q := s.NewQueue()
		if _, err := q.Lookup(uintptr(addr)); err != nil {
			testproc.Say("bad round %d: lookup: %v", i, err)
		}
		if after {
			_ = s.Close()
			q.Close() // nobody reads the old segment any more
		} else {
			q.Close()
			_ = s.Close()
		}
	}
	testproc.Say("vm %d MiB", vmSize()>>20)
	testproc.Say("done")
	return 0
}

// b13Run starts helper name and fails the test on every "bad" line and on
// an unclean exit.
func b13Run(t *testing.T, name string, args ...string) {
	t.Helper()
	h := testproc.Start(t, name, args)
	h.Expect("ready", 0)
	expectClean(t, h)
}

// Close with every queue closed (the documented order) unmaps the segment.
// A queue made afterwards reads the generation from the unmapped segment
// as it is made: SIGSEGV, where the README promises a queue "made after"
// Close an answer or an error. The same holds for a NewQueue that comes
// between Close's check for live queues and the munmap.
func TestBreaker13PrimaryNewQueueAfterCloseDoesNotFault(t *testing.T) {
	b13Run(t, "b13-primary-close", testenv.Prefix(t), testenv.RunDir(t), "newqueue")
}

// The same for a secondary: Queue's check for Close comes too late, the
// queue is made (cache.NewLocal reads DevGen) before any lookup.
func TestBreaker13SecondaryNewQueueAfterCloseDoesNotFault(t *testing.T) {
	p, cfg := startPrimary(t, testenv.Tmpfs(t))
	r, err := p.Alloc(p.Backend().PageSize)
	require.NoError(t, err)
	b13Run(t, "b13-secondary-close", cfg.Prefix, cfg.RuntimeDir, fmt.Sprint(r.Addr), "newqueue")
}

// Global.Close moved the generation on (every queue must flush), then the
// segment was vacated: DevGen reads 0 again, which is the generation a
// queue that never saw an invalidation remembers. Its cache is believed
// again, and a primary's Queue (which has no check for Close) hands out the
// key of an MR that Close deregistered, for memory Close released.
//
// A queue that saw one invalidation before Close (the second subtest,
// which passes) remembers generation 1, flushes and gets errors: what a
// queue answers after Close depends on whether memory was ever freed.
func TestBreaker13PrimaryLookupAfterCloseGetsNoDeregisteredKey(t *testing.T) {
	for _, c := range []string{"stale", "stale-after-free"} {
		t.Run(c, func(t *testing.T) {
			b13Run(t, "b13-primary-close", testenv.Prefix(t), testenv.RunDir(t), c)
		})
	}
}

// A secondary closed with a queue open: the primary then frees the memory
// (DevGen moves, the MR goes). The queue's Hit (which Queue does not
// guard with its check for Close) and the embedded Local's Lookup read
// DevGen from the vacated range, 0, the generation they remember: they
// keep answering the freed MR's key.
func TestBreaker13SecondaryHitAfterCloseIgnoresFree(t *testing.T) {
	p, cfg := startPrimary(t, testenv.Tmpfs(t), shortSync)
	r, err := p.Alloc(p.Backend().PageSize)
	require.NoError(t, err)
	require.Zero(t, p.Global().DevGen(), "no invalidation yet")
	h := testproc.Start(t, "b13-sec-hit", []string{cfg.Prefix, cfg.RuntimeDir, fmt.Sprint(r.Addr)})
	h.Expect("ready", 0)
	var key uint32
	var gen uint32
	_, err = fmt.Sscanf(h.Expect("warm", 0), "warm %d gen=%d", &key, &gen)
	require.NoError(t, err)
	require.NoError(t, p.Device().Validate(verbs.SGE{Addr: r.Addr, Len: 1, Key: key}, verbs.AccessLocalWrite))
	require.Equal(t, "closed", ask(t, h, "close"))

	require.NoError(t, p.Free(r))
	require.NotZero(t, p.Global().DevGen(), "the free moved the generation")
	require.Error(t, p.Device().Validate(verbs.SGE{Addr: r.Addr, Len: 1, Key: key}, verbs.AccessLocalWrite),
		"the key is dead")

	h.Send("hit")
	hit := strings.TrimPrefix(h.Expect("> hit", 0), "> ")
	local := strings.TrimPrefix(h.Expect("> local", 0), "> ")
	assert.Equal(t, fmt.Sprintf("hit %d false", cache.InvalidKey), hit, "Hit after Close and a free of the memory")
	assert.NotEqual(t, fmt.Sprintf("local %d <nil>", key), local, "Local.Lookup after Close and a free of the memory")
	assert.NotEqual(t, "regpool <nil>", strings.TrimPrefix(h.Expect("> regpool", 0), "> "),
		"Queue.RegisterMempool after Close and a free of the memory")
}

// A read section of the global lock in the primary (Global.Shared; a
// lookup that falls back to the read lock takes the same hold) is
// overtaken by Close with a queue open. Global.Close's writer fences the
// hold (the reader line's generation moves 0 -> 1), then the vacate zeros
// the line (generation 0, count 0): RUnlock finds its own generation and
// no hold, and panics (errUnbalanced) instead of reporting the section
// void.
func TestBreaker13ReadHoldAcrossPrimaryCloseDoesNotPanic(t *testing.T) {
	b13Run(t, "b13-primary-close", testenv.Prefix(t), testenv.RunDir(t), "shared")
}

// Every Close under an open queue keeps 64 MiB of address space for the
// life of the process, even once that queue is closed a moment later and
// nothing can read the old range any more. A secondary that reattaches
// (a supervisor restarting it, a primary restart) runs out of address
// space under RLIMIT_AS after a few rounds, where closing in the other
// order attaches for ever.
func TestBreaker13VacatedSegmentsAreGivenBackOnceTheQueuesClose(t *testing.T) {
	p, cfg := startPrimary(t, testenv.Tmpfs(t))
	r, err := p.Alloc(p.Backend().PageSize)
	require.NoError(t, err)
	for _, mode := range []string{"before", "after"} {
		t.Run(mode, func(t *testing.T) {
			b13Run(t, "b13-cycles", cfg.Prefix, cfg.RuntimeDir, fmt.Sprint(r.Addr), "12", mode)
		})
	}
}

// A secondary closes while its queues look up and the primary frees memory
// it mapped. Its data memory is unmapped before the segment is vacated, and
// the zeros are anonymous: whatever the free's sync made of it (answered,
// or timed out and fenced), nothing stays quarantined on its account while
// it lives on with its queues reading zeros.
func TestBreaker13FreeWhileSecondaryClosesUnderLookups(t *testing.T) {
	p, cfg := startPrimary(t, testenv.Tmpfs(t), shortSync)
	ps := p.Backend().PageSize
	r, err := p.Alloc(4 * ps)
	require.NoError(t, err)
	h := testproc.Start(t, "b13-close-free", []string{cfg.Prefix, cfg.RuntimeDir, fmt.Sprint(r.Addr), fmt.Sprint(r.Len)})
	h.Expect("ready", 0)
	h.Send("close")
	h.Expect("closing", 0)
	require.NoError(t, p.Free(hugetlb.Region{Addr: r.Addr + uintptr(ps), Len: ps}))
	require.Equal(t, "> closed", h.Expect("> ", 0))
	p.Memory().ReleaseQuarantine()
	assert.Zero(t, p.Memory().Quarantined(), "pages quarantined for a secondary that closed")
	reg, err := p.Alloc(ps)
	require.NoError(t, err)
	assert.Equal(t, r.Addr+uintptr(ps), reg.Addr, "the freed page is handed out again")
	h.Send("exit")
	h.Expect("> bye", 0)
	h.CloseInput()
	assert.NoError(t, h.Wait(0), h.Stderr())
}

// Stats, Dump and the Global's own readers after a Close under an open
// queue read zeros: none of them may panic or hang.
func TestBreaker13AccessorsAfterCloseUnderQueues(t *testing.T) {
	t.Run("primary", func(t *testing.T) {
		b13Run(t, "b13-primary-close", testenv.Prefix(t), testenv.RunDir(t), "accessors")
	})
	t.Run("secondary", func(t *testing.T) {
		p, cfg := startPrimary(t, testenv.Tmpfs(t))
		r, err := p.Alloc(p.Backend().PageSize)
		require.NoError(t, err)
		b13Run(t, "b13-secondary-close", cfg.Prefix, cfg.RuntimeDir, fmt.Sprint(r.Addr), "accessors")
	})
}
