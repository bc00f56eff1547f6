package cache

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/shm"
)

// TestReadLockedStaysWithinLockTimeout: LockTimeout bounds a read under
// the global lock as a whole — the wait for a writer and the read sections
// that writers fence and that run again. Here a secondary's read waits
// behind a writer for most of the timeout, then has its read section
// fenced by every write the primary makes: the time left after the first
// fenced pass is not enough for another, so there is none. (A limit
// started afresh at the first fence ran the section three times.)
func TestReadLockedStaysWithinLockTimeout(t *testing.T) {
	const (
		timeout = time.Second
		behind  = 700 * time.Millisecond // how long the writer keeps the reader waiting
		section = 400 * time.Millisecond // longer than shm.DefaultFenceAfter, and than timeout-behind
	)
	p := newPrimary(t, fixtureConfig{lockTimeout: timeout})
	o := p.opts // another attachment, as a secondary's: its own reader line
	o.Role = shm.RoleSecondary
	seg, err := shm.Attach(o)
	require.NoError(t, err)
	t.Cleanup(func() { seg.Close() })
	v, err := AttachGlobal(seg, quiet, timeout)
	require.NoError(t, err)
	release := p.holdLock(t)

	type result struct {
		err  error
		runs int
	}
	done := make(chan result, 1)
	go func() {
		runs := 0
		err := v.readLocked(func() error {
			runs++
			time.Sleep(section) // a slow read section, the workload
			return nil
		})
		done <- result{err, runs}
	}()
	require.Eventually(t, func() bool { return p.g.lock.State().Waiters > 0 }, 5*time.Second, time.Millisecond,
		"the reader waits for the writer")
	time.Sleep(behind) // the writer's section, the workload
	require.NoError(t, release())

	// The primary goes on writing: each write fences the read section in
	// progress after shm.DefaultFenceAfter.
	ctx, stop := context.WithCancel(t.Context())
	var wg sync.WaitGroup
	wg.Go(func() {
		for ctx.Err() == nil {
			_ = p.g.Exclusive(func() {})
		}
	})
	r := <-done
	stop()
	wg.Wait()
	t.Logf("readLocked: %v after %d runs of the read section", r.err, r.runs)
	assert.LessOrEqual(t, r.runs, 1, "a fenced read section ran again past LockTimeout")
	switch r.runs {
	case 0: // a machine too slow to let the reader in before the limit
		assert.ErrorIs(t, r.err, context.DeadlineExceeded)
	case 1:
		assert.ErrorIs(t, r.err, shm.ErrFenced)
	}
}
