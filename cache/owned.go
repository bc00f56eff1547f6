package cache

import (
	"slices"

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
	pages    pageBits
	pageSize uint64
	left     uint32
}

// pageBits is a set of page indexes: in one word for an MR of up to 64
// pages, so that registering one allocates nothing; in more otherwise.
type pageBits struct {
	word uint64
	more []uint64
}

func newPageBits(n uint32) pageBits {
	if n <= 64 {
		return pageBits{}
	}
	return pageBits{more: make([]uint64, (n+63)/64)}
}

func (b *pageBits) set(i uint32) {
	if b.more == nil {
		b.word |= 1 << i
		return
	}
	b.more[i/64] |= 1 << (i % 64)
}

// clear clears bit i and reports whether it was set.
func (b *pageBits) clear(i uint32) bool {
	w := &b.word
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

// own records the registration of the MR whose record is at off: pages
// of pageSize, set pages of them held (none for external memory).
func (g *Global) own(off uint64, m verbs.MR, external bool, pageSize uint64, pages pageBits, set uint32) {
	g.ownMu.Lock()
	defer g.ownMu.Unlock()
	if g.owned == nil {
		g.owned = make(map[uint64]ownedMR, 64)
	}
	if g.owned[off].freed {
		g.freed-- // a record offset used again: what it held is forgotten
	}
	g.owned[off] = ownedMR{mr: m, external: external, pages: pages, pageSize: pageSize, left: set}
}

// letGo clears, in the owner's record of the MR at off, the pages of
// [addr, addr+length) it held; it returns their bit indexes (appended to
// dst) and how many pages the MR holds now.
func (g *Global) letGo(off, addr, length uint64, dst []uint32) ([]uint32, uint32) {
	g.ownMu.Lock()
	defer g.ownMu.Unlock()
	o, ok := g.owned[off]
	if !ok || o.pageSize == 0 {
		return dst, 0
	}
	s := max(addr, uint64(o.mr.Addr))
	e := min(addr+length, uint64(o.mr.Addr+o.mr.Len))
	for page := s; page < e; page += o.pageSize {
		i := uint32((page - uint64(o.mr.Addr)) / o.pageSize)
		if o.pages.clear(i) {
			o.left--
			dst = append(dst, i)
		}
	}
	g.owned[off] = o
	return dst, o.left
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
		g.freed++
	}
}

// disown forgets the MR at off, once the device let go of it.
func (g *Global) disown(off uint64) {
	g.ownMu.Lock()
	defer g.ownMu.Unlock()
	if g.owned[off].freed {
		g.freed--
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

// freedCount returns how many MRs wait for a collection.
func (g *Global) freedCount() int {
	g.ownMu.Lock()
	defer g.ownMu.Unlock()
	return g.freed
}

// ownedOver returns, in record order, the offsets of the owner's live MRs
// of pool memory whose registered range overlaps [addr, addr+length).
func (g *Global) ownedOver(addr, length uint64) []uint64 {
	g.ownMu.Lock()
	defer g.ownMu.Unlock()
	var out []uint64
	for off, o := range g.owned {
		s, n := uint64(o.mr.Addr), uint64(o.mr.Len)
		if !o.external && !o.freed && addr < s+n && s < addr+length {
			out = append(out, off)
		}
	}
	slices.Sort(out)
	return out
}

// ownedFreedOver returns, in record order, the offsets of the MRs the
// owner moved to the free list and the device has not let go of yet whose
// registered range overlaps [addr, addr+length).
func (g *Global) ownedFreedOver(addr, length uint64) []uint64 {
	g.ownMu.Lock()
	defer g.ownMu.Unlock()
	var out []uint64
	for off, o := range g.owned {
		s, n := uint64(o.mr.Addr), uint64(o.mr.Len)
		if o.freed && addr < s+n && s < addr+length {
			out = append(out, off)
		}
	}
	slices.Sort(out)
	return out
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
			g.freed++
		}
	}
}
