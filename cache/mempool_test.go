package cache

import (
	"sync"
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
