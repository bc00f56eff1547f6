package cache

import (
	"errors"
	"fmt"
	"slices"
	"sync/atomic"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/shm"
	"github.com/mpmr/mpmr/verbs"
)

// guardFree is the memory's free guard: it runs before the pages of a free
// are unmapped, once they are marked as being freed (no create registers
// them meanwhile: see hugetlb.Memory.Freeing), without the memory lock;
// the guards of two frees may run at once. If the registrations
// cannot be invalidated (the global lock cannot be had, the MR list is
// corrupt), it refuses the free, so that no memory is freed that a key is
// still served for.
func (g *Global) guardFree(ev hugetlb.Event) error {
	if ev.Kind != hugetlb.EventFree {
		return nil
	}
	if err := g.invalidate(uint64(ev.Addr), ev.Len); err != nil {
		g.log.Error("MR cache invalidation failed; the free is refused", "addr", ev.Addr, "len", ev.Len, "err", err)
		return fmt.Errorf("cache: invalidate [0x%x, +0x%x): %w", ev.Addr, ev.Len, err)
	}
	return nil
}

// CollectFor is Collect for a free of [addr, addr+length), as a free guard
// after the cache's (the primary's): it fails only if an MR of that range
// may still be registered — one the device kept, or any when the free list
// could not be taken — so that the free is refused. An MR of other memory
// the device keeps from an earlier free refuses that memory's free, not
// this one; it is logged.
func (g *Global) CollectFor(addr, length uint64) error {
	_, err := g.Collect()
	if err == nil {
		return nil
	}
	if len(g.ownedFreedOver(addr, length)) != 0 {
		return err // the device may still accept one of them there
	}
	g.logCollect(err)
	return nil
}

// invalidate clears the pages of [addr, addr+length) from every MR. An MR
// left with no pages moves to the free list, to be deregistered by the next
// GC. If anything changed, DevGen is bumped and then the table rebuilt,
// both under the write lock: a lookup that sees the old generation may
// still use what it cached, but one that starts after the bump flushes,
// and finds the global table either locked or rebuilt.
//
// The device is told too (see trim). An MR the device cannot trim (a soft
// device out of holes, say) is taken off the list whole, to be
// deregistered before the pages go: its other pages lose their
// registration and are registered again on demand, which is safe, where
// keeping it would leave its key valid over freed memory.
//
// The MRs and the pages they hold come from this process's own record of
// what it registered: the records in the segment, which any process
// mapping it can rewrite, only receive the changes, and the table is
// rebuilt from them. A list or record that cannot be read when it starts
// refuses the free with nothing changed; one that fails later (rewritten
// meanwhile) still flushes every cache and empties the table, so that no
// key is served for the range.
func (g *Global) invalidate(addr, length uint64) error {
	err := g.writeLock()
	if err != nil {
		return err
	}
	defer g.writeUnlock()
	// Every MR whose registered range covers the pages, holding them or
	// not (see trim): the device accepts their keys there.
	over := g.ownedOver(addr, length)
	if len(over) == 0 {
		return nil
	}
	// Before anything changes, the list and the table must read well: a
	// free refused (another process rewrote a link or the table's header)
	// then leaves everything as it was, to be asked again once it is put
	// back. The records of the MRs are the owner's to write whatever they
	// hold now.
	if err := g.eachMR(atomic.LoadUint64(&g.root.MRList), func(mr) bool { return true }); err != nil {
		return err
	}
	if _, err := g.table(); err != nil {
		return err
	}
	// Logged and bumped before the rebuild, so no local cache can miss the
	// flush.
	g.bumpGen(addr, addr+length)
	atomic.AddUint64(&g.root.Invalidations, 1)
	var errs []error
	drop := g.trim(over, addr, length)
	for _, off := range drop {
		o, _ := g.ownedAt(off)
		g.bumpGen(uint64(o.mr.Addr), uint64(o.mr.Addr+o.mr.Len))
	}
	for _, off := range over {
		if slices.Contains(drop, off) {
			continue
		}
		left := g.letGo(off, addr, length)
		g.writeRecord(off) // its bitmap as the owner has it, and every other word
		if left == 0 && g.holdsPages(off) {
			// Left with none now, or by an earlier free whose move
			// failed.
			drop = append(drop, off)
		}
	}
	for _, off := range drop {
		errs = append(errs, g.moveToFree(off))
	}
	errs = append(errs, g.rebuild())
	if err := errors.Join(errs...); err != nil {
		g.bumpGen(everything.start, everything.end) // the list cannot be trusted: every cache flushes
		if t, terr := g.table(); terr == nil {
			t.Clear()
			atomic.StoreUint32(&t.hdr.Overflow, 1) // lookups go to the list, which no longer has the pages
		}
		return err
	}
	return nil
}

// trim tells the device that the MRs in over (the records' offsets) no
// longer cover [addr, addr+length): an MR that lost some of its pages, or
// one registered over pages another MR held (the create path registers a
// whole run and leaves such pages out of its bitmap only). Without that,
// the device would keep accepting their keys for freed memory. It returns
// the MRs the device could not trim, which the caller must take off the
// list whole. Devices that cannot trim at all (rdma-core) keep the pages
// registered, as DPDK's drivers do. Call with the write lock held.
func (g *Global) trim(over []uint64, addr, length uint64) (failed []uint64) {
	t, ok := g.pd.(verbs.Trimmer)
	if !ok {
		return nil
	}
	for _, off := range over {
		o, _ := g.ownedAt(off)
		if err := t.TrimMR(o.mr, uintptr(addr), uintptr(length)); err != nil {
			g.log.Warn("the device cannot trim an MR; deregistering it whole",
				"lkey", o.mr.LKey, "addr", addr, "len", length, "err", err)
			failed = append(failed, off)
		}
	}
	return failed
}

// moveToFree unlinks the MR whose record is at off from the MR list and
// pushes it on the free list; the owner's record marks it for the next
// collection whatever the list says (one not on it any more is only
// marked), unless the list cannot be read: then the record may still be
// on it, and stays. Call with the write lock held.
func (g *Global) moveToFree(off uint64) error {
	prev := &g.root.MRList
	limit := g.walkLimit()
	for cur, n := atomic.LoadUint64(prev), 0; cur != 0; cur, n = atomic.LoadUint64(prev), n+1 {
		if n >= limit {
			return fmt.Errorf("%w: MR list does not end", ErrCorrupt)
		}
		m, err := g.mrAt(cur)
		if err != nil {
			return err
		}
		if cur == off {
			atomic.StoreUint64(prev, atomic.LoadUint64(&m.rec.Next))
			atomic.AddUint32(&g.root.MRCount, ^uint32(0))
			g.push(&g.root.FreeList, &g.root.FreeCount, m)
			g.markFreed(off)
			return nil
		}
		prev = &m.rec.Next
	}
	g.log.Warn("a registration was not on the MR list; it is deregistered all the same", "record", off)
	g.markFreed(off)
	return nil
}

// GC deregisters the MRs on the free list and frees their records: the
// list is detached under the write lock and released outside it, as the
// mlx5 driver does. Primary only; returns how many MRs were released.
// Failures are logged; Collect reports them.
func (g *Global) GC() int {
	n, err := g.Collect()
	if err != nil {
		g.logCollect(err)
	}
	return n
}

// logCollect logs a collection's failure, once while it stays the same:
// an MR the device keeps is retried at every collection, and every
// creation collects.
func (g *Global) logCollect(err error) {
	msg := err.Error()
	g.gcMu.Lock()
	same := msg == g.lastGCErr
	g.lastGCErr = msg
	g.gcMu.Unlock()
	if !same {
		g.log.Error("MR garbage collection", "err", err)
	}
}

// Collect is GC reporting what failed. Collections run one at a time: when
// Collect returns, every MR that was on the free list when it was called
// has been deregistered — by this call, or by one that ran meanwhile — or
// the error says why not.
func (g *Global) Collect() (int, error) {
	if !g.owner {
		return 0, nil
	}
	g.gcMu.Lock()
	defer g.gcMu.Unlock()
	// What is released is what this process moved to the free list (its
	// own record says), whatever the list in the segment holds now. Both
	// are taken under the write lock, so that no free is halfway through
	// moving an MR, and the list is emptied, so that no record freed here
	// stays on it.
	if g.freedCount() == 0 && atomic.LoadUint64(&g.root.FreeList) == 0 && atomic.LoadUint32(&g.root.FreeCount) == 0 {
		return 0, nil
	}
	if err := g.writeLock(); err != nil {
		return 0, fmt.Errorf("cache: collect freed MRs: %w", err)
	}
	atomic.StoreUint64(&g.root.FreeList, 0)
	atomic.StoreUint32(&g.root.FreeCount, 0)
	freed := g.ownedFreedOver(0, ^uint64(0))
	g.writeUnlock()
	var n int
	var errs []error
	for _, off := range freed {
		n += g.release(off, &errs)
	}
	if err := errors.Join(errs...); err != nil {
		return n, fmt.Errorf("cache: collect freed MRs: %w", err)
	}
	g.lastGCErr = ""
	return n, nil
}

// release deregisters the MR whose record is at off, as this process
// registered it, and frees the record, and reports 1; or, if the device
// refuses, keeps it for the next collection (its key may still be valid:
// a free waiting on this collection must be refused, and its retry too,
// until the device lets go), appends why to errs and reports 0. Call with
// gcMu held.
func (g *Global) release(off uint64, errs *[]error) int {
	o, _ := g.ownedAt(off)
	if err := g.pd.DeregMR(o.mr); err != nil && !errors.Is(err, verbs.ErrStaleKey) {
		*errs = append(*errs, err)
		return 0
	}
	g.disown(off)
	*errs = append(*errs, g.seg.Free(off))
	return 1
}

// Close releases every MR (deregistering them) and the global table, and
// stops listening to memory events. Other processes' handles need no
// closing. Idempotent.
func (g *Global) Close() error {
	if !g.owner {
		return nil
	}
	g.closeMu.Lock()
	defer g.closeMu.Unlock()
	if g.closed.Swap(true) {
		return nil
	}
	err := g.writeLock()
	if err != nil {
		// Nothing changed: still open and guarding frees, and a later
		// Close tries again.
		g.closed.Store(false)
		return err
	}
	// Frees stay guarded until the list is swept: one that came between
	// would otherwise leave keys served for its pages.
	defer g.unsub()
	var errs []error
	limit := g.walkLimit()
	for off, n := atomic.LoadUint64(&g.root.MRList), 0; off != 0; off, n = atomic.LoadUint64(&g.root.MRList), n+1 {
		if n >= limit {
			errs = append(errs, fmt.Errorf("%w: MR list does not end", ErrCorrupt))
			break
		}
		if err := g.moveToFree(off); err != nil {
			errs = append(errs, err)
			break
		}
	}
	// And those this process registered that the list no longer names:
	// their keys go with the cache too.
	g.markAllFreed()
	g.bumpGen(everything.start, everything.end)
	if t, err := g.table(); err == nil {
		t.Clear()
	}
	g.writeUnlock()
	_, err = g.Collect()
	return errors.Join(append(errs, err)...)
}

// RegisterExternal registers [addr, addr+length), memory outside every
// memseg list, as one MR (DPDK's external-memory MRs) and returns its
// entry. Registering exactly a range already registered returns the
// existing entry; a range that overlaps a memseg list or another
// registered external range is refused with an error matching ErrOverlap
// that names the overlap, and nothing changes. External memory is not
// tracked: keep it mapped until UnregisterExternal. Primary only.
func (g *Global) RegisterExternal(addr, length uint64) (Entry, error) {
	if !g.owner {
		return Entry{}, ErrNotPrimary
	}
	if g.closed.Load() {
		return Entry{}, ErrClosed
	}
	if addr == 0 || length == 0 || addr+length < addr {
		return Entry{}, fmt.Errorf("%w: register external [0x%x, +0x%x)", ErrBadRange, addr, length)
	}
	end := addr + length
	for _, l := range g.mem.Lists() {
		if addr < uint64(l.End) && uint64(l.Base) < end {
			return Entry{}, fmt.Errorf("%w: external [0x%x, 0x%x) overlaps memseg list %d at [0x%x, 0x%x)",
				ErrOverlap, addr, end, l.Index, l.Base, l.End)
		}
	}
	off, err := g.seg.Alloc(mrRecordSize, 64)
	if err != nil {
		return Entry{}, fmt.Errorf("cache: register external 0x%x: %w", addr, err)
	}
	err = g.writeLock()
	if err != nil {
		_ = g.seg.Free(off)
		return Entry{}, err
	}
	defer g.writeUnlock()
	if g.closed.Load() {
		_ = g.seg.Free(off)
		return Entry{}, ErrClosed // Close swept the list while we waited
	}
	// What is registered already is this process's own record's word.
	var same *Entry
	g.ownMu.Lock()
	for _, o := range g.owned {
		s, n := uint64(o.mr.Addr), uint64(o.mr.Len)
		switch {
		case !o.external || o.freed:
		case s == addr && n == length:
			same = &Entry{Start: s, End: s + n, LKey: o.mr.LKey}
		case addr < s+n && s < end:
			err = fmt.Errorf("%w: external [0x%x, 0x%x) overlaps the registered external [0x%x, 0x%x) (lkey 0x%x)",
				ErrOverlap, addr, end, s, s+n, o.mr.LKey)
		}
	}
	g.ownMu.Unlock()
	if err != nil || same != nil {
		_ = g.seg.Free(off)
		if same != nil {
			return *same, nil
		}
		return Entry{}, err
	}
	vmr, err := g.pd.RegMR(uintptr(addr), uintptr(length), g.access)
	if err != nil {
		_ = g.seg.Free(off)
		return Entry{}, fmt.Errorf("cache: register external [0x%x, 0x%x): %w", addr, end, err)
	}
	g.own(off, vmr, true, recordShape{list: -1, bitmapLen: 1}, pageBits{}, 0)
	rec := shm.At[mrRecord](g.seg, off)
	atomic.StoreInt32(&rec.List, -1)
	atomic.StoreUint64(&rec.Start, addr)
	atomic.StoreUint64(&rec.Len, length)
	atomic.StoreUint32(&rec.PagesSet, 1)
	atomic.StoreUint32(&rec.BitmapLen, 1)
	atomic.StoreUint32(&rec.LKey, vmr.LKey)
	atomic.StoreUint32(&rec.RKey, vmr.RKey)
	atomic.StoreUint32(&rec.Handle, vmr.Handle)
	atomic.StoreUint32(&rec.Access, uint32(vmr.Access))
	m, err := g.mrAt(off)
	if err != nil {
		return Entry{}, err
	}
	g.push(&g.root.MRList, &g.root.MRCount, m)
	atomic.AddUint64(&g.root.Creates, 1)
	if err := g.insertChunks(m); err != nil {
		return Entry{}, err
	}
	e, _, err := g.find(addr)
	return e, err
}

// UnregisterExternal deregisters the external-memory MR holding addr.
// Lookups that start after it returns no longer find it. Primary only.
func (g *Global) UnregisterExternal(addr uint64) error {
	if !g.owner {
		return ErrNotPrimary
	}
	if g.closed.Load() {
		return ErrClosed
	}
	err := g.writeLock()
	if err != nil {
		return err
	}
	off, o, found := g.ownedExternal(addr) // as this process registered it
	if !found {
		err = fmt.Errorf("%w: no external MR holds 0x%x", ErrNoMemory, addr)
	}
	if err == nil {
		err = g.moveToFree(off)
	}
	if err == nil {
		g.bumpGen(uint64(o.mr.Addr), uint64(o.mr.Addr+o.mr.Len))
		atomic.AddUint64(&g.root.Invalidations, 1)
		err = g.rebuild()
	}
	g.writeUnlock()
	if err != nil {
		return err
	}
	g.GC()
	return nil
}
