package cache

import (
	"encoding/binary"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// refLookup is the table's contract, by linear scan: the last entry of es
// (sentinel first, sorted) starting at or before addr, and its key if it
// holds addr.
func refLookup(es []Entry, addr uint64) (uint32, int) {
	idx := 0
	for i, e := range es {
		if e.Start <= addr {
			idx = i
		}
	}
	if addr < es[idx].End {
		return es[idx].LKey, idx
	}
	return InvalidKey, idx
}

// withSentinel returns the table's full contents for entries es.
func withSentinel(es []Entry) []Entry {
	return append([]Entry{{LKey: InvalidKey}}, es...)
}

// keyed numbers the keys of es 1, 2, ...
func keyed(es []Entry) []Entry {
	for i := range es {
		es[i].LKey = uint32(i + 1)
	}
	return es
}

// Distributions of table contents a lookup structure can trip on.
var layouts = []struct {
	name string
	make func(rng *rand.Rand) []Entry
}{
	{"empty", func(*rand.Rand) []Entry { return nil }},
	{"one", func(*rand.Rand) []Entry { return spaced(1) }},
	{"two", func(*rand.Rand) []Entry { return spaced(2) }},
	{"spaced 17", func(*rand.Rand) []Entry { return spaced(17) }},
	{"spaced 1000", func(*rand.Rand) []Entry { return spaced(1000) }},
	{"pages back to back", func(*rand.Rand) []Entry {
		es := make([]Entry, 700)
		for i := range es {
			s := uint64(1)<<40 + uint64(i)*4096
			es[i] = Entry{Start: s, End: s + 4096}
		}
		return keyed(es)
	}},
	{"pages every 12 KiB", func(*rand.Rand) []Entry {
		es := make([]Entry, 300)
		for i := range es {
			s := uint64(1)<<40 + uint64(i)*3*4096
			es[i] = Entry{Start: s, End: s + 4096}
		}
		return keyed(es)
	}},
	{"pages with a hole", func(*rand.Rand) []Entry {
		var es []Entry
		for i := range 400 {
			if i != 250 {
				s := uint64(1)<<40 + uint64(i)*mb2
				es = append(es, Entry{Start: s, End: s + mb2})
			}
		}
		return keyed(es)
	}},
	{"two lists and external memory", func(rng *rand.Rand) []Entry {
		var es []Entry
		for i := range 500 {
			s := uint64(1)<<40 + uint64(i)*2*mb2
			es = append(es, Entry{Start: s, End: s + mb2})
		}
		for i := range 300 {
			s := uint64(1)<<44 + uint64(i)*mb2
			es = append(es, Entry{Start: s, End: s + mb2})
		}
		es = append(es, Entry{Start: 0x1000, End: 0x3000})
		for i := range 5 {
			s := uint64(0x7f00_0000_0000) + uint64(i)<<32 + rng.Uint64N(1<<20)
			es = append(es, Entry{Start: s, End: s + 1 + rng.Uint64N(1<<30)})
		}
		slices.SortFunc(es, func(a, b Entry) int { return startCmp(a.Start, b.Start) })
		return keyed(es)
	}},
	{"uneven gaps and sizes", func(rng *rand.Rand) []Entry {
		es := make([]Entry, 2000)
		a := uint64(1) << 20
		for i := range es {
			a += 1 + rng.Uint64N(uint64(1)<<rng.IntN(36))
			size := 1 + rng.Uint64N(uint64(1)<<rng.IntN(30))
			es[i] = Entry{Start: a, End: a + size}
			a += size
		}
		return keyed(es)
	}},
	{"a crowd in one bucket", func(*rand.Rand) []Entry {
		es := spaced(1000)
		crowd := es[500].End + 4096
		for i := range 200 {
			s := crowd + uint64(i)*16
			es = append(es, Entry{Start: s, End: s + 8})
		}
		slices.SortFunc(es, func(a, b Entry) int { return startCmp(a.Start, b.Start) })
		return keyed(es)
	}},
	{"top of the address space", func(*rand.Rand) []Entry {
		es := make([]Entry, 100)
		for i := range es {
			s := math.MaxUint64 - uint64(100-i)*8192
			es[i] = Entry{Start: s, End: s + 4096}
		}
		es[99].End = math.MaxUint64
		return keyed(es)
	}},
}

func layout(name string, rng *rand.Rand) []Entry {
	for _, l := range layouts {
		if l.name == name {
			return l.make(rng)
		}
	}
	panic("no layout " + name)
}

func startCmp(a, b uint64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// probes returns addresses around every entry's edges and random ones.
func probes(es []Entry, rng *rand.Rand) []uint64 {
	out := []uint64{0, 1, math.MaxUint64, math.MaxUint64 - 1}
	for _, e := range es {
		out = append(out, e.Start-1, e.Start, e.Start+(e.End-e.Start)/2, e.End-1, e.End)
	}
	for range 500 {
		out = append(out, rng.Uint64())
		if len(es) > 0 {
			e := es[rng.IntN(len(es))]
			out = append(out, e.Start+rng.Uint64N(4*(e.End-e.Start)+1))
		}
	}
	return out
}

// checkTable asserts that tb answers every probe as the linear scan of
// want (sentinel excluded) does.
func checkTable(t *testing.T, tb *Table, want []Entry, rng *rand.Rand) {
	t.Helper()
	full := withSentinel(want)
	if len(want) > 0 {
		require.Equal(t, want, tb.Entries())
	} else {
		require.Empty(t, tb.Entries())
	}
	for _, a := range probes(want, rng) {
		k, i := tb.Lookup(a)
		wk, wi := refLookup(full, a)
		if k != wk || i != wi {
			require.Failf(t, "wrong answer", "addr 0x%x: got key 0x%x index %d, want 0x%x index %d", a, k, i, wk, wi)
		}
	}
}

// Every kind of table, filled every way, answers exactly as the sorted
// array's contract says: before its index is rebuilt, once it is, and in
// the segment.
func TestTableIndexAgreesWithLinearScan(t *testing.T) {
	p := newPrimary(t, fixtureConfig{})
	for _, l := range layouts {
		t.Run(l.name, func(t *testing.T) {
			rng := rand.New(rand.NewPCG(7, uint64(len(l.name))))
			es := l.make(rng)
			size := max(len(es)+1, 2)

			inserted := NewTable(size)
			for _, i := range rng.Perm(len(es)) {
				require.NoError(t, inserted.Insert(es[i]))
			}
			checkTable(t, inserted, es, rng) // the first lookups search unindexed
			inserted.reindex()
			checkTable(t, inserted, es, rng)

			filled := NewTable(size)
			require.True(t, filled.Fill(es))
			filled.reindex()
			checkTable(t, filled, es, rng)

			hdrOff, err := p.seg.Alloc(64, 64)
			require.NoError(t, err)
			seg, err := newSegmentTable(p.seg, hdrOff, size)
			require.NoError(t, err)
			require.True(t, seg.Fill(es))
			checkTable(t, seg, es, rng)
			view, err := openSegmentTable(p.seg, hdrOff)
			require.NoError(t, err)
			checkTable(t, view, es, rng)
		})
	}
}

// starts returns the number of entries starting in each bucket of tb's
// index.
func bucketLoads(tb *Table) []int {
	var out []int
	for w := range tb.ix.Windows {
		win := tb.ix.W[w]
		for j := range int(win.Last) + 1 {
			d := int(win.Dir) + j
			out = append(out, int(tb.dir[d+1]-tb.dir[d]))
		}
	}
	return out
}

// The index answers in constant time where memory is laid out as MRs lay
// it: pages or runs of pages in memseg lists, far from external memory.
// Every bucket then holds at most one start, so no lookup searches.
func TestTableIndexBucketsHoldOneStart(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for _, name := range []string{"spaced 1000", "pages back to back", "two lists and external memory", "top of the address space"} {
		t.Run(name, func(t *testing.T) {
			es := layout(name, rng)
			tb := NewTable(len(es) + 1)
			require.True(t, tb.Fill(es))
			tb.reindex()
			loads := bucketLoads(tb)
			assert.NotEmpty(t, loads)
			assert.LessOrEqual(t, slices.Max(loads), 1, "a bucket holds more than one start")
			sum := 0
			for _, n := range loads {
				sum += n
			}
			assert.Equal(t, len(es), sum, "every entry starts in one bucket")
			assert.LessOrEqual(t, len(loads), 2*len(es)+maxWindows, "two buckets per entry at most")
		})
	}
	for _, name := range []string{"two", "spaced 17", "spaced 1000", "pages back to back", "top of the address space"} {
		t.Run("evenly spread starts stay one window/"+name, func(t *testing.T) {
			es := layout(name, rng)
			tb := NewTable(len(es) + 1)
			require.True(t, tb.Fill(es))
			tb.reindex()
			assert.Equal(t, uint32(1), tb.ix.Windows)
		})
	}
	for _, n := range []int{3, 4, 8, 9, 16} {
		t.Run(fmt.Sprintf("evenly spread starts stay one window/spaced %d", n), func(t *testing.T) {
			tb := NewTable(n + 1)
			require.True(t, tb.Fill(spaced(n)))
			tb.reindex()
			assert.Equal(t, uint32(1), tb.ix.Windows)
			assert.LessOrEqual(t, slices.Max(bucketLoads(tb)), 1)
		})
	}
	t.Run("external memory gets windows of its own", func(t *testing.T) {
		es := layout("two lists and external memory", rng)
		tb := NewTable(len(es) + 1)
		require.True(t, tb.Fill(es))
		tb.reindex()
		assert.Equal(t, uint32(maxWindows), tb.ix.Windows)
		assert.Equal(t, es[0].Start, tb.ix.W[0].Lo, "the low external chunk")
		assert.Equal(t, uint64(1)<<40, tb.ix.W[1].Lo, "the first list")
		assert.Equal(t, uint64(1)<<44, tb.ix.W[2].Lo, "the second list")
	})
}

// A Go-memory table keeps answering right through every kind of change,
// whether or not its index has caught up.
func TestTableIndexFollowsChanges(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 3))
	tb := NewTable(4)
	var want []Entry
	slot := func(i uint64) Entry { // slots 4 MiB apart, so entries never overlap
		s := uint64(1)<<40 + i*2*mb2
		return Entry{Start: s, End: s + 1 + rng.Uint64N(mb2), LKey: uint32(i + 1)}
	}
	for round := range 400 {
		switch op := rng.IntN(10); {
		case op < 6:
			e := slot(rng.Uint64N(3000))
			if _, i := refLookup(withSentinel(want), e.Start); i > 0 && want[i-1].Start == e.Start {
				break
			}
			if tb.Len() >= tb.Size() {
				require.NoError(t, tb.Expand(2*tb.Size()))
			}
			require.NoError(t, tb.Insert(e))
			want = append(want, e)
			slices.SortFunc(want, func(a, b Entry) int { return startCmp(a.Start, b.Start) })
		case op < 8:
			s := slot(rng.Uint64N(3000)).Start
			sp := []span{{s, s + rng.Uint64N(64*mb2)}}
			tb.dropOverlapping(sp)
			want = slices.DeleteFunc(want, func(e Entry) bool { return overlapsAny(sp, e.Start, e.End) })
		case op < 9:
			require.True(t, tb.Fill(want[:len(want)/2]))
			want = want[:len(want)/2]
		default:
			if round%3 == 0 {
				tb.Clear()
				want = nil
			}
		}
		for range rng.IntN(3 * tb.Len()) {
			k, i := tb.Lookup(rng.Uint64N(3001*2*mb2) + 1<<40)
			_, _ = k, i
		}
		checkTable(t, tb, want, rng)
	}
}

// A segment table keeps answering right through inserts, fills, clears and
// expansions, through the owner's handle and through another view.
func TestSegmentTableIndexFollowsChanges(t *testing.T) {
	p := newPrimary(t, fixtureConfig{})
	rng := rand.New(rand.NewPCG(4, 4))
	hdrOff, err := p.seg.Alloc(64, 64)
	require.NoError(t, err)
	tb, err := newSegmentTable(p.seg, hdrOff, 4)
	require.NoError(t, err)
	var want []Entry
	for range 200 {
		switch op := rng.IntN(10); {
		case op < 7:
			s := uint64(1)<<40 + rng.Uint64N(3000)*2*mb2
			e := Entry{Start: s, End: s + mb2, LKey: uint32(s >> 20)}
			if slices.ContainsFunc(want, func(w Entry) bool { return w.Start == s }) {
				break
			}
			if tb.Len() >= tb.Size() {
				tb, err = tb.expandSegment(2 * tb.Size())
				require.NoError(t, err)
			}
			require.NoError(t, tb.Insert(e))
			want = append(want, e)
			slices.SortFunc(want, func(a, b Entry) int { return startCmp(a.Start, b.Start) })
		case op < 9:
			want = want[:len(want)/2]
			require.True(t, tb.Fill(want))
		default:
			tb.Clear()
			want = nil
		}
		checkTable(t, tb, want, rng)
		view, err := openSegmentTable(p.seg, hdrOff)
		require.NoError(t, err)
		checkTable(t, view, want, rng)
	}
}

// An optimistic reader may read an index the owner is rewriting. Whatever
// it reads, the lookup stays inside the arrays and returns an index of the
// table: garbage that fails validation, never a fault.
func FuzzTableIndexSurvivesGarbage(f *testing.F) {
	f.Add([]byte{}, uint64(1)<<40)
	f.Add([]byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0, 0, 0, 0, 0x80}, uint64(1)<<41)
	f.Add(make([]byte, 64), uint64(math.MaxUint64))
	tail := make([]byte, 512)
	for i := range tail {
		tail[i] = byte(i * 7)
	}
	f.Add(tail, uint64(1)<<40+3*mb2)
	f.Fuzz(func(t *testing.T, garbage []byte, addr uint64) {
		tb := NewTable(64)
		require.True(t, tb.Fill(spaced(40)))
		tb.reindex()
		// Overwrite the index header and the directory with the input.
		words := make([]uint32, 0, len(garbage)/4)
		for i := 0; i+4 <= len(garbage); i += 4 {
			words = append(words, binary.LittleEndian.Uint32(garbage[i:]))
		}
		if len(words) > 0 {
			tb.ix.Windows = words[0]
		}
		for w := range maxWindows {
			if b := 1 + w*6; b+6 <= len(words) {
				win := &tb.ix.W[w]
				win.Lo = uint64(words[b]) | uint64(words[b+1])<<32
				win.Span = uint64(words[b+2]) | uint64(words[b+3])<<32
				win.Shift, win.Dir = words[b+4], words[b+5]
				win.First = words[b] ^ words[b+5]
			}
		}
		for i, w := range words {
			tb.dir[i%len(tb.dir)] = w
		}
		for _, a := range []uint64{addr, addr + mb2, addr - mb2, 0, math.MaxUint64} {
			_, i := tb.Lookup(a)
			assert.True(t, i >= 0 && i < tb.Len(), "index %d of a table of %d", i, tb.Len())
		}
	})
}

// Readers of the global table — in this process and through another
// mapping of the segment, as another process reads it — keep finding the
// memory that stays registered, under its key, while the primary inserts,
// rebuilds and expands the table and its index under them.
func TestGlobalLookupDuringIndexRebuilds(t *testing.T) {
	p := newPrimary(t, fixtureConfig{pages: 64, single: true, tableSize: 4})
	ps := uintptr(p.pageSize())
	stable := p.alloc(t, 6)
	want := map[uintptr]uint32{}
	for i := range uintptr(6) {
		e, err := p.g.Create(uint64(stable.Addr + i*ps))
		require.NoError(t, err)
		want[stable.Addr+i*ps+ps/2] = e.LKey
	}
	other := p.attachView(t)

	done := make(chan struct{})
	errs := make(chan error, 1)
	report := func(err error) {
		select {
		case errs <- err:
		default:
		}
	}
	var readers sync.WaitGroup
	for _, g := range []*Global{p.g, other, other} {
		readers.Add(1)
		go func() {
			defer readers.Done()
			for n := 0; ; n++ {
				select {
				case <-done:
					return
				default:
				}
				for a, k := range want {
					e, found, err := g.Lookup(uint64(a))
					switch {
					case err != nil:
						report(err)
						return
					case !found || e.LKey != k || !e.Contains(uint64(a)):
						report(fmt.Errorf("lookup %d of 0x%x: found %v, entry %v, want key 0x%x", n, a, found, e, k))
						return
					}
				}
			}
		}()
	}

	// Churn: register runs of single-page MRs (inserts, expansions) and
	// free them again (rebuilds), 30 rounds.
	rng := rand.New(rand.NewPCG(9, 9))
	for round := range 30 {
		r := p.alloc(t, 2+rng.IntN(30))
		for a := r.Addr; a < r.End(); a += ps {
			_, err := p.g.Create(uint64(a))
			require.NoError(t, err, "round %d", round)
		}
		require.NoError(t, p.mem.Free(r))
	}
	close(done)
	readers.Wait()
	close(errs)
	assert.NoError(t, <-errs)
	st := p.g.Stats()
	assert.Positive(t, st.Expansions, "the table was replaced under the readers")
	assert.Positive(t, st.Rebuilds)
}

// A window of evenly spaced starts (a power of two apart, as single-page
// mode registers pages) is marked affine, and lookups skip its directory;
// the directory still gives the same answers to a reader that ignores the
// mark. Other spacings keep the directory.
func TestTableIndexAffineWindows(t *testing.T) {
	p := newPrimary(t, fixtureConfig{})
	for _, c := range []struct {
		name   string
		affine bool
	}{
		{"two", true}, {"spaced 1000", true}, {"pages back to back", true}, {"top of the address space", true},
		{"pages every 12 KiB", false}, {"pages with a hole", false}, {"uneven gaps and sizes", false},
	} {
		t.Run(c.name, func(t *testing.T) {
			rng := rand.New(rand.NewPCG(3, uint64(len(c.name))))
			es := layout(c.name, rng)
			local := NewTable(len(es) + 1)
			require.True(t, local.Fill(es))
			local.reindex()
			hdrOff, err := p.seg.Alloc(64, 64)
			require.NoError(t, err)
			seg, err := newSegmentTable(p.seg, hdrOff, len(es)+1)
			require.NoError(t, err)
			require.True(t, seg.Fill(es))
			for _, tb := range []*Table{local, seg} {
				marked := false
				for w := range tb.ix.Windows {
					marked = marked || tb.ix.W[w].Shift&affine != 0
				}
				assert.Equal(t, c.affine, marked)
				checkTable(t, tb, es, rng)
				for w := range tb.ix.Windows {
					tb.ix.W[w].Shift &^= affine // a reader that ignores the mark
				}
				checkTable(t, tb, es, rng)
			}
		})
	}
}
