package cache

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/hugetlb"
)

// A free the device cannot take part in (its hole table is full, so the
// MR that keeps its other pages cannot be trimmed) must not leave the old
// key valid over the freed page, on the first try or on a later one. The
// MR is deregistered whole instead: the free completes, the old key is
// refused everywhere, and the pages still allocated get registered again
// on demand, under a new key the device accepts.
func TestFreeTheDeviceCannotTrimDeregistersTheMRWhole(t *testing.T) {
	// One MR slot, so four holes in the device's hole table.
	p := newPrimary(t, fixtureConfig{pages: 32, maxMRs: 1})
	// The primary's second free guard: what the invalidation took off
	// the list is deregistered before the pages go.
	defer p.mem.GuardFree(func(hugetlb.Event) error { _, err := p.g.Collect(); return err })()
	ps := uintptr(p.pageSize())
	r := p.alloc(t, 12) // one MR over all twelve pages
	l := NewLocal(p.g, p.g, 0)
	key, err := l.Lookup(r.Addr)
	require.NoError(t, err)
	page := func(i int) hugetlb.Region { return hugetlb.Region{Addr: r.Addr + uintptr(i)*ps, Len: uint64(ps)} }
	for _, i := range []int{1, 3, 5, 7} { // four separate holes: the table is full
		require.NoError(t, p.mem.Free(page(i)))
		require.Error(t, p.validates(page(i).Addr, key), "page %d is trimmed out of the MR", i)
	}
	require.NoError(t, p.validates(page(9).Addr, key), "page 9 is still registered")

	require.NoError(t, p.mem.Free(page(9)), "the fifth trim finds no hole: the MR goes whole instead")
	_, ok := p.mem.PageOf(page(9).Addr)
	assert.False(t, ok, "the page is freed")
	for _, i := range []int{0, 2, 9, 11} {
		assert.Error(t, p.validates(page(i).Addr, key), "the old key is refused over page %d", i)
	}
	st := p.g.Stats()
	assert.Zero(t, st.MRs, "the MR left the list")

	// What is still allocated is registered again when looked up (the
	// device has room for one MR: pages 10 and 11, the run after page 9).
	for _, i := range []int{10, 11} {
		k, err := l.Lookup(page(i).Addr)
		require.NoError(t, err, "page %d", i)
		assert.NotEqual(t, key, k, "page %d has a new key", i)
		assert.NoError(t, p.validates(page(i).Addr, k), "its new key validates over page %d", i)
	}
	_, err = l.Lookup(page(9).Addr)
	assert.ErrorIs(t, err, ErrNoMemory, "the freed page has no key")
}
