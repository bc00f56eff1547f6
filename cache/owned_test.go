package cache

import (
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
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
