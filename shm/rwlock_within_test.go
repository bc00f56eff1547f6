package shm_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/shm"
)

// TestRWLockWithinStoppedReader: a reader process stopped (SIGSTOP)
// inside its read section. LockWithin shorter than the fence gives up at
// its limit and leaves the hold alone; TryLock fails at once; LockWithin
// longer than the fence fences the hold after DefaultFenceAfter and goes
// ahead; the resumed reader learns it was fenced.
func TestRWLockWithinStoppedReader(t *testing.T) {
	owner, o := newSegment(t, testenv.Tmpfs(t))
	f := newLockFixture(t, owner)
	r := testproc.Start(t, "rlock-stall", []string{o.Path})
	r.Expect("held", 0)
	r.Stop()

	took, err := testenv.Bounded(t, "LockWithin(20ms)", 2*time.Second, func() error { return f.lock.LockWithin(20 * time.Millisecond) })
	t.Logf("LockWithin(20ms): %v after %v", err, took)
	assert.ErrorIs(t, err, context.DeadlineExceeded)
	st := f.lock.State()
	assert.Equal(t, -1, st.WriterSlot, "no trace of the writer that gave up")
	assert.Len(t, st.Readers, 1, "the stopped reader's hold is still there")
	assert.Zero(t, st.Fences)

	_, err = testenv.Bounded(t, "TryLock", time.Second, func() error {
		ok, err := f.lock.TryLock()
		if err == nil && ok {
			f.lock.Unlock()
			t.Error("TryLock got the lock past a live reader")
		}
		return err
	})
	assert.NoError(t, err)

	took, err = testenv.Bounded(t, "LockWithin(5s)", 5*time.Second, func() error { return f.lock.LockWithin(5 * time.Second) })
	t.Logf("LockWithin(5s) past a stopped reader: %v after %v", err, took)
	require.NoError(t, err)
	assert.GreaterOrEqual(t, took, shm.DefaultFenceAfter-5*time.Millisecond, "no fence before DefaultFenceAfter")
	assert.Equal(t, uint64(1), f.lock.State().Fences)
	f.lock.Unlock()

	r.Continue()
	r.Send("release")
	assert.Equal(t, "released "+shm.ErrFenced.Error(), r.Expect("released", 0))
	r.CloseInput()
	require.NoError(t, r.Wait(0))
}

// TestRWLockWithinStoppedWriter: a writer process stopped while it
// holds the write lock. RLockWithin and LockWithin each give up at their
// limit, counted from when they first had to wait, and leave nothing
// behind.
func TestRWLockWithinStoppedWriter(t *testing.T) {
	owner, o := newSegment(t, testenv.Tmpfs(t))
	f := newLockFixture(t, owner)
	w := testproc.Start(t, "wlock-hold", []string{o.Path})
	w.Expect("held", 0)
	w.Stop()

	const d = 100 * time.Millisecond
	took, err := testenv.Bounded(t, "RLockWithin", 2*time.Second, func() error {
		h, err := f.lock.RLockWithin(d)
		if err == nil {
			_ = f.lock.RUnlock(h)
		}
		return err
	})
	t.Logf("RLockWithin(%v) under a stopped writer: %v after %v", d, err, took)
	assert.ErrorIs(t, err, context.DeadlineExceeded)
	assert.GreaterOrEqual(t, took, d-5*time.Millisecond)
	assert.Empty(t, f.lock.State().Readers, "a reader that gave up leaves no hold")

	took, err = testenv.Bounded(t, "LockWithin", 2*time.Second, func() error { return f.lock.LockWithin(d) })
	t.Logf("LockWithin(%v) under a stopped writer: %v after %v", d, err, took)
	assert.ErrorIs(t, err, context.DeadlineExceeded)
	assert.GreaterOrEqual(t, took, d-5*time.Millisecond)
	assert.NotEqual(t, owner.Slot(), f.lock.State().WriterSlot)
}

// TestRWLockWithinDeadReader: a reader killed while it holds. The
// writer discards its hold without waiting for the fence.
func TestRWLockWithinDeadReader(t *testing.T) {
	owner, o := newSegment(t, testenv.Tmpfs(t))
	f := newLockFixture(t, owner)
	r := testproc.Start(t, "rlock-hold", []string{o.Path})
	r.Expect("held", 0)
	r.Kill()
	require.Error(t, r.Wait(0))
	took, err := testenv.Bounded(t, "LockWithin", 2*time.Second, func() error { return f.lock.LockWithin(time.Second) })
	require.NoError(t, err)
	t.Logf("LockWithin past a dead reader: %v", took)
	assert.Zero(t, f.lock.State().Fences, "a dead reader's hold is discarded, not fenced")
	f.lock.Unlock()
}
