package cache

import (
	"fmt"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/verbs"
)

// Another process links a live MR's record into the free list (any
// process mapping the segment can write the list words). A collection
// must not deregister that MR, nor free its record under the list that
// still holds it: what is released is what the owner moved to the free
// list itself.
func TestCollectReleasesOnlyWhatTheOwnerFreed(t *testing.T) {
	p := newPrimary(t, fixtureConfig{single: true})
	r := p.alloc(t, 2)
	e, err := p.g.Create(uint64(r.Addr))
	require.NoError(t, err)
	require.NoError(t, p.validates(r.Addr, e.LKey))

	live := atomic.LoadUint64(&p.g.root.MRList)
	require.NotZero(t, live)
	atomic.StoreUint64(&p.g.root.FreeList, live) // the other process's writes
	atomic.StoreUint32(&p.g.root.FreeCount, 1)
	_, err = p.g.Collect()
	require.NoError(t, err)
	assert.NoError(t, p.validates(r.Addr, e.LKey), "a collection deregistered a live MR a rewritten list named")
	assert.Equal(t, 1, p.g.Stats().MRs)

	// The pages' next MR must not land on the live one's record.
	e2, err := p.g.Create(uint64(r.Addr) + p.pageSize())
	require.NoError(t, err)
	got, found, err := p.g.Lookup(uint64(r.Addr))
	require.NoError(t, err)
	require.True(t, found)
	assert.Equal(t, e, got, "the live MR's record was reused")
	assert.NoError(t, p.validates(r.Addr, e.LKey))
	assert.NoError(t, p.validates(r.Addr+uintptr(p.pageSize()), e2.LKey))
}

// Another process rewrites one word of a live MR's record: its Start, so
// that the record claims the pages of another region. A free of that
// other region must leave the live MR alone: the device keeps accepting
// its key over memory nobody freed, and a queue that cached it serves a
// key the device accepts.
func TestAFreeLeavesAnMRWhoseRecordWasRewrittenAlone(t *testing.T) {
	p := newPrimary(t, fixtureConfig{single: true})

	a := p.alloc(t, 1)
	b := p.alloc(t, 1)
	_, err := p.g.Create(uint64(a.Addr))
	require.NoError(t, err)
	eb, err := p.g.Create(uint64(b.Addr))
	require.NoError(t, err)
	require.NoError(t, p.validates(b.Addr, eb.LKey))
	q := NewLocal(p.g, p.g, 0)
	k, err := q.Lookup(b.Addr)
	require.NoError(t, err)
	require.Equal(t, eb.LKey, k)

	// The record of B's MR, as the list names it.
	var recB *mrRecord
	require.NoError(t, p.g.eachMR(atomic.LoadUint64(&p.g.root.MRList), func(m mr) bool {
		if atomic.LoadUint32(&m.rec.LKey) == eb.LKey {
			recB = m.rec
		}
		return true
	}))
	require.NotNil(t, recB)
	atomic.StoreUint64(&recB.Start, uint64(a.Addr)) // the other process's only write

	require.NoError(t, p.mem.Free(a))
	_, err = p.g.Collect()
	require.NoError(t, err)

	assert.NoError(t, p.validates(b.Addr, eb.LKey), "the live MR over B (never freed) was deregistered")
	k2, err := q.Lookup(b.Addr)
	t.Logf("queue lookup of B after the free of A: key %#x err %v (B's MR key %#x)", k2, err, eb.LKey)
	if err == nil {
		assert.NoError(t, p.validates(b.Addr, k2), "the queue serves a key for B the device refuses")
	}
}

// Another process unlinks the MR list (root MRList = 0) before each free.
// An MR the free leaves without a page must still be deregistered: were
// it kept until Close, every cycle would leave one more device slot
// taken, until the device is full and every create fails.
func TestAnUnlinkedListLeavesNoRegistrationBehind(t *testing.T) {
	p := newPrimary(t, fixtureConfig{single: true, maxMRs: 8})
	for i := 0; i < 24; i++ {
		r := p.alloc(t, 1)
		_, err := p.g.Create(uint64(r.Addr))
		require.NoError(t, err, "cycle %d: device stats %+v, owned %d", i, p.dev.Stats(), len(p.g.owned))
		atomic.StoreUint64(&p.g.root.MRList, 0) // the other process's write
		atomic.StoreUint32(&p.g.root.MRCount, 0)
		require.NoError(t, p.mem.Free(r))
		_, _ = p.g.Collect()
	}
}

// Collections running beside frees (a Create's, on another goroutine, as
// the IPC server runs them) must release nothing a free is still moving
// to the free list: a record released there would be named by the free
// list in the segment after it went back to the arena, for tools to show
// as a free MR and, once reused, a live one.
func TestCollectBesideFreesReleasesNothingTheFreeListStillNames(t *testing.T) {
	const n = 3000
	p := newPrimary(t, fixtureConfig{pages: n + 8, single: true, pageSize: 4096, tableSize: 2 * n})
	ps := uintptr(p.pageSize())
	r := p.alloc(t, n)
	for i := 0; i < n; i++ { // page 0's MR ends up last on the list
		_, err := p.g.Create(uint64(r.Addr + uintptr(i)*ps))
		require.NoError(t, err)
	}
	var hits, frees int
	var mu sync.Mutex
	var firstHit string
	// Runs after the cache's guard (the invalidation), before the
	// primary's collection: what does the shared free list name now?
	defer p.mem.GuardFree(func(ev hugetlb.Event) error {
		// Looked at under the write lock, which a collection takes to
		// empty the list and choose what to release.
		var head uint64
		var owned bool
		var blkErr error
		require.NoError(t, p.g.Exclusive(func() {
			head = atomic.LoadUint64(&p.g.root.FreeList)
			if head != 0 {
				_, owned = p.g.ownedAt(head)
				_, blkErr = p.seg.BlockSize(head)
			}
		}))
		if head == 0 {
			return nil
		}
		mu.Lock()
		defer mu.Unlock()
		frees++
		if !owned || blkErr != nil {
			hits++
			if firstHit == "" {
				firstHit = fmt.Sprintf("free list head %#x: owned=%t arena block error=%v", head, owned, blkErr)
				if d, err := p.g.Dump(); err == nil {
					for _, m := range d.FreeMRs {
						if m.Offset == head {
							firstHit += fmt.Sprintf("; Dump lists it as a free MR (lkey %#x)", m.LKey)
						}
					}
				}
			}
		}
		return nil
	})()
	defer collectOnFree(p)()

	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { // a Create's GC on another goroutine, as the IPC server runs them
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			default:
			}
			_, _ = p.g.Collect()
		}
	}()
	for i := 0; i < 400; i++ {
		require.NoError(t, p.mem.Free(hugetlb.Region{Addr: r.Addr + uintptr(i)*ps, Len: uint64(ps)}))
	}
	close(stop)
	wg.Wait()
	t.Logf("%d of %d frees left the shared free list naming a record already released; first: %s", hits, frees, firstHit)
	assert.Zero(t, hits, "Collect released a record while the shared free list named it")
}

// Another process zeroes one word of a live MR's record (its BitmapLen)
// and puts it back after a free of the MR's page was refused. The refused
// free must have changed nothing: the MR is still listed, registered and
// served, the primary creates as before, and the free asked again works.
func TestARefusedFreeChangesNothing(t *testing.T) {
	p := newPrimary(t, fixtureConfig{pages: 8, single: true})
	defer collectOnFree(p)()
	r := p.alloc(t, 1)
	e, err := p.g.Create(uint64(r.Addr))
	require.NoError(t, err)
	off := atomic.LoadUint64(&p.g.root.MRList)
	m, err := p.g.mrAt(off)
	require.NoError(t, err)
	require.Equal(t, e.LKey, atomic.LoadUint32(&m.rec.LKey))

	bl := atomic.LoadUint32(&m.rec.BitmapLen)
	atomic.StoreUint32(&m.rec.BitmapLen, 0) // the other process's write
	err = p.mem.Free(r)
	t.Logf("free with the record rewritten: %v", err)
	require.ErrorIs(t, err, hugetlb.ErrNotFreed)
	o, _ := p.g.ownedAt(off)
	t.Logf("after the refused free: owner's record freed=%t, freed count %d, MR list head %#x", o.freed, p.g.freedCount(), atomic.LoadUint64(&p.g.root.MRList))
	atomic.StoreUint32(&m.rec.BitmapLen, bl) // and puts it back

	// A create of other memory collects first.
	r2 := p.alloc(t, 1)
	for i := 0; i < 3; i++ {
		_, err = p.g.Create(uint64(r2.Addr))
		t.Logf("create %d of other memory after the word was put back: %v", i, err)
	}
	assert.NoError(t, err, "the primary does not create again once the record is put back")
	st := p.dev.Stats()
	t.Logf("device live MRs %d, owner's record %d", st.LiveMRs, len(p.g.owned))

	_, blkErr := p.seg.BlockSize(off)
	listed := false
	require.NoError(t, p.g.eachMR(atomic.LoadUint64(&p.g.root.MRList), func(m mr) bool {
		listed = m.off == off
		return !listed
	}))
	t.Logf("the MR's record listed: %t; its arena block: %v", listed, blkErr)
	assert.True(t, listed, "the MR of the memory the free was refused for is no longer listed")
	assert.NoError(t, blkErr, "the record of an MR whose free was refused went back to the arena")

	// The memory was never freed: its key must still be served and valid.
	got, found, err := p.g.Lookup(uint64(r.Addr))
	t.Logf("lookup of the never-freed page: %+v found=%t err=%v", got, found, err)
	if err == nil && found {
		assert.NoError(t, p.validates(r.Addr, got.LKey), "a lookup serves a key the device deregistered")
	}
	q := NewLocal(p.g, p.g, 0)
	k, err := q.Lookup(r.Addr)
	t.Logf("queue lookup: key %#x err %v", k, err)
	if err == nil {
		assert.NoError(t, p.validates(r.Addr, k), "a queue serves a key the device refuses for memory nobody freed")
	}
	assert.NoError(t, p.mem.Free(r), "the free asked again")
}

// hookPD runs hook (once) at the device's trim: the moment another
// process's write lands between the free's pre-check and its writes.
type hookPD struct {
	verbs.PD
	hook func()
	done bool
}

func (p *hookPD) TrimMR(m verbs.MR, addr, length uintptr) error {
	if !p.done && p.hook != nil {
		p.done = true
		p.hook()
	}
	return p.PD.(verbs.Trimmer).TrimMR(m, addr, length)
}

// afterAFreeOfPage0 checks the keys of a two-page MR over r after a free
// of its first page that returned err, whichever way it went, while
// another process rewrote words of the segment (put back since): if it
// was refused, page 0's key is good still, and served and created; if it
// went, the device refuses the key over page 0, no lookup is served it,
// page 1 keeps its key, and page 0 allocated again gets a good one.
func afterAFreeOfPage0(t *testing.T, p *primary, r hugetlb.Region, key uint32, err error) {
	t.Helper()
	ps := uintptr(p.pageSize())
	page0 := hugetlb.Region{Addr: r.Addr, Len: uint64(ps)}
	if err != nil {
		require.ErrorIs(t, err, hugetlb.ErrNotFreed)
		assert.NoError(t, p.validates(r.Addr, key), "a refused free trimmed the device over memory that stays allocated")
		got, found, err := p.g.Lookup(uint64(r.Addr))
		require.NoError(t, err)
		if found {
			assert.NoError(t, p.validates(r.Addr, got.LKey), "the cache serves a key the device refuses for memory nobody freed")
		}
		ce, err := p.g.Create(uint64(r.Addr))
		require.NoError(t, err)
		assert.NoError(t, p.validates(r.Addr, ce.LKey), "Create returns a key the device refuses")
		require.NoError(t, p.mem.Free(page0), "the free asked again")
	} else {
		assert.Error(t, p.validates(r.Addr, key), "the device accepts the key over a freed page")
		_, found, err := p.g.Lookup(uint64(r.Addr))
		require.NoError(t, err)
		assert.False(t, found, "a key is served for a freed page")
	}
	got, found, err := p.g.Lookup(uint64(r.Addr + ps))
	require.NoError(t, err)
	if found {
		assert.NoError(t, p.validates(r.Addr+ps, got.LKey), "page 1, never freed, is served a key the device refuses")
	}
	ce, err := p.g.Create(uint64(r.Addr + ps))
	require.NoError(t, err)
	assert.NoError(t, p.validates(r.Addr+ps, ce.LKey), "Create of page 1 returns a key the device refuses")
	r2 := p.alloc(t, 1)
	for i := 0; i < 3; i++ {
		_, _ = p.g.Collect()
		ce, err = p.g.Create(uint64(r2.Addr))
		require.NoError(t, err)
		assert.NoError(t, p.validates(r2.Addr, ce.LKey), "Create of memory allocated again returns a key the device refuses")
	}
}

// twoPageMR allocates two pages and registers them as one MR.
func twoPageMR(t *testing.T, p *primary) (hugetlb.Region, Entry, mr) {
	t.Helper()
	r := p.alloc(t, 2)
	e, err := p.g.Create(uint64(r.Addr))
	require.NoError(t, err)
	require.Equal(t, uint64(r.Addr)+2*p.pageSize(), e.End, "one MR over both pages")
	m, err := p.g.mrAt(atomic.LoadUint64(&p.g.root.MRList))
	require.NoError(t, err)
	require.NoError(t, p.validates(r.Addr, e.LKey))
	return r, e, m
}

// Another process rewrites the List word of a live MR's record to -1,
// which marks external memory, during a free of one of its pages.
func TestAFreeOverARecordRewrittenAsExternalKeepsKeysRight(t *testing.T) {
	p := newPrimary(t, fixtureConfig{pages: 8})
	defer collectOnFree(p)()
	r, e, m := twoPageMR(t, p)
	list := atomic.LoadInt32(&m.rec.List)
	atomic.StoreInt32(&m.rec.List, -1) // the other process's write
	err := p.mem.Free(hugetlb.Region{Addr: r.Addr, Len: p.pageSize()})
	t.Logf("free with the record's List rewritten: %v", err)
	atomic.StoreInt32(&m.rec.List, list) // put back
	afterAFreeOfPage0(t, p, r, e.LKey, err)
}

// Another process rewrites the global table's header (Gen and Size)
// during a free.
func TestAFreeUnderARewrittenTableHeaderKeepsKeysRight(t *testing.T) {
	p := newPrimary(t, fixtureConfig{pages: 8})
	defer collectOnFree(p)()
	r, e, _ := twoPageMR(t, p)
	h := &p.g.root.Table
	gen, size := atomic.LoadUint32(&h.Gen), atomic.LoadUint32(&h.Size)
	atomic.StoreUint32(&h.Gen, gen+1) // the other process's writes
	atomic.StoreUint32(&h.Size, 1)
	err := p.mem.Free(hugetlb.Region{Addr: r.Addr, Len: p.pageSize()})
	t.Logf("free with the table header rewritten: %v", err)
	atomic.StoreUint32(&h.Size, size) // put back
	atomic.StoreUint32(&h.Gen, gen)
	afterAFreeOfPage0(t, p, r, e.LKey, err)
}

// Another process zeroes the record's BitmapLen in the middle of a free
// (here: while the device trims), and puts it back after.
func TestAWordRewrittenDuringAFreeKeepsKeysRight(t *testing.T) {
	p := newPrimary(t, fixtureConfig{pages: 8})
	defer collectOnFree(p)()
	r, e, m := twoPageMR(t, p)
	bl := atomic.LoadUint32(&m.rec.BitmapLen)
	hp := &hookPD{PD: p.g.pd, hook: func() { atomic.StoreUint32(&m.rec.BitmapLen, 0) }}
	p.g.pd = hp
	err := p.mem.Free(hugetlb.Region{Addr: r.Addr, Len: p.pageSize()})
	p.g.pd = hp.PD
	t.Logf("free with BitmapLen zeroed during it: %v", err)
	atomic.StoreUint32(&m.rec.BitmapLen, bl) // put back
	afterAFreeOfPage0(t, p, r, e.LKey, err)
}

// Another process writes a root counter, MRCount, to 0 while the list
// holds an MR. A free that moves the MR must not size anything by the
// counter (decremented, it reads 4294967295): the primary would die of
// an allocation of about 100 GB.
func TestARewrittenMRCountDoesNotTakeThePrimaryDown(t *testing.T) {
	p := newPrimary(t, fixtureConfig{pages: 8, single: true})
	r := p.alloc(t, 1)
	_, err := p.g.Create(uint64(r.Addr))
	require.NoError(t, err)
	atomic.StoreUint32(&p.g.root.MRCount, 0) // the other process's write
	require.NoError(t, p.mem.Free(r))
	r2 := p.alloc(t, 1)
	e, err := p.g.Create(uint64(r2.Addr))
	require.NoError(t, err)
	assert.NoError(t, p.validates(r2.Addr, e.LKey))
}

// collectOnFree has every free of p's memory collect the MRs it dropped
// before the pages go, as the primary's guard does; call what it returns
// to stop.
func collectOnFree(p *primary) func() {
	return p.mem.GuardFree(func(ev hugetlb.Event) error { return p.g.CollectFor(uint64(ev.Addr), ev.Len) })
}
