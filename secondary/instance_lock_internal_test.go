package secondary

import (
	"context"
	"errors"
	"strconv"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Attach attempts to one instance take turns; to others they do not wait;
// an attempt out of time gives up; and nothing is kept for an instance
// once no attempt holds or waits for it, however many instances a process
// attaches to over its life.
func TestInstanceLock(t *testing.T) {
	ctx := context.Background()
	unlockA, err := lockInstance(ctx, "a")
	require.NoError(t, err)
	unlockB, err := lockInstance(ctx, "b")
	require.NoError(t, err, "another instance does not wait")

	expired, cancel := context.WithCancel(ctx)
	cancel()
	_, err = lockInstance(expired, "a")
	assert.True(t, errors.Is(err, context.Canceled), "an attempt out of time gives up: %v", err)

	got := make(chan func())
	go func() {
		unlock, err := lockInstance(ctx, "a")
		assert.NoError(t, err)
		got <- unlock
	}()
	unlockA()
	unlockA() // a second call does nothing
	(<-got)()
	unlockB()

	for i := range 1000 {
		unlock, err := lockInstance(ctx, strconv.Itoa(i))
		require.NoError(t, err)
		unlock()
	}
	instanceLocks.mu.Lock()
	defer instanceLocks.mu.Unlock()
	assert.Empty(t, instanceLocks.m)
}
