package cache

import (
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/hugetlb"
)

// A free drops only the local entries that overlap what it took away: a
// queue keeps answering unrelated memory from its top half.
func TestLocalSelectiveFlushKeepsUnrelatedEntries(t *testing.T) {
	p := newPrimary(t, fixtureConfig{pages: 16, single: true})
	ps := uintptr(p.pageSize())
	keep := p.alloc(t, 2) // two single-page MRs
	gone := p.alloc(t, 1)
	l := NewLocal(p.g, p.g, 0)
	k0, err := l.Lookup(keep.Addr)
	require.NoError(t, err)
	k1, err := l.Lookup(keep.Addr + ps)
	require.NoError(t, err)
	_, err = l.Lookup(gone.Addr)
	require.NoError(t, err)
	before := l.Stats()

	require.NoError(t, p.mem.Free(gone))
	_, hit := l.Hit(keep.Addr)
	assert.False(t, hit, "the top half does not answer across a generation change")
	k, err := l.Lookup(keep.Addr)
	require.NoError(t, err)
	assert.Equal(t, k0, k)
	k, err = l.Lookup(keep.Addr + ps)
	require.NoError(t, err)
	assert.Equal(t, k1, k)
	_, err = l.Lookup(gone.Addr)
	assert.ErrorIs(t, err, ErrNoMemory)

	st := l.Stats()
	assert.Equal(t, uint64(1), st.Flushes-before.Flushes)
	assert.Equal(t, uint64(1), st.SelectiveFlushes-before.SelectiveFlushes)
	assert.Equal(t, uint64(2), st.SelectiveDropped, "the freed page's entry, in the top and the bottom half")
	assert.Equal(t, before.GlobalHits, st.GlobalHits, "the kept entries needed no trip to the global table")
	assert.Equal(t, before.BottomHits, st.BottomHits)
	hitKey, hit := l.Hit(keep.Addr + ps)
	assert.True(t, hit, "and the top half answers again")
	assert.Equal(t, k1, hitKey)
}

// An entry a free only trimmed (its MR lost some pages) is dropped too.
func TestLocalSelectiveFlushDropsTrimmedEntries(t *testing.T) {
	p := newPrimary(t, fixtureConfig{pages: 16})
	ps := uintptr(p.pageSize())
	r := p.alloc(t, 4) // one MR over four pages
	l := NewLocal(p.g, p.g, 0)
	k, err := l.Lookup(r.Addr)
	require.NoError(t, err)
	require.NoError(t, p.mem.Free(hugetlb.Region{Addr: r.Addr + 2*ps, Len: uint64(ps)}))
	_, err = l.Lookup(r.Addr + 2*ps)
	assert.ErrorIs(t, err, ErrNoMemory, "the freed page in the middle is not answered")
	k2, err := l.Lookup(r.Addr)
	require.NoError(t, err)
	assert.Equal(t, k, k2, "the MR's remaining chunk, fetched anew")
	st := l.Stats()
	assert.Equal(t, uint64(1), st.SelectiveFlushes)
	assert.Equal(t, uint64(1), st.GlobalHits, "refetched from the global table")
	top, _ := l.Entries()
	for _, e := range top {
		assert.False(t, e.Contains(uint64(r.Addr+2*ps)), "no entry covers the freed page: %v", e)
	}
}

// A cache further behind than the log remembers flushes everything.
func TestLocalTooFarBehindFlushesEverything(t *testing.T) {
	p := newPrimary(t, fixtureConfig{pages: 16, single: true, logSize: 2})
	keep := p.alloc(t, 1)
	l := NewLocal(p.g, p.g, 0)
	_, err := l.Lookup(keep.Addr)
	require.NoError(t, err)
	for range 3 {
		r := p.alloc(t, 1)
		_, err := p.g.Create(uint64(r.Addr))
		require.NoError(t, err)
		require.NoError(t, p.mem.Free(r))
	}
	_, err = l.Lookup(keep.Addr)
	require.NoError(t, err)
	st := l.Stats()
	assert.Equal(t, uint64(1), st.FullFlushes())
	assert.Zero(t, st.SelectiveFlushes)
	assert.Equal(t, uint64(2), st.FullDropped, "the top and the bottom half's entry")
	assert.Equal(t, uint64(1), st.GlobalHits, "refilled from the global table")
}

// A reader that catches up while the primary overwrites the log entry it
// needs (the ring came round) must not trust what it read: it flushes
// everything. The interleaving is forced: the reader read the generation
// before the overwrite and reads the entry after it.
func TestLocalCatchUpDistrustsOverwrittenLog(t *testing.T) {
	p := newPrimary(t, fixtureConfig{pages: 16, single: true, logSize: 1})
	gone := p.alloc(t, 1)
	decoy := p.alloc(t, 1)
	_, err := p.g.Create(uint64(decoy.Addr))
	require.NoError(t, err)
	l := NewLocal(p.g, p.g, 0)
	_, err = l.Lookup(gone.Addr)
	require.NoError(t, err)
	start := l.gen
	require.NoError(t, p.mem.Free(gone))  // generation start+1 in the only slot
	seen := p.g.DevGen()                  // what the reader read
	require.NoError(t, p.mem.Free(decoy)) // start+2 overwrites the slot
	l.catchUp(seen)
	st := l.Stats()
	assert.Zero(t, st.SelectiveFlushes, "an overwritten entry is not trusted")
	assert.Equal(t, uint64(1), st.FullFlushes())
	for _, e := range l.top {
		assert.Zero(t, e.size, "nothing kept")
	}
	assert.Equal(t, start+1, seen)

	// A torn entry (the primary in the middle of writing it) neither.
	l2 := NewLocal(p.g, p.g, 0)
	r := p.alloc(t, 1)
	_, err = l2.Lookup(r.Addr)
	require.NoError(t, err)
	require.NoError(t, p.mem.Free(r))
	e := &p.g.ilog[0]
	atomic.AddUint32(&e.Seq, 1)
	_, err = l2.Lookup(r.Addr)
	assert.ErrorIs(t, err, ErrNoMemory)
	assert.Equal(t, uint64(1), l2.Stats().FullFlushes())
	atomic.AddUint32(&e.Seq, 1)
}

// In full-flush mode every invalidation flushes every cache, as DPDK does.
func TestFullFlushMode(t *testing.T) {
	p := newPrimary(t, fixtureConfig{pages: 16, single: true, fullFlush: true})
	keep := p.alloc(t, 1)
	gone := p.alloc(t, 1)
	l := NewLocal(p.g, p.g, 0)
	for _, a := range []uintptr{keep.Addr, gone.Addr} {
		_, err := l.Lookup(a)
		require.NoError(t, err)
	}
	require.NoError(t, p.mem.Free(gone))
	_, err := l.Lookup(keep.Addr)
	require.NoError(t, err)
	st := l.Stats()
	assert.Equal(t, uint64(1), st.FullFlushes())
	assert.Equal(t, uint64(4), st.FullDropped)
}

// A log entry's sequence word knocked out of step once (a stray write to
// the segment leaves it odd at rest) is put right by the entry's next
// write, as the lock's is: an entry being written never reads as a
// finished one, and catch-ups through the entry are selective again.
func TestALogEntryKnockedOutOfStepIsPutRightByItsNextWrite(t *testing.T) {
	p := newPrimary(t, fixtureConfig{pages: 16, single: true, logSize: 4})
	invalidate := func() {
		r := p.alloc(t, 1)
		_, err := p.g.Create(uint64(r.Addr))
		require.NoError(t, err)
		require.NoError(t, p.mem.Free(r))
	}
	e := &p.g.ilog[(p.g.DevGen()+1)%4] // the entry the next invalidation writes
	atomic.AddUint32(&e.Seq, 1)
	invalidate()
	assert.Zero(t, atomic.LoadUint32(&e.Seq)&1, "even at rest once written again")

	keep := p.alloc(t, 1)
	l := NewLocal(p.g, p.g, 0)
	_, err := l.Lookup(keep.Addr)
	require.NoError(t, err)
	from := p.g.DevGen()
	for p.g.DevGen()-from < 4 { // through every entry, the one knocked out of step too
		invalidate()
	}
	require.Equal(t, from+4, p.g.DevGen(), "no further than the log remembers")
	_, err = l.Lookup(keep.Addr)
	require.NoError(t, err)
	st := l.Stats()
	assert.Equal(t, uint64(1), st.SelectiveFlushes)
	assert.Zero(t, st.FullFlushes())
}
