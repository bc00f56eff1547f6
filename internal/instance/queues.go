package instance

import (
	"sync"
	"time"

	"github.com/mpmr/mpmr/cache"
	"github.com/mpmr/mpmr/shm"
)

// Queues tracks a process's local caches so that their counters can be
// summed. Closed queues leave their last counters behind in the sum. Safe
// for concurrent use.
type Queues struct {
	mu      sync.Mutex
	live    map[*cache.Local]struct{}
	retired cache.LocalStats
	empty   chan struct{} // closed when the last live queue is removed
}

// Add starts tracking l.
func (q *Queues) Add(l *cache.Local) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.live == nil {
		q.live = map[*cache.Local]struct{}{}
	}
	if len(q.live) == 0 {
		q.empty = make(chan struct{})
	}
	q.live[l] = struct{}{}
}

// Remove stops tracking l, keeping its published counters in the sum. The
// caller publishes first (from l's goroutine).
func (q *Queues) Remove(l *cache.Local) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if _, ok := q.live[l]; ok {
		delete(q.live, l)
		q.retired = q.retired.Add(l.Published())
		if len(q.live) == 0 {
			close(q.empty)
		}
	}
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

// Live returns how many queues are live.
func (q *Queues) Live() int {
	q.mu.Lock()
	defer q.mu.Unlock()
	return len(q.live)
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

// CloseSegment closes a process's control segment. While queues are live,
// one of them may be in the middle of a lookup that passed its check for
// Close (lookups read the segment, and take no lock against Close): the
// segment's range is then left as zeros (shm.Segment.CloseUnderReaders)
// rather than unmapped under it.
func CloseSegment(seg *shm.Segment, q *Queues) error {
	if q.Live() > 0 {
		return seg.CloseUnderReaders()
	}
	return seg.Close()
}
