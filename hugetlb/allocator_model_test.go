package hugetlb_test

import (
	"math/rand/v2"
	"os/exec"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/shm"
)

// The primary's allocator and double-free check against a page-by-page
// model, through quarantine (fences on and off, the fenced holder a real
// process that is killed to end it) and releases, with the shared page
// state rewritten at random between operations, as another process could:
// no page is handed out twice, no quarantined page is handed out, a free
// of anything not allocated is refused, a free of what is allocated
// succeeds, and every new page reads as zeros.
func TestTheAllocatorFollowsAModelUnderRewrittenStateAndQuarantine(t *testing.T) {
	b := testenv.Tmpfs(t)
	ps := b.PageSize
	const pages = 130
	in := newInstance(t, b, hugetlb.ListConfig{Pages: pages})
	base := in.mem.Lists()[0].Base
	table := in.seg.Root(shm.RootMemory)
	bitsOff := atomic.LoadUint64(&shm.Slice[uint64](in.seg, table+64+32, 1)[0])
	bits := shm.Slice[uint64](in.seg, bitsOff, 3)

	const (
		free = iota
		live
		held
	)
	model := make([]int, pages)
	rng := rand.New(rand.NewPCG(8, 8))
	var cmd *exec.Cmd
	var again *shm.Segment
	fenced := false
	var nAlloc, nRefused, nFree, nDouble, maxHeld int
	defer func() {
		t.Logf("allocs %d refused %d frees %d refused frees %d max quarantined %d", nAlloc, nRefused, nFree, nDouble, maxHeld)
	}()
	pageOf := func(a uintptr) int { return int(uint64(a-base) / ps) }

	for op := 0; op < 1500; op++ {
		if rng.IntN(3) == 0 {
			for i := range bits {
				atomic.StoreUint64(&bits[i], rng.Uint64())
			}
		}
		switch k := rng.IntN(10); {
		case k < 4: // alloc
			n := 1 + rng.IntN(4)
			r, err := in.mem.Alloc(uint64(n) * ps)
			if err != nil {
				require.ErrorIs(t, err, hugetlb.ErrNoFreeRun, "op %d", op)
				nRefused++
				// Is there a run of n free pages in the model?
				run := 0
				for i := 0; i < pages; i++ {
					if model[i] == free {
						run++
						require.Less(t, run, n, "op %d: alloc of %d refused with a free run at %d", op, n, i-run+1)
					} else {
						run = 0
					}
				}
				continue
			}
			nAlloc++
			f := pageOf(r.Addr)
			for i := f; i < f+n; i++ {
				require.Equal(t, free, model[i], "op %d: page %d handed out while %d", op, i, model[i])
				model[i] = live
				page := vmBytes(r.Addr+uintptr(uint64(i-f)*ps), ps)
				require.Equal(t, byte(0), page[0], "op %d: page %d not zero", op, i)
				page[0] = 0xa5
			}
		case k < 7: // free
			f := rng.IntN(pages)
			n := 1 + rng.IntN(min(3, pages-f))
			allLive := true
			for i := f; i < f+n; i++ {
				allLive = allLive && model[i] == live
			}
			err := in.mem.Free(hugetlb.Region{Addr: base + uintptr(uint64(f)*ps), Len: uint64(n) * ps})
			if !allLive {
				require.ErrorIs(t, err, hugetlb.ErrDoubleFree, "op %d: free [%d,+%d) %v", op, f, n, model[f:f+n])
				nDouble++
				continue
			}
			require.NoError(t, err, "op %d", op)
			nFree++
			for i := f; i < f+n; i++ {
				if fenced {
					model[i] = held
				} else {
					model[i] = free
				}
			}
		case k < 8: // toggle the fence
			if !fenced {
				cmd = exec.CommandContext(t.Context(), "sleep", "1000")
				require.NoError(t, cmd.Start())
				holder := cmd
				t.Cleanup(func() { _ = holder.Process.Kill(); _ = holder.Wait() })
				var err error
				again, err = shm.Attach(in.opts)
				require.NoError(t, err)
				require.True(t, in.seg.Fence(again.Slot(), 1000, cmd.Process.Pid, testenv.ProcessStart(t, cmd.Process.Pid)))
				fenced = true
			} else {
				require.NoError(t, cmd.Process.Kill())
				_ = cmd.Wait()
				// Polled: the quarantine ends once the kernel says the
				// holder is gone.
				deadline := time.Now().Add(5 * time.Second)
				for in.mem.ReleaseQuarantine(); in.mem.Quarantined() > 0 && time.Now().Before(deadline); in.mem.ReleaseQuarantine() {
					time.Sleep(time.Millisecond)
				}
				require.Zero(t, in.mem.Quarantined())
				for i := range model {
					if model[i] == held {
						model[i] = free
					}
				}
				fenced = false
				again.Close()
			}
		default: // quarantine counted right
			h := 0
			for _, s := range model {
				if s == held {
					h++
				}
			}
			require.Equal(t, h, in.mem.Quarantined(), "op %d", op)
			maxHeld = max(maxHeld, h)
		}
	}
	if fenced {
		again.Close()
	}
}

// vmBytes returns the memory [addr, addr+n) of data memory.
func vmBytes(addr uintptr, n uint64) []byte { return hugetlb.Region{Addr: addr, Len: n}.Bytes() }
