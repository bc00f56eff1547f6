package cache

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync/atomic"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/shm"
	"github.com/mpmr/mpmr/verbs"
)

// writeLock takes the global write lock. Only the primary writes, so a dead
// previous owner can only be a crashed primary whose segment we adopted:
// the MR list is the truth, and the table is rebuilt from it.
func (g *Global) writeLock() error {
	err := g.lock.LockWithin(g.timeout)
	if (err == nil || errors.Is(err, shm.ErrOwnerDied)) && g.owner {
		if t := g.tbl.Load(); t.Stale() || t.Size() != int(atomic.LoadUint32(&t.hdr.Size)) {
			t.writeHeader() // another process rewrote it
		}
	}
	if errors.Is(err, shm.ErrOwnerDied) {
		g.log.Warn("global cache lock owner died; rebuilding the table from the MR list")
		// The dead writer may have changed the list: every local cache
		// must flush what it took from the table before.
		g.bumpGen(everything.start, everything.end)
		if err = g.rebuild(); err != nil {
			// The list cannot be read (another process may have rewritten
			// it): the table is left empty and lookups go to the list,
			// where they fail while it stays so. The lock is not
			// abandoned: the list may be put right, and the primary's
			// frees and creates work again then.
			if t, terr := g.table(); terr == nil {
				t.Clear()
				atomic.StoreUint32(&t.hdr.Overflow, 1)
			}
		}
		g.lock.MarkConsistent()
		if err != nil {
			g.lock.Unlock()
		}
	}
	if err != nil {
		return fmt.Errorf("cache: global write lock: %w", err)
	}
	return nil
}

func (g *Global) writeUnlock() { g.lock.Unlock() }

// Create returns the entry for addr, registering the memory around it if no
// MR covers it yet. Primary only. It follows DPDK's mlx5 create path:
//
//  1. release MRs on the free list (deregistering outside the lock);
//  2. return the entry of an MR that covers addr already, if an optimistic
//     read of the table finds one;
//  3. find the run of allocated, contiguous pages around addr — or just its
//     page, in single-page mode;
//  4. allocate the record and its bitmap;
//  5. under the memory read lock, check the run is unchanged and no free
//     is letting go of its pages (else retry with one page; wait first if
//     the free's guards have not answered yet);
//  6. under the write lock, return the existing entry if another goroutine
//     or process created one meanwhile;
//  7. mark the pages of the run not yet registered by other MRs (the bitmap
//     may come out fragmented) and trim the range to them;
//  8. register that range, insert the MR in the list and its chunks in the
//     table, and return the entry for addr.
func (g *Global) Create(addr uint64) (Entry, error) {
	if !g.owner {
		return Entry{}, ErrNotPrimary
	}
	if g.closed.Load() {
		return Entry{}, ErrClosed
	}
	g.GC()
	// Many creates find the MR another request made meanwhile (misses of
	// the same memory from several queues at once, say): an optimistic
	// read says so without a lock or a record. The entry is as good as
	// the one the write section below would find: a free that trims it
	// later moves the generation, as it would for that one.
	if e, found, err := g.Lookup(addr); err == nil && found {
		return e, nil
	}
	run, ok := g.runAround(addr, g.single)
	if !ok {
		return Entry{}, fmt.Errorf("%w: 0x%x", ErrNoMemory, addr)
	}
	for {
		e, retry, undecided, err := g.createIn(addr, run)
		if undecided != nil {
			// A free of pages of the run asks its guards, which may
			// refuse it: wait for their answer, then start again.
			<-undecided
			if run, ok = g.runAround(addr, g.single); !ok {
				return Entry{}, fmt.Errorf("%w: 0x%x (freed meanwhile)", ErrNoMemory, addr)
			}
			continue
		}
		if !retry {
			return e, err
		}
		// The memory changed between the walk and the lock: one page only.
		if run, ok = g.runAround(addr, true); !ok {
			return Entry{}, fmt.Errorf("%w: 0x%x (freed meanwhile)", ErrNoMemory, addr)
		}
	}
}

// runAround finds the memory to register for addr: the contiguous run of
// allocated pages of its list, or only its page.
func (g *Global) runAround(addr uint64, onePage bool) (hugetlb.Run, bool) {
	run, ok := g.mem.ContigRun(uintptr(addr))
	if !ok || !onePage || run.Pages == 1 {
		return run, ok
	}
	i := int((uintptr(addr) - run.Start) / uintptr(run.PageSize))
	run.First += i
	run.Start += uintptr(i) * uintptr(run.PageSize)
	run.End = run.Start + uintptr(run.PageSize)
	run.Pages = 1
	return run, true
}

// createIn does steps 4 to 8 for one candidate run; retry reports that the
// run changed before the lock was taken, undecided that a free of some of
// its pages waits for its guards' answer (see hugetlb.Memory.Freeing).
func (g *Global) createIn(addr uint64, run hugetlb.Run) (e Entry, retry bool, undecided <-chan struct{}, err error) {
	n := uint32(run.Pages)
	words := uint64(n+63) / 64
	off, err := g.seg.Alloc(mrRecordSize+words*8, 64)
	if err != nil {
		return Entry{}, false, nil, fmt.Errorf("cache: create MR for 0x%x: %w", addr, err)
	}
	keep := false
	defer func() {
		if !keep {
			_ = g.seg.Free(off)
		}
	}()

	g.mem.RLock()
	defer g.mem.RUnlock()
	if again, ok := g.runAround(addr, run.Pages == 1); !ok {
		return Entry{}, false, nil, fmt.Errorf("%w: 0x%x (freed meanwhile)", ErrNoMemory, addr)
	} else if again != run {
		return Entry{}, true, nil, nil
	}
	if freeing, undecided := g.mem.Freeing(run.Start, uint64(run.End-run.Start)); undecided != nil {
		return Entry{}, false, undecided, nil
	} else if freeing {
		// A free has let go of pages of the run, and waits for the
		// secondaries to unmap them before they go.
		if run.Pages == 1 {
			return Entry{}, false, nil, fmt.Errorf("%w: 0x%x (being freed)", ErrNoMemory, addr)
		}
		return Entry{}, true, nil, nil
	}

	if err := g.writeLock(); err != nil {
		return Entry{}, false, nil, err
	}
	defer g.writeUnlock()
	if g.closed.Load() {
		return Entry{}, false, nil, ErrClosed // Close swept the list while we waited
	}
	if e, found, err := g.find(addr); err != nil || found {
		return e, false, nil, err
	}

	rec := shm.At[mrRecord](g.seg, off)
	atomic.StoreInt32(&rec.List, int32(run.List))
	atomic.StoreUint32(&rec.BitmapLen, n)
	m, err := g.mrAt(off)
	if err != nil {
		return Entry{}, false, nil, err
	}
	ps := run.PageSize
	first := -1
	var last, set uint32
	pages := newPageBits(n) // this process's own copy of the bitmap
	for i := range n {
		page := uint64(run.Start) + uint64(i)*ps
		if _, found, err := g.find(page); err != nil {
			return Entry{}, false, nil, err
		} else if found {
			continue // registered by another MR
		}
		if first < 0 {
			first = int(i)
		}
		m.setBit(i - uint32(first))
		pages.set(i - uint32(first))
		last = i
		set++
	}
	if first < 0 {
		// Every page is covered by other MRs, but not addr: impossible
		// unless the table lost entries.
		return Entry{}, false, nil, fmt.Errorf("%w: 0x%x missing though its pages are registered", ErrCorrupt, addr)
	}
	start := uint64(run.Start) + uint64(first)*ps
	length := uint64(last-uint32(first)+1) * ps
	vmr, err := g.pd.RegMR(uintptr(start), uintptr(length), g.access)
	if err != nil {
		return Entry{}, false, nil, fmt.Errorf("cache: register [0x%x, 0x%x) for 0x%x: %w", start, start+length, addr, err)
	}
	g.own(off, vmr, false, recordShape{pageSize: ps, list: int32(run.List), baseIdx: uint32(run.First + first),
		bitmapLen: last - uint32(first) + 1}, pages, set)
	defer func() {
		// Run before the locks go. Registered, but never listed: nobody
		// was given its key.
		if keep {
			return
		}
		if err := g.pd.DeregMR(vmr); err != nil && !errors.Is(err, verbs.ErrStaleKey) {
			g.markFreed(off) // the next collection tries again, with the record
			keep = true
			return
		}
		g.disown(off)
	}()
	atomic.StoreUint64(&rec.Start, start)
	atomic.StoreUint64(&rec.Len, length)
	atomic.StoreUint64(&rec.PageSize, ps)
	atomic.StoreUint32(&rec.BaseIdx, uint32(run.First+first))
	atomic.StoreUint32(&rec.PagesSet, set)
	atomic.StoreUint32(&rec.BitmapLen, last-uint32(first)+1)
	atomic.StoreUint32(&rec.LKey, vmr.LKey)
	atomic.StoreUint32(&rec.RKey, vmr.RKey)
	atomic.StoreUint32(&rec.Handle, vmr.Handle)
	atomic.StoreUint32(&rec.Access, uint32(vmr.Access))
	if m, err = g.mrAt(off); err != nil {
		return Entry{}, false, nil, err
	}
	g.push(&g.root.MRList, &g.root.MRCount, m)
	keep = true
	atomic.AddUint64(&g.root.Creates, 1)
	if err := g.insertChunks(m); err != nil {
		return Entry{}, false, nil, err
	}
	e, found, err := g.find(addr)
	if err == nil && !found {
		err = fmt.Errorf("%w: 0x%x not found right after registering it", ErrCorrupt, addr)
	}
	if g.log.Enabled(context.Background(), slog.LevelDebug) { // the arguments cost allocations
		g.log.Debug("MR created", "addr", addr, "start", start, "len", length, "lkey", vmr.LKey, "pages", set)
	}
	return e, false, nil, err
}

// Repair takes the global lock over if a writer died holding it (the
// rebuild that comes with the takeover repairs the table) and reports
// whether it did. Readers cannot repair a dead writer's lock, and lookups
// fail with shm.ErrOwnerDied until a writer comes: the primary calls this
// now and then so that one always comes. Primary only.
func (g *Global) Repair() (bool, error) {
	if !g.owner || !g.lock.OwnerDead() || g.closed.Load() {
		return false, nil
	}
	if err := g.writeLock(); err != nil {
		return false, err
	}
	g.writeUnlock()
	return true, nil
}

// push puts m at the head of a list. Call with the write lock held.
func (g *Global) push(head *uint64, count *uint32, m mr) {
	atomic.StoreUint64(&m.rec.Next, atomic.LoadUint64(head))
	atomic.StoreUint64(head, m.off)
	atomic.AddUint32(count, 1)
}

// insertChunks puts every chunk of m into the table, doubling the table
// when it is full. Call with the write lock held.
func (g *Global) insertChunks(m mr) error {
	var buf [4]Entry // most MRs are one chunk: no allocation for them
	for _, e := range m.appendChunks(buf[:0]) {
		if err := g.insert(e); err != nil {
			return err
		}
	}
	return nil
}

func (g *Global) insert(e Entry) error {
	t, err := g.table()
	if err != nil {
		return err
	}
	if t.Len() >= t.Size() && !t.Overflowed() && !g.noExpand {
		if nt, err := t.expandSegment(2 * t.Size()); err != nil {
			// Not fatal: the table overflows and lookups scan the list.
			g.log.Warn("global MR table cannot grow; falling back to list lookups", "err", err)
		} else {
			t = nt
			g.tbl.Store(t)
			atomic.AddUint64(&g.root.Expansions, 1)
		}
	}
	if err := t.Insert(e); err != nil && !errors.Is(err, ErrTableFull) {
		return err
	}
	return nil
}

// rebuild refills the table from the MR list, growing it to hold every
// chunk. Call with the write lock held, after bumping DevGen.
func (g *Global) rebuild() error {
	t, err := g.table()
	if err != nil {
		return err
	}
	chunks := make([]Entry, 0, g.ownedCount()) // not the list's count, which any process can rewrite
	err = g.eachMR(atomic.LoadUint64(&g.root.MRList), func(m mr) bool {
		chunks = m.appendChunks(chunks)
		return true
	})
	if err != nil {
		t.Clear()
		return err
	}
	slices.SortFunc(chunks, func(a, b Entry) int { return cmp.Compare(a.Start, b.Start) })
	if need := len(chunks) + 1; need > t.Size() && !g.noExpand {
		size := t.Size()
		for size < need {
			size *= 2
		}
		if nt, err := t.expandSegment(size); err != nil {
			g.log.Warn("global MR table cannot grow; falling back to list lookups", "err", err)
		} else {
			t = nt
			g.tbl.Store(t)
			atomic.AddUint64(&g.root.Expansions, 1)
		}
	}
	t.Fill(chunks)
	atomic.AddUint64(&g.root.Rebuilds, 1)
	return nil
}

// Exclusive runs fn while holding the global write lock, so that no lookup,
// creation or invalidation runs in any process meanwhile. It is meant for
// tools and tests: a process that dies inside fn leaves the lock to be
// recovered as from a writer that died mid-update. Primary only
// (ErrNotPrimary elsewhere): only the primary writes the global cache, so
// no other process, stopped or slow, can hold every other one up.
func (g *Global) Exclusive(fn func()) error {
	if !g.owner {
		return ErrNotPrimary
	}
	if err := g.writeLock(); err != nil {
		return err
	}
	defer g.writeUnlock()
	fn()
	return nil
}

// Shared runs fn while holding the global read lock: writers (creations,
// invalidations) in every process wait meanwhile — for a while: a writer
// that waits longer than the lock's fence time (shm.DefaultFenceAfter)
// fences the hold and goes ahead, and Shared then returns an error matching
// shm.ErrFenced, meaning that what fn read may be torn. Like Exclusive, it
// is meant for tools and tests, such as stopping or killing a process that
// holds the read lock.
func (g *Global) Shared(fn func()) error {
	ctx, cancel := g.lockCtx()
	defer cancel()
	h, err := g.lock.RLock(ctx)
	if err != nil {
		return fmt.Errorf("cache: global read lock: %w", err)
	}
	fn()
	if err := g.lock.RUnlock(h); err != nil {
		return fmt.Errorf("cache: global read section: %w", err)
	}
	return nil
}
