package hugetlb

import (
	"fmt"
	"slices"
	"sync/atomic"
	"time"

	"github.com/mpmr/mpmr/internal/sys/falloc"
	"github.com/mpmr/mpmr/shm"
)

// Quarantine.
//
// A page may go back to the allocator (and, on hugetlbfs, to the kernel)
// only when no live process can still reach it. Secondaries unmap freed
// pages before Free returns, because the primary has them follow every
// change; but a secondary that is alive and does not answer (stopped by a
// signal, a debugger, a slow tool) cannot be made to. The process that keeps
// secondaries in step then fences it in the process table (shm.Segment.Fence)
// instead of waiting for ever. From then on, until the fenced process is dead
// or, by the kernel's word, neither maps nor holds open a backing file (see
// reach.go; where the kernel will not say, until it dies or lets its slot
// go), every page the primary frees is quarantined: unmapped in the primary,
// marked free in the shared descriptors (so no process maps it anew), but
// neither punched out of its backing file nor handed to Alloc. The fenced
// process might still map it; whatever it writes there stays there, and
// nobody else ever sees it. Without this, the stalled process, once
// resumed, would touch a page the primary had punched out, the kernel would
// give the file a fresh page at that offset, and the primary's next Alloc
// would map that same page: shared with the stale process, not zeroed.
//
// Every page freed while any fenced process lives is quarantined, not only
// those it mapped when it was fenced: a process that stopped listening
// cannot be trusted about what it maps. ReleaseQuarantine (also run by every
// Alloc) returns the pages whose holders have all gone.

// batch is a run of quarantined pages and the processes it waits for.
type batch struct {
	list    *list
	first   int
	n       int
	holders []shm.Proc
}

// GuardFree registers fn to be consulted by Free before it changes
// anything: an error refuses the free (Free then returns it, wrapped with
// ErrNotFreed, with the memory still allocated and mapped). Guards run in
// registration order, on Free's goroutine, without the memory lock but
// with the pages marked as being freed (see Freeing): no create comes to
// refer to them from then on, and no other Alloc or Free takes them. fn
// must not call Alloc, Free, ReleaseQuarantine, HoldChanges or Close; it
// may call the queries, RLock, and take the cache's locks. Guards run
// before the subscribers' EventFree; those of different frees may run at
// once. The returned function cancels the guard. Primary only: a
// secondary never frees.
func (m *Memory) GuardFree(fn func(Event) error) (cancel func()) {
	return m.subscribe(&m.guards, func(Event) {}, fn)
}

// holdersLocked returns the processes pages freed now must wait for: those
// fenced and alive. Whether they still reach data memory is asked later,
// outside the lock (see ReleaseQuarantine).
func (m *Memory) holdersLocked() []shm.Proc { return m.seg.Holders() }

// quarantineLocked keeps pages [first, first+n) of l away from the
// allocator and the kernel until every holder has gone. Called with m.mu
// held, after the pages were unmapped here.
func (m *Memory) quarantineLocked(l *list, first, n int, holders []shm.Proc) {
	l.held.setRange(first, n)
	l.heldPages += n
	m.quarantine = append(m.quarantine, batch{list: l, first: first, n: n, holders: holders})
	m.qpages.Add(int64(n))
	pids := make([]int, len(holders))
	for i, h := range holders {
		pids[i] = h.PID
	}
	m.log.Warn("freed pages quarantined: processes that stopped following memory changes may still map them",
		"list", l.index, "first", first, "pages", n, "addr", fmt.Sprintf("0x%x", l.addr(first)), "pids", pids)
}

// Quarantined returns how many freed pages wait in quarantine.
func (m *Memory) Quarantined() int { return int(m.qpages.Load()) }

// ReleaseQuarantine asks the kernel whether each fenced process still
// reaches data memory, ends the fences of those that do not, then returns
// to the allocator (punching them out of their backing files) the
// quarantined pages whose holders are all gone, and reports how many it
// released. Primary only. The questions to the kernel are asked without
// the memory lock: a process that is slow to describe blocks only this
// call.
func (m *Memory) ReleaseQuarantine() int {
	if m.closed.Load() {
		return 0
	}
	m.ask(m.seg.Holders(), time.Time{})
	return m.releaseGone(true)
}

// Housekeep is ReleaseQuarantine for a caller that runs it often (the
// primary's runtime, every few milliseconds), and must not wait on the
// kernel: the pages of a holder that died go back at once, while the
// questions about live holders run on a goroutine of their own, one round
// at a time (a process the kernel is slow to describe holds up only the
// next round), and a holder that still reaches data memory is asked again
// only after a while, doubling from askFirst to askMost, since reading a
// large process's maps costs milliseconds and a process stopped in a
// debugger may stay stopped for hours.
func (m *Memory) Housekeep(now time.Time) int {
	if m.closed.Load() {
		return 0
	}
	if holders := m.seg.Holders(); len(holders) > 0 && m.asking.CompareAndSwap(false, true) {
		m.fileIDs() // while the files are open
		m.askWG.Add(1)
		go func() {
			defer m.askWG.Done()
			defer m.asking.Store(false)
			m.ask(holders, now)
		}()
	}
	return m.releaseGone(false)
}

// askWait bounds how long Close waits for a round of Housekeep's questions:
// one the kernel cannot answer (a process stuck in the kernel holding its
// memory map) must not keep the primary from closing.
const askWait = 2 * time.Second

// waitAsking waits up to d for a round of Housekeep's questions to end.
func (m *Memory) waitAsking(d time.Duration) {
	done := make(chan struct{})
	go func() { m.askWG.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(d):
		m.log.Warn("closing while the kernel has not answered a question about a fenced process", "waited", d)
	}
}

const (
	askFirst = 20 * time.Millisecond
	askMost  = time.Second
)

// holderKey names a fence (see shm.Proc.SameHolder).
type holderKey struct {
	pid   int
	start uint64
	slot  int
}

// askState is when a holder that still reached data memory is asked again.
type askState struct {
	next  time.Time
	every time.Duration
}

// ask ends the fences of holders that reach no data memory any more: all
// of them (now zero), or those due by now. It touches no shared memory:
// Housekeep runs it on a goroutine that may outlive the segment's mapping.
func (m *Memory) ask(holders []shm.Proc, now time.Time) {
	m.askMu.Lock()
	due := holders[:0:0]
	kept := make(map[holderKey]askState, len(holders)) // schedules of holders that died go
	for _, h := range holders {
		k := holderKey{h.PID, h.Start, h.Slot}
		st, seen := m.asked[k]
		if seen {
			kept[k] = st
		}
		if !seen || now.IsZero() || !now.Before(st.next) {
			due = append(due, h)
		}
	}
	m.asked = kept
	m.askMu.Unlock()
	for _, h := range due {
		k := holderKey{h.PID, h.Start, h.Slot}
		if !m.mayReach(h) {
			m.seg.Forget(h)
			m.askMu.Lock()
			delete(m.asked, k)
			m.askMu.Unlock()
			continue
		}
		m.askMu.Lock()
		st := m.asked[k]
		st.every = min(max(2*st.every, askFirst), askMost)
		st.next = now.Add(st.every)
		m.asked[k] = st
		m.askMu.Unlock()
	}
}

// releaseGone returns the quarantined pages whose holders are all gone.
// Without wait it releases nothing if the memory changes are held back
// (a hello or Close waits for a change under way, which may wait for a
// stalled secondary): Housekeep comes again soon, and the rest of the
// primary's housekeeping must not wait meanwhile.
func (m *Memory) releaseGone(wait bool) int {
	if m.qpages.Load() == 0 {
		return 0
	}
	// Close does not release the files under the punches.
	if !wait {
		if !m.chMu.TryRLock() {
			return 0
		}
	} else {
		m.chMu.RLock()
	}
	defer m.chMu.RUnlock()
	return m.releaseQuarantine()
}

// releaseQuarantine returns to the allocator the quarantined pages whose
// holders are all gone: it takes them out of the quarantine under m.mu,
// punches them out of their backing files without it (they stay out of
// the allocator meanwhile), and gives them back under it. One release
// runs at a time: an Alloc that comes during another's punches waits for
// them, and finds the pages free. Called with m.chMu held for reading.
func (m *Memory) releaseQuarantine() int {
	if m.qpages.Load() == 0 {
		return 0
	}
	m.relMu.Lock()
	defer m.relMu.Unlock()
	m.mu.Lock()
	var gone []batch
	if !m.closed.Load() {
		now := m.seg.Holders()
		keep := m.quarantine[:0]
		for _, b := range m.quarantine {
			if stillHeld(b.holders, now) {
				keep = append(keep, b)
			} else {
				gone = append(gone, b)
			}
		}
		clear(m.quarantine[len(keep):])
		m.quarantine = keep
	}
	m.mu.Unlock()
	if len(gone) == 0 {
		return 0
	}
	for _, b := range gone {
		l := b.list
		if err := falloc.PunchHole(l.fd(), int64(uint64(b.first)*l.pageSize), int64(uint64(b.n)*l.pageSize)); err != nil {
			// The pages are no use to anyone; only their blocks linger
			// (Alloc punches before it allocates).
			m.log.Error("quarantined pages released, but their blocks were not returned", "list", l.index, "err", err)
		}
	}
	released := 0
	m.mu.Lock()
	for _, b := range gone {
		l := b.list
		l.held.clearRange(b.first, b.n)
		l.heldPages -= b.n
		released += b.n
		m.log.Info("quarantined pages released", "list", l.index, "first", b.first, "pages", b.n)
	}
	m.qpages.Add(-int64(released))
	m.mu.Unlock()
	return released
}

// stillHeld reports whether any of holders is still fenced: alive, and not
// yet found to reach nothing.
func stillHeld(holders, now []shm.Proc) bool {
	for _, h := range holders {
		if slices.ContainsFunc(now, h.SameHolder) {
			return true
		}
	}
	return false
}

// freeMask returns what the allocator must treat as taken in l: the
// allocated pages, the quarantined ones, and those an Alloc or a Free
// works on without the memory lock. The
// allocated pages are the ones the primary mapped, by its own record: the
// shared page state is any process's to rewrite, and a page marked free
// there must not be handed out twice. Called with m.mu held.
func (l *list) freeMask() bitmap {
	b := l.mapped.snapshot()
	for i := range b {
		// Quarantined, being allocated, being freed (until punched), and
		// lost.
		b[i] |= atomic.LoadUint64(&l.held[i]) | l.allocating[i] | l.freeing[i] | l.lost[i]
	}
	return b
}
