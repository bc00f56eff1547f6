package cache

import (
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/shm"
)

// A reader that stalls inside the global read lock (a stopped process, a
// debugger, a slow tool) cannot make a free give up its invalidation: the
// free fences the reader, completes, and no lookup afterwards returns a key
// for the freed memory.
func TestStalledReaderCannotKeepFreedMemoryRegistered(t *testing.T) {
	p := newPrimary(t, fixtureConfig{})
	r := p.alloc(t, 2)
	q := NewLocal(p.g, p.g, 0)
	key, err := q.Lookup(r.Addr)
	require.NoError(t, err)

	in, release := make(chan struct{}), make(chan struct{})
	shared := make(chan error, 1)
	go func() {
		shared <- p.g.Shared(func() {
			close(in)
			<-release
		})
	}()
	<-in
	gen := p.g.DevGen()
	require.NoError(t, p.mem.Free(r), "the free completes although a reader stalls")
	assert.NotEqual(t, gen, p.g.DevGen(), "the free moved the generation")
	_, found, err := p.g.Lookup(uint64(r.Addr))
	require.NoError(t, err)
	assert.False(t, found, "the global table no longer holds the freed memory")
	_, err = q.Lookup(r.Addr)
	assert.ErrorIs(t, err, ErrNoMemory, "nor does the local cache serve it")
	p.g.GC()
	assert.Error(t, p.validates(r.Addr, key), "the device no longer accepts the old key")

	close(release)
	assert.ErrorIs(t, <-shared, shm.ErrFenced, "the stalled reader learns its read was cut short")
	assert.Equal(t, uint64(1), p.g.LockState().Fences)

	// The pages come back from Alloc with a new registration.
	again := p.alloc(t, 2)
	require.Equal(t, r.Addr, again.Addr)
	k2, err := q.Lookup(again.Addr)
	require.NoError(t, err)
	assert.NotEqual(t, key, k2, "a new MR, not the old one")
	require.NoError(t, p.validates(again.Addr, k2))
}

// A free whose invalidation cannot run (a live writer keeps the global lock
// past the timeout) changes nothing and says so.
func TestFreeRefusedWhenInvalidationCannotRun(t *testing.T) {
	p := newPrimary(t, fixtureConfig{lockTimeout: 100 * time.Millisecond})
	r := p.alloc(t, 1)
	e, err := p.g.Create(uint64(r.Addr))
	require.NoError(t, err)

	release := p.holdLock(t)
	err = p.mem.Free(r)
	require.NoError(t, release())
	require.ErrorIs(t, err, hugetlb.ErrNotFreed)

	assert.NotPanics(t, func() { r.Bytes()[0] = 1 }, "the memory is still mapped")
	got, found, err := p.g.Lookup(uint64(r.Addr))
	require.NoError(t, err)
	require.True(t, found, "and still registered")
	assert.Equal(t, e, got)
	assert.NoError(t, p.validates(r.Addr, e.LKey))
	require.NoError(t, p.mem.Free(r), "a later free goes through")
}

func TestRegisterExternalRefusesOverlaps(t *testing.T) {
	p := newPrimary(t, fixtureConfig{})
	list := p.mem.Lists()[0]
	buf := externalBuffer(t, 1<<20)
	base := uint64(sliceAddr(buf))
	first, err := p.g.RegisterExternal(base, 1<<19)
	require.NoError(t, err)

	cases := []struct {
		name       string
		addr, size uint64
		want       error
	}{
		{"a whole memseg list", uint64(list.Base) - 4096, uint64(list.End-list.Base) + 8192, ErrOverlap},
		{"the middle of a memseg list", uint64(list.Base) + 4096, 4096, ErrOverlap},
		{"the tail of a registered range", base + 1<<18, 1 << 19, ErrOverlap},
		{"inside a registered range", base + 4096, 4096, ErrOverlap},
		{"around a registered range", base - 4096, 1<<19 + 8192, ErrOverlap},
		{"zero length", base + 1<<19, 0, ErrBadRange},
		{"wrapping", ^uint64(0) - 4095, 8192, ErrBadRange},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			before := p.g.Stats()
			_, err := p.g.RegisterExternal(c.addr, c.size)
			require.ErrorIs(t, err, c.want)
			assert.Equal(t, before.MRs, p.g.Stats().MRs, "nothing was registered")
			e, found, err := p.g.Lookup(base + 100)
			require.NoError(t, err)
			require.True(t, found, "what was registered still is")
			assert.Equal(t, first, e)
		})
	}
	if !t.Failed() {
		again, err := p.g.RegisterExternal(base, 1<<19)
		require.NoError(t, err, "the same range again is not an overlap")
		assert.Equal(t, first, again)
		e, err := p.g.RegisterExternal(base+1<<19, 1<<19)
		require.NoError(t, err, "an adjacent range is")
		assert.NotEqual(t, first.LKey, e.LKey)
	}
}

// A creation queued behind Close registers nothing after Close swept the
// list: Close leaves no MR registered with the device.
func TestCreateQueuedBehindCloseRegistersNothing(t *testing.T) {
	for i := range 8 {
		t.Run(fmt.Sprint(i), func(t *testing.T) {
			p := newPrimary(t, fixtureConfig{})
			r := p.alloc(t, 1)
			release := p.holdLock(t)
			var wg sync.WaitGroup
			wg.Add(2)
			// Writers of this process beyond the first wait for its turn
			// (Queued), the first in the lock's word (Waiters).
			waiters := func(n int) func() bool {
				return func() bool { st := p.g.LockState(); return st.Waiters+st.Queued >= n }
			}
			var createErr, closeErr error
			go func() {
				defer wg.Done()
				_, createErr = p.g.Create(uint64(r.Addr))
			}()
			require.Eventually(t, waiters(1), 5*time.Second, time.Millisecond, "the creation waits for the lock")
			go func() {
				defer wg.Done()
				closeErr = p.g.Close()
			}()
			require.Eventually(t, waiters(2), 5*time.Second, time.Millisecond, "so does Close")
			require.NoError(t, release())
			wg.Wait()
			require.NoError(t, closeErr)
			if createErr == nil {
				t.Log("the creation ran before Close")
			} else {
				assert.ErrorIs(t, createErr, ErrClosed)
			}
			assert.Zero(t, p.dev.Stats().LiveMRs, "Close left no registration behind")
		})
	}
}

// A writer that dies holding the global lock may have changed the MR list:
// the takeover rebuilds the table and moves the generation, so that no
// local cache keeps what it took from the table before.
func TestDeadWriterTakeoverMovesGeneration(t *testing.T) {
	p := newPrimary(t, fixtureConfig{})
	r := p.alloc(t, 1)
	q := NewLocal(p.g, p.g, 0)
	_, err := q.Lookup(r.Addr)
	require.NoError(t, err)
	gen := p.g.DevGen()

	h := testproc.Start(t, "hold-global", []string{p.opts.Path})
	h.Expect("held", 0)
	h.Kill()
	require.Error(t, h.Wait(0))
	require.NoError(t, p.g.Exclusive(func() {}), "the primary takes the lock over")
	assert.NotEqual(t, gen, p.g.DevGen(), "and moves the generation")
	_, err = q.Lookup(r.Addr)
	require.NoError(t, err)
	assert.Equal(t, uint64(1), q.Stats().Flushes, "the local cache flushed")
}

// A Close that cannot have the global lock changes nothing: frees are
// still guarded, the MRs still registered, and a later Close does the
// work instead of reporting success.
func TestCloseThatCannotLockChangesNothing(t *testing.T) {
	p := newPrimary(t, fixtureConfig{lockTimeout: 100 * time.Millisecond})
	r := p.alloc(t, 1)
	e, err := p.g.Create(uint64(r.Addr))
	require.NoError(t, err)

	release := p.holdLock(t)
	closeErr := p.g.Close()
	require.NoError(t, release())
	require.Error(t, closeErr, "Close could not lock")

	assert.NoError(t, p.validates(r.Addr, e.LKey), "the MR is still registered")
	require.NoError(t, p.mem.Free(r), "a free is still guarded: it invalidates")
	_, err = p.g.Collect()
	require.NoError(t, err)
	assert.Error(t, p.validates(r.Addr, e.LKey), "and the key went with the memory")
	require.NoError(t, p.g.Close(), "a later Close does the work")
}
