package shm_test

import (
	"errors"
	"math/rand/v2"
	"sort"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/shm"
)

type block struct{ off, n, stamp uint64 }

func TestArenaAgainstModel(t *testing.T) {
	s, o := newSegment(t, testenv.Tmpfs(t), func(o *shm.Options) { o.Size = 1; o.MaxSize = 32 << 20 })
	// A process that only looks walks the segment's mirror of the
	// owner's records; it must find what the owner knows.
	view := attach(t, o)
	rng := rand.New(rand.NewPCG(1, 2))
	var live []block
	initial := s.ArenaStats()

	check := func() {
		require.Equal(t, s.ArenaStats(), view.ArenaStats(), "the mirror in the segment")
		sorted := append([]block(nil), live...)
		sort.Slice(sorted, func(i, j int) bool { return sorted[i].off < sorted[j].off })
		for i := 1; i < len(sorted); i++ {
			require.LessOrEqual(t, sorted[i-1].off+sorted[i-1].n, sorted[i].off, "blocks overlap")
		}
		for _, b := range live {
			// Each block keeps the stamp written when it was allocated.
			require.Equal(t, b.stamp, atomic.LoadUint64(shm.At[uint64](s, b.off)))
			require.Equal(t, b.stamp, atomic.LoadUint64(shm.At[uint64](s, b.off+b.n-8)))
		}
	}
	for step := range 4000 {
		if len(live) == 0 || rng.IntN(3) != 0 {
			n := uint64(8+rng.IntN(4096)) &^ 7
			align := uint64(16) << rng.IntN(4)
			off, err := s.Alloc(n, align)
			require.NoError(t, err)
			require.Zero(t, off%align, "alignment")
			size, err := s.BlockSize(off)
			require.NoError(t, err)
			require.GreaterOrEqual(t, size, n)
			for i := uint64(0); i < n; i += 8 {
				require.Zero(t, atomic.LoadUint64(shm.At[uint64](s, off+i)), "fresh blocks are zeroed")
			}
			b := block{off, n, uint64(step) + 1}
			atomic.StoreUint64(shm.At[uint64](s, off), b.stamp)
			atomic.StoreUint64(shm.At[uint64](s, off+n-8), b.stamp)
			live = append(live, b)
		} else {
			i := rng.IntN(len(live))
			require.NoError(t, s.Free(live[i].off))
			live[i] = live[len(live)-1]
			live = live[:len(live)-1]
		}
		if step%10 == 0 {
			check()
		}
	}
	check()
	for _, b := range live {
		require.NoError(t, s.Free(b.off))
	}
	st := s.ArenaStats()
	assert.Zero(t, st.UsedBytes)
	assert.Zero(t, st.Blocks)
	assert.Equal(t, 1, st.FreeBlocks, "freeing everything coalesces the arena into one block")
	assert.Equal(t, st.End-st.Start, st.FreeBytes)
	assert.GreaterOrEqual(t, st.End, initial.End)
}

// TestArenaMirrorIsMended: any process of the user can write the
// segment, the arena's mirror included. The owner never reads it back,
// and writes all of it again now and then, so that a mirror another
// process rewrote is right again after a bounded number of changes, even
// where nothing next to the damage changes.
func TestArenaMirrorIsMended(t *testing.T) {
	s, o := newSegment(t, testenv.Tmpfs(t), func(o *shm.Options) { o.Size = 1; o.MaxSize = 32 << 20 })
	view := attach(t, o)
	// Three free blocks: two holes and the tail.
	var offs []uint64
	for range 5 {
		off, err := s.Alloc(256, 16)
		require.NoError(t, err)
		offs = append(offs, off)
	}
	require.NoError(t, s.Free(offs[1]))
	require.NoError(t, s.Free(offs[3]))
	want := s.ArenaStats()
	require.Equal(t, want, view.ArenaStats())

	// Another process of the user cuts the list after its first block.
	head := atomic.LoadUint64(shm.At[uint64](s, arenaFreeWord))
	atomic.StoreUint64(shm.At[uint64](s, head+16), 0)
	require.NotEqual(t, want, view.ArenaStats(), "the forged link shows")

	// Blocks too big for the holes come from the tail: changes that leave
	// the cut link alone.
	for range 64 {
		off, err := s.Alloc(1024, 16)
		require.NoError(t, err)
		require.NoError(t, s.Free(off))
	}
	assert.Equal(t, s.ArenaStats(), view.ArenaStats(), "mended by the owner's records")
}

func TestArenaRejectsBadFrees(t *testing.T) {
	s, _ := newSegment(t, testenv.Tmpfs(t))
	off, err := s.Alloc(100, 16)
	require.NoError(t, err)
	require.NoError(t, s.Free(off))
	assert.ErrorIs(t, s.Free(off), shm.ErrBadBlock, "double free")
	assert.ErrorIs(t, s.Free(8), shm.ErrBadBlock, "inside the header")
	assert.ErrorIs(t, s.Free(s.Size()+4096), shm.ErrBadBlock, "past the end")
	off, err = s.Alloc(256, 16)
	require.NoError(t, err)
	assert.ErrorIs(t, s.Free(off+32), shm.ErrBadBlock, "inside a block")
	assert.NoError(t, s.Free(off))
}

func TestArenaExhaustion(t *testing.T) {
	s, _ := newSegment(t, testenv.Tmpfs(t), func(o *shm.Options) { o.Size = 1 << 20; o.MaxSize = 1 << 20 })
	var n int
	for {
		_, err := s.Alloc(64<<10, 16)
		if err != nil {
			assert.ErrorIs(t, err, shm.ErrArenaFull)
			assert.Contains(t, err.Error(), "max")
			break
		}
		n++
		require.Less(t, n, 100, "a 1 MiB arena cannot hold 100 blocks of 64 KiB")
	}
	assert.Greater(t, n, 10)
}

// The arena's owner may close the segment while other goroutines of it
// still allocate, free and make locks: each of them either completes
// before the mapping goes or fails with ErrClosed, and none writes an
// unmapped (or vacated) segment.
func TestArenaAfterClose(t *testing.T) {
	for _, underReaders := range []bool{false, true} {
		name := map[bool]string{false: "Close", true: "CloseUnderReaders"}[underReaders]
		t.Run(name, func(t *testing.T) {
			// The windows are short: many closes, each into goroutines
			// already at work.
			for range 40 {
				closeUnderArenaWork(t, underReaders)
			}
		})
	}
}

func closeUnderArenaWork(t *testing.T, underReaders bool) {
	s, _ := newSegment(t, testenv.Tmpfs(t), func(o *shm.Options) { o.Size = 1 << 20; o.MaxSize = 8 << 20 })
	kept, err := s.Alloc(64, 16)
	require.NoError(t, err)
	var wg sync.WaitGroup
	var working sync.WaitGroup
	errs := make(chan error, 3)
	work := func(op func(i int) error) {
		working.Add(1)
		wg.Go(func() {
			for i := 0; ; i++ {
				err := op(i)
				if i == 0 {
					working.Done()
				}
				if errors.Is(err, shm.ErrArenaFull) {
					return // only locks fill it: they are never freed
				}
				if err != nil {
					errs <- err
					return
				}
			}
		})
	}
	work(func(int) error {
		// Past the table's room for locks it still allocates and fills
		// a block before it says so.
		if _, err := s.NewRWLock(); !errors.Is(err, shm.ErrTooManyLks) {
			return err
		}
		return nil
	})
	for g := range 2 {
		work(func(i int) error {
			// Large blocks now and then, so that the arena grows too.
			n := uint64(64)
			if i%16 == g {
				n = 256 << 10
			}
			off, err := s.Alloc(n, 16)
			if err == nil {
				err = s.Free(off)
			}
			return err
		})
	}
	working.Wait()
	if underReaders {
		_, err = s.CloseUnderReaders()
		defer s.Unreserve()
	} else {
		err = s.Close()
	}
	require.NoError(t, err)
	wg.Wait()
	close(errs)
	for err := range errs {
		require.ErrorIs(t, err, shm.ErrClosed)
	}
	_, err = s.Alloc(64, 16)
	assert.ErrorIs(t, err, shm.ErrClosed, "Alloc after Close")
	assert.ErrorIs(t, s.Free(kept), shm.ErrClosed, "Free after Close")
	assert.ErrorIs(t, s.Grow(1<<20), shm.ErrClosed, "Grow after Close")
	_, err = s.NewRWLock()
	assert.ErrorIs(t, err, shm.ErrClosed, "NewRWLock after Close")
}
