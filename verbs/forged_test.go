package verbs_test

import (
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/internal/sys/vm"
	"github.com/mpmr/mpmr/verbs"
)

// The MR table lives in the segment, which every process of the user maps
// writable; these tests write its words through an attached view, as such
// a process would, and check that the owner's registrations do not follow
// them: no crash, no slot or hole handed out twice, no key revived.

// A slot's hole link forged out of range: the owner's trim, deregistration
// and close neither crash nor lose a hole.
func TestOwnerDoesNotFollowAForgedHoleLink(t *testing.T) {
	d, pd, o := newSoft(t, 1)
	view := attachSoft(t, o)
	trimmer := pd.(verbs.Trimmer)
	buf := newBuffer(t, 4*vm.PageSize)
	mr, err := pd.RegMR(buf.addr, 4*vm.PageSize, verbs.AccessLocalWrite)
	require.NoError(t, err)
	require.NoError(t, trimmer.TrimMR(mr, buf.page(1), vm.PageSize))
	_, _, _, holes := view.SlotWords(mr.LKey)

	atomic.StoreUint32(holes, 0xffffffff)
	require.NoError(t, trimmer.TrimMR(mr, buf.page(3), vm.PageSize))
	for _, page := range []int{1, 3} {
		assert.ErrorIs(t, view.Validate(verbs.SGE{Addr: buf.page(page), Len: 8, Key: mr.LKey}, 0),
			verbs.ErrLocalProtection, "page %d, trimmed, after the owner trimmed again", page)
	}
	atomic.StoreUint32(holes, 0xffffffff)
	require.NoError(t, pd.DeregMR(mr))

	// Both holes went back, and only they: the slot's four, no more.
	mr2, err := pd.RegMR(buf.addr, 4*vm.PageSize, verbs.AccessLocalWrite)
	require.NoError(t, err)
	for i := range 4 {
		require.NoError(t, trimmer.TrimMR(mr2, buf.page(i), vm.PageSize/2), "hole %d", i)
	}
	assert.ErrorIs(t, trimmer.TrimMR(mr2, buf.page(3)+vm.PageSize-64, 8), verbs.ErrNoResources)
	atomic.StoreUint32(holes, 0xfffffffe)
	assert.NoError(t, d.Close())
}

// A slot's hole link forged to another MR's hole: deregistering it does
// not free that hole, so the next trim cannot move it, and the other MR's
// key keeps failing for the memory it lost.
func TestOwnerDoesNotFreeAnotherMRsHole(t *testing.T) {
	_, pd, o := newSoft(t, 2)
	view := attachSoft(t, o)
	trimmer := pd.(verbs.Trimmer)
	a, b := newBuffer(t, 2*vm.PageSize), newBuffer(t, 2*vm.PageSize)
	mrA, err := pd.RegMR(a.addr, 2*vm.PageSize, verbs.AccessLocalWrite)
	require.NoError(t, err)
	mrB, err := pd.RegMR(b.addr, 2*vm.PageSize, verbs.AccessLocalWrite)
	require.NoError(t, err)
	require.NoError(t, trimmer.TrimMR(mrA, a.page(1), vm.PageSize), "a's second page is freed")
	_, _, _, holesA := view.SlotWords(mrA.LKey)
	_, _, _, holesB := view.SlotWords(mrB.LKey)
	atomic.StoreUint32(holesB, atomic.LoadUint32(holesA))

	require.NoError(t, pd.DeregMR(mrB))
	mrC, err := pd.RegMR(b.addr, 2*vm.PageSize, verbs.AccessLocalWrite)
	require.NoError(t, err)
	require.NoError(t, trimmer.TrimMR(mrC, b.page(0), vm.PageSize))
	assert.ErrorIs(t, view.Validate(verbs.SGE{Addr: a.page(1), Len: 8, Key: mrA.LKey}, 0),
		verbs.ErrLocalProtection, "a's key for the page a lost")
	assert.ErrorIs(t, view.Validate(verbs.SGE{Addr: b.page(0), Len: 8, Key: mrC.LKey}, 0),
		verbs.ErrLocalProtection, "c's key for the page c lost")
}

// A free slot forged to look registered to a PD: closing that PD does
// not free it again, so the owner never hands one slot to two MRs.
func TestOwnerDoesNotFreeAFreeSlotTwice(t *testing.T) {
	d, pd, o := newSoft(t, 2)
	view := attachSoft(t, o)
	buf := newBuffer(t, 3*vm.PageSize)
	a, err := pd.RegMR(buf.page(0), vm.PageSize, verbs.AccessLocalWrite)
	require.NoError(t, err)
	pd2, err := d.AllocPD()
	require.NoError(t, err)
	b, err := pd2.RegMR(buf.page(1), vm.PageSize, verbs.AccessLocalWrite)
	require.NoError(t, err)
	require.NoError(t, pd2.DeregMR(b))
	key, _, _, _ := view.SlotWords(b.LKey) // the free slot, which still names pd2
	atomic.StoreUint32(key, b.LKey)
	require.NoError(t, pd2.Close())

	c, err := pd.RegMR(buf.page(1), vm.PageSize, verbs.AccessLocalWrite)
	require.NoError(t, err, "one slot is free")
	_, err = pd.RegMR(buf.page(2), vm.PageSize, verbs.AccessLocalWrite)
	assert.ErrorIs(t, err, verbs.ErrNoResources, "no slot is free")
	assert.NotEqual(t, a.LKey>>8, c.LKey>>8, "two live MRs in one slot")
	assert.NoError(t, view.Validate(verbs.SGE{Addr: a.Addr, Len: 8, Key: a.LKey}, 0), "the first MR")
}

// A slot's count of keys handed out, forged back: the next registration
// there still gets a key the slot never handed out, so a key kept from an
// MR that is gone does not come back to life on another's memory.
func TestOwnerDoesNotReuseAKeyOfAForgedCount(t *testing.T) {
	_, pd, o := newSoft(t, 1)
	view := attachSoft(t, o)
	buf := newBuffer(t, 2*vm.PageSize)
	old, err := pd.RegMR(buf.page(0), vm.PageSize, verbs.AccessLocalWrite)
	require.NoError(t, err)
	require.NoError(t, pd.DeregMR(old))
	_, _, uses, _ := view.SlotWords(old.LKey)
	atomic.StoreUint32(uses, 0)

	mr, err := pd.RegMR(buf.page(1), vm.PageSize, verbs.AccessLocalWrite)
	require.NoError(t, err)
	assert.NotEqual(t, old.LKey, mr.LKey, "the key of an MR that is gone, handed out again")
	assert.Error(t, view.Validate(verbs.SGE{Addr: buf.page(1), Len: 8, Key: old.LKey}, 0), "the old key on the new MR's memory")
}

// The header's PD counter forged back: a new PD does not take the number
// of one in use, so closing it leaves the other's MRs registered.
func TestOwnerDoesNotReuseAPDNumber(t *testing.T) {
	d, pd, o := newSoft(t, 2)
	view := attachSoft(t, o)
	buf := newBuffer(t, vm.PageSize)
	mr, err := pd.RegMR(buf.addr, vm.PageSize, verbs.AccessLocalWrite)
	require.NoError(t, err)
	_, pdWord, _, _ := view.SlotWords(mr.LKey)
	view.ForgeNextPD(atomic.LoadUint32(pdWord) - 1)

	pd2, err := d.AllocPD()
	require.NoError(t, err)
	require.NoError(t, pd2.Close())
	assert.NoError(t, view.Validate(verbs.SGE{Addr: buf.addr, Len: 8, Key: mr.LKey}, 0), "the first PD's MR")
}
