package hugetlb

import (
	"math/bits"
	"sync/atomic"
)

// bitmap holds one bit per page. The shared page-state bitmap lives in the
// segment, where only the primary writes it; each process also keeps a
// private one of the pages it has mapped. Every access is atomic so that
// the same code serves both.
type bitmap []uint64

func words(pages int) int { return (pages + 63) / 64 }

func (b bitmap) get(i int) bool {
	return atomic.LoadUint64(&b[i>>6])&(1<<(uint(i)&63)) != 0
}

// setRange sets bits [first, first+n).
func (b bitmap) setRange(first, n int) {
	for i, end := first, first+n; i < end; {
		w, mask, next := span(i, end)
		atomic.OrUint64(&b[w], mask)
		i = next
	}
}

// clearRange clears bits [first, first+n).
func (b bitmap) clearRange(first, n int) {
	for i, end := first, first+n; i < end; {
		w, mask, next := span(i, end)
		atomic.AndUint64(&b[w], ^mask)
		i = next
	}
}

// span returns the word holding bit i, the mask of bits [i, end) in it, and
// the first bit past that word's part of the range.
func span(i, end int) (w int, mask uint64, next int) {
	w = i >> 6
	lo := uint(i) & 63
	hi := uint(64)
	if wordEnd := (w + 1) << 6; end < wordEnd {
		hi = uint(end - w<<6)
	}
	mask = (^uint64(0) >> (64 - (hi - lo))) << lo
	return w, mask, w<<6 + int(hi)
}

// next returns the first index in [i, limit) whose bit equals set, or limit.
func (b bitmap) next(i, limit int, set bool) int {
	for i < limit {
		w := atomic.LoadUint64(&b[i>>6])
		if !set {
			w = ^w
		}
		w &= ^uint64(0) << (uint(i) & 63)
		if w != 0 {
			return min(i&^63+bits.TrailingZeros64(w), limit)
		}
		i = (i | 63) + 1
	}
	return limit
}

// prevClear returns the last index <= i whose bit is clear, or -1.
func (b bitmap) prevClear(i int) int {
	for i >= 0 {
		w := ^atomic.LoadUint64(&b[i>>6])
		w &= ^uint64(0) >> (63 - (uint(i) & 63))
		if w != 0 {
			return i&^63 + 63 - bits.LeadingZeros64(w)
		}
		i = i&^63 - 1
	}
	return -1
}

// snapshot copies the words.
func (b bitmap) snapshot() bitmap {
	out := make(bitmap, len(b))
	for i := range b {
		out[i] = atomic.LoadUint64(&b[i])
	}
	return out
}

// firstFit returns the first index of a run of n clear bits in [0, limit)
// (or -1) and the length of the longest clear run it saw (all of them when
// it finds none).
func (b bitmap) firstFit(n, limit int) (first, longest int) {
	for i := 0; i < limit; {
		start := b.next(i, limit, false)
		if start == limit {
			break
		}
		end := b.next(start, limit, true)
		longest = max(longest, end-start)
		if end-start >= n {
			return start, longest
		}
		i = end
	}
	return -1, longest
}

// count returns the number of set bits in [0, limit).
func (b bitmap) count(limit int) int {
	n := 0
	for i := 0; i < words(limit); i++ {
		w := atomic.LoadUint64(&b[i])
		if rest := limit - i<<6; rest < 64 {
			w &= 1<<uint(rest) - 1
		}
		n += bits.OnesCount64(w)
	}
	return n
}
