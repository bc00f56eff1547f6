package verbs_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/internal/sys/vm"
	"github.com/mpmr/mpmr/verbs"
)

// A trimmed range stops validating for the MR's key, in the owner and in
// an attached view, while the rest of the MR keeps validating; trimming
// the same range again takes no new hole, and deregistration frees them.
func TestTrimMR(t *testing.T) {
	d, pd, o := newSoft(t, 1)
	view := attachSoft(t, o)
	buf := newBuffer(t, 4*vm.PageSize)
	mr, err := pd.RegMR(buf.addr, 4*vm.PageSize, verbs.AccessLocalWrite)
	require.NoError(t, err)
	trimmer, ok := pd.(verbs.Trimmer)
	require.True(t, ok, "the soft device can trim")
	mid := buf.page(1)

	require.NoError(t, trimmer.TrimMR(mr, mid, vm.PageSize))
	for _, dev := range []*verbs.Soft{d, view} {
		assert.ErrorIs(t, dev.Validate(verbs.SGE{Addr: mid, Len: 8, Key: mr.LKey}, 0), verbs.ErrLocalProtection)
		assert.ErrorIs(t, dev.Validate(verbs.SGE{Addr: mid - 4, Len: 8, Key: mr.LKey}, 0),
			verbs.ErrLocalProtection, "an element reaching into the hole")
		assert.NoError(t, dev.Validate(verbs.SGE{Addr: buf.page(0), Len: 8, Key: mr.LKey}, verbs.AccessLocalWrite))
		assert.NoError(t, dev.Validate(verbs.SGE{Addr: buf.page(2), Len: 8, Key: mr.LKey}, verbs.AccessLocalWrite))
	}
	// The hole table has 4 entries per slot: trimming one range a hundred
	// times must not use them up.
	for range 100 {
		require.NoError(t, trimmer.TrimMR(mr, mid, vm.PageSize), "the same range again takes no hole")
	}
	require.NoError(t, trimmer.TrimMR(mr, buf.page(2), vm.PageSize), "a neighbour widens the hole")
	assert.ErrorIs(t, d.Validate(verbs.SGE{Addr: buf.page(2), Len: 8, Key: mr.LKey}, 0), verbs.ErrLocalProtection)
	assert.NoError(t, d.Validate(verbs.SGE{Addr: buf.page(3), Len: 8, Key: mr.LKey}, 0))
	require.NoError(t, trimmer.TrimMR(mr, buf.addr+8*vm.PageSize, vm.PageSize), "outside the MR: nothing to do")

	require.NoError(t, pd.DeregMR(mr))
	assert.ErrorIs(t, trimmer.TrimMR(mr, buf.addr, vm.PageSize), verbs.ErrStaleKey)
	// Its holes went back: a new MR in the slot trims as many as it likes.
	mr2, err := pd.RegMR(buf.addr, 4*vm.PageSize, verbs.AccessLocalWrite)
	require.NoError(t, err)
	for i := range 4 {
		require.NoError(t, trimmer.TrimMR(mr2, buf.page(i), vm.PageSize/2), "hole %d", i)
	}
	assert.ErrorIs(t, trimmer.TrimMR(mr2, buf.page(3)+vm.PageSize-64, 8), verbs.ErrNoResources, "a fifth hole for one slot's table")
}
