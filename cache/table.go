package cache

import (
	"errors"
	"fmt"
	"sync/atomic"

	"github.com/mpmr/mpmr/shm"
)

// InvalidKey is the key of no memory region: what a miss returns.
const InvalidKey uint32 = 0xFFFFFFFF

// Entry maps the address range [Start, End) to a key.
//
//	off size field
//	  0   8  Start
//	  8   8  End
//	 16   4  LKey  host byte order
//	 20   4  reserved
type Entry struct {
	Start uint64 `json:"start"`
	End   uint64 `json:"end"`
	LKey  uint32 `json:"lkey"`
	_     uint32
}

// Contains reports whether addr lies in [e.Start, e.End).
func (e *Entry) Contains(addr uint64) bool { return addr-e.Start < e.End-e.Start }

func (e Entry) String() string {
	return fmt.Sprintf("[0x%x, 0x%x) lkey 0x%x", e.Start, e.End, e.LKey)
}

// tableHeader describes a Table; for the global table it lives in the
// segment, for local tables in Go memory.
//
//	off size field
//	  0   4  Len       entries in use, the sentinel at index 0 included
//	  4   4  Size      capacity in entries
//	  8   4  Overflow  1 once an insert found the table full
//	 12   4  Gen       bumped each time the entry array is replaced (global table)
//	 16   8  Entries   segment offset of the entry array (global table)
//	 24  40  reserved
type tableHeader struct {
	Len      uint32
	Size     uint32
	Overflow uint32
	Gen      uint32
	Entries  uint64
	_        [40]byte
}

// ErrTableFull is returned by Insert when the table has no room; the table
// is then marked overflowed.
var ErrTableFull = errors.New("cache: lookup table is full")

// ErrCorrupt means shared cache state failed a sanity check.
var ErrCorrupt = errors.New("cache: shared state is corrupt")

// MaxTableSize bounds a table; indexes stay within uint32 and a table of
// this size is far beyond any realistic number of registered chunks.
const MaxTableSize = 1 << 24

// Table is the sorted lookup table DPDK's mlx5 driver calls its "B-tree": entries ordered
// by Start with a zero entry at index 0, so a binary search never falls off
// the front. Lookups go through an index of address buckets in front of
// the array (see index.go) that answers in constant time. The same code
// serves local tables in Go memory and the global table in the control
// segment, where the entry array and its index share one arena block:
//
//	[Size]Entry, padded to 64 bytes | tableIndex | [dirCap(Size)]uint32
//
// A Table is not safe for concurrent use by itself: local tables belong to
// one goroutine; the global table is guarded by the global cache's lock.
// Shared words are read and written with sync/atomic either way.
type Table struct {
	hdr  *tableHeader
	ents []Entry // ents[:hdr.Len] are in use; len(ents) == hdr.Size
	ix   *tableIndex
	dir  []uint32

	// Go-memory tables only: lookups left until the index is rebuilt, 0
	// when it is up to date; and the header and index hdr and ix point
	// to, which lookups then reach without following the pointers.
	reindexIn int
	own       struct {
		hdr tableHeader
		ix  tableIndex
	}

	// Segment tables only.
	seg *shm.Segment
	off uint64 // offset ents was made from
	gen uint32 // the header's Gen when ents was made
}

// NewTable returns a table in Go memory with room for size entries.
func NewTable(size int) *Table {
	size = max(size, 2)
	t := &Table{ents: make([]Entry, size)}
	t.hdr, t.ix = &t.own.hdr, &t.own.ix
	atomic.StoreUint32(&t.hdr.Size, uint32(size))
	t.Clear()
	return t
}

// newSegmentTable lays out a table of size entries in the segment, with its
// header at hdrOff (owner only).
func newSegmentTable(seg *shm.Segment, hdrOff uint64, size int) (*Table, error) {
	off, err := seg.Alloc(tableBlockSize(size), 64)
	if err != nil {
		return nil, fmt.Errorf("cache: table of %d entries: %w", size, err)
	}
	hdr := shm.At[tableHeader](seg, hdrOff)
	atomic.StoreUint64(&hdr.Entries, off)
	atomic.StoreUint32(&hdr.Size, uint32(size))
	t := &Table{hdr: hdr, seg: seg}
	t.remap(off, size)
	t.Clear()
	return t, nil
}

// openSegmentTable returns a view of the segment table whose header is at
// hdrOff, over the entry array the header names now. A view stays valid
// until the owner expands the table; compare Stale.
func openSegmentTable(seg *shm.Segment, hdrOff uint64) (*Table, error) {
	hdr := shm.At[tableHeader](seg, hdrOff)
	// Gen first: the owner replaces the array, then bumps Gen, so a view
	// that read the new Gen also read the new array, and one that read the
	// old Gen is found stale.
	gen := atomic.LoadUint32(&hdr.Gen)
	off := atomic.LoadUint64(&hdr.Entries)
	size := uint64(atomic.LoadUint32(&hdr.Size))
	if size < 2 || size > MaxTableSize || seg.CheckRange(off, tableBlockSize(int(size))) != nil {
		return nil, fmt.Errorf("%w: global table header names %d entries at 0x%x", ErrCorrupt, size, off)
	}
	t := &Table{hdr: hdr, seg: seg, gen: gen}
	t.remap(off, int(size))
	return t, nil
}

// Stale reports whether a segment table view no longer covers the array
// the header names: the owner replaced it (expanded the table), even if the
// new array happens to sit where the old one did.
func (t *Table) Stale() bool {
	return t.seg != nil && (atomic.LoadUint32(&t.hdr.Gen) != t.gen || atomic.LoadUint64(&t.hdr.Entries) != t.off ||
		int(atomic.LoadUint32(&t.hdr.Size)) != len(t.ents))
}

func (t *Table) remap(off uint64, size int) {
	t.off = off
	t.ents = shm.Slice[Entry](t.seg, off, size)
	ixOff := off + entriesSize(size)
	t.ix = shm.At[tableIndex](t.seg, ixOff)
	t.dir = shm.Slice[uint32](t.seg, ixOff+tableIndexSize, dirCap(size))
}

// entriesSize returns the bytes of an entry array of size entries, padded
// so that the index behind it starts on a cache line.
func entriesSize(size int) uint64 { return (uint64(size)*entrySize + 63) &^ 63 }

// tableBlockSize returns the bytes of a segment table's block: entries,
// index header and directory.
func tableBlockSize(size int) uint64 {
	return entriesSize(size) + tableIndexSize + uint64(dirCap(size))*4
}

// Len returns the number of entries in use, the sentinel included. In a
// segment table the word can be rewritten by any process mapping it: it
// is bounded by the array this view has, and the sentinel.
func (t *Table) Len() int {
	return max(1, min(int(atomic.LoadUint32(&t.hdr.Len)), len(t.ents)))
}

// Size returns the capacity: that of the array this view has, whatever
// the header says now.
func (t *Table) Size() int { return len(t.ents) }

// writeHeader writes the header's words that name the array as this
// view has them (the owner's view, put right after another process
// rewrote them).
func (t *Table) writeHeader() {
	atomic.StoreUint32(&t.hdr.Size, uint32(len(t.ents)))
	atomic.StoreUint64(&t.hdr.Entries, t.off)
	atomic.StoreUint32(&t.hdr.Gen, t.gen)
}

// Overflowed reports whether an insert found the table full since the last
// Clear: the table then misses entries and lookups must fall back to the
// MR list.
func (t *Table) Overflowed() bool { return atomic.LoadUint32(&t.hdr.Overflow) != 0 }

// Clear empties the table down to its sentinel.
func (t *Table) Clear() {
	t.store(0, Entry{LKey: InvalidKey})
	atomic.StoreUint32(&t.hdr.Len, 1)
	atomic.StoreUint32(&t.hdr.Overflow, 0)
	t.reindex()
}

// Lookup searches for addr. It returns the key and the index of the entry
// holding addr, or InvalidKey and the index where the search stopped: the
// last entry starting at or before addr, after which addr would be
// inserted.
func (t *Table) Lookup(addr uint64) (uint32, int) {
	e, idx, hit := t.find(addr)
	if hit {
		return e.LKey, idx
	}
	return InvalidKey, idx
}

// find is Lookup returning the entry where the search stopped, and whether
// it holds addr.
func (t *Table) find(addr uint64) (e Entry, idx int, hit bool) {
	// The bound keeps an optimistic reader of the global table, which may
	// see a length from a newer, larger array, inside the one it has.
	n := min(int(atomic.LoadUint32(&t.hdr.Len)), len(t.ents))
	if n == 0 {
		return Entry{LKey: InvalidKey}, 0, false
	}
	ok := false
	if t.seg != nil {
		e, idx, ok = t.probe(addr, n)
	} else if t.reindexIn == 0 {
		e, idx, ok = t.probeLocal(addr)
	}
	if !ok {
		idx = t.locate(addr, n)
		e = t.At(idx)
	}
	return e, idx, e.Start <= addr && addr < e.End
}

// At returns entry i (0 <= i < Len()).
func (t *Table) At(i int) Entry {
	e := &t.ents[i]
	return Entry{Start: atomic.LoadUint64(&e.Start), End: atomic.LoadUint64(&e.End), LKey: atomic.LoadUint32(&e.LKey)}
}

func (t *Table) store(i int, v Entry) {
	e := &t.ents[i]
	atomic.StoreUint64(&e.Start, v.Start)
	atomic.StoreUint64(&e.End, v.End)
	atomic.StoreUint32(&e.LKey, v.LKey)
}

// Insert adds e in order. An entry already covering e.Start makes it a
// no-op. A full table is marked overflowed and ErrTableFull returned.
func (t *Table) Insert(e Entry) error {
	if e.Start == 0 || e.End <= e.Start {
		return fmt.Errorf("cache: insert %v: empty or null range", e)
	}
	n := t.Len()
	idx := search(t.ents, n, e.Start)
	if e.Start < t.At(idx).End {
		return nil
	}
	if n >= t.Size() {
		atomic.StoreUint32(&t.hdr.Overflow, 1)
		return ErrTableFull
	}
	idx++
	if t.seg == nil {
		// Go-memory tables belong to one goroutine: a plain move will do.
		copy(t.ents[idx+1:n+1], t.ents[idx:n])
	} else {
		for i := n; i > idx; i-- {
			t.store(i, t.At(i-1))
		}
	}
	t.store(idx, e)
	atomic.StoreUint32(&t.hdr.Len, uint32(n+1))
	t.changed()
	return nil
}

// Fill replaces the contents with es, which must be sorted by Start and
// must not overlap; it fills the table up to its size and reports whether
// everything fit (if not, the table is marked overflowed). Filling writes
// each entry once, where inserting one by one would move entries around.
func (t *Table) Fill(es []Entry) bool {
	n := min(len(es), t.Size()-1)
	for i := range n {
		t.store(i+1, es[i])
	}
	atomic.StoreUint32(&t.hdr.Len, uint32(n+1))
	full := n < len(es)
	if full {
		atomic.StoreUint32(&t.hdr.Overflow, 1)
	} else {
		atomic.StoreUint32(&t.hdr.Overflow, 0)
	}
	t.changed()
	return !full
}

// Expand grows a Go-memory table to hold n entries, keeping its contents.
// Global tables grow with expandSegment instead.
func (t *Table) Expand(n int) error {
	if t.seg != nil {
		return errors.New("cache: Expand on a segment table")
	}
	if n <= t.Size() {
		return nil
	}
	if n > MaxTableSize {
		return fmt.Errorf("cache: table of %d entries: over the limit of %d", n, MaxTableSize)
	}
	ents := make([]Entry, n)
	copy(ents, t.ents[:t.Len()])
	t.ents = ents
	atomic.StoreUint32(&t.hdr.Size, uint32(n))
	return nil
}

// expandSegment moves a segment table into a new array of n entries, frees
// the old one and returns a view of the new one; t itself is left alone,
// since other goroutines may be reading through it. Owner only, with the
// global write lock held: other views notice with Stale.
func (t *Table) expandSegment(n int) (*Table, error) {
	if n > MaxTableSize {
		return nil, fmt.Errorf("cache: table of %d entries: over the limit of %d", n, MaxTableSize)
	}
	off, err := t.seg.Alloc(tableBlockSize(n), 64)
	if err != nil {
		return nil, fmt.Errorf("cache: expand table to %d entries: %w", n, err)
	}
	nt := &Table{hdr: t.hdr, seg: t.seg, gen: atomic.LoadUint32(&t.hdr.Gen) + 1}
	nt.remap(off, n)
	used := t.Len()
	for i := range used {
		nt.store(i, t.At(i))
	}
	nt.reindex()
	atomic.StoreUint32(&t.hdr.Size, uint32(n))
	atomic.StoreUint64(&t.hdr.Entries, off)
	atomic.StoreUint32(&t.hdr.Gen, nt.gen)
	return nt, t.seg.Free(t.off)
}

// dropOverlapping removes the entries overlapping any of spans, keeping
// the rest in order, and returns how many it removed. Go-memory tables
// only.
func (t *Table) dropOverlapping(spans []span) int {
	n := t.Len()
	w := 1
	for i := 1; i < n; i++ {
		if e := t.ents[i]; !overlapsAny(spans, e.Start, e.End) {
			t.ents[w] = e
			w++
		}
	}
	atomic.StoreUint32(&t.hdr.Len, uint32(w))
	if w != n {
		t.changed()
	}
	return n - w
}

// Entries returns a copy of the entries in use, sentinel excluded.
func (t *Table) Entries() []Entry {
	n := min(t.Len(), len(t.ents))
	out := make([]Entry, 0, n-1)
	for i := 1; i < n; i++ {
		out = append(out, t.At(i))
	}
	return out
}
