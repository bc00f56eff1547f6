package ipc_test

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/internal/sys/sock"
	"github.com/mpmr/mpmr/ipc"
)

// b3secLimitsTripped sums what Server.Stats counts of tripped limits.
func b3secLimitsTripped(st ipc.ServerStats) uint64 {
	return st.RefusedConns + st.RefusedConnsUID + st.HelloTimeouts + st.RefusedFiles + st.RefusedFilesInFlight +
		st.QueueOverflows + st.WriteTimeouts + st.Violations
}

// Limits: "Until then [its hello] it is held to far less than these
// limits ...: frames of at most MaxUnadmittedMessage bytes", and the
// package doc: "Server.Stats counts each limit that tripped, and the
// server logs it (at most once a second per limit)". A stranger's frame
// over MaxUnadmittedMessage closes the connection, but no counter of
// Stats moves, and every such connection logs a warning of its own
// ("closed the connection of a peer that broke the protocol"), not
// rate-limited: a process of the user floods the primary's log at the
// rate it can connect.
func TestBreaker3SecStrangersOversizedFrameIsNeitherCountedNorRateLimited(t *testing.T) {
	s := startServer(t, quietHandler{newHandler()}, withHello)
	const conns = 40
	body := &ipc.RegisterMempool{Name: "x"}
	for i := 0; i < 300; i++ {
		body.Chunks = append(body.Chunks, ipc.Chunk{Addr: 1 << 40, Len: 1 << 20})
	}
	frame, err := ipc.AppendFrame(nil, 1, ipc.KindRegisterMempool, 0, body)
	require.NoError(t, err)
	require.Greater(t, len(frame), ipc.MaxUnadmittedMessage)
	require.LessOrEqual(t, len(frame), ipc.MaxMessage)

	start := time.Now()
	buf := make([]byte, ipc.MaxMessage)
	for i := 0; i < conns; i++ {
		c, err := sock.Dial(ctxBound(t), s.path)
		require.NoError(t, err)
		require.NoError(t, c.Send(frame, nil))
		require.NoError(t, c.SetReadDeadline(time.Now().Add(bound)))
		var rerr error
		for rerr == nil {
			_, _, rerr = c.Recv(buf)
		}
		c.Close()
		require.False(t, errors.Is(rerr, ipc.ErrClosed), "the connection was closed by the server: %v", rerr)
	}
	require.True(t, eventually(func() bool { return s.Stats().Conns == 0 }), "every connection ended")
	elapsed := time.Since(start)

	st := s.Stats()
	assert.NotZero(t, b3secLimitsTripped(st), "%d strangers sent frames over MaxUnadmittedMessage and were closed for it; "+
		"Stats counts nothing: %+v", conns, st)
	lines := strings.Count(s.log.String(), "broke the protocol")
	// At most once a second per limit, and one more for the count of those
	// that went unlogged.
	assert.LessOrEqual(t, lines, int(elapsed/time.Second)+2,
		"%d warnings in %v for %d oversized frames of strangers: the log is not rate-limited", lines, elapsed, conns)
}
