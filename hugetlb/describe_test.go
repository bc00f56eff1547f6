package hugetlb_test

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/shm"
)

// unmapped is what Describe reports: the primary's accounting with nothing
// mapped in the describing process.
func unmapped(lists []hugetlb.ListInfo) []hugetlb.ListInfo {
	out := append([]hugetlb.ListInfo(nil), lists...)
	for i := range out {
		out[i].Mapped = 0
	}
	return out
}

func TestDescribeReadsDescriptorsWithoutMapping(t *testing.T) {
	testenv.ForEachBackend(t, 3, func(t *testing.T, b hugetlb.Backend) {
		in := newInstance(t, b, hugetlb.ListConfig{Pages: 4}, hugetlb.ListConfig{Pages: 2})
		ps := b.PageSize
		r, err := in.mem.Alloc(3 * ps)
		require.NoError(t, err)
		require.NoError(t, in.mem.Free(hugetlb.Region{Addr: r.Addr + uintptr(ps), Len: ps}))

		got, err := hugetlb.Describe(in.seg)
		require.NoError(t, err)
		assert.Equal(t, unmapped(in.mem.Lists()), got)
		assert.Equal(t, 2, got[0].Allocated)
		assert.Equal(t, 1, got[0].LargestFree, "pages 1 and 3 are free, apart")

		// From a read-only view, as a tool sees it.
		ro, _, err := shm.OpenReadOnly(in.opts)
		require.NoError(t, err)
		defer ro.Close()
		got, err = hugetlb.Describe(ro)
		require.NoError(t, err)
		assert.Equal(t, unmapped(in.mem.Lists()), got)
	})
}

func TestDescribeClosedAndStuckTables(t *testing.T) {
	b := testenv.Tmpfs(t)
	in := newInstance(t, b, hugetlb.ListConfig{Pages: 4})
	_, err := in.mem.Alloc(b.PageSize)
	require.NoError(t, err)
	want := unmapped(in.mem.Lists())

	// A primary that died in the middle of a change leaves the table's
	// generation odd (offset 24 of the table, see layout_unsafe.go):
	// Describe gives up waiting and answers with what it read.
	gen := shm.At[uint64](in.seg, in.seg.Root(shm.RootMemory)+24)
	atomic.AddUint64(gen, 1)
	start := time.Now()
	got, err := hugetlb.Describe(in.seg)
	require.NoError(t, err)
	assert.Equal(t, want, got)
	assert.Less(t, time.Since(start), 2*time.Second, "bounded wait")
	atomic.AddUint64(gen, 1)

	require.NoError(t, in.mem.Close())
	got, err = hugetlb.Describe(in.seg)
	require.NoError(t, err, "a closed table is still described")
	assert.Equal(t, want[0].File, got[0].File)

	_, err = hugetlb.Describe(newSegment(t, b).seg)
	assert.ErrorIs(t, err, hugetlb.ErrBadDescriptor, "no table yet")
}
