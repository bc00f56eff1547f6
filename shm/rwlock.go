package shm

import (
	"context"
	"errors"
	"fmt"
	"math"
	"runtime"
	"sync/atomic"
	"time"

	"github.com/mpmr/mpmr/internal/futex"
)

// RWLock is a process-shared reader-writer lock that lives in a segment and
// survives the death of any process holding it.
//
// Readers count themselves on their process's own cache line (one line per
// process-table slot), so readers in different processes never write the
// same line. A writer claims the writer word with its slot number, which
// stops new readers, then waits for every slot's count to drain. The lock is
// writer-preferring: once a writer holds the word, readers wait, so a stream
// of readers cannot starve it.
//
// Robustness:
//   - A process that dies holding read locks leaves a count behind. A
//     waiting writer looks at the slot's liveness every few milliseconds
//     while it waits and discards the count of a dead slot, so it proceeds
//     within a bounded time of the death.
//   - A process that dies holding the write lock leaves its slot in the
//     writer word. The next Lock takes the lock over and returns
//     ErrOwnerDied with it; the caller repairs the protected state, calls
//     MarkConsistent and unlocks. Unlocking without MarkConsistent makes the
//     lock permanently unusable (ErrNotRecoverable). Readers cannot repair,
//     so RLock returns ErrOwnerDied without the lock while the dead writer's
//     slot is in the word, and waits while a live writer repairs.
//
// Waiting uses shared futexes after a brief spin. Every wait is bounded by
// its context.
//
// Optimistic reads (Optimistic, Validate) let a reader proceed without
// writing anything, for read sections that only load words with
// sync/atomic and can tolerate retrying.
//
// An RWLock value belongs to one process (it is bound to the process's slot)
// and is safe for use by many goroutines. A goroutine must not take the
// lock recursively.
type RWLock struct {
	seg    *Segment
	off    uint64
	head   *lockHead
	lines  []readerLine
	me     uint32  // this process's slot + 1: its mark in the writer word
	mine   *uint64 // this process's reader count
	writer *uint32 // &head.Writer, one indirection less on the fast paths
}

const (
	lockUnrecoverable = math.MaxUint32 // writer word of a lock that cannot recover
	flagInconsistent  = 1

	spinTries = 64
	pollEvery = 5 * time.Millisecond // liveness look-again interval while waiting
)

// NewRWLock allocates a lock in the segment and registers it, so that a
// process claiming a slot later starts with a clean count in it. Owner only.
func (s *Segment) NewRWLock() (uint64, error) {
	if !s.owner {
		return 0, ErrNotOwner
	}
	n := atomic.LoadUint32(&s.hdr.Slots)
	off, err := s.Alloc(lineSize*(1+uint64(n)), lineSize)
	if err != nil {
		return 0, fmt.Errorf("shm: new lock: %w", err)
	}
	head := At[lockHead](s, off)
	atomic.StoreUint32(&head.Lines, n)
	lines := Slice[readerLine](s, off+lineSize, int(n))
	slots := s.slots()
	for i := range lines {
		atomic.StoreUint64(&lines[i].Count, uint64(atomic.LoadUint32(&slots[i].Epoch))<<32)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for i := range s.hdr.Locks {
		if atomic.CompareAndSwapUint64(&s.hdr.Locks[i], 0, off) {
			return off, nil
		}
	}
	return 0, ErrTooManyLks
}

// resetReaderLines gives slot i a clean count, tagged with its new epoch, in
// every registered lock. Called while claiming slot i.
func (s *Segment) resetReaderLines(i int, epoch uint32) {
	for j := range s.hdr.Locks {
		off := atomic.LoadUint64(&s.hdr.Locks[j])
		if off == 0 {
			continue
		}
		lines := Slice[readerLine](s, off+lineSize, int(atomic.LoadUint32(&At[lockHead](s, off).Lines)))
		if i < len(lines) {
			atomic.StoreUint64(&lines[i].Count, uint64(epoch)<<32)
		}
	}
}

// RWLock returns this process's handle on the lock at off, which must be an
// offset NewRWLock returned.
func (s *Segment) RWLock(off uint64) (*RWLock, error) {
	registered := false
	for i := range s.hdr.Locks {
		registered = registered || atomic.LoadUint64(&s.hdr.Locks[i]) == off
	}
	if off == 0 || !registered {
		return nil, fmt.Errorf("%w: no lock at 0x%x", ErrBadOffset, off)
	}
	head := At[lockHead](s, off)
	lines := Slice[readerLine](s, off+lineSize, int(atomic.LoadUint32(&head.Lines)))
	if s.slot < 0 || s.slot >= len(lines) {
		return nil, fmt.Errorf("shm: lock at 0x%x: this process has no slot", off)
	}
	return &RWLock{seg: s, off: off, head: head, lines: lines, me: uint32(s.slot) + 1, mine: &lines[s.slot].Count, writer: &head.Writer}, nil
}

// RLock takes a read hold. It waits while a writer holds the lock, up to
// ctx's end. It fails with ErrOwnerDied if the writer died (the state may be
// half-written), ErrNotRecoverable if a repair was abandoned, or ctx's error.
func (l *RWLock) RLock(ctx context.Context) error {
	atomic.AddUint64(l.mine, 1)
	if atomic.LoadUint32(l.writer) == 0 {
		return nil
	}
	return l.rlockSlow(ctx)
}

//go:noinline
func (l *RWLock) rlockSlow(ctx context.Context) error {
	for {
		l.RUnlock()
		if err := l.waitWriter(ctx); err != nil {
			return err
		}
		atomic.AddUint64(l.mine, 1)
		if atomic.LoadUint32(&l.head.Writer) == 0 {
			return nil
		}
	}
}

// TryRLock takes a read hold if no writer holds the lock. It reports false
// (and no error) when a live writer does.
func (l *RWLock) TryRLock() (bool, error) {
	atomic.AddUint64(l.mine, 1)
	w := atomic.LoadUint32(&l.head.Writer)
	if w == 0 {
		return true, nil
	}
	l.RUnlock()
	return false, l.writerError(w)
}

// RUnlock drops a read hold.
func (l *RWLock) RUnlock() {
	n := uint32(atomic.AddUint64(l.mine, math.MaxUint64))
	if n == 0 && atomic.LoadUint32(l.writer) != 0 || n == math.MaxUint32 {
		l.runlockSlow(n)
	}
}

// runlockSlow wakes a writer that may be asleep waiting for this process's
// count to drain, or reports an unbalanced RUnlock.
//
//go:noinline
func (l *RWLock) runlockSlow(n uint32) {
	if n == math.MaxUint32 {
		panic(errUnbalanced)
	}
	_, _ = futex.Wake(lowHalf(l.mine), 1)
}

var errUnbalanced = errors.New("shm: RUnlock of an RWLock not read-locked")

// writerError classifies a non-zero writer word for a reader.
func (l *RWLock) writerError(w uint32) error {
	switch {
	case w == lockUnrecoverable:
		return ErrNotRecoverable
	case !l.seg.Alive(int(w - 1)):
		return ErrOwnerDied
	}
	return nil
}

// waitWriter waits until the writer word is clear, or fails.
func (l *RWLock) waitWriter(ctx context.Context) error {
	for i := 0; i < spinTries; i++ {
		if atomic.LoadUint32(&l.head.Writer) == 0 {
			return nil
		}
		runtime.Gosched()
	}
	for {
		w := atomic.LoadUint32(&l.head.Writer)
		if w == 0 {
			return nil
		}
		if err := l.writerError(w); err != nil {
			return err
		}
		if err := l.sleep(ctx, &l.head.Writer, w, true); err != nil {
			return err
		}
	}
}

// sleep waits on a futex word until it changes, the poll interval passes or
// ctx ends (its error is returned).
func (l *RWLock) sleep(ctx context.Context, word *uint32, val uint32, counted bool) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	d := pollEvery
	if dl, ok := ctx.Deadline(); ok {
		if r := time.Until(dl); r < d {
			if r <= 0 {
				return context.DeadlineExceeded
			}
			d = r
		}
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
// error without the lock: ErrNotRecoverable or ctx's error.
func (l *RWLock) Lock(ctx context.Context) error {
	for spins := 0; ; {
		w := atomic.LoadUint32(&l.head.Writer)
		switch {
		case w == 0:
			if atomic.CompareAndSwapUint32(&l.head.Writer, 0, l.me) {
				return l.drain(ctx)
			}
			continue
		case w == lockUnrecoverable:
			return ErrNotRecoverable
		case spins < spinTries:
			spins++
			runtime.Gosched()
			continue
		case !l.seg.Alive(int(w - 1)):
			if atomic.CompareAndSwapUint32(&l.head.Writer, w, l.me) {
				atomic.StoreUint32(&l.head.Flags, flagInconsistent)
				l.seg.log.Warn("took over lock from dead writer", "lock", l.off, "dead_slot", w-1)
				return l.drain(ctx)
			}
			continue
		}
		if err := l.sleep(ctx, &l.head.Writer, w, true); err != nil {
			return err
		}
	}
}

// TryLock takes the write lock if nobody holds it and no reader is in. It
// reports false (and no error) when the lock is busy. A dead writer is taken
// over as in Lock.
func (l *RWLock) TryLock() (bool, error) {
	w := atomic.LoadUint32(&l.head.Writer)
	switch {
	case w == lockUnrecoverable:
		return false, ErrNotRecoverable
	case w != 0 && l.seg.Alive(int(w-1)):
		return false, nil
	case !atomic.CompareAndSwapUint32(&l.head.Writer, w, l.me):
		return false, nil
	case w != 0:
		atomic.StoreUint32(&l.head.Flags, flagInconsistent)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel() // no waiting: drain fails at once if a live reader is in
	if err := l.drain(ctx); err == ErrOwnerDied {
		return true, err
	} else if err != nil {
		return false, nil
	}
	return true, nil
}

// drain runs with the writer word held: it marks optimistic readers out,
// then waits for every slot's read holds to go, discarding the holds of
// dead processes. On failure it gives the word back.
func (l *RWLock) drain(ctx context.Context) error {
	if seq := atomic.LoadUint32(&l.head.Seq); seq&1 == 0 {
		atomic.StoreUint32(&l.head.Seq, seq+1)
	}
	for i := range l.lines {
		c := &l.lines[i].Count
		for {
			v := atomic.LoadUint64(c)
			n := uint32(v)
			if n == 0 {
				break
			}
			if i != l.seg.slot && !l.seg.Alive(i) {
				if atomic.CompareAndSwapUint64(c, v, v&^math.MaxUint32) {
					l.seg.log.Warn("discarded read holds of dead process", "lock", l.off, "slot", i, "holds", n)
				}
				continue
			}
			if err := l.sleep(ctx, lowHalf(c), n, false); err != nil {
				l.release(false)
				return err
			}
		}
	}
	if atomic.LoadUint32(&l.head.Flags)&flagInconsistent != 0 {
		return ErrOwnerDied
	}
	return nil
}

// MarkConsistent declares the protected state repaired after Lock returned
// ErrOwnerDied. Call it with the write lock held.
func (l *RWLock) MarkConsistent() {
	atomic.StoreUint32(&l.head.Flags, 0)
}

// Unlock drops the write lock. If the state was never marked consistent
// after ErrOwnerDied, the lock becomes unrecoverable.
func (l *RWLock) Unlock() {
	if atomic.LoadUint32(&l.head.Writer) != l.me {
		panic("shm: Unlock of an RWLock this process does not write-hold")
	}
	l.release(atomic.LoadUint32(&l.head.Flags)&flagInconsistent != 0)
}

func (l *RWLock) release(abandon bool) {
	word := uint32(0)
	if abandon {
		// The state stays half-written: optimistic readers must keep
		// failing (Seq stays odd) and nobody may lock again.
		word = lockUnrecoverable
	} else if atomic.LoadUint32(&l.head.Flags)&flagInconsistent == 0 {
		atomic.AddUint32(&l.head.Seq, 1)
	}
	atomic.StoreUint32(&l.head.Writer, word)
	if atomic.LoadUint32(&l.head.Waiters) != 0 {
		_, _ = futex.Wake(&l.head.Writer, math.MaxInt32)
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
	Offset         uint64
	WriterSlot     int // -1: none
	Inconsistent   bool
	NotRecoverable bool
	Waiters        int
	Seq            uint32
	Readers        map[int]int // slot -> read holds, for slots holding any
}

// State returns a snapshot of the lock.
func (l *RWLock) State() LockState { return lockState(l.off, l.head, l.lines) }

// lockState reads the lock at off word by word.
func lockState(off uint64, head *lockHead, lines []readerLine) LockState {
	st := LockState{Offset: off, WriterSlot: -1, Readers: map[int]int{}}
	switch w := atomic.LoadUint32(&head.Writer); w {
	case 0:
	case lockUnrecoverable:
		st.NotRecoverable = true
	default:
		st.WriterSlot = int(w - 1)
	}
	st.Inconsistent = atomic.LoadUint32(&head.Flags)&flagInconsistent != 0
	st.Waiters = int(atomic.LoadUint32(&head.Waiters))
	st.Seq = atomic.LoadUint32(&head.Seq)
	for i := range lines {
		if n := uint32(atomic.LoadUint64(&lines[i].Count)); n != 0 {
			st.Readers[i] = int(n)
		}
	}
	return st
}
