package ipc_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/mpmr/mpmr/internal/sys/sock"
	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/ipc"
)

// withInline has the server answer create requests on the reader of each
// admitted peer's call lane.
func withInline(c *ipc.ServerConfig) { c.Inline = []ipc.Kind{ipc.KindCreateMR} }

// laneClient dials s and makes the first call, which brings the call
// lane: the hello with sayHello set, else a stats request.
func laneClient(t *testing.T, s *testServer, sayHello bool, cfg ipc.ClientConfig) *ipc.Client {
	t.Helper()
	c := dial(t, s.path, cfg)
	require.False(t, ipc.HasLane(c), "no lane before the first answer")
	if sayHello {
		hello(t, c)
	} else {
		require.NoError(t, c.Call(ctxBound(t), ipc.KindStats, &ipc.StatsRequest{}, &ipc.StatsReply{}))
	}
	require.True(t, ipc.HasLane(c), "the lane came before the first answer")
	return c
}

// A stranger gets no lane and no descriptor, and is answered on its
// connection; the hello's answer is preceded by exactly one frame, the
// lane, with exactly one descriptor: a seqpacket socket the server made.
// Requests on the lane are answered on the lane.
func TestLaneComesWithAdmission(t *testing.T) {
	s := startServer(t, newHandler(), withHello)
	c, err := sock.Dial(ctxBound(t), s.path)
	require.NoError(t, err)
	defer c.Close()
	buf := make([]byte, ipc.MaxMessage)
	send := func(id uint64, kind ipc.Kind, body any) {
		b, err := ipc.AppendFrame(nil, id, kind, 0, body)
		require.NoError(t, err)
		require.NoError(t, c.Send(b, nil))
	}
	recv := func() (ipc.Frame, []*os.File) {
		require.NoError(t, c.SetReadDeadline(time.Now().Add(bound)))
		n, files, err := c.Recv(buf)
		require.NoError(t, err)
		f, err := ipc.ParseFrame(buf[:n])
		require.NoError(t, err)
		return f, files
	}

	send(1, ipc.KindStats, &ipc.StatsRequest{})
	f, files := recv()
	assert.Empty(t, files, "no descriptor for a stranger")
	assert.Equal(t, uint64(1), f.ID)
	assert.Equal(t, ipc.KindReply, f.Kind)

	send(2, ipc.KindHello, &ipc.Hello{ABI: ipc.ABI, PID: os.Getpid(), UID: os.Getuid(), Role: "secondary"})
	f, files = recv()
	require.Equal(t, ipc.KindChannel, f.Kind, "the lane comes first")
	assert.Equal(t, uint64(0), f.ID)
	require.Len(t, files, 1)
	lane, err := sock.NewBlocking(files[0], false)
	require.NoError(t, err, "a seqpacket socket")
	defer lane.Close()
	cred, err := lane.PeerCred()
	require.NoError(t, err)
	assert.Equal(t, os.Getpid(), cred.PID, "made by the server's process")
	f, files = recv()
	assert.Empty(t, files)
	assert.Equal(t, uint64(2), f.ID)
	assert.Equal(t, ipc.KindReply, f.Kind, "then the hello's answer")

	b, err := ipc.AppendFrame(nil, 3, ipc.KindCreateMR, 0, &ipc.CreateMR{Addr: 0x7000})
	require.NoError(t, err)
	require.NoError(t, lane.Send(b, nil, time.Now().Add(bound)))
	n, files, err := lane.Recv(buf, time.Now().Add(bound))
	require.NoError(t, err)
	assert.Empty(t, files)
	f, err = ipc.ParseFrame(buf[:n])
	require.NoError(t, err)
	assert.Equal(t, uint64(3), f.ID)
	var r ipc.CreateMRReply
	require.NoError(t, ipc.Unmarshal(f.Body, &r))
	assert.Equal(t, uint32(7), r.LKey, "answered on the lane")
}

// An inline request's handler runs on the lane's reader, so the peer's
// next inline request waits for it; pushes and their acknowledgements
// travel on the connection, so a handler may push to its own peer and
// wait for the acknowledgement (as a memory sync does while a create
// waits for the memory lock).
func TestInlineRequestsRunOnTheLaneOneAtATime(t *testing.T) {
	var running, peak, handled atomic.Int32
	release := make(chan struct{})
	inRelease := make(chan struct{}, 1)
	h := newHandler()
	h.handle = func(ctx context.Context, p *ipc.Peer, kind ipc.Kind, body *ipc.Decoder) (any, error, bool) {
		var m ipc.CreateMR
		if kind != ipc.KindCreateMR || body.Decode(&m) != nil {
			return nil, nil, false
		}
		if m.Addr == 0xac4 { // a create that needs the peer to acknowledge a push
			if err := p.Push(ctx, ipc.KindSync, &ipc.Sync{Op: ipc.SyncMap, Count: 1}, &ipc.SyncAck{}); err != nil {
				return nil, err, true
			}
		}
		n := running.Add(1)
		for {
			m := peak.Load()
			if n <= m || peak.CompareAndSwap(m, n) {
				break
			}
		}
		if m.Addr == 0x1e1 {
			inRelease <- struct{}{}
			<-release
		}
		runtime.Gosched()
		running.Add(-1)
		handled.Add(1)
		return nil, nil, false
	}
	push := ipc.PushHandlerFunc(func(ctx context.Context, kind ipc.Kind, body *ipc.Decoder) (any, error) {
		return &ipc.SyncAck{}, body.Decode(&ipc.Sync{})
	})
	s := startServer(t, h, withHello, withInline)
	c := laneClient(t, s, true, ipc.ClientConfig{PushHandler: push})

	var r ipc.CreateMRReply
	require.NoError(t, c.Call(ctxBound(t), ipc.KindCreateMR, &ipc.CreateMR{Addr: 0xac4}, &r),
		"an inline handler pushes to its peer and gets the acknowledgement")

	held := make(chan error, 1)
	go func() { held <- c.Call(ctxBound(t), ipc.KindCreateMR, &ipc.CreateMR{Addr: 0x1e1}, nil) }()
	waitFor(t, inRelease, "the held request in its handler")
	var wg sync.WaitGroup
	errs := make(chan error, 16)
	for i := range 16 {
		wg.Go(func() { errs <- c.Call(ctxBound(t), ipc.KindCreateMR, &ipc.CreateMR{Addr: uint64(i+1) << 12}, nil) })
	}
	assert.EqualValues(t, 1, handled.Load(), "no create behind the held one was handled")
	close(release)
	require.NoError(t, waitFor(t, held, "the held call"))
	wg.Wait()
	close(errs)
	for err := range errs {
		assert.NoError(t, err)
	}
	assert.EqualValues(t, 18, handled.Load())
	assert.EqualValues(t, 1, peak.Load(), "inline requests of one peer never overlap")
	assert.NoError(t, c.Err())
}

// Calls on the lane from many goroutines, with contexts that end early at
// random (cancelled, or past their deadline) while the server answers in
// any order: every call that is not ended gets its own answer, every
// ended one its context's error, and the connection carries on. Whoever
// receives the frames hands the lane over as its call ends.
func TestLaneCallsWithEndingContexts(t *testing.T) {
	for _, inline := range []bool{false, true} {
		t.Run(fmt.Sprintf("inline=%t", inline), func(t *testing.T) {
			h := newHandler()
			h.handle = func(ctx context.Context, p *ipc.Peer, kind ipc.Kind, body *ipc.Decoder) (any, error, bool) {
				var m ipc.CreateMR
				if kind == ipc.KindCreateMR && body.Decode(&m) == nil && m.Addr&1 == 1 && !inline {
					time.Sleep(time.Duration(m.Addr>>12%200) * time.Microsecond) // answers out of order
				}
				return nil, nil, false
			}
			opts := []serverOpt{}
			if inline {
				opts = append(opts, withInline)
			}
			s := startServer(t, h, opts...)
			c := laneClient(t, s, false, ipc.ClientConfig{})
			goroutines := runtime.NumGoroutine()

			var wg sync.WaitGroup
			var answered, ended atomic.Int64
			for g := range 8 {
				wg.Go(func() {
					rng := rand.New(rand.NewPCG(uint64(g), 7))
					for i := range 300 {
						addr := uint64(g*1000+i+1)<<12 | uint64(i&1)
						ctx, cancel := context.WithCancel(context.Background())
						switch rng.IntN(6) {
						case 0:
							cancel() // ended before the call
						case 1:
							time.AfterFunc(time.Duration(rng.IntN(100))*time.Microsecond, cancel)
						case 2:
							ctx, cancel = context.WithTimeout(context.Background(), time.Duration(rng.IntN(100))*time.Microsecond)
						default:
							ctx, cancel = context.WithTimeout(context.Background(), bound)
						}
						var r ipc.CreateMRReply
						err := c.Call(ctx, ipc.KindCreateMR, &ipc.CreateMR{Addr: addr}, &r)
						cancel()
						switch {
						case err == nil:
							answered.Add(1)
							assert.Equal(t, uint32(addr>>12), r.LKey, "call for 0x%x got another's answer", addr)
						case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
							ended.Add(1)
							assert.Equal(t, ipc.CreateMRReply{}, r, "an ended call's reply stays untouched")
						default:
							t.Errorf("call for 0x%x: %v", addr, err)
						}
					}
				})
			}
			wg.Wait()
			t.Logf("%d answered, %d ended by their context", answered.Load(), ended.Load())
			assert.NotZero(t, answered.Load())
			require.NoError(t, c.Err())
			var r ipc.CreateMRReply
			require.NoError(t, c.Call(ctxBound(t), ipc.KindCreateMR, &ipc.CreateMR{Addr: 0x5000}, &r), "the lane still works")
			assert.Equal(t, uint32(5), r.LKey)
			assert.True(t, eventually(func() bool { return runtime.NumGoroutine() <= goroutines }),
				"goroutines: %d before, %d after", goroutines, runtime.NumGoroutine())
		})
	}
}

// A call that waits on the lane with a context that has no deadline ends
// when the context is cancelled, and calls waiting beside it get their
// answers, before and after.
func TestCancelledLaneCallHandsTheLaneOver(t *testing.T) {
	release := make(chan struct{})
	h := newHandler()
	h.handle = func(ctx context.Context, p *ipc.Peer, kind ipc.Kind, body *ipc.Decoder) (any, error, bool) {
		var m ipc.CreateMR
		if kind == ipc.KindCreateMR && body.Decode(&m) == nil && m.Addr == 0x2000 {
			select {
			case <-release:
			case <-ctx.Done():
			}
		}
		return nil, nil, false
	}
	s := startServer(t, h)
	c := laneClient(t, s, false, ipc.ClientConfig{})
	defer close(release)

	ctx, cancel := context.WithCancel(context.Background())
	first := make(chan error, 1)
	go func() { first <- c.Call(ctx, ipc.KindCreateMR, &ipc.CreateMR{Addr: blockAddr}, nil) }()
	second := make(chan error, 1)
	var r ipc.CreateMRReply
	go func() { second <- c.Call(context.Background(), ipc.KindCreateMR, &ipc.CreateMR{Addr: 0x2000}, &r) }()
	third := make(chan error, 1)
	var r3 ipc.CreateMRReply
	go func() {
		time.Sleep(time.Millisecond) // most likely behind the others; any order is right
		third <- c.Call(context.Background(), ipc.KindCreateMR, &ipc.CreateMR{Addr: 0x3000}, &r3)
	}()
	require.NoError(t, waitFor(t, third, "a call while others wait"))
	assert.Equal(t, uint32(3), r3.LKey)
	cancel()
	assert.ErrorIs(t, waitFor(t, first, "the cancelled call"), context.Canceled)
	release <- struct{}{}
	require.NoError(t, waitFor(t, second, "the call behind it"))
	assert.Equal(t, uint32(2), r.LKey)
	assert.NoError(t, c.Err())
}

// A server that hands over something that is not a lane breaks the
// protocol: the client drops it.
func TestBadLaneIsAProtocolViolation(t *testing.T) {
	pair := func(t *testing.T) *os.File {
		fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
		require.NoError(t, err)
		t.Cleanup(func() { unix.Close(fds[1]) })
		f := os.NewFile(uintptr(fds[0]), "lane")
		t.Cleanup(func() { f.Close() })
		return f
	}
	for _, tc := range []struct {
		name  string
		id    uint64
		files func(t *testing.T) []*os.File
		twice bool
	}{
		{"no descriptor", 0, func(*testing.T) []*os.File { return nil }, false},
		{"two descriptors", 0, func(t *testing.T) []*os.File { return []*os.File{pair(t), pair(t)} }, false},
		{"a pipe", 0, func(t *testing.T) []*os.File { _, w := pipe(t); return []*os.File{w} }, false},
		{"a request id", 9, func(t *testing.T) []*os.File { return []*os.File{pair(t)} }, false},
		{"a second lane", 0, func(t *testing.T) []*os.File { return []*os.File{pair(t)} }, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, srv := rawServer(t, ipc.ClientConfig{})
			for range 1 + btoi(tc.twice) {
				files := tc.files(t)
				b, err := ipc.AppendFrame(nil, tc.id, ipc.KindChannel, len(files), &ipc.Channel{})
				require.NoError(t, err)
				require.NoError(t, srv.Send(b, files))
			}
			waitFor(t, c.Done(), "the client's end")
			assert.ErrorIs(t, c.Err(), ipc.ErrMalformed)
		})
	}
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}

// CallTimeout ends a call at its timeout, whether it reads the lane
// itself or waits while another call does, and before the lane exists;
// the connection carries on and the late answers are dropped.
func TestCallTimeout(t *testing.T) {
	release := make(chan struct{})
	h := newHandler()
	h.handle = func(ctx context.Context, p *ipc.Peer, kind ipc.Kind, body *ipc.Decoder) (any, error, bool) {
		var m ipc.CreateMR
		if kind == ipc.KindCreateMR && body.Decode(&m) == nil && m.Addr >= 0x10_0000 {
			select { // held until released
			case <-release:
			case <-ctx.Done():
			}
		}
		return nil, nil, false
	}
	s := startServer(t, h)
	defer close(release)

	c := dial(t, s.path, ipc.ClientConfig{})
	var r ipc.CreateMRReply
	require.NoError(t, c.CallTimeout(bound, ipc.KindCreateMR, &ipc.CreateMR{Addr: 0x4000}, &r), "before the lane")
	assert.Equal(t, uint32(4), r.LKey)
	require.True(t, ipc.HasLane(c))
	assert.ErrorIs(t, c.CallTimeout(bound, ipc.KindSync, &ipc.Sync{}, nil), ipc.ErrUnknownKind)

	// A call that reads the lane, and one that waits behind it, both
	// held by the server: each ends at its own timeout.
	held := make(chan error, 1)
	go func() {
		held <- c.CallTimeout(300*time.Millisecond, ipc.KindCreateMR, &ipc.CreateMR{Addr: 0x10_0000}, nil)
	}()
	behind := make(chan error, 1)
	go func() {
		behind <- c.CallTimeout(20*time.Millisecond, ipc.KindCreateMR, &ipc.CreateMR{Addr: 0x20_0000}, nil)
	}()
	assert.ErrorIs(t, waitFor(t, behind, "the shorter call"), context.DeadlineExceeded)
	assert.ErrorIs(t, waitFor(t, held, "the longer call"), context.DeadlineExceeded)
	// Both told the server they gave up: their handlers' contexts ended,
	// and their late answers are dropped.

	require.NoError(t, c.CallTimeout(bound, ipc.KindCreateMR, &ipc.CreateMR{Addr: 0x6000}, &r), "the connection carries on")
	assert.Equal(t, uint32(6), r.LKey)
	assert.NoError(t, c.Err())

	fresh := dial(t, s.path, ipc.ClientConfig{})
	assert.ErrorIs(t, fresh.CallTimeout(10*time.Millisecond, ipc.KindCreateMR, &ipc.CreateMR{Addr: 0x30_0000}, nil),
		context.DeadlineExceeded, "before the lane too")
	release <- struct{}{}
}

// rawLane dials s, says hello on a bare connection and returns it with
// the call lane the server hands over, both closed with the test.
func rawLane(t *testing.T, s *testServer) (*sock.Conn, *sock.Blocking) {
	t.Helper()
	c, f := rawHello(t, s)
	lane, err := sock.NewBlocking(f, false)
	require.NoError(t, err)
	t.Cleanup(func() { lane.Close() })
	return c, lane
}

// rawHello dials s, says hello on a bare connection and returns it,
// closed with the test, with the lane's socket the server hands over
// (the caller's to close) once the hello's answer has come.
func rawHello(t *testing.T, s *testServer) (*sock.Conn, *os.File) {
	t.Helper()
	return rawHelloAt(t, s.path)
}

// rawHelloAt is rawHello to the server listening at path.
func rawHelloAt(t *testing.T, path string) (*sock.Conn, *os.File) {
	t.Helper()
	c, err := sock.Dial(ctxBound(t), path)
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() })
	b, err := ipc.AppendFrame(nil, 1, ipc.KindHello, 0, &ipc.Hello{ABI: ipc.ABI, PID: os.Getpid(), UID: os.Getuid(), Role: "secondary"})
	require.NoError(t, err)
	require.NoError(t, c.Send(b, nil))
	buf := make([]byte, ipc.MaxMessage)
	require.NoError(t, c.SetReadDeadline(time.Now().Add(bound)))
	n, files, err := c.Recv(buf)
	require.NoError(t, err)
	f, err := ipc.ParseFrame(buf[:n])
	require.NoError(t, err)
	require.Equal(t, ipc.KindChannel, f.Kind, "the lane comes before the hello's answer")
	require.Len(t, files, 1)
	n, _, err = c.Recv(buf)
	if err != nil {
		files[0].Close()
	}
	require.NoError(t, err)
	f, err = ipc.ParseFrame(buf[:n])
	require.NoError(t, err)
	require.Equal(t, ipc.KindReply, f.Kind, "the hello's answer")
	return c, files[0]
}

// A call on the lane to a server in another process allocates nothing in
// the caller: the call and its channels are kept for the next one.
func TestLaneCallAllocatesNothing(t *testing.T) {
	if raceEnabled {
		t.Skip("under the race detector sync.Pool drops what it keeps at random")
	}
	path := filepath.Join(t.TempDir(), ipc.SocketName)
	srv := testproc.Start(t, "serve", []string{path})
	srv.Expect("ready", 0)
	c := dial(t, path, ipc.ClientConfig{})
	ctx := context.Background()
	req := &ipc.CreateMR{Addr: 0x4000}
	var r ipc.CreateMRReply
	require.NoError(t, c.Call(ctx, ipc.KindCreateMR, req, &r))
	require.True(t, ipc.HasLane(c), "the lane came with the first answer")
	allocs := testing.AllocsPerRun(1000, func() {
		if err := c.Call(ctx, ipc.KindCreateMR, req, &r); err != nil {
			t.Fatal(err)
		}
	})
	// A collection may empty the pool once in a while: well below one a call.
	assert.Less(t, allocs, 0.5, "allocations per call")
	assert.Equal(t, uint32(4), r.LKey)
}
