package instance

import (
	"sync"

	"github.com/mpmr/mpmr/cache"
)

// Queues tracks a process's local caches so that their counters can be
// summed. Closed queues leave their last counters behind in the sum. Safe
// for concurrent use.
type Queues struct {
	mu      sync.Mutex
	live    map[*cache.Local]struct{}
	retired cache.LocalStats
}

// Add starts tracking l.
func (q *Queues) Add(l *cache.Local) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.live == nil {
		q.live = map[*cache.Local]struct{}{}
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
