package cache

import (
	"errors"
	"fmt"
	"sync/atomic"
)

// ErrSplit means a buffer given to LookupRange does not lie inside one
// memory region. The error is a *SplitError, which says where the MR
// holding the buffer's start ends.
var ErrSplit = errors.New("cache: buffer spans more than one memory region")

// SplitError is LookupRange's answer for a buffer that one MR does not
// cover: [Addr, Split) is covered, under Key; the rest, from Split on,
// needs a lookup of its own (it may be another MR, or memory that is not
// registered). Split a scatter-gather element there rather than hand the
// device a key that does not cover it.
type SplitError struct {
	Addr  uintptr // the buffer's first byte
	Len   uint64  // its length
	Split uintptr // the first byte the MR holding Addr does not cover
	Key   uint32  // the key of [Addr, Split)
}

func (e *SplitError) Error() string {
	return fmt.Sprintf("cache: buffer [0x%x, 0x%x) spans more than one memory region: lkey 0x%x covers it up to 0x%x",
		e.Addr, uint64(e.Addr)+e.Len, e.Key, e.Split)
}

// Is makes errors.Is(err, ErrSplit) true.
func (e *SplitError) Is(target error) bool { return target == ErrSplit }

// LookupRange returns the key of the MR holding all of [addr, addr+n),
// creating the MR around addr if needed. If that MR ends before addr+n, it
// returns InvalidKey and a *SplitError (matching ErrSplit) saying up to
// where it covers the buffer and under which key; a driver then splits
// the buffer there. DPDK's drivers look up a buffer's first byte only, and
// a buffer over two MRs then reaches the device with a key that covers
// part of it; buffers of DPDK's default mbuf size (2176 bytes) cross page
// boundaries, and pages may belong to different MRs.
//
// An empty or wrapping range gets ErrBadRange; otherwise the errors are
// Lookup's. An answer allocates nothing; a split allocates its error.
func (l *Local) LookupRange(addr uintptr, n uint64) (uint32, error) {
	a := uint64(addr)
	if n == 0 || a+n < a {
		return InvalidKey, fmt.Errorf("%w: lookup of [0x%x, +0x%x)", ErrBadRange, a, n)
	}
	var e Entry
	if i, ok := l.hitEntry(a); ok {
		e = l.top[i].entry()
		if (l.mruHit+l.topHit)&(publishEvery-1) == 0 {
			l.publish()
		}
	} else {
		var err error
		if e, err = l.lookupSlow(a); err != nil {
			return InvalidKey, err
		}
	}
	if n > e.End-a {
		return InvalidKey, &SplitError{Addr: addr, Len: n, Split: uintptr(e.End), Key: e.LKey}
	}
	return e.LKey, nil
}

// hitEntry is Hit returning the index of the top-half entry.
func (l *Local) hitEntry(a uint64) (uint32, bool) {
	if atomic.LoadUint32(l.devGen) != l.gen {
		return 0, false
	}
	if m := l.mru % topSize; a-l.top[m].start < l.top[m].size {
		l.mruHit++
		return m, true
	}
	i, ok := l.findTop(a)
	if ok {
		l.mru = i
		l.topHit++
	}
	return i, ok
}

// LookupBurst looks up every address of addrs, as Lookup does, and stores
// the keys in keys, which must be at least as long. It returns how many
// addresses it answered: all of them, or those before the first it could
// not answer, with the error for that one (keys from there on are left as
// they were).
//
// A burst checks the generation once, at its start, and answers a run of
// addresses in one MR — a transmit burst of packets from one mempool —
// with one comparison each; other addresses go through the top half and,
// if need be, the slower levels, in order. A free that returned before the
// burst started is honoured for every address in it, and one that happened
// while the burst waited for a slower level for every address after that.
// Answers from the cache allocate nothing.
func (l *Local) LookupBurst(addrs []uintptr, keys []uint32) (int, error) {
	if len(keys) < len(addrs) {
		return 0, errShortKeys(len(addrs), len(keys))
	}
	if atomic.LoadUint32(l.devGen) != l.gen {
		return l.burst(addrs, keys, 0)
	}
	// The run of addresses in the most recently used entry.
	e := &l.top[l.mru%topSize]
	n := run(addrs, keys, e.start, e.size, e.key)
	if n < len(addrs) {
		l.mruHit += uint64(n)
		return l.burst(addrs, keys, n)
	}
	before := l.mruHit + l.topHit
	l.mruHit += uint64(n)
	if (before^(before+uint64(n)))>>12 != 0 { // crossed a multiple of publishEvery
		l.publish()
	}
	return n, nil
}

func errShortKeys(addrs, keys int) error {
	return fmt.Errorf("cache: burst of %d addresses with room for %d keys", addrs, keys)
}

// countRun counts n addresses answered by runs in the top half.
func (l *Local) countRun(n uint64) {
	before := l.mruHit + l.topHit
	l.mruHit += n
	if (before^(before+n))>>12 != 0 { // crossed a multiple of publishEvery
		l.publish()
	}
}

// burst is LookupBurst from addrs[i] on, where the first run ended.
func (l *Local) burst(addrs []uintptr, keys []uint32, i int) (int, error) {
	keys = keys[:len(addrs)]
	if g := atomic.LoadUint32(l.devGen); g != l.gen {
		l.catchUp(g)
	}
	m := l.mru % topSize
	start, size, key := l.top[m].start, l.top[m].size, l.top[m].key
	var runs uint64 // addresses answered by the entry that answered the one before
	for ; i < len(addrs); i++ {
		a := uint64(addrs[i])
		if a-start < size {
			keys[i] = key
			runs++
			continue
		}
		if t, ok := l.findTop(a); ok {
			l.mru = t
			l.topHit++
			start, size, key = l.top[t].start, l.top[t].size, l.top[t].key
			keys[i] = key
			continue
		}
		e, err := l.lookupSlow(a)
		if err != nil {
			l.countRun(runs)
			return i, err
		}
		// Memory may have been freed while the slow path waited (for a
		// create, say): catch up before the top half answers again. e
		// answers addrs[i], whose lookup overlapped the free, but the
		// addresses after it are looked up afresh: catching up may just
		// have dropped e.
		keys[i] = e.LKey
		start, size, key = e.Start, e.End-e.Start, e.LKey
		if g := atomic.LoadUint32(l.devGen); g != l.gen {
			l.catchUp(g)
			size = 0
		}
	}
	l.countRun(runs)
	return len(addrs), nil
}
