package cache

import (
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/verbs"
)

// TestDifferential runs random sequences of allocations, frees, lookups
// through several queues, creates and mempool registrations, and checks
// every answer against a plain model of which pages are allocated, and every
// key with the soft device.
func TestDifferential(t *testing.T) {
	for _, single := range []bool{false, true} {
		name := "extended"
		if single {
			name = "single-page"
		}
		t.Run(name, func(t *testing.T) {
			p := newPrimary(t, fixtureConfig{pages: 48, single: single, tableSize: 8})
			ps := p.pageSize()
			base := p.mem.Lists()[0].Base
			rng := rand.New(rand.NewPCG(7, uint64(len(name))))
			allocated := make([]bool, 48) // the model
			var regions []hugetlb.Region
			queues := []*Local{NewLocal(p.g, p.g, 4), NewLocal(p.g, p.g, 4), NewLocal(p.g, &forwarder{g: p.g}, 4)}
			pool := 0

			pageOf := func(a uintptr) int { return int((a - base) / uintptr(ps)) }
			for step := range 3000 {
				switch op := rng.IntN(10); {
				case op == 0 && len(regions) < 12:
					r, err := p.mem.Alloc(uint64(1+rng.IntN(4)) * ps)
					if err != nil {
						require.ErrorIs(t, err, hugetlb.ErrNoFreeRun, "step %d", step)
						continue
					}
					for i := pageOf(r.Addr); i < pageOf(r.End()); i++ {
						require.False(t, allocated[i])
						allocated[i] = true
					}
					regions = append(regions, r)
				case op == 1 && len(regions) > 0:
					i := rng.IntN(len(regions))
					r := regions[i]
					// Free the whole region or one of its pages.
					if n := r.Len / ps; n > 1 && rng.IntN(2) == 0 {
						k := uint64(rng.IntN(int(n)))
						page := hugetlb.Region{Addr: r.Addr + uintptr(k*ps), Len: ps}
						require.NoError(t, p.mem.Free(page), "step %d", step)
						allocated[pageOf(page.Addr)] = false
						regions = append(regions[:i], regions[i+1:]...)
						if k > 0 {
							regions = append(regions, hugetlb.Region{Addr: r.Addr, Len: k * ps})
						}
						if k+1 < n {
							regions = append(regions, hugetlb.Region{Addr: page.End(), Len: (n - k - 1) * ps})
						}
						continue
					}
					require.NoError(t, p.mem.Free(r), "step %d", step)
					for j := pageOf(r.Addr); j < pageOf(r.End()); j++ {
						allocated[j] = false
					}
					regions = append(regions[:i], regions[i+1:]...)
				case op == 2 && len(regions) > 0:
					r := regions[rng.IntN(len(regions))]
					e, err := p.g.Create(uint64(r.Addr) + rng.Uint64N(r.Len))
					require.NoError(t, err, "step %d", step)
					for a := e.Start; a < e.End; a += ps {
						require.True(t, allocated[pageOf(uintptr(a))], "step %d: entry %v covers a free page", step, e)
					}
				case op == 3 && len(regions) > 0:
					r := regions[rng.IntN(len(regions))]
					p.mem.RLock() // the pool must not move under us
					mp := &fakePool{name: "pool", chunks: []Chunk{{Addr: r.Addr, Len: r.Len}}}
					p.mem.RUnlock()
					pool++
					require.NoError(t, queues[rng.IntN(len(queues))].RegisterMempool(mp), "step %d", step)
				default:
					a := base + uintptr(rng.Uint64N(48*ps))
					q := queues[rng.IntN(len(queues))]
					k, err := q.Lookup(a)
					if !allocated[pageOf(a)] {
						require.ErrorIs(t, err, ErrNoMemory, "step %d: lookup of free page %d", step, pageOf(a))
						continue
					}
					require.NoError(t, err, "step %d", step)
					require.NoError(t, p.dev.Validate(verbs.SGE{Addr: a, Len: 1, Key: k}, verbs.AccessLocalWrite),
						"step %d: key 0x%x for 0x%x", step, k, a)
				}
			}
			d, err := p.g.Dump()
			require.NoError(t, err)
			for _, m := range d.MRs {
				for _, c := range m.Chunks {
					for a := c.Start; a < c.End; a += ps {
						require.True(t, allocated[pageOf(uintptr(a))], "MR chunk %v covers a free page", c)
					}
				}
			}
			t.Logf("%d MRs, %d table entries, %d mempool registrations, gen %d", len(d.MRs), len(d.Table), pool, d.DevGen)
		})
	}
}

type fakePool struct {
	name   string
	chunks []Chunk
}

func (f *fakePool) Name() string    { return f.name }
func (f *fakePool) Chunks() []Chunk { return f.chunks }
