package cache

import (
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/shm"
)

// Another process rewrites the Start and Len of external MR B's record
// (at the head of the list) to cover external range A. UnregisterExternal(A)
// must deregister A's MR, as the primary registered it, and leave B's
// alone: the caller unmaps A once it returns.
func TestUnregisterExternalDeregistersWhatItRegistered(t *testing.T) {
	p := newPrimary(t, fixtureConfig{pages: 8})
	bufA := externalBuffer(t, 1<<20)
	bufB := externalBuffer(t, 1<<20)
	a, b := uint64(sliceAddr(bufA)), uint64(sliceAddr(bufB))
	ea, err := p.g.RegisterExternal(a, 1<<20)
	require.NoError(t, err)
	eb, err := p.g.RegisterExternal(b, 1<<20)
	require.NoError(t, err)
	head := atomic.LoadUint64(&p.g.root.MRList)
	m, err := p.g.mrAt(head)
	require.NoError(t, err)
	require.Equal(t, b, atomic.LoadUint64(&m.rec.Start), "B's record heads the list")
	// The other process's writes.
	atomic.StoreUint64(&m.rec.Start, a)
	atomic.StoreUint64(&m.rec.Len, 1<<20)

	require.NoError(t, p.g.UnregisterExternal(a))
	_, _ = p.g.Collect()
	assert.Error(t, p.validates(uintptr(a+100), ea.LKey),
		"A was unregistered (and its caller may unmap it) but the device still accepts A's key over it")
	assert.NoError(t, p.validates(uintptr(b+100), eb.LKey),
		"B, never unregistered, lost its registration")
}

// Another process writes three words: the table's Overflow flag (lookups
// go to the MR list), a live record's Next to the record itself (a loop)
// and its BitmapLen to as many bits as the segment holds after it. The
// primary's own Create of a page no MR covers, which walks the list under
// its locks, must end at once, not after a walk of a million visits of a
// record of millions of bits (about an hour here).
func TestACreateOverALoopedListEnds(t *testing.T) {
	p := newPrimary(t, fixtureConfig{pages: 8, single: true})
	r1 := p.alloc(t, 1)
	_, err := p.g.Create(uint64(r1.Addr))
	require.NoError(t, err)
	r2 := p.alloc(t, 1)
	m, err := p.g.mrAt(atomic.LoadUint64(&p.g.root.MRList))
	require.NoError(t, err)
	// As many bits as stay inside the segment (mrAt's only bound).
	bits := uint32(1 << 12)
	for p.g.seg.CheckRange(m.off+mrRecordSize, uint64(2*bits)/8) == nil && bits < 1<<26 {
		bits *= 2
	}
	t.Logf("forged BitmapLen %d bits", bits)
	bl, next := atomic.LoadUint32(&m.rec.BitmapLen), atomic.LoadUint64(&m.rec.Next)
	// The other process's writes.
	atomic.StoreUint32(&m.rec.BitmapLen, bits)
	atomic.StoreUint64(&m.rec.Next, m.off)
	atomic.StoreUint32(&p.g.root.Table.Overflow, 1)

	if mf, err := p.g.mrAt(m.off); err == nil {
		t0 := time.Now()
		n := len(mf.chunks())
		d := time.Since(t0)
		t.Logf("one visit of the forged record: %d chunks in %v; a walk of maxMRs visits: ~%v", n, d, d*maxMRs)
	}
	took, err := testenv.Bounded(t, "the primary's Create over a looped list", 20*time.Second, func() error {
		_, err := p.g.Create(uint64(r2.Addr))
		return err
	})
	t.Logf("Create returned after %v: %v", took, err)
	assert.ErrorIs(t, err, ErrCorrupt, "a list longer than what the primary registered is a corrupt one")
	atomic.StoreUint64(&m.rec.Next, next) // put back
	atomic.StoreUint32(&m.rec.BitmapLen, bl)
	_, err = p.g.Create(uint64(r2.Addr))
	assert.NoError(t, err, "and the primary creates again once it is put back")
}

// Another process writes, while the primary frees a page (after the
// free's pre-check walked the list: here, while the device trims), a
// record of its own in the arena (64 bitmap bits, every other one set:
// 32 chunks) whose Next names itself, and links it after the freed MR's
// record. The free's rebuild must not walk that loop a million times,
// gathering every chunk of every visit (gigabytes, for one registered MR).
func TestAFreeOverALoopedListAllocatesLittle(t *testing.T) {
	p := newPrimary(t, fixtureConfig{pages: 8, single: true})
	r := p.alloc(t, 1)
	_, err := p.g.Create(uint64(r.Addr))
	require.NoError(t, err)
	own := atomic.LoadUint64(&p.g.root.MRList)
	// Space the other process writes its record into (any arena words
	// would do; allocated here so no honest structure is overwritten).
	x, err := p.g.seg.Alloc(mrRecordSize+8, 64)
	require.NoError(t, err)
	fake := shm.At[mrRecord](p.g.seg, x)
	atomic.StoreInt32(&fake.List, 0)
	atomic.StoreUint64(&fake.Start, 1<<40)
	atomic.StoreUint64(&fake.Len, 64<<12)
	atomic.StoreUint64(&fake.PageSize, 1<<12)
	atomic.StoreUint32(&fake.BitmapLen, 64)
	atomic.StoreUint32(&fake.LKey, 0x4242)
	atomic.StoreUint64(shm.At[uint64](p.g.seg, x+mrRecordSize), 0x5555555555555555)
	ownRec := shm.At[mrRecord](p.g.seg, own)
	hp := &hookPD{PD: p.g.pd, hook: func() {
		atomic.StoreUint64(&fake.Next, x)
		atomic.StoreUint64(&ownRec.Next, x)
	}}
	p.g.pd = hp
	defer func() { p.g.pd = hp.PD }()

	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	start := time.Now()
	err = p.mem.Free(r)
	took := time.Since(start)
	runtime.ReadMemStats(&after)
	alloc := after.TotalAlloc - before.TotalAlloc
	t.Logf("free: %v after %v; the primary allocated %d MB meanwhile (it registered %d MR)",
		err, took, alloc>>20, p.g.ownedCount())
	atomic.StoreUint64(&p.g.root.MRList, 0) // put back
	assert.Less(t, alloc, uint64(64<<20), "a free's rebuild over one registered MR allocated %d MB from a forged list", alloc>>20)
}
