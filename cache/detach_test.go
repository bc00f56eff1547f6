package cache

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A process closes (Detach, then the segment closed under a live queue)
// while the primary frees memory: a free that lands inside Detach, caught
// up by the queue selectively, must not leave the queue's other entries
// answering after Close. Once the primary frees their memory too, Hit
// must report false and Lookup fail, as after any Close.
func TestAFreeDuringDetachLeavesNoKeyAfterClose(t *testing.T) {
	p := newPrimary(t, fixtureConfig{pages: 16, single: true, pageSize: 1 << 16})
	view := p.attachView(t)
	keep := p.alloc(t, 1) // freed after the close
	gone := p.alloc(t, 1) // freed inside Detach
	l := NewLocal(view, &forwarder{g: p.g}, 0)
	key, err := l.Lookup(keep.Addr)
	require.NoError(t, err)
	_, err = l.Lookup(gone.Addr)
	require.NoError(t, err)

	detachStep = func() {
		require.NoError(t, p.mem.Free(gone))
		_, _ = l.Lookup(keep.Addr) // catches up, as any live queue may
	}
	t.Cleanup(func() { detachStep = func() {} })
	view.Detach()
	vacated, err := view.seg.CloseUnderReaders()
	require.NoError(t, err)
	require.True(t, vacated, "a queue is live")
	view.Vacated()
	t.Cleanup(view.seg.Unreserve)

	require.NoError(t, p.mem.Free(keep))
	require.Error(t, p.validates(keep.Addr, key), "the device refuses the freed memory's key")
	k, hit := l.Hit(keep.Addr)
	assert.False(t, hit, "Hit answers key %#x for freed memory after Close", k)
	k, err = l.Lookup(keep.Addr)
	assert.Error(t, err, "Lookup answers key %#x for freed memory after Close", k)
}
