package cache

import (
	"fmt"
	"math/rand/v2"
	"testing"
)

// pageEntries returns n entries of one 4 KiB page each, back to back from
// base, as single-page mode registers a run of pages.
func pageEntries(base uint64, n int) []Entry {
	es := make([]Entry, n)
	for i := range es {
		s := base + uint64(i)*4096
		es[i] = Entry{Start: s, End: s + 4096, LKey: uint32(i + 1)}
	}
	return es
}

// A lookup that misses the top half and is answered by the queue's bottom
// half or by the global table, each holding 32,768 single-page chunks
// (target: 10 ns). Addresses are random pages, so the top half almost
// never holds the answer.
//
// The tables are filled directly with the chunks single-page mode would
// register: registering 32,768 MRs one Create at a time takes about half
// a minute here, and a lookup reads only the tables.
func BenchmarkLookupPastTopHalf(b *testing.B) {
	const n = 32768
	p := newPrimary(b, fixtureConfig{pages: 4, tableSize: 2 * n})
	es := pageEntries(1<<40, n)
	if err := p.g.Exclusive(func() {
		t, err := p.g.table()
		if err != nil {
			b.Fatal(err)
		}
		t.Fill(es)
	}); err != nil {
		b.Fatal(err)
	}
	l := NewLocal(p.g, p.g, 2*n)
	l.bh.Fill(es)
	rng := rand.New(rand.NewPCG(1, 1))
	addrs := make([]uintptr, 4096)
	for i := range addrs {
		addrs[i] = uintptr(es[rng.IntN(n)].Start) + uintptr(rng.IntN(4096))
	}
	b.Run(fmt.Sprintf("MRs=%d/bottom", n), func(b *testing.B) {
		b.ReportAllocs()
		before := l.Stats()
		var sink uint32
		for i := range b.N {
			k, err := l.Lookup(addrs[i&4095])
			if err != nil {
				b.Fatal(err)
			}
			sink += k
		}
		_ = sink
		if st := l.Stats(); st.GlobalHits != before.GlobalHits || st.Created != before.Created {
			b.Fatalf("left the queue's cache: %+v", st)
		}
	})
	b.Run(fmt.Sprintf("MRs=%d/global", n), func(b *testing.B) {
		b.ReportAllocs()
		var sink uint32
		for i := range b.N {
			e, found, err := p.g.Lookup(uint64(addrs[i&4095]))
			if !found || err != nil {
				b.Fatal("miss", err)
			}
			sink += e.LKey
		}
		_ = sink
	})
}
