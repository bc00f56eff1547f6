package cache

import (
	"math/bits"
	"sync/atomic"
)

// The table's index.
//
// The entries stay a sorted array with DPDK's semantics (sentinel at index
// 0, the stop index on a miss, duplicates ignored), and Insert keeps
// finding its place with DPDK's binary search. Lookups go through an index
// in front of the array: a directory of equal-width address buckets. The
// table's starts are split into at most maxWindows windows at the widest
// gaps between them (memory of the memseg lists far below external memory,
// say); each window covers its starts with about two buckets per entry,
// and bucket j of a window records the index of the last entry that starts
// before it. A lookup finds its window, shifts the address into a bucket,
// reads two neighbouring directory words and compares with at most one
// entry: one cache line of directory and one of entries, at any table
// size. A bucket that holds more than one start (entries of very uneven
// spacing in one window) is searched between its two words, which is
// still a search over a few entries rather than the whole table.
//
// Measured here against the same loop in C (binary search, gcc -O2) and a
// static B+-tree ("S-tree") over the starts in the same run: a binary
// search costs a mispredicted branch and, past a few thousand entries, a
// cache miss per level; the B+-tree, with nodes of 8 or 16 starts counted
// without branches, needs 2 to 5 nodes of 8 to 16 scalar comparisons each,
// about 16, 25 and 28 ns at 256, 4,096 and 32,768 entries; the directory
// answers in 4 to 6 ns at all three sizes.
//
// A window whose starts are evenly spaced by a power of two — the pages of
// a memseg list registered one MR each, as single-page mode does — is
// marked affine: its buckets are one stride wide, so the entry starting in
// bucket j is the window's First+j, and a lookup reads that entry alone,
// without the directory. One dependent read fewer on the lookup that
// tables of tens of thousands of MRs make. The directory is written all
// the same, and a reader that ignores the mark finds the same answer.
//
// Local tables rebuild the index lazily: a change marks it out of date,
// and lookups use the binary search until they have paid for a rebuild, so
// that filling a table one insert at a time stays linear per insert. The
// global table's owner rebuilds it in the same write section as the change;
// optimistic readers validate afterwards, and every index they read from a
// torn or replaced index is clamped into the arrays they have, so a torn
// read gives a wrong answer that fails validation, never a fault.

// maxWindows bounds the windows of an index.
const maxWindows = 4

// affine marks a window's Shift: entry First+j starts at bucket j.
const affine = 1 << 31

// window is one run of consecutive entries and the directory covering
// their starts.
//
// The window covers [Lo, Lo+Span]: from its first entry's Start to the
// last byte of its last entry. Its buckets cover the starts; addresses past
// the last start belong to the last bucket.
//
//	off size field
//	  0   8  Lo     Start of the window's first entry
//	  8   8  Span   last address of its last entry minus Lo
//	 16   4  Shift  log2 of the bucket width (low 6 bits), and affine
//	                 (bit 31): the window's entries start every bucket
//	 20   4  Dir    directory index of the window's bucket 0
//	 24   4  First  table index of the window's first entry
//	 28   4  Last   its last bucket
type window struct {
	Lo    uint64
	Span  uint64
	Shift uint32
	Dir   uint32
	First uint32
	Last  uint32
}

// tableIndex heads the index: the windows, ordered by address. The
// directory (uint32 table indexes) follows it.
//
//	off size field
//	  0   4  Windows  windows in use
//	  4   4  DirLen   directory words in use
//	  8  56  reserved
//	 64 128  W        the windows
type tableIndex struct {
	Windows uint32
	DirLen  uint32
	_       [56]byte
	W       [maxWindows]window
}

// dirCap returns the directory words an index of a table of size entries
// may need: at most two buckets per entry and one closing word per window.
func dirCap(size int) int { return 2*size + maxWindows }

// locate returns the index of the last entry among ents[:n] whose Start is
// at most addr (0 < n <= len(ents)): the sentinel when there is none.
func (t *Table) locate(addr uint64, n int) int {
	if t.seg == nil && t.reindexIn != 0 {
		return t.locateUnindexed(addr, n)
	}
	ix := t.ix
	nw := min(atomic.LoadUint32(&ix.Windows), maxWindows)
	for w := range nw {
		win := &ix.W[w]
		lo := atomic.LoadUint64(&win.Lo)
		if addr < lo {
			// Between the previous window and this one: the last entry
			// before this window.
			return max(min(int(atomic.LoadUint32(&win.First)), n)-1, 0)
		}
		off := addr - lo
		if off > atomic.LoadUint64(&win.Span) {
			continue
		}
		j := uint64(atomic.LoadUint32(&win.Dir)) + min(off>>(atomic.LoadUint32(&win.Shift)&63), uint64(atomic.LoadUint32(&win.Last)))
		if j+1 >= uint64(len(t.dir)) {
			break // torn: only an optimistic reader of a changing index gets here
		}
		i, e := int(atomic.LoadUint32(&t.dir[j])), int(atomic.LoadUint32(&t.dir[j+1]))
		switch {
		case e >= n || i > e:
			// torn, as above
		case e-i <= 1:
			// At most one entry starts in the bucket: take it if it starts
			// at or before addr. No branch: the borrow decides.
			_, below := bits.Sub64(addr, atomic.LoadUint64(&t.ents[e].Start), 0)
			return i + (e-i)&int(below^1)
		default:
			return i + search(t.ents[i:], e-i+1, addr)
		}
		break
	}
	return t.lastOr(addr, n)
}

// lastOr finishes locate for an address past every window, or one whose
// directory words were torn: the last entry if it starts at or below addr,
// else a binary search.
func (t *Table) lastOr(addr uint64, n int) int {
	if atomic.LoadUint64(&t.ents[n-1].Start) <= addr {
		return n - 1
	}
	return search(t.ents, n, addr)
}

// locateUnindexed is locate while a Go-memory table's index is out of
// date: DPDK's binary search, and a rebuild once enough lookups have been
// made to pay for it.
func (t *Table) locateUnindexed(addr uint64, n int) int {
	t.reindexIn--
	if t.reindexIn == 0 {
		t.reindex()
	}
	return search(t.ents, n, addr)
}

// changed notes that the entries changed. A segment table's index is
// rebuilt at once (the owner calls this with the write lock held); a
// Go-memory table's after a number of lookups in proportion to its size.
func (t *Table) changed() {
	if t.seg != nil {
		t.reindex()
		return
	}
	t.reindexIn = 1 + t.Len()/8
}

// reindex rebuilds the index from the entries.
func (t *Table) reindex() {
	if t.seg == nil {
		t.reindexIn = 0
	}
	n := min(t.Len(), len(t.ents))
	start := func(i int) uint64 { return atomic.LoadUint64(&t.ents[i].Start) }

	// Windows: entries [bounds[w], bounds[w+1]), split at the gap that is
	// the largest part of its window's span while that part is an eighth
	// or more and the gap at least four times the window's other gaps on
	// average: a gap that widens every bucket of its window. Evenly spread
	// starts stay one window.
	var bounds [maxWindows + 1]int
	nw := 0
	if n > 1 {
		bounds[0], bounds[1], nw = 1, n, 1
	}
	for nw < maxWindows {
		best, at, in := 0.0, 0, 0
		for w := range nw {
			a, b := bounds[w], bounds[w+1]-1
			if b-a < 2 {
				continue // two starts always fall in different buckets
			}
			var widest uint64
			wat, prev := 0, start(a)
			for i := a + 1; i <= b; i++ {
				s := start(i)
				if s-prev > widest {
					widest, wat = s-prev, i
				}
				prev = s
			}
			span, g := float64(prev-start(a)), float64(widest)
			rest := (span - g) / float64(b-a-1)
			if r := g / span; r >= 1.0/8 && g >= 4*rest && r > best {
				best, at, in = r, wat, w
			}
		}
		if best == 0 {
			break
		}
		copy(bounds[in+2:nw+2], bounds[in+1:nw+1])
		bounds[in+1] = at
		nw++
	}

	need := 0
	for w := range nw {
		need += 2*(bounds[w+1]-bounds[w]) + 1
	}
	if t.seg == nil && len(t.dir) < need {
		t.dir = make([]uint32, max(need, 2*len(t.dir)))
	}
	if need > len(t.dir) {
		// Cannot happen with a directory of dirCap(Size) words; an empty
		// index sends lookups to the binary search.
		nw, need = 0, 0
	}

	p := 0
	for w := range nw {
		a, b := bounds[w], bounds[w+1]-1
		lo := start(a)
		span := start(b) - lo
		count := uint64(b - a + 1)
		shift := uint32(0)
		if s, ok := t.evenlySpaced(a, b); ok {
			shift = s | affine
		} else {
			for span>>shift >= 2*count {
				shift++
			}
		}
		if end := atomic.LoadUint64(&t.ents[b].End); end > lo+span {
			span = end - 1 - lo // the last entry's bytes, in the last bucket
		}
		if w+1 < nw {
			// But never into the next window: an address there belongs
			// to the entries that start there, even if this window's
			// last entry (overlapping them) reaches that far.
			span = min(span, start(bounds[w+1])-1-lo)
		}
		buckets := int((start(b)-lo)>>(shift&63)) + 1
		// Bucket j records the last entry whose bucket is below j.
		j, k := 0, a-1
		for e := a; e <= b; e++ {
			for be := int((start(e) - lo) >> (shift & 63)); j <= be; j++ {
				t.setDir(p+j, uint32(k))
			}
			k = e
		}
		for ; j <= buckets; j++ {
			t.setDir(p+j, uint32(k))
		}
		win := &t.ix.W[w]
		atomic.StoreUint64(&win.Lo, lo)
		atomic.StoreUint64(&win.Span, span)
		atomic.StoreUint32(&win.Shift, shift)
		atomic.StoreUint32(&win.Dir, uint32(p))
		atomic.StoreUint32(&win.First, uint32(a))
		atomic.StoreUint32(&win.Last, uint32(buckets-1))
		p += buckets + 1
	}
	atomic.StoreUint32(&t.ix.DirLen, uint32(p))
	atomic.StoreUint32(&t.ix.Windows, uint32(nw))
}

// evenlySpaced reports whether the starts of entries a..b (a < b) are
// evenly spaced by a power of two, and its log2.
func (t *Table) evenlySpaced(a, b int) (uint32, bool) {
	if b <= a {
		return 0, false
	}
	stride := atomic.LoadUint64(&t.ents[a+1].Start) - atomic.LoadUint64(&t.ents[a].Start)
	if stride == 0 || stride&(stride-1) != 0 {
		return 0, false
	}
	for e := a + 1; e <= b; e++ {
		if atomic.LoadUint64(&t.ents[e].Start)-atomic.LoadUint64(&t.ents[e-1].Start) != stride {
			return 0, false
		}
	}
	return uint32(bits.TrailingZeros64(stride)), true
}

// setDir writes directory word i: plainly in Go memory (which one
// goroutine owns); atomically in the segment, and only if it changes, since
// most words keep their value when an entry is added near the end.
func (t *Table) setDir(i int, v uint32) {
	if t.seg == nil {
		t.dir[i] = v
	} else if d := &t.dir[i]; atomic.LoadUint32(d) != v {
		atomic.StoreUint32(d, v)
	}
}
