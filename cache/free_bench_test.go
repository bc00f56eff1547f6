package cache

import (
	"fmt"
	"testing"

	"github.com/mpmr/mpmr/hugetlb"
)

// Free of one page while n MRs are registered, the invalidation and the
// table rebuild included: the cost of a free in the primary's cache. Pages
// are 4 KiB on tmpfs so that a thousand MRs cost little memory; the cache
// does the same work whatever the page size.
func BenchmarkFree(b *testing.B) {
	for _, n := range []int{1, 64, 1024} {
		b.Run(fmt.Sprintf("mrs=%d", n), func(b *testing.B) {
			p := newPrimary(b, fixtureConfig{pages: 2*n + 2, single: true, pageSize: 4096, tableSize: 2 * n})
			ps := p.pageSize()
			// n single-page MRs, each page followed by a free one so that
			// each stays its own run.
			pages := make([]hugetlb.Region, n)
			for i := range n {
				r := p.alloc(b, 2)
				if err := p.mem.Free(hugetlb.Region{Addr: r.Addr + uintptr(ps), Len: ps}); err != nil {
					b.Fatal(err)
				}
				pages[i] = hugetlb.Region{Addr: r.Addr, Len: ps}
				if _, err := p.g.Create(uint64(r.Addr)); err != nil {
					b.Fatal(err)
				}
			}
			victim := pages[n/2]
			b.ReportAllocs()
			b.ResetTimer()
			for range b.N {
				if err := p.mem.Free(victim); err != nil {
					b.Fatal(err)
				}
				b.StopTimer()
				r, err := p.mem.Alloc(ps)
				if err != nil || r.Addr != victim.Addr {
					b.Fatalf("realloc: %v at 0x%x, want 0x%x", err, r.Addr, victim.Addr)
				}
				if _, err := p.g.Create(uint64(r.Addr)); err != nil {
					b.Fatal(err)
				}
				p.g.GC()
				b.StartTimer()
			}
			if st := p.g.Stats(); st.MRs != n {
				b.Fatalf("%d MRs registered, want %d", st.MRs, n)
			}
		})
	}
}
