package cache

import (
	"context"
	"testing"

	"github.com/mpmr/mpmr/hugetlb"
)

// Global lookup including its synchronisation (target: 20 ns): the
// optimistic read, and the same lookup under the read lock.
func BenchmarkGlobalLookup(b *testing.B) {
	p := newPrimary(b, fixtureConfig{pages: 16, single: true})
	r := p.alloc(b, 8)
	ps := uintptr(p.pageSize())
	for i := range uintptr(8) {
		if _, err := p.g.Create(uint64(r.Addr + i*ps)); err != nil {
			b.Fatal(err)
		}
	}
	b.Run("optimistic", func(b *testing.B) {
		b.ReportAllocs()
		i := uintptr(0)
		for b.Loop() {
			if _, found, err := p.g.Lookup(uint64(r.Addr + (i&7)*ps)); !found || err != nil {
				b.Fatal("miss", err)
			}
			i++
		}
	})
	b.Run("rlock", func(b *testing.B) {
		b.ReportAllocs()
		ctx := context.Background()
		i := uintptr(0)
		for b.Loop() {
			h, err := p.g.lock.RLock(ctx)
			if err != nil {
				b.Fatal(err)
			}
			_, found, err := p.g.find(uint64(r.Addr + (i&7)*ps))
			if uerr := p.g.lock.RUnlock(h); uerr != nil {
				err = uerr
			}
			if !found || err != nil {
				b.Fatal("miss", err)
			}
			i++
		}
	})
}

// MR creation in the primary: registration of a fresh 2 MiB page and
// insertion, then the free event and garbage collection that undo it.
func BenchmarkCreateMR(b *testing.B) {
	for _, kind := range []string{"tmpfs", "hugetlbfs"} {
		b.Run(kind, func(b *testing.B) {
			var bk hugetlb.Backend
			if kind == "hugetlbfs" {
				bk = hugetlbOrSkip(b)
			}
			p := newPrimary(b, fixtureConfig{backend: bk, pages: 4})
			ps := p.pageSize()
			r := p.alloc(b, 1)
			b.ReportAllocs()
			for b.Loop() {
				b.StopTimer()
				p.g.GC()
				b.StartTimer()
				e, err := p.g.Create(uint64(r.Addr))
				if err != nil {
					b.Fatal(err)
				}
				b.StopTimer()
				// Make the next Create register again: drop the MR.
				if err := p.g.invalidate(e.Start, ps); err != nil {
					b.Fatal(err)
				}
				b.StartTimer()
			}
		})
	}
}

// Rebuild of a 512-entry global table from 512 MRs.
func BenchmarkRebuild512(b *testing.B) {
	p := newPrimary(b, fixtureConfig{pages: 1024, single: true, tableSize: 1024, maxMRs: 1024})
	r := p.alloc(b, 512)
	ps := uintptr(p.pageSize())
	for i := range uintptr(512) {
		if _, err := p.g.Create(uint64(r.Addr + i*ps)); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportAllocs()
	for b.Loop() {
		err := p.g.writeLock()
		if err != nil {
			b.Fatal(err)
		}
		if err := p.g.rebuild(); err != nil {
			b.Fatal(err)
		}
		p.g.writeUnlock()
	}
	if n := p.g.Stats().TableLen; n != 512 {
		b.Fatalf("table holds %d entries", n)
	}
}
