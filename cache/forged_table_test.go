package cache

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/internal/test/testenv"
)

// Another process rewrites the global table header's Len and Size, which
// the primary's inserts and rebuilds used to size and bound their work
// by: each case took the primary down (a panic out of range, a fault in
// the unchecked search) or hung it, under its locks. Its creates must go
// on, with keys the device accepts.
func TestARewrittenTableHeaderDoesNotTakeThePrimaryDown(t *testing.T) {
	for _, c := range []struct {
		name      string
		len, size uint32
		setLen    bool
		setSize   bool
	}{
		{name: "Len past the array", len: 0xFFFFFFF0, setLen: true},
		{name: "Size past the array", size: 1 << 20, setSize: true},
		{name: "both past", len: 0x7FFFFFFF, size: 0xFFFFFFFF, setLen: true, setSize: true},
		{name: "Len zero", len: 0, setLen: true},
	} {
		t.Run(c.name, func(t *testing.T) {
			p := newPrimary(t, fixtureConfig{pages: 32, single: true, tableSize: 4})
			r := p.alloc(t, 1)
			_, err := p.g.Create(uint64(r.Addr))
			require.NoError(t, err)
			if c.setLen { // the other process's writes
				atomic.StoreUint32(&p.g.root.Table.Len, c.len)
			}
			if c.setSize {
				atomic.StoreUint32(&p.g.root.Table.Size, c.size)
			}
			for range 8 {
				r := p.alloc(t, 1)
				e, err := p.g.Create(uint64(r.Addr))
				require.NoError(t, err)
				assert.NoError(t, p.validates(r.Addr, e.LKey))
			}
		})
	}
}

// The header's Size rewritten to 0: the rebuild that ends a free grew its
// table by doubling the size it read until it fit, which from 0 never
// ends, under the global write lock and the memory lock.
func TestATableSizeRewrittenToZeroDoesNotHangAFree(t *testing.T) {
	p := newPrimary(t, fixtureConfig{pages: 8, single: true})
	r1, r2 := p.alloc(t, 1), p.alloc(t, 1)
	_, err := p.g.Create(uint64(r1.Addr))
	require.NoError(t, err)
	e2, err := p.g.Create(uint64(r2.Addr))
	require.NoError(t, err)
	atomic.StoreUint32(&p.g.root.Table.Size, 0) // the other process's write
	_, err = testenv.Bounded(t, "a free after the table's size was rewritten", 20*time.Second, func() error { return p.mem.Free(r1) })
	require.NoError(t, err)
	got, found, err := p.g.Lookup(uint64(r2.Addr))
	require.NoError(t, err)
	require.True(t, found)
	assert.Equal(t, e2, got)
	assert.Equal(t, uint32(p.g.tbl.Load().Size()), atomic.LoadUint32(&p.g.root.Table.Size), "the primary put the header right")
}
