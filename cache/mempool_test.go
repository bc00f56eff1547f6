package cache

import (
	"errors"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/shm"
)

func TestPoolGetPut(t *testing.T) {
	p := newPrimary(t, fixtureConfig{pages: 8})
	pool, err := CreatePool(p.seg, p.mem, "pkts", 2000, 100)
	require.NoError(t, err)
	assert.Equal(t, uint64(2048), pool.ObjSize(), "rounded up to 64 bytes")
	_, err = CreatePool(p.seg, p.mem, "pkts", 64, 1)
	assert.ErrorIs(t, err, ErrPoolExists)

	// Another process's view of the pool.
	o := p.opts
	o.Role = shm.RoleSecondary
	seg2, err := shm.Attach(o)
	require.NoError(t, err)
	defer seg2.Close()
	other, err := OpenPool(seg2, "pkts")
	require.NoError(t, err)
	_, err = OpenPool(seg2, "nope")
	assert.ErrorIs(t, err, ErrNoPool)

	seen := map[uintptr]bool{}
	var mu sync.Mutex
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			pl := pool
			if g%2 == 1 {
				pl = other
			}
			for range 25 {
				a, err := pl.Get()
				if !assert.NoError(t, err) {
					return
				}
				mu.Lock()
				assert.False(t, seen[a], "object 0x%x handed out twice", a)
				seen[a] = true
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	assert.Len(t, seen, 100)
	assert.Equal(t, 100, pool.InUse())
	_, err = pool.Get()
	assert.ErrorIs(t, err, ErrPoolEmpty)
	for a := range seen {
		require.NoError(t, other.Put(a))
	}
	assert.Zero(t, pool.InUse())
	assert.ErrorIs(t, pool.Put(0x1234), ErrNotInPool)
	a, err := pool.Get()
	require.NoError(t, err)
	assert.ErrorIs(t, pool.Put(a+1), ErrNotInPool, "not an object start")

	infos := Pools(seg2)
	require.Len(t, infos, 1)
	assert.Equal(t, PoolInfo{Name: "pkts", Base: uint64(pool.Chunks()[0].Addr), ObjSize: 2048, Count: 100, InUse: 1}, infos[0])
}

func TestRegisterMempoolFillsCache(t *testing.T) {
	p := newPrimary(t, fixtureConfig{pages: 8})
	pool, err := CreatePool(p.seg, p.mem, "pkts", 4096, 1024)
	require.NoError(t, err)
	l := NewLocal(p.g, p.g, 0)
	require.NoError(t, l.RegisterMempool(pool))
	assert.Equal(t, uint64(1), l.Stats().Created)
	c := pool.Chunks()[0]
	k, err := l.Lookup(c.Addr + uintptr(c.Len) - 1)
	require.NoError(t, err)
	require.NoError(t, p.validates(c.Addr, k))
	assert.Equal(t, uint64(1), l.Stats().Created, "the whole pool is covered")
}

func TestExternalMempool(t *testing.T) {
	p := newPrimary(t, fixtureConfig{pages: 8})
	buf := externalBuffer(t, 256<<10)
	ext, err := NewExternalPool("ext", buf, 2048)
	require.NoError(t, err)

	// A secondary cannot register external memory itself.
	sec := NewLocal(p.g, &forwarder{g: p.g}, 0)
	err = sec.RegisterMempool(ext)
	require.ErrorIs(t, err, ErrExternalMemory)
	assert.Contains(t, err.Error(), "register the mempool in the primary")

	// The primary can; then the secondary finds it.
	prim := NewLocal(p.g, p.g, 0)
	require.NoError(t, prim.RegisterMempool(ext))
	obj, err := ext.Get()
	require.NoError(t, err)
	k, err := prim.Lookup(obj)
	require.NoError(t, err)
	require.NoError(t, p.validates(obj, k))
	require.NoError(t, sec.RegisterMempool(ext), "registered by the primary before use")
	k2, err := sec.Lookup(obj)
	require.NoError(t, err)
	assert.Equal(t, k, k2)
	require.NoError(t, ext.Put(obj))
	assert.ErrorIs(t, ext.Put(obj+1), ErrNotInPool)
}

// A pool refuses every object it did not hand out, in any process, and
// keeps handing out each object once.
func TestPoolMisuse(t *testing.T) {
	p := newPrimary(t, fixtureConfig{pages: 8})
	pool, err := CreatePool(p.seg, p.mem, "pkts", 64, 6)
	require.NoError(t, err)
	otherPool, err := CreatePool(p.seg, p.mem, "other", 64, 2)
	require.NoError(t, err)
	o := p.opts
	o.Role = shm.RoleSecondary
	seg2, err := shm.Attach(o)
	require.NoError(t, err)
	defer seg2.Close()
	view, err := OpenPool(seg2, "pkts") // another process's view
	require.NoError(t, err)

	base := pool.Chunks()[0].Addr
	foreign, err := otherPool.Get()
	require.NoError(t, err)
	a, err := pool.Get()
	require.NoError(t, err)
	never := base + uintptr(5*pool.ObjSize()) // still free: never handed out
	require.NotEqual(t, a, never)
	require.NoError(t, pool.Put(a))

	for _, c := range []struct {
		name string
		pool *Pool
		addr uintptr
		want error
	}{
		{"put twice", pool, a, ErrDoublePut},
		{"put twice through another process", view, a, ErrDoublePut},
		{"put of an object never taken", pool, never, ErrDoublePut},
		{"object of another pool", pool, foreign, ErrNotInPool},
		{"below the pool", pool, base - 64, ErrNotInPool},
		{"past the pool", pool, base + uintptr(6*pool.ObjSize()), ErrNotInPool},
		{"far past the pool", pool, ^uintptr(0) &^ 63, ErrNotInPool},
		{"not an object's start", pool, base + 8, ErrMisaligned},
	} {
		t.Run(c.name, func(t *testing.T) {
			err := c.pool.Put(c.addr)
			assert.ErrorIs(t, err, c.want)
			assert.Contains(t, err.Error(), "pkts", "the error names the pool")
			assert.Zero(t, pool.InUse(), "nothing changed")
		})
	}
	assert.ErrorIs(t, ErrMisaligned, ErrNotInPool, "a misaligned address is not an object of the pool either")

	// Every object comes out exactly once, and then the pool is empty.
	seen := map[uintptr]bool{}
	for range 6 {
		x, err := view.Get()
		require.NoError(t, err)
		assert.False(t, seen[x], "object 0x%x handed out twice", x)
		seen[x] = true
	}
	assert.Equal(t, 6, pool.InUse())
	_, err = pool.Get()
	assert.ErrorIs(t, err, ErrPoolEmpty)
	for x := range seen {
		require.NoError(t, pool.Put(x))
		assert.ErrorIs(t, view.Put(x), ErrDoublePut)
	}
	assert.Zero(t, pool.InUse())
}

// Many goroutines putting the same object back at once: exactly one
// succeeds.
func TestPoolConcurrentDoublePut(t *testing.T) {
	p := newPrimary(t, fixtureConfig{pages: 8})
	pool, err := CreatePool(p.seg, p.mem, "pkts", 64, 4)
	require.NoError(t, err)
	for range 200 {
		a, err := pool.Get()
		require.NoError(t, err)
		var ok atomic.Int32
		var wg sync.WaitGroup
		for range 4 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				if err := pool.Put(a); err == nil {
					ok.Add(1)
				} else {
					assert.ErrorIs(t, err, ErrDoublePut)
				}
			}()
		}
		wg.Wait()
		require.Equal(t, int32(1), ok.Load())
		require.Zero(t, pool.InUse())
	}
}

func TestExternalPoolMisuse(t *testing.T) {
	buf := externalBuffer(t, 4096)
	// 100-byte objects: 40 of them, and a 96-byte tail that is none.
	ext, err := NewExternalPool("ext", buf, 100)
	require.NoError(t, err)
	base := sliceAddr(buf)
	a, err := ext.Get()
	require.NoError(t, err)
	require.NoError(t, ext.Put(a))
	for _, c := range []struct {
		name string
		addr uintptr
		want error
	}{
		{"put twice", a, ErrDoublePut},
		{"put of an object never taken", base, ErrDoublePut},
		{"the tail past the last object", base + 4000, ErrNotInPool},
		{"below the memory", base - 100, ErrNotInPool},
		{"past the memory", base + 4096, ErrNotInPool},
		{"not an object's start", base + 150, ErrMisaligned},
	} {
		t.Run(c.name, func(t *testing.T) {
			err := ext.Put(c.addr)
			assert.ErrorIs(t, err, c.want)
			assert.Contains(t, err.Error(), "ext")
		})
	}
	seen := map[uintptr]bool{}
	for {
		x, err := ext.Get()
		if errors.Is(err, ErrPoolEmpty) {
			break
		}
		require.NoError(t, err)
		require.False(t, seen[x], "object 0x%x handed out twice", x)
		require.LessOrEqual(t, x+100, base+4096, "every object lies inside the memory")
		seen[x] = true
	}
	assert.Len(t, seen, 40)
}

// badChunks is a mempool whose chunks are given.
type badChunks []Chunk

func (b badChunks) Name() string    { return "bad" }
func (b badChunks) Chunks() []Chunk { return b }

func TestRegisterMempoolRefusesBadChunks(t *testing.T) {
	p := newPrimary(t, fixtureConfig{pages: 8})
	r, err := p.mem.Alloc(p.mem.Lists()[0].PageSize)
	require.NoError(t, err)
	good := Chunk{Addr: r.Addr, Len: 4096}
	for _, c := range []struct {
		name   string
		chunks badChunks
	}{
		{"zero length in memory", badChunks{{Addr: r.Addr, Len: 0}}},
		{"zero length outside memory", badChunks{{Addr: 0x1000, Len: 0}}},
		{"end wraps past 2^64", badChunks{{Addr: r.Addr, Len: ^uint64(0)}}},
		{"end exactly at 2^64", badChunks{{Addr: ^uintptr(0) - 4095, Len: 4096}}},
		{"a bad chunk after a good one", badChunks{good, {Addr: r.Addr, Len: 0}}},
	} {
		t.Run(c.name, func(t *testing.T) {
			for _, l := range []*Local{NewLocal(p.g, p.g, 0), NewLocal(p.g, &forwarder{g: p.g}, 0)} {
				err := l.RegisterMempool(c.chunks)
				assert.ErrorIs(t, err, ErrBadChunk)
				assert.Contains(t, err.Error(), "bad", "the error names the mempool")
				assert.Zero(t, p.g.Stats().MRs, "nothing registered")
				assert.Zero(t, l.Stats().Created)
			}
		})
	}
	for _, c := range []Chunk{{Addr: 1, Len: 0}, {Addr: ^uintptr(0), Len: 1}} {
		assert.ErrorIs(t, c.Check(), ErrBadChunk, "%+v", c)
	}
	assert.NoError(t, good.Check())
	assert.NoError(t, Chunk{Addr: ^uintptr(0) - 4096, Len: 4096}.Check(), "ends one byte short of 2^64")
}
