package verbs

import (
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"
)

// overlapping lists, by slot, the spans of set that overlap sp, as from
// must find them.
func overlapping(set pinSet, sp span) []uint32 {
	var slots []uint32
	for _, s := range set.from(sp) {
		if s.lo >= sp.hi {
			break
		}
		if s.hi > sp.lo {
			slots = append(slots, s.slot)
		}
	}
	slices.Sort(slots)
	return slots
}

// The index of pinned spans finds every span that overlaps a span, after
// any sequence of additions and removals, as a walk over all of them does.
func TestPinSetMatchesAWalk(t *testing.T) {
	const slots, page = 64, 4096
	rng := rand.New(rand.NewPCG(1, 2))
	set := newPinSet(slots)
	all := map[uint32]span{}
	for range 20000 {
		slot := uint32(rng.IntN(slots))
		if _, ok := all[slot]; ok {
			sp, removed := set.remove(slot)
			require.True(t, removed)
			require.Equal(t, all[slot], sp)
			delete(all, slot)
		} else {
			lo := uintptr(rng.IntN(256)) * page
			n := uintptr(1 + rng.IntN(4))
			if rng.IntN(50) == 0 {
				n = uintptr(1 + rng.IntN(200)) // now and then a long one
			}
			sp := span{lo, lo + n*page}
			set.add(slot, sp)
			all[slot] = sp
		}
		probe := uintptr(rng.IntN(300)) * page
		sp := span{probe, probe + uintptr(1+rng.IntN(8))*page}
		var want []uint32
		for slot, s := range all {
			if s.lo < sp.hi && s.hi > sp.lo {
				want = append(want, slot)
			}
		}
		slices.Sort(want)
		require.Equal(t, want, overlapping(set, sp), "overlaps of %v among %v", sp, all)
	}
}

// Once a long span is gone, overlaps are looked for no further back than
// the spans left need: the look-back does not stay as long as the
// longest span ever pinned.
func TestPinSetLookBackShrinks(t *testing.T) {
	const n, page = 1000, 4096
	set := newPinSet(n + 1)
	for i := range uintptr(n) {
		set.add(uint32(i), span{i * page, (i + 1) * page})
	}
	set.add(n, span{0, n * page})
	last := span{(n - 1) * page, n * page}
	require.Len(t, set.from(last), n+1, "with the long span, every span may overlap the last page")
	_, ok := set.remove(n)
	require.True(t, ok)
	require.LessOrEqual(t, len(set.from(last)), 2, "spans looked at for the last page once the long span is gone")
}
