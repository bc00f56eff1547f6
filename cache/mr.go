package cache

import (
	"fmt"
	"sync/atomic"

	"github.com/mpmr/mpmr/shm"
)

// mrRecord is one registered memory region, in the segment. The bitmap of
// still-registered pages follows the record in the same arena block. MRs
// over data memory cover pages of one memseg list; external-memory MRs
// (List < 0) cover one chunk and have no bitmap.
//
//	off size field
//	  0   8  Next       offset of the next record in its list, 0 at the end
//	  8   8  Start      address of the page of bit 0 (the registered start)
//	 16   8  Len        registered length
//	 24   8  PageSize
//	 32   4  List       memseg list index, -1 for external memory
//	 36   4  BaseIdx    list page index of bit 0
//	 40   4  PagesSet   bits still set (pages still registered)
//	 44   4  BitmapLen  bits in the bitmap
//	 48   4  LKey
//	 52   4  RKey
//	 56   4  Handle     the verbs MR handle
//	 60   4  Access     verbs access flags
//	 64  16  reserved
//	 80      bitmap words (uint64), BitmapLen bits
type mrRecord struct {
	Next      uint64
	Start     uint64
	Len       uint64
	PageSize  uint64
	List      int32
	BaseIdx   uint32
	PagesSet  uint32
	BitmapLen uint32
	LKey      uint32
	RKey      uint32
	Handle    uint32
	Access    uint32
	_         [16]byte
}

// mr is a process-local handle on a record.
type mr struct {
	off uint64
	rec *mrRecord
	bmp []uint64 // nil for external memory
}

func (g *Global) mrAt(off uint64) (mr, error) {
	if err := g.seg.CheckRange(off, mrRecordSize); err != nil {
		return mr{}, fmt.Errorf("%w: MR record: %v", ErrCorrupt, err)
	}
	rec := shm.At[mrRecord](g.seg, off)
	m := mr{off: off, rec: rec}
	if atomic.LoadInt32(&rec.List) >= 0 {
		n := atomic.LoadUint32(&rec.BitmapLen)
		words := (uint64(n) + 63) / 64
		if n == 0 || g.seg.CheckRange(off+mrRecordSize, words*8) != nil || !g.recordHolds(off, words) {
			return mr{}, fmt.Errorf("%w: MR record at 0x%x: bitmap of %d bits", ErrCorrupt, off, n)
		}
		m.bmp = shm.Slice[uint64](g.seg, off+mrRecordSize, int(words))
	}
	return m, nil
}

// recordHolds reports whether the record at off has room for a bitmap of
// words words: in the owner, which knows its blocks, the block it
// allocated must; elsewhere the segment bounds it (checked by the caller).
func (g *Global) recordHolds(off, words uint64) bool {
	if !g.owner {
		return true
	}
	size, err := g.seg.BlockSize(off)
	return err == nil && size >= mrRecordSize+words*8
}

func (m mr) external() bool { return m.bmp == nil }

func (m mr) bit(i uint32) bool {
	return atomic.LoadUint64(&m.bmp[i/64])&(1<<(i%64)) != 0
}

func (m mr) setBit(i uint32) {
	w := &m.bmp[i/64]
	atomic.StoreUint64(w, atomic.LoadUint64(w)|1<<(i%64))
}

// nextChunk returns the chunk of contiguous registered pages that starts at
// or after bit i, and the bit to continue from; ok is false when there is
// none. An external MR has exactly one chunk. (DPDK's
// mr_find_next_chunk.)
func (m mr) nextChunk(i uint32) (e Entry, next uint32, ok bool) {
	r := m.rec
	key := atomic.LoadUint32(&r.LKey)
	start := atomic.LoadUint64(&r.Start)
	if m.external() {
		if i > 0 {
			return Entry{}, 1, false
		}
		return Entry{Start: start, End: start + atomic.LoadUint64(&r.Len), LKey: key}, 1, true
	}
	n := min(atomic.LoadUint32(&r.BitmapLen), uint32(len(m.bmp))*64)
	ps := atomic.LoadUint64(&r.PageSize)
	for i < n && !m.bit(i) {
		i++
	}
	if i >= n {
		return Entry{}, n, false
	}
	j := i
	for j < n && m.bit(j) {
		j++
	}
	return Entry{Start: start + uint64(i)*ps, End: start + uint64(j)*ps, LKey: key}, j, true
}

// chunks returns every chunk of m.
func (m mr) chunks() []Entry { return m.appendChunks(nil) }

// appendChunks appends every chunk of m to dst.
func (m mr) appendChunks(dst []Entry) []Entry {
	for i := uint32(0); ; {
		e, next, ok := m.nextChunk(i)
		if !ok {
			return dst
		}
		dst = append(dst, e)
		i = next
	}
}
