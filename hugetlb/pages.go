package hugetlb

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/bits"
	"runtime"
	"strings"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mpmr/mpmr/internal/sys/falloc"
	"github.com/mpmr/mpmr/internal/sys/vm"
)

// Region is a range of data memory: whole pages of one list.
type Region struct {
	Addr uintptr
	Len  uint64
}

// End returns the first address past the region.
func (r Region) End() uintptr { return r.Addr + uintptr(r.Len) }

// Bytes returns the region's memory. It is valid while the region stays
// allocated (and, in a secondary, mapped); touching it after Free faults.
func (r Region) Bytes() []byte { return vm.Bytes(r.Addr, uintptr(r.Len)) }

// EventKind says what happened to a range of memory.
type EventKind int

// Event kinds.
const (
	// EventAlloc: the range was just mapped; it is readable and writable.
	EventAlloc EventKind = iota + 1
	// EventFree: the range is about to be unmapped; it is still readable,
	// unless a mapping that failed in a secondary removed it already (a
	// hole left by a failed MAP_FIXED). If the unmap then fails, the
	// pages that were mapped are announced again with EventAlloc.
	EventFree
)

func (k EventKind) String() string {
	switch k {
	case EventAlloc:
		return "alloc"
	case EventFree:
		return "free"
	}
	return fmt.Sprintf("event(%d)", int(k))
}

// Event reports a change of the memory mapped in this process: whole pages
// of one list.
type Event struct {
	Kind EventKind
	Addr uintptr
	Len  uint64
}

type subscriber struct {
	fn    func(Event)
	guard func(Event) error
	live  atomic.Bool
}

// Subscribe registers fn for events and returns a function that cancels the
// subscription (idempotent; an event being delivered at that moment may
// still reach fn, no later one does).
//
// In the primary, Alloc delivers EventAlloc after it mapped the pages and
// Free delivers EventFree before it unmaps anything (after the guards, see
// GuardFree), so a subscriber can drop what refers to the range first. In a
// secondary, MapPages, UnmapPages and Resync deliver the same events for the
// pages whose mapping they change in this process.
//
// Events are delivered synchronously, in subscription order, on the
// goroutine that changes the memory. In a secondary the memory write lock
// is held meanwhile: fn must not call MapPages, UnmapPages, Resync, RLock
// or Close. In the primary it is not, so that a subscriber that waits
// (for secondaries to follow the change) holds up only the changes of
// memory, not the MR cache's creates: events of different calls may be
// delivered at once, the pages of the event stay allocated and mapped
// meanwhile, no other Free takes them and no Alloc hands them out, and a
// Free's pages are reported by Freeing. There fn must not call Alloc,
// Free, ReleaseQuarantine, HoldChanges or Close. Either way it may call the
// queries and take other locks (lock order: the memory lock, then the
// cache's locks).
func (m *Memory) Subscribe(fn func(Event)) (cancel func()) {
	return m.subscribe(&m.subs, fn, nil)
}

func (m *Memory) subscribe(to *atomic.Pointer[[]*subscriber], fn func(Event), guard func(Event) error) (cancel func()) {
	s := &subscriber{fn: fn, guard: guard}
	s.live.Store(true)
	m.subMu.Lock()
	var subs []*subscriber
	if p := to.Load(); p != nil {
		subs = append(subs, *p...)
	}
	subs = append(subs, s)
	to.Store(&subs)
	m.subMu.Unlock()
	return func() {
		if !s.live.Swap(false) {
			return
		}
		m.subMu.Lock()
		defer m.subMu.Unlock()
		var rest []*subscriber
		for _, o := range *to.Load() {
			if o != s {
				rest = append(rest, o)
			}
		}
		to.Store(&rest)
	}
}

// guard asks the guards whether a free may go ahead. Called without m.mu,
// with the pages marked as being freed.
func (m *Memory) guard(l *list, first, n int) error {
	p := m.guards.Load()
	if p == nil {
		return nil
	}
	e := Event{Kind: EventFree, Addr: l.addr(first), Len: uint64(n) * l.pageSize}
	for _, s := range *p {
		if s.live.Load() {
			if err := s.guard(e); err != nil {
				return err
			}
		}
	}
	return nil
}

// deliver calls the subscribers. Called with m.mu held for writing in a
// secondary; in the primary, without it, with m.chMu held for reading.
func (m *Memory) deliver(kind EventKind, l *list, first, n int) {
	p := m.subs.Load()
	if p == nil {
		return
	}
	e := Event{Kind: kind, Addr: l.addr(first), Len: uint64(n) * l.pageSize}
	for _, s := range *p {
		if s.live.Load() {
			s.fn(e)
		}
	}
}

// beginChange and endChange bracket a change of the shared page state in the
// primary (the table's Gen is odd in between), so that a secondary's Resync
// can tell a consistent snapshot from a torn one. Called with m.mu held.
func (m *Memory) beginChange() { atomic.AddUint64(&m.table.Gen, 1) }
func (m *Memory) endChange()   { atomic.AddUint64(&m.table.Gen, 1) }

// Alloc allocates a region of at least size bytes: the first run of free,
// virtually contiguous pages long enough, trying the lists in order. It
// allocates the pages in the backing file first (so a missing hugepage is an
// error now, ErrNoHugepages, and not a SIGBUS at the first touch), maps them
// at base + index*pagesize, marks them allocated in the shared descriptor and
// then delivers EventAlloc. New pages read as zeros. If the mapping fails
// and undoing it leaves a hole that cannot be reserved again, the error
// matches ErrHole and the pages are lost (see Free). Primary only.
func (m *Memory) Alloc(size uint64) (Region, error) {
	if !m.primary {
		return Region{}, fmt.Errorf("hugetlb: alloc: %w", ErrNotPrimary)
	}
	if size == 0 {
		return Region{}, fmt.Errorf("hugetlb: alloc: %w", ErrZeroLength)
	}
	m.chMu.RLock()
	defer m.chMu.RUnlock()
	if m.closed.Load() {
		return Region{}, fmt.Errorf("hugetlb: alloc: %w", ErrClosed)
	}
	m.releaseQuarantine()
	m.mu.Lock()
	l, first, n, err := m.choose(size)
	m.mu.Unlock()
	if err != nil {
		return Region{}, err
	}
	defer func() {
		// Also if a subscriber panics: the pages stay allocated, the
		// caller's to free.
		m.mu.Lock()
		l.allocating.clearRange(first, n)
		m.mu.Unlock()
	}()
	r, err := m.allocPages(l, first, n)
	if err == nil {
		m.deliver(EventAlloc, l, first, n)
	}
	return r, err
}

// choose finds the pages of an Alloc and marks them as being allocated,
// which keeps them from every other Alloc and Free until it returns.
// Called with m.mu held.
func (m *Memory) choose(size uint64) (l *list, first, n int, err error) {
	if m.closed.Load() {
		return nil, 0, 0, fmt.Errorf("hugetlb: alloc: %w", ErrClosed)
	}
	var best struct {
		bytes    uint64
		pages    int
		list     int
		pageSize uint64
	}
	for _, l := range m.lists {
		pages := size / l.pageSize
		if size%l.pageSize != 0 {
			pages++
		}
		n := int(min(pages, uint64(l.pages)+1))
		first, longest := l.freeMask().firstFit(n, l.pages)
		if first >= 0 {
			l.allocating.setRange(first, n)
			return l, first, n, nil
		}
		if b := uint64(longest) * l.pageSize; b > best.bytes || best.pageSize == 0 {
			best.bytes, best.pages, best.list, best.pageSize = b, longest, l.index, l.pageSize
		}
	}
	return nil, 0, 0, fmt.Errorf("hugetlb: alloc %s (%d bytes): %w: the largest free run is %s (%d pages of %s in list %d)%s",
		FormatSize(size), size, ErrNoFreeRun, FormatSize(best.bytes), best.pages, FormatSize(best.pageSize), best.list,
		m.quarantineNote())
}

// quarantineNote says, for an allocation that failed, what the quarantine
// holds and for whom (nothing if it is empty). Called with m.mu held.
func (m *Memory) quarantineNote() string {
	q := m.qpages.Load()
	if q == 0 {
		return ""
	}
	return fmt.Sprintf("; %d freed pages wait in quarantine, keeping their memory, for processes that stopped following memory changes (%s)",
		q, m.holderNames())
}

// holderNames names the processes quarantined pages wait for.
func (m *Memory) holderNames() string {
	seen := map[int]bool{}
	var out []string
	for _, b := range m.quarantine {
		for _, h := range b.holders {
			if !seen[h.PID] {
				seen[h.PID] = true
				out = append(out, fmt.Sprintf("pid %d", h.PID))
			}
		}
	}
	return strings.Join(out, ", ")
}

// allocPages allocates pages [first, first+n) of l, which choose marked
// as being allocated: it allocates their blocks and maps them without the
// memory lock (on tmpfs that writes every byte, seconds for gigabytes,
// and creates of other memory must not wait for it), then records them
// and marks them allocated in the shared descriptor under it.
func (m *Memory) allocPages(l *list, first, n int) (Region, error) {
	r := Region{Addr: l.addr(first), Len: uint64(n) * l.pageSize}
	off := int64(uint64(first) * l.pageSize)
	// Punched first: blocks an earlier life of the pages left behind (a
	// punch that failed, a write through a mapping this process does not
	// know of) would come back with their contents. New pages read as
	// zeros.
	err := falloc.PunchHole(l.fd(), off, int64(r.Len))
	if err == nil {
		err = falloc.Allocate(l.fd(), off, int64(r.Len))
	}
	if err != nil {
		// A partial allocation keeps what it got: give it back.
		_ = falloc.PunchHole(l.fd(), off, int64(r.Len))
		if errors.Is(err, falloc.ErrNoSpace) && l.kind == Hugetlbfs {
			m.mu.Lock()
			note := m.quarantineNote()
			m.mu.Unlock()
			return Region{}, fmt.Errorf("hugetlb: alloc %s in list %d: %w: asked %d pages of %s, %d free%s",
				FormatSize(r.Len), l.index, ErrNoHugepages, n, FormatSize(l.pageSize), freeHugepages(l), note)
		}
		return Region{}, fmt.Errorf("hugetlb: alloc %s in list %d (%s): %w", FormatSize(r.Len), l.index, l.path, err)
	}
	// Populated: the primary registers what it allocates, and pinning
	// would fault every page in anyway (512 a hugepage on tmpfs).
	if err := mapPopulated(r.Addr, uintptr(r.Len), l.fd(), off); err != nil {
		err = fmt.Errorf("hugetlb: alloc %s in list %d: %w", FormatSize(r.Len), l.index, err)
		// A populate that failed has released the range already, and
		// says if that left a hole: then nothing is released over it.
		if !errors.Is(err, vm.ErrHole) {
			if rerr := releaseRange(r.Addr, uintptr(r.Len)); rerr != nil {
				err = fmt.Errorf("%w; undoing it: %w", err, rerr)
			}
		}
		// Still being allocated: no other Alloc or Free has the pages.
		m.mu.Lock()
		m.loseLocked(l, first, n, err)
		m.mu.Unlock()
		_ = falloc.PunchHole(l.fd(), off, int64(r.Len))
		return Region{}, err
	}
	m.mu.Lock()
	m.beginChange()
	l.mapped.setRange(first, n)
	l.state.setRange(first, n)
	atomic.AddUint64(&l.desc.Allocated, uint64(n))
	m.endChange()
	m.mu.Unlock()
	m.debug("pages allocated", l, first, n)
	return r, nil
}

// debug logs a change of pages, costing nothing when debug logging is off.
func (m *Memory) debug(msg string, l *list, first, n int) {
	if m.log.Enabled(context.Background(), slog.LevelDebug) {
		m.log.Debug(msg, "list", l.index, "first", first, "pages", n, "addr", fmt.Sprintf("0x%x", l.addr(first)))
	}
}

// freeHugepages says how many hugepages of l's size an allocation could
// still get: the pool's free pages, or fewer if the mount has a size limit.
func freeHugepages(l *list) uint64 {
	free := uint64(0)
	if p, err := PoolFor(l.pageSize); err == nil {
		free = p.Available()
	}
	var st unix.Statfs_t
	if unix.Fstatfs(l.fd(), &st) == nil && st.Blocks != ^uint64(0) && st.Blocks != 0 {
		free = min(free, st.Bavail)
	}
	return free
}

// Free frees r, any page-aligned part of allocated memory inside one list.
// It first asks the guards (GuardFree): if one refuses, Free changes
// nothing and returns an error matching ErrNotFreed. Otherwise it marks
// the pages as being freed (see Freeing) and delivers EventFree, outside
// the memory lock, while the range is still mapped; then it turns the
// range back into an inaccessible reservation (a later touch faults) and
// marks the pages free in the shared descriptor. The pages themselves go
// back to the kernel (punched out of the backing file; on hugetlbfs to
// the pool) and to the allocator — unless a fenced process may still map them: then they wait in
// quarantine (see GuardFree's neighbour, ReleaseQuarantine, and the
// package's notes on quarantine). If the unmap itself fails, the pages stay
// allocated (the subscribers have already let go of them, which does no
// harm). The one exception to all or nothing: if the unmap left a hole
// it could not reserve again, the pages are freed for every other purpose
// (the subscribers let go of them, the shared state marks them free, the
// queries no longer offer them, their blocks are punched) but lost to
// this process, and the error matches ErrHole: no Alloc hands them out
// again, a Free of them again is a double free, and Close leaves their
// range be (ListInfo.Lost counts them). Primary only.
func (m *Memory) Free(r Region) error {
	if !m.primary {
		return fmt.Errorf("hugetlb: free: %w", ErrNotPrimary)
	}
	if r.Len == 0 {
		return fmt.Errorf("hugetlb: free [0x%x, +0): %w", r.Addr, ErrZeroLength)
	}
	m.chMu.RLock()
	defer m.chMu.RUnlock()
	l, first, n, err := m.takeForFree(r)
	if err != nil {
		return err
	}
	// Outside the memory lock: the subscribers may wait for secondaries
	// to unmap the pages, and creates of other memory go on meanwhile.
	delivered := false
	defer func() {
		if !delivered { // a subscriber panicked: the pages stay allocated
			m.mu.Lock()
			l.freeing.clearRange(first, n)
			m.mu.Unlock()
		}
	}()
	m.deliver(EventFree, l, first, n)
	delivered = true
	quarantined, err := m.unmapFreed(l, first, n)
	if err != nil && !errors.Is(err, ErrHole) {
		return err
	}
	lostErr := err // freed all the same; said once the blocks are punched
	var punchErr error
	if !quarantined {
		// Without the memory lock (seconds for gigabytes on tmpfs); the
		// pages stay out of the allocator until it is done.
		punchErr = falloc.PunchHole(l.fd(), int64(uint64(first)*l.pageSize), int64(r.Len))
		m.mu.Lock()
		l.freeing.clearRange(first, n)
		m.mu.Unlock()
	}
	m.debug("pages freed", l, first, n)
	if punchErr != nil {
		// The pages are unmapped and free; only their blocks linger.
		punchErr = fmt.Errorf("hugetlb: free: the memory is free but its blocks were not returned: %w", punchErr)
		if lostErr != nil {
			return fmt.Errorf("%w; %w", lostErr, punchErr)
		}
		return punchErr
	}
	return lostErr
}

// loseLocked marks pages [first, first+n) of l lost if err, a failed
// release of them, says it left a hole it could not reserve again
// (vm.ErrHole): part of the range may hold another mapping of the
// process by now, which any later mapping or unmapping of the pages
// would replace. The whole range is lost, since what part is not known.
// Called with m.mu held.
func (m *Memory) loseLocked(l *list, first, n int, err error) (lost bool) {
	if !errors.Is(err, vm.ErrHole) {
		return false
	}
	l.lost.setRange(first, n)
	l.lostPages.Store(int64(l.lost.count(l.pages)))
	m.log.Error("hugetlb: pages lost: a failed unmap left their range unmapped and it could not be reserved again; "+
		"they are never mapped, unmapped or allocated again", "list", l.index, "first", first, "pages", n,
		"addr", fmt.Sprintf("%#x", l.addr(first)), "err", err)
	return true
}

// unmapFreed unmaps a Free's pages here (without m.mu: tearing down the
// page tables of gigabytes takes a while) and marks them free in the
// shared descriptor, under m.mu. Pages a fenced process may still map go
// into quarantine; the others stay marked as being freed, for the caller
// to punch. If the unmap fails, nothing changes but the mark, which goes
// (vm.Release reserves again a range a failed unmap left empty, and
// counts that as done). If it leaves a hole it cannot reserve again
// (vm.ErrHole), the pages are lost here (see loseLocked) but freed for
// every other purpose, as after an unmap, and the error says so.
func (m *Memory) unmapFreed(l *list, first, n int) (quarantined bool, err error) {
	err = releaseRange(l.addr(first), uintptr(uint64(n)*l.pageSize))
	m.mu.Lock()
	defer m.mu.Unlock()
	if err != nil {
		err = fmt.Errorf("hugetlb: free: %w", err)
		if !m.loseLocked(l, first, n, err) {
			l.freeing.clearRange(first, n)
			return false, err
		}
	}
	m.beginChange()
	defer m.endChange()
	l.mapped.clearRange(first, n)
	// Lost pages are never handed out again: no quarantine to keep them
	// from the fenced processes' successors; their blocks go now.
	if holders := m.holdersLocked(); len(holders) > 0 && err == nil {
		m.quarantineLocked(l, first, n, holders)
		l.freeing.clearRange(first, n)
		quarantined = true
	}
	l.state.clearRange(first, n)
	atomic.AddUint64(&l.desc.Allocated, -uint64(n))
	return quarantined, err
}

// takeForFree checks a Free and marks the pages as being freed, under
// m.mu, then asks the guards without it: from the mark on no create
// registers the pages (a create of them waits for the guards' answer, see
// Freeing), and a guard's work (deregistering the MRs of gigabytes) holds
// no create of other memory up. If a guard refuses, the mark goes and
// nothing else has changed.
func (m *Memory) takeForFree(r Region) (*list, int, int, error) {
	l, first, n, err := m.markFreeing(r)
	if err != nil {
		return nil, 0, 0, err
	}
	refused := true // until the guards let it go ahead; a guard that panics refuses
	defer func() {
		m.mu.Lock()
		l.guarding.clearRange(first, n)
		if refused {
			l.freeing.clearRange(first, n)
		}
		close(m.decided)
		m.decided = make(chan struct{})
		m.mu.Unlock()
	}()
	if err := m.guard(l, first, n); err != nil {
		return nil, 0, 0, fmt.Errorf("hugetlb: free [0x%x, 0x%x): %w: %w", r.Addr, r.End(), ErrNotFreed, err)
	}
	refused = false
	return l, first, n, nil
}

// markFreeing is takeForFree's part under m.mu.
func (m *Memory) markFreeing(r Region) (l *list, first, n int, err error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed.Load() {
		return nil, 0, 0, fmt.Errorf("hugetlb: free: %w", ErrClosed)
	}
	l, first, n, err = m.locate(r)
	if err != nil {
		return nil, 0, 0, fmt.Errorf("hugetlb: free [0x%x, 0x%x): %w", r.Addr, r.Addr+uintptr(r.Len), err)
	}
	for _, c := range []struct {
		pages bitmap
		set   bool
		is    string
	}{{l.mapped, false, "free"}, {l.freeing, true, "being freed"}, {l.allocating, true, "being allocated"}} {
		if i := c.pages.next(first, first+n, c.set); i < first+n { // its own record, not the shared state
			is := c.is
			if l.lost.get(i) {
				is = "free, and lost to a failed unmap"
			}
			return nil, 0, 0, fmt.Errorf("hugetlb: free [0x%x, 0x%x): %w: page %d of list %d at 0x%x is %s",
				r.Addr, r.End(), ErrDoubleFree, i, l.index, l.addr(i), is)
		}
	}
	l.freeing.setRange(first, n)
	l.guarding.setRange(first, n)
	if m.decided == nil {
		m.decided = make(chan struct{})
	}
	return l, first, n, nil
}

// locate maps a range to its list and pages.
func (m *Memory) locate(r Region) (l *list, first, n int, err error) {
	for _, c := range m.lists {
		if r.Addr >= c.base && r.Addr < c.end() {
			l = c
			break
		}
	}
	if l == nil {
		return nil, 0, 0, ErrForeign
	}
	if r.Len > uint64(l.end()-r.Addr) {
		return nil, 0, 0, fmt.Errorf("%w: runs past the end of list %d at 0x%x", ErrForeign, l.index, l.end())
	}
	if uint64(r.Addr-l.base)%l.pageSize != 0 || r.Len%l.pageSize != 0 {
		return nil, 0, 0, fmt.Errorf("%w: list %d has %s pages", ErrUnaligned, l.index, FormatSize(l.pageSize))
	}
	return l, int(uint64(r.Addr-l.base) / l.pageSize), int(r.Len / l.pageSize), nil
}

// pages checks a page range of a list given by index.
func (m *Memory) pages(list, first, n int) (*list, error) {
	if list < 0 || list >= len(m.lists) {
		return nil, fmt.Errorf("%w: no list %d", ErrForeign, list)
	}
	l := m.lists[list]
	if n <= 0 {
		return nil, ErrZeroLength
	}
	if first < 0 || first >= l.pages || n > l.pages-first {
		return nil, fmt.Errorf("%w: pages [%d, %d) of list %d, which has %d", ErrForeign, first, first+n, list, l.pages)
	}
	return l, nil
}

// MapPages maps pages [first, first+n) of a list in this secondary, after
// the primary allocated them, and delivers EventAlloc for the pages that
// were not mapped here yet. Mapping pages that are mapped already is
// harmless. The pages must be allocated in the shared descriptor
// (ErrNotAllocated otherwise). If the mapping fails, whatever the kernel
// left in the range (what was there, a hole, the file mapped without its
// DONTFORK mark), the range is unmapped, as UnmapPages leaves it, with
// EventFree for the pages that were mapped; they may no longer be
// readable when the subscribers hear of it. If that unmap fails too (as
// both do at the limit of the process's mappings, vm.max_map_count,
// where the kernel changes nothing), the pages stay counted as they were
// and those mapped are announced again with EventAlloc. Lost pages (see
// UnmapPages) are left as they are: it fails with ErrHole once the others
// are mapped. Secondary only.
func (m *Memory) MapPages(list, first, n int) error {
	if m.primary {
		return fmt.Errorf("hugetlb: map pages: %w", ErrNotSecondary)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed.Load() {
		return fmt.Errorf("hugetlb: map pages: %w", ErrClosed)
	}
	l, err := m.pages(list, first, n)
	if err != nil {
		return fmt.Errorf("hugetlb: map pages: %w", err)
	}
	if i := l.state.next(first, first+n, false); i < first+n {
		return fmt.Errorf("hugetlb: map pages [%d, %d) of list %d: %w: page %d is free",
			first, first+n, list, ErrNotAllocated, i)
	}
	return m.mapRun(l, first, n)
}

// mapFile and releaseRange are vm.MapFile and vm.Release (in both roles),
// mapPopulated vm.MapFilePopulated (an Alloc's); variables for tests,
// which make them fail.
var mapFile, releaseRange, mapPopulated = vm.MapFile, vm.Release, vm.MapFilePopulated

// mapRun maps pages of l here and announces the newly mapped ones. Called
// with m.mu held.
//
// A mapping that fails may leave its range in any state: what was mapped
// there still mapped, nothing mapped at all (a MAP_FIXED that removed the
// old mapping first, on kernels before 6.12: a hole any other mapping of
// the process could take, which a later unmap of the pages would then
// destroy), or the file mapped without DONTFORK (a mark that failed, and
// its undo too). The range goes back to an inaccessible reservation, as
// after an unmap, the pages that were mapped announced as freed first;
// they may no longer be readable when the subscribers hear of it. If
// that release fails too, as both do at the limit of the process's
// mappings (vm.max_map_count: each splits the reservation), something
// is most likely still mapped there (a failed release reserves a hole
// again, and says vm.ErrHole if it cannot) and the kernel has changed
// nothing: the pages stay counted as they were, and those mapped are
// announced again.
//
// Lost pages (see list.lost) are left as they are, and make it fail with
// ErrHole once the others are mapped.
func (m *Memory) mapRun(l *list, first, n int) error {
	return l.aroundLost(first, n, "map", m.mapPlain)
}

// mapPlain is mapRun for pages none of which is lost.
func (m *Memory) mapPlain(l *list, first, n int) error {
	if err := mapFile(l.addr(first), uintptr(uint64(n)*l.pageSize), l.fd(), int64(uint64(first)*l.pageSize)); err != nil {
		err = fmt.Errorf("hugetlb: map pages [%d, %d) of list %d: %w", first, first+n, l.index, err)
		if uerr := m.unmapPlain(l, first, n); uerr != nil {
			eachRun(l.mapped, first, first+n, true, func(a, b int) { m.deliver(EventAlloc, l, a, b-a) })
			return fmt.Errorf("%w; undoing it: %w", err, uerr)
		}
		return err
	}
	var fresh [][2]int
	eachRun(l.mapped, first, first+n, false, func(a, b int) { fresh = append(fresh, [2]int{a, b}) })
	l.mapped.setRange(first, n)
	for _, r := range fresh {
		m.deliver(EventAlloc, l, r[0], r[1]-r[0])
	}
	return nil
}

// UnmapPages turns pages [first, first+n) of a list back into an
// inaccessible reservation in this secondary, so that a touch faults
// instead of reaching memory the primary freed. It delivers EventFree for
// the pages mapped here before it unmaps them. Unmapping pages that are not
// mapped is harmless. If the unmap leaves a hole it could not reserve
// again (ErrHole), the pages are lost: counted as not mapped, and never
// mapped or unmapped here again (MapPages, UnmapPages and Resync fail
// with ErrHole on them, after dealing with the others), nor at Close.
// Secondary only.
func (m *Memory) UnmapPages(list, first, n int) error {
	if m.primary {
		return fmt.Errorf("hugetlb: unmap pages: %w", ErrNotSecondary)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed.Load() {
		return fmt.Errorf("hugetlb: unmap pages: %w", ErrClosed)
	}
	l, err := m.pages(list, first, n)
	if err != nil {
		return fmt.Errorf("hugetlb: unmap pages: %w", err)
	}
	return m.unmapRun(l, first, n)
}

// unmapRun announces and unmaps pages of l here. Lost pages (see
// list.lost) are left as they are, and make it fail with ErrHole once the
// others are unmapped. Called with m.mu held.
func (m *Memory) unmapRun(l *list, first, n int) error {
	return l.aroundLost(first, n, "unmap", m.unmapPlain)
}

// unmapPlain is unmapRun for pages none of which is lost. If the release
// leaves a hole it could not reserve again, the pages are lost, and count
// as not mapped here (they were announced as freed).
func (m *Memory) unmapPlain(l *list, first, n int) error {
	eachRun(l.mapped, first, first+n, true, func(a, b int) { m.deliver(EventFree, l, a, b-a) })
	if err := releaseRange(l.addr(first), uintptr(uint64(n)*l.pageSize)); err != nil {
		if m.loseLocked(l, first, n, err) {
			l.mapped.clearRange(first, n)
		}
		return fmt.Errorf("hugetlb: unmap pages [%d, %d) of list %d: %w", first, first+n, l.index, err)
	}
	l.mapped.clearRange(first, n)
	return nil
}

// aroundLost runs fn on each run of pages of [first, first+n) that is not
// lost, and, if some are, fails with ErrHole after them (with fn's
// errors, if any).
func (l *list) aroundLost(first, n int, what string, fn func(l *list, first, n int) error) error {
	i := l.lost.next(first, first+n, true)
	if i == first+n {
		return fn(l, first, n) // the common case: nothing lost
	}
	err := fmt.Errorf("hugetlb: %s pages [%d, %d) of list %d: %w: page %d at 0x%x was lost to a failed unmap",
		what, first, first+n, l.index, ErrHole, i, l.addr(i))
	eachRun(l.lost, first, first+n, false, func(a, b int) { err = joined(err, fn(l, a, b-a)) })
	return err
}

// joined is a and b in one error, on one line (either may be nil).
func joined(a, b error) error {
	switch {
	case a == nil:
		return b
	case b == nil:
		return a
	}
	return fmt.Errorf("%w; %w", a, b)
}

// eachRun calls fn(a, b) for each maximal run [a, b) inside [from, to) whose
// bits in b equal set.
func eachRun(bm bitmap, from, to int, set bool, fn func(a, b int)) {
	for i := from; i < to; {
		a := bm.next(i, to, set)
		if a == to {
			return
		}
		b := bm.next(a, to, !set)
		fn(a, b)
		i = b
	}
}

// Resync brings this secondary's mappings in line with the shared
// descriptors: it maps every allocated page and unmaps every free one,
// delivering events for what changes, but for lost pages (see
// UnmapPages), which make it fail with ErrHole once every other page of
// every list is dealt with; so does any other failure. It retries while
// the primary is in the middle of a change. Secondary only.
func (m *Memory) Resync() error {
	if m.primary {
		return fmt.Errorf("hugetlb: resync: %w", ErrNotSecondary)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed.Load() {
		return fmt.Errorf("hugetlb: resync: %w", ErrClosed)
	}
	return m.resyncLocked()
}

// resyncTimeout bounds how long Resync waits for the primary to finish a
// change; only a primary that died halfway through one makes it wait so
// long. A variable for tests.
var resyncTimeout = 5 * time.Second

// resyncOpen, when set (by tests), runs each time Resync finds a change
// open, before it judges its wait: where its process may stop.
var resyncOpen atomic.Pointer[func()]

// resyncLocked takes a consistent snapshot of the page state (Gen even and
// unchanged around it), applies it, and starts over if the primary changed
// something meanwhile. Called with m.mu held for writing.
func (m *Memory) resyncLocked() error {
	var deadline time.Time
	last := false // the look after the deadline
	for try := 0; ; try++ {
		gen := atomic.LoadUint64(&m.table.Gen)
		if gen&1 == 0 {
			snaps := make([]bitmap, len(m.lists))
			for i, l := range m.lists {
				snaps[i] = l.state.snapshot()
			}
			if atomic.LoadUint64(&m.table.Gen) == gen {
				var failed error // a list that fails does not stop the others
				for i, l := range m.lists {
					failed = joined(failed, m.apply(l, snaps[i]))
				}
				if failed != nil {
					return fmt.Errorf("hugetlb: resync: %w", failed)
				}
				if atomic.LoadUint64(&m.table.Gen) == gen {
					return nil
				}
			}
		}
		// The primary is changing pages: give it time, up to a point.
		if hook := resyncOpen.Load(); hook != nil {
			(*hook)()
		}
		switch {
		case try == 0:
			deadline = time.Now().Add(resyncTimeout)
		case time.Now().After(deadline) && last:
			return fmt.Errorf("hugetlb: resync: the primary kept changing pages for %v (did it die during a change?)", resyncTimeout)
		case time.Now().After(deadline):
			// Once more: this process may not have run between its look
			// and the deadline (stopped, traced, starved of CPU), and the
			// primary may have ended the change meanwhile.
			last = true
		case try < 16:
			runtime.Gosched()
		default:
			time.Sleep(min(time.Duration(try)*10*time.Microsecond, time.Millisecond))
		}
	}
}

// apply maps and unmaps l's pages here so that they match want. A run
// that fails does not stop the others: what can be unmapped is.
func (m *Memory) apply(l *list, want bitmap) (failed error) {
	for i := 0; i < l.pages; {
		w := i >> 6
		diff := (want[w] ^ atomic.LoadUint64(&l.mapped[w])) &^ (1<<(uint(i)&63) - 1)
		if diff == 0 {
			i = (w + 1) << 6
			continue
		}
		i = w<<6 + bits.TrailingZeros64(diff)
		if i >= l.pages {
			break
		}
		set := want.get(i)
		j := i + 1
		for j < l.pages && want.get(j) == set && l.mapped.get(j) != set {
			j++
		}
		var err error
		if set {
			err = m.mapRun(l, i, j-i)
		} else {
			err = m.unmapRun(l, i, j-i)
		}
		failed = joined(failed, err)
		i = j
	}
	return failed
}
