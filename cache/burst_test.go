package cache

import (
	"errors"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/verbs"
)

// pagesOf registers n single-page MRs over a fresh region and returns the
// region and each page's key.
func pagesOf(t testing.TB, p *primary, n int) (hugetlb.Region, []uint32) {
	t.Helper()
	r := p.alloc(t, n)
	keys := make([]uint32, n)
	for i := range n {
		e, err := p.g.Create(uint64(r.Addr) + uint64(i)*p.pageSize())
		require.NoError(t, err)
		keys[i] = e.LKey
	}
	return r, keys
}

// A burst answers every address as Lookup does, one address at a time,
// whatever level each answer comes from, and counts every address as a
// lookup.
func TestLookupBurstMatchesLookup(t *testing.T) {
	p := newPrimary(t, fixtureConfig{pages: 48, single: true})
	ps := uintptr(p.pageSize())
	r, _ := pagesOf(t, p, 24)
	fresh := p.alloc(t, 4) // not registered yet: the burst creates
	rng := rand.New(rand.NewPCG(1, 2))
	page := func(i int) uintptr { return r.Addr + uintptr(i)*ps + uintptr(rng.IntN(int(ps))) }
	cases := []struct {
		name  string
		addrs func() []uintptr
	}{
		{"one MR", func() []uintptr {
			out := make([]uintptr, 32)
			for i := range out {
				out[i] = page(3)
			}
			return out
		}},
		{"runs", func() []uintptr {
			var out []uintptr
			for len(out) < 64 {
				i := rng.IntN(24)
				for range 1 + rng.IntN(6) {
					out = append(out, page(i))
				}
			}
			return out
		}},
		{"eight MRs at random", func() []uintptr {
			out := make([]uintptr, 32)
			for i := range out {
				out[i] = page(rng.IntN(8))
			}
			return out
		}},
		{"more MRs than the top half", func() []uintptr {
			out := make([]uintptr, 100)
			for i := range out {
				out[i] = page(rng.IntN(24))
			}
			return out
		}},
		{"memory not yet registered", func() []uintptr {
			return []uintptr{page(1), fresh.Addr + 5, fresh.Addr + ps + 9, page(1), fresh.Addr + 3*ps, fresh.Addr + 7}
		}},
		{"empty", func() []uintptr { return nil }},
	}
	burst := NewLocal(p.g, p.g, 0)
	single := NewLocal(p.g, p.g, 0)
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			addrs := c.addrs()
			before := burst.Stats()
			keys := make([]uint32, len(addrs))
			n, err := burst.LookupBurst(addrs, keys)
			require.NoError(t, err)
			assert.Equal(t, len(addrs), n)
			for i, a := range addrs {
				want, err := single.Lookup(a)
				require.NoError(t, err)
				assert.Equal(t, want, keys[i], "address %d (0x%x)", i, a)
				require.NoError(t, p.validates(a, keys[i]))
			}
			after := burst.Stats()
			assert.Equal(t, uint64(len(addrs)), after.Lookups-before.Lookups, "every address is a lookup")
			levels := (after.TopHits - before.TopHits) + (after.BottomHits - before.BottomHits) +
				(after.GlobalHits - before.GlobalHits) + (after.Created - before.Created)
			assert.Equal(t, uint64(len(addrs)), levels, "and was answered at one level")
		})
	}
}

// A burst stops at the first address it cannot answer: the ones before
// are answered, the ones after untouched, and the error says why.
func TestLookupBurstStopsAtFirstFailure(t *testing.T) {
	p := newPrimary(t, fixtureConfig{pages: 16, single: true})
	r, keys := pagesOf(t, p, 2)
	l := NewLocal(p.g, p.g, 0)
	addrs := []uintptr{r.Addr, r.Addr + 64, 0x1000, r.Addr}
	got := []uint32{7, 7, 7, 7}
	n, err := l.LookupBurst(addrs, got)
	assert.Equal(t, 2, n)
	assert.ErrorIs(t, err, ErrNoMemory)
	assert.Equal(t, []uint32{keys[0], keys[0], 7, 7}, got)
	assert.Equal(t, uint64(1), l.Stats().Failed)

	_, err = l.LookupBurst(addrs, got[:2])
	assert.Error(t, err, "fewer keys than addresses")
}

// Memory freed before a burst starts is answered for no address of it, and
// memory freed while a burst waits for a create is answered for no address
// looked up after that.
func TestLookupBurstHonoursFrees(t *testing.T) {
	p := newPrimary(t, fixtureConfig{pages: 16, single: true})
	ps := uintptr(p.pageSize())
	r, _ := pagesOf(t, p, 2)
	l := NewLocal(p.g, p.g, 0)
	keys := make([]uint32, 4)
	_, err := l.LookupBurst([]uintptr{r.Addr, r.Addr + ps}, keys)
	require.NoError(t, err)

	require.NoError(t, p.mem.Free(hugetlb.Region{Addr: r.Addr, Len: uint64(ps)}))
	n, err := l.LookupBurst([]uintptr{r.Addr + ps, r.Addr + 8}, keys)
	assert.Equal(t, 1, n, "the freed page is not answered from the cache")
	assert.ErrorIs(t, err, ErrNoMemory)

	// A create path that frees the remaining page while the burst waits.
	other := p.alloc(t, 1)
	fc := &freeingCreator{g: p.g, free: func() error {
		return p.mem.Free(hugetlb.Region{Addr: r.Addr + ps, Len: uint64(ps)})
	}}
	l2 := NewLocal(p.g, fc, 0)
	_, err = l2.Lookup(r.Addr + ps) // cached in l2's top half
	require.NoError(t, err)
	n, err = l2.LookupBurst([]uintptr{r.Addr + ps, other.Addr, r.Addr + ps + 8}, keys)
	assert.Equal(t, 2, fc.calls, "the middle address went to the create path, and so did the freed page")
	assert.Equal(t, 2, n, "the page freed during the create is not answered after it")
	assert.ErrorIs(t, err, ErrNoMemory)
}

// freeingCreator creates through the primary and runs free (once) first.
type freeingCreator struct {
	g     *Global
	free  func() error
	calls int
}

func (c *freeingCreator) CreateMR(addr uint64) (Entry, error) {
	c.calls++
	if c.free != nil {
		if err := c.free(); err != nil {
			return Entry{}, err
		}
		c.free = nil
	}
	return c.g.Create(addr)
}

func (c *freeingCreator) RegisterExternal(addr, length uint64) (Entry, error) {
	return Entry{}, ErrExternalMemory
}

func TestLookupBurstAllocatesNothing(t *testing.T) {
	p := newPrimary(t, fixtureConfig{pages: 32, single: true})
	r, _ := pagesOf(t, p, 12)
	ps := uintptr(p.pageSize())
	l := NewLocal(p.g, p.g, 0)
	addrs := make([]uintptr, 32)
	for i := range addrs {
		addrs[i] = r.Addr + uintptr(i%12)*ps + uintptr(i)
	}
	keys := make([]uint32, len(addrs))
	_, err := l.LookupBurst(addrs, keys) // warm up
	require.NoError(t, err)
	allocs := testing.AllocsPerRun(200, func() {
		if _, err := l.LookupBurst(addrs, keys); err != nil {
			t.Fatal(err)
		}
	})
	assert.Zero(t, allocs)
}

// LookupRange answers only for a buffer inside one MR, and otherwise says
// where the MR holding its start ends, so the buffer can be split there.
func TestLookupRange(t *testing.T) {
	p := newPrimary(t, fixtureConfig{pages: 16, single: true})
	ps := uint64(p.pageSize())
	r, keys := pagesOf(t, p, 2) // two MRs side by side
	hole := p.alloc(t, 2)       // the second page is freed: a hole after the first
	holeKey, err := p.g.Create(uint64(hole.Addr))
	require.NoError(t, err)
	require.NoError(t, p.mem.Free(hugetlb.Region{Addr: hole.Addr + uintptr(ps), Len: ps}))
	a := uint64(r.Addr)
	l := NewLocal(p.g, p.g, 0)
	cases := []struct {
		name  string
		addr  uint64
		n     uint64
		key   uint32
		split uint64 // 0: answered
		err   error
	}{
		{"inside one MR", a + 100, 2176, keys[0], 0, nil},
		{"a whole MR", a, ps, keys[0], 0, nil},
		{"up to the last byte", a + ps - 2176, 2176, keys[0], 0, nil},
		{"across two MRs", a + ps - 1000, 2176, keys[0], a + ps, ErrSplit},
		{"the second MR", a + ps, 2176, keys[1], 0, nil},
		{"into freed memory", uint64(hole.Addr) + ps - 64, 128, holeKey.LKey, uint64(hole.Addr) + ps, ErrSplit},
		{"zero bytes", a, 0, InvalidKey, 0, ErrBadRange},
		{"wrapping", a, ^uint64(0) - 10, InvalidKey, 0, ErrBadRange},
		{"outside all memory", 0x1000, 64, InvalidKey, 0, ErrNoMemory},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			k, err := l.LookupRange(uintptr(c.addr), c.n)
			if c.err == nil {
				require.NoError(t, err)
				assert.Equal(t, c.key, k)
				require.NoError(t, p.dev.Validate(verbs.SGE{Addr: uintptr(c.addr), Len: uint32(c.n), Key: k}, verbs.AccessLocalWrite))
				return
			}
			require.ErrorIs(t, err, c.err)
			assert.Equal(t, InvalidKey, k)
			var se *SplitError
			if !errors.Is(c.err, ErrSplit) {
				assert.False(t, errors.As(err, &se))
				return
			}
			require.ErrorAs(t, err, &se)
			assert.Equal(t, uintptr(c.addr), se.Addr)
			assert.Equal(t, c.n, se.Len)
			assert.Equal(t, uintptr(c.split), se.Split)
			assert.Equal(t, c.key, se.Key)
			assert.Contains(t, err.Error(), "0x")
			covered := verbs.SGE{Addr: se.Addr, Len: uint32(uint64(se.Split) - c.addr), Key: se.Key}
			require.NoError(t, p.dev.Validate(covered, verbs.AccessLocalWrite), "the covered part validates under the key")
			whole := verbs.SGE{Addr: se.Addr, Len: uint32(c.n), Key: se.Key}
			require.Error(t, p.dev.Validate(whole, verbs.AccessLocalWrite), "as the whole buffer would not")
		})
	}

	// A split buffer's parts are each answered.
	k1, err := l.LookupRange(uintptr(a+ps-1000), 1000)
	require.NoError(t, err)
	k2, err := l.LookupRange(uintptr(a+ps), 1176)
	require.NoError(t, err)
	assert.Equal(t, []uint32{keys[0], keys[1]}, []uint32{k1, k2})

	allocs := testing.AllocsPerRun(200, func() {
		if _, err := l.LookupRange(uintptr(a+64), 2176); err != nil {
			t.Fatal(err)
		}
	})
	assert.Zero(t, allocs, "an answer allocates nothing")
}

// Bursts publish their counters as they go, as Lookup does.
func TestLookupBurstPublishes(t *testing.T) {
	p := newPrimary(t, fixtureConfig{pages: 8})
	r := p.alloc(t, 1)
	l := NewLocal(p.g, p.g, 0)
	addrs := make([]uintptr, 32)
	for i := range addrs {
		addrs[i] = r.Addr + uintptr(i)*64
	}
	keys := make([]uint32, len(addrs))
	for range 3 * publishEvery / len(addrs) {
		n, err := l.LookupBurst(addrs, keys)
		require.NoError(t, err)
		require.Equal(t, len(addrs), n)
	}
	var seen LocalStats
	done := make(chan struct{})
	go func() { seen = l.Published(); close(done) }()
	<-done
	assert.GreaterOrEqual(t, seen.Lookups, uint64(2*publishEvery), "burst hits are published as they go")
	assert.Equal(t, uint64(3*publishEvery), l.Stats().Lookups)
}
