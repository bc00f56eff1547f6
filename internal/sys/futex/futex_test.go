package futex

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestWaitReturnsAtOnceWhenValueDiffers(t *testing.T) {
	var w uint32 = 1
	require.NoError(t, Wait(&w, 0, time.Second))
}

func TestWaitTimesOut(t *testing.T) {
	var w uint32
	err := Wait(&w, 0, time.Millisecond)
	assert.ErrorIs(t, err, ErrTimeout)
}

func TestWakeReleasesWaiter(t *testing.T) {
	var w uint32
	done := make(chan error, 1)
	go func() {
		for atomic.LoadUint32(&w) == 0 {
			if err := Wait(&w, 0, -1); err != nil {
				done <- err
				return
			}
		}
		done <- nil
	}()
	atomic.StoreUint32(&w, 1)
	// Keep waking until the waiter has seen the change: the wake may land
	// before it sleeps, in which case its wait returns EAGAIN at once.
	for {
		_, err := Wake(&w, 1)
		require.NoError(t, err)
		select {
		case err := <-done:
			require.NoError(t, err)
			return
		case <-time.After(time.Millisecond):
		}
	}
}
