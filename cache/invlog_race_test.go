package cache

import (
	"sync"
	"sync/atomic"
	"testing"
)

// The linearizability test's selective path relies on this: a reader of
// the invalidation log whose entry is overwritten while it reads never
// takes the new entry's range for the generation it asked about. The
// primary's own writer (bumpGen) keeps rewriting the one slot of a
// one-entry log with generation G (range A) and G+1 (range B); a reader
// asking what generation G invalidated must get A, or be told the log
// cannot say (and flush everything) — never B, which would keep a cached
// entry of range A alive after its memory was freed.
func TestInvalidationLogReaderNeverTakesAnOverwrittenEntry(t *testing.T) {
	p := newPrimary(t, fixtureConfig{pages: 4, logSize: 1})
	g := p.g
	base := atomic.LoadUint32(g.devGen)
	gen := base + 1
	a := span{0x1000, 0x2000}
	b := span{0x9000, 0xa000}
	var stop atomic.Bool
	var wg sync.WaitGroup
	wg.Add(1)
	started := make(chan struct{})
	go func() {
		defer wg.Done()
		for i := 0; !stop.Load(); i++ {
			atomic.StoreUint32(g.devGen, base)
			g.bumpGen(a.start, a.end) // entry (G, A)
			g.bumpGen(b.start, b.end) // entry (G+1, B), in the same slot
			if i == 0 {
				close(started)
			}
		}
	}()
	<-started
	var torn, trusted, refused int
	dst := make([]span, 0, 1)
	// At least 2 million reads, and on until both answers were seen: on
	// a loaded machine the writer may not run during the first ones.
	for i := 0; (i < 2_000_000 || trusted == 0 || refused == 0) && i < 100_000_000 && torn == 0; i++ {
		if s, ok := g.invalidated(gen-1, gen, dst[:0]); !ok {
			refused++
		} else if trusted++; len(s) != 1 || s[0] != a {
			torn++
		}
	}
	stop.Store(true)
	wg.Wait()
	if torn != 0 {
		t.Fatalf("a reader took another generation's range for generation %d (%d of %d answers trusted)", gen, torn, trusted)
	}
	if trusted == 0 || refused == 0 {
		t.Fatalf("the race was not run: %d answers trusted, %d refused", trusted, refused)
	}
	t.Logf("%d answers trusted, %d refused", trusted, refused)
}
