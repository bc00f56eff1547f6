package cache

import (
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/shm"
)

// poolDescOf returns the descriptor published under name, as any process
// mapping the segment can reach it.
func poolDescOf(t *testing.T, seg *shm.Segment, name string) *poolDesc {
	t.Helper()
	dir, err := openDir(seg, false)
	require.NoError(t, err)
	for i := range dir.Pools {
		if off := atomic.LoadUint64(&dir.Pools[i]); off != 0 {
			if d := shm.At[poolDesc](seg, off); poolName(d) == name {
				return d
			}
		}
	}
	t.Fatalf("no mempool %s", name)
	return nil
}

// CreatePool hands its caller the pool it made, whatever the directory
// says by the time it returns: the directory is shared with every
// process of the user, and the pool's memory takes a while to allocate
// (every secondary must map it). Here a descriptor in an earlier place is
// renamed to the new pool's name, and pointed at an address mapped
// nowhere, while the memory is being allocated.
func TestCreatePoolReturnsThePoolItMade(t *testing.T) {
	p := newPrimary(t, fixtureConfig{pages: 8})
	_, err := CreatePool(p.seg, p.mem, "decoy", 64, 16)
	require.NoError(t, err)
	decoy := poolDescOf(t, p.seg, "decoy")

	var made hugetlb.Event
	cancel := p.mem.Subscribe(func(e hugetlb.Event) {
		if e.Kind != hugetlb.EventAlloc {
			return
		}
		made = e
		copy(decoy.Name[:], "pkts\x00")
		atomic.StoreUint64(&decoy.Base, 0x10000)
	})
	pool, err := CreatePool(p.seg, p.mem, "pkts", 2048, 16)
	cancel()
	require.NoError(t, err)
	require.NotZero(t, made.Addr)
	c := pool.Chunks()[0]
	assert.Equal(t, made.Addr, c.Addr, "the pool is the memory CreatePool allocated")
	assert.True(t, p.mem.Mapped(c.Addr, c.Len), "the pool's objects are data memory")
	a, err := pool.Get()
	require.NoError(t, err)
	assert.True(t, p.mem.Mapped(a, pool.ObjSize()), "its first object is data memory")
}

// A name is refused before anything is allocated or published if it
// cannot be stored as given: a NUL byte would end it early.
func TestCreatePoolRefusesANameWithNUL(t *testing.T) {
	p := newPrimary(t, fixtureConfig{pages: 8})
	_, err := CreatePool(p.seg, p.mem, "pkts", 64, 16)
	require.NoError(t, err)
	before := p.mem.Lists()[0].Allocated
	_, err = CreatePool(p.seg, p.mem, "pkts\x00x", 4096, 16)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "NUL")
	assert.Equal(t, before, p.mem.Lists()[0].Allocated, "no memory allocated")
	assert.Len(t, Pools(p.seg), 1, "nothing published")
}

// A descriptor that names the new pool already, valid or not, takes the
// name: CreatePool refuses it before allocating anything.
func TestCreatePoolRefusesANameACorruptDescriptorHolds(t *testing.T) {
	p := newPrimary(t, fixtureConfig{pages: 8})
	_, err := CreatePool(p.seg, p.mem, "decoy", 64, 16)
	require.NoError(t, err)
	decoy := poolDescOf(t, p.seg, "decoy")
	copy(decoy.Name[:], "pkts\x00")
	atomic.StoreUint32(&decoy.Count, 0) // corrupt
	before := p.mem.Lists()[0].Allocated
	_, err = CreatePool(p.seg, p.mem, "pkts", 64, 16)
	assert.ErrorIs(t, err, ErrPoolExists)
	assert.Equal(t, before, p.mem.Lists()[0].Allocated, "no memory allocated")
}

// A process that dies (or is stopped) between taking an object and
// counting it leaves the count short; a put of that object meanwhile, by
// a careless peer, must not make the count wrap: in use never exceeds
// the pool.
func TestPoolInUseStaysInRangeAfterAPeerDiedMidGet(t *testing.T) {
	p := newPrimary(t, fixtureConfig{pages: 8})
	pool, err := CreatePool(p.seg, p.mem, "one", 64, 1)
	require.NoError(t, err)
	// What Get of a process killed before it counted leaves: the object
	// off the stack and marked out, the count not raised.
	h := atomic.LoadUint64(&pool.desc.Head)
	require.True(t, atomic.CompareAndSwapUint64(&pool.desc.Head, h, (h>>32+1)<<32))
	atomic.StoreUint32(&pool.next[0], objectOut)

	require.NoError(t, pool.Put(uintptr(pool.base)), "a put of an object that is out is taken")
	assert.Equal(t, 0, pool.InUse())
	require.Len(t, Pools(p.seg), 1)
	assert.Equal(t, 0, Pools(p.seg)[0].InUse)
	// The count is one short for good now, as after any death between
	// the two steps, but stays within the pool.
	a, err := pool.Get()
	require.NoError(t, err)
	assert.GreaterOrEqual(t, pool.InUse(), 0)
	assert.LessOrEqual(t, pool.InUse(), 1)
	require.NoError(t, pool.Put(a))
	assert.Equal(t, 0, pool.InUse())
	assert.Equal(t, 0, Pools(p.seg)[0].InUse)
}
