package cache

import (
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/verbs"
)

func TestCreateRegistersTheContiguousRun(t *testing.T) {
	testenv.ForEachBackend(t, 8, func(t *testing.T, b hugetlb.Backend) {
		p := newPrimary(t, fixtureConfig{backend: b, pages: 8})
		r := p.alloc(t, 4)
		ps := p.pageSize()
		e, err := p.g.Create(uint64(r.Addr) + ps + 10)
		require.NoError(t, err)
		assert.Equal(t, uint64(r.Addr), e.Start, "the MR covers the whole run, not just the page")
		assert.Equal(t, uint64(r.Addr)+4*ps, e.End)
		for i := range uint64(4) {
			assert.NoError(t, p.validates(r.Addr+uintptr(i*ps), e.LKey))
		}
		again, err := p.g.Create(uint64(r.Addr))
		require.NoError(t, err)
		assert.Equal(t, e, again, "a second create finds the first MR")
		assert.Equal(t, 1, p.g.Stats().MRs)

		got, found, err := p.g.Lookup(uint64(r.Addr) + 3*ps)
		require.NoError(t, err)
		require.True(t, found)
		assert.Equal(t, e, got)
	})
}

func TestSinglePageMode(t *testing.T) {
	p := newPrimary(t, fixtureConfig{pages: 8, single: true})
	r := p.alloc(t, 4)
	ps := p.pageSize()
	e, err := p.g.Create(uint64(r.Addr) + 2*ps + 1)
	require.NoError(t, err)
	assert.Equal(t, uint64(r.Addr)+2*ps, e.Start)
	assert.Equal(t, uint64(r.Addr)+3*ps, e.End)
	e2, err := p.g.Create(uint64(r.Addr))
	require.NoError(t, err)
	assert.NotEqual(t, e.LKey, e2.LKey, "another page, another MR")
	assert.Equal(t, 2, p.g.Stats().MRs)
}

// TestCreateAllocatesNothing: a create that registers a new MR (once no
// freed MR waits to be collected) allocates nothing in the primary, so
// that a stream of misses makes no work for the garbage collector.
func TestCreateAllocatesNothing(t *testing.T) {
	const runs = 16
	p := newPrimary(t, fixtureConfig{pages: runs + 2, single: true, pageSize: 64 << 10})
	r := p.alloc(t, runs+1)
	ps := p.pageSize()
	next := uint64(r.Addr)
	allocs := testing.AllocsPerRun(runs, func() {
		if _, err := p.g.Create(next); err != nil {
			t.Fatal(err)
		}
		next += ps
	})
	assert.Zero(t, allocs)
	assert.Equal(t, runs+1, p.g.Stats().MRs, "every run registered a page")
}

func TestCreateOutsideMemory(t *testing.T) {
	p := newPrimary(t, fixtureConfig{pages: 8})
	r := p.alloc(t, 1)
	for _, addr := range []uint64{0, 0x1000, uint64(r.Addr) + p.pageSize(), 1 << 62} {
		_, err := p.g.Create(addr)
		assert.ErrorIs(t, err, ErrNoMemory, "addr 0x%x", addr)
	}
	assert.Zero(t, p.g.Stats().MRs)
}

func TestCreateExcludesPagesOfOtherMRs(t *testing.T) {
	p := newPrimary(t, fixtureConfig{pages: 16})
	ps := p.pageSize()
	a := p.alloc(t, 2)
	first, err := p.g.Create(uint64(a.Addr))
	require.NoError(t, err)
	// The next allocation is adjacent: one run of 5 pages, the first two
	// already registered.
	b := p.alloc(t, 3)
	require.Equal(t, a.End(), b.Addr)
	second, err := p.g.Create(uint64(b.Addr) + ps)
	require.NoError(t, err)
	assert.Equal(t, uint64(b.Addr), second.Start, "pages of the first MR are left out")
	assert.Equal(t, uint64(b.End()), second.End)
	assert.NotEqual(t, first.LKey, second.LKey)

	d, err := p.g.Dump()
	require.NoError(t, err)
	require.Len(t, d.MRs, 2)
	assert.Len(t, d.Table, 2)
	assert.Equal(t, uint32(3), d.MRs[0].PagesSet, "newest first")
}

func TestFreeFragmentsThenReleasesMR(t *testing.T) {
	p := newPrimary(t, fixtureConfig{pages: 8})
	ps := p.pageSize()
	r := p.alloc(t, 4)
	e, err := p.g.Create(uint64(r.Addr))
	require.NoError(t, err)
	gen := p.g.DevGen()

	// Free a middle page: the MR splits into two chunks.
	require.NoError(t, p.mem.Free(hugetlb.Region{Addr: r.Addr + uintptr(ps), Len: ps}))
	assert.Greater(t, p.g.DevGen(), gen, "the generation moved")
	d, err := p.g.Dump()
	require.NoError(t, err)
	require.Len(t, d.MRs, 1)
	assert.Equal(t, []Entry{
		{Start: uint64(r.Addr), End: uint64(r.Addr) + ps, LKey: e.LKey},
		{Start: uint64(r.Addr) + 2*ps, End: uint64(r.Addr) + 4*ps, LKey: e.LKey},
	}, d.MRs[0].Chunks)
	assert.Equal(t, uint32(3), d.MRs[0].PagesSet)
	_, found, err := p.g.Lookup(uint64(r.Addr) + ps)
	require.NoError(t, err)
	assert.False(t, found, "the freed page is gone from the table")
	_, err = p.g.Create(uint64(r.Addr) + ps)
	assert.ErrorIs(t, err, ErrNoMemory)

	// Free the rest: the MR moves to the free list, and the next GC
	// deregisters it.
	live := p.dev.Stats().LiveMRs
	require.NoError(t, p.mem.Free(hugetlb.Region{Addr: r.Addr, Len: ps}))
	require.NoError(t, p.mem.Free(hugetlb.Region{Addr: r.Addr + 2*uintptr(ps), Len: 2 * ps}))
	st := p.g.Stats()
	assert.Zero(t, st.MRs)
	assert.Equal(t, 1, st.FreeMRs)
	assert.Zero(t, st.TableLen)
	assert.Equal(t, live, p.dev.Stats().LiveMRs, "still registered until collected")
	assert.Equal(t, 1, p.g.GC())
	assert.Equal(t, live-1, p.dev.Stats().LiveMRs)
	assert.ErrorIs(t, p.dev.Validate(verbs.SGE{Addr: r.Addr, Len: 1, Key: e.LKey}, verbs.AccessLocalWrite),
		verbs.ErrInvalidKey, "the old key no longer validates")
}

func TestGlobalTableExpands(t *testing.T) {
	p := newPrimary(t, fixtureConfig{pages: 64, tableSize: 4})
	ps := p.pageSize()
	r := p.alloc(t, 40)
	// Free every other page so that each remaining page is its own run.
	for i := 1; i < 40; i += 2 {
		require.NoError(t, p.mem.Free(hugetlb.Region{Addr: r.Addr + uintptr(i)*uintptr(ps), Len: ps}))
	}
	// A second process's view, opened before the table grows.
	other := p.attachView(t)
	keys := map[uint64]uint32{}
	for i := 0; i < 40; i += 2 {
		a := uint64(r.Addr) + uint64(i)*ps
		e, err := p.g.Create(a)
		require.NoError(t, err)
		keys[a] = e.LKey
	}
	st := p.g.Stats()
	assert.Equal(t, 20, st.TableLen)
	assert.GreaterOrEqual(t, st.TableSize, 21)
	assert.Positive(t, st.Expansions)
	assert.False(t, st.Overflowed)
	for a, k := range keys {
		e, found, err := other.Lookup(a + 5)
		require.NoError(t, err)
		require.True(t, found, "the other view follows the moved table")
		assert.Equal(t, k, e.LKey)
	}
}

func TestOverflowedTableFallsBackToList(t *testing.T) {
	p := newPrimary(t, fixtureConfig{pages: 32, tableSize: 4})
	ps := p.pageSize()
	r := p.alloc(t, 20)
	for i := 1; i < 20; i += 2 {
		require.NoError(t, p.mem.Free(hugetlb.Region{Addr: r.Addr + uintptr(i)*uintptr(ps), Len: ps}))
	}
	p.g.noExpand = true
	keys := map[uint64]uint32{}
	for i := 0; i < 20; i += 2 {
		a := uint64(r.Addr) + uint64(i)*ps
		e, err := p.g.Create(a)
		require.NoError(t, err)
		keys[a] = e.LKey
	}
	st := p.g.Stats()
	require.True(t, st.Overflowed, "the table could not hold every chunk")
	assert.Equal(t, 10, st.MRs)
	for a, k := range keys {
		e, found, err := p.g.Lookup(a)
		require.NoError(t, err)
		require.True(t, found, "found by scanning the MR list")
		assert.Equal(t, k, e.LKey)
		again, err := p.g.Create(a)
		require.NoError(t, err)
		assert.Equal(t, k, again.LKey, "create sees the MR through the list too")
	}
	assert.Equal(t, 10, p.g.Stats().MRs, "no duplicate MRs")
}

func TestConcurrentCreatesOverlap(t *testing.T) {
	p := newPrimary(t, fixtureConfig{pages: 64})
	ps := p.pageSize()
	var regions []hugetlb.Region
	all := p.alloc(t, 24)
	for i := range 6 {
		start := all.Addr + uintptr(4*i)*uintptr(ps)
		regions = append(regions, hugetlb.Region{Addr: start, Len: 3 * ps})
		// A free page after each region keeps them separate runs.
		require.NoError(t, p.mem.Free(hugetlb.Region{Addr: start + 3*uintptr(ps), Len: ps}))
	}
	var wg sync.WaitGroup
	errs := make(chan error, 64)
	for g := range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 60 {
				r := regions[(g+i)%len(regions)]
				a := uint64(r.Addr) + uint64(i%3)*ps + uint64(g)
				e, err := p.g.Create(a)
				if err == nil {
					err = p.validates(uintptr(a), e.LKey)
				}
				if err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	d, err := p.g.Dump()
	require.NoError(t, err)
	assert.Len(t, d.MRs, len(regions), "one MR per region, however many raced")
	var chunks []Entry
	for _, m := range d.MRs {
		chunks = append(chunks, m.Chunks...)
	}
	for i := range chunks {
		for j := range chunks {
			if i != j {
				assert.False(t, chunks[i].Start < chunks[j].End && chunks[j].Start < chunks[i].End,
					"chunks %v and %v overlap", chunks[i], chunks[j])
			}
		}
	}
}

func TestExternalMemory(t *testing.T) {
	p := newPrimary(t, fixtureConfig{pages: 8})
	buf := externalBuffer(t, 1<<20)
	addr := uint64(sliceAddr(buf))
	e, err := p.g.RegisterExternal(addr, uint64(len(buf)))
	require.NoError(t, err)
	assert.Equal(t, Entry{Start: addr, End: addr + 1<<20, LKey: e.LKey}, e)
	require.NoError(t, p.validates(uintptr(addr+100), e.LKey))
	again, err := p.g.RegisterExternal(addr, uint64(len(buf)))
	require.NoError(t, err)
	assert.Equal(t, e, again)

	r := p.alloc(t, 1)
	_, err = p.g.RegisterExternal(uint64(r.Addr), 4096)
	assert.Error(t, err, "memseg memory is not external")

	// A free of data memory leaves external MRs alone.
	require.NoError(t, p.mem.Free(r))
	got, found, err := p.g.Lookup(addr)
	require.NoError(t, err)
	assert.True(t, found)
	assert.Equal(t, e, got)

	require.NoError(t, p.g.UnregisterExternal(addr))
	_, found, err = p.g.Lookup(addr)
	require.NoError(t, err)
	assert.False(t, found)
	assert.Error(t, p.validates(uintptr(addr), e.LKey))
	assert.ErrorIs(t, p.g.UnregisterExternal(addr), ErrNoMemory)
}
