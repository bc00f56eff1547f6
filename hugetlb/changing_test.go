package hugetlb_test

import (
	"os"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/sys/vm"
	"github.com/mpmr/mpmr/internal/test/testenv"
)

// freeing is Memory.Freeing for pages whose free is past its guards.
func freeing(t *testing.T, m *hugetlb.Memory, addr uintptr, n uint64) bool {
	t.Helper()
	f, undecided := m.Freeing(addr, n)
	require.Nil(t, undecided, "a free's guards have not answered")
	return f
}

// blockEvents subscribes a subscriber that, for the first event of kind,
// says so on entered and waits until release is closed, as the primary's
// sync waits for a secondary that does not answer.
func blockEvents(t *testing.T, in *instance, kind hugetlb.EventKind) (entered chan hugetlb.Event, release chan struct{}) {
	entered, release = make(chan hugetlb.Event, 1), make(chan struct{})
	var first atomic.Bool
	t.Cleanup(in.mem.Subscribe(func(e hugetlb.Event) {
		if e.Kind == kind && !first.Swap(true) {
			entered <- e
			<-release
		}
	}))
	return entered, release
}

// A Free delivers EventFree without the memory lock: while a subscriber
// waits, the MR cache's re-check (RLock and the queries) goes on, the
// pages are still allocated and mapped, Freeing reports them (and only
// them), no Alloc hands them out and no other Free takes them. Once the
// subscriber returns, the free completes.
func TestAFreeWaitingForItsSubscribersHoldsNoLock(t *testing.T) {
	b := testenv.Tmpfs(t)
	ps := b.PageSize
	in := newInstance(t, b, hugetlb.ListConfig{Pages: 4})
	r, err := in.mem.Alloc(2 * ps)
	require.NoError(t, err)
	other, err := in.mem.Alloc(ps)
	require.NoError(t, err)
	r.Bytes()[0] = 9
	entered, release := blockEvents(t, in, hugetlb.EventFree)

	freed := make(chan error, 1)
	go func() { freed <- in.mem.Free(r) }()
	assert.Equal(t, hugetlb.Event{Kind: hugetlb.EventFree, Addr: r.Addr, Len: r.Len}, <-entered)

	_, err = testenv.Bounded(t, "the queries while a free's subscriber waits", 20*time.Second, func() error {
		in.mem.RLock()
		defer in.mem.RUnlock()
		run, ok := in.mem.ContigRun(r.Addr)
		assert.True(t, ok, "still allocated")
		assert.Equal(t, r.Addr, run.Start)
		assert.True(t, freeing(t, in.mem, r.Addr, r.Len))
		assert.True(t, freeing(t, in.mem, r.End()-1, 1))
		assert.True(t, freeing(t, in.mem, r.Addr-uintptr(ps), 2*ps), "a range that overlaps it")
		assert.False(t, freeing(t, in.mem, other.Addr, other.Len), "other memory")
		assert.False(t, freeing(t, in.mem, r.Addr, 0))
		return nil
	})
	require.NoError(t, err)
	assert.Equal(t, byte(9), r.Bytes()[0], "still mapped, with its contents")

	_, err = testenv.Bounded(t, "Alloc and Free while a free's subscriber waits", 20*time.Second, func() error {
		err := in.mem.Free(hugetlb.Region{Addr: r.Addr + uintptr(ps), Len: ps})
		assert.ErrorIs(t, err, hugetlb.ErrDoubleFree, "a free of pages being freed")
		assert.ErrorContains(t, err, "being freed")
		last, err := in.mem.Alloc(ps)
		require.NoError(t, err)
		assert.Equal(t, in.region(3, 1), last, "the one free page, not one being freed")
		_, err = in.mem.Alloc(ps)
		assert.ErrorIs(t, err, hugetlb.ErrNoFreeRun, "pages being freed are not free yet")
		return in.mem.Free(last)
	})
	require.NoError(t, err)

	close(release)
	require.NoError(t, <-freed)
	assert.False(t, freeing(t, in.mem, r.Addr, r.Len))
	assert.ErrorIs(t, vm.CheckReadable(r.Addr, uintptr(r.Len)), vm.ErrNotMapped)
	_, ok := in.mem.PageOf(r.Addr)
	assert.False(t, ok)
	again, err := in.mem.Alloc(2 * ps)
	require.NoError(t, err)
	assert.Equal(t, r, again, "free now")
}

// An Alloc delivers EventAlloc without the memory lock too; its pages are
// the caller's only once it returns, so no Free takes them meanwhile.
func TestAnAllocWaitingForItsSubscribersKeepsItsPages(t *testing.T) {
	b := testenv.Tmpfs(t)
	in := newInstance(t, b, hugetlb.ListConfig{Pages: 2})
	entered, release := blockEvents(t, in, hugetlb.EventAlloc)
	type result struct {
		r   hugetlb.Region
		err error
	}
	done := make(chan result, 1)
	go func() {
		r, err := in.mem.Alloc(b.PageSize)
		done <- result{r, err}
	}()
	e := <-entered
	_, err := testenv.Bounded(t, "a free while an alloc's subscriber waits", 20*time.Second, func() error {
		return in.mem.Free(hugetlb.Region{Addr: e.Addr, Len: e.Len})
	})
	assert.ErrorIs(t, err, hugetlb.ErrDoubleFree)
	assert.ErrorContains(t, err, "being allocated")
	assert.False(t, freeing(t, in.mem, e.Addr, e.Len))

	close(release)
	res := <-done
	require.NoError(t, res.err)
	assert.Equal(t, hugetlb.Region{Addr: e.Addr, Len: e.Len}, res.r)
	require.NoError(t, in.mem.Free(res.r), "the caller's to free once Alloc returned")
}

// Close waits for the Alloc and Free calls under way, events included,
// and then releases everything.
func TestCloseWaitsForAFreeUnderWay(t *testing.T) {
	b := testenv.Tmpfs(t)
	in := newInstance(t, b, hugetlb.ListConfig{Pages: 2})
	r, err := in.mem.Alloc(b.PageSize)
	require.NoError(t, err)
	entered, release := blockEvents(t, in, hugetlb.EventFree)
	freed := make(chan error, 1)
	go func() { freed <- in.mem.Free(r) }()
	<-entered
	closed := make(chan error, 1)
	go func() { closed <- in.mem.Close() }()
	// Close waits for the free (a Close that did not would return, and
	// never be seen waiting), and the free for its subscriber.
	require.Eventually(t, func() bool { return testenv.GoroutinesIn("(*Memory).Close", "sync.(*RWMutex).Lock") == 1 },
		20*time.Second, 100*time.Microsecond, "Close waits for the free under way")
	select {
	case err := <-closed:
		t.Fatalf("Close returned (%v) while a free's subscriber waited", err)
	case err := <-freed:
		t.Fatalf("the free returned (%v) while its subscriber waited", err)
	default:
	}
	close(release)
	require.NoError(t, <-freed)
	require.NoError(t, <-closed)
	_, err = in.mem.Alloc(b.PageSize)
	assert.ErrorIs(t, err, hugetlb.ErrClosed)
}

// New pages read as zeros even when the backing file holds blocks at
// their place (a hole punch that failed, a write through a mapping the
// primary does not know of): Alloc punches before it allocates.
func TestNewPagesReadAsZerosOverLeftoverBlocks(t *testing.T) {
	testenv.ForEachBackend(t, 2, func(t *testing.T, b hugetlb.Backend) {
		in := newInstance(t, b, hugetlb.ListConfig{Pages: 2})
		r0, err := in.mem.Alloc(b.PageSize)
		require.NoError(t, err)
		f, err := os.OpenFile(in.mem.Lists()[0].File, os.O_RDWR, 0)
		require.NoError(t, err)
		defer f.Close()
		if b.Kind == hugetlb.Hugetlbfs {
			// A hugetlbfs file is written only through a mapping.
			at, err := vm.MapShared(int(f.Fd()), uintptr(2*b.PageSize), true)
			require.NoError(t, err)
			require.NoError(t, unix.Fallocate(int(f.Fd()), 0, int64(b.PageSize), int64(b.PageSize)))
			vm.Bytes(at+uintptr(b.PageSize), 1)[0] = 0x42
			require.NoError(t, vm.Unmap(at, uintptr(2*b.PageSize)))
		} else {
			_, err = f.WriteAt([]byte{0x42}, int64(b.PageSize))
			require.NoError(t, err)
		}
		r1, err := in.mem.Alloc(b.PageSize)
		require.NoError(t, err)
		require.Equal(t, r0.End(), r1.Addr, "the page written behind the allocator's back")
		assert.Equal(t, byte(0), r1.Bytes()[0])
	})
}
