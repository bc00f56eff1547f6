package ipc_test

import (
	"context"
	"os"
	"runtime"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/ipc"
)

// openFDs counts this process's open descriptors.
func openFDs(t *testing.T) int {
	es, err := os.ReadDir("/proc/self/fd")
	require.NoError(t, err)
	return len(es)
}

// Each end watches the other's process for its exit (a pidfd in the
// network poller, on a goroutine): clients that dial, call and close, or
// close without a call, leave no watcher and no pidfd behind, at either
// end.
func TestProcessWatchesEndWithTheirConnections(t *testing.T) {
	srv := startServer(t, quietHandler{newHandler()})
	goroutines, fds := runtime.NumGoroutine(), openFDs(t)
	for i := range 1500 {
		ctx, cancel := context.WithTimeout(context.Background(), bound)
		c, err := ipc.DialClient(ctx, srv.path, ipc.ClientConfig{Logger: quiet})
		require.NoError(t, err)
		if i%3 != 0 {
			require.NoError(t, c.Call(ctx, ipc.KindStats, &ipc.StatsRequest{}, &ipc.StatsReply{}))
		}
		c.Close()
		cancel()
	}
	require.True(t, eventually(func() bool {
		return runtime.NumGoroutine() <= goroutines+2 && openFDs(t) <= fds+2
	}), "goroutines %d, were %d; descriptors %d, were %d", runtime.NumGoroutine(), goroutines, openFDs(t), fds)
}
