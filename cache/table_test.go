package cache

import (
	"math/rand/v2"
	"sort"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

const mb2 = 2 << 20

// spaced returns n entries of 2 MiB with 2 MiB gaps, keys 1..n.
func spaced(n int) []Entry {
	out := make([]Entry, n)
	base := uint64(1) << 40
	for i := range out {
		s := base + uint64(i)*2*mb2
		out[i] = Entry{Start: s, End: s + mb2, LKey: uint32(i + 1)}
	}
	return out
}

func TestTableSentinelAndMissIndex(t *testing.T) {
	tb := NewTable(8)
	assert.Equal(t, 1, tb.Len(), "a new table holds only its sentinel")
	key, idx := tb.Lookup(0x1234)
	assert.Equal(t, InvalidKey, key)
	assert.Equal(t, 0, idx, "a search in an empty table stops at the sentinel")

	es := spaced(3)
	for _, e := range es {
		require.NoError(t, tb.Insert(e))
	}
	cases := []struct {
		name string
		addr uint64
		key  uint32
		idx  int
	}{
		{"below everything", es[0].Start - 1, InvalidKey, 0},
		{"first byte", es[0].Start, 1, 1},
		{"last byte", es[0].End - 1, 1, 1},
		{"gap after first", es[0].End, InvalidKey, 1},
		{"inside second", es[1].Start + 100, 2, 2},
		{"past the end", es[2].End + 1<<30, InvalidKey, 3},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			key, idx := tb.Lookup(c.addr)
			assert.Equal(t, c.key, key)
			assert.Equal(t, c.idx, idx)
		})
	}
}

func TestTableInsertKeepsOrderAndIgnoresDuplicates(t *testing.T) {
	tb := NewTable(64)
	es := spaced(40)
	rng := rand.New(rand.NewPCG(3, 4))
	for _, i := range rng.Perm(len(es)) {
		require.NoError(t, tb.Insert(es[i]))
	}
	require.NoError(t, tb.Insert(es[7]), "a duplicate is not an error")
	require.NoError(t, tb.Insert(Entry{Start: es[7].Start + 5, End: es[7].End, LKey: 99}), "nor is an entry inside one")
	assert.Equal(t, len(es)+1, tb.Len(), "duplicates are ignored")
	got := tb.Entries()
	assert.True(t, sort.SliceIsSorted(got, func(i, j int) bool { return got[i].Start < got[j].Start }))
	assert.Equal(t, es, got)
	assert.Error(t, tb.Insert(Entry{Start: 0, End: 10}), "the null range is the sentinel's")
	assert.Error(t, tb.Insert(Entry{Start: 10, End: 10}), "empty range")
}

func TestTableOverflowAndExpand(t *testing.T) {
	tb := NewTable(4) // sentinel + 3
	es := spaced(5)
	for _, e := range es[:3] {
		require.NoError(t, tb.Insert(e))
	}
	assert.False(t, tb.Overflowed())
	assert.ErrorIs(t, tb.Insert(es[3]), ErrTableFull)
	assert.True(t, tb.Overflowed())
	key, _ := tb.Lookup(es[3].Start)
	assert.Equal(t, InvalidKey, key, "the entry that did not fit is missing")

	require.NoError(t, tb.Expand(8))
	assert.Equal(t, 8, tb.Size())
	require.NoError(t, tb.Insert(es[3]))
	require.NoError(t, tb.Insert(es[4]))
	assert.Equal(t, es, tb.Entries(), "expanding keeps the contents")

	tb.Clear()
	assert.False(t, tb.Overflowed())
	assert.Equal(t, 1, tb.Len())
}

// The table agrees with a linear scan on random lookups.
func TestTableMatchesLinearScan(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	for _, n := range []int{1, 2, 3, 7, 64, 255, 256, 1000} {
		tb := NewTable(n + 1)
		es := spaced(n)
		for _, e := range es {
			require.NoError(t, tb.Insert(e))
		}
		for range 2000 {
			addr := es[0].Start - mb2 + rng.Uint64N(uint64(n+1)*2*mb2)
			want := InvalidKey
			for _, e := range es {
				if e.Contains(addr) {
					want = e.LKey
				}
			}
			got, idx := tb.Lookup(addr)
			require.Equal(t, want, got, "n=%d addr=0x%x", n, addr)
			require.LessOrEqual(t, tb.At(idx).Start, addr)
			if idx+1 < tb.Len() {
				require.Greater(t, tb.At(idx+1).Start, addr)
			}
		}
	}
}

// A view of the global table must notice a replacement even when the new,
// larger array lands exactly where the old one was (the arena's first fit
// makes that happen whenever the old block and its freed neighbours are
// the first hole large enough).
func TestSegmentTableViewNoticesReplacementAtSameOffset(t *testing.T) {
	p := newPrimary(t, fixtureConfig{})
	hdrOff, err := p.seg.Alloc(64, 64) // a table header
	require.NoError(t, err)
	owner, err := newSegmentTable(p.seg, hdrOff, 4)
	require.NoError(t, err)
	// A block right behind the array, freed later so that the old array's
	// block merges with it into a hole large enough for 16 entries.
	filler, err := p.seg.Alloc(16*entrySize, 16)
	require.NoError(t, err)
	es := spaced(12)
	for _, e := range es[:3] {
		require.NoError(t, owner.Insert(e))
	}
	view, err := openSegmentTable(p.seg, hdrOff) // as another process sees it
	require.NoError(t, err)
	require.False(t, view.Stale())

	first := owner.off
	owner, err = owner.expandSegment(8)
	require.NoError(t, err)
	require.NoError(t, p.seg.Free(filler))
	owner, err = owner.expandSegment(16)
	require.NoError(t, err)
	require.Equal(t, first, owner.off, "precondition: the larger array took the old one's place")
	for _, e := range es[3:] {
		require.NoError(t, owner.Insert(e))
	}

	assert.True(t, view.Stale(), "the view must see that its array was replaced")
	assert.NotPanics(t, func() { view.Entries() }, "an old view reads within its own array")
	fresh, err := openSegmentTable(p.seg, hdrOff)
	require.NoError(t, err)
	assert.False(t, fresh.Stale())
	for _, e := range es {
		key, _ := fresh.Lookup(e.Start + 1)
		assert.Equal(t, e.LKey, key, "entry at 0x%x", e.Start)
	}
}
