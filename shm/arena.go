package shm

import (
	"fmt"
	"slices"
	"sync/atomic"
)

// The arena hands out blocks of the segment to the layers above. Only the
// owner allocates and frees, under Segment.mu; other processes only follow
// offsets the owner published.
//
// Any process mapping the segment can write it, so the owner keeps the
// arena's bookkeeping in its own memory (ownArena) and never reads it back
// from the segment: a rewritten word there cannot make the owner hand out
// a block in use, walk a cycle or fault. What the segment holds is a
// mirror for the processes that only look (ArenaStats, the tool): blocks
// start with a 16-byte header, and free blocks form a singly linked list
// sorted by offset, never two adjacent blocks.

const (
	blockUsed = 0x44455355414d504d // "MPMAUSED"
	blockFree = 0x45455246414d504d // "MPMAFREE"

	blockHdr     = 16
	minBlock     = 32 // header + next pointer, rounded to 16
	minAlignment = 16
)

// ownArena is the owner's own record of the arena and the segment's
// bounds. Guarded by Segment.mu, except size, which limit reads.
type ownArena struct {
	start, maxSize, page uint64
	size                 atomic.Uint64
	free                 []span            // sorted by offset, never adjacent
	used                 map[uint64]uint64 // block start → block size
	usedBytes            uint64
	changes              uint64 // of free, for mirrorChange
}

type span struct{ off, size uint64 }

func (s *Segment) block(off uint64) *blockHeader { return At[blockHeader](s, off) }

func (s *Segment) nextFree(off uint64) uint64 {
	return atomic.LoadUint64(At[uint64](s, off+blockHdr))
}

func (s *Segment) arenaInit(start, end, maxSize, page uint64) {
	a := &s.arena
	a.start, a.maxSize, a.page = start, maxSize, page
	a.size.Store(end)
	a.free = []span{{start, end - start}}
	a.used = map[uint64]uint64{}
	s.mirrorFree()
}

// mirrorFree writes the whole free list into the segment for the
// processes that only look, and the totals into the header. Called with
// s.mu held.
func (s *Segment) mirrorFree() { s.mirrorSpans(0, len(s.arena.free)) }

// mirrorEvery is how many changes of the free list may go by before the
// whole mirror is written again: any process of the user can write the
// segment, and a mirror it rewrote is mended within that many changes
// even where nothing next to the damage changes.
const mirrorEvery = 64

// mirrorChange writes what a change of the free list altered — entries
// lo..hi-1 of the owner's list — into the mirror, or, every mirrorEvery
// changes, the whole list. Called with s.mu held.
func (s *Segment) mirrorChange(lo, hi int) {
	if s.arena.changes++; s.arena.changes%mirrorEvery == 0 {
		lo, hi = 0, len(s.arena.free)
	}
	s.mirrorSpans(lo, hi)
}

// mirrorSpans writes free blocks lo..hi-1 of the owner's list into the
// segment — header, size and link to the next — and the totals into the
// header; lo 0 writes the list's head too. An allocation or a free
// changes at most three neighbouring entries of the list and the link of
// the one before them, so that is all it rewrites: the mirror costs the
// same however fragmented the arena is. It writes from the last entry to
// the first, so that a process walking the mirror meanwhile never follows
// a link to a block whose header and link are not written yet (a freed
// block's memory holds whatever was stored in it). Called with s.mu held.
func (s *Segment) mirrorSpans(lo, hi int) {
	a := &s.arena
	lo, hi = max(lo, 0), min(hi, len(a.free))
	for i := hi - 1; i >= lo; i-- {
		f := a.free[i]
		next := uint64(0)
		if i+1 < len(a.free) {
			next = a.free[i+1].off
		}
		b := s.block(f.off)
		atomic.StoreUint64(&b.Size, f.size)
		atomic.StoreUint64(&b.Tag, blockFree)
		atomic.StoreUint64(At[uint64](s, f.off+blockHdr), next)
	}
	if lo == 0 {
		head := uint64(0)
		if len(a.free) > 0 {
			head = a.free[0].off
		}
		atomic.StoreUint64(&s.hdr.ArenaFree, head)
	}
	atomic.StoreUint64(&s.hdr.ArenaUsed, a.usedBytes)
	atomic.StoreUint64(&s.hdr.ArenaBlocks, uint64(len(a.used)))
}

// Alloc returns the offset of a zeroed block of at least n bytes, aligned to
// align (a power of two; at least 16), growing the segment if no free block
// is large enough. Owner only. Once Close has begun it fails with ErrClosed,
// as do Free and Grow: one under way when Close came finishes first. What
// the caller writes into the block afterwards is not covered: keep Close
// out until it has done so.
func (s *Segment) Alloc(n, align uint64) (uint64, error) {
	if !s.owner {
		return 0, ErrNotOwner
	}
	if align < minAlignment {
		align = minAlignment
	}
	if align&(align-1) != 0 || n == 0 || n > 1<<40 {
		return 0, fmt.Errorf("shm: alloc %d bytes aligned to %d: bad request", n, align)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed.Load() {
		return 0, ErrClosed
	}
	for {
		if off, ok := s.allocLocked(n, align); ok {
			clear(Slice[byte](s, off, int(n)))
			return off, nil
		}
		// Grow by enough for the request, its alignment and a header.
		if err := s.growLocked(roundUp(n, minAlignment) + align + 2*minBlock); err != nil {
			return 0, fmt.Errorf("shm: alloc %d bytes: %w", n, err)
		}
	}
}

// allocLocked carves a block out of the first free block that fits.
func (s *Segment) allocLocked(n, align uint64) (uint64, bool) {
	a := &s.arena
	for i, f := range a.free {
		end := f.off + f.size
		payload := roundUp(f.off+blockHdr, align)
		// A leading remainder must be big enough to stay a free block.
		for payload-blockHdr != f.off && payload-blockHdr-f.off < minBlock {
			payload += align
		}
		start := payload - blockHdr
		blockEnd := roundUp(payload+n, minAlignment)
		if blockEnd > end {
			continue
		}
		if end-blockEnd < minBlock {
			blockEnd = end // too small to keep: it goes with the block
		}
		// [f.off, start) stays free, [blockEnd, end) becomes free.
		var buf [2]span
		rest := buf[:0]
		if start > f.off {
			rest = append(rest, span{f.off, start - f.off})
		}
		if end > blockEnd {
			rest = append(rest, span{blockEnd, end - blockEnd})
		}
		a.free = slices.Replace(a.free, i, i+1, rest...)
		a.used[start] = blockEnd - start
		a.usedBytes += blockEnd - start
		b := s.block(start)
		atomic.StoreUint64(&b.Size, blockEnd-start)
		atomic.StoreUint64(&b.Tag, blockUsed)
		// The block before i now links to what replaced i, or to what
		// followed it.
		s.mirrorChange(i-1, i+len(rest))
		return payload, true
	}
	return 0, false
}

// Free returns the block at off (an offset Alloc returned) to the arena.
// Freeing anything else, or freeing twice, fails with ErrBadBlock. Owner
// only.
func (s *Segment) Free(off uint64) error {
	if !s.owner {
		return ErrNotOwner
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed.Load() {
		return ErrClosed
	}
	size, ok := s.arena.used[off-blockHdr]
	if off < blockHdr || !ok {
		return fmt.Errorf("%w: offset 0x%x (double free or not a block start)", ErrBadBlock, off)
	}
	delete(s.arena.used, off-blockHdr)
	s.arena.usedBytes -= size
	s.freeRange(off-blockHdr, size)
	return nil
}

// BlockSize returns the usable size of the allocated block at off.
func (s *Segment) BlockSize(off uint64) (uint64, error) {
	if s.owner {
		s.mu.Lock()
		size, ok := s.arena.used[off-blockHdr]
		s.mu.Unlock()
		if off < blockHdr || !ok {
			return 0, fmt.Errorf("%w: offset 0x%x", ErrBadBlock, off)
		}
		return size - blockHdr, nil
	}
	if err := s.CheckRange(off-blockHdr, blockHdr); err != nil || off < blockHdr {
		return 0, fmt.Errorf("%w: offset 0x%x", ErrBadBlock, off)
	}
	b := s.block(off - blockHdr)
	if atomic.LoadUint64(&b.Tag) != blockUsed {
		return 0, fmt.Errorf("%w: offset 0x%x", ErrBadBlock, off)
	}
	return atomic.LoadUint64(&b.Size) - blockHdr, nil
}

// freeRange inserts [start, start+size) into the sorted free list, merging
// it with the free blocks right before and after it. Called with s.mu held.
func (s *Segment) freeRange(start, size uint64) {
	a := &s.arena
	i, _ := slices.BinarySearchFunc(a.free, start, func(f span, off uint64) int { return cmpU64(f.off, off) })
	if i < len(a.free) && start+size == a.free[i].off {
		size += a.free[i].size
		a.free = slices.Delete(a.free, i, i+1)
	}
	if i > 0 && a.free[i-1].off+a.free[i-1].size == start {
		a.free[i-1].size += size
		s.mirrorChange(i-1, i) // it grew; what follows it is unchanged
	} else {
		a.free = slices.Insert(a.free, i, span{start, size})
		s.mirrorChange(i-1, i+1) // the new block, and the link to it
	}
}

func cmpU64(a, b uint64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// ArenaStats describes the arena's use.
type ArenaStats struct {
	Start       uint64 `json:"start"`
	End         uint64 `json:"end"`        // arena bounds in the segment
	UsedBytes   uint64 `json:"used_bytes"` // in allocated blocks, headers included
	Blocks      uint64 `json:"blocks"`     // allocated blocks
	FreeBytes   uint64 `json:"free_bytes"`
	FreeBlocks  int    `json:"free_blocks"`
	LargestFree uint64 `json:"largest_free"`
}

// ArenaStats describes the arena. The owner answers from its own records;
// other processes walk the segment's mirror of them, a best-effort
// snapshot.
func (s *Segment) ArenaStats() ArenaStats {
	if s.owner {
		s.mu.Lock()
		defer s.mu.Unlock()
		a := &s.arena
		st := ArenaStats{Start: a.start, End: a.size.Load(), UsedBytes: a.usedBytes, Blocks: uint64(len(a.used))}
		for _, f := range a.free {
			st.FreeBytes += f.size
			st.FreeBlocks++
			st.LargestFree = max(st.LargestFree, f.size)
		}
		return st
	}
	st := ArenaStats{
		Start:     atomic.LoadUint64(&s.hdr.ArenaOff),
		End:       atomic.LoadUint64(&s.hdr.Size),
		UsedBytes: atomic.LoadUint64(&s.hdr.ArenaUsed),
		Blocks:    atomic.LoadUint64(&s.hdr.ArenaBlocks),
	}
	for cur, n := atomic.LoadUint64(&s.hdr.ArenaFree), 0; cur != 0 && n < 1<<20; cur, n = s.nextFree(cur), n+1 {
		if s.CheckRange(cur, minBlock) != nil {
			break
		}
		size := atomic.LoadUint64(&s.block(cur).Size)
		st.FreeBytes += size
		st.FreeBlocks++
		st.LargestFree = max(st.LargestFree, size)
	}
	return st
}
