package instance

import (
	"sync"
	"time"

	"github.com/mpmr/mpmr/cache"
	"github.com/mpmr/mpmr/shm"
)

// Queues tracks a process's local caches so that their counters can be
// summed, and so that the control segment they read is closed under them
// safely (CloseSegment). Closed queues leave their last counters behind
// in the sum. Safe for concurrent use.
type Queues struct {
	mu      sync.Mutex
	live    map[*cache.Local]struct{}
	retired cache.LocalStats
	empty   chan struct{} // closed when the last live queue is removed
	// unreserve gives back the segment's range CloseSegment left as
	// zeros under live queues, once the last of them is removed.
	unreserve func()
}

// Add makes a queue with newLocal and starts tracking it. newLocal runs
// under the lock CloseSegment takes, so a queue is made either before the
// segment is closed, and counts as live then, or after Detach, when it
// reads nothing of the segment.
func (q *Queues) Add(newLocal func() *cache.Local) *cache.Local {
	q.mu.Lock()
	defer q.mu.Unlock()
	l := newLocal()
	if q.live == nil {
		q.live = map[*cache.Local]struct{}{}
	}
	if len(q.live) == 0 {
		q.empty = make(chan struct{})
	}
	q.live[l] = struct{}{}
	return l
}

// Remove stops tracking l, keeping its published counters in the sum. The
// caller publishes first (from l's goroutine). Removing the last live
// queue of a segment closed under its queues gives the segment's address
// range back.
func (q *Queues) Remove(l *cache.Local) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if _, ok := q.live[l]; ok {
		delete(q.live, l)
		q.retired = q.retired.Add(l.Published())
		if len(q.live) == 0 {
			close(q.empty)
			if q.unreserve != nil {
				q.unreserve()
				q.unreserve = nil
			}
		}
	}
}

// CloseSegment closes seg, the control segment that g and the queues
// read, for a process letting go of it (its Close). g is detached first
// (cache.Global.Detach): lookups past the top half fail with
// cache.ErrClosed from then on, and queues made afterwards read nothing
// of the segment. Queues still live may be in the middle of a lookup
// that reads it (lookups take no lock against Close), so while there are
// any, the segment's range is left as zeros instead of unmapped
// (shm.Segment.CloseUnderReaders) and their generation moved past what
// they cached (cache.Global.Vacated); the range goes back when the last
// of them is removed. Either way, a segment that stays mapped is an
// error, and its slot stays held (see shm.Segment.Close).
func (q *Queues) CloseSegment(seg *shm.Segment, g *cache.Global) error {
	q.mu.Lock()
	defer q.mu.Unlock()
	if g != nil {
		g.Detach()
	}
	if len(q.live) == 0 {
		return seg.Close()
	}
	vacated, err := seg.CloseUnderReaders()
	if vacated {
		if g != nil {
			g.Vacated()
		}
		q.unreserve = seg.Unreserve
	}
	return err
}

// WaitEmpty waits until no queue is live, at most d, and reports whether
// none is.
func (q *Queues) WaitEmpty(d time.Duration) bool {
	q.mu.Lock()
	if len(q.live) == 0 {
		q.mu.Unlock()
		return true
	}
	empty := q.empty
	q.mu.Unlock()
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-empty:
		return true
	case <-t.C:
		return false
	}
}

// Sum returns the published counters of every queue, live or closed, and
// how many are live.
func (q *Queues) Sum() (cache.LocalStats, int) {
	q.mu.Lock()
	defer q.mu.Unlock()
	s := q.retired
	for l := range q.live {
		s = s.Add(l.Published())
	}
	return s, len(q.live)
}
