package hugetlb

import "sync/atomic"

// The queries read the shared descriptors without taking the memory lock,
// so event callbacks may call them. After Close they report nothing; one
// under way when Close comes finishes first. Each answer is consistent in itself; to keep
// several answers consistent with each other, hold RLock (or ask from an
// event callback). In a secondary they describe what the primary has
// allocated, which the secondary maps once the primary tells it to.

// Page is one allocated page.
type Page struct {
	List  int
	Index int     // index of the page in its list
	Addr  uintptr // first byte of the page
	Size  uint64  // page size
}

// PageOf returns the page holding addr. It reports false for an address
// outside every list and also for one in a page that is reserved but not
// allocated: like rte_mem_virt2memseg, it only knows live pages. Use InList
// to ask whether an address is inside a list at all.
func (m *Memory) PageOf(addr uintptr) (Page, bool) {
	m.qmu.RLock()
	defer m.qmu.RUnlock()
	l, i, ok := m.find(addr)
	if !ok || !l.state.get(i) {
		return Page{}, false
	}
	return Page{List: l.index, Index: i, Addr: l.addr(i), Size: l.pageSize}, true
}

// Run is a maximal run of allocated, virtually contiguous pages of one list:
// what the MR cache registers as one chunk.
type Run struct {
	List       int
	First      int // index of the first page
	Pages      int
	Start, End uintptr // [Start, End)
	PageSize   uint64
}

func (l *list) run(first, end int) Run {
	return Run{List: l.index, First: first, Pages: end - first, Start: l.addr(first), End: l.addr(end), PageSize: l.pageSize}
}

// ContigRun returns the run of allocated pages that contains addr, the
// contiguous walk of DPDK (rte_memseg_contig_walk stopping at the
// chunk around an address). It reports false if addr is not in an
// allocated page. Pages of separate allocations that happen to be adjacent
// form one run.
func (m *Memory) ContigRun(addr uintptr) (Run, bool) {
	m.qmu.RLock()
	defer m.qmu.RUnlock()
	l, i, ok := m.find(addr)
	if !ok || !l.state.get(i) {
		return Run{}, false
	}
	return l.run(l.state.prevClear(i)+1, l.state.next(i, l.pages, false)), true
}

// Runs calls fn for every run of allocated pages, list by list in address
// order, until fn returns false. It can be ranged over:
//
//	for r := range m.Runs { ... }
func (m *Memory) Runs(fn func(Run) bool) {
	for li, i := 0, 0; ; {
		r, ok := m.nextRun(&li, &i)
		if !ok || !fn(r) {
			return
		}
	}
}

// nextRun returns the first run of allocated pages from page i of list li
// on, and moves li and i past it. It reports false when there is none, or
// the memory is closed. fn is not called under qmu: it may query too.
func (m *Memory) nextRun(li, i *int) (Run, bool) {
	m.qmu.RLock()
	defer m.qmu.RUnlock()
	if m.closed.Load() {
		return Run{}, false
	}
	for ; *li < len(m.lists); *li, *i = *li+1, 0 {
		l := m.lists[*li]
		if a := l.state.next(*i, l.pages, true); a < l.pages {
			*i = l.state.next(a, l.pages, false)
			return l.run(a, *i), true
		}
	}
	return Run{}, false
}

// Mapped reports whether every page of [addr, addr+length) is mapped in
// this process, as the process itself knows, not as the shared page state
// says now (any process mapping the segment can write it): in the
// primary, the pages it allocated; in a secondary, those it mapped
// following the primary's changes, which at attach or after a resync are
// what the shared state said then. Use it to check an address read from
// shared memory before touching it.
func (m *Memory) Mapped(addr uintptr, length uint64) bool {
	end := uint64(addr) + length
	if length == 0 || end < uint64(addr) {
		return false
	}
	m.qmu.RLock()
	defer m.qmu.RUnlock()
	l, first, ok := m.find(addr)
	if !ok || end > uint64(l.end()) {
		return false
	}
	last := int((end - 1 - uint64(l.base)) / l.pageSize)
	return l.mapped.next(first, last+1, false) > last
}

// InList reports which list's reserved range holds addr, allocated or not.
func (m *Memory) InList(addr uintptr) (list int, ok bool) {
	m.qmu.RLock()
	defer m.qmu.RUnlock()
	l, _, ok := m.find(addr)
	if !ok {
		return -1, false
	}
	return l.index, true
}

func (m *Memory) find(addr uintptr) (*list, int, bool) {
	if m.closed.Load() {
		return nil, 0, false
	}
	for _, l := range m.lists {
		if addr >= l.base && addr < l.end() {
			return l, int(uint64(addr-l.base) / l.pageSize), true
		}
	}
	return nil, 0, false
}

// ListInfo is the accounting of one memseg list.
type ListInfo struct {
	Index    int     `json:"index"`
	Base     uintptr `json:"base"`
	End      uintptr `json:"end"` // first address past the reserved range
	PageSize uint64  `json:"page_size"`
	Backend  Kind    `json:"backend"`
	File     string  `json:"file"` // backing file

	// Pages.
	Capacity  int `json:"capacity"`
	Allocated int `json:"allocated"` // allocated by the primary
	Free      int `json:"free"`
	Mapped    int `json:"mapped"` // mapped in this process (a secondary lags the primary until it syncs)
	// LargestFree is the longest run of free pages: the largest
	// allocation the list can still serve.
	LargestFree int `json:"largest_free"`

	// Quarantined pages are free but wait until no fenced process may map
	// them any more (primary only; see ReleaseQuarantine); they count as
	// free above but are not in LargestFree.
	Quarantined int `json:"quarantined"`
	// Lost pages are never mapped or unmapped again by this process: a
	// failed unmap left their range to whatever other mapping of the
	// process takes it (see ErrHole). In the primary they are free but
	// never allocated again, and not in LargestFree.
	Lost int `json:"lost,omitempty"`
	// The same in bytes.
	CapacityBytes  uint64 `json:"capacity_bytes"`
	AllocatedBytes uint64 `json:"allocated_bytes"`
	FreeBytes      uint64 `json:"free_bytes"`
}

// Lists returns the accounting of every list (nil after Close).
func (m *Memory) Lists() []ListInfo {
	m.qmu.RLock()
	defer m.qmu.RUnlock()
	if m.closed.Load() {
		return nil
	}
	out := make([]ListInfo, len(m.lists))
	for i, l := range m.lists {
		alloc := int(min(atomic.LoadUint64(&l.desc.Allocated), uint64(l.pages)))
		taken, held, lost := l.state, 0, int(l.lostPages.Load())
		if m.primary {
			if held = l.held.count(l.pages); held > 0 || lost > 0 {
				taken = l.state.snapshot()
				for i := range taken {
					taken[i] |= atomic.LoadUint64(&l.held[i]) | atomic.LoadUint64(&l.lost[i])
				}
			}
		}
		_, longest := taken.firstFit(l.pages+1, l.pages)
		mapped := l.mapped.count(l.pages)
		out[i] = ListInfo{
			Index: l.index, Base: l.base, End: l.end(), PageSize: l.pageSize, Backend: l.kind, File: l.path,
			Capacity: l.pages, Allocated: alloc, Free: l.pages - alloc, Mapped: mapped, LargestFree: longest,
			Quarantined:    held,
			Lost:           lost,
			CapacityBytes:  l.size(),
			AllocatedBytes: uint64(alloc) * l.pageSize,
			FreeBytes:      uint64(l.pages-alloc) * l.pageSize,
		}
	}
	return out
}
