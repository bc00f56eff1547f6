package cache

import (
	"slices"
	"sync/atomic"

	"github.com/mpmr/mpmr/shm"
	"github.com/mpmr/mpmr/verbs"
)

// The owner's own record of what it registered.
//
// An MR's record in the segment (its range, key and page bitmap, its links
// in the MR and free lists) can be rewritten by any process that maps the
// segment. What the readers of the table are served is theirs to trust;
// what the owner tells the device is not: a free trims the device's MRs
// over the freed pages, and a collection deregisters MRs, from this
// record, so that no rewritten word can keep a key valid over memory the
// owner freed, or have it deregister an MR still in use.

// ownedMR is one registration, kept by the owner under ownMu.
type ownedMR struct {
	mr       verbs.MR // as the device registered it
	external bool     // external memory (RegisterExternal): frees do not touch it
	freed    bool     // moved to the free list by the owner: the next collection deregisters it
	// pages is the owner's copy of the record's bitmap: bit i is the page
	// at mr.Addr + i*pageSize, set while the MR holds it; left counts them.
	pages pageBits
	left  uint32
	shape recordShape
}

// recordShape is what the owner wrote into an MR's record besides its
// key, range and bitmap.
type recordShape struct {
	pageSize  uint64
	list      int32
	baseIdx   uint32
	bitmapLen uint32 // bits of the bitmap the record holds
}

// pageBits is a set of page indexes: in one word for an MR of up to 64
// pages, so that registering one allocates nothing; in more otherwise.
type pageBits struct {
	bits uint64
	more []uint64
}

func newPageBits(n uint32) pageBits {
	if n <= 64 {
		return pageBits{}
	}
	return pageBits{more: make([]uint64, (n+63)/64)}
}

// word returns word w of the set.
func (b *pageBits) word(w int) uint64 {
	switch {
	case b.more != nil && w < len(b.more):
		return b.more[w]
	case b.more == nil && w == 0:
		return b.bits
	}
	return 0
}

func (b *pageBits) set(i uint32) {
	if b.more == nil {
		b.bits |= 1 << i
		return
	}
	b.more[i/64] |= 1 << (i % 64)
}

// clear clears bit i and reports whether it was set.
func (b *pageBits) clear(i uint32) bool {
	w := &b.bits
	if b.more != nil {
		if int(i/64) >= len(b.more) {
			return false
		}
		w = &b.more[i/64]
	} else if i >= 64 {
		return false
	}
	bit := uint64(1) << (i % 64)
	was := *w&bit != 0
	*w &^= bit
	return was
}

// own records the registration of the MR whose record is at off, shaped
// so, set pages of it held (none for external memory).
func (g *Global) own(off uint64, m verbs.MR, external bool, shape recordShape, pages pageBits, set uint32) {
	g.ownMu.Lock()
	defer g.ownMu.Unlock()
	if g.owned == nil {
		g.owned = make(map[uint64]ownedMR, 64)
	}
	if g.owned[off].freed {
		g.freed.Add(-1) // a record offset used again: what it held is forgotten
	}
	g.owned[off] = ownedMR{mr: m, external: external, pages: pages, left: set, shape: shape}
}

// letGo clears, in the owner's record of the MR at off, the pages of
// [addr, addr+length) it held, and returns how many pages it holds now.
func (g *Global) letGo(off, addr, length uint64) uint32 {
	g.ownMu.Lock()
	defer g.ownMu.Unlock()
	o, ok := g.owned[off]
	ps := o.shape.pageSize
	if !ok || ps == 0 {
		return 0
	}
	s := max(addr, uint64(o.mr.Addr))
	e := min(addr+length, uint64(o.mr.Addr+o.mr.Len))
	for page := s; page < e; page += ps {
		if o.pages.clear(uint32((page - uint64(o.mr.Addr)) / ps)) {
			o.left--
		}
	}
	g.owned[off] = o
	return o.left
}

// writeRecord writes the record of the MR at off, its links excepted, as
// the owner's record has it: whatever another process rewrote there is
// put right. The owner allocated the record, so its words are in the
// segment. Call with the write lock held.
func (g *Global) writeRecord(off uint64) {
	o, ok := g.ownedAt(off)
	if !ok || o.external {
		return
	}
	rec := shm.At[mrRecord](g.seg, off)
	atomic.StoreUint64(&rec.Start, uint64(o.mr.Addr))
	atomic.StoreUint64(&rec.Len, uint64(o.mr.Len))
	atomic.StoreUint64(&rec.PageSize, o.shape.pageSize)
	atomic.StoreInt32(&rec.List, o.shape.list)
	atomic.StoreUint32(&rec.BaseIdx, o.shape.baseIdx)
	atomic.StoreUint32(&rec.PagesSet, o.left)
	atomic.StoreUint32(&rec.BitmapLen, o.shape.bitmapLen)
	atomic.StoreUint32(&rec.LKey, o.mr.LKey)
	atomic.StoreUint32(&rec.RKey, o.mr.RKey)
	atomic.StoreUint32(&rec.Handle, o.mr.Handle)
	atomic.StoreUint32(&rec.Access, uint32(o.mr.Access))
	words := shm.Slice[uint64](g.seg, off+mrRecordSize, int(o.shape.bitmapLen+63)/64)
	for w := range words {
		atomic.StoreUint64(&words[w], o.pages.word(w))
	}
}

// ownedAt returns the registration the owner made at off, if any.
func (g *Global) ownedAt(off uint64) (ownedMR, bool) {
	g.ownMu.Lock()
	defer g.ownMu.Unlock()
	o, ok := g.owned[off]
	return o, ok
}

// markFreed records that the MR at off went to the free list.
func (g *Global) markFreed(off uint64) {
	g.ownMu.Lock()
	defer g.ownMu.Unlock()
	if o, ok := g.owned[off]; ok && !o.freed {
		o.freed = true
		g.owned[off] = o
		g.freed.Add(1)
	}
}

// disown forgets the MR at off, once the device let go of it.
func (g *Global) disown(off uint64) {
	g.ownMu.Lock()
	defer g.ownMu.Unlock()
	if g.owned[off].freed {
		g.freed.Add(-1)
	}
	delete(g.owned, off)
}

// holdsPages reports whether the MR at off is one of pool memory's that
// the owner has not freed: one whose pages it keeps count of.
func (g *Global) holdsPages(off uint64) bool {
	g.ownMu.Lock()
	defer g.ownMu.Unlock()
	o, ok := g.owned[off]
	return ok && !o.freed && !o.external
}

// ownedCount returns how many MRs the owner has registered.
func (g *Global) ownedCount() int {
	g.ownMu.Lock()
	defer g.ownMu.Unlock()
	return len(g.owned)
}

// freedCount returns how many MRs wait for a collection: read without
// ownMu, since every create asks.
func (g *Global) freedCount() int { return int(g.freed.Load()) }

// ownedOver returns, in record order, the offsets of the owner's live MRs
// of pool memory whose registered range overlaps [addr, addr+length).
func (g *Global) ownedOver(addr, length uint64) []uint64 { return g.ownedIn(addr, length, false) }

// ownedFreedOver returns, in record order, the offsets of the MRs the
// owner moved to the free list and the device has not let go of yet whose
// registered range overlaps [addr, addr+length).
func (g *Global) ownedFreedOver(addr, length uint64) []uint64 { return g.ownedIn(addr, length, true) }

func (g *Global) ownedIn(addr, length uint64, freed bool) []uint64 {
	g.ownMu.Lock()
	defer g.ownMu.Unlock()
	var out []uint64
	for off, o := range g.owned {
		s, n := uint64(o.mr.Addr), uint64(o.mr.Len)
		live := !o.external && !o.freed
		if (freed && o.freed || !freed && live) && addr < s+n && s < addr+length {
			out = append(out, off)
		}
	}
	slices.Sort(out)
	return out
}

// ownedExternal returns the live external-memory MR the owner registered
// over addr.
func (g *Global) ownedExternal(addr uint64) (uint64, ownedMR, bool) {
	g.ownMu.Lock()
	defer g.ownMu.Unlock()
	for off, o := range g.owned {
		if o.external && !o.freed && uint64(o.mr.Addr) <= addr && addr-uint64(o.mr.Addr) < uint64(o.mr.Len) {
			return off, o, true
		}
	}
	return 0, ownedMR{}, false
}

// markAllFreed marks every MR the owner registered for the next
// collection (Close).
func (g *Global) markAllFreed() {
	g.ownMu.Lock()
	defer g.ownMu.Unlock()
	for off, o := range g.owned {
		if !o.freed {
			o.freed = true
			g.owned[off] = o
			g.freed.Add(1)
		}
	}
}
