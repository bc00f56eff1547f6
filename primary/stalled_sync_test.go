package primary_test

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/cache"
	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/primary"
)

// One secondary (A) is stopped (SIGSTOP) inside a read section of the
// global lock, and the primary frees memory A maps: the free's guard
// fences A's read hold after the lock's fence time, then its sync waits
// for A's acknowledgement, up to SyncTimeout (here a minute). Meanwhile
// another, healthy secondary (B) misses on other memory and asks the
// primary to create the MR. The create must be answered, with its key,
// while the free still waits: a stalled secondary holds up the memory
// changes that need its answer, not the creates of other processes. A
// create of the memory being freed is refused meanwhile, in B and in the
// primary: it would register memory about to go.
func TestACreateIsNotHeldUpByAFreeWaitingForAStoppedSecondary(t *testing.T) {
	const syncTimeout = time.Minute
	p, cfg := startPrimary(t, testenv.Tmpfs(t), func(c *primary.Config) { c.SyncTimeout = syncTimeout })
	ps := p.Backend().PageSize
	r1, err := p.Alloc(2 * ps)
	require.NoError(t, err)
	q := p.NewQueue()
	defer q.Close()
	_, err = q.Lookup(r1.Addr) // an MR over r1: its free takes the global write lock
	require.NoError(t, err)
	r2, err := p.Alloc(2 * ps) // allocated after: no MR covers it yet
	require.NoError(t, err)
	_, found, err := p.Global().Lookup(uint64(r2.Addr))
	require.NoError(t, err)
	require.False(t, found)

	a := startSecondary(t, cfg)
	b := startSecondary(t, cfg) // default RequestTimeout
	require.Contains(t, ask(t, a, "lookup %d", r1.Addr), "key")
	require.Equal(t, "in", ask(t, a, "shared"))
	a.Stop()
	t.Cleanup(a.Continue)

	fences := p.Stats().Counters.ReadFences
	freed := make(chan error, 1)
	go func() { freed <- p.Free(r1) }()
	// Once A's read hold is fenced, the free goes on to wait for A.
	for p.Stats().Counters.ReadFences == fences {
		time.Sleep(time.Millisecond) // polling the primary's counter
	}
	stillFreeing := func(what string) {
		t.Helper()
		select {
		case err := <-freed:
			t.Fatalf("the free ended (%v) before %s: it waited for the free", err, what)
		default:
		}
	}

	answer := ask(t, b, "create %d", r2.Addr)
	stillFreeing("B's create was answered")
	require.True(t, strings.HasPrefix(answer, "key "),
		"a healthy secondary's create must be answered while a free waits for a stopped one: %q", answer)
	assert.True(t, strings.HasPrefix(ask(t, b, "create %d", r1.Addr), "err "), "a create of memory being freed")
	_, err = p.Global().Create(uint64(r1.Addr + uintptr(ps)))
	assert.ErrorIs(t, err, cache.ErrNoMemory, "a create of memory being freed, in the primary")
	stillFreeing("the creates of memory being freed were refused")

	a.Continue()
	require.NoError(t, <-freed)
	_, found, err = p.Global().Lookup(uint64(r1.Addr))
	require.NoError(t, err)
	assert.False(t, found, "nothing registered the freed memory meanwhile")
}

// An Alloc of a gigabyte on tmpfs writes every byte of it, which takes a
// second or more; a create of other memory asked meanwhile must not wait
// for it (a secondary's create waits a hundred milliseconds beyond its own
// RequestTimeout for a memory change, see ipc.HelloReply.Hold). Here the
// create must be answered while the Alloc is still allocating or mapping
// its pages, in one of a few tries.
func TestACreateIsNotHeldUpByALargeAlloc(t *testing.T) {
	const bigPages, tries = 512, 3
	p, cfg := startPrimary(t, testenv.Tmpfs(t), func(c *primary.Config) { c.MemoryPages = bigPages + 2*tries })
	ps := p.Backend().PageSize
	b := startSecondary(t, cfg)
	populating := func() bool {
		return b3Waiting("(*Memory).allocPages", "vm.mapFile") || b3Waiting("(*Memory).allocPages", "falloc.")
	}
	var answers []string
	for try := range tries {
		r, err := p.Alloc(2 * ps) // new memory, no MR over it yet
		require.NoError(t, err)
		allocated := make(chan error, 1)
		var big hugetlb.Region
		go func() {
			var err error
			big, err = p.Alloc(bigPages * ps)
			allocated <- err
		}()
		require.Eventually(t, populating, 20*time.Second, 100*time.Microsecond, "the large Alloc populates its pages")
		answer := ask(t, b, "create %d", r.Addr)
		during := populating()
		require.True(t, strings.HasPrefix(answer, "key "), "try %d: a create during a large Alloc: %q", try, answer)
		require.NoError(t, <-allocated)
		require.NoError(t, p.Free(big))
		answers = append(answers, fmt.Sprintf("during=%v", during))
		if during {
			return
		}
	}
	t.Fatalf("no create was answered while the Alloc populated its pages: %v", answers)
}

// When a stopped secondary that kept a gigabyte of freed memory in
// quarantine dies, the primary's housekeeping punches the pages out of
// their file, which takes a while on tmpfs; a create of other memory asked
// meanwhile must not wait for it. As above, the create must be answered
// while the pages are still being punched, in one of a few tries.
func TestACreateIsNotHeldUpByAQuarantineRelease(t *testing.T) {
	const bigPages, tries = 512, 3
	p, cfg := startPrimary(t, testenv.Tmpfs(t), func(c *primary.Config) {
		c.MemoryPages = bigPages + 2*tries
	}, steadySync) // b maps the big allocations in time
	ps := p.Backend().PageSize
	b := startSecondary(t, cfg)
	punching := func() bool { return b3Waiting("(*Memory).releaseQuarantine", "falloc.PunchHole") }
	var answers []string
	for try := range tries {
		r, err := p.Alloc(2 * ps)
		require.NoError(t, err)
		big, err := p.Alloc(bigPages * ps)
		require.NoError(t, err)
		s := startSecondary(t, cfg)
		s.Stop()
		require.NoError(t, p.Free(big))
		require.Equal(t, bigPages, p.Memory().Quarantined(), "the pages wait for the stopped secondary")
		s.Kill()
		require.Eventually(t, func() bool { return punching() || p.Memory().Quarantined() == 0 }, 20*time.Second,
			100*time.Microsecond, "the quarantine's release")
		answer := ask(t, b, "create %d", r.Addr)
		during := punching()
		require.True(t, strings.HasPrefix(answer, "key "), "try %d: a create during the release: %q", try, answer)
		require.Eventually(t, func() bool { return p.Memory().Quarantined() == 0 }, 20*time.Second, time.Millisecond,
			"the quarantine released")
		answers = append(answers, fmt.Sprintf("during=%v", during))
		if during {
			return
		}
	}
	t.Fatalf("no create was answered while the quarantine's pages were punched: %v", answers)
}
