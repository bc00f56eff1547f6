package cache

import (
	"encoding/binary"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/hugetlb"
)

// createThenFree creates through the primary, then frees the page it
// created for before the answer reaches the caller: a free that happens
// while the answer of a create travels back (in a secondary, while the
// reply is on its way over IPC).
type createThenFree struct {
	g     *Global
	mem   *hugetlb.Memory
	ps    uint64
	calls int
	freed bool
}

func (c *createThenFree) CreateMR(addr uint64) (Entry, error) {
	c.calls++
	e, err := c.g.Create(addr)
	if err == nil && !c.freed {
		c.freed = true
		page := addr &^ (c.ps - 1)
		if err := c.mem.Free(hugetlb.Region{Addr: uintptr(page), Len: c.ps}); err != nil {
			return Entry{}, err
		}
	}
	return e, err
}

func (c *createThenFree) RegisterExternal(addr, length uint64) (Entry, error) {
	return Entry{}, ErrExternalMemory
}

// LookupBurst promises the answers Lookup would give one address at a
// time, and to honour a free that happened while it waited for a slower
// level for every address after that. When the memory of the entry a
// create just returned is freed before the burst goes on, Lookup of the
// next address in that entry catches up, drops the entry and fails
// (ErrNoMemory); the burst catches up too, but then answers the next
// addresses from the dropped entry it still holds in its locals
// (burst.go: "start, size, key = e.Start, ..." after catchUp).
func TestBreaker3BurstDoesNotAnswerFromAnEntryItJustDropped(t *testing.T) {
	p := newPrimary(t, fixtureConfig{pages: 16, single: true})
	ps := p.pageSize()

	// One address at a time.
	one := p.alloc(t, 1)
	single := NewLocal(p.g, &createThenFree{g: p.g, mem: p.mem, ps: ps}, 0)
	k0, err0 := single.Lookup(one.Addr)
	_, err1 := single.Lookup(one.Addr + 8)
	require.NoError(t, err0)
	require.NotEqual(t, InvalidKey, k0)
	require.ErrorIs(t, err1, ErrNoMemory, "Lookup: the page was freed before the second address")

	// The same as a burst.
	two := p.alloc(t, 1)
	burst := NewLocal(p.g, &createThenFree{g: p.g, mem: p.mem, ps: ps}, 0)
	keys := []uint32{7, 7, 7}
	n, err := burst.LookupBurst([]uintptr{two.Addr, two.Addr + 8, two.Addr + 16}, keys)
	assert.Equal(t, 1, n, "the burst answers what Lookup answers: the first address only (keys %x)", keys)
	assert.ErrorIs(t, err, ErrNoMemory)
	assert.Equal(t, uint32(7), keys[2], "keys past the failure are left alone")
	// And the cache itself agrees with Lookup: the page is gone.
	_, err = burst.Lookup(two.Addr + 8)
	assert.ErrorIs(t, err, ErrNoMemory)
}

// Insert keeps the starts sorted but, as DPDK's does, looks only at the
// entry before the new one: an entry may reach past the starts of those
// after it. A plain binary search then answers with the last entry that
// starts at or before the address. The index widens the span of a
// window's last entry to cover that entry's bytes (index.go: "span =
// end - 1 - lo"), so when that entry reaches into the next window, the
// next window's addresses are answered by the previous window's last
// entry instead.
func TestBreaker3IndexMatchesSearchWhenAnEntryReachesIntoTheNextWindow(t *testing.T) {
	base := uint64(1) << 40
	var es []Entry
	for i := range 16 { // a cluster of pages
		s := base + uint64(i)*4096
		es = append(es, Entry{Start: s, End: s + 4096})
	}
	far := base + 1<<36
	for i := range 16 { // another, far above
		s := far + uint64(i)*4096
		es = append(es, Entry{Start: s, End: s + 4096})
	}
	keyed(es)
	// The last of the first cluster reaches over the second.
	long := Entry{Start: base + 16*4096, End: far + 64*4096, LKey: 100}

	for _, seg := range []bool{false, true} {
		var tb *Table
		if seg {
			p := newPrimary(t, fixtureConfig{})
			hdrOff, err := p.seg.Alloc(64, 64)
			require.NoError(t, err)
			tb, err = newSegmentTable(p.seg, hdrOff, 64)
			require.NoError(t, err)
		} else {
			tb = NewTable(64)
		}
		for _, e := range es {
			require.NoError(t, tb.Insert(e))
		}
		require.NoError(t, tb.Insert(long))
		tb.reindex()
		want := tb.Entries()
		require.Len(t, want, len(es)+1)
		full := withSentinel(want)
		bad := 0
		for _, e := range want {
			for _, a := range []uint64{e.Start, e.Start + 1, e.End - 1} {
				k, i := tb.Lookup(a)
				wk, wi := refLookup(full, a)
				if k != wk || i != wi {
					if bad++; bad <= 3 {
						t.Errorf("segment=%t addr 0x%x: got key %d index %d, a binary search gives key %d index %d",
							seg, a, k, i, wk, wi)
					}
				}
			}
		}
		if bad > 3 {
			t.Errorf("segment=%t: %d wrong answers in all", seg, bad)
		}
	}
}

// breaker3Entries decodes data into sorted entries that do not overlap,
// with adversarial spacing: back to back, one byte apart, gaps of any
// power of two up to 2^63, sizes of 1 byte to 2^63, starting anywhere
// (0 included) and running up to the top of the address space.
func breaker3Entries(data []byte) []Entry {
	var a uint64
	if len(data) >= 8 {
		a = binary.LittleEndian.Uint64(data)
		data = data[8:]
	}
	var es []Entry
	for i := 0; i+2 <= len(data) && len(es) < 400; i += 2 {
		g, s := data[i], data[i+1]
		var gap uint64
		switch g & 7 {
		case 0:
			gap = 0
		case 1:
			gap = 1
		case 2, 3:
			gap = 4096 * uint64(g>>3)
		default:
			gap = uint64(1) << (g >> 2 & 63)
		}
		var size uint64
		switch s & 3 {
		case 0:
			size = 1
		case 1:
			size = 4096
		case 2:
			size = uint64(s>>2) + 1
		default:
			size = uint64(1) << (s >> 2 & 63)
		}
		if len(es) > 0 || gap > 0 {
			if a+gap < a {
				break
			}
			a += gap
		}
		if a+size <= a { // wraps, or ends at 2^64 (End cannot say so)
			break
		}
		es = append(es, Entry{Start: a, End: a + size, LKey: uint32(len(es) + 1)})
		a += size
	}
	return es
}

func breaker3Probes(es []Entry, extra uint64) []uint64 {
	out := []uint64{0, 1, math.MaxUint64, math.MaxUint64 - 1, extra, extra - 1, extra + 1}
	for _, e := range es {
		out = append(out, e.Start-1, e.Start, e.Start+1, e.Start+(e.End-e.Start)/2, e.End-2, e.End-1, e.End, e.End+1)
	}
	return out
}

func breaker3Check(t *testing.T, what string, tb *Table, want []Entry, probes []uint64) {
	t.Helper()
	got := tb.Entries()
	if len(want) == 0 {
		require.Empty(t, got, what)
	} else {
		require.Equal(t, want, got, what)
	}
	full := withSentinel(want)
	for _, a := range probes {
		k, i := tb.Lookup(a)
		wk, wi := refLookup(full, a)
		if k != wk || i != wi {
			t.Fatalf("%s: addr 0x%x: got key %d index %d, want key %d index %d (%d entries)", what, a, k, i, wk, wi, len(want))
		}
	}
}

// Tables that keep Fill's contract (sorted, no overlaps) answer as a
// binary search does, on every path: unindexed, indexed, in the segment,
// through a view, after Expand, after dropOverlapping, after Clear.
func FuzzBreaker3IndexMatchesSearch(f *testing.F) {
	f.Add([]byte{}, uint64(0))
	f.Add([]byte{0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 4, 2}, uint64(1))
	f.Add(append(make([]byte, 8), 0xfc, 0xff, 0, 0, 0xfc, 0xfc, 1, 1, 1, 0), uint64(1)<<63)
	big := make([]byte, 8+800)
	for i := range big[8:] {
		big[8+i] = byte(i*37 + i>>3)
	}
	f.Add(big, uint64(1)<<40)
	p := newPrimary(f, fixtureConfig{})
	hdrOff, err := p.seg.Alloc(64, 64)
	require.NoError(f, err)
	segTab, err := newSegmentTable(p.seg, hdrOff, 512)
	require.NoError(f, err)
	f.Fuzz(func(t *testing.T, data []byte, extra uint64) {
		es := breaker3Entries(data)
		probes := breaker3Probes(es, extra)

		filled := NewTable(len(es) + 1)
		require.True(t, filled.Fill(es))
		breaker3Check(t, "filled, unindexed", filled, es, probes)
		filled.reindex()
		breaker3Check(t, "filled, indexed", filled, es, probes)

		inserted := NewTable(2)
		for i := len(es) - 1; i >= 0 && es[0].Start != 0; i-- { // Insert refuses a start of 0
			if inserted.Len() >= inserted.Size() {
				require.NoError(t, inserted.Expand(2*inserted.Size()))
			}
			require.NoError(t, inserted.Insert(es[i]))
		}
		if len(es) > 0 && es[0].Start != 0 {
			inserted.reindex()
			breaker3Check(t, "inserted backwards, indexed", inserted, es, probes)
		}

		require.True(t, segTab.Fill(es))
		breaker3Check(t, "segment", segTab, es, probes)
		view, err := openSegmentTable(p.seg, hdrOff)
		require.NoError(t, err)
		breaker3Check(t, "view", view, es, probes)

		sp := []span{{extra, extra + uint64(len(data))<<(extra&31)}}
		if sp[0].end < sp[0].start {
			sp[0].end = math.MaxUint64
		}
		kept := slices.DeleteFunc(slices.Clone(es), func(e Entry) bool { return overlapsAny(sp, e.Start, e.End) })
		filled.dropOverlapping(sp)
		breaker3Check(t, "dropped, unindexed", filled, kept, probes)
		filled.reindex()
		breaker3Check(t, "dropped, indexed", filled, kept, probes)
		filled.Clear()
		breaker3Check(t, "cleared", filled, nil, probes)
	})
}

// Optimistic readers of the global table, in this process and through a
// second mapping, look up while the owner replaces the table's contents
// (Fill, Clear and Insert, in random orders) and the table itself
// (expandSegment) in write sections. Every answer that passes validation
// must be exactly what a binary search over the contents of that moment
// gives, key and stop index: the writer records which contents it left,
// inside the section, and the reader reads that word inside its
// optimistic section too.
func TestBreaker3OptimisticReadersNeverPassATornAnswer(t *testing.T) {
	p := newPrimary(t, fixtureConfig{tableSize: 4})
	other := p.attachView(t)
	rng := rand.New(rand.NewPCG(33, 3))
	names := []string{"empty", "one", "spaced 17", "pages back to back", "two lists and external memory",
		"uneven gaps and sizes", "a crowd in one bucket", "top of the address space"}
	sets := make([][]Entry, len(names))
	var probeSets [][]uint64
	for k, n := range names {
		es := layout(n, rng)
		for i := range es {
			es[i].LKey = uint32(k)<<16 | uint32(i+1)
		}
		sets[k] = es
		probeSets = append(probeSets, probes(es, rng))
	}
	var all []uint64
	for _, ps := range probeSets {
		all = append(all, ps...)
	}
	full := make([][]Entry, len(sets))
	for k := range sets {
		full[k] = withSentinel(sets[k])
	}
	var cur atomic.Int32 // which set the table holds; written in write sections

	done := make(chan struct{})
	var readers sync.WaitGroup
	t.Cleanup(func() { // before the segment goes
		close(done)
		readers.Wait()
	})
	var checked, torn atomic.Uint64
	errs := make(chan string, 1)
	for r, g := range []*Global{p.g, other} {
		readers.Add(1)
		go func() {
			defer readers.Done()
			rr := rand.New(rand.NewPCG(uint64(r), 1))
			for {
				select {
				case <-done:
					return
				default:
				}
				a := all[rr.IntN(len(all))]
				stamp, ok := g.lock.Optimistic()
				if !ok {
					continue
				}
				k := cur.Load()
				tb, err := g.table()
				if err != nil || tb.Overflowed() {
					torn.Add(1)
					continue
				}
				key, idx := tb.Lookup(a)
				if !g.lock.Validate(stamp) {
					torn.Add(1)
					continue
				}
				checked.Add(1)
				if wk, wi := refLookup(full[k], a); key != wk || idx != wi {
					select {
					case errs <- fmt.Sprintf("reader %d, set %q, addr 0x%x: key 0x%x index %d, want 0x%x index %d",
						r, names[k], a, key, idx, wk, wi):
					default:
					}
					return
				}
			}
		}()
	}

	rounds := 1200
	if raceEnabled {
		rounds = 150
	}
	for range rounds {
		k := rng.IntN(len(sets))
		es := sets[k]
		require.NoError(t, p.g.Exclusive(func() {
			tb, err := p.g.table()
			require.NoError(t, err)
			// Grow when needed; now and then replace the array by one of
			// the same size, freeing the old one under the readers.
			if need := len(es) + 1; need > tb.Size() || rng.IntN(10) == 0 {
				size := tb.Size()
				for size < need {
					size *= 2
				}
				nt, err := tb.expandSegment(size)
				require.NoError(t, err)
				p.g.tbl.Store(nt)
				tb = nt
			}
			if rng.IntN(3) == 0 {
				tb.Clear()
				for _, i := range rng.Perm(len(es)) {
					require.NoError(t, tb.Insert(es[i]))
				}
			} else {
				require.True(t, tb.Fill(es))
			}
			cur.Store(int32(k))
		}))
		select {
		case msg := <-errs:
			t.Fatal(msg)
		default:
		}
	}
	select {
	case msg := <-errs:
		t.Fatal(msg)
	default:
	}
	t.Logf("%d answers checked, %d reads discarded", checked.Load(), torn.Load())
	assert.Positive(t, checked.Load())
}
