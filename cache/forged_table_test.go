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

// Another process rewrites only the table header's Size. The primary puts
// it right at its next write section. A view opened from the header
// meanwhile (a secondary attaching then) has an entry array and an index
// sized and placed by the rewritten Size: once the header is right again
// it must follow the real table, and no lookup may answer with an entry
// that does not hold the address.
func TestAViewOpenedOnARewrittenSizeFollowsTheRepair(t *testing.T) {
	p := newPrimary(t, fixtureConfig{pages: 64, single: true, tableSize: 64})
	var addrs []uint64
	for range 20 {
		r := p.alloc(t, 2) // the second page stays unregistered
		_, err := p.g.Create(uint64(r.Addr))
		require.NoError(t, err)
		addrs = append(addrs, uint64(r.Addr))
	}
	atomic.StoreUint32(&p.g.root.Table.Size, 4) // the other process's write
	v := p.attachView(t)                        // a secondary attaching meanwhile
	// The primary's next write section puts the header right.
	require.NoError(t, p.g.Exclusive(func() {}))
	require.Equal(t, uint32(p.g.tbl.Load().Size()), atomic.LoadUint32(&p.g.root.Table.Size),
		"the primary put the header right")
	tb, err := v.table()
	require.NoError(t, err)
	t.Logf("view: %d entries of %d, header says %d", tb.Len(), tb.Size(), atomic.LoadUint32(&p.g.root.Table.Size))
	missed, wrong := 0, 0
	for _, a := range addrs {
		e, found, err := v.Lookup(a + 9)
		require.NoError(t, err)
		if !found || !e.Contains(a+9) {
			missed++
		}
		if found && !e.Contains(a+9) {
			wrong++
			t.Logf("0x%x: found %v, which does not hold it", a+9, e)
		}
	}
	assert.Zero(t, wrong, "answers naming an entry that does not hold the address")
	assert.Zero(t, missed, "lookups of registered addresses the repaired view still misses (of %d)", len(addrs))
}
