package shm_test

import (
	"os"
	"path/filepath"
	"sync/atomic"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/shm"
)

func openReadOnly(t testing.TB, o shm.Options) (*shm.Segment, shm.Info) {
	t.Helper()
	s, info, err := shm.OpenReadOnly(o)
	require.NoError(t, err)
	t.Cleanup(func() { s.Close() })
	return s, info
}

func TestOpenReadOnlySeesEverythingAndClaimsNothing(t *testing.T) {
	testenv.ForEachBackend(t, 2, func(t *testing.T, b hugetlb.Backend) {
		owner, o := newSegment(t, b)
		off, err := owner.Alloc(64, 64)
		require.NoError(t, err)
		require.NoError(t, owner.SetRoot(shm.RootUser, off))
		atomic.StoreUint64(shm.At[uint64](owner, off), 0xfeedface)
		other := attach(t, o)
		before := owner.Procs()

		ro, info := openReadOnly(t, o)
		assert.True(t, ro.ReadOnly())
		assert.Equal(t, "ready", info.State)
		assert.Equal(t, b.Kind == hugetlb.Hugetlbfs, info.Hugetlbfs)
		assert.Equal(t, -1, ro.Slot(), "no slot is claimed")
		assert.Equal(t, before, owner.Procs(), "the process table is unchanged")
		assert.Equal(t, before, ro.Procs(), "and reads the same from the read-only view")
		assert.True(t, ro.Alive(owner.Slot()))
		assert.True(t, ro.Alive(other.Slot()))
		assert.Equal(t, uint64(0xfeedface), atomic.LoadUint64(shm.At[uint64](ro, off)))

		// Growth after opening is visible: the whole reservation is mapped.
		big, err := owner.Alloc(owner.Size(), 64)
		require.NoError(t, err)
		atomic.StoreUint64(shm.At[uint64](owner, big), 7)
		assert.Equal(t, uint64(7), atomic.LoadUint64(shm.At[uint64](ro, big)))
		assert.Equal(t, owner.ArenaStats(), ro.ArenaStats())

		_, err = ro.Alloc(64, 64)
		assert.ErrorIs(t, err, shm.ErrNotOwner)
		_, err = ro.NewRWLock()
		assert.ErrorIs(t, err, shm.ErrNotOwner)
		ro.MarkDead()
		assert.True(t, owner.Ready(), "MarkDead through a read-only view does nothing")
		assert.Empty(t, ro.Reap(), "nor does Reap")
		require.NoError(t, ro.Close())
		require.NoError(t, ro.Close(), "Close is idempotent")
		assert.Equal(t, before, owner.Procs())
	})
}

func TestOpenReadOnlyAcceptsDeadAndRefusesForeign(t *testing.T) {
	owner, o := newSegment(t, testenv.Tmpfs(t))
	h := testproc.Start(t, "attach", []string{o.Path})
	slot := slotOf(t, h)
	h.Kill()
	require.Error(t, h.Wait(0))
	owner.MarkDead()

	ro, info := openReadOnly(t, o)
	assert.Equal(t, "dead", info.State, "a dead segment can still be described")
	p := ro.Proc(slot)
	assert.True(t, p.Live && !p.Alive, "the killed process shows as live in the table, dead to the kernel")

	// Without the lock file nobody can hold a slot.
	noLock := o
	noLock.LockPath = o.Path + ".missing"
	ro2, _ := openReadOnly(t, noLock)
	assert.False(t, ro2.Alive(owner.Slot()))
	_, err := os.Stat(noLock.LockPath)
	assert.ErrorIs(t, err, os.ErrNotExist, "nothing is created")

	other := o
	other.LayoutTag++
	_, _, err = shm.OpenReadOnly(other)
	assert.ErrorIs(t, err, shm.ErrLayoutMismatch)

	junk := testenv.File(t, testenv.Tmpfs(t).Dir)
	require.NoError(t, os.WriteFile(junk, make([]byte, 8192), 0o600))
	_, _, err = shm.OpenReadOnly(opts(junk))
	assert.ErrorIs(t, err, shm.ErrNotReady, "an all-zero header is not a segment yet")
	_, err = os.Stat(junk + ".lock")
	assert.ErrorIs(t, err, os.ErrNotExist)
}

func TestLockViewDescribesWithoutTakingPart(t *testing.T) {
	owner, o := newSegment(t, testenv.Tmpfs(t))
	f := newLockFixture(t, owner)
	lockOff := f.lock.State().Offset
	ro, _ := openReadOnly(t, o)
	v, err := ro.ViewLock(lockOff)
	require.NoError(t, err)
	_, err = ro.RWLock(lockOff)
	assert.Error(t, err, "a read-only view has no slot to lock with")
	_, err = ro.ViewLock(lockOff + 64)
	assert.ErrorIs(t, err, shm.ErrBadOffset, "only registered locks")

	stamp, ok := v.Optimistic()
	require.True(t, ok)
	assert.True(t, v.Validate(stamp))
	assert.False(t, v.Abandoned())
	assert.Equal(t, f.lock.State(), v.State())

	hold, err := f.lock.RLock(ctxBound(t))
	require.NoError(t, err)
	assert.Equal(t, map[int]int{owner.Slot(): 1}, v.State().Readers)
	require.NoError(t, f.lock.RUnlock(hold))

	require.NoError(t, f.lock.Lock(ctxBound(t)))
	_, ok = v.Optimistic()
	assert.False(t, ok, "a writer is in")
	assert.False(t, v.Validate(stamp))
	assert.Equal(t, owner.Slot(), v.State().WriterSlot)
	assert.False(t, v.Abandoned(), "its writer lives")
	f.lock.Unlock()

	// A writer that dies holding the lock leaves it abandoned.
	h := testproc.Start(t, "wlock-hold", []string{o.Path})
	h.Expect("held", 0)
	slot := -1
	for _, p := range owner.Procs() {
		if p.PID == h.PID() {
			slot = p.Slot
		}
	}
	assert.False(t, v.Abandoned())
	h.Kill()
	require.Error(t, h.Wait(0))
	st := v.State()
	assert.Equal(t, slot, st.WriterSlot)
	assert.True(t, v.Abandoned(), "held by a dead writer")
	_, ok = v.Optimistic()
	assert.False(t, ok)

	require.ErrorIs(t, f.lock.Lock(ctxBound(t)), shm.ErrOwnerDied)
	assert.False(t, v.Abandoned(), "taken over by a live process")
	assert.True(t, v.State().Inconsistent)
	f.lock.Unlock() // without MarkConsistent
	assert.True(t, v.Abandoned(), "a lock that can never be taken again")
	assert.True(t, v.State().NotRecoverable)
}

// What is not a regular file where a segment should be (a FIFO another
// process could hold open, a directory) is refused at once by every way
// of opening one without taking part: not waited on, not mapped.
func TestOpenersRefuseWhatIsNoRegularFile(t *testing.T) {
	dir := t.TempDir()
	fifo := filepath.Join(dir, "fifo")
	require.NoError(t, syscall.Mkfifo(fifo, 0o600))
	sub := filepath.Join(dir, "dir")
	require.NoError(t, os.Mkdir(sub, 0o700))
	for _, path := range []string{fifo, sub} {
		_, _, err := shm.OpenReadOnly(shm.Options{Path: path})
		assert.ErrorIs(t, err, shm.ErrBadMagic, "OpenReadOnly %s", path)
		_, err = shm.Probe(path, 0)
		assert.ErrorIs(t, err, shm.ErrBadMagic, "Probe %s", path)
	}
	assert.Error(t, shm.MarkDeadFile(fifo), "MarkDeadFile of a FIFO")
}
