package shm

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"runtime"
	"slices"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/mpmr/mpmr/internal/sys/futex"
)

// RWLock is a process-shared reader-writer lock that lives in a segment and
// survives the death or the stall of any process holding it.
//
// Readers count themselves on their process's own cache line (one line per
// process-table slot), so readers in different processes never write the
// same line. A writer claims the owner word with its slot and the slot's
// epoch, which stops new readers, then waits for every slot's count to
// drain. The lock is writer-preferring: once a writer holds the word,
// readers wait, so a stream of readers cannot starve it.
//
// Owners are named for good: the owner word carries the epoch of the
// writer's process-table slot, which every claim of the slot bumps, so a new
// process that claims a dead writer's slot never makes the dead writer look
// alive, and a takeover's compare-and-swap cannot succeed against a word
// that a later claimant of the same slot wrote.
//
// Robustness:
//   - A process that dies holding read locks leaves a count behind. A
//     waiting writer looks at the slot's liveness every few milliseconds
//     while it waits and discards the count of a dead slot, so it proceeds
//     within a bounded time of the death.
//   - A process that is alive but stalled in a read section (stopped by a
//     signal, a debugger, a slow tool) is fenced: a writer waits for live
//     readers at most FenceAfter, then discards their holds and goes ahead.
//     The fenced reader learns it when it calls RUnlock, which returns
//     ErrFenced: what it read may be torn and must be thrown away. A read
//     section may therefore only load words with sync/atomic, check what it
//     reads against the segment's bounds, and act on it only after RUnlock
//     returned nil — exactly what an optimistic read requires, with the read
//     hold only making writers wait politely for a short while. So no
//     reader can hold up a writer for longer than FenceAfter.
//   - A process that dies holding the write lock leaves its mark in the
//     owner word. The next Lock takes the lock over and returns
//     ErrOwnerDied with it; the caller repairs the protected state, calls
//     MarkConsistent and unlocks. Unlocking without MarkConsistent makes the
//     lock permanently unusable (ErrNotRecoverable). A takeover that cannot
//     finish (its context ends while readers drain) puts the dead writer's
//     mark back, so the state stays marked as needing repair. Readers cannot
//     repair, so RLock returns ErrOwnerDied without the lock while a dead
//     writer's mark is in the word, and waits while a live writer repairs.
//   - Any process mapping the segment can write the owner word. A process
//     keeps its own record of whether one of its writers holds the lock
//     (its writers take their turn in the process before the word), so a
//     word that names it while none of its writers holds the lock was
//     written by another, and is taken back as from a writer that died;
//     a word rewritten while it holds the lock does not stop it letting
//     go. A segment's owner that never left a lock unrecoverable takes an
//     unrecoverable word back the same way.
//
// Waiting uses shared futexes after a brief spin. Every wait is bounded by
// its context, or by a time limit (LockWithin, RLockWithin) that starts
// counting when the lock first has to wait: a lock taken at once reads no
// clock, starts no timer and allocates nothing.
//
// Optimistic reads (Optimistic, Validate) let a reader proceed without
// writing anything, for read sections that only load words with
// sync/atomic and can tolerate retrying.
//
// An RWLock value belongs to one process (it is bound to the process's slot)
// and is safe for use by many goroutines; a process's handles on one lock
// share its writers' turn. A goroutine must not take the lock recursively.
type RWLock struct {
	seg   *Segment
	off   uint64
	head  *lockHead
	lines []readerLine
	me    uint64  // this process's mark in the owner word
	mine  *uint64 // this process's reader line
	owner *uint64 // &head.Owner, one indirection less on the fast paths
	fence atomic.Int64
	*lockWriters
}

// lockWriters is what a process keeps of its own writers of one lock,
// shared by all its handles on it.
type lockWriters struct {
	// turn is this process's turn to write: a writer takes it before the
	// owner word and gives it back after, so that while it is held here
	// no other writer of this process holds the word.
	turn chan struct{}
	// owed says the writer of this process that holds the lock was told
	// to repair (ErrOwnerDied) and has not said it did (MarkConsistent).
	// Under the turn; the shared flag is only what readers are told.
	owed bool
	// abandoned says this process left the lock unrecoverable.
	abandoned atomic.Bool
	// ownerOnly says no process but the segment's owner writes the lock
	// (OwnerWritesOnly).
	ownerOnly atomic.Bool
	queued    atomic.Int32 // writers waiting for the turn
}

// writersOf returns this process's record of the writers of the lock at
// off.
func (s *Segment) writersOf(off uint64) *lockWriters {
	s.writersMu.Lock()
	defer s.writersMu.Unlock()
	if s.writers == nil {
		s.writers = map[uint64]*lockWriters{}
	}
	w := s.writers[off]
	if w == nil {
		w = &lockWriters{turn: make(chan struct{}, 1)}
		s.writers[off] = w
	}
	return w
}

// ReadHold is a read hold taken by RLock or TryRLock; give it back to
// RUnlock.
type ReadHold struct{ gen uint32 }

const (
	// ownerUnrecoverable is the owner word of a lock that cannot recover.
	ownerUnrecoverable uint64 = math.MaxUint32
	flagInconsistent          = 1

	spinTries = 64
	pollEvery = 5 * time.Millisecond // liveness look-again interval while waiting

	// DefaultFenceAfter is how long a writer waits for a live reader before
	// it fences the reader's process (see RWLock).
	DefaultFenceAfter = 50 * time.Millisecond
)

// ownerMark is the owner word of a writer in slot with epoch.
func ownerMark(slot int, epoch uint32) uint64 { return uint64(epoch)<<32 | uint64(slot+1) }

// NewRWLock allocates a lock in the segment and registers it, so that a
// process claiming a slot later starts with a clean count in it. Owner only.
func (s *Segment) NewRWLock() (uint64, error) {
	if !s.owner {
		return 0, ErrNotOwner
	}
	n := uint32(len(s.procs))
	off, err := s.Alloc(lineSize*(1+uint64(n)), lineSize)
	if err != nil {
		return 0, fmt.Errorf("shm: new lock: %w", err)
	}
	s.mu.Lock() // held while the block is written: Close waits for it
	defer s.mu.Unlock()
	if s.closed.Load() {
		return 0, ErrClosed
	}
	head := At[lockHead](s, off)
	atomic.StoreUint32(&head.Lines, n)
	for i := range s.hdr.Locks {
		if atomic.CompareAndSwapUint64(&s.hdr.Locks[i], 0, off) {
			return off, nil
		}
	}
	return 0, ErrTooManyLks
}

// resetReaderLines discards slot i's read holds in every registered lock,
// moving the line's generation on. Called while claiming slot i.
func (s *Segment) resetReaderLines(i int) {
	for j := range s.hdr.Locks {
		off := atomic.LoadUint64(&s.hdr.Locks[j])
		if off == 0 {
			continue
		}
		_, lines, err := s.lockAt(off)
		if err != nil {
			s.log.Warn("skipping a registered lock that does not fit the segment", "err", err)
			continue
		}
		if i < len(lines) {
			c := &lines[i].Count
			for v := atomic.LoadUint64(c); !atomic.CompareAndSwapUint64(c, v, nextGen(v)); v = atomic.LoadUint64(c) {
			}
		}
	}
}

// lockAt finds the registered lock at off and its reader lines. Every word
// it reads can have been rewritten by any process mapping the segment, so
// each is checked against one reading of the segment's bounds, and a lock
// that does not fit is an error, never a fault.
func (s *Segment) lockAt(off uint64) (*lockHead, []readerLine, error) {
	registered := false
	for i := range s.hdr.Locks {
		registered = registered || atomic.LoadUint64(&s.hdr.Locks[i]) == off
	}
	if off == 0 || !registered {
		return nil, nil, fmt.Errorf("%w: no lock at 0x%x", ErrBadOffset, off)
	}
	arena, end := s.arenaStart(), s.limit(off+lineSize*(1+MaxSlots))
	if off%lineSize != 0 || off < arena || off > end || end-off < lineSize {
		return nil, nil, fmt.Errorf("%w: lock at 0x%x in %s", ErrBadOffset, off, s.path)
	}
	head := (*lockHead)(s.pointer(off))
	n := uint64(atomic.LoadUint32(&head.Lines))
	if n < 1 || n > MaxSlots || (end-off)/lineSize-1 < n {
		return nil, nil, fmt.Errorf("%w: lock at 0x%x has %d reader lines", ErrCorrupt, off, n)
	}
	return head, unsafe.Slice((*readerLine)(s.pointer(off+lineSize)), n), nil
}

// nextGen is a reader line's word with its holds discarded.
func nextGen(v uint64) uint64 { return (v>>32 + 1) << 32 }

// RWLock returns this process's handle on the lock at off, which must be an
// offset NewRWLock returned.
func (s *Segment) RWLock(off uint64) (*RWLock, error) {
	head, lines, err := s.lockAt(off)
	if err != nil {
		return nil, err
	}
	i := s.Slot()
	if i < 0 || i >= len(lines) {
		return nil, fmt.Errorf("shm: lock at 0x%x: this process has no slot", off)
	}
	l := &RWLock{seg: s, off: off, head: head, lines: lines, me: ownerMark(i, s.epoch),
		mine: &lines[i].Count, owner: &head.Owner, lockWriters: s.writersOf(off)}
	l.fence.Store(int64(DefaultFenceAfter))
	return l, nil
}

// SetFenceAfter sets how long this process's writers wait for a live
// reader before fencing it (default DefaultFenceAfter; d <= 0 restores the
// default).
func (l *RWLock) SetFenceAfter(d time.Duration) {
	if d <= 0 {
		d = DefaultFenceAfter
	}
	l.fence.Store(int64(d))
}

// RLock takes a read hold. It waits while a writer holds the lock, up to
// ctx's end. It fails with ErrOwnerDied if the writer died (the state may be
// half-written), ErrNotRecoverable if a repair was abandoned, or ctx's error.
// A writer found gone as a wait runs out does not fail it: RLock may return
// a hold after ctx's deadline (its process may not have run meanwhile), not
// after a cancellation. What the read section reads counts only if RUnlock
// returns nil.
func (l *RWLock) RLock(ctx context.Context) (ReadHold, error) {
	v := atomic.AddUint64(l.mine, 1)
	if atomic.LoadUint64(l.owner) == 0 {
		return ReadHold{gen: uint32(v >> 32)}, nil
	}
	return l.rlockSlow(&bound{ctx: ctx}, v)
}

// RLockWithin is RLock bounded by a time limit instead of a context: it
// waits at most d for a writer to go, counted from when it first has to.
func (l *RWLock) RLockWithin(d time.Duration) (ReadHold, error) {
	v := atomic.AddUint64(l.mine, 1)
	if atomic.LoadUint64(l.owner) == 0 {
		return ReadHold{gen: uint32(v >> 32)}, nil
	}
	return l.rlockSlow(&bound{within: d}, v)
}

//go:noinline
func (l *RWLock) rlockSlow(b *bound, v uint64) (ReadHold, error) {
	b.start()
	for {
		_ = l.RUnlock(ReadHold{gen: uint32(v >> 32)})
		if err := l.waitWriter(b); err != nil {
			return ReadHold{}, err
		}
		v = atomic.AddUint64(l.mine, 1)
		if atomic.LoadUint64(l.owner) == 0 {
			return ReadHold{gen: uint32(v >> 32)}, nil
		}
	}
}

// TryRLock takes a read hold if no writer holds the lock. It reports false
// (and no error) when a live writer does.
func (l *RWLock) TryRLock() (ReadHold, bool, error) {
	v := atomic.AddUint64(l.mine, 1)
	h := ReadHold{gen: uint32(v >> 32)}
	w := atomic.LoadUint64(l.owner)
	if w == 0 {
		return h, true, nil
	}
	_ = l.RUnlock(h)
	return ReadHold{}, false, l.writerError(w)
}

// RUnlock drops a read hold. It returns ErrFenced if a writer stopped
// waiting for this process's readers while the hold was out: the hold was
// discarded then, and what was read under it must be thrown away. It
// returns ErrClosed if the segment was closed under the hold.
func (l *RWLock) RUnlock(h ReadHold) error {
	for {
		v := atomic.LoadUint64(l.mine)
		if uint32(v>>32) != h.gen {
			if l.seg.closed.Load() {
				return ErrClosed // vacated under the hold (CloseUnderReaders)
			}
			return ErrFenced
		}
		n := uint32(v)
		if n == 0 {
			if l.seg.closed.Load() {
				return ErrClosed // the segment was vacated under the hold (CloseUnderReaders)
			}
			panic(errUnbalanced)
		}
		if atomic.CompareAndSwapUint64(l.mine, v, v-1) {
			if n == 1 && atomic.LoadUint64(l.owner) != 0 {
				l.wakeWriter()
			}
			return nil
		}
	}
}

// wakeWriter wakes a writer that may be asleep waiting for this process's
// count to drain.
//
//go:noinline
func (l *RWLock) wakeWriter() { _, _ = futex.Wake(lowHalf(l.mine), 1) }

var errUnbalanced = errors.New("shm: RUnlock of an RWLock not read-locked")

// alive reports whether the writer that left mark w in the owner word is
// alive. A word naming no slot of the table is nobody's.
func (l *RWLock) alive(w uint64) bool {
	slot := int(uint32(w)) - 1
	return slot >= 0 && slot < len(l.lines) && l.seg.aliveAs(slot, uint32(w>>32))
}

// writerError classifies a non-zero owner word for a reader.
func (l *RWLock) writerError(w uint64) error {
	switch {
	case w == ownerUnrecoverable:
		return ErrNotRecoverable
	case !l.alive(w):
		return ErrOwnerDied
	}
	return nil
}

// waitWriter waits until the owner word is clear, or fails.
func (l *RWLock) waitWriter(b *bound) error {
	for i := 0; i < spinTries; i++ {
		if atomic.LoadUint64(l.owner) == 0 {
			return nil
		}
		runtime.Gosched()
	}
	for last := false; ; {
		w := atomic.LoadUint64(l.owner)
		if w == 0 {
			return nil
		}
		if err := l.writerError(w); err != nil {
			return err
		}
		b.seen()
		if err := l.sleep(b, lowHalf(l.owner), uint32(w), true, time.Time{}); err != nil {
			if last = lookAgain(last, err); !last {
				return err
			}
		}
	}
}

// bound is what limits a lock's waits: the caller's context, or else a
// time limit whose deadline is fixed when start is first called, so that
// a lock that never waits never reads the clock. It lives on the stack of
// the lock call it bounds; one goroutine uses it.
type bound struct {
	ctx    context.Context // nil: within bounds the waits
	within time.Duration
	at     time.Time // within's deadline, once started
}

// start begins counting within, if it has not begun.
func (b *bound) start() {
	if b.ctx == nil && b.at.IsZero() {
		b.at = time.Now().Add(b.within)
	}
}

// err is the context's error, or context.DeadlineExceeded once within has
// passed since start.
func (b *bound) err() error {
	if b.ctx != nil {
		return b.ctx.Err()
	}
	b.start()
	if !time.Now().Before(b.at) {
		return context.DeadlineExceeded
	}
	return nil
}

func (b *bound) deadline() (time.Time, bool) {
	if b.ctx != nil {
		return b.ctx.Deadline()
	}
	b.start()
	return b.at, true
}

// seen runs the heldSeen hook, if a test set it.
func (b *bound) seen() {
	if hook := heldSeen.Load(); hook != nil {
		at, _ := b.deadline()
		(*hook)(at)
	}
}

// lookAgain reports whether a wait whose sleep failed with err looks at
// the lock once more before it fails: once, after its deadline passed,
// since the process may not have run between its last look and the
// deadline (stopped, traced, starved of CPU), and the holder may have let
// go meanwhile. A cancelled wait takes nothing more. last is whether this
// look was that one already.
func lookAgain(last bool, err error) bool {
	return !last && errors.Is(err, context.DeadlineExceeded)
}

// sleep waits on a futex word until it changes, the poll interval passes,
// until (if set) comes, or b ends the wait (its error is returned).
func (l *RWLock) sleep(b *bound, word *uint32, val uint32, counted bool, until time.Time) error {
	if err := b.err(); err != nil {
		return err
	}
	d := pollEvery
	if dl, ok := b.deadline(); ok {
		if r := time.Until(dl); r < d {
			if r <= 0 {
				return context.DeadlineExceeded
			}
			d = r
		}
	}
	if !until.IsZero() {
		d = max(min(d, time.Until(until)), time.Microsecond)
	}
	if counted {
		atomic.AddUint32(&l.head.Waiters, 1)
		defer atomic.AddUint32(&l.head.Waiters, math.MaxUint32)
	}
	if err := futex.Wait(word, val, d); err != nil && err != futex.ErrTimeout {
		return fmt.Errorf("shm: lock wait: %w", err)
	}
	return nil
}

// Lock takes the write lock, waiting up to ctx's end. It returns nil, or
// ErrOwnerDied with the lock held (see the type's documentation), or an
// error without the lock: ErrNotRecoverable or ctx's error. A lock found
// free as a wait runs out is taken: Lock may return nil after ctx's
// deadline (its process may not have run meanwhile), not after a
// cancellation.
func (l *RWLock) Lock(ctx context.Context) error {
	return l.lock(&bound{ctx: ctx})
}

// LockWithin is Lock bounded by a time limit instead of a context: it
// waits at most d in all, counted from when it first has to. The write
// lock of an uncontended lock costs no clock reading, timer or allocation.
func (l *RWLock) LockWithin(d time.Duration) error {
	return l.lock(&bound{within: d})
}

func (l *RWLock) lock(b *bound) error {
	if err := l.takeTurn(b); err != nil {
		return err
	}
	err := l.lockWord(b)
	switch err {
	case nil:
	case ErrOwnerDied:
		l.owed = true
	default:
		<-l.turn
	}
	return err
}

// takeTurn takes this process's turn to write, waiting as b allows: a
// wait that ran out (not one cancelled) takes the turn if it is free by
// then.
func (l *RWLock) takeTurn(b *bound) error {
	select {
	case l.turn <- struct{}{}:
		return nil
	default:
	}
	l.queued.Add(1)
	defer l.queued.Add(-1)
	var ranOut error
	if b.ctx != nil {
		select {
		case l.turn <- struct{}{}:
			return nil
		case <-b.ctx.Done():
			if ranOut = b.ctx.Err(); !errors.Is(ranOut, context.DeadlineExceeded) {
				return ranOut // cancelled: it takes nothing more
			}
		}
	} else {
		at, _ := b.deadline()
		t := time.NewTimer(time.Until(at))
		defer t.Stop()
		select {
		case l.turn <- struct{}{}:
			return nil
		case <-t.C:
			ranOut = context.DeadlineExceeded
		}
	}
	if hook := turnRanOut.Load(); hook != nil {
		(*hook)()
	}
	// The writer ahead may have given the turn back while this one did
	// not run (its process stopped, traced, starved of CPU): a turn free
	// when it judges counts.
	select {
	case l.turn <- struct{}{}:
		return nil
	default:
		return ranOut
	}
}

// turnRanOut, when set (by tests), runs in takeTurn as a writer's wait
// for its turn runs out, before it judges: where its process may stop.
var turnRanOut atomic.Pointer[func()]

// forged reports whether owner word w, read while this process holds its
// turn, was written by another process: it names this process, whose
// writers do not hold the word, or it says unrecoverable on a segment this
// process owns and never left it so, or it names any writer at all of a
// lock only this process, the segment's owner, writes.
func (l *RWLock) forged(w uint64) bool {
	switch {
	case w == l.me:
		return true
	case w == 0 || !l.seg.Owner():
		return false
	case w == ownerUnrecoverable:
		return !l.abandoned.Load()
	}
	return l.ownerOnly.Load()
}

// OwnerWritesOnly declares that no process but the segment's owner ever
// takes the lock to write (the global cache's lock, which only the
// primary writes). In the owner, an owner word that names another process
// is then one a process rewrote, not a hold: the owner's writers take the
// lock back at once, as from a writer that died, instead of waiting for
// that process to let go of what it never took. Elsewhere it changes
// nothing. It holds for every handle of this process on the lock.
func (l *RWLock) OwnerWritesOnly() { l.ownerOnly.Store(true) }

// lockWord takes the owner word, with this process's turn held.
func (l *RWLock) lockWord(b *bound) error {
	for spins, last := 0, false; ; {
		w := atomic.LoadUint64(l.owner)
		switch {
		case w == 0:
			if atomic.CompareAndSwapUint64(l.owner, 0, l.me) {
				return l.drain(b, 0)
			}
			continue
		case l.forged(w):
			if atomic.CompareAndSwapUint64(l.owner, w, l.me) {
				atomic.StoreUint32(&l.head.Flags, flagInconsistent)
				l.seg.log.Warn("took back a lock whose owner word another process rewrote", "lock", l.off, "word", w)
				return l.drain(b, w)
			}
			continue
		case w == ownerUnrecoverable:
			return ErrNotRecoverable
		case spins < spinTries:
			b.start()
			spins++
			runtime.Gosched()
			continue
		case !l.alive(w):
			if atomic.CompareAndSwapUint64(l.owner, w, l.me) {
				atomic.StoreUint32(&l.head.Flags, flagInconsistent)
				l.seg.log.Warn("took over lock from dead writer", "lock", l.off,
					"dead_slot", int(uint32(w))-1, "dead_epoch", uint32(w>>32))
				return l.drain(b, w)
			}
			continue
		}
		b.seen()
		if err := l.sleep(b, lowHalf(l.owner), uint32(w), true, time.Time{}); err != nil {
			if last = lookAgain(last, err); !last {
				return err
			}
		}
	}
}

// TryLock takes the write lock if nobody holds it and no reader is in. It
// reports false (and no error) when the lock is busy. A dead writer is taken
// over as in Lock; if readers keep the takeover from finishing, the dead
// writer's mark goes back.
func (l *RWLock) TryLock() (bool, error) {
	select {
	case l.turn <- struct{}{}:
	default:
		return false, nil // another writer of this process has it
	}
	ok, err := l.tryLockWord()
	if !ok {
		<-l.turn
		return false, err
	}
	l.owed = err == ErrOwnerDied
	return true, err
}

// tryLockWord is TryLock with this process's turn held.
func (l *RWLock) tryLockWord() (bool, error) {
	w := atomic.LoadUint64(l.owner)
	switch {
	case l.forged(w):
	case w == ownerUnrecoverable:
		return false, ErrNotRecoverable
	case w != 0 && l.alive(w):
		return false, nil
	}
	if !atomic.CompareAndSwapUint64(l.owner, w, l.me) {
		return false, nil
	}
	if w != 0 {
		atomic.StoreUint32(&l.head.Flags, flagInconsistent)
	}
	// No waiting: drain fails at once if a live reader is in.
	if err := l.drain(&bound{within: 0}, w); err == ErrOwnerDied {
		return true, err
	} else if err != nil {
		return false, nil
	}
	return true, nil
}

// drain runs with the owner word held: it marks optimistic readers out,
// then waits for every slot's read holds to go, discarding the holds of
// dead processes at once and fencing those of live ones after FenceAfter.
// On failure it gives the word back — to the dead writer it took over
// from, if prev names one, so that the state stays marked for repair.
func (l *RWLock) drain(b *bound, prev uint64) error {
	if seq := atomic.LoadUint32(&l.head.Seq); seq&1 == 0 {
		atomic.StoreUint32(&l.head.Seq, seq+1)
	}
	var fenceAt time.Time // from the first live reader met on
	var ranOut error      // the deadline's, once it passed: one more look, which takes only what is free
	for i := range l.lines {
		c := &l.lines[i].Count
		for {
			v := atomic.LoadUint64(c)
			n := uint32(v)
			if n == 0 {
				break
			}
			if i != l.seg.Slot() && !l.seg.Alive(i) {
				if atomic.CompareAndSwapUint64(c, v, nextGen(v)) {
					l.seg.log.Warn("discarded read holds of dead process", "lock", l.off, "slot", i, "holds", n)
				}
				continue
			}
			if ranOut != nil {
				// A live reader is still in at the look after the
				// deadline. Fencing it now would count this process's
				// own stop against the reader.
				l.abort(prev)
				return ranOut
			}
			if fenceAt.IsZero() {
				b.start()
				fenceAt = time.Now().Add(time.Duration(l.fence.Load()))
			}
			if !time.Now().Before(fenceAt) {
				if atomic.CompareAndSwapUint64(c, v, nextGen(v)) {
					atomic.AddUint64(&l.head.Fences, uint64(n))
					l.seg.log.Warn("fenced read holds of a process that kept them too long",
						"lock", l.off, "slot", i, "pid", l.seg.Proc(i).PID, "holds", n,
						"waited", time.Duration(l.fence.Load()))
				}
				continue
			}
			b.seen()
			if err := l.sleep(b, lowHalf(c), n, false, fenceAt); err != nil {
				if ranOut != nil || !errors.Is(err, context.DeadlineExceeded) {
					l.abort(prev) // a cancellation, or a failed wait
					return err
				}
				ranOut = err
			}
		}
	}
	if atomic.LoadUint32(&l.head.Flags)&flagInconsistent != 0 {
		return ErrOwnerDied
	}
	return nil
}

// abort gives up a write lock whose drain failed.
func (l *RWLock) abort(prev uint64) {
	if prev == 0 {
		l.release(false)
		return
	}
	// A takeover that did not finish: the state is as the dead writer left
	// it, so its mark goes back (readers keep getting ErrOwnerDied, Seq
	// stays odd) and the next writer takes over again.
	atomic.StoreUint64(l.owner, prev)
	if atomic.LoadUint32(&l.head.Waiters) != 0 {
		_, _ = futex.Wake(lowHalf(l.owner), math.MaxInt32)
	}
}

// OwnerDead reports whether a writer died holding the lock and nobody has
// taken it over yet (Lock would, and return ErrOwnerDied).
func (l *RWLock) OwnerDead() bool {
	w := atomic.LoadUint64(l.owner)
	return w != 0 && w != ownerUnrecoverable && !l.alive(w)
}

// MarkConsistent declares the protected state repaired after Lock returned
// ErrOwnerDied. Call it with the write lock held.
func (l *RWLock) MarkConsistent() {
	l.owed = false
	atomic.StoreUint32(&l.head.Flags, 0)
}

// Unlock drops the write lock. If the state was never marked consistent
// after ErrOwnerDied, the lock becomes unrecoverable. On a segment closed
// under the hold it does nothing.
func (l *RWLock) Unlock() {
	if len(l.turn) == 0 {
		panic("shm: Unlock of an RWLock this process does not write-hold")
	}
	defer func() { <-l.turn }()
	if l.seg.closed.Load() {
		l.owed = false
		return // the segment was vacated under the hold (CloseUnderReaders)
	}
	if w := atomic.LoadUint64(l.owner); w != l.me {
		// Another process rewrote the word under the hold: let go all
		// the same.
		l.seg.log.Warn("owner word rewritten by another process while this one held the lock", "lock", l.off, "word", w)
	}
	// Abandoned only for a repair this process owes, whatever the shared
	// flag says: another process may have written it.
	abandon := l.owed
	l.owed = false
	if !abandon {
		atomic.StoreUint32(&l.head.Flags, 0)
	}
	l.release(abandon)
}

func (l *RWLock) release(abandon bool) {
	word := uint64(0)
	if abandon {
		l.abandoned.Store(true)
		// The state stays half-written: optimistic readers must keep
		// failing (Seq stays odd) and nobody may lock again.
		word = ownerUnrecoverable
	} else if atomic.LoadUint32(&l.head.Flags)&flagInconsistent == 0 {
		atomic.AddUint32(&l.head.Seq, 1)
	}
	atomic.StoreUint64(l.owner, word)
	if atomic.LoadUint32(&l.head.Waiters) != 0 {
		_, _ = futex.Wake(lowHalf(l.owner), math.MaxInt32)
	}
}

// Optimistic starts an optimistic read: it returns a stamp, and false if a
// writer holds the lock (then take RLock instead). Read the protected words
// with sync/atomic, then call Validate; if it fails, the words read may be
// torn and must be discarded. Nothing is written, so optimistic readers
// cost writers nothing and never need repair.
func (l *RWLock) Optimistic() (uint32, bool) {
	s := atomic.LoadUint32(&l.head.Seq)
	return s, s&1 == 0
}

// Validate reports whether no writer has held the lock since Optimistic
// returned stamp.
func (l *RWLock) Validate(stamp uint32) bool {
	return atomic.LoadUint32(&l.head.Seq) == stamp
}

// LockState is a snapshot of a lock, for operators.
type LockState struct {
	Offset         uint64 `json:"offset"`
	WriterSlot     int    `json:"writer_slot"`  // -1: none
	WriterEpoch    uint32 `json:"writer_epoch"` // the epoch of WriterSlot the writer claimed it with
	Inconsistent   bool   `json:"inconsistent"`
	NotRecoverable bool   `json:"not_recoverable"`
	Waiters        int    `json:"waiters"`
	// Queued counts the writers of the process that asked (State) waiting
	// for its turn to write, behind another writer of its own.
	Queued  int         `json:"queued,omitempty"`
	Seq     uint32      `json:"seq"`
	Fences  uint64      `json:"fences"`  // read holds fenced since the lock was made
	Readers map[int]int `json:"readers"` // slot -> read holds, for slots holding any
}

// readHold is one slot's read holds, as LockState's JSON lists them.
type readHold struct {
	Slot  int `json:"slot"`
	Holds int `json:"holds"`
}

// MarshalJSON writes the state with its readers as a list of {"slot",
// "holds"} ordered by slot, not as an object keyed by slot numbers.
func (s LockState) MarshalJSON() ([]byte, error) {
	type plain LockState
	rs := make([]readHold, 0, len(s.Readers))
	for slot, n := range s.Readers {
		rs = append(rs, readHold{slot, n})
	}
	slices.SortFunc(rs, func(a, b readHold) int { return a.Slot - b.Slot })
	return json.Marshal(struct {
		plain
		Readers []readHold `json:"readers"`
	}{plain(s), rs})
}

// UnmarshalJSON reads what MarshalJSON wrote.
func (s *LockState) UnmarshalJSON(b []byte) error {
	type plain LockState
	var v struct {
		plain
		Readers []readHold `json:"readers"`
	}
	if err := json.Unmarshal(b, &v); err != nil {
		return err
	}
	*s = LockState(v.plain)
	s.Readers = make(map[int]int, len(v.Readers))
	for _, h := range v.Readers {
		s.Readers[h.Slot] = h.Holds
	}
	return nil
}

// State returns a snapshot of the lock.
func (l *RWLock) State() LockState {
	st := lockState(l.off, l.head, l.lines)
	st.Queued = int(l.queued.Load())
	return st
}

// lockState reads the lock at off word by word.
func lockState(off uint64, head *lockHead, lines []readerLine) LockState {
	st := LockState{Offset: off, WriterSlot: -1, Readers: map[int]int{}}
	switch w := atomic.LoadUint64(&head.Owner); w {
	case 0:
	case ownerUnrecoverable:
		st.NotRecoverable = true
	default:
		st.WriterSlot, st.WriterEpoch = int(uint32(w))-1, uint32(w>>32)
	}
	st.Inconsistent = atomic.LoadUint32(&head.Flags)&flagInconsistent != 0
	st.Waiters = int(atomic.LoadUint32(&head.Waiters))
	st.Seq = atomic.LoadUint32(&head.Seq)
	st.Fences = atomic.LoadUint64(&head.Fences)
	for i := range lines {
		if n := uint32(atomic.LoadUint64(&lines[i].Count)); n != 0 {
			st.Readers[i] = int(n)
		}
	}
	return st
}

// heldSeen, when set (by tests), runs in a wait for the lock once it has
// seen the lock held and before it sleeps, with the wait's deadline: where
// its process may stop.
var heldSeen atomic.Pointer[func(deadline time.Time)]
