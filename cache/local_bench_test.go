package cache

import (
	"math/rand/v2"
	"testing"
)

// topOnly returns a local cache whose top half holds es (at most 8) and
// whose generation never moves; misses are not expected.
func topOnly(es []Entry) *Local {
	var gen uint32
	l := &Local{devGen: &gen, bh: NewTable(defaultLocalSize)}
	for _, e := range es {
		l.promote(e)
	}
	return l
}

// The top-half benchmarks measure Lookup and the inlinable Hit a datapath
// loop calls first. Compare with the same top-half search written in C and
// measured in the same run (see README, Performance). They loop over b.N
// with a result sink, the shape of the C loop (b.Loop adds about half a
// nanosecond per iteration here).

func BenchmarkTopHalfMRU(b *testing.B) {
	es := spaced(8)
	l := topOnly(es)
	l.mru = 0
	base := uintptr(es[0].Start)
	b.Run("Hit", func(b *testing.B) {
		b.ReportAllocs()
		var sink uint32
		for i := range b.N {
			k, ok := l.Hit(base + uintptr(i&1023))
			if !ok {
				b.Fatal("miss")
			}
			sink += k
		}
		_ = sink
	})
	b.Run("Lookup", func(b *testing.B) {
		b.ReportAllocs()
		var sink uint32
		for i := range b.N {
			k, err := l.Lookup(base + uintptr(i&1023))
			if err != nil {
				b.Fatal(err)
			}
			sink += k
		}
		_ = sink
	})
}

func BenchmarkTopHalfRandom8(b *testing.B) {
	es := spaced(8)
	l := topOnly(es)
	rng := rand.New(rand.NewPCG(1, 1))
	addrs := make([]uintptr, 4096)
	for i := range addrs {
		e := es[rng.IntN(len(es))]
		addrs[i] = uintptr(e.Start + rng.Uint64N(e.End-e.Start))
	}
	b.Run("Hit", func(b *testing.B) {
		b.ReportAllocs()
		var sink uint32
		for i := range b.N {
			k, ok := l.Hit(addrs[i&4095])
			if !ok {
				b.Fatal("miss")
			}
			sink += k
		}
		_ = sink
	})
	b.Run("Lookup", func(b *testing.B) {
		b.ReportAllocs()
		var sink uint32
		for i := range b.N {
			k, err := l.Lookup(addrs[i&4095])
			if err != nil {
				b.Fatal(err)
			}
			sink += k
		}
		_ = sink
	})
}
