package ipc_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/internal/sys/sock"
	"github.com/mpmr/mpmr/ipc"
)

func TestRoundTrips(t *testing.T) {
	s := startServer(t, newHandler())
	c := dial(t, s.path, ipc.ClientConfig{})
	ctx := ctxBound(t)

	p := waitFor(t, s.h.connected, "Connected")
	assert.Equal(t, os.Getpid(), p.PID())
	assert.Equal(t, os.Geteuid(), p.UID())
	assert.Equal(t, os.Getegid(), p.GID())
	assert.NotZero(t, p.ID())
	assert.Equal(t, []*ipc.Peer{p}, s.Peers())
	cred, err := c.ServerCred()
	require.NoError(t, err)
	assert.Equal(t, os.Getpid(), cred.PID, "the client can check who serves it")

	t.Run("hello", func(t *testing.T) {
		var r ipc.HelloReply
		require.NoError(t, c.Call(ctx, ipc.KindHello, &ipc.Hello{ABI: ipc.ABI, PID: 15, Role: "secondary"}, &r))
		assert.Equal(t, ipc.HelloReply{Slot: 1, Segment: "/dev/shm/seg", LockFile: "/dev/shm/seg.lock",
			LayoutTag: 9, Backend: "tmpfs", PageSize: 4096, PrimaryPID: os.Getpid()}, r)
	})
	t.Run("create MR", func(t *testing.T) {
		var r ipc.CreateMRReply
		require.NoError(t, c.Call(ctx, ipc.KindCreateMR, &ipc.CreateMR{Addr: 0x7f00_1234}, &r))
		assert.Equal(t, ipc.CreateMRReply{Start: 0x7f00_1000, End: 0x7f00_2000, LKey: 0x7f001}, r)
	})
	t.Run("register mempool", func(t *testing.T) {
		var r ipc.RegisterMempoolReply
		req := &ipc.RegisterMempool{Name: "mbufs", Chunks: []ipc.Chunk{{Addr: 0x1000, Len: 64}, {Addr: 0x5000, Len: 64}}}
		require.NoError(t, c.Call(ctx, ipc.KindRegisterMempool, req, &r))
		assert.Equal(t, []uint32{1, 5}, r.Keys)
	})
	t.Run("stats", func(t *testing.T) {
		var r ipc.StatsReply
		require.NoError(t, c.Call(ctx, ipc.KindStats, &ipc.StatsRequest{}, &r))
		assert.Equal(t, map[string]uint64{"creates": 3}, r.Counters)
	})
	t.Run("detach, ignoring the reply", func(t *testing.T) {
		require.NoError(t, c.Call(ctx, ipc.KindDetach, &ipc.Detach{}, nil))
	})
}

func TestRemoteErrors(t *testing.T) {
	h := newHandler()
	h.handle = func(ctx context.Context, p *ipc.Peer, kind ipc.Kind, body *ipc.Decoder) (any, error, bool) {
		if kind != ipc.KindStats {
			return nil, nil, false
		}
		var m ipc.StatsRequest
		if err := body.Decode(&m); err != nil {
			return nil, err, true
		}
		return nil, errors.New("stats are off today"), true
	}
	s := startServer(t, h)
	c := dial(t, s.path, ipc.ClientConfig{})
	ctx := ctxBound(t)

	err := c.Call(ctx, ipc.KindCreateMR, &ipc.CreateMR{Addr: 0}, &ipc.CreateMRReply{})
	assert.ErrorIs(t, err, errNotMapped, "a registered sentinel matches across the connection")
	var re *ipc.RemoteError
	require.ErrorAs(t, err, &re)
	assert.Equal(t, "test.not-mapped", re.Code)
	assert.Equal(t, "create MR for 0x0: test: address not in any memory", re.Message)

	err = c.Call(ctx, ipc.KindStats, &ipc.StatsRequest{}, &ipc.StatsReply{})
	require.ErrorAs(t, err, &re, "an unregistered error is a RemoteError")
	assert.Empty(t, re.Code)
	assert.NoError(t, errors.Unwrap(err))
	assert.Equal(t, "stats are off today", err.Error())

	require.NoError(t, c.Call(ctx, ipc.KindDetach, &ipc.Detach{}, nil), "an error reply harms nothing")
}

func TestCallRejectsKindsOfTheWrongDirection(t *testing.T) {
	s := startServer(t, newHandler())
	c := dial(t, s.path, ipc.ClientConfig{})
	p := waitFor(t, s.h.connected, "Connected")
	assert.ErrorIs(t, c.Call(ctxBound(t), ipc.KindSync, &ipc.Sync{}, nil), ipc.ErrUnknownKind)
	assert.ErrorIs(t, c.Call(ctxBound(t), ipc.KindReply, nil, nil), ipc.ErrUnknownKind)
	assert.ErrorIs(t, p.Push(ctxBound(t), ipc.KindCreateMR, &ipc.CreateMR{}, nil), ipc.ErrUnknownKind)
}

// 64 calls from 8 goroutines are all in the handler at once (a barrier
// holds them until the last arrives), so the answers go back in whatever
// order the handlers finish, and each must still reach its own caller.
func TestManyConcurrentCallsAreMatched(t *testing.T) {
	const goroutines, perGoroutine = 8, 8
	const total = goroutines * perGoroutine
	var arrived atomic.Int32
	all := make(chan struct{})
	h := newHandler()
	h.handle = func(ctx context.Context, p *ipc.Peer, kind ipc.Kind, body *ipc.Decoder) (any, error, bool) {
		if arrived.Add(1) == total {
			close(all)
		}
		select {
		case <-all:
		case <-ctx.Done():
			return nil, ctx.Err(), true
		}
		return nil, nil, false
	}
	s := startServer(t, h)
	c := dial(t, s.path, ipc.ClientConfig{})
	ctx := ctxBound(t)

	var wg sync.WaitGroup
	errs := make(chan error, total)
	for g := range goroutines {
		wg.Go(func() {
			for i := range perGoroutine {
				wg.Go(func() {
					addr := uint64(g*perGoroutine+i+1) << 12
					var r ipc.CreateMRReply
					if err := c.Call(ctx, ipc.KindCreateMR, &ipc.CreateMR{Addr: addr}, &r); err != nil {
						errs <- err
						return
					}
					if r.Start != addr || r.LKey != uint32(addr>>12) {
						errs <- fmt.Errorf("call for 0x%x got the answer %+v", addr, r)
					}
				})
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		assert.NoError(t, err)
	}
	assert.Equal(t, int32(total), arrived.Load())
}

func TestInflightIsBoundedPerConnection(t *testing.T) {
	const limit, calls = 4, 40
	var now, peak atomic.Int32
	h := newHandler()
	h.handle = func(ctx context.Context, p *ipc.Peer, kind ipc.Kind, body *ipc.Decoder) (any, error, bool) {
		n := now.Add(1)
		for {
			m := peak.Load()
			if n <= m || peak.CompareAndSwap(m, n) {
				break
			}
		}
		time.Sleep(time.Millisecond) // a handler with some length, so calls overlap
		now.Add(-1)
		return nil, nil, false
	}
	s := startServer(t, h, func(c *ipc.ServerConfig) { c.MaxInflightPerConn = limit })
	c := dial(t, s.path, ipc.ClientConfig{})
	ctx := ctxBound(t)
	var wg sync.WaitGroup
	for i := range calls {
		wg.Go(func() {
			assert.NoError(t, c.Call(ctx, ipc.KindCreateMR, &ipc.CreateMR{Addr: uint64(i+1) << 12}, nil))
		})
	}
	wg.Wait()
	assert.LessOrEqual(t, peak.Load(), int32(limit))
	assert.Positive(t, peak.Load())
}

func TestLateReplyIsDroppedSafely(t *testing.T) {
	release := make(chan struct{})
	h := newHandler()
	h.handle = func(ctx context.Context, p *ipc.Peer, kind ipc.Kind, body *ipc.Decoder) (any, error, bool) {
		var m ipc.CreateMR
		if kind == ipc.KindCreateMR && body.Decode(&m) == nil && m.Addr == 0x5000 {
			<-release
			return &ipc.CreateMRReply{Start: 0x5000, End: 0x6000, LKey: 5}, nil, true
		}
		return nil, nil, false
	}
	s := startServer(t, h)
	c := dial(t, s.path, ipc.ClientConfig{})

	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	var r ipc.CreateMRReply
	err := c.Call(ctx, ipc.KindCreateMR, &ipc.CreateMR{Addr: 0x5000}, &r)
	assert.ErrorIs(t, err, context.DeadlineExceeded)
	close(release)

	// The late answer arrives now; it must neither land in r nor in the
	// next call's reply.
	var r2 ipc.CreateMRReply
	require.NoError(t, c.Call(ctxBound(t), ipc.KindCreateMR, &ipc.CreateMR{Addr: 0x9000}, &r2))
	assert.Equal(t, uint32(9), r2.LKey)
	assert.Equal(t, ipc.CreateMRReply{}, r, "a timed-out call's reply stays untouched")
	assert.Nil(t, c.Err())
}

func TestCloseFailsPendingAndLaterCalls(t *testing.T) {
	s := startServer(t, newHandler())
	c := dial(t, s.path, ipc.ClientConfig{})
	done := make(chan error, 1)
	go func() { done <- c.Call(ctxBound(t), ipc.KindCreateMR, &ipc.CreateMR{Addr: blockAddr}, nil) }()
	// The request is in the handler once the server has it in flight;
	// Close must fail it whether or not it got there.
	require.NoError(t, c.Close())
	assert.ErrorIs(t, waitFor(t, done, "the pending call"), ipc.ErrClosed)
	assert.ErrorIs(t, c.Call(ctxBound(t), ipc.KindDetach, &ipc.Detach{}, nil), ipc.ErrClosed)
	assert.ErrorIs(t, c.Err(), ipc.ErrClosed)
	d := waitFor(t, s.h.disconnected, "Disconnected")
	assert.ErrorIs(t, d.err, ipc.ErrPeerGone)
}

func TestServerCloseEndsEveryClient(t *testing.T) {
	h := newHandler()
	inHandler := make(chan context.Context, 1)
	h.handle = func(ctx context.Context, p *ipc.Peer, kind ipc.Kind, body *ipc.Decoder) (any, error, bool) {
		inHandler <- ctx
		<-ctx.Done()
		return nil, ctx.Err(), true
	}
	s := startServer(t, h)
	c := dial(t, s.path, ipc.ClientConfig{})
	done := make(chan error, 1)
	go func() { done <- c.Call(ctxBound(t), ipc.KindDetach, &ipc.Detach{}, nil) }()
	hctx := waitFor(t, inHandler, "the handler")

	require.NoError(t, s.Close())
	assert.Error(t, hctx.Err(), "Close cancels running handlers and waits for them")
	assert.ErrorIs(t, waitFor(t, done, "the pending call"), ipc.ErrPeerGone)
	waitFor(t, c.Done(), "the client's end")
	assert.ErrorIs(t, c.Call(ctxBound(t), ipc.KindDetach, &ipc.Detach{}, nil), ipc.ErrPeerGone)
	d := waitFor(t, s.h.disconnected, "Disconnected")
	assert.ErrorIs(t, d.err, ipc.ErrClosed)
	_, err := os.Lstat(s.path)
	assert.ErrorIs(t, err, os.ErrNotExist, "the server removed its socket")
}

func TestPeerCloseEndsTheClient(t *testing.T) {
	s := startServer(t, newHandler())
	c := dial(t, s.path, ipc.ClientConfig{})
	p := waitFor(t, s.h.connected, "Connected")
	require.NoError(t, p.Close())
	waitFor(t, c.Done(), "the client's end")
	assert.ErrorIs(t, c.Err(), ipc.ErrPeerGone)
	waitFor(t, p.Context().Done(), "the peer's context")
	assert.ErrorIs(t, p.Err(), ipc.ErrClosed)
}

func TestTooLargeReplyBecomesAnError(t *testing.T) {
	h := newHandler()
	h.handle = func(ctx context.Context, p *ipc.Peer, kind ipc.Kind, body *ipc.Decoder) (any, error, bool) {
		if kind != ipc.KindStats {
			return nil, nil, false
		}
		r := &ipc.StatsReply{Counters: map[string]uint64{}}
		for i := range ipc.MaxItems {
			r.Counters[fmt.Sprintf("counter-with-a-long-name-%06d", i)] = uint64(i)
		}
		return r, nil, true
	}
	s := startServer(t, h)
	c := dial(t, s.path, ipc.ClientConfig{})
	err := c.Call(ctxBound(t), ipc.KindStats, &ipc.StatsRequest{}, &ipc.StatsReply{})
	assert.ErrorIs(t, err, ipc.ErrTooLarge)
	assert.NoError(t, c.Call(ctxBound(t), ipc.KindDetach, &ipc.Detach{}, nil), "the connection is intact")

	big := &ipc.RegisterMempool{Name: "big", Chunks: make([]ipc.Chunk, ipc.MaxChunks)}
	for i := range big.Chunks {
		big.Chunks[i] = ipc.Chunk{Addr: 1 << 62, Len: 1 << 61}
	}
	assert.ErrorIs(t, c.Call(ctxBound(t), ipc.KindRegisterMempool, big, nil), ipc.ErrTooLarge, "the sender refuses to send it")
	assert.NoError(t, c.Err())
}

// rawServer accepts one connection on a bare socket, so a test can play a
// server that writes frames at will.
func rawServer(t *testing.T, cfg ipc.ClientConfig) (*ipc.Client, *sock.Conn) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "raw.sock")
	l, err := sock.Listen(path, false)
	require.NoError(t, err)
	defer l.Close()
	accepted := make(chan *sock.Conn, 1)
	go func() {
		c, err := l.Accept()
		if err == nil {
			accepted <- c
		}
	}()
	c := dial(t, path, cfg)
	srv := waitFor(t, accepted, "the connection")
	t.Cleanup(func() { srv.Close() })
	return c, srv
}

func readFrame(t *testing.T, c *sock.Conn, buf []byte) ipc.Frame {
	t.Helper()
	require.NoError(t, c.SetReadDeadline(time.Now().Add(bound)))
	n, files, err := c.Recv(buf)
	require.NoError(t, err)
	require.Empty(t, files)
	f, err := ipc.ParseFrame(buf[:n])
	require.NoError(t, err)
	return f
}

// The server may send pushes back to back without waiting: the client
// handles them one at a time, in order, and acknowledges each by its id.
func TestPushesAreHandledInOrderAndAcked(t *testing.T) {
	const n = 200
	var mu sync.Mutex // the ack travels through the kernel, which the race detector cannot see
	var order []int
	var running atomic.Int32
	var overlapped atomic.Bool
	push := ipc.PushHandlerFunc(func(ctx context.Context, kind ipc.Kind, body *ipc.Decoder) (any, error) {
		if running.Add(1) != 1 {
			overlapped.Store(true)
		}
		defer running.Add(-1)
		var m ipc.Sync
		if err := body.Decode(&m); err != nil {
			return nil, err
		}
		mu.Lock()
		order = append(order, m.First)
		mu.Unlock()
		if m.First%10 == 9 {
			return nil, fmt.Errorf("page %d: %w", m.First, errNotMapped)
		}
		return &ipc.SyncAck{}, nil
	})
	c, srv := rawServer(t, ipc.ClientConfig{PushHandler: push})

	for i := range n {
		b, err := ipc.AppendFrame(nil, uint64(1000+i), ipc.KindSync, 0, &ipc.Sync{Op: ipc.SyncMap, First: i, Count: 1})
		require.NoError(t, err)
		require.NoError(t, srv.Send(b, nil))
	}
	buf := make([]byte, ipc.MaxMessage)
	for i := range n {
		f := readFrame(t, srv, buf)
		require.Equal(t, uint64(1000+i), f.ID, "acks come in push order")
		if i%10 == 9 {
			require.Equal(t, ipc.KindError, f.Kind)
			var e ipc.ErrorReply
			require.NoError(t, ipc.Unmarshal(f.Body, &e))
			assert.Equal(t, "test.not-mapped", e.Code)
		} else {
			require.Equal(t, ipc.KindReply, f.Kind)
			require.NoError(t, ipc.Unmarshal(f.Body, &ipc.SyncAck{}))
		}
	}
	assert.False(t, overlapped.Load(), "pushes were handled one at a time")
	want := make([]int, n)
	for i := range want {
		want[i] = i
	}
	mu.Lock()
	assert.Equal(t, want, order)
	mu.Unlock()
	assert.NoError(t, c.Err())
}

func TestPushFromManyGoroutines(t *testing.T) {
	var running atomic.Int32
	var overlapped atomic.Bool
	push := ipc.PushHandlerFunc(func(ctx context.Context, kind ipc.Kind, body *ipc.Decoder) (any, error) {
		if running.Add(1) != 1 {
			overlapped.Store(true)
		}
		defer running.Add(-1)
		var m ipc.Sync
		if err := body.Decode(&m); err != nil {
			return nil, err
		}
		if m.First%2 == 1 {
			return nil, fmt.Errorf("odd page %d", m.First)
		}
		return &ipc.SyncAck{}, nil
	})
	s := startServer(t, newHandler())
	dial(t, s.path, ipc.ClientConfig{PushHandler: push})
	p := waitFor(t, s.h.connected, "Connected")
	ctx := ctxBound(t)
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Go(func() {
			for i := range 25 {
				page := g*25 + i
				err := p.Push(ctx, ipc.KindSync, &ipc.Sync{Op: ipc.SyncUnmap, First: page, Count: 1}, &ipc.SyncAck{})
				if page%2 == 1 {
					assert.EqualError(t, err, fmt.Sprintf("odd page %d", page), "each push gets its own ack")
				} else {
					assert.NoError(t, err)
				}
			}
		})
	}
	wg.Wait()
	assert.False(t, overlapped.Load())
}

func TestPushWithoutHandlerIsAnsweredWithAnError(t *testing.T) {
	s := startServer(t, newHandler())
	dial(t, s.path, ipc.ClientConfig{})
	p := waitFor(t, s.h.connected, "Connected")
	err := p.Push(ctxBound(t), ipc.KindSync, &ipc.Sync{Op: ipc.SyncResync}, nil)
	assert.ErrorIs(t, err, ipc.ErrNoHandler)
	assert.NoError(t, p.Err())
}

func TestPushTimesOutWithItsContext(t *testing.T) {
	push := ipc.PushHandlerFunc(func(ctx context.Context, kind ipc.Kind, body *ipc.Decoder) (any, error) {
		<-ctx.Done() // a stuck secondary
		return nil, ctx.Err()
	})
	s := startServer(t, newHandler())
	dial(t, s.path, ipc.ClientConfig{PushHandler: push})
	p := waitFor(t, s.h.connected, "Connected")
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	err := p.Push(ctx, ipc.KindSync, &ipc.Sync{Op: ipc.SyncResync}, nil)
	assert.ErrorIs(t, err, context.DeadlineExceeded)
}

// A client that breaks the protocol loses its connection, with a log line,
// while another client goes on working.
func TestBadClientsAreDroppedAndOthersServed(t *testing.T) {
	rnd := make([]byte, 300)
	for i := range rnd {
		rnd[i] = byte(rand.N(256))
	}
	rnd[0] = 0xc1 // never valid msgpack
	good := frame(t, 7, ipc.KindCreateMR, 0, &ipc.CreateMR{Addr: 0x1000})
	oversized := frame(t, 7, ipc.KindCreateMR, 0, &ipc.RegisterMempool{Name: string(make([]byte, ipc.MaxMessage))})

	cases := []struct {
		name string
		msg  []byte
		want error
	}{
		{"random bytes", rnd, ipc.ErrMalformed},
		{"truncated frame", good[:len(good)-2], ipc.ErrMalformed},
		{"oversized frame", oversized, ipc.ErrTooLarge},
		{"unknown kind", frame(t, 7, 999, 0, &ipc.CreateMR{Addr: 1}), ipc.ErrUnknownKind},
		{"push kind from a client", frame(t, 7, ipc.KindSync, 0, &ipc.Sync{Op: ipc.SyncResync}), ipc.ErrUnknownKind},
		{"unknown field", frame(t, 7, ipc.KindCreateMR, 0, map[string]any{"addr": 1, "bogus": 2}), ipc.ErrMalformed},
		{"field out of range", frame(t, 7, ipc.KindRegisterMempool, 0, &ipc.RegisterMempool{Name: "p"}), ipc.ErrMalformed},
		{"files promised but missing", frame(t, 7, ipc.KindCreateMR, 1, &ipc.CreateMR{Addr: 1}), ipc.ErrMalformed},
		{"answer with id 0", frame(t, 0, ipc.KindReply, 0, nil), ipc.ErrMalformed},
	}
	s := startServer(t, newHandler())
	goodClient := dial(t, s.path, ipc.ClientConfig{})
	waitFor(t, s.h.connected, "Connected")
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			bad, err := sock.Dial(ctxBound(t), s.path)
			require.NoError(t, err)
			defer bad.Close()
			p := waitFor(t, s.h.connected, "Connected")
			require.NoError(t, bad.Send(tc.msg, nil))

			require.NoError(t, bad.SetReadDeadline(time.Now().Add(bound)))
			_, _, err = bad.Recv(make([]byte, ipc.MaxMessage))
			assert.ErrorIs(t, err, io.EOF, "the server closed the connection without an answer")
			d := waitFor(t, s.h.disconnected, "Disconnected")
			assert.Equal(t, p, d.peer)
			assert.ErrorIs(t, d.err, tc.want)
			assert.ErrorIs(t, d.err, ipc.ErrPeerGone)
			assert.Contains(t, s.log.String(), "broke the protocol")

			var r ipc.CreateMRReply
			require.NoError(t, goodClient.Call(ctxBound(t), ipc.KindCreateMR, &ipc.CreateMR{Addr: 0x3000}, &r))
			assert.Equal(t, uint32(3), r.LKey)
		})
	}
	assert.Len(t, s.Peers(), 1)
}

func TestEmptyDatagramEndsTheConnection(t *testing.T) {
	s := startServer(t, newHandler())
	bad, err := sock.Dial(ctxBound(t), s.path)
	require.NoError(t, err)
	defer bad.Close()
	require.NoError(t, bad.Send(nil, nil))
	d := waitFor(t, s.h.disconnected, "Disconnected")
	assert.ErrorIs(t, d.err, ipc.ErrPeerGone, "a zero-length message reads as end of file")
}

func TestServerThatBreaksTheProtocolIsDropped(t *testing.T) {
	c, srv := rawServer(t, ipc.ClientConfig{})
	done := make(chan error, 1)
	go func() { done <- c.Call(ctxBound(t), ipc.KindDetach, &ipc.Detach{}, nil) }()
	f := readFrame(t, srv, make([]byte, ipc.MaxMessage))
	require.Equal(t, ipc.KindDetach, f.Kind)
	// A request kind from the server is not something a client serves.
	require.NoError(t, srv.Send(frame(t, 1, ipc.KindCreateMR, 0, &ipc.CreateMR{Addr: 1}), nil))
	err := waitFor(t, done, "the pending call")
	assert.ErrorIs(t, err, ipc.ErrPeerGone)
	assert.ErrorIs(t, err, ipc.ErrUnknownKind)
}

func TestMalformedReplyFailsOnlyThatCall(t *testing.T) {
	c, srv := rawServer(t, ipc.ClientConfig{})
	done := make(chan error, 1)
	go func() { done <- c.Call(ctxBound(t), ipc.KindCreateMR, &ipc.CreateMR{Addr: 1}, &ipc.CreateMRReply{}) }()
	f := readFrame(t, srv, make([]byte, ipc.MaxMessage))
	require.NoError(t, srv.Send(frame(t, f.ID, ipc.KindReply, 0, map[string]any{"start": 1, "end": 2, "color": "red"}), nil))
	assert.ErrorIs(t, waitFor(t, done, "the call"), ipc.ErrMalformed)
	assert.NoError(t, c.Err())
}

// bigRequest is a request of almost MaxMessage bytes: a few fill the
// socket's send buffer.
func bigRequest() *ipc.RegisterMempool {
	m := &ipc.RegisterMempool{Name: "big", Chunks: make([]ipc.Chunk, 2600)}
	for i := range m.Chunks {
		m.Chunks[i] = ipc.Chunk{Addr: 1 << 40, Len: 1 << 30}
	}
	return m
}

// A server that takes no message for WriteTimeout is dropped.
func TestServerThatDoesNotReadIsDropped(t *testing.T) {
	c, _ := rawServer(t, ipc.ClientConfig{WriteTimeout: 20 * time.Millisecond})
	const calls = 20
	errs := make(chan error, calls)
	for range calls {
		go func() { errs <- c.Call(context.Background(), ipc.KindRegisterMempool, bigRequest(), nil) }()
	}
	for range calls {
		assert.ErrorIs(t, waitFor(t, errs, "a call's end"), ipc.ErrPeerGone)
	}
	assert.ErrorContains(t, c.Err(), "took no message")
}

// Clients that close, or whose server drops them, leave no goroutine
// behind: the push loop sees the end however it comes.
func TestClosedClientsLeaveNoGoroutines(t *testing.T) {
	s := startServer(t, quietHandler{newHandler()})
	goroutines := runtime.NumGoroutine()
	for i := range 300 {
		c := dial(t, s.path, ipc.ClientConfig{})
		require.NoError(t, c.Call(ctxBound(t), ipc.KindDetach, &ipc.Detach{}, nil))
		if i%2 == 1 {
			for _, p := range s.Peers() {
				p.Close()
			}
			waitFor(t, c.Done(), "the client's end")
		}
		require.NoError(t, c.Close())
	}
	ok := eventually(func() bool { return runtime.NumGoroutine() <= goroutines+4 })
	if !ok {
		buf := make([]byte, 1<<20)
		t.Logf("goroutines:\n%s", buf[:runtime.Stack(buf, true)])
	}
	assert.True(t, ok, "goroutines: %d before, %d after 300 clients", goroutines, runtime.NumGoroutine())
}

// A server that ends a connection says why first, then closes. A call whose
// send finds the connection closed fails with that reason, not a bare
// "peer has gone", even when the reader has not handled the reason yet.
func TestACallThatFindsTheConnectionClosedFailsWithTheServersReason(t *testing.T) {
	c, srv := rawServer(t, ipc.ClientConfig{})
	gate := make(chan struct{})
	var once sync.Once
	held := ipc.HoldNextFrame(gate, false)
	ipc.OnSendToClosedPeer(func() { once.Do(func() { close(gate) }) })
	t.Cleanup(func() { ipc.OnSendToClosedPeer(nil); once.Do(func() { close(gate) }) })

	why := &ipc.ErrorReply{Code: "ipc.limit", Message: "256 connections open, at most 256"}
	require.NoError(t, srv.Send(frame(t, 0, ipc.KindError, 0, why), nil))
	require.NoError(t, srv.Close())
	waitFor(t, held, "the reader taking the reason")

	err := c.Call(ctxBound(t), ipc.KindHello, &ipc.Hello{ABI: ipc.ABI, PID: os.Getpid(), Role: "secondary"}, nil)
	assert.ErrorIs(t, err, ipc.ErrLimit, "%v", err)
	assert.ErrorIs(t, err, ipc.ErrPeerGone)
	assert.ErrorContains(t, err, "at most 256")
}

// A peer that shut only its reading side keeps the connection open: the
// end the reader waits for does not come. A push with a bound of its own
// still returns within it, not at the end of the wait for the reason.
func TestAPushToAPeerThatStoppedReadingKeepsItsBound(t *testing.T) {
	defer ipc.SetPeerClosedGrace(time.Hour)()
	h := newHandler()
	s := startServer(t, h)
	raw, err := net.Dial("unixpacket", s.path)
	require.NoError(t, err)
	defer raw.Close()
	p := waitFor(t, h.connected, "the peer")
	require.NoError(t, raw.(*net.UnixConn).CloseRead())

	done := make(chan error, 1)
	go func() {
		done <- p.PushWithin(context.Background(), 50*time.Millisecond, ipc.KindSync, &ipc.Sync{}, &ipc.SyncAck{})
	}()
	err = waitFor(t, done, "the push, bound to 50 ms, with an hour's grace for the reason")
	assert.ErrorIs(t, err, ipc.ErrPeerGone)
}

// A call with no deadline of its own to a server that shut only its
// reading side: the wait for the server's reason keeps the send's bound,
// the write timeout.
func TestACallToAServerThatStoppedReadingKeepsTheWriteTimeout(t *testing.T) {
	defer ipc.SetPeerClosedGrace(time.Hour)()
	path := filepath.Join(t.TempDir(), "raw.sock")
	l, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: path, Net: "unixpacket"})
	require.NoError(t, err)
	defer l.Close()
	accepted := make(chan *net.UnixConn, 1)
	go func() {
		if srv, err := l.AcceptUnix(); err == nil {
			accepted <- srv
		}
	}()
	c := dial(t, path, ipc.ClientConfig{WriteTimeout: 50 * time.Millisecond})
	srv := waitFor(t, accepted, "the connection")
	defer srv.Close()
	require.NoError(t, srv.CloseRead())
	done := make(chan error, 1)
	go func() { done <- c.Call(context.Background(), ipc.KindStats, &ipc.StatsRequest{}, nil) }()
	err = waitFor(t, done, "the call, its send bound by a 50 ms write timeout, with an hour's grace for the reason")
	assert.ErrorIs(t, err, ipc.ErrPeerGone)
}
