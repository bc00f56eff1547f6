package shm_test

import (
	"context"
	"fmt"
	"math"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/shm"
)

// ownerWord returns the fixture lock's owner word, which any process
// mapping the segment can write.
func (f *lockFixture) ownerWord() *uint64 {
	data := f.seg.Root(shm.RootUser)
	return shm.At[uint64](f.seg, atomic.LoadUint64(shm.At[uint64](f.seg, data+fixLock)))
}

// Another process writes this process's own mark (its slot and epoch,
// which the process table shows) into the owner word while no writer of
// this process holds the lock. The writers of this process must not take
// the word for a hold of their own and wait for it to go, which it never
// would: the lock is taken back, as from a writer that died, and the
// writer told to repair what it guards.
func TestRWLockTakesBackAnOwnerWordForgedWithItsOwnMark(t *testing.T) {
	owner, _ := newSegment(t, testenv.Tmpfs(t))
	f := newLockFixture(t, owner)
	word := f.ownerWord()
	require.NoError(t, f.lock.Lock(ctxBound(t)))
	mark := atomic.LoadUint64(word)
	f.lock.Unlock()
	require.NotZero(t, mark)

	atomic.StoreUint64(word, mark) // the other process's write
	require.ErrorIs(t, f.lock.LockWithin(time.Second), shm.ErrOwnerDied)
	require.True(t, f.lock.State().Inconsistent)
	f.lock.MarkConsistent()
	f.lock.Unlock()
	require.NoError(t, f.lock.Lock(ctxBound(t)), "an ordinary lock again")
	f.lock.Unlock()

	atomic.StoreUint64(word, mark)
	ok, err := f.lock.TryLock()
	require.ErrorIs(t, err, shm.ErrOwnerDied, "TryLock takes it back too")
	require.True(t, ok)
	f.lock.MarkConsistent()
	f.lock.Unlock()
}

// The owner word rewritten while this process holds the lock: letting go
// must not crash the process (a panic in Unlock would take the primary
// down), and the lock works afterwards.
func TestRWLockUnlockSurvivesARewrittenOwnerWord(t *testing.T) {
	owner, _ := newSegment(t, testenv.Tmpfs(t))
	f := newLockFixture(t, owner)
	word := f.ownerWord()
	for _, forged := range []uint64{0, 7<<32 | 3} {
		require.NoError(t, f.lock.Lock(ctxBound(t)))
		atomic.StoreUint64(word, forged)
		require.NotPanics(t, f.lock.Unlock)
		require.NoError(t, f.lock.LockWithin(time.Second))
		f.lock.Unlock()
	}
	require.Panics(t, f.lock.Unlock, "an Unlock without a Lock is still a bug of the caller")
}

// "Unrecoverable" written into the owner word of a lock whose segment this
// process owns, which it never left so: the owner's writer takes it back
// and repairs, instead of failing every write for good. A lock the owner
// did leave unrecoverable stays so (TestRWLockAbandonedRepairIsNotRecoverable).
func TestRWLockOwnerTakesBackAForgedUnrecoverableWord(t *testing.T) {
	owner, _ := newSegment(t, testenv.Tmpfs(t))
	f := newLockFixture(t, owner)
	atomic.StoreUint64(f.ownerWord(), math.MaxUint32)
	require.ErrorIs(t, f.lock.LockWithin(time.Second), shm.ErrOwnerDied)
	f.lock.MarkConsistent()
	f.lock.Unlock()
	require.NoError(t, f.lock.Lock(ctxBound(t)))
	f.lock.Unlock()
	require.False(t, f.lock.State().NotRecoverable)
}

// flagsWord is the lock head's Flags word (right after the 8-byte owner
// word), which any process mapping the segment can write just as it can
// the owner word.
func (f *lockFixture) flagsWord() *uint32 {
	data := f.seg.Root(shm.RootUser)
	return shm.At[uint32](f.seg, atomic.LoadUint64(shm.At[uint64](f.seg, data+fixLock))+8)
}

// Another process sets the "inconsistent" flag while this process holds
// the lock in an ordinary hold (no ErrOwnerDied, no repair owed). Unlock
// must not take it for a repair this process skipped and abandon the
// lock: the next write takes it as ever.
func TestRWLockForgedFlagUnderAHoldIsNoAbandonment(t *testing.T) {
	owner, _ := newSegment(t, testenv.Tmpfs(t))
	f := newLockFixture(t, owner)
	require.NoError(t, f.lock.Lock(ctxBound(t)), "an ordinary hold, no takeover")
	atomic.StoreUint32(f.flagsWord(), 1) // the other process's only write
	f.lock.Unlock()
	t.Logf("after Unlock: %+v", f.lock.State())

	err := f.lock.LockWithin(time.Second)
	if err == shm.ErrOwnerDied {
		f.lock.MarkConsistent()
		f.lock.Unlock()
		err = nil
	}
	require.NoError(t, err, "one forged flag word ended every write of the segment's owner")
}

// Two handles on one lock in one process (Segment.RWLock called twice for
// one offset): a writer of one must wait while a writer of the other
// holds the lock, not take the process's own mark for a forged one.
func TestRWLockHandlesOfOneProcessExcludeEachOther(t *testing.T) {
	owner, _ := newSegment(t, testenv.Tmpfs(t))
	f1 := newLockFixture(t, owner)
	f2, err := openFixture(owner)
	require.NoError(t, err)
	require.NoError(t, f1.lock.Lock(ctxBound(t)))
	err = f2.lock.LockWithin(200 * time.Millisecond)
	require.ErrorIs(t, err, context.DeadlineExceeded, "a second handle's writer got the lock while the first's held it")
	f1.lock.Unlock()
	require.NoError(t, f2.lock.LockWithin(time.Second), "and gets it once the first lets go")
	f2.lock.Unlock()
}

// A lock only the segment's owner writes (OwnerWritesOnly, the global
// cache's): another process writes the mark of a live process, here a
// real one attached in a slot of its own, into the owner word. The owner
// takes the lock back, as from a writer that died, instead of waiting for
// a hold that process never took; a lock without the declaration still
// waits for it.
func TestRWLockOwnerWritesOnlyTakesBackAWordNamingAnotherLiveProcess(t *testing.T) {
	owner, o := newSegment(t, testenv.Tmpfs(t))
	f := newLockFixture(t, owner)
	h := testproc.Start(t, "attach", []string{o.Path})
	var slot int
	_, err := fmt.Sscanf(h.Expect("slot ", 0), "slot %d", &slot)
	require.NoError(t, err)
	p := owner.Proc(slot)
	require.True(t, p.Alive)
	mark := uint64(p.Epoch)<<32 | uint64(slot+1)

	atomic.StoreUint64(f.ownerWord(), mark)
	require.ErrorIs(t, f.lock.LockWithin(50*time.Millisecond), context.DeadlineExceeded,
		"a lock any process may write waits for a live writer")

	f.lock.OwnerWritesOnly()
	require.ErrorIs(t, f.lock.LockWithin(10*time.Second), shm.ErrOwnerDied)
	f.lock.MarkConsistent()
	f.lock.Unlock()

	atomic.StoreUint64(f.ownerWord(), mark)
	ok, err := f.lock.TryLock()
	require.ErrorIs(t, err, shm.ErrOwnerDied, "TryLock takes it back too")
	require.True(t, ok)
	f.lock.MarkConsistent()
	f.lock.Unlock()
}
