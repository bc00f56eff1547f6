package cache

import (
	"errors"
	"fmt"
	"sync/atomic"

	"github.com/mpmr/mpmr/shm"
)

// Creator is how a miss in every cache becomes a new MR. The primary
// registers the memory itself (*Global implements Creator); a secondary
// asks the primary over IPC.
type Creator interface {
	// CreateMR returns the entry of an MR covering addr, creating the MR
	// if there is none.
	CreateMR(addr uint64) (Entry, error)
	// RegisterExternal registers a chunk of external memory (outside the
	// memseg lists). A secondary cannot: it returns ErrExternalMemory.
	RegisterExternal(addr, length uint64) (Entry, error)
}

// CreateMR implements Creator for the primary.
func (g *Global) CreateMR(addr uint64) (Entry, error) { return g.Create(addr) }

const (
	topSize          = 8 // entries in the top half (a power of two)
	defaultLocalSize = 256
	publishEvery     = 1 << 12 // hits between publications of the counters
	publishSlowEvery = 1 << 8  // slower lookups between publications
)

// LocalStats counts what a local cache did.
type LocalStats struct {
	Lookups    uint64 // all lookups
	TopHits    uint64 // answered by the top half (MRU entry or linear search)
	BottomHits uint64 // answered by the bottom-half table
	GlobalHits uint64 // answered by the global table
	Created    uint64 // answered by the create path
	Failed     uint64 // not answered
	Flushes    uint64 // times the generation moved and the cache caught up
	// Of those flushes, the ones that dropped only the entries the
	// invalidations touched (the rest dropped everything).
	SelectiveFlushes uint64
	// Entries dropped by full flushes and by selective ones.
	FullDropped, SelectiveDropped uint64
}

// Add returns the sum of s and o.
func (s LocalStats) Add(o LocalStats) LocalStats {
	return LocalStats{
		Lookups: s.Lookups + o.Lookups, TopHits: s.TopHits + o.TopHits, BottomHits: s.BottomHits + o.BottomHits,
		GlobalHits: s.GlobalHits + o.GlobalHits, Created: s.Created + o.Created, Failed: s.Failed + o.Failed,
		Flushes: s.Flushes + o.Flushes, SelectiveFlushes: s.SelectiveFlushes + o.SelectiveFlushes,
		FullDropped: s.FullDropped + o.FullDropped, SelectiveDropped: s.SelectiveDropped + o.SelectiveDropped,
	}
}

// FullFlushes returns the flushes that dropped everything.
func (s LocalStats) FullFlushes() uint64 { return s.Flushes - s.SelectiveFlushes }

// Local is a per-queue cache: an 8-entry top half searched first, most
// recently used entry before the rest, with round-robin replacement; then a
// bottom-half table that starts at 256 entries and doubles; then the global
// cache and the create path. It remembers the generation it was filled at;
// when the global one moves, it drops the entries the invalidations since
// touched, as the segment's invalidation log records them, or everything
// when the log cannot say (see invlog.go).
//
// A Local is used by one goroutine at a time and is not safe for
// concurrent use; give each queue its own. A hit takes no lock, makes no
// call and allocates nothing.
type Local struct {
	gen    uint32  // generation the contents belong to
	mru    uint32  // index of the most recently used top entry
	devGen *uint32 // the global generation, in shared memory
	top    [topSize]topEntry
	head   uint32 // next top entry to replace
	mruHit uint64 // lookups answered by the MRU entry
	topHit uint64 // lookups answered by the rest of the top half
	bh     *Table
	global *Global
	create Creator
	st     LocalStats
	pub    published
	spans  []span // scratch for catching up
}

// published is the last copy of the counters other goroutines may read.
type published struct {
	lookups, top, bottom, global, created, failed, flushes atomic.Uint64
	selective, fullDropped, selectiveDropped               atomic.Uint64
}

// NewLocal returns a local cache over g that creates MRs through c. A
// bottomSize of 0 means 256 entries.
func NewLocal(g *Global, c Creator, bottomSize int) *Local {
	if bottomSize <= 0 {
		bottomSize = defaultLocalSize
	}
	devGen := g.devGen
	if g.detached.Load() {
		devGen = &g.deadGen // the segment may be gone: nothing of it is read
	}
	l := &Local{devGen: devGen, bh: NewTable(bottomSize), global: g, create: c, spans: make([]span, 0, 8)}
	l.gen = atomic.LoadUint32(l.devGen)
	return l
}

// Lookup returns the key of the MR holding addr, creating the MR if needed.
// On failure it returns InvalidKey and an error: ErrNoMemory for an address
// outside all known memory, or what the global cache or the create path
// reported (a secondary whose primary died gets that error).
func (l *Local) Lookup(addr uintptr) (uint32, error) {
	a := uint64(addr)
	if atomic.LoadUint32(l.devGen) == l.gen {
		if e := &l.top[l.mru%topSize]; a-e.start < e.size {
			l.mruHit++
			if l.mruHit&(publishEvery-1) == 0 {
				l.publish()
			}
			return e.key, nil
		}
		// The rest of the top half as Hit tests it, but two entries a
		// loop step, so that the loop's own branch runs half as often. On
		// an Intel host that paid (a hit on a random entry of the eight
		// 4.9 → 3.8 ns, eight misses 6.1 → 4.6 ns, measured apart); on an
		// AMD one Hit's plain loop is as fast. Too big for Hit, which must
		// stay inlinable; the answers are Hit's.
		for i := uint32(0); i < topSize; i += 2 {
			e, f := &l.top[i], &l.top[i+1]
			if a-e.start < e.size || a-f.start < f.size {
				if a-e.start >= e.size {
					e, i = f, i+1
				}
				l.mru = i
				l.topHit++
				if l.topHit&(publishEvery-1) == 0 {
					l.publish()
				}
				return e.key, nil
			}
		}
	}
	return l.lookupMiss(a)
}

// Hit answers from the top half alone: the most recently used entry, then
// the other seven. It reports false when the top half cannot answer (or the
// generation moved); Lookup then goes on to the slower levels. Hit is small
// enough to be inlined into a datapath loop, which saves the call Lookup
// costs; for hits spread over the top half, Lookup's loop (two entries a
// step) is the faster on some CPUs (see Lookup). A loop that calls Hit
// instead of Lookup should call Publish now and then for its hits to show
// in Published.
func (l *Local) Hit(addr uintptr) (uint32, bool) {
	a := uint64(addr)
	if atomic.LoadUint32(l.devGen) == l.gen {
		if e := &l.top[l.mru%topSize]; a-e.start < e.size {
			l.mruHit++
			return e.key, true
		}
		for i := range l.top {
			if e := &l.top[i]; a-e.start < e.size {
				l.mru = uint32(i)
				l.topHit++
				return e.key, true
			}
		}
	}
	return InvalidKey, false
}

// lookupMiss is Lookup past the top half. A bottom-half hit that the
// table's index answers at once is answered here, without the rest of the
// slow path's bookkeeping; anything else (a search, a miss, a generation
// that moved) goes to lookupSlow.
func (l *Local) lookupMiss(a uint64) (uint32, error) {
	if atomic.LoadUint32(l.devGen) == l.gen && l.bh.reindexIn == 0 {
		if e, _, ok := l.bh.probeLocal(a); ok && a < e.End {
			l.st.Lookups++
			l.st.BottomHits++
			l.promote(e)
			if l.st.Lookups&(publishSlowEvery-1) == 0 {
				l.publish()
			}
			return e.LKey, nil
		}
	}
	e, err := l.lookupSlow(a)
	return e.LKey, err
}

// lookupSlow is everything after the top half: the bottom half, the global
// cache, the create path.
func (l *Local) lookupSlow(a uint64) (Entry, error) {
	l.st.Lookups++
	defer func() {
		if l.st.Lookups&(publishSlowEvery-1) == 0 {
			l.publish()
		}
	}()
	if g := atomic.LoadUint32(l.devGen); g != l.gen {
		l.catchUp(g)
		if i, ok := l.findTop(a); ok {
			l.st.TopHits++
			l.mru = i
			return l.top[i].entry(), nil
		}
	}
	if e, _, hit := l.bh.find(a); hit {
		l.st.BottomHits++
		l.promote(e)
		return e, nil
	}
	return l.miss(a)
}

// miss looks in the global cache, then asks the create path, and caches the
// answer in both halves.
func (l *Local) miss(a uint64) (Entry, error) {
	if l.bh.Len() >= l.bh.Size() {
		_ = l.bh.Expand(2 * l.bh.Size()) // on failure the table overflows; fine
	}
	e, found, err := l.global.Lookup(a)
	if errors.Is(err, shm.ErrOwnerDied) {
		// A writer died mid-update: the table cannot be trusted, and only a
		// writer can repair it. The create path leads to one (the primary
		// takes the lock over, rebuilds and answers).
		found, err = false, nil
	}
	switch {
	case err != nil:
	case found:
		l.st.GlobalHits++
	default:
		e, err = l.create.CreateMR(a)
		if err == nil {
			l.st.Created++
		}
	}
	if err != nil {
		l.st.Failed++
		return Entry{LKey: InvalidKey}, err
	}
	_ = l.bh.Insert(e) // a full table just means the global is asked again
	l.promote(e)
	return e, nil
}

// topEntry is a top-half entry, kept as start and size so that a hit
// check is one subtraction and one comparison. An entry of size 0 is
// unused.
type topEntry struct {
	start, size uint64
	key         uint32
}

func (e *topEntry) entry() Entry { return Entry{Start: e.start, End: e.start + e.size, LKey: e.key} }

// findTop returns the top-half entry holding a, testing two entries at a
// time as Lookup does.
func (l *Local) findTop(a uint64) (uint32, bool) {
	for i := uint32(0); i < topSize; i += 2 {
		e, f := &l.top[i], &l.top[i+1]
		if a-e.start < e.size || a-f.start < f.size {
			if a-e.start >= e.size {
				i++
			}
			return i, true
		}
	}
	return 0, false
}

// promote puts e in the top half in place of the oldest entry.
func (l *Local) promote(e Entry) {
	l.top[l.head] = topEntry{start: e.Start, size: e.End - e.Start, key: e.LKey}
	l.mru = l.head
	l.head = (l.head + 1) % topSize
}

// Flush empties the cache. Lookups catch up by themselves when the
// generation moves; this is for users who want to drop entries early.
func (l *Local) Flush() { l.flush(atomic.LoadUint32(l.devGen)) }

func (l *Local) flush(gen uint32) {
	dropped := uint64(l.bh.Len() - 1)
	for i := range l.top {
		if l.top[i].size != 0 {
			dropped++
		}
	}
	l.top = [topSize]topEntry{}
	l.mru, l.head = 0, 0
	l.bh.Clear()
	if gen != l.gen {
		l.st.Flushes++
		l.st.FullDropped += dropped
	}
	l.gen = gen
}

// catchUp brings the cache to generation gen: it drops the entries that
// overlap what the invalidations since l.gen took away, or everything if
// the invalidation log cannot say (too far behind, an entry overwritten
// while read, an invalidation of everything). An entry an invalidation only
// trimmed (its MR lost some pages) overlaps the range and is dropped too.
func (l *Local) catchUp(gen uint32) {
	spans, ok := l.global.invalidated(l.gen, gen, l.spans[:0])
	l.spans = spans[:0]
	if !ok {
		l.flush(gen)
		return
	}
	var dropped uint64
	for i := range l.top {
		if e := &l.top[i]; e.size != 0 && overlapsAny(spans, e.start, e.start+e.size) {
			*e = topEntry{}
			dropped++
		}
	}
	dropped += uint64(l.bh.dropOverlapping(spans))
	l.st.Flushes++
	l.st.SelectiveFlushes++
	l.st.SelectiveDropped += dropped
	l.gen = gen
}

// overlapsAny reports whether [start, end) overlaps any of spans.
func overlapsAny(spans []span, start, end uint64) bool {
	for _, s := range spans {
		if s.overlaps(start, end) {
			return true
		}
	}
	return false
}

// Stats returns the counters. Call it from the goroutine using the cache;
// other goroutines use Published.
func (l *Local) Stats() LocalStats {
	s := l.st
	s.Lookups += l.mruHit + l.topHit
	s.TopHits += l.mruHit + l.topHit
	return s
}

// Publish makes the current counters visible to Published. Lookup
// publishes every few thousand hits and every 256 slower lookups on its own.
func (l *Local) Publish() { l.publish() }

// publish stores the counters that changed since the last time: a store
// is a locked instruction here, a load is not, and between two
// publications most counters stay as they were.
func (l *Local) publish() {
	s := l.Stats()
	p := &l.pub
	set := func(c *atomic.Uint64, v uint64) {
		if c.Load() != v {
			c.Store(v)
		}
	}
	set(&p.lookups, s.Lookups)
	set(&p.top, s.TopHits)
	set(&p.bottom, s.BottomHits)
	set(&p.global, s.GlobalHits)
	set(&p.created, s.Created)
	set(&p.failed, s.Failed)
	set(&p.flushes, s.Flushes)
	set(&p.selective, s.SelectiveFlushes)
	set(&p.fullDropped, s.FullDropped)
	set(&p.selectiveDropped, s.SelectiveDropped)
}

// Published returns the counters as last published. Safe from any
// goroutine.
func (l *Local) Published() LocalStats {
	p := &l.pub
	return LocalStats{Lookups: p.lookups.Load(), TopHits: p.top.Load(), BottomHits: p.bottom.Load(),
		GlobalHits: p.global.Load(), Created: p.created.Load(), Failed: p.failed.Load(), Flushes: p.flushes.Load(),
		SelectiveFlushes: p.selective.Load(), FullDropped: p.fullDropped.Load(), SelectiveDropped: p.selectiveDropped.Load()}
}

// Entries returns the top-half entries in use and the bottom-half table's
// entries, for dumps. Call it from the goroutine using the cache.
func (l *Local) Entries() (top, bottom []Entry) {
	for _, e := range l.top {
		if e.size != 0 {
			top = append(top, e.entry())
		}
	}
	return top, l.bh.Entries()
}

// lookupEntry is Lookup returning the whole entry.
func (l *Local) lookupEntry(a uint64) (Entry, error) {
	if atomic.LoadUint32(l.devGen) == l.gen {
		if i, ok := l.findTop(a); ok {
			l.topHit++
			return l.top[i].entry(), nil
		}
	}
	return l.lookupSlow(a)
}

// RegisterMempool makes sure every chunk of p is covered by MRs and fills
// this cache with their entries, as DPDK's drivers do before a queue starts.
// Chunks in data memory get MRs through the create path; chunks of
// external memory are registered as their own MRs by the primary, while a
// secondary gets ErrExternalMemory unless the primary registered them
// already. A chunk that is empty or wraps past the top of the address
// space fails it with ErrBadChunk before anything is registered.
func (l *Local) RegisterMempool(p Mempool) error {
	chunks := p.Chunks()
	for i, c := range chunks {
		if err := c.Check(); err != nil {
			return fmt.Errorf("cache: register mempool %s chunk %d of %d: %w", p.Name(), i, len(chunks), err)
		}
	}
	for _, c := range chunks {
		for a, end := uint64(c.Addr), uint64(c.Addr)+c.Len; a < end; {
			e, err := l.lookupEntry(a)
			if errors.Is(err, ErrNoMemory) {
				e, err = l.create.RegisterExternal(uint64(c.Addr), c.Len)
				if err == nil {
					_ = l.bh.Insert(e)
					l.promote(e)
				}
			}
			if err == nil && e.End <= a {
				err = fmt.Errorf("%w: entry %v does not cover 0x%x", ErrCorrupt, e, a)
			}
			if err != nil {
				return fmt.Errorf("cache: register mempool %s chunk [0x%x, 0x%x): %w", p.Name(), c.Addr, end, err)
			}
			a = e.End
		}
	}
	return nil
}
