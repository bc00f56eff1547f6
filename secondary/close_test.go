package secondary_test

import (
	"sync"
	"testing"

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
