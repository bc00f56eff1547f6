package ipc_test

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/internal/sys/sock"
	"github.com/mpmr/mpmr/ipc"
)

// Addresses the abandoning handler knows: giveUpAddr waits for its
// context's end, heldAddr for the test's release.
const (
	giveUpAddr = 0x6e0_0000
	heldAddr   = 0x4e1_0000
)

// abandoning is a server whose handler for giveUpAddr says it started,
// then waits for its context to end and says why, and whose handler for
// heldAddr waits for one release; it runs inflight requests of a
// connection at a time, so a request behind waiting ones is not handled
// before one of them ends, and answers stats requests inline.
type abandoning struct {
	*testServer
	started chan uint64
	ended   chan error
	release chan struct{}
}

func abandoningServer(t *testing.T, inflight int) *abandoning {
	a := &abandoning{started: make(chan uint64, 16), ended: make(chan error, 16), release: make(chan struct{})}
	h := newHandler()
	h.handle = func(ctx context.Context, p *ipc.Peer, kind ipc.Kind, body *ipc.Decoder) (any, error, bool) {
		var m ipc.CreateMR
		if kind != ipc.KindCreateMR || body.Decode(&m) != nil {
			return nil, nil, false
		}
		switch m.Addr {
		case giveUpAddr:
			a.started <- m.Addr
			select {
			case <-ctx.Done():
				a.ended <- ctx.Err()
				return nil, ctx.Err(), true
			case <-a.release:
				a.ended <- nil
			}
		case heldAddr:
			a.started <- m.Addr
			<-a.release
		}
		return nil, nil, false
	}
	a.testServer = startServer(t, h, func(c *ipc.ServerConfig) { c.MaxInflightPerConn, c.Inline = inflight, []ipc.Kind{ipc.KindStats} })
	t.Cleanup(func() { close(a.release) }) // before the server's Close, which waits for handlers
	return a
}

// answers checks that a call made now on c is answered.
func answers(t *testing.T, c *ipc.Client, addr uint64) {
	t.Helper()
	var r ipc.CreateMRReply
	require.NoError(t, c.Call(ctxBound(t), ipc.KindCreateMR, &ipc.CreateMR{Addr: addr}, &r))
	require.Equal(t, uint32(addr>>12), r.LKey)
}

// A call that gives up tells the server so: the handler's context ends,
// whether the caller read the lane itself or waited while another call
// did, whether its context was cancelled or its time ran out. The
// connection's slots are all taken by the call that gives up and those
// beside it, so the next call is answered only once it is told.
func TestAbandonedCallEndsItsHandlersContext(t *testing.T) {
	for _, tc := range []struct {
		name     string
		follower bool // another call reads the lane meanwhile
		timeout  bool // CallTimeout's time runs out, rather than a cancel
	}{
		{"alone/cancelled", false, false},
		{"alone/timed-out", false, true},
		{"beside-another/cancelled", true, false},
		{"beside-another/timed-out", true, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			inflight := 1
			if tc.follower {
				inflight = 2
			}
			a := abandoningServer(t, inflight)
			c := laneClient(t, a.testServer, false, ipc.ClientConfig{})
			held := make(chan error, 1)
			if tc.follower {
				// A call that waits on the lane first, reading it: the one
				// that gives up waits beside it.
				go func() { held <- c.Call(ctxBound(t), ipc.KindCreateMR, &ipc.CreateMR{Addr: heldAddr}, nil) }()
				require.Equal(t, uint64(heldAddr), waitFor(t, a.started, "the held call's start"))
			}
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			done := make(chan error, 1)
			go func() {
				req := &ipc.CreateMR{Addr: giveUpAddr}
				if tc.timeout {
					done <- c.CallTimeout(300*time.Millisecond, ipc.KindCreateMR, req, nil)
				} else {
					done <- c.Call(ctx, ipc.KindCreateMR, req, nil)
				}
			}()
			if !tc.timeout {
				require.Equal(t, uint64(giveUpAddr), waitFor(t, a.started, "the handler's start"))
				cancel()
			}
			err := waitFor(t, done, "the call's end")
			if tc.timeout {
				require.ErrorIs(t, err, context.DeadlineExceeded)
			} else {
				require.ErrorIs(t, err, context.Canceled)
			}
			answers(t, c, 0x7000) // waits, and fails, while the handler is not told
			select {
			case err := <-a.ended:
				assert.ErrorIs(t, err, context.Canceled, "the handler's context ends as cancelled")
			default:
				t.Error("the handler did not end before the next call was answered")
			}
			if tc.follower {
				a.release <- struct{}{}
				require.NoError(t, waitFor(t, held, "the held call's answer"))
			}
			require.NoError(t, c.Err())
		})
	}
}

// A call that gives up while its request waits for a free slot has its
// handler start with its context ended.
func TestAbandonedQueuedCallStartsEnded(t *testing.T) {
	a := abandoningServer(t, 1)
	c := laneClient(t, a.testServer, false, ipc.ClientConfig{})
	held := make(chan error, 1)
	go func() { held <- c.Call(ctxBound(t), ipc.KindCreateMR, &ipc.CreateMR{Addr: heldAddr}, nil) }()
	require.Equal(t, uint64(heldAddr), waitFor(t, a.started, "the held call's start"))
	err := c.CallTimeout(100*time.Millisecond, ipc.KindCreateMR, &ipc.CreateMR{Addr: giveUpAddr}, nil)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	// Answered by the lane's reader, which read the cancellation before.
	require.NoError(t, c.Call(ctxBound(t), ipc.KindStats, &ipc.StatsRequest{}, &ipc.StatsReply{}))
	a.release <- struct{}{}
	require.NoError(t, waitFor(t, held, "the held call's answer"))
	require.Equal(t, uint64(giveUpAddr), waitFor(t, a.started, "the given-up call's start"))
	assert.ErrorIs(t, waitFor(t, a.ended, "the given-up call's end"), context.Canceled)
	answers(t, c, 0x7000)
	require.NoError(t, c.Err())
}

// A cancellation names a call of the peer that sends it: one naming
// another peer's call, or none, changes nothing, and the connection goes
// on. One that is not well formed (a body that is not the empty Cancel,
// descriptors), or sent on the connection rather than the lane, breaks
// the protocol.
func TestCancelFramesAreScopedAndChecked(t *testing.T) {
	a := abandoningServer(t, 2)
	c := laneClient(t, a.testServer, false, ipc.ClientConfig{})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- c.Call(ctx, ipc.KindCreateMR, &ipc.CreateMR{Addr: giveUpAddr}, nil) }()
	waitFor(t, a.started, "the handler's start")

	buf := make([]byte, ipc.MaxMessage)
	send := func(lane *sock.Blocking, id uint64, kind ipc.Kind, body any, files []*os.File) {
		t.Helper()
		b, err := ipc.AppendFrame(nil, id, kind, len(files), body)
		require.NoError(t, err)
		require.NoError(t, lane.Send(b, files, time.Now().Add(bound)))
	}
	// The client's ids count from 1 on its connection: its calls so far
	// are low numbers, and each is named here.
	_, stranger := rawLane(t, a.testServer)
	for id := range uint64(16) {
		send(stranger, id, ipc.KindCancel, &ipc.Cancel{}, nil)
	}
	send(stranger, 99, ipc.KindCreateMR, &ipc.CreateMR{Addr: 0x5000}, nil)
	n, _, err := stranger.Recv(buf, time.Now().Add(bound))
	require.NoError(t, err, "the peer that sent cancellations for calls it never made is still served")
	f, err := ipc.ParseFrame(buf[:n])
	require.NoError(t, err)
	assert.Equal(t, ipc.KindReply, f.Kind)
	assert.Equal(t, uint64(99), f.ID)
	select {
	case err := <-a.ended:
		t.Fatalf("another peer's cancellations ended a call's handler: %v", err)
	default:
	}

	for _, tc := range []struct {
		name   string
		body   any
		files  func(t *testing.T) []*os.File
		onConn bool // sent on the connection, where no call is cancelled
	}{
		{"a body with a field", &ipc.CreateMR{Addr: 1}, nil, false},
		{"a descriptor", &ipc.Cancel{}, func(t *testing.T) []*os.File { _, w := pipe(t); return []*os.File{w} }, false},
		{"on the connection", &ipc.Cancel{}, nil, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			conn, lane := rawLane(t, a.testServer)
			var files []*os.File
			if tc.files != nil {
				files = tc.files(t)
			}
			if tc.onConn {
				b, err := ipc.AppendFrame(nil, 1, ipc.KindCancel, 0, tc.body)
				require.NoError(t, err)
				require.NoError(t, conn.Send(b, nil))
			} else {
				send(lane, 1, ipc.KindCancel, tc.body, files)
			}
			require.NoError(t, conn.SetReadDeadline(time.Now().Add(bound)))
			for {
				n, _, err := conn.Recv(buf)
				if err != nil {
					require.NotErrorIs(t, err, os.ErrDeadlineExceeded, "the connection goes on")
					break // the connection ended
				}
				f, err := ipc.ParseFrame(buf[:n])
				require.NoError(t, err)
				require.Equal(t, ipc.KindError, f.Kind, "only the reason for the end comes")
			}
			_, _, err := lane.Recv(buf, time.Now().Add(bound))
			require.Error(t, err, "the lane ends with the connection")
			require.NotErrorIs(t, err, os.ErrDeadlineExceeded, "the lane goes on")
		})
	}

	cancel()
	require.ErrorIs(t, waitFor(t, done, "the call's end"), context.Canceled)
	assert.ErrorIs(t, waitFor(t, a.ended, "the handler's end"), context.Canceled)
}
