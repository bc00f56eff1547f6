package cache

import (
	"fmt"
	"math"
	"sync/atomic"

	"github.com/mpmr/mpmr/shm"
)

// The invalidation log.
//
// Every change that can make a cached entry wrong moves the generation
// DevGen. A local cache that sees the generation move could flush
// everything, as DPDK's mlx5 does; instead it reads what moved it here: a
// ring of the most recent invalidations in the segment, each with its
// generation and the address range it took away. A cache k generations
// behind, with all k still in the ring, drops only its entries overlapping
// those ranges. Entries that do not overlap any of them are still exactly
// right: an MR loses pages only by an invalidation, and a chunk of an MR
// that lost none is unchanged.
//
// Only the primary writes the log, with the write lock held, in the same
// write section as the generation it logs, and before it publishes the
// generation. Readers take no lock: each entry is a little seqlock (Seq odd
// while it is written), so a reader that races the entry's overwrite — it
// fell so far behind that the ring came round — sees the sequence or the
// entry's generation change and flushes everything.

// logEntry is one invalidation, in the segment.
//
//	off size field
//	  0   4  Seq    odd while the entry is being written
//	  4   4  Gen    the generation this entry moved DevGen to
//	  8   8  Start  first address invalidated
//	 16   8  End    first address past it; Start 0 and End max: everything
//	 24   8  reserved
type logEntry struct {
	Seq   uint32
	Gen   uint32
	Start uint64
	End   uint64
	_     uint64
}

// DefaultLogSize is the number of invalidations the log remembers unless
// GlobalConfig says otherwise.
const DefaultLogSize = 64

// maxLogSize bounds the log a reader trusts.
const maxLogSize = 1 << 16

// span is an invalidated address range.
type span struct{ start, end uint64 }

// everything is the span of an invalidation that cannot say what it took.
var everything = span{0, math.MaxUint64}

func (s span) overlaps(start, end uint64) bool { return start < s.end && s.start < end }

// newLog lays out the log (owner only).
func newLog(seg *shm.Segment, root *globalRoot, n int) error {
	if n < 1 || n > maxLogSize {
		return fmt.Errorf("cache: invalidation log of %d entries, want 1..%d", n, maxLogSize)
	}
	off, err := seg.Alloc(uint64(n)*logEntrySize, 64)
	if err != nil {
		return fmt.Errorf("cache: invalidation log: %w", err)
	}
	atomic.StoreUint64(&root.LogOff, off)
	atomic.StoreUint32(&root.LogLen, uint32(n))
	return nil
}

// openLog returns the log the root names, or nil (then every reader flushes
// everything) if it makes no sense.
func openLog(seg *shm.Segment, root *globalRoot) []logEntry {
	off := atomic.LoadUint64(&root.LogOff)
	n := uint64(atomic.LoadUint32(&root.LogLen))
	if off == 0 || n == 0 || n > maxLogSize || seg.CheckRange(off, n*logEntrySize) != nil {
		return nil
	}
	return shm.Slice[logEntry](seg, off, int(n))
}

// bumpGen logs an invalidation of [start, end) and moves DevGen on, in that
// order. Call it with the write lock held, before the table changes.
func (g *Global) bumpGen(start, end uint64) {
	if g.fullFlush {
		start, end = everything.start, everything.end
	}
	next := atomic.LoadUint32(g.devGen) + 1
	if len(g.ilog) > 0 {
		e := &g.ilog[next%uint32(len(g.ilog))]
		// Odd while written, even at rest: made odd rather than moved on,
		// so that a sequence word knocked out of step (a stray write to
		// the segment, a writer killed mid-entry) is put right here, as
		// the lock's is.
		seq := atomic.LoadUint32(&e.Seq) | 1
		atomic.StoreUint32(&e.Seq, seq)
		atomic.StoreUint32(&e.Gen, next)
		atomic.StoreUint64(&e.Start, start)
		atomic.StoreUint64(&e.End, end)
		atomic.StoreUint32(&e.Seq, seq+1)
	}
	atomic.StoreUint32(g.devGen, next)
}

// invalidated appends to dst the ranges invalidated by generations
// (from, to]. It reports false when the log cannot say: too many
// generations, an entry overwritten meanwhile, an invalidation of
// everything, or a segment let go of (Detach).
func (g *Global) invalidated(from, to uint32, dst []span) ([]span, bool) {
	n := uint32(len(g.ilog))
	if to-from > n || g.detached.Load() {
		return dst, false
	}
	for gen := from + 1; gen != to+1; gen++ {
		e := &g.ilog[gen%n]
		seq := atomic.LoadUint32(&e.Seq)
		eg := atomic.LoadUint32(&e.Gen)
		s := span{atomic.LoadUint64(&e.Start), atomic.LoadUint64(&e.End)}
		if seq&1 != 0 || eg != gen || atomic.LoadUint32(&e.Seq) != seq || s == everything {
			return dst, false
		}
		dst = append(dst, s)
	}
	return dst, true
}
