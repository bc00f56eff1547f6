package shm

import (
	"fmt"
	"sync/atomic"
)

// The arena hands out blocks of the segment to the layers above. Only the
// owner allocates and frees, under Segment.mu; other processes only follow
// offsets the owner published. Blocks start with a 16-byte header; free
// blocks form a singly linked list sorted by offset, and a freed block is
// merged with free neighbours, so the list never holds two adjacent blocks.

const (
	blockUsed = 0x44455355414d504d // "MPMAUSED"
	blockFree = 0x45455246414d504d // "MPMAFREE"

	blockHdr     = 16
	minBlock     = 32 // header + next pointer, rounded to 16
	minAlignment = 16
)

func (s *Segment) block(off uint64) *blockHeader { return At[blockHeader](s, off) }

func (s *Segment) nextFree(off uint64) uint64 {
	return atomic.LoadUint64(At[uint64](s, off+blockHdr))
}

func (s *Segment) setNextFree(off, next uint64) {
	atomic.StoreUint64(At[uint64](s, off+blockHdr), next)
}

func (s *Segment) makeFree(off, size, next uint64) {
	b := s.block(off)
	atomic.StoreUint64(&b.Size, size)
	atomic.StoreUint64(&b.Tag, blockFree)
	s.setNextFree(off, next)
}

func (s *Segment) arenaInit(start, end uint64) {
	s.makeFree(start, end-start, 0)
	atomic.StoreUint64(&s.hdr.ArenaFree, start)
}

// arenaExtend adds [old, size) to the arena, merging it with a free block
// that ends at old. Called with s.mu held.
func (s *Segment) arenaExtend(old, size uint64) {
	s.freeRange(old, size-old)
}

// Alloc returns the offset of a zeroed block of at least n bytes, aligned to
// align (a power of two; at least 16), growing the segment if no free block
// is large enough. Owner only.
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
	var prev uint64
	for cur := atomic.LoadUint64(&s.hdr.ArenaFree); cur != 0; prev, cur = cur, s.nextFree(cur) {
		size := atomic.LoadUint64(&s.block(cur).Size)
		end := cur + size
		payload := roundUp(cur+blockHdr, align)
		// A leading remainder must be big enough to stay a free block.
		for payload-blockHdr != cur && payload-blockHdr-cur < minBlock {
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
		next := s.nextFree(cur)
		// Rebuild the list around the carved block: [cur, start) stays
		// free, [blockEnd, end) becomes free.
		if end > blockEnd {
			s.makeFree(blockEnd, end-blockEnd, next)
			next = blockEnd
		}
		if start > cur {
			s.makeFree(cur, start-cur, next)
			next = cur
		}
		s.linkAfter(prev, next)
		b := s.block(start)
		atomic.StoreUint64(&b.Size, blockEnd-start)
		atomic.StoreUint64(&b.Tag, blockUsed)
		atomic.AddUint64(&s.hdr.ArenaUsed, blockEnd-start)
		atomic.AddUint64(&s.hdr.ArenaBlocks, 1)
		return payload, true
	}
	return 0, false
}

// linkAfter makes next follow prev in the free list (prev 0: the head).
func (s *Segment) linkAfter(prev, next uint64) {
	if prev == 0 {
		atomic.StoreUint64(&s.hdr.ArenaFree, next)
	} else {
		s.setNextFree(prev, next)
	}
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
	arena := atomic.LoadUint64(&s.hdr.ArenaOff)
	if off < arena+blockHdr || off%minAlignment != 0 || off >= s.limit() {
		return fmt.Errorf("%w: offset 0x%x", ErrBadBlock, off)
	}
	start := off - blockHdr
	b := s.block(start)
	size := atomic.LoadUint64(&b.Size)
	if atomic.LoadUint64(&b.Tag) != blockUsed || size < minBlock || start+size < start || start+size > s.limit() {
		return fmt.Errorf("%w: offset 0x%x (double free or not a block start)", ErrBadBlock, off)
	}
	atomic.AddUint64(&s.hdr.ArenaUsed, -size)
	atomic.AddUint64(&s.hdr.ArenaBlocks, ^uint64(0))
	s.freeRange(start, size)
	return nil
}

// BlockSize returns the usable size of the allocated block at off.
func (s *Segment) BlockSize(off uint64) (uint64, error) {
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
// it with the free blocks right before and after it.
func (s *Segment) freeRange(start, size uint64) {
	var prev uint64
	cur := atomic.LoadUint64(&s.hdr.ArenaFree)
	for cur != 0 && cur < start {
		prev, cur = cur, s.nextFree(cur)
	}
	next := cur
	if next != 0 && start+size == next {
		size += atomic.LoadUint64(&s.block(next).Size)
		next = s.nextFree(next)
	}
	if prev != 0 && prev+atomic.LoadUint64(&s.block(prev).Size) == start {
		atomic.StoreUint64(&s.block(prev).Size, atomic.LoadUint64(&s.block(prev).Size)+size)
		s.setNextFree(prev, next)
		return
	}
	s.makeFree(start, size, next)
	s.linkAfter(prev, start)
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

// ArenaStats walks the free list. Without the owner's lock (other
// processes) the figures are a best-effort snapshot.
func (s *Segment) ArenaStats() ArenaStats {
	if s.owner {
		s.mu.Lock()
		defer s.mu.Unlock()
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
