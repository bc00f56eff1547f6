package cache

import (
	"fmt"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/hugetlb"
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
	defer p.mem.GuardFree(func(ev hugetlb.Event) error { return p.g.CollectFor(uint64(ev.Addr), ev.Len) })()

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
	defer p.mem.GuardFree(func(ev hugetlb.Event) error { return p.g.CollectFor(uint64(ev.Addr), ev.Len) })()
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
	listed := atomic.LoadUint64(&p.g.root.MRList) == off
	t.Logf("MR list head %#x (the MR's record: %t); its arena block: %v", atomic.LoadUint64(&p.g.root.MRList), listed, blkErr)
	assert.False(t, listed && blkErr != nil, "the MR list names a record the owner freed")

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
