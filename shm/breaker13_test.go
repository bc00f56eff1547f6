package shm_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/shm"
)

// noPanic runs fn and returns what it panicked with, as an error.
func noPanic(fn func() error) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("panicked: %v", r)
		}
	}()
	return fn()
}

// Breaker 13: CloseUnderReaders promises a reader left behind "an empty
// segment (no generation, no MR, no lock held) instead of faulting". A
// reader that holds the lock when the segment is vacated gives its hold
// back to a zero reader line. The owner's reader line has generation 0
// (the locks are made after its slot was claimed), as does the vacated
// one: RUnlock finds its own generation with no hold and panics
// (errUnbalanced), where an attacher's (generation 1 or more) learns the
// hold was discarded (ErrFenced). A write hold across the vacate panics in
// Unlock for the same reason. The primary's lookups that fall back to the
// read lock (cache.Global.lookupLocked), Global.Shared and Global.Exclusive
// are such holds.
func TestBreaker13LockHeldAcrossCloseUnderReaders(t *testing.T) {
	for _, who := range []string{"owner", "attacher"} {
		t.Run(who+"/read", func(t *testing.T) {
			owner, o := newSegment(t, testenv.Tmpfs(t))
			f := newLockFixture(t, owner)
			if who == "attacher" {
				var err error
				f, err = openFixture(attach(t, o))
				require.NoError(t, err)
			}
			h, err := f.lock.RLock(context.Background())
			require.NoError(t, err)
			vacated, err := f.seg.CloseUnderReaders()
			require.NoError(t, err)
			require.True(t, vacated)
			err = noPanic(func() error { return f.lock.RUnlock(h) })
			assert.ErrorIs(t, err, shm.ErrClosed, "the hold was not kept: the read section must not count")
		})
	}
	t.Run("owner/write", func(t *testing.T) {
		owner, _ := newSegment(t, testenv.Tmpfs(t))
		f := newLockFixture(t, owner)
		require.NoError(t, f.lock.Lock(context.Background()))
		vacated, err := owner.CloseUnderReaders()
		require.NoError(t, err)
		require.True(t, vacated)
		err = noPanic(func() error { f.lock.Unlock(); return nil })
		assert.NoError(t, err, "Unlock after the segment was vacated under the writer")
	})
}
