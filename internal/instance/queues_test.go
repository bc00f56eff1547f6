package instance

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"

	"github.com/mpmr/mpmr/cache"
)

// WaitEmpty returns at once with no live queue, gives up after its bound
// while one is live, and returns when the last one is removed; a queue
// added after that makes it wait again.
func TestQueuesWaitEmpty(t *testing.T) {
	var q Queues
	assert.True(t, q.WaitEmpty(0), "no queue yet")
	a := q.Add(func() *cache.Local { return &cache.Local{} })
	b := q.Add(func() *cache.Local { return &cache.Local{} })
	assert.False(t, q.WaitEmpty(10*time.Millisecond), "two live queues")
	q.Remove(a)
	assert.False(t, q.WaitEmpty(10*time.Millisecond), "one still live")
	done := make(chan bool, 1)
	go func() { done <- q.WaitEmpty(10 * time.Second) }()
	q.Remove(b)
	select {
	case empty := <-done:
		assert.True(t, empty, "the last one removed")
	case <-time.After(10 * time.Second):
		t.Fatal("WaitEmpty did not return when the last queue was removed")
	}
	q.Remove(b) // removing twice changes nothing
	assert.True(t, q.WaitEmpty(0))
	q.Add(func() *cache.Local { return a })
	assert.False(t, q.WaitEmpty(10*time.Millisecond), "a queue added again")
	_, live := q.Sum()
	assert.Equal(t, 1, live)
}
