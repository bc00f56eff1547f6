package secondary_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/secondary"
)

// Pool and requests racing Close: each answers, or fails with ErrClosed
// (not ErrPrimaryGone: the primary lives), and none reads the segment
// after Close has unmapped it.
func TestPoolAndRequestsRacingClose(t *testing.T) {
	_, cfg := startLeakPrimary(t, testenv.Tmpfs(t), 0, 0)
	for range 40 {
		s, err := secondary.Attach(cfg)
		require.NoError(t, err)
		pool, err := s.Pool("pkts")
		require.NoError(t, err)
		addr := uint64(pool.Chunks()[0].Addr)
		var wg, working sync.WaitGroup
		errs := make(chan error, 4)
		for g := range 4 {
			working.Add(1)
			wg.Go(func() {
				for i := 0; ; i++ {
					var err error
					if g%2 == 0 {
						_, err = s.Pool("pkts")
					} else {
						_, err = s.CreateMR(addr)
					}
					if i == 0 {
						working.Done()
					}
					if err != nil {
						errs <- err
						return
					}
				}
			})
		}
		working.Wait()
		require.NoError(t, s.Close())
		wg.Wait()
		close(errs)
		for err := range errs {
			require.ErrorIs(t, err, secondary.ErrClosed)
		}
		_, err = s.Pool("pkts")
		require.ErrorIs(t, err, secondary.ErrClosed, "Pool after Close")
	}
}

// An attachment whose primary has gone keeps its data memory mapped until
// it is closed, and no Attach waits for it, even if its claim's fence
// word says fenced afterwards (the primary fenced it as it died, or any
// process mapping the segment wrote the word): one to a new primary goes
// ahead at once, and fails, if it does, on the addresses still taken.
func TestAttachDoesNotWaitForAnAttachmentWhosePrimaryHasGone(t *testing.T) {
	p, cfg := startLeakPrimary(t, testenv.Tmpfs(t), 0, 0)
	a, err := secondary.Attach(cfg)
	require.NoError(t, err)
	defer a.Close()
	p.End(0)
	select {
	case <-a.PrimaryGone():
	case <-time.After(10 * time.Second):
		t.Fatal("the primary's end went unnoticed")
	}
	w := a.Segment().FenceWatch()
	word := *(**uint32)(unsafe.Pointer(&w)) // the claim's fence word, as another process could write it
	atomic.StoreUint32(word, a.Segment().Epoch())
	require.True(t, a.Segment().FenceWatch().Fenced())

	_, cfg2 := startLeakPrimary(t, testenv.Tmpfs(t), 0, 0)
	cfg2.AttachTimeout = 2 * time.Second
	b, err := secondary.Attach(cfg2)
	if err == nil {
		b.Close()
	}
	assert.NotErrorIs(t, err, context.DeadlineExceeded, "Attach waited for an attachment whose primary has gone")
}
