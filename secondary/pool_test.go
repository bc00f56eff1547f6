package secondary_test

import (
	"sync/atomic"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/cache"
	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/secondary"
	"github.com/mpmr/mpmr/shm"
)

// A pool's descriptor is in the segment, which every process of the user
// can write: Pool hands out no pool whose objects are not data memory
// this process maps.
func TestPoolRefusesAPoolOutsideDataMemory(t *testing.T) {
	_, cfg := startLeakPrimary(t, testenv.Tmpfs(t), 0, 0)
	s, err := secondary.Attach(cfg)
	require.NoError(t, err)
	defer s.Close()
	_, err = s.Pool("pkts")
	require.NoError(t, err)

	// The directory: 64 descriptor offsets; a descriptor's Base is at
	// byte 32.
	seg := s.Segment()
	dir := shm.Slice[uint64](seg, seg.Root(shm.RootPools), 64)
	desc := atomic.LoadUint64(&dir[0])
	require.NotZero(t, desc)
	base := &shm.Slice[uint64](seg, desc+32, 1)[0]
	real := atomic.LoadUint64(base)
	for _, forged := range []uint64{0x10000, real + 1<<40} {
		atomic.StoreUint64(base, forged)
		_, err := s.Pool("pkts")
		if assert.ErrorIs(t, err, cache.ErrCorrupt, "base 0x%x", forged) {
			assert.Contains(t, err.Error(), "pkts")
		}
	}
	atomic.StoreUint64(base, real)

	// Descriptors that look whole: objects one 64-byte step past the
	// memory allocated so far, a huge count or object size, a range that
	// wraps, the segment's own memory. (Count and ObjSize are at bytes 52
	// and 48.)
	pool, err := s.Pool("pkts")
	require.NoError(t, err)
	c := pool.Chunks()[0]
	count := &shm.Slice[uint32](seg, desc+52, 1)[0]
	size := &shm.Slice[uint32](seg, desc+48, 1)[0]
	n, sz := atomic.LoadUint32(count), atomic.LoadUint32(size)
	var allocatedEnd uint64
	for _, l := range s.Memory().Lists() {
		if c.Addr >= l.Base && c.Addr < l.End {
			allocatedEnd = uint64(l.Base) + uint64(l.Allocated)*l.PageSize
		}
	}
	require.NotZero(t, allocatedEnd)
	for _, f := range []struct {
		name        string
		base        uint64
		count, size uint32
	}{
		{"one step past the memory allocated", allocatedEnd - uint64(n)*uint64(sz) + 64, n, sz},
		{"huge count", real, 1 << 30, 64},
		{"huge objects", real, 1, 1<<32 - 64},
		{"wraps", ^uint64(0) - 63, 2, 64},
		{"the segment", uint64(uintptr(unsafe.Pointer(&dir[0]))), 1, 64},
	} {
		atomic.StoreUint64(base, f.base)
		atomic.StoreUint32(count, f.count)
		atomic.StoreUint32(size, f.size)
		_, err := s.Pool("pkts")
		assert.ErrorIs(t, err, cache.ErrCorrupt, f.name)
	}
	atomic.StoreUint64(base, real)
	atomic.StoreUint32(count, n)
	atomic.StoreUint32(size, sz)
	_, err = s.Pool("pkts")
	assert.NoError(t, err)
}
