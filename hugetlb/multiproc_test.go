package hugetlb_test

import (
	"strings"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/sys/vm"
	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/internal/test/testproc"
)

func TestSecondarySeesSameBytesAtSameAddresses(t *testing.T) {
	testenv.ForEachBackend(t, 6, func(t *testing.T, b hugetlb.Backend) {
		ps := b.PageSize
		in := newInstance(t, b, hugetlb.ListConfig{Pages: 2}, hugetlb.ListConfig{Pages: 8})
		lists := in.mem.Lists()

		// Three pages do not fit list 0: they go to list 1.
		big, err := in.mem.Alloc(3*ps - 100)
		require.NoError(t, err)
		assert.Equal(t, hugetlb.Region{Addr: lists[1].Base, Len: 3 * ps}, big, "whole pages, first fit")
		small, err := in.mem.Alloc(1)
		require.NoError(t, err)
		assert.Equal(t, hugetlb.Region{Addr: lists[0].Base, Len: ps}, small)
		fill(big.Bytes(), 1)
		fill(small.Bytes(), 2)

		sec := startSecondary(t, in)
		ask(t, sec, "ok", "check %#x %d 1", big.Addr, big.Len)
		ask(t, sec, "ok", "check %#x %d 2", small.Addr, small.Len)

		// The secondary writes the middle page; the primary sees it.
		ask(t, sec, "filled", "fill %#x %d 3", big.Addr+uintptr(ps), ps)
		assert.Equal(t, -1, verify(big.Bytes()[ps:2*ps], 3))
		assert.Equal(t, -1, verify(big.Bytes()[:ps], 1), "the rest is unchanged")

		// Pages allocated after the attach appear when the secondary maps
		// them, as the IPC layer will tell it to.
		later, err := in.mem.Alloc(2 * ps)
		require.NoError(t, err)
		assert.Equal(t, lists[1].Base+uintptr(3*ps), later.Addr)
		fill(later.Bytes(), 4)
		ask(t, sec, "readable false", "readable %#x %d", later.Addr, later.Len)
		ask(t, sec, "mapped", "map 1 3 2")
		ask(t, sec, "ok", "check %#x %d 4", later.Addr, later.Len)
		ask(t, sec, "mapped", "map 1 3 2") // again: harmless
		ask(t, sec, "mapped 5", "mapped 1")

		// A secondary may neither allocate nor free, nor map free pages.
		ask(t, sec, "alloc-error notprimary=true", "alloc %d", ps)
		ask(t, sec, "free-error notprimary=true", "free %#x %d", big.Addr, ps)
		ask(t, sec, "error", "map 1 6 1")

		got := in.mem.Lists()
		assert.Equal(t, 5, got[1].Allocated)
		assert.Equal(t, 3, got[1].Free)
		assert.Equal(t, 5, got[1].Mapped)
		assert.Equal(t, 1, got[0].Allocated)
		assert.Equal(t, b.Kind, got[0].Backend)
	})
}

func TestSecondaryFaultsOnFreedMemory(t *testing.T) {
	testenv.ForEachBackend(t, 2, func(t *testing.T, b hugetlb.Backend) {
		ps := b.PageSize
		in := newInstance(t, b, hugetlb.ListConfig{Pages: 4})
		r, err := in.mem.Alloc(2 * ps)
		require.NoError(t, err)
		fill(r.Bytes(), 1)
		freed := hugetlb.Region{Addr: r.Addr + uintptr(ps), Len: ps}

		sec := startSecondary(t, in)
		ask(t, sec, "touching", "touch %#x", freed.Addr)
		sec.Expect("touched", 0)

		// What the IPC layer will do: the free event makes every secondary
		// unmap before the primary's Free goes on.
		cancel := in.mem.Subscribe(func(e hugetlb.Event) {
			if e.Kind == hugetlb.EventFree {
				ask(t, sec, "unmapped", "unmap 0 1 1")
			}
		})
		defer cancel()
		require.NoError(t, in.mem.Free(freed))
		assert.ErrorIs(t, vm.CheckReadable(freed.Addr, uintptr(freed.Len)), vm.ErrNotMapped, "the primary faults too")

		ask(t, sec, "touching", "touch %#x", r.Addr)
		sec.Expect("touched", 0)
		ask(t, sec, "touching", "touch %#x", freed.Addr)
		line, err := sec.Next("touched", 0)
		require.Error(t, err, "the secondary read freed memory: %s", line)
		require.ErrorContains(t, err, "ended", "the secondary neither read nor died")
		require.Error(t, sec.Wait(0))
		assert.Equal(t, syscall.SIGSEGV, sec.Signal(), "stderr: %s", sec.Stderr())
	})
}

func TestResyncFollowsDescriptors(t *testing.T) {
	testenv.ForEachBackend(t, 4, func(t *testing.T, b hugetlb.Backend) {
		ps := b.PageSize
		in, r, sec := subscribedSecondary(t, b, 8, 3)

		// Changes the secondary is not told about.
		require.NoError(t, in.mem.Free(hugetlb.Region{Addr: r.Addr + uintptr(ps), Len: ps}))
		later, err := in.mem.Alloc(ps) // reuses page 1
		require.NoError(t, err)
		require.Equal(t, r.Addr+uintptr(ps), later.Addr)
		fill(later.Bytes(), 2)
		require.NoError(t, in.mem.Free(hugetlb.Region{Addr: r.Addr + uintptr(2*ps), Len: ps}))
		extra, err := in.mem.Alloc(ps)
		require.NoError(t, err)
		require.Equal(t, r.Addr+uintptr(2*ps), extra.Addr, "first fit takes the hole")
		require.NoError(t, in.mem.Free(extra))

		ask(t, sec, "readable true", "readable %#x %d", r.Addr+uintptr(2*ps), ps)
		sec.Send("resync")
		assert.Equal(t, "event free "+hex(r.Addr+uintptr(2*ps))+" "+dec(ps), sec.Expect("event", 0),
			"page 2 was freed: it goes, announced first")
		sec.Expect("resynced", 0)
		ask(t, sec, "readable false", "readable %#x %d", r.Addr+uintptr(2*ps), ps)
		ask(t, sec, "ok", "check %#x %d 1", r.Addr, ps)
		ask(t, sec, "ok", "check %#x %d 2", later.Addr, ps)

		// A new allocation arrives with its event, after the mapping.
		fresh, err := in.mem.Alloc(2 * ps)
		require.NoError(t, err)
		sec.Send("resync")
		assert.Equal(t, "event alloc "+hex(fresh.Addr)+" "+dec(fresh.Len), sec.Expect("event", 0))
		sec.Expect("resynced", 0)
		ask(t, sec, "mapped 4", "mapped 0")
	})
}

func TestAttachFailsClearlyWhenRangeIsTaken(t *testing.T) {
	b := testenv.Tmpfs(t)
	in := newInstance(t, b, hugetlb.ListConfig{Pages: 4})
	l := in.mem.Lists()[0]

	p := startHelperExpectingFailure(t, in, "occupy")
	line := p.Expect("attach-error", 0)
	t.Log(line)
	assert.Contains(t, line, "inuse=true")
	assert.Contains(t, line, "["+hex(l.Base)+", "+hex(l.End)+")", "names the list's range")
	assert.Contains(t, line, "["+hex(l.Base+uintptr(l.PageSize))+", "+hex(l.Base+2*uintptr(l.PageSize))+")",
		"names what is in the way")
	assert.Contains(t, line, "ListConfig.Base", "names the knob")
	require.Error(t, p.Wait(0))

	// Without the obstacle the same attach works.
	startSecondary(t, in)
}

func TestAttachAfterPrimaryClosed(t *testing.T) {
	in := newInstance(t, testenv.Tmpfs(t), hugetlb.ListConfig{Pages: 2})
	require.NoError(t, in.mem.Close())
	p := startHelperExpectingFailure(t, in)
	assert.Contains(t, p.Expect("attach-error", 0), hugetlb.ErrClosed.Error())
}

func TestResyncWhilePrimaryChangesPages(t *testing.T) {
	b := testenv.Tmpfs(t)
	b.PageSize = 64 << 10 // cheap pages: the point is the interleaving
	in := newInstance(t, b, hugetlb.ListConfig{Pages: 64})
	sec := startSecondary(t, in)
	sec.Send("resync-loop 300")
	var held []hugetlb.Region
	for i := range 300 {
		if len(held) > 8 || (i%3 == 2 && len(held) > 0) {
			require.NoError(t, in.mem.Free(held[0]))
			held = held[1:]
			continue
		}
		r, err := in.mem.Alloc(uint64(1+i%4) * b.PageSize)
		require.NoError(t, err)
		held = append(held, r)
	}
	sec.Expect("looped", 0)
	ask(t, sec, "resynced", "resync")
	ask(t, sec, "consistent <nil>", "consistent")
}

// A secondary whose wait for the primary to end a change ran out while
// the secondary itself was stopped (a debugger, SIGSTOP, a CPU it did not
// get) looks once more before it fails: the primary ended the change
// meanwhile, and the resync succeeds.
func TestAResyncStoppedPastItsWaitLooksAgain(t *testing.T) {
	in := newInstance(t, testenv.Tmpfs(t), hugetlb.ListConfig{Pages: 4})
	p := startSecondary(t, in)
	in.mem.BeginChange()
	p.Send("resync-stalled 50")
	p.Expect("stalling", 0)
	in.mem.EndChange()
	p.Send("go")
	line, err := p.Next("", 0)
	require.NoError(t, err)
	require.Equal(t, "resynced", line, "the change had ended when it looked again")
	ask(t, p, "consistent <nil>", "consistent")
}

// A mapping that fails in a secondary leaves its range as unmapping would:
// an inaccessible reservation, the pages that were mapped there announced
// as freed and counted as not mapped, whatever the failure left behind —
// nothing changed (kernels since 6.12), nothing mapped at all (a
// MAP_FIXED that removed the old mapping, then failed), or the file
// mapped without DONTFORK (a mark that failed, and its undo too). A hole
// could be taken by any other mapping of the process, which a later unmap
// of the pages would then destroy; a mapping left in place and not
// counted would stay readable after the primary freed the pages, and a
// child forked meanwhile would keep it. If the release fails too (both do
// at the limit of the process's mappings, changing nothing), the pages
// stay counted as they are, and those mapped are announced again. Either
// way a resync maps the pages not mapped.
func TestAFailedMappingLeavesItsRangeUnmapped(t *testing.T) {
	for _, how := range []string{"kept", "hole", "unmarked", "kept-twice"} {
		t.Run(how, func(t *testing.T) {
			testenv.ForEachBackend(t, 4, func(t *testing.T, b hugetlb.Backend) {
				ps := b.PageSize
				in, r, sec := subscribedSecondary(t, b, 4, 2)
				more, err := in.mem.Alloc(2 * ps) // the secondary is not told
				require.NoError(t, err)
				fill(more.Bytes(), 2)

				page1 := r.Addr + uintptr(ps)
				sec.Send("map-failing %s 0 1 3", how)
				line, err := sec.Next("", 0)
				require.NoError(t, err)
				assert.Equal(t, "event free "+hex(page1)+" "+dec(ps), line,
					"page 1 was mapped here: it goes, announced")
				if strings.HasPrefix(line, "event ") {
					line, err = sec.Next("", 0)
					require.NoError(t, err)
				}
				if how == "kept-twice" { // still mapped: back, announced
					assert.Equal(t, "event alloc "+hex(page1)+" "+dec(ps), line)
					if strings.HasPrefix(line, "event ") {
						line, err = sec.Next("", 0)
						require.NoError(t, err)
					}
				}
				require.True(t, strings.HasPrefix(line, "error "), "the map failed: %s", line)
				require.Contains(t, line, "made to fail")
				ask(t, sec, "reserved true", "reserved %#x %d", page1, 3*ps)
				ask(t, sec, "readable false", "readable %#x %d", more.Addr, 2*ps)
				if how == "kept-twice" {
					ask(t, sec, "mapped 2", "mapped 0")
					ask(t, sec, "ok", "check %#x %d 1", r.Addr, 2*ps)
				} else {
					ask(t, sec, "mapped 1", "mapped 0")
					ask(t, sec, "readable false", "readable %#x %d", page1, ps)
					ask(t, sec, "ok", "check %#x %d 1", r.Addr, ps)
				}

				sec.Send("resync")
				remapped := hugetlb.Region{Addr: page1, Len: 3 * ps}
				if how == "kept-twice" {
					remapped = more
				}
				assert.Equal(t, "event alloc "+hex(remapped.Addr)+" "+dec(remapped.Len), sec.Expect("event", 0))
				sec.Expect("resynced", 0)
				ask(t, sec, "consistent <nil>", "consistent")
				ask(t, sec, "ok", "check %#x %d 1", r.Addr, 2*ps)
				ask(t, sec, "ok", "check %#x %d 2", more.Addr, 2*ps)
			})
		})
	}
}

// subscribedSecondary makes a memory of one list of pages pages on b,
// allocates the first n of them, filled with pattern 1, and starts a
// secondary that has mapped them and prints the events it receives.
func subscribedSecondary(t *testing.T, b hugetlb.Backend, pages, n int) (*instance, hugetlb.Region, *testproc.Proc) {
	t.Helper()
	in := newInstance(t, b, hugetlb.ListConfig{Pages: pages})
	r, err := in.mem.Alloc(uint64(n) * b.PageSize)
	require.NoError(t, err)
	fill(r.Bytes(), 1)
	sec := startSecondary(t, in)
	ask(t, sec, "subscribed", "subscribe")
	return in, r, sec
}
