package shm_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/shm"
)

// bound is how long a lock call may take before a test calls it hung. The
// recovery targets themselves are measured by benchmarks.
const bound = 5 * time.Second

func ctxBound(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(t.Context(), bound)
	t.Cleanup(cancel)
	return ctx
}

func TestRWLockInProcess(t *testing.T) {
	owner, _ := newSegment(t, testenv.Tmpfs(t))
	f := newLockFixture(t, owner)
	l := f.lock

	h1, err := l.RLock(ctxBound(t))
	require.NoError(t, err)
	h2, err := l.RLock(ctxBound(t))
	require.NoError(t, err, "read holds share")
	ok, err := l.TryLock()
	require.NoError(t, err)
	assert.False(t, ok, "a writer waits for readers")

	short, cancel := context.WithTimeout(t.Context(), 20*time.Millisecond)
	defer cancel()
	assert.ErrorIs(t, l.Lock(short), context.DeadlineExceeded)
	assert.Equal(t, 2, l.State().Readers[owner.Slot()])
	assert.Equal(t, -1, l.State().WriterSlot, "a writer that gave up leaves no trace")

	require.NoError(t, l.RUnlock(h1))
	require.NoError(t, l.RUnlock(h2))
	require.NoError(t, l.Lock(ctxBound(t)))
	_, ok, err = l.TryRLock()
	require.NoError(t, err)
	assert.False(t, ok, "readers wait for a writer")
	_, valid := l.Optimistic()
	assert.False(t, valid, "optimistic reads fail while a writer holds")
	l.Unlock()

	stamp, valid := l.Optimistic()
	require.True(t, valid)
	assert.True(t, l.Validate(stamp))
	require.NoError(t, l.Lock(ctxBound(t)))
	l.Unlock()
	assert.False(t, l.Validate(stamp), "a write in between invalidates the stamp")
}

// TestRWLockWithin: the time-limited calls wait as the context ones do,
// give up at their limit leaving no trace, and cost nothing when the lock
// is free.
func TestRWLockWithin(t *testing.T) {
	owner, _ := newSegment(t, testenv.Tmpfs(t))
	l := newLockFixture(t, owner).lock

	h, err := l.RLockWithin(bound)
	require.NoError(t, err)
	assert.ErrorIs(t, l.LockWithin(20*time.Millisecond), context.DeadlineExceeded, "a live reader keeps it")
	assert.Equal(t, -1, l.State().WriterSlot, "a writer that gave up leaves no trace")
	require.NoError(t, l.RUnlock(h))

	require.NoError(t, l.LockWithin(bound))
	_, err = l.RLockWithin(20 * time.Millisecond)
	assert.ErrorIs(t, err, context.DeadlineExceeded, "a writer keeps readers out")
	assert.Empty(t, l.State().Readers, "a reader that gave up leaves no hold")
	done := make(chan error, 1)
	go func() { done <- l.LockWithin(20 * time.Millisecond) }()
	assert.ErrorIs(t, <-done, context.DeadlineExceeded, "a writer keeps writers out")
	go func() { done <- l.LockWithin(bound) }()
	l.Unlock()
	require.NoError(t, <-done, "and lets the waiting one in when it goes")
	l.Unlock()

	allocs := testing.AllocsPerRun(100, func() {
		if err := l.LockWithin(bound); err != nil {
			t.Fatal(err)
		}
		l.Unlock()
		h, err := l.RLockWithin(bound)
		if err != nil {
			t.Fatal(err)
		}
		if err := l.RUnlock(h); err != nil {
			t.Fatal(err)
		}
	})
	assert.Zero(t, allocs)
}

func TestRWLockGoroutinesNeverOverlap(t *testing.T) {
	owner, _ := newSegment(t, testenv.Tmpfs(t))
	f := newLockFixture(t, owner)
	var wg sync.WaitGroup
	var torn atomic.Int64
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 2000 {
				if (g+i)%4 == 0 {
					require.NoError(t, f.lock.Lock(ctxBound(t)))
					atomic.AddUint64(f.a, 1)
					atomic.AddUint64(f.b, 1)
					f.lock.Unlock()
					continue
				}
				if stamp, ok := f.lock.Optimistic(); ok && i%2 == 0 {
					a, b := atomic.LoadUint64(f.a), atomic.LoadUint64(f.b)
					if f.lock.Validate(stamp) && a != b {
						torn.Add(1)
					}
					continue
				}
				h, err := f.lock.RLock(ctxBound(t))
				require.NoError(t, err)
				differ := atomic.LoadUint64(f.a) != atomic.LoadUint64(f.b)
				if f.lock.RUnlock(h) == nil && differ {
					torn.Add(1)
				}
			}
		}()
	}
	wg.Wait()
	assert.Zero(t, torn.Load())
	assert.Equal(t, atomic.LoadUint64(f.a), atomic.LoadUint64(f.b))
}

func TestRWLockAcrossProcesses(t *testing.T) {
	testenv.ForEachBackend(t, 4, func(t *testing.T, b hugetlb.Backend) {
		owner, o := newSegment(t, b)
		f := newLockFixture(t, owner)
		readers := []*testproc.Proc{
			testproc.Start(t, "reader", []string{o.Path, "4"}),
			testproc.Start(t, "reader", []string{o.Path, "4"}),
		}
		writer := testproc.Start(t, "writer", []string{o.Path, "3000"})
		for _, r := range readers {
			r.Expect("ready", 0)
		}
		writer.Expect("ready", 0)
		for range 3000 {
			require.NoError(t, f.lock.Lock(ctxBound(t)))
			atomic.AddUint64(f.a, 1)
			atomic.AddUint64(f.b, 1)
			f.lock.Unlock()
		}
		writer.Expect("done", 0)
		for i, r := range readers {
			r.CloseInput()
			var reads, torn int64
			_, err := fmt.Sscanf(r.Expect("done", 0), "done %d %d", &reads, &torn)
			require.NoError(t, err)
			assert.Positive(t, reads, "reader %d read", i)
			assert.Zero(t, torn, "reader %d saw a writer's half-done update", i)
		}
		assert.Equal(t, uint64(6000), atomic.LoadUint64(f.a))
		assert.Equal(t, atomic.LoadUint64(f.a), atomic.LoadUint64(f.b))
	})
}

func TestRWLockWriterRecoversFromDeadReader(t *testing.T) {
	testenv.ForEachBackend(t, 4, func(t *testing.T, b hugetlb.Backend) {
		owner, o := newSegment(t, b)
		f := newLockFixture(t, owner)
		h := testproc.Start(t, "rlock-hold", []string{o.Path})
		h.Expect("held", 0)
		slot := -1
		for s, n := range f.lock.State().Readers {
			assert.Equal(t, 1, n)
			slot = s
		}
		require.NotEqual(t, owner.Slot(), slot, "the helper holds a read lock")

		// The writer is already waiting when the reader dies.
		got := make(chan error, 1)
		go func() { got <- f.lock.Lock(ctxBound(t)) }()
		require.Eventually(t, func() bool { return f.lock.State().WriterSlot == owner.Slot() },
			bound, time.Millisecond, "the writer claims the lock and waits for the reader")
		h.Kill()
		require.Error(t, h.Wait(0))
		died := time.Now()
		require.NoError(t, <-got, "the dead reader's hold is discarded")
		t.Logf("writer got the lock %v after the reader's death", time.Since(died))
		assert.Empty(t, f.lock.State().Readers)
		f.lock.Unlock()
	})
}

func TestRWLockOwnerDiedMidUpdate(t *testing.T) {
	owner, o := newSegment(t, testenv.Tmpfs(t))
	f := newLockFixture(t, owner)
	h := testproc.Start(t, "wlock-hold", []string{o.Path})
	h.Expect("held", 0)
	_, ok, err := f.lock.TryRLock()
	require.NoError(t, err)
	assert.False(t, ok, "a live writer makes readers wait")

	h.Kill()
	require.Error(t, h.Wait(0))
	_, err = f.lock.RLock(ctxBound(t))
	assert.ErrorIs(t, err, shm.ErrOwnerDied, "readers are told instead of reading a torn update")
	_, valid := f.lock.Optimistic()
	assert.False(t, valid, "optimistic readers too")

	err = f.lock.Lock(ctxBound(t))
	require.ErrorIs(t, err, shm.ErrOwnerDied, "the next writer gets the lock and the news")
	assert.True(t, f.lock.State().Inconsistent)
	assert.NotEqual(t, atomic.LoadUint64(f.a), atomic.LoadUint64(f.b), "the update was half done")
	atomic.StoreUint64(f.b, atomic.LoadUint64(f.a))
	f.lock.MarkConsistent()
	f.lock.Unlock()

	hold, err := f.lock.RLock(ctxBound(t))
	require.NoError(t, err)
	assert.Equal(t, atomic.LoadUint64(f.a), atomic.LoadUint64(f.b))
	require.NoError(t, f.lock.RUnlock(hold))
	require.NoError(t, f.lock.Lock(ctxBound(t)), "a repaired lock is an ordinary lock again")
	f.lock.Unlock()
	_, valid = f.lock.Optimistic()
	assert.True(t, valid)
}

func TestRWLockAbandonedRepairIsNotRecoverable(t *testing.T) {
	owner, o := newSegment(t, testenv.Tmpfs(t))
	f := newLockFixture(t, owner)
	h := testproc.Start(t, "wlock-hold", []string{o.Path})
	h.Expect("held", 0)
	h.Kill()
	require.Error(t, h.Wait(0))

	require.ErrorIs(t, f.lock.Lock(ctxBound(t)), shm.ErrOwnerDied)
	f.lock.Unlock() // without MarkConsistent
	assert.ErrorIs(t, f.lock.Lock(ctxBound(t)), shm.ErrNotRecoverable)
	_, err := f.lock.RLock(ctxBound(t))
	assert.ErrorIs(t, err, shm.ErrNotRecoverable)
	_, err = f.lock.TryLock()
	assert.ErrorIs(t, err, shm.ErrNotRecoverable)
	assert.True(t, f.lock.State().NotRecoverable)
}

func TestRWLockWriterNotStarvedByReaderFlood(t *testing.T) {
	owner, o := newSegment(t, testenv.Tmpfs(t))
	f := newLockFixture(t, owner)
	floods := []*testproc.Proc{
		testproc.Start(t, "flood", []string{o.Path}),
		testproc.Start(t, "flood", []string{o.Path}),
	}
	for _, p := range floods {
		p.Expect("ready", 0)
	}
	var worst time.Duration
	for range 50 {
		start := time.Now()
		require.NoError(t, f.lock.Lock(ctxBound(t)), "a writer gets in despite the readers")
		worst = max(worst, time.Since(start))
		atomic.AddUint64(f.a, 1)
		atomic.AddUint64(f.b, 1)
		f.lock.Unlock()
	}
	t.Logf("slowest write acquisition under a reader flood: %v", worst)
	for _, p := range floods {
		p.CloseInput()
		require.NoError(t, p.Wait(0))
	}
}

// slotIn returns the process-table slot of a helper.
func slotIn(t *testing.T, s *shm.Segment, p *testproc.Proc) int {
	t.Helper()
	for _, pr := range s.Procs() {
		if pr.PID == p.PID() && pr.Alive {
			return pr.Slot
		}
	}
	t.Fatalf("pid %d holds no slot", p.PID())
	return -1
}

// A reader that is alive but stopped inside its read section cannot hold a
// writer up: the writer fences it and goes ahead, and the reader learns at
// RUnlock that what it read does not count.
func TestRWLockStalledReaderIsFenced(t *testing.T) {
	testenv.ForEachBackend(t, 4, func(t *testing.T, b hugetlb.Backend) {
		owner, o := newSegment(t, b)
		f := newLockFixture(t, owner)
		r := testproc.Start(t, "rlock-stall", []string{o.Path})
		r.Expect("held", 0)
		slot := slotIn(t, owner, r)
		r.Stop()

		require.NoError(t, f.lock.Lock(ctxBound(t)), "the writer does not wait for a stopped reader for ever")
		assert.Empty(t, f.lock.State().Readers, "the stopped reader's hold was discarded")
		assert.Equal(t, uint64(1), f.lock.State().Fences)
		atomic.AddUint64(f.a, 1)
		atomic.AddUint64(f.b, 1)
		f.lock.Unlock()

		r.Continue()
		r.Send("release")
		assert.Equal(t, "released "+shm.ErrFenced.Error(), r.Expect("released", 0),
			"the fenced reader learns its read section did not count")
		r.Send("again")
		assert.Equal(t, "again <nil>", r.Expect("again", 0), "and reads normally afterwards")
		assert.True(t, owner.Proc(slot).Alive, "fencing does not touch the process otherwise")
		r.CloseInput()
		require.NoError(t, r.Wait(0))
	})
}

// A writer dies holding the lock and a new process claims its slot: the
// newcomer must not make the dead writer look alive.
func TestRWLockDeadWriterSlotReused(t *testing.T) {
	owner, o := newSegment(t, testenv.Tmpfs(t))
	f := newLockFixture(t, owner)
	w := testproc.Start(t, "wlock-hold", []string{o.Path})
	w.Expect("held", 0)
	slot := slotIn(t, owner, w)
	w.Kill()
	require.Error(t, w.Wait(0))

	n := testproc.Start(t, "attach", []string{o.Path})
	require.Equal(t, fmt.Sprintf("slot %d", slot), n.Expect("slot", 0), "the newcomer reuses the dead writer's slot")

	_, err := f.lock.RLock(ctxBound(t))
	assert.ErrorIs(t, err, shm.ErrOwnerDied, "readers are not fooled by the newcomer")
	require.ErrorIs(t, f.lock.Lock(ctxBound(t)), shm.ErrOwnerDied, "the next writer takes over")
	atomic.StoreUint64(f.b, atomic.LoadUint64(f.a))
	f.lock.MarkConsistent()
	f.lock.Unlock()
	h, err := f.lock.RLock(ctxBound(t))
	require.NoError(t, err)
	require.NoError(t, f.lock.RUnlock(h))
	n.CloseInput()
	require.NoError(t, n.Wait(0))
}

// A takeover that cannot drain the readers leaves the dead writer's mark in
// place: no reader may enter the half-done update it was about to repair.
func TestRWLockFailedTakeoverStaysInconsistent(t *testing.T) {
	owner, o := newSegment(t, testenv.Tmpfs(t))
	f := newLockFixture(t, owner)
	r := testproc.Start(t, "rlock-stall", []string{o.Path})
	r.Expect("held", 0)
	// The writer waits for the reader (it would fence it only after ten
	// minutes) and dies while it waits, holding the word.
	w := testproc.Start(t, "wlock-hold", []string{o.Path, "10m"})
	wslot := -1
	require.Eventually(t, func() bool {
		for _, p := range owner.Procs() {
			if p.PID == w.PID() {
				wslot = p.Slot
			}
		}
		return wslot >= 0 && f.lock.State().WriterSlot == wslot
	}, bound, time.Millisecond, "the writer claims the lock and waits for the reader")
	w.Kill()
	require.Error(t, w.Wait(0))

	ok, err := f.lock.TryLock()
	require.NoError(t, err)
	assert.False(t, ok, "a live reader keeps the takeover from finishing")
	short, cancel := context.WithTimeout(t.Context(), 20*time.Millisecond)
	defer cancel()
	assert.ErrorIs(t, f.lock.Lock(short), context.DeadlineExceeded)

	st := f.lock.State()
	assert.Equal(t, wslot, st.WriterSlot, "the dead writer's mark is back")
	assert.True(t, st.Inconsistent)
	_, err = f.lock.RLock(ctxBound(t))
	assert.ErrorIs(t, err, shm.ErrOwnerDied, "readers do not enter unrepaired state")
	_, valid := f.lock.Optimistic()
	assert.False(t, valid, "optimistic readers neither")

	require.ErrorIs(t, f.lock.Lock(ctxBound(t)), shm.ErrOwnerDied, "a writer that may wait fences the reader and repairs")
	f.lock.MarkConsistent()
	f.lock.Unlock()
	r.Send("release")
	assert.Equal(t, "released "+shm.ErrFenced.Error(), r.Expect("released", 0))
	r.CloseInput()
	require.NoError(t, r.Wait(0))
}
