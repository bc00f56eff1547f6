package shm

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// A writer whose wait for its process's turn ran out takes the turn if it
// is free when it comes to judge: the writer ahead may have given it back
// while this one did not run (its process stopped, traced, starved of
// CPU), which its deadline should not count against it, whether the wait
// was bounded by a time (LockWithin) or by a context's deadline (Lock).
func TestAWriterWhoseTurnCameWhileItDidNotRunTakesIt(t *testing.T) {
	newDir := closeOrderDir(t)
	for _, how := range []string{"within", "context"} {
		t.Run(how, func(t *testing.T) {
			first, second, _ := twoWritersAndAnother(t, newDir())
			var ranOut atomic.Bool
			// As the second's wait runs out, and before it judges, the
			// first lets go.
			hook := func() {
				ranOut.Store(true)
				first.Unlock()
			}
			turnRanOut.Store(&hook)
			t.Cleanup(func() { turnRanOut.Store(nil) })
			const wait = 10 * time.Millisecond
			var err error
			if how == "within" {
				err = second.LockWithin(wait)
			} else {
				ctx, cancel := context.WithTimeout(context.Background(), wait)
				defer cancel()
				err = second.Lock(ctx)
			}
			require.NoError(t, err, "the turn was free when the writer judged")
			require.True(t, ranOut.Load(), "the wait ran out")
			second.Unlock()
		})
	}
}

// A writer that takes its turn late, once its wait ran out, and finds the
// lock held by another process's writer fails with its deadline and gives
// the turn back: the lock is free to take once that writer lets go.
func TestAWriterTakingItsTurnLateGivesItBackWhenTheLockIsHeld(t *testing.T) {
	first, second, theirs := twoWritersAndAnother(t, closeOrderDir(t)())
	// As the second's wait runs out, the first lets go and the other
	// process's writer takes the lock.
	var taken error
	hook := func() {
		first.Unlock()
		taken = theirs.LockWithin(time.Second)
	}
	turnRanOut.Store(&hook)
	t.Cleanup(func() { turnRanOut.Store(nil) })
	require.ErrorIs(t, second.LockWithin(10*time.Millisecond), context.DeadlineExceeded)
	require.NoError(t, taken)
	turnRanOut.Store(nil)
	theirs.Unlock()
	ok, err := first.TryLock()
	require.NoError(t, err)
	require.True(t, ok, "the turn and the lock are free again")
	first.Unlock()
}

// twoWritersAndAnother makes a lock in a segment at path and returns two
// handles of this process on it, the first holding it, and one of another
// Segment attached to it, as another process's.
func twoWritersAndAnother(t *testing.T, path string) (first, second, theirs *RWLock) {
	first, theirs = mineAndTheirs(t, path)
	second, err := first.seg.RWLock(first.off)
	require.NoError(t, err)
	require.NoError(t, first.LockWithin(time.Second))
	return first, second, theirs
}
