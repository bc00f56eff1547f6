package primary_test

import (
	"errors"
	"fmt"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/cache"
	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/primary"
	"github.com/mpmr/mpmr/secondary"
)

func init() {
	// close-lookups-secondary PREFIX RUNDIR ADDR LEN ROUNDS: ROUNDS times,
	// attach, warm four queues on [ADDR, ADDR+LEN), close the secondary
	// while they look up, and have them go on looking up (through the
	// embedded cache.Local, past Queue's own check for Close: a lookup
	// that lost the race). "done" at the end; "bad ..." for an answer
	// no closed instance may give.
	testproc.Register("close-lookups-secondary", closeLookupsSecondary)
	// close-lookups-primary PREFIX RUNDIR ROUNDS: the same with a primary
	// of its own, started and closed ROUNDS times.
	testproc.Register("close-lookups-primary", closeLookupsPrimary)
}

// lookupsAcrossClose runs four queues' lookups of [addr, addr+n) and of
// memory outside it, calls closeFn once every queue has answered, and
// lets the queues go on for as many lookups again. It returns the
// answers no lookup may give: a key for an address no MR ever covered,
// or no key and no error.
func lookupsAcrossClose(newQueue func() *cache.Local, addr uintptr, n uint64, closeFn func() error) []string {
	const queues, warm = 4, 2000
	var (
		wg     sync.WaitGroup
		mu     sync.Mutex
		bad    []string
		warmed sync.WaitGroup
		closed atomic.Bool
	)
	report := func(format string, args ...any) {
		mu.Lock()
		defer mu.Unlock()
		if len(bad) < 10 {
			bad = append(bad, fmt.Sprintf(format, args...))
		}
	}
	outside := addr + uintptr(n) + 1<<40 // no memory list reaches this far
	qs := make([]*cache.Local, queues)
	for i := range qs {
		qs[i] = newQueue()
	}
	warmed.Add(queues)
	for _, q := range qs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			keys := make([]uint32, 8)
			addrs := make([]uintptr, 8)
			after := 0
			for i := 0; after < warm; i++ {
				if i == warm {
					warmed.Done()
				}
				if closed.Load() {
					after++
				}
				a := addr + uintptr(uint64(i)*4096%n)
				if _, err := q.Lookup(a); err != nil && !closed.Load() {
					report("lookup 0x%x before close: %v", a, err)
				}
				q.Hit(a)
				for j := range addrs {
					addrs[j] = a + uintptr(j)*64
				}
				if k, err := q.LookupBurst(addrs, keys); k > len(addrs) || k < len(addrs) && err == nil {
					report("burst answered %d of %d without an error", k, len(addrs))
				}
				if _, err := q.LookupRange(a, 64); err != nil && !closed.Load() {
					report("range 0x%x before close: %v", a, err)
				}
				if k, err := q.Lookup(outside); err == nil || k != cache.InvalidKey {
					report("lookup of 0x%x, outside all memory: key %d err %v", outside, k, err)
				}
			}
		}()
	}
	warmed.Wait()
	closed.Store(true) // from here on, an error is the answer expected
	err := closeFn()
	wg.Wait()
	if err != nil {
		bad = append(bad, fmt.Sprintf("close: %v", err))
	}
	return bad
}

func closeLookupsSecondary(args []string) int {
	addr, _ := strconv.ParseUint(args[2], 0, 64)
	n, _ := strconv.ParseUint(args[3], 0, 64)
	rounds, _ := strconv.Atoi(args[4])
	testproc.Say("ready")
	for range rounds {
		s, err := secondary.Attach(secondary.Config{Prefix: args[0], RuntimeDir: args[1], Logger: quiet})
		if err != nil {
			testproc.Say("attach-failed %v", err)
			return 3
		}
		newQueue := func() *cache.Local { return s.NewQueue().Local }
		for _, b := range lookupsAcrossClose(newQueue, uintptr(addr), n, s.Close) {
			testproc.Say("bad %s", b)
		}
		// A whole lookup after Close, through Queue: refused.
		q := s.NewQueue()
		if _, err := q.Lookup(uintptr(addr)); !errors.Is(err, secondary.ErrClosed) {
			testproc.Say("bad lookup after close: %v", err)
		}
	}
	testproc.Say("done")
	return 0
}

func closeLookupsPrimary(args []string) int {
	rounds, _ := strconv.Atoi(args[2])
	testproc.Say("ready")
	for range rounds {
		p, err := primary.Start(primary.Config{Prefix: args[0], RuntimeDir: args[1], Backend: hugetlb.Tmpfs, MemoryPages: 16, Logger: quiet})
		if err != nil {
			testproc.Say("start-failed %v", err)
			return 3
		}
		r, err := p.Alloc(4 * p.Backend().PageSize)
		if err != nil {
			testproc.Say("alloc-failed %v", err)
			return 3
		}
		newQueue := func() *cache.Local { return p.NewQueue().Local }
		for _, b := range lookupsAcrossClose(newQueue, r.Addr, r.Len, p.Close) {
			testproc.Say("bad %s", b)
		}
	}
	testproc.Say("done")
	return 0
}

// expectClean waits for h's "done", failing the test on every "bad" line
// before it, and for a clean exit.
func expectClean(t *testing.T, h *testproc.Proc) {
	t.Helper()
	for {
		line, err := h.Next("", 2*testproc.DefaultTimeout)
		if err != nil {
			t.Error(err)
			break
		}
		if line == "done" {
			break
		}
		if strings.HasPrefix(line, "bad ") || strings.Contains(line, "-failed") {
			t.Errorf("helper: %s", line)
		}
	}
	assert.NoError(t, h.Wait(0), "the helper exits cleanly, not killed by a fault; stderr:\n%s", h.Stderr())
}

// Close unmaps the control segment, which every lookup past the top half
// reads (and the top half's generation check reads too). A queue that is
// still looking up when the secondary closes, one whose lookup passed
// Queue's check for Close a moment before, must get an answer or an
// error: not take the whole process down with SIGSEGV.
func TestLookupsRacingSecondaryCloseDoNotFault(t *testing.T) {
	p, cfg := startPrimary(t, testenv.Tmpfs(t))
	r, err := p.Alloc(4 * p.Backend().PageSize)
	require.NoError(t, err)
	h := testproc.Start(t, "close-lookups-secondary", []string{cfg.Prefix, cfg.RuntimeDir,
		fmt.Sprint(r.Addr), fmt.Sprint(r.Len), "8"})
	h.Expect("ready", 0)
	expectClean(t, h)
}

// The same for the primary's own queues.
func TestLookupsRacingPrimaryCloseDoNotFault(t *testing.T) {
	h := testproc.Start(t, "close-lookups-primary", []string{testenv.Prefix(t), testenv.RunDir(t), "8"})
	h.Expect("ready", 0)
	expectClean(t, h)
}

// CreatePool racing Close: each pool is made whole before the segment
// goes, or refused with ErrClosed; none is written into an unmapped
// segment.
func TestCreatePoolRacingCloseDoesNotFault(t *testing.T) {
	for round := range 40 {
		p, _ := startPrimary(t, testenv.Tmpfs(t))
		var wg, started sync.WaitGroup
		errs := make(chan error, 8)
		for g := range 8 {
			started.Add(1)
			wg.Go(func() {
				started.Done()
				for i := range 4 {
					if _, err := p.CreatePool(fmt.Sprintf("r%dg%di%d", round, g, i), 64, 16); err != nil {
						errs <- err
						return
					}
				}
			})
		}
		started.Wait()
		require.NoError(t, p.Close())
		wg.Wait()
		close(errs)
		for err := range errs {
			require.ErrorIs(t, err, primary.ErrClosed)
		}
	}
}

// A Free under way when Close comes finishes with the instance whole: its
// sync reaches the secondaries (which unmap the pages) before Close drops
// them, so a nil from Free still means that nobody maps the pages. Here
// the Free is held inside its guard while Close runs as far as it can.
func TestFreeRacingCloseStillSyncs(t *testing.T) {
	p, cfg := startPrimary(t, testenv.Tmpfs(t))
	h := startSecondary(t, cfg)
	r, err := p.Alloc(p.Backend().PageSize)
	require.NoError(t, err)
	require.Equal(t, "byte 0", ask(t, h, "read %d", r.Addr))
	require.True(t, b10MapsAt(t, h.PID(), ".msl", r.Addr), "the secondary maps the region")

	entered, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	cancel := p.Memory().GuardFree(func(hugetlb.Event) error {
		once.Do(func() { close(entered); <-release })
		return nil
	})
	defer cancel()
	freed, closed := make(chan error, 1), make(chan error, 1)
	go func() { freed <- p.Free(r) }()
	<-entered
	go func() { closed <- p.Close() }()
	// Close has gone as far as it can while the Free is held: it waits
	// for a lock, before tearing anything down or in the memory's Close.
	for !b3Waiting("(*Primary).Close", "sync.(*RWMutex).Lock") {
		runtime.Gosched()
	}
	close(release)
	require.NoError(t, <-closed)
	if err := <-freed; err == nil {
		assert.False(t, b10MapsAt(t, h.PID(), ".msl", r.Addr), "Free returned nil while the secondary maps the region")
	} else {
		assert.ErrorIs(t, err, primary.ErrClosed)
	}
}

// The memory's queries racing Close answer, or report nothing once the
// memory is closed; none reads the segment after Close has unmapped it.
func TestMemoryQueriesRacingCloseDoNotFault(t *testing.T) {
	for range 20 {
		p, _ := startPrimary(t, testenv.Tmpfs(t))
		r, err := p.Alloc(2 * p.Backend().PageSize)
		require.NoError(t, err)
		m := p.Memory()
		queries := []func(){
			func() { _ = m.Lists() },
			func() {
				for range m.Runs {
				}
			},
			func() { _, _ = m.ContigRun(r.Addr) },
			func() { _, _ = m.PageOf(r.Addr) },
		}
		var wg, working sync.WaitGroup
		var closed atomic.Bool
		for _, q := range append(queries, queries[:2]...) {
			working.Add(1)
			wg.Go(func() {
				q()
				working.Done()
				for !closed.Load() {
					q()
				}
				q()
			})
		}
		working.Wait()
		require.NoError(t, p.Close())
		closed.Store(true)
		wg.Wait()
		assert.Nil(t, m.Lists(), "Lists after Close")
		_, ok := m.ContigRun(r.Addr)
		assert.False(t, ok, "ContigRun after Close")
	}
}

// A secondary whose connection ends while Close waits for a Free under
// way is fenced as at any other time: the Free still runs, and neither it
// nor an Alloc made meanwhile (which does not wait for the Free: its
// pages are kept from it) hands out pages the secondary maps.
func TestConnectionLostWhileCloseWaitsIsFenced(t *testing.T) {
	p, cfg := startPrimary(t, testenv.Tmpfs(t), shortSync)
	ps := p.Backend().PageSize
	r, err := p.Alloc(ps)
	require.NoError(t, err)
	s := b10Start(t, cfg, "")
	slot, epoch := b10Attach(t, s)
	require.Equal(t, "byte 0", ask(t, s, "peek %d", r.Addr), "the secondary maps r")

	entered, release := make(chan struct{}), make(chan struct{})
	var once, released sync.Once
	cancel := p.Memory().GuardFree(func(hugetlb.Event) error {
		once.Do(func() { close(entered); <-release })
		return nil
	})
	defer cancel()
	let := func() { released.Do(func() { close(release) }) }
	defer let() // a failed check must not leave the Free, and Close, waiting
	freed := make(chan error, 1)
	go func() { freed <- p.Free(r) }()
	<-entered
	type alloc struct {
		r   hugetlb.Region
		err error
	}
	allocated := make(chan alloc, 1)
	go func() {
		y, err := p.Alloc(ps)
		allocated <- alloc{y, err}
	}()
	a := <-allocated
	closed := make(chan error, 1)
	go func() { closed <- p.Close() }()
	for !b3Waiting("(*Primary).Close", "sync.(*RWMutex).Lock") {
		runtime.Gosched()
	}

	require.Equal(t, "shut 1", ask(t, s, "shutconn"))
	require.Eventually(t, func() bool {
		pr := p.Segment().Proc(slot)
		return pr.Epoch == epoch && pr.Fenced
	}, 5*time.Second, time.Millisecond, "the secondary whose connection ended is fenced")
	let()
	require.NoError(t, <-freed)
	require.NoError(t, a.err)
	assert.False(t, b10Overlap(r, a.r), "r handed out again while the secondary, not fenced, maps it")
	require.NoError(t, <-closed)
}

// Pools made at once from many goroutines each get a place of their own
// in the directory, and a name is taken once.
func TestPoolsCreatedConcurrently(t *testing.T) {
	p, _ := startPrimary(t, testenv.Tmpfs(t))
	const n = 8
	var wg sync.WaitGroup
	made := make([]*cache.Pool, n)
	errs := make([]error, n)
	sameName := make([]error, n)
	for g := range n {
		wg.Go(func() {
			made[g], errs[g] = p.CreatePool(fmt.Sprintf("pool%d", g), 64, 16)
			_, sameName[g] = p.CreatePool("shared", 64, 16)
		})
	}
	wg.Wait()
	bases := map[uintptr]bool{}
	for g := range n {
		require.NoError(t, errs[g])
		opened, err := cache.OpenPool(p.Segment(), fmt.Sprintf("pool%d", g))
		require.NoError(t, err, "pool %d is in the directory", g)
		assert.Equal(t, made[g].Chunks(), opened.Chunks())
		bases[opened.Chunks()[0].Addr] = true
	}
	assert.Len(t, bases, n, "each pool has its own memory")
	var took int
	for _, err := range sameName {
		if err == nil {
			took++
		} else {
			assert.ErrorIs(t, err, cache.ErrPoolExists)
		}
	}
	assert.Equal(t, 1, took, "one pool called shared")
}
