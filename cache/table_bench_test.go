package cache

import (
	"fmt"
	"math/rand/v2"
	"sync/atomic"
	"testing"
)

// benchAddrs returns 4096 addresses spread over the entries, as the C
// reference loop does.
func benchAddrs(es []Entry) []uint64 {
	rng := rand.New(rand.NewPCG(1, 1))
	out := make([]uint64, 4096)
	for i := range out {
		e := es[rng.IntN(len(es))]
		out[i] = e.Start + rng.Uint64N(e.End-e.Start)
	}
	return out
}

// lookupBranchFree is the branch-free binary search the table's loop is
// measured against: the comparison only picks the next base (a conditional
// move), and the remaining length shrinks the same way on both sides.
func lookupBranchFree(t *Table, addr uint64) (uint32, int) {
	n := min(int(atomic.LoadUint32(&t.hdr.Len)), len(t.ents))
	ents := t.ents[:n:n]
	base := 0
	for n > 1 {
		half := n >> 1
		if atomic.LoadUint64(&ents[base+half].Start) <= addr {
			base += half
		}
		n -= half
	}
	e := &ents[base]
	if addr < atomic.LoadUint64(&e.End) {
		return atomic.LoadUint32(&e.LKey), base
	}
	return InvalidKey, base
}

func TestBranchFreeAgrees(t *testing.T) {
	es := spaced(300)
	tb := NewTable(512)
	for _, e := range es {
		_ = tb.Insert(e)
	}
	for _, a := range benchAddrs(es) {
		for _, d := range []uint64{0, 1 << 22} {
			k1, i1 := tb.Lookup(a + d)
			k2, i2 := lookupBranchFree(tb, a+d)
			if k1 != k2 || i1 != i2 {
				t.Fatalf("addr 0x%x: loop (%x, %d) branch-free (%x, %d)", a+d, k1, i1, k2, i2)
			}
		}
	}
}

// Table lookup with 256 entries; compare with the same search written in C
// and measured in the same run (see README, Performance). The loop has the
// C loop's shape: b.N iterations into a sink.
func BenchmarkTableLookup256(b *testing.B) {
	es := spaced(256)
	tb := NewTable(257)
	for _, e := range es {
		_ = tb.Insert(e)
	}
	addrs := benchAddrs(es)
	b.Run("loop", func(b *testing.B) {
		b.ReportAllocs()
		var sink uint32
		for i := range b.N {
			k, _ := tb.Lookup(addrs[i&4095])
			sink += k
		}
		_ = sink
	})
	b.Run("branchfree", func(b *testing.B) {
		b.ReportAllocs()
		var sink uint32
		for i := range b.N {
			k, _ := lookupBranchFree(tb, addrs[i&4095])
			sink += k
		}
		_ = sink
	})
}

// Table lookup at the sizes the C reference is run with (`run lookup N`):
// N entries of 2 MiB with 2 MiB gaps, 4096 addresses spread over them,
// b.N iterations into a sink, as the C loop does. Targets: 0.8, 0.4 and
// 0.3 times C at 256, 4,096 and 32,768 entries (see README, Performance).
func BenchmarkTableLookup(b *testing.B) {
	for _, n := range []int{256, 4096, 32768} {
		b.Run(fmt.Sprintf("n=%d", n), func(b *testing.B) {
			es := spaced(n)
			tb := NewTable(n + 1)
			for _, e := range es {
				_ = tb.Insert(e)
			}
			addrs := benchAddrs(es)
			b.ReportAllocs()
			b.ResetTimer()
			var sink uint32
			for i := range b.N {
				k, _ := tb.Lookup(addrs[i&4095])
				sink += k
			}
			_ = sink
		})
	}
}
