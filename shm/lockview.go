package shm

import (
	"fmt"
	"sync/atomic"
)

// LockView looks at an RWLock without taking part in it: it never holds,
// waits for or repairs the lock and writes nothing, so it needs no
// process-table slot and works on a read-only Segment (see OpenReadOnly).
// Tools use it to describe a lock and to read the state it protects with
// optimistic reads. A LockView is safe for concurrent use.
type LockView struct {
	seg   *Segment
	off   uint64
	head  *lockHead
	lines []readerLine
}

// ViewLock returns a view of the registered lock at off. Unlike RWLock it
// checks the lock's words against the segment instead of trusting them,
// since the segment may belong to an instance that died mid-update.
func (s *Segment) ViewLock(off uint64) (*LockView, error) {
	head, lines, err := s.lockAt(off)
	if err != nil {
		return nil, fmt.Errorf("shm: view lock: %w", err)
	}
	return &LockView{seg: s, off: off, head: head, lines: lines}, nil
}

// Optimistic starts an optimistic read, as RWLock.Optimistic does: it
// returns a stamp, and false while a writer holds the lock.
func (v *LockView) Optimistic() (uint32, bool) {
	s := atomic.LoadUint32(&v.head.Seq)
	return s, s&1 == 0
}

// Validate reports whether no writer has held the lock since Optimistic
// returned stamp.
func (v *LockView) Validate(stamp uint32) bool {
	return atomic.LoadUint32(&v.head.Seq) == stamp
}

// State returns a snapshot of the lock, as RWLock.State does.
func (v *LockView) State() LockState { return lockState(v.off, v.head, v.lines) }

// Abandoned reports whether the lock is stuck: its writer (the claim of its
// slot that took the lock, not a later one) died holding it
// and nobody has taken it over yet, or a repair was abandoned and it can
// never be taken again. Optimistic reads then fail until a live process
// takes the lock over, so a reader should stop waiting for one.
func (v *LockView) Abandoned() bool {
	switch w := atomic.LoadUint64(&v.head.Owner); {
	case w == 0:
		return false
	case w == ownerUnrecoverable:
		return true
	default:
		slot := int(uint32(w)) - 1
		return slot < 0 || slot >= len(v.lines) || !v.seg.aliveAs(slot, uint32(w>>32))
	}
}
