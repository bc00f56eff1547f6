package ipc

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/internal/sys/sock"
)

// A send blocked on a full socket ends when its context is cancelled, even
// a context without deadline, and leaves the connection intact: a datagram
// goes whole or not at all. White-box, because only here can the test fill
// the socket and know it is full.
func TestCancelledSendLeavesTheConnectionIntact(t *testing.T) {
	a, b := pair(t)
	var e endpoint
	e.init(&Conn{c: a}, slog.New(slog.DiscardHandler), time.Minute)
	defer e.fail(ErrClosed)

	pad := make([]byte, 60<<10)
	big, err := AppendFrame(nil, 1, KindReply, 0, pad)
	require.NoError(t, err)
	queued := 0
	for ; ; queued++ {
		require.Less(t, queued, 1000, "the socket never filled up")
		err := e.conn.send(big, nil, time.Now().Add(5*time.Millisecond))
		if errors.Is(err, os.ErrDeadlineExceeded) {
			break
		}
		require.NoError(t, err)
	}

	ctx, cancel := context.WithCancel(context.Background()) // no deadline
	timer := time.AfterFunc(20*time.Millisecond, cancel)
	defer timer.Stop()
	start := time.Now()
	err = e.write(ctx, 2, KindReply, pad)
	assert.ErrorIs(t, err, context.Canceled)
	assert.Less(t, time.Since(start), 10*time.Second, "ended by the cancellation, not by the write timeout")
	require.NoError(t, e.Err(), "the connection is intact")

	// The receiver finds only whole frames: the ones queued before.
	buf := make([]byte, MaxMessage)
	require.NoError(t, b.SetReadDeadline(time.Now().Add(10*time.Second)))
	for range queued {
		n, _, err := b.Recv(buf)
		require.NoError(t, err)
		_, err = ParseFrame(buf[:n])
		require.NoError(t, err)
	}
	require.NoError(t, e.write(context.Background(), 3, KindReply, nil), "writing works again")
	n, _, err := b.Recv(buf)
	require.NoError(t, err)
	f, err := ParseFrame(buf[:n])
	require.NoError(t, err)
	assert.Equal(t, uint64(3), f.ID)
}

// The reason a connection ends reaches a peer whose queue has room even
// when the goroutine telling it comes to send only after its wait for
// room is over: a server held up by load or a debugger between deciding
// and sending must not close the connection without saying why.
func TestAReasonIsToldWhenThereIsRoomWhateverTheWait(t *testing.T) {
	a, b := pair(t)
	require.NoError(t, tell(&Conn{c: a}, ErrLimit, time.Now().Add(-time.Second)))

	require.NoError(t, b.SetReadDeadline(time.Now().Add(10*time.Second)))
	buf := make([]byte, MaxMessage)
	n, _, err := b.Recv(buf)
	require.NoError(t, err)
	f, err := ParseFrame(buf[:n])
	require.NoError(t, err)
	require.Equal(t, KindError, f.Kind)
	var r ErrorReply
	require.NoError(t, Unmarshal(f.Body, &r))
	assert.Equal(t, "ipc.limit", r.Code)
}

// A call that finds the lane closed after its time ran out (its process
// was stopped past its deadline, say) while the connection has already
// ended says why the connection ended, not that its time ran out: the
// server closes both at once and tells the reason on the connection.
func TestALaneEndedPastItsBoundTakesTheConnectionsReason(t *testing.T) {
	a, _ := pair(t)
	var c Client
	c.init(&Conn{c: a}, slog.New(slog.DiscardHandler), time.Minute)
	c.fail(ErrLimit)
	for range 100 { // both ready: not a coin's toss
		require.True(t, c.laneEnded(io.EOF, nil, time.Now().Add(-time.Millisecond)),
			"the call gave up as at its deadline though the connection had ended")
	}
}

// pair returns two connected sockets, closed when the test ends.
func pair(t *testing.T) (a, b *sock.Conn) {
	t.Helper()
	a, b, err := sock.Pair()
	require.NoError(t, err)
	t.Cleanup(func() { a.Close(); b.Close() })
	return a, b
}
