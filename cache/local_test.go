package cache

import (
	"errors"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/hugetlb"
)

func TestLocalLevels(t *testing.T) {
	p := newPrimary(t, fixtureConfig{pages: 16})
	ps := p.pageSize()
	r := p.alloc(t, 2)
	f := &forwarder{g: p.g}
	l := NewLocal(p.g, f, 0)

	k1, err := l.Lookup(r.Addr + 5)
	require.NoError(t, err)
	assert.Equal(t, 1, f.calls, "a first lookup goes to the create path")
	require.NoError(t, p.validates(r.Addr+5, k1))

	k2, err := l.Lookup(r.Addr + uintptr(ps) + 7)
	require.NoError(t, err)
	assert.Equal(t, k1, k2, "same MR")
	assert.Equal(t, 1, f.calls, "answered by the top half")

	l2 := NewLocal(p.g, f, 0)
	k3, err := l2.Lookup(r.Addr + 9)
	require.NoError(t, err)
	assert.Equal(t, k1, k3)
	assert.Equal(t, 1, f.calls, "another queue finds it in the global table")

	st := l.Stats()
	assert.Equal(t, LocalStats{Lookups: 2, TopHits: 1, Created: 1}, st)
	assert.Equal(t, LocalStats{Lookups: 1, GlobalHits: 1}, l2.Stats())

	_, err = l.Lookup(0x1000)
	assert.ErrorIs(t, err, ErrNoMemory)
	assert.Equal(t, uint64(1), l.Stats().Failed)
}

func TestLocalTopHalfRoundRobinAndBottomHalf(t *testing.T) {
	p := newPrimary(t, fixtureConfig{pages: 32, single: true})
	ps := p.pageSize()
	r := p.alloc(t, 10)
	l := NewLocal(p.g, p.g, 0)
	addr := func(i int) uintptr { return r.Addr + uintptr(i)*uintptr(ps) + 1 }
	keys := make([]uint32, 10)
	for i := range 10 {
		k, err := l.Lookup(addr(i))
		require.NoError(t, err)
		keys[i] = k
	}
	top, bottom := l.Entries()
	assert.Len(t, top, topSize, "the top half is full")
	assert.Len(t, bottom, 10, "the bottom half keeps everything")
	// Pages 0 and 1 were replaced round-robin by pages 8 and 9.
	for _, e := range top {
		assert.NotEqual(t, uint64(addr(0)-1), e.Start)
		assert.NotEqual(t, uint64(addr(1)-1), e.Start)
	}
	before := l.Stats()
	k, err := l.Lookup(addr(0))
	require.NoError(t, err)
	assert.Equal(t, keys[0], k)
	after := l.Stats()
	assert.Equal(t, before.BottomHits+1, after.BottomHits, "an evicted entry comes from the bottom half")
	k, err = l.Lookup(addr(5))
	require.NoError(t, err)
	assert.Equal(t, keys[5], k)
	assert.Equal(t, after.TopHits+1, l.Stats().TopHits, "a resident entry comes from the top half")
}

func TestLocalBottomHalfDoubles(t *testing.T) {
	p := newPrimary(t, fixtureConfig{pages: 64, single: true})
	r := p.alloc(t, 40)
	l := NewLocal(p.g, p.g, 16)
	for i := range 40 {
		_, err := l.Lookup(r.Addr + uintptr(i)*uintptr(p.pageSize()))
		require.NoError(t, err)
	}
	assert.Equal(t, 64, l.bh.Size(), "16 -> 32 -> 64")
	assert.Equal(t, 41, l.bh.Len())
	assert.False(t, l.bh.Overflowed())
}

func TestLocalFlushesWhenGenerationMoves(t *testing.T) {
	p := newPrimary(t, fixtureConfig{pages: 16})
	ps := p.pageSize()
	r := p.alloc(t, 3)
	l := NewLocal(p.g, p.g, 0)
	k, err := l.Lookup(r.Addr + uintptr(2*ps))
	require.NoError(t, err)

	require.NoError(t, p.mem.Free(hugetlb.Region{Addr: r.Addr, Len: ps}))
	// The remaining pages are still registered, under the same key, but
	// the cache must notice the change before answering.
	k2, err := l.Lookup(r.Addr + uintptr(2*ps))
	require.NoError(t, err)
	assert.Equal(t, k, k2)
	st := l.Stats()
	assert.Equal(t, uint64(1), st.Flushes)
	assert.Equal(t, uint64(1), st.GlobalHits, "refilled from the global table")
	_, err = l.Lookup(r.Addr)
	assert.ErrorIs(t, err, ErrNoMemory, "the freed page is not answered from stale entries")
}

func TestLocalHitAllocatesNothing(t *testing.T) {
	p := newPrimary(t, fixtureConfig{pages: 16, single: true})
	r := p.alloc(t, 4)
	l := NewLocal(p.g, p.g, 0)
	for i := range 4 {
		_, err := l.Lookup(r.Addr + uintptr(i)*uintptr(p.pageSize()))
		require.NoError(t, err)
	}
	i, ps := 0, uintptr(p.pageSize())
	allocs := testing.AllocsPerRun(1000, func() {
		_, _ = l.Lookup(r.Addr + uintptr(i%4)*ps + 64)
		i++
	})
	assert.Zero(t, allocs, "top-half hits")
	allocs = testing.AllocsPerRun(100, func() {
		l.top = [topSize]topEntry{} // force bottom-half hits
		_, _ = l.Lookup(r.Addr + 64)
	})
	assert.Zero(t, allocs, "bottom-half hits")
}

func TestLocalPublishedStats(t *testing.T) {
	p := newPrimary(t, fixtureConfig{pages: 8})
	r := p.alloc(t, 1)
	l := NewLocal(p.g, p.g, 0)
	for range 3 * publishEvery {
		_, err := l.Lookup(r.Addr)
		require.NoError(t, err)
	}
	var seen LocalStats
	done := make(chan struct{})
	go func() { seen = l.Published(); close(done) }()
	<-done
	assert.GreaterOrEqual(t, seen.Lookups, uint64(2*publishEvery), "hits are published as they go")
	l.Publish()
	assert.Equal(t, l.Stats(), l.Published())
}

// Once Free returns, no lookup that starts afterwards, in any goroutine or
// queue, returns a key for the freed range. Each round allocates a region
// (usually at the same address as the last), registers it under a fresh key
// and frees it while readers keep looking it up; then it frees and
// reallocates a decoy region elsewhere, so that consecutive invalidations
// name different ranges. Readers also look up a region that is never
// freed, which the selective modes must keep answering.
//
// It runs with full flushes (DPDK's way), with selective flushes, and with
// a log of one entry, where readers are often too far behind: a reader
// that kept one overlapping entry would return a freed key. A reader that
// reads an entry while the primary overwrites it is rare here; that race
// is forced, and a reader that trusts the overwritten entry caught, by
// TestInvalidationLogReaderNeverTakesAnOverwrittenEntry.
func TestInvalidationIsLinearizable(t *testing.T) {
	modes := []struct {
		name string
		cfg  fixtureConfig
	}{
		{"full flush", fixtureConfig{pages: 32, fullFlush: true}},
		{"selective", fixtureConfig{pages: 32}},
		{"log of one entry", fixtureConfig{pages: 32, logSize: 1}},
	}
	for _, m := range modes {
		t.Run(m.name, func(t *testing.T) { testLinearizable(t, m.cfg) })
	}
}

func testLinearizable(t *testing.T, cfg fixtureConfig) {
	p := newPrimary(t, cfg)
	ps := p.pageSize()
	const rounds = 40
	stable := p.alloc(t, 1)
	stableKey, err := p.g.Create(uint64(stable.Addr))
	require.NoError(t, err)
	decoy := p.alloc(t, 1)
	var (
		mu      sync.Mutex
		roundOf = map[uint32]int{} // key -> round that registered it
		current uintptr            // address of the live region
		freed   atomic.Int64       // rounds whose Free has returned
		stop    atomic.Bool
		lookups atomic.Int64
		stale   atomic.Int64
		wg      sync.WaitGroup
		perQ    = make([]LocalStats, 4)
	)
	for q := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			// Readers never create: every key they see comes from the
			// main goroutine, which records its round first.
			l := NewLocal(p.g, noCreate{}, 0)
			defer func() { perQ[q] = l.Stats() }()
			for !stop.Load() {
				if k, err := l.Lookup(stable.Addr + 16); err != nil || k != stableKey.LKey {
					t.Errorf("the region that is never freed: key 0x%x, %v", k, err)
				}
				mu.Lock()
				addr := current
				mu.Unlock()
				if addr == 0 {
					runtime.Gosched()
					continue
				}
				before := freed.Load()
				k, err := l.Lookup(addr + 8)
				lookups.Add(1)
				if err != nil {
					if !errors.Is(err, ErrNoMemory) {
						t.Errorf("lookup: %v", err)
					}
					continue
				}
				mu.Lock()
				r, ok := roundOf[k]
				mu.Unlock()
				if !ok || int64(r) < before {
					stale.Add(1)
					t.Errorf("lookup started after round %d was freed returned key 0x%x of round %d", before, k, r)
				}
			}
		}()
	}
	for i := range rounds {
		r, err := p.mem.Alloc(2 * ps)
		require.NoError(t, err)
		// Readers may find the new MR in the global table as soon as
		// Create inserts it; holding mu makes them wait for its round.
		mu.Lock()
		e, err := p.g.Create(uint64(r.Addr))
		require.NoError(t, err)
		roundOf[e.LKey] = i
		current = r.Addr
		mu.Unlock()
		for target := lookups.Load() + 200; lookups.Load() < target; {
			runtime.Gosched() // let the readers use the region for a while
		}
		require.NoError(t, p.mem.Free(r))
		freed.Store(int64(i + 1))
		_, err = p.g.Create(uint64(decoy.Addr))
		require.NoError(t, err)
		require.NoError(t, p.mem.Free(decoy))
		decoy = p.alloc(t, 1)
	}
	stop.Store(true)
	wg.Wait()
	assert.Zero(t, stale.Load())
	assert.GreaterOrEqual(t, lookups.Load(), int64(rounds*200))
	var sum LocalStats
	for _, st := range perQ {
		sum = sum.Add(st)
	}
	switch {
	case cfg.fullFlush:
		assert.Zero(t, sum.SelectiveFlushes, "full-flush mode never flushes selectively")
	case cfg.logSize == 1:
		// Each round frees twice: a queue flushes selectively only if it
		// catches up between the two, which a busy machine may never let
		// it do. What the overwritten log must cause is full flushes.
		assert.Positive(t, sum.FullFlushes(), "a queue behind an overwritten log flushes everything")
	default:
		assert.Positive(t, sum.SelectiveFlushes)
	}
	t.Logf("%d lookups over %d alloc/free rounds; flushes: %d full, %d selective (dropped %d and %d entries)",
		lookups.Load(), rounds, sum.FullFlushes(), sum.SelectiveFlushes, sum.FullDropped, sum.SelectiveDropped)
}

// noCreate is a create path that never creates.
type noCreate struct{}

func (noCreate) CreateMR(addr uint64) (Entry, error) { return Entry{}, ErrNoMemory }
func (noCreate) RegisterExternal(addr, length uint64) (Entry, error) {
	return Entry{}, ErrExternalMemory
}

// Lookup tests the top half two entries at a time, Hit one at a time:
// from every most-recently-used entry, for an address in each entry (or
// in none, or in a free slot's range), both answer alike and leave the
// same entry most recently used.
func TestLocalLookupAnswersAsHit(t *testing.T) {
	es := spaced(7) // a free slot too
	for mru := range uint32(topSize) {
		for target := -1; target < len(es); target++ {
			a := uintptr(es[0].Start) - 1 // in none
			if target >= 0 {
				a = uintptr(es[target].Start + uint64(target)*64)
			}
			hit, look := topOnly(es), topOnly(es)
			hit.mru, look.mru = mru, mru
			k, ok := hit.Hit(a)
			if !ok {
				continue // a miss goes on to the bottom half: nothing to compare
			}
			got, err := look.Lookup(a)
			require.NoError(t, err)
			assert.Equal(t, k, got, "mru %d, address in entry %d", mru, target)
			assert.Equal(t, hit.mru, look.mru, "mru %d, address in entry %d", mru, target)
			assert.Equal(t, hit.mruHit+hit.topHit, look.mruHit+look.topHit)
		}
	}
}
