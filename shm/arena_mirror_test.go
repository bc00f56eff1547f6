package shm_test

import (
	"fmt"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/shm"
)

func init() {
	testproc.Register("mirror-walker", helperMirrorWalker)
}

// arenaFreeWord and arenaBlocksWord are the header offsets of ArenaFree
// and ArenaBlocks (layout_unsafe.go).
const (
	arenaFreeWord   = 80
	arenaBlocksWord = 96
)

// helperMirrorWalker maps the segment read-only, as the mpmr tool
// does, and walks the segment's mirror of the arena free list as fast as
// it can until its input closes: the list is documented as sorted by
// offset, so every link must lead further on. A walk during which the
// owner finished an allocation or a free (the count of allocated blocks,
// which each change publishes last, moved) may have followed a link into
// a block allocated and written meanwhile, and proves nothing: a link
// backwards counts only in a walk that saw no change end. It also calls
// ArenaStats (the tool's own walk) now and then. It prints "done WALKS
// BAD MAXBLOCKS FIRST-BAD".
func helperMirrorWalker(args []string) int {
	ro, _, err := shm.OpenReadOnly(opts(args[0]))
	if err != nil {
		fmt.Println("error", err)
		return 3
	}
	defer ro.Close()
	size, _ := strconv.ParseUint(args[1], 10, 64)
	words := shm.Slice[uint64](ro, 0, int(size/8))
	var stop atomic.Bool
	go func() { waitForEOF(); stop.Store(true) }()
	testproc.Say("ready")
	var walks, bad uint64
	maxBlocks := 0
	first := "-"
	for !stop.Load() {
		walks++
		prev := uint64(0)
		blocks := atomic.LoadUint64(&words[arenaBlocksWord/8])
		cur := atomic.LoadUint64(&words[arenaFreeWord/8])
		for n := 0; cur != 0 && n < 64; n++ {
			if cur <= prev || cur%16 != 0 || cur+24 > size {
				if atomic.LoadUint64(&words[arenaBlocksWord/8]) == blocks {
					bad++
					if first == "-" {
						first = fmt.Sprintf("link_0x%x->0x%x", prev, cur)
					}
				}
				break
			}
			prev = cur
			cur = atomic.LoadUint64(&words[(cur+16)/8])
		}
		if walks%64 == 0 {
			maxBlocks = max(maxBlocks, ro.ArenaStats().FreeBlocks)
		}
	}
	testproc.Say("done %d %d %d %s", walks, bad, maxBlocks, first)
	return 0
}

// TestArenaMirrorNeverLinksAheadOfItsBlocks: another process (the mpmr
// tool) walks the arena's mirror while the owner allocates. Freed blocks
// keep their old contents (here: words that point back at the list's
// head, as any offset a layer stored would). A mirror that wrote the link
// to a new free block before the block's header and link would, for a
// moment, lead the walker to those old contents: a link backwards, a
// cycle for ArenaStats.
func TestArenaMirrorNeverLinksAheadOfItsBlocks(t *testing.T) {
	s, o := newSegment(t, testenv.Tmpfs(t), func(o *shm.Options) { o.Size = 1; o.MaxSize = 64 << 20 })
	// A 48-byte fragment no request below fits heads the free list, so the
	// churn happens at index 1 of the list.
	frag, err := s.Alloc(32, 16)
	require.NoError(t, err)
	_, err = s.Alloc(32, 16) // keeps the fragment from merging
	require.NoError(t, err)
	const region = 16 << 20
	big, err := s.Alloc(region, 16)
	require.NoError(t, err)
	require.NoError(t, s.Free(big))
	require.NoError(t, s.Free(frag))
	head := frag - 16
	size := s.Size()

	poison := func() {
		off, err := s.Alloc(region, 16)
		require.NoError(t, err)
		words := shm.Slice[uint64](s, off, region/8)
		for i := range words {
			atomic.StoreUint64(&words[i], head)
		}
		require.NoError(t, s.Free(off))
	}

	w := testproc.Start(t, "mirror-walker", []string{o.Path, strconv.FormatUint(size, 10)})
	w.Expect("ready", 0)
	deadline := time.Now().Add(1500 * time.Millisecond) // workload length, not a wait
	allocs := 0
	for rounds := 0; time.Now().Before(deadline); rounds++ {
		poison()
		var blocks []uint64
		for used := 0; used < region-(1<<16) && time.Now().Before(deadline); used += 64 {
			off, err := s.Alloc(48, 16) // a 64-byte block carved off the front of free block 1
			require.NoError(t, err)
			blocks = append(blocks, off)
			allocs++
		}
		for i := len(blocks) - 1; i >= 0; i-- {
			require.NoError(t, s.Free(blocks[i]))
		}
		require.Equal(t, size, s.Size(), "the churn must not grow the segment")
	}
	w.CloseInput()
	line := w.Expect("done", 10*time.Second)
	t.Logf("%d allocations; walker: %s", allocs, line)
	var walks, bad uint64
	var maxBlocks int
	var first string
	_, err = fmt.Sscanf(line, "done %d %d %d %s", &walks, &bad, &maxBlocks, &first)
	require.NoError(t, err)
	assert.Zero(t, bad, "the walker followed a link that leads back (first: %s): a free block linked before its header and link were written", first)
	assert.LessOrEqual(t, maxBlocks, 2, "ArenaStats counted free blocks the arena never had")
	require.NoError(t, w.Wait(0))
}
