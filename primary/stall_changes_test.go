package primary_test

import (
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/cache"
	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/primary"
	"github.com/mpmr/mpmr/verbs"
)

// waitUntil polls cond until it holds, failing the test after 20 s.
func waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		runtime.Gosched()
		time.Sleep(200 * time.Microsecond) // polling
	}
}

// freeHeldByAStoppedSecondary stops s and frees r in the background; it
// returns once the free waits for s, with the channel the free's result
// comes on.
func freeHeldByAStoppedSecondary(t *testing.T, p *primary.Primary, s *testproc.Proc, r hugetlb.Region) <-chan error {
	t.Helper()
	s.Stop()
	t.Cleanup(s.Continue)
	freed := make(chan error, 1)
	go func() { freed <- p.Free(r) }()
	waitUntil(t, "the free waiting for the stopped secondary", func() bool {
		return testenv.GoroutinesIn("(*Primary).syncSecondaries", "(*Memory).Free") == 1
	})
	return freed
}

// helloWaitingForTheFree has tp, started by startSecondaryOnCommand,
// attach, and returns once its hello waits in the primary for the memory
// changes under way.
func helloWaitingForTheFree(t *testing.T, tp *testproc.Proc) {
	t.Helper()
	attachNow(tp)
	waitUntil(t, "the hello waiting", func() bool { return testenv.GoroutinesIn("(*handler).hello", "HoldChanges") == 1 })
}

// overlaps reports whether two regions share memory.
func overlaps(a, b hugetlb.Region) bool { return a.Addr < b.End() && b.Addr < a.End() }

// Three frees at once while one secondary (S) is stopped: every free waits
// for S, without the memory lock. Meanwhile a healthy secondary (B) and
// the primary create and look up memory, and the primary allocates. No
// key for the memory being freed may be created, served or stay valid; no
// Alloc may hand out pages being freed; S is dropped and fenced once; every
// page of the three frees waits in quarantine while S lives stopped.
func TestThreeFreesOneStalledSecondary(t *testing.T) {
	const syncTimeout = 3 * time.Second
	p, cfg := startPrimary(t, testenv.Tmpfs(t), func(c *primary.Config) { c.SyncTimeout = syncTimeout; c.MemoryPages = 16 })
	ps := p.Backend().PageSize
	r1, err := p.Alloc(2 * ps)
	require.NoError(t, err)
	r3, err := p.Alloc(ps)
	require.NoError(t, err)
	r4, err := p.Alloc(ps)
	require.NoError(t, err)
	r2, err := p.Alloc(2 * ps)
	require.NoError(t, err)
	q := p.NewQueue()
	defer q.Close()
	pk1, err := q.Lookup(r1.Addr)
	require.NoError(t, err)

	s := startSecondary(t, cfg)
	b := startSecondary(t, cfg)
	require.Contains(t, ask(t, s, "lookup %d", r1.Addr), "key")
	k1 := parseKey(t, ask(t, b, "lookup %d", r1.Addr+uintptr(ps)))
	k3 := parseKey(t, ask(t, b, "lookup %d", r3.Addr))
	k4 := parseKey(t, ask(t, b, "lookup %d", r4.Addr))
	s.Stop()
	t.Cleanup(s.Continue)

	base := p.Stats().Counters
	start := time.Now()
	var wg sync.WaitGroup
	errs := make([]error, 3)
	for i, r := range []hugetlb.Region{r1, r3, r4} {
		wg.Add(1)
		go func() { defer wg.Done(); errs[i] = p.Free(r) }()
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	waitUntil(t, "three frees waiting for S", func() bool { return testenv.GoroutinesIn("(*Primary).syncSecondaries", "(*Memory).Free") == 3 })
	inWindow := func(what string) {
		t.Helper()
		select {
		case <-done:
			t.Fatalf("the frees ended before %s (after %v)", what, time.Since(start))
		default:
		}
	}

	// In the window.
	for _, a := range []uintptr{r1.Addr, r1.Addr + uintptr(ps), r3.Addr, r4.Addr} {
		assert.True(t, strings.HasPrefix(ask(t, b, "create %d", a), "err "), "B's create of 0x%x being freed", a)
		assert.True(t, strings.HasPrefix(ask(t, b, "lookup %d", a), "err "), "B's lookup of 0x%x being freed", a)
		_, err := p.Global().Create(uint64(a))
		assert.ErrorIs(t, err, cache.ErrNoMemory, "primary create of 0x%x", a)
		_, err = q.Lookup(a)
		assert.Error(t, err, "primary lookup of 0x%x", a)
	}
	for _, kv := range []struct {
		a uintptr
		k uint32
	}{{r1.Addr, pk1}, {r1.Addr + uintptr(ps), k1}, {r3.Addr, k3}, {r4.Addr, k4}} {
		assert.Error(t, p.Device().Validate(verbs.SGE{Addr: kv.a, Len: 1, Key: kv.k}, verbs.AccessLocalWrite),
			"key %#x of memory being freed still valid at 0x%x", kv.k, kv.a)
	}
	assert.Equal(t, "done 2000 0", ask(t, b, "hammer 2 1000 %d %d", r2.Addr, r2.Len), "other memory works")
	err = p.Free(hugetlb.Region{Addr: r1.Addr + uintptr(ps), Len: ps})
	assert.ErrorIs(t, err, hugetlb.ErrDoubleFree, "free of part of a region being freed")
	inWindow("the creates and lookups")

	// An Alloc now also pushes to S: it returns once S is dropped.
	type res struct {
		r   hugetlb.Region
		err error
	}
	allocs := make(chan res, 8)
	go func() {
		for range 4 {
			r, err := p.Alloc(ps)
			allocs <- res{r, err}
		}
		close(allocs)
	}()
	waitUntil(t, "an alloc waiting", func() bool { return testenv.GoroutinesIn("(*Primary).syncSecondaries") >= 4 })
	inWindow("the alloc started")

	<-done
	t.Logf("frees took %v: %v", time.Since(start), errs)
	for i, err := range errs {
		require.NoError(t, err, "free %d", i)
	}
	var got []hugetlb.Region
	for a := range allocs {
		if a.err != nil {
			t.Logf("alloc: %v", a.err)
			continue
		}
		got = append(got, a.r)
	}
	for _, a := range got {
		for _, f := range []hugetlb.Region{r1, r3, r4} {
			assert.False(t, overlaps(a, f), "alloc %v handed out freed %v while stopped S may map it", a, f)
		}
	}
	c := p.Stats().Counters
	assert.Equal(t, base.SyncDrops+1, c.SyncDrops, "S dropped once")
	assert.Equal(t, base.Fenced+1, c.Fenced, "S fenced once")
	assert.Equal(t, 4, p.Memory().Quarantined(), "every page of the three frees waits for S")
	for _, f := range []hugetlb.Region{r1, r3, r4} {
		_, found, err := p.Global().Lookup(uint64(f.Addr))
		require.NoError(t, err)
		assert.False(t, found)
	}
	for _, kv := range []struct {
		a uintptr
		k uint32
	}{{r1.Addr, pk1}, {r1.Addr + uintptr(ps), k1}, {r3.Addr, k3}, {r4.Addr, k4}} {
		assert.Error(t, p.Device().Validate(verbs.SGE{Addr: kv.a, Len: 1, Key: kv.k}, verbs.AccessLocalWrite),
			"key %#x of freed memory still valid at 0x%x", kv.k, kv.a)
	}
	s.Continue()
	waitUntil(t, "the quarantine released", func() bool { return p.Memory().Quarantined() == 0 })
}

// A secondary (T) attaches while a free waits for a stopped one (S): its
// hello waits for the free, and once the free has returned, T must map no
// page of it — neither by its mappings (/proc/PID/maps) nor by a touch —
// and the pages must wait in quarantine for S alone.
func TestHelloDuringAStalledFree(t *testing.T) {
	p, cfg := startPrimary(t, testenv.Tmpfs(t), func(c *primary.Config) { c.SyncTimeout = 2 * time.Second; c.MemoryPages = 16 })
	ps := p.Backend().PageSize
	file := p.Memory().Lists()[0].File
	r1, err := p.Alloc(2 * ps)
	require.NoError(t, err)
	keep, err := p.Alloc(ps)
	require.NoError(t, err)
	s := startSecondary(t, cfg)
	tp := startSecondaryOnCommand(t, cfg)
	require.Contains(t, ask(t, s, "lookup %d", r1.Addr), "key")
	freed := freeHeldByAStoppedSecondary(t, p, s, r1)
	helloWaitingForTheFree(t, tp)
	select {
	case err := <-freed:
		t.Fatalf("free ended early: %v", err)
	default:
	}
	require.NoError(t, <-freed)
	tp.Expect("ready", 0)
	assert.False(t, b10MapsAt(t, tp.PID(), file, r1.Addr), "T maps freed r1")
	assert.False(t, b10MapsAt(t, tp.PID(), file, r1.Addr+uintptr(ps)), "T maps freed r1")
	assert.Equal(t, "fault", ask(t, tp, "peek %d", r1.Addr))
	assert.True(t, b10MapsAt(t, tp.PID(), file, keep.Addr), "T maps keep")
	assert.Contains(t, ask(t, tp, "lookup %d", keep.Addr), "key")
	assert.NotContains(t, ask(t, tp, "lookup %d", r1.Addr), "key")
	assert.Equal(t, 2, p.Memory().Quarantined())
	// Allocations now: never r1 while S is stopped.
	for range 8 {
		a, err := p.Alloc(ps)
		if err != nil {
			break
		}
		assert.False(t, overlaps(a, r1), "alloc %v is freed r1", a)
		assert.Equal(t, "wrote", ask(t, tp, "poke %d 7", a.Addr))
	}
	s.Continue()
	waitUntil(t, "the quarantine released", func() bool { return p.Memory().Quarantined() == 0 })
}

// While a free waits for a stopped secondary (S): a hello (T) waits for it,
// an Alloc waits behind the hello, a CreatePool behind that, and the
// primary is closed. Everything must end, bounded by the sync timeout, and
// in order: the free and the allocations complete (or fail), Close last.
func TestCloseDuringAStalledFreeWithHelloAndAllocQueued(t *testing.T) {
	p, cfg := startPrimary(t, testenv.Tmpfs(t), func(c *primary.Config) { c.SyncTimeout = 2 * time.Second; c.MemoryPages = 16 })
	ps := p.Backend().PageSize
	r1, err := p.Alloc(ps)
	require.NoError(t, err)
	s := startSecondary(t, cfg)
	b := startSecondary(t, cfg)
	tp := startSecondaryOnCommand(t, cfg)
	require.Contains(t, ask(t, s, "lookup %d", r1.Addr), "key")
	freed := freeHeldByAStoppedSecondary(t, p, s, r1)
	helloWaitingForTheFree(t, tp)
	allocd := make(chan error, 1)
	go func() { _, err := p.Alloc(ps); allocd <- err }()
	waitUntil(t, "the alloc waiting", func() bool { return testenv.GoroutinesIn("(*Memory).Alloc", "RLock") == 1 })
	pooled := make(chan error, 1)
	go func() { _, err := p.CreatePool("pool", 64, 16); pooled <- err }()
	waitUntil(t, "the pool waiting", func() bool { return testenv.GoroutinesIn("CreatePool", "RLock") == 1 })
	closed := make(chan error, 1)
	start := time.Now()
	go func() { closed <- p.Close() }()
	waitUntil(t, "Close waiting", func() bool { return testenv.GoroutinesIn("(*Primary).Close") == 1 })
	t.Logf("B create during close: %s", ask(t, b, "create %d", r1.Addr))

	_, err = testenv.Bounded(t, "Close", 15*time.Second, func() error { return <-closed })
	t.Logf("close after %v: %v", time.Since(start), err)
	assert.NoError(t, err, "Close")
	// Each sends its result as it returns: Close returned after them.
	for _, op := range []struct {
		what string
		ch   <-chan error
	}{{"the free", freed}, {"the alloc", allocd}, {"the pool", pooled}} {
		select {
		case err := <-op.ch:
			t.Logf("%s: %v", op.what, err)
			if op.what == "the free" {
				assert.NoError(t, err, "the free")
			} else if err != nil {
				assert.ErrorIs(t, err, primary.ErrClosed, "%s failed, and not for the close", op.what)
			}
		default:
			t.Errorf("Close returned before %s", op.what)
		}
	}
	ln, err := tp.Next("", 5*time.Second)
	t.Logf("T: %q %v", ln, err)
	require.NoError(t, err, "T says how its attach ended")
	if !strings.HasPrefix(ln, "ready") {
		assert.Contains(t, ln, "closing", "T's attach failed, and not for the close")
	}
}

// An Alloc waits for a stopped secondary (S) to map its pages: meanwhile a
// healthy secondary (B) registers a mempool over them and over memory
// being freed, creates keys for them, and closes; another (C) detaches.
// After S is dropped, freeing the allocated pages quarantines them and
// leaves no key valid over them.
func TestAllocWaitAndPoolsAndDetachDuringAStall(t *testing.T) {
	p, cfg := startPrimary(t, testenv.Tmpfs(t), func(c *primary.Config) { c.SyncTimeout = 2 * time.Second; c.MemoryPages = 16 })
	ps := p.Backend().PageSize
	r1, err := p.Alloc(2 * ps)
	require.NoError(t, err)
	s := startSecondary(t, cfg)
	b := startSecondary(t, cfg)
	c := startSecondary(t, cfg)
	require.Contains(t, ask(t, s, "lookup %d", r1.Addr), "key")
	freed := freeHeldByAStoppedSecondary(t, p, s, r1)
	type res struct {
		r   hugetlb.Region
		err error
	}
	allocd := make(chan res, 1)
	go func() { r, err := p.Alloc(2 * ps); allocd <- res{r, err} }()
	waitUntil(t, "the alloc waiting", func() bool { return testenv.GoroutinesIn("(*Primary).syncSecondaries", "(*Memory).Alloc") == 1 })
	// The alloc's pages: the first pages after r1 (r1 is being freed).
	var na hugetlb.Region
	for a := r1.End(); ; a += uintptr(ps) {
		if pg, ok := p.Memory().PageOf(a); ok {
			na = hugetlb.Region{Addr: pg.Addr, Len: 2 * ps}
			break
		}
		require.Less(t, a, r1.End()+16*uintptr(ps))
	}
	t.Logf("alloc in progress over %v", na)
	kb := ask(t, b, "create %d", na.Addr)
	t.Logf("B create of memory being allocated: %s", kb)
	t.Logf("B regpool over r1 (being freed): %s", ask(t, b, "regpool %d %d", r1.Addr, 4096))
	t.Logf("B regpool over na (being allocated): %s", ask(t, b, "regpool %d %d", na.Addr, 4096))
	assert.Equal(t, "closed", ask(t, c, "close"))
	select {
	case err := <-freed:
		t.Fatalf("free ended early: %v", err)
	default:
	}
	require.NoError(t, <-freed)
	a := <-allocd
	require.NoError(t, a.err)
	assert.Equal(t, na, a.r)
	k := uint32(0)
	if strings.HasPrefix(kb, "key ") {
		k = parseKey(t, kb)
	}
	require.NoError(t, p.Free(a.r))
	assert.Equal(t, 4, p.Memory().Quarantined())
	if k != 0 {
		assert.Error(t, p.Device().Validate(verbs.SGE{Addr: na.Addr, Len: 1, Key: k}, verbs.AccessLocalWrite))
	}
	assert.Equal(t, uint64(1), p.Stats().Counters.SyncDrops)
	s.Continue()
	waitUntil(t, "the quarantine released", func() bool { return p.Memory().Quarantined() == 0 })
}
