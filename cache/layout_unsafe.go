package cache

import (
	"fmt"
	"math/bits"
	"sync/atomic"
	"unsafe"

	"github.com/mpmr/mpmr/shm"
)

const entrySize = uint64(unsafe.Sizeof(Entry{}))

// Compile-time size checks of the shared structs.
var (
	_ [24 - unsafe.Sizeof(Entry{})]byte
	_ [unsafe.Sizeof(Entry{}) - 24]byte
	_ [64 - unsafe.Sizeof(tableHeader{})]byte
	_ [unsafe.Sizeof(tableHeader{}) - 64]byte
	_ [32 - unsafe.Sizeof(window{})]byte
	_ [unsafe.Sizeof(window{}) - 32]byte
	_ [192 - unsafe.Sizeof(tableIndex{})]byte
	_ [unsafe.Sizeof(tableIndex{}) - 192]byte
	_ [64 - unsafe.Offsetof(tableIndex{}.W)]byte
	_ [unsafe.Offsetof(tableIndex{}.W) - 64]byte
)

const tableIndexSize = uint64(unsafe.Sizeof(tableIndex{}))

// search is DPDK's MR B-tree binary search over ents[:n] (0 < n <= len(ents)):
// it returns the index of the last entry whose Start is at most addr, the
// sentinel at index 0 when there is none. The loop keeps base+n <= the
// starting n, so every probe is in bounds; indexing through the pointer
// spares the bounds check a slice index would repeat on every step.
func search(ents []Entry, n int, addr uint64) int {
	p := unsafe.Pointer(unsafe.SliceData(ents))
	base := 0
	for n > 1 {
		half := n >> 1
		if addr < atomic.LoadUint64((*uint64)(unsafe.Add(p, uintptr(base+half)*unsafe.Sizeof(Entry{})))) {
			n = half
		} else {
			base += half
			n -= half
		}
	}
	return base
}

// probe is Lookup's constant-time path: addr lies inside a window and its
// bucket holds at most one start. It reads the two directory words, the
// entry before the bucket and the one that may start in it together, and
// picks one without a branch. ok is false when the index cannot answer
// that way (addr outside every window, a crowded bucket, a torn read);
// locate then does. Pointers stand in for slice indexes once the bounds
// are checked, as in search.
func (t *Table) probe(addr uint64, n int) (e Entry, idx int, ok bool) {
	ix := t.ix
	nw := min(atomic.LoadUint32(&ix.Windows), maxWindows)
	for w := range nw {
		win := (*window)(unsafe.Add(unsafe.Pointer(&ix.W), uintptr(w)*unsafe.Sizeof(window{})))
		off := addr - atomic.LoadUint64(&win.Lo)
		if off > atomic.LoadUint64(&win.Span) {
			continue // below (off wrapped) or above the window
		}
		sh := atomic.LoadUint32(&win.Shift)
		b := min(off>>(sh&63), uint64(atomic.LoadUint32(&win.Last)))
		if sh&affine != 0 {
			k := uint64(atomic.LoadUint32(&win.First)) + b
			if k >= uint64(n) {
				return Entry{}, 0, false // torn
			}
			in := (*Entry)(unsafe.Add(unsafe.Pointer(unsafe.SliceData(t.ents)), uintptr(k)*unsafe.Sizeof(Entry{})))
			return Entry{Start: atomic.LoadUint64(&in.Start), End: atomic.LoadUint64(&in.End), LKey: atomic.LoadUint32(&in.LKey)}, int(k), true
		}
		j := uint64(atomic.LoadUint32(&win.Dir)) + b
		if j+1 >= uint64(len(t.dir)) {
			return Entry{}, 0, false
		}
		d := unsafe.Add(unsafe.Pointer(unsafe.SliceData(t.dir)), uintptr(j)*4)
		i := uint64(atomic.LoadUint32((*uint32)(d)))
		e := uint64(atomic.LoadUint32((*uint32)(unsafe.Add(d, 4))))
		if e >= uint64(n) || e-i > 1 { // i <= e, or the difference wraps
			return Entry{}, 0, false
		}
		p := unsafe.Pointer(unsafe.SliceData(t.ents))
		before := (*Entry)(unsafe.Add(p, uintptr(i)*unsafe.Sizeof(Entry{})))
		in := (*Entry)(unsafe.Add(p, uintptr(e)*unsafe.Sizeof(Entry{})))
		startB, endB, keyB := atomic.LoadUint64(&before.Start), atomic.LoadUint64(&before.End), atomic.LoadUint32(&before.LKey)
		startI, endI, keyI := atomic.LoadUint64(&in.Start), atomic.LoadUint64(&in.End), atomic.LoadUint32(&in.LKey)
		return pick(addr, i, e, Entry{Start: startB, End: endB, LKey: keyB}, Entry{Start: startI, End: endI, LKey: keyI})
	}
	return Entry{}, 0, false
}

// probeLocal is probe for a Go-memory table, which one goroutine owns:
// the same steps with plain loads, which the compiler schedules better
// than atomic ones (a nanosecond of a five-nanosecond lookup), from the
// header and index inside the Table. Keep the two in step; the index
// tests run every case through both.
func (t *Table) probeLocal(addr uint64) (e Entry, idx int, ok bool) {
	ix := &t.own.ix
	n := min(int(t.own.hdr.Len), len(t.ents))
	nw := min(ix.Windows, maxWindows)
	for w := range nw {
		win := (*window)(unsafe.Add(unsafe.Pointer(&ix.W), uintptr(w)*unsafe.Sizeof(window{})))
		off := addr - win.Lo
		if off > win.Span {
			continue // below (off wrapped) or above the window
		}
		b := min(off>>(win.Shift&63), uint64(win.Last))
		if win.Shift&affine != 0 {
			k := uint64(win.First) + b
			if k >= uint64(n) {
				return Entry{}, 0, false
			}
			return *(*Entry)(unsafe.Add(unsafe.Pointer(unsafe.SliceData(t.ents)), uintptr(k)*unsafe.Sizeof(Entry{}))), int(k), true
		}
		j := uint64(win.Dir) + b
		if j+1 >= uint64(len(t.dir)) {
			return Entry{}, 0, false
		}
		d := unsafe.Add(unsafe.Pointer(unsafe.SliceData(t.dir)), uintptr(j)*4)
		i := uint64(*(*uint32)(d))
		e := uint64(*(*uint32)(unsafe.Add(d, 4)))
		if e >= uint64(n) || e-i > 1 { // i <= e, or the difference wraps
			return Entry{}, 0, false
		}
		p := unsafe.Pointer(unsafe.SliceData(t.ents))
		before := (*Entry)(unsafe.Add(p, uintptr(i)*unsafe.Sizeof(Entry{})))
		in := (*Entry)(unsafe.Add(p, uintptr(e)*unsafe.Sizeof(Entry{})))
		return pick(addr, i, e, *before, *in)
	}
	return Entry{}, 0, false
}

// pick returns, of the entry before a bucket (index i) and the one that may
// start in it (index e, i <= e <= i+1), the last that starts at or before
// addr, choosing with masks rather than a branch.
func pick(addr, i, e uint64, before, in Entry) (Entry, int, bool) {
	_, below := bits.Sub64(addr, in.Start, 0)
	take := (e - i) & (below ^ 1)
	m := -take
	return Entry{
		Start: before.Start ^ (before.Start^in.Start)&m,
		End:   before.End ^ (before.End^in.End)&m,
		LKey:  before.LKey ^ (before.LKey^in.LKey)&uint32(m),
	}, int(i + take), true
}

// run stores key in keys for the addresses at the front of addrs that lie
// in [start, start+size), and returns how many there were: four at a time
// while the farthest of four from start is inside, then one by one.
// LookupBurst's inner loop; pointers stand in for the indexes, which stay
// below the shorter slice's length.
func run(addrs []uintptr, keys []uint32, start, size uint64, key uint32) int {
	n := min(len(addrs), len(keys))
	pa, pk := unsafe.Pointer(unsafe.SliceData(addrs)), unsafe.Pointer(unsafe.SliceData(keys))
	const sa, sk = unsafe.Sizeof(uintptr(0)), unsafe.Sizeof(uint32(0))
	i := 0
	for ; i+4 <= n; i += 4 {
		a := (*[4]uintptr)(unsafe.Add(pa, uintptr(i)*sa))
		if max(uint64(a[0])-start, uint64(a[1])-start, uint64(a[2])-start, uint64(a[3])-start) >= size {
			break
		}
		k := (*[4]uint32)(unsafe.Add(pk, uintptr(i)*sk))
		k[0], k[1], k[2], k[3] = key, key, key, key
	}
	for ; i < n && uint64(*(*uintptr)(unsafe.Add(pa, uintptr(i)*sa)))-start < size; i++ {
		*(*uint32)(unsafe.Add(pk, uintptr(i)*sk)) = key
	}
	return i
}

const (
	mrRecordSize   = uint64(unsafe.Sizeof(mrRecord{}))
	globalRootSize = uint64(unsafe.Sizeof(globalRoot{}))
	tableHeaderOff = uint64(unsafe.Offsetof(globalRoot{}.Table))
)

var (
	_ [80 - unsafe.Sizeof(mrRecord{})]byte
	_ [unsafe.Sizeof(mrRecord{}) - 80]byte
	_ [192 - unsafe.Sizeof(globalRoot{})]byte
	_ [unsafe.Sizeof(globalRoot{}) - 192]byte
	_ [64 - unsafe.Offsetof(globalRoot{}.Table)]byte
	_ [unsafe.Offsetof(globalRoot{}.Table) - 64]byte
	_ [128 - unsafe.Offsetof(globalRoot{}.DevGen)]byte
	_ [unsafe.Offsetof(globalRoot{}.DevGen) - 128]byte
)

const logEntrySize = uint64(unsafe.Sizeof(logEntry{}))

var (
	_ [32 - unsafe.Sizeof(logEntry{})]byte
	_ [unsafe.Sizeof(logEntry{}) - 32]byte
)

const poolDescSize = uint64(unsafe.Sizeof(poolDesc{}))

var (
	_ [128 - unsafe.Sizeof(poolDesc{})]byte
	_ [unsafe.Sizeof(poolDesc{}) - 128]byte
	_ [512 - unsafe.Sizeof(poolDir{})]byte
	_ [unsafe.Sizeof(poolDir{}) - 512]byte
)

// sliceAddr returns the address of b's first byte.
func sliceAddr(b []byte) uintptr { return uintptr(unsafe.Pointer(unsafe.SliceData(b))) }

// Layout describes this package's shared structs, for the segment's layout
// tag (see shm.LayoutHash).
func Layout() []string {
	return []string{shm.Describe(Entry{}), shm.Describe(tableHeader{}), shm.Describe(tableIndex{}), shm.Describe(window{}),
		shm.Describe(mrRecord{}), shm.Describe(globalRoot{}), shm.Describe(poolDir{}), shm.Describe(poolDesc{}),
		shm.Describe(logEntry{}),
		// The meaning of a pool's Next words: taken objects are marked.
		fmt.Sprintf("poolNext:out=0x%x", objectOut)}
}
