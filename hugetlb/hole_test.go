package hugetlb_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/sys/vm"
	"github.com/mpmr/mpmr/internal/test/testenv"
)

// sentinelMark is what a sentinel mapping holds in its first byte.
const sentinelMark = 0x77

// sentinel maps anonymous memory over [addr, addr+length), as another
// mapping of the process may take a hole, and marks it.
func sentinel(addr, length uintptr) error {
	if _, err := vm.Reserve(addr, length); err != nil {
		return err
	}
	if err := unix.Mprotect(vm.Bytes(addr, length), unix.PROT_READ|unix.PROT_WRITE); err != nil {
		return err
	}
	vm.Bytes(addr, 1)[0] = sentinelMark
	return nil
}

// takeHole puts a sentinel in a hole and records where it is; it is
// unmapped at the test's end.
func takeHole(t *testing.T, at *[2]uintptr) func(addr, length uintptr) {
	return func(addr, length uintptr) {
		require.NoError(t, sentinel(addr, length))
		*at = [2]uintptr{addr, length}
		t.Cleanup(func() { _ = vm.Unmap(addr, length) })
	}
}

// intact reports whether the sentinel at is still there: readable and
// marked.
func intact(at [2]uintptr) bool {
	return at[0] != 0 && vm.CheckReadable(at[0], at[1]) == nil && vm.Bytes(at[0], 1)[0] == sentinelMark
}

// A Free whose unmap fails and leaves a hole it cannot reserve again
// fails with ErrHole, and the memory never touches those pages again: a
// Free of them again fails at once, no Alloc gets them, and Close leaves
// them be — whatever another mapping of the process put there would
// otherwise be replaced by the next mapping of the pages.
func TestAHoleLeftByAFailedFreeIsNeverTouchedAgain(t *testing.T) {
	testenv.ForEachBackend(t, 4, func(t *testing.T, b hugetlb.Backend) {
		in := newInstance(t, b, hugetlb.ListConfig{Pages: 4})
		r, err := in.mem.Alloc(2 * b.PageSize)
		require.NoError(t, err)
		var at [2]uintptr
		hugetlb.LoseNextRelease(takeHole(t, &at))
		err = in.mem.Free(r)
		require.ErrorIs(t, err, hugetlb.ErrHole)
		require.True(t, intact(at), "the hole was taken")
		// Freed for every other purpose: no query offers the pages (the
		// cache would register them), no secondary maps them.
		_, ok := in.mem.PageOf(r.Addr)
		assert.False(t, ok, "PageOf")
		_, ok = in.mem.ContigRun(r.Addr)
		assert.False(t, ok, "ContigRun")
		assert.False(t, in.mem.Mapped(r.Addr, r.Len), "Mapped")
		li := in.mem.Lists()[0]
		assert.Equal(t, 0, li.Allocated)
		assert.Equal(t, 2, li.Lost)
		assert.Equal(t, 2, li.LargestFree, "the two pages after them")

		assert.ErrorIs(t, in.mem.Free(r), hugetlb.ErrDoubleFree, "a Free again")
		assert.True(t, intact(at), "after a Free again")
		rest, err := in.mem.Alloc(2 * b.PageSize)
		require.NoError(t, err, "the other two pages")
		assert.Equal(t, in.region(2, 2), rest)
		run, ok := in.mem.ContigRun(rest.Addr)
		assert.True(t, ok)
		assert.Equal(t, 2, run.First, "a run stops at lost pages")
		n := 0
		for range in.mem.Runs {
			n++
		}
		assert.Equal(t, 1, n, "Runs")
		_, err = in.mem.Alloc(b.PageSize)
		assert.ErrorIs(t, err, hugetlb.ErrNoFreeRun, "the lost pages are not handed out")
		assert.Zero(t, in.mem.Lists()[0].LargestFree)
		require.NoError(t, in.mem.Free(rest))
		assert.True(t, intact(at), "after the Allocs")
		assert.NoError(t, in.mem.Close())
		assert.True(t, intact(at), "after Close")
	})
}

// The same for an Alloc whose mapping fails and whose undoing leaves
// such a hole — its own release, or the populate's (which the Alloc must
// then not release again): the Alloc fails with ErrHole, and the pages
// are never handed out or touched again.
func TestAHoleLeftByAFailedAllocIsNeverTouchedAgain(t *testing.T) {
	testenv.ForEachBackend(t, 4, func(t *testing.T, b hugetlb.Backend) {
		for _, by := range []string{"undo", "populate"} {
			t.Run(by, func(t *testing.T) { aHoleLeftByAFailedAlloc(t, b, by) })
		}
	})
}

func aHoleLeftByAFailedAlloc(t *testing.T, b hugetlb.Backend, by string) {
	in := newInstance(t, b, hugetlb.ListConfig{Pages: 4})
	var at [2]uintptr
	if by == "undo" {
		hugetlb.FailNextPopulate(nil)
		hugetlb.LoseNextRelease(takeHole(t, &at))
	} else {
		hugetlb.FailNextPopulate(takeHole(t, &at))
	}
	_, err := in.mem.Alloc(2 * b.PageSize)
	require.ErrorIs(t, err, hugetlb.ErrHole)
	require.True(t, intact(at), "the hole was taken")

	rest, err := in.mem.Alloc(2 * b.PageSize)
	require.NoError(t, err, "the other two pages")
	assert.Equal(t, in.region(2, 2), rest)
	_, err = in.mem.Alloc(b.PageSize)
	assert.ErrorIs(t, err, hugetlb.ErrNoFreeRun, "the lost pages are not handed out")
	assert.True(t, intact(at), "after the Allocs")
	assert.NoError(t, in.mem.Close())
	assert.True(t, intact(at), "after Close")
}

// A secondary's unmap that fails and leaves such a hole fails with
// ErrHole, announcing the pages as freed, and the secondary never touches
// them again: a resync, a map or an unmap of them fails without changing
// what holds their range now (the primary then treats the secondary as
// one that does not follow), and Close leaves them be.
func TestAHoleLeftInASecondaryIsNeverTouchedAgain(t *testing.T) {
	testenv.ForEachBackend(t, 4, func(t *testing.T, b hugetlb.Backend) {
		ps := b.PageSize
		in, r, sec := subscribedSecondary(t, b, 4, 2)
		require.NoError(t, in.mem.Free(r))
		sec.Send("unmap-losing 0 0 2")
		assert.Equal(t, "event free "+hex(r.Addr)+" "+dec(2*ps), sec.Expect("event", 0))
		line := sec.Expect("error", 0)
		assert.Contains(t, line, "range left unmapped")
		ask(t, sec, "sentinel true", "sentinel")
		ask(t, sec, "mapped 0", "mapped 0")

		again, err := in.mem.Alloc(4 * ps) // the same pages, and two more
		require.NoError(t, err)
		sec.Send("resync")
		assert.Equal(t, "event alloc "+hex(again.Addr+uintptr(2*ps))+" "+dec(2*ps), sec.Expect("event", 0),
			"the pages that are not lost are mapped")
		assert.Contains(t, sec.Expect("error", 0), "lost")
		ask(t, sec, "sentinel true", "sentinel")
		for _, c := range []string{"map 0 0 2", "unmap 0 0 1"} {
			assert.Contains(t, ask(t, sec, "error", "%s", c), "lost", c)
			ask(t, sec, "sentinel true", "sentinel")
		}
		// Freed, and the lost pages allocated again: a resync fails on
		// them, and still unmaps the freed pages after them.
		require.NoError(t, in.mem.Free(again))
		_, err = in.mem.Alloc(2 * ps)
		require.NoError(t, err)
		sec.Send("resync")
		assert.Equal(t, "event free "+hex(again.Addr+uintptr(2*ps))+" "+dec(2*ps), sec.Expect("event", 0))
		assert.Contains(t, sec.Expect("error", 0), "lost")
		ask(t, sec, "readable false", "readable %#x %d", again.Addr+uintptr(2*ps), 2*ps)
		ask(t, sec, "sentinel true", "sentinel")
		ask(t, sec, "closed", "close")
		ask(t, sec, "sentinel true", "sentinel")
	})
}

// A resync that fails on lost pages of one list still brings the other
// lists in line: the pages freed there are unmapped.
func TestAResyncFailingOnLostPagesGoesOnToTheOtherLists(t *testing.T) {
	b := testenv.Tmpfs(t)
	ps := b.PageSize
	in := newInstance(t, b, hugetlb.ListConfig{Pages: 4}, hugetlb.ListConfig{Pages: 4})
	lost, err := in.mem.Alloc(2 * ps)
	require.NoError(t, err)
	_, err = in.mem.Alloc(2 * ps) // the rest of list 0
	require.NoError(t, err)
	other, err := in.mem.Alloc(ps) // in list 1
	require.NoError(t, err)
	require.Equal(t, 1, in.mem.Lists()[1].Allocated)
	sec := startSecondary(t, in)

	require.NoError(t, in.mem.Free(lost))
	assert.Contains(t, ask(t, sec, "error", "unmap-losing 0 0 2"), "range left unmapped")
	_, err = in.mem.Alloc(2 * ps) // list 0's lost pages again
	require.NoError(t, err)
	require.NoError(t, in.mem.Free(other))
	assert.Contains(t, ask(t, sec, "error", "resync"), "lost")
	ask(t, sec, "readable false", "readable %#x %d", other.Addr, ps)
	ask(t, sec, "sentinel true", "sentinel")
}

// Lost pages wait in no quarantine, even while a fenced process may map
// them: they are never handed out again, so their blocks go back at once,
// and nothing says they will come back.
func TestLostPagesWaitInNoQuarantine(t *testing.T) {
	b := testenv.Tmpfs(t)
	in := newInstance(t, b, hugetlb.ListConfig{Pages: 4})
	fenceASleeper(t, in)
	r, err := in.mem.Alloc(2 * b.PageSize)
	require.NoError(t, err)
	var at [2]uintptr
	hugetlb.LoseNextRelease(takeHole(t, &at))
	require.ErrorIs(t, in.mem.Free(r), hugetlb.ErrHole)
	li := in.mem.Lists()[0]
	assert.Zero(t, li.Quarantined)
	assert.Equal(t, 2, li.Lost)
	assert.Zero(t, allocatedBytes(t, li.File), "the blocks are punched")
	_, err = in.mem.Alloc(3 * b.PageSize)
	assert.ErrorIs(t, err, hugetlb.ErrNoFreeRun)
	assert.NotContains(t, err.Error(), "quarantine")
	assert.True(t, intact(at))
}
