package shm

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// A wait that saw the lock held and then did not run past its deadline
// (its process stopped, traced, starved of CPU) looks once more before it
// fails: the holder may have let go meanwhile. A reader waiting for a
// writer, a writer waiting for another process's writer and a writer
// waiting for readers to leave all take the lock then, whether the wait
// was bounded by a time or by a context's deadline.
func TestAWaitThatDidNotRunPastItsDeadlineLooksAgainBeforeItFails(t *testing.T) {
	newDir := closeOrderDir(t)
	const wait = 10 * time.Millisecond
	for _, waiter := range []string{"reader", "writer", "drain"} {
		for _, how := range []string{"within", "context"} {
			t.Run(waiter+"/"+how, func(t *testing.T) {
				mine, theirs := mineAndTheirs(t, newDir())
				var err error
				// The holder, and the waiter's hold's undoing, as the
				// waiter stalls.
				var letGo func()
				switch waiter {
				case "reader", "writer": // the owner's writer holds
					require.NoError(t, mine.LockWithin(time.Second))
					letGo = mine.Unlock
				case "drain": // another process's reader holds
					h, err := theirs.RLockWithin(time.Second)
					require.NoError(t, err)
					letGo = func() { require.NoError(t, theirs.RUnlock(h)) }
					mine.SetFenceAfter(time.Minute) // the stall fences nobody
				}
				stalled := false
				hook := func(deadline time.Time) {
					if stalled {
						return
					}
					stalled = true
					letGo()
					// The stall: the waiter does not run until its
					// deadline has passed.
					time.Sleep(time.Until(deadline))
				}
				heldSeen.Store(&hook)
				t.Cleanup(func() { heldSeen.Store(nil) })

				var ctx context.Context = context.Background()
				if how == "context" {
					c, cancel := context.WithTimeout(ctx, wait)
					defer cancel()
					ctx = c
				}
				switch waiter {
				case "reader":
					var h ReadHold
					if how == "within" {
						h, err = theirs.RLockWithin(wait)
					} else {
						h, err = theirs.RLock(ctx)
					}
					require.NoError(t, err, "the writer had gone when the reader looked again")
					require.True(t, stalled)
					require.NoError(t, theirs.RUnlock(h))
				default:
					l := theirs
					if waiter == "drain" {
						l = mine
					}
					if how == "within" {
						err = l.LockWithin(wait)
					} else {
						err = l.Lock(ctx)
					}
					require.NoError(t, err, "the holder had gone when the writer looked again")
					require.True(t, stalled)
					l.Unlock()
				}
				requireFree(t, theirs)
			})
		}
	}
}

// A writer whose wait ran out while its process was stopped, past the
// time after which it fences a live reader too, does not fence the reader
// at its look after the deadline: the stop was the writer's. It fails
// with its deadline, and the reader's hold stands.
func TestAWriterStoppedPastItsDeadlineFencesNoReaderAtItsLastLook(t *testing.T) {
	newDir := closeOrderDir(t)
	const wait, fence = 10 * time.Millisecond, 30 * time.Millisecond
	for _, how := range []string{"within", "context"} {
		t.Run(how, func(t *testing.T) {
			mine, theirs := mineAndTheirs(t, newDir())
			h, err := theirs.RLockWithin(time.Second)
			require.NoError(t, err)
			mine.SetFenceAfter(fence)
			stalled := false
			hook := func(deadline time.Time) {
				if !stalled {
					stalled = true
					// The stop: past the deadline and the fence time.
					time.Sleep(time.Until(deadline) + 2*fence)
				}
			}
			heldSeen.Store(&hook)
			t.Cleanup(func() { heldSeen.Store(nil) })
			if how == "within" {
				err = mine.LockWithin(wait)
			} else {
				ctx, cancel := context.WithTimeout(context.Background(), wait)
				defer cancel()
				err = mine.Lock(ctx)
			}
			require.ErrorIs(t, err, context.DeadlineExceeded)
			require.True(t, stalled)
			require.NoError(t, theirs.RUnlock(h), "the reader's hold was fenced")
			requireFree(t, mine)
		})
	}
}

// A wait that is cancelled fails with the cancellation though the holder
// let go meanwhile: it takes nothing after its caller gave up.
func TestACancelledWaitDoesNotLookAgain(t *testing.T) {
	newDir := closeOrderDir(t)
	for _, waiter := range []string{"reader", "writer"} {
		t.Run(waiter, func(t *testing.T) {
			mine, theirs := mineAndTheirs(t, newDir())
			var err error
			require.NoError(t, mine.LockWithin(time.Second))
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			hook := func(time.Time) {
				cancel()
				mine.Unlock()
			}
			heldSeen.Store(&hook)
			t.Cleanup(func() { heldSeen.Store(nil) })
			if waiter == "reader" {
				_, err = theirs.RLock(ctx)
			} else {
				err = theirs.Lock(ctx)
			}
			require.ErrorIs(t, err, context.Canceled)
			requireFree(t, theirs)
		})
	}
}

// mineAndTheirs makes a lock in a segment at path and returns a handle of
// this process, the segment's owner, on it and one of another Segment
// attached to it, as another process's.
func mineAndTheirs(t *testing.T, path string) (mine, theirs *RWLock) {
	owner, other := ownerAndOther(t, path)
	off, err := owner.NewRWLock()
	require.NoError(t, err)
	mine, err = owner.RWLock(off)
	require.NoError(t, err)
	theirs, err = other.RWLock(off)
	require.NoError(t, err)
	return mine, theirs
}

// requireFree unsets the heldSeen hook and checks, through l, that the
// lock is free: nobody holds it and no reader is in.
func requireFree(t *testing.T, l *RWLock) {
	heldSeen.Store(nil)
	ok, err := l.TryLock()
	require.NoError(t, err)
	require.True(t, ok, "the lock is free again")
	l.Unlock()
}
