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

// LookupBurst of a transmit burst of 32 addresses (targets: 0.5 ns per
// address in one MR; no more than the Lookup loop over 8 MRs). Each
// iteration looks up one burst; ns/addr is the figure to compare.
func BenchmarkLookupBurst(b *testing.B) {
	es := spaced(8)
	rng := rand.New(rand.NewPCG(2, 2))
	const burst = 32
	bursts := func(mrs int) [][]uintptr {
		out := make([][]uintptr, 128)
		for i := range out {
			out[i] = make([]uintptr, burst)
			for j := range out[i] {
				e := es[rng.IntN(mrs)]
				out[i][j] = uintptr(e.Start + rng.Uint64N(e.End-e.Start))
			}
		}
		return out
	}
	for _, c := range []struct {
		name string
		mrs  int
	}{{"one MR", 1}, {"8 MRs", 8}} {
		addrs := bursts(c.mrs)
		keys := make([]uint32, burst)
		b.Run(c.name+"/LookupBurst", func(b *testing.B) {
			l := topOnly(es)
			b.ReportAllocs()
			for i := range b.N {
				if n, err := l.LookupBurst(addrs[i&127], keys); n != burst || err != nil {
					b.Fatal(n, err)
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*burst), "ns/addr")
		})
		b.Run(c.name+"/Lookup", func(b *testing.B) {
			l := topOnly(es)
			b.ReportAllocs()
			for i := range b.N {
				for j, a := range addrs[i&127] {
					k, err := l.Lookup(a)
					if err != nil {
						b.Fatal(err)
					}
					keys[j] = k
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*burst), "ns/addr")
		})
	}
}
