package secondary_test

import (
	"sync/atomic"
	"testing"

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
	_, err = s.Pool("pkts")
	assert.NoError(t, err)
}
