package ipc_test

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/mpmr/mpmr/internal/sys/sock"
	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/ipc"
)

func init() { testproc.Register("push-server", helperPushServer) }

// pushHandler is helperPushServer's handler: procHandler's, and it hands
// over each peer that connects.
type pushHandler struct {
	procHandler
	peers chan *ipc.Peer
}

func (h pushHandler) Connected(p *ipc.Peer) {
	testproc.Say("connected")
	h.peers <- p
}

// helperPushServer serves args[0], with args[1], when given, the time a
// connection has to say hello. It says "connected" for each connection
// it takes. On "push D" it pushes a memory sync to the peer that
// connected first, with a deadline D away, and says how the push ended:
// "> pushed ERR".
func helperPushServer(args []string) int {
	l, err := ipc.Listen(args[0])
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 3
	}
	h := pushHandler{peers: make(chan *ipc.Peer, 16)}
	cfg := ipc.ServerConfig{Listener: l, Handler: h, Logger: quiet}
	if len(args) > 1 {
		cfg.HelloKind = ipc.KindHello
		if cfg.Limits.HelloTimeout, err = time.ParseDuration(args[1]); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 3
		}
	}
	s, err := ipc.NewServer(cfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 3
	}
	go s.Serve(context.Background())
	testproc.Say("ready")
	var peer *ipc.Peer
	testproc.EachCommand(func(c testproc.Line) {
		if c.Name != "push" || len(c.Args) != 1 {
			return
		}
		if peer == nil {
			peer = <-h.peers
		}
		d, err := time.ParseDuration(c.Args[0])
		if err != nil {
			testproc.Say("> pushed %v", err)
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), d)
		defer cancel()
		err = peer.Push(ctx, ipc.KindSync, &ipc.Sync{Op: ipc.SyncUnmap, Count: 1}, &ipc.SyncAck{})
		testproc.Say("> pushed %v", err)
	})
	s.Close()
	return 0
}

// A peer that answers a push in time has met the push's deadline, though
// the pushing process was stopped (SIGSTOP, a debugger, a slow tool) past
// it while the answer waited in its socket: the server's own stall is not
// the peer's doing. (A primary dropped a secondary that had followed its
// memory change in time so.)
func TestAnAnswerInTimeCountsThoughTheServerWasStoppedPastItsDeadline(t *testing.T) {
	const timeout = time.Second // room for a busy machine to stop the server and send in time
	for i := range 3 {
		t.Run(fmt.Sprintf("attempt %d", i+1), func(t *testing.T) {
			path := filepath.Join(t.TempDir(), ipc.SocketName)
			srv := testproc.Start(t, "push-server", []string{path})
			srv.Expect("ready", bound)
			c, lane := rawHelloAt(t, path)
			t.Cleanup(func() { lane.Close() }) // kept open: a closed lane ends the connection

			before := time.Now() // the server's deadline is after timeout from here
			srv.Send("push %v", timeout)
			buf := make([]byte, ipc.MaxMessage)
			require.NoError(t, c.SetReadDeadline(time.Now().Add(bound)))
			n, _, err := c.Recv(buf)
			require.NoError(t, err)
			f, err := ipc.ParseFrame(buf[:n])
			require.NoError(t, err)
			require.Equal(t, ipc.KindSync, f.Kind)

			ack, err := ipc.AppendFrame(nil, f.ID, ipc.KindReply, 0, &ipc.SyncAck{})
			require.NoError(t, err)
			sendWhileStopped(t, srv, c, ack, before.Add(timeout))
			assert.Equal(t, "> pushed <nil>", srv.Expect("> pushed", bound))
		})
	}
}

// A connection whose hello came in time has said hello in time, though the
// server was stopped past its time to say it while the hello waited in
// the socket: a secondary attaching while its primary was stopped.
func TestAHelloInTimeCountsThoughTheServerWasStoppedPastItsTime(t *testing.T) {
	const timeout = time.Second // room for a busy machine to stop the server and send in time
	for i := range 3 {
		t.Run(fmt.Sprintf("attempt %d", i+1), func(t *testing.T) {
			path := filepath.Join(t.TempDir(), ipc.SocketName)
			srv := testproc.Start(t, "push-server", []string{path, timeout.String()})
			srv.Expect("ready", bound)
			before := time.Now() // the time to say hello ends after timeout from here
			c, err := sock.Dial(ctxBound(t), path)
			require.NoError(t, err)
			t.Cleanup(func() { c.Close() })
			srv.Expect("connected", bound)

			b, err := ipc.AppendFrame(nil, 1, ipc.KindHello, 0, &ipc.Hello{ABI: ipc.ABI, PID: os.Getpid(), UID: os.Getuid(), Role: "secondary"})
			require.NoError(t, err)
			sendWhileStopped(t, srv, c, b, before.Add(timeout))
			buf := make([]byte, ipc.MaxMessage)
			require.NoError(t, c.SetReadDeadline(time.Now().Add(bound)))
			var kinds []ipc.Kind
			for len(kinds) < 2 {
				n, files, err := c.Recv(buf)
				require.NoError(t, err, "after %v", kinds)
				for _, f := range files {
					t.Cleanup(func() { f.Close() }) // the lane: a closed one ends the connection
				}
				f, err := ipc.ParseFrame(buf[:n])
				require.NoError(t, err)
				kinds = append(kinds, f.Kind)
				if f.Kind == ipc.KindError {
					var r ipc.ErrorReply
					require.NoError(t, ipc.Unmarshal(f.Body, &r))
					t.Fatalf("the server refused the hello: %+v", r)
				}
			}
			assert.Equal(t, []ipc.Kind{ipc.KindChannel, ipc.KindReply}, kinds, "the lane, then the hello's answer")
		})
	}
}

// sendWhileStopped stops srv, sends it frame on c (queued in its socket
// before due, or the test fails: it means to meet due) and resumes srv
// once due is well past: as long again as due was away.
func sendWhileStopped(t *testing.T, srv *testproc.Proc, c *sock.Conn, frame []byte, due time.Time) {
	t.Helper()
	srv.Stop()
	stopped := time.Now()
	require.NoError(t, c.Send(frame, nil))
	if now := time.Now(); !now.Before(due) {
		t.Fatalf("the test sent its frame %v after its deadline: it means to meet it", now.Sub(due))
	}
	// The server stays stopped past the deadline.
	time.Sleep(time.Until(due.Add(due.Sub(stopped))))
	srv.Continue()
}

func init() { testproc.Register("lane-caller", helperLaneCaller) }

// helperLaneCaller connects to args[0] and says hello. On "call D" it
// asks for an MR on the call lane, with CallTimeout D; on "callctx D"
// with a context of deadline D away; on "call2 D" twice at once, with
// CallTimeout D. It says how each call ended: "> called ERR".
func helperLaneCaller(args []string) int {
	ctx, cancel := context.WithTimeout(context.Background(), bound)
	defer cancel()
	c, err := dialHello(ctx, args[0])
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 3
	}
	defer c.Close()
	testproc.Say("ready")
	testproc.EachCommand(func(l testproc.Line) {
		if len(l.Args) != 1 {
			return
		}
		d, err := time.ParseDuration(l.Args[0])
		if err != nil {
			testproc.Say("> called %v", err)
			return
		}
		req, reply := &ipc.CreateMR{Addr: 0x1234_5000}, &ipc.CreateMRReply{}
		switch l.Name {
		case "call":
			err = c.CallTimeout(d, ipc.KindCreateMR, req, reply)
		case "callctx":
			ctx, cancel := context.WithTimeout(context.Background(), d)
			defer cancel()
			err = c.Call(ctx, ipc.KindCreateMR, req, reply)
		case "call2":
			// One reads the lane, the other waits behind it.
			other := make(chan error)
			go func() {
				other <- c.CallTimeout(d, ipc.KindCreateMR, &ipc.CreateMR{Addr: 0x1234_6000}, &ipc.CreateMRReply{})
			}()
			err = c.CallTimeout(d, ipc.KindCreateMR, req, reply)
			testproc.Say("> called %v", <-other)
		default:
			return
		}
		testproc.Say("> called %v", err)
	})
	return 0
}

// A call whose answer came on the call lane in time is answered, though
// the calling process was stopped past the call's deadline with the
// answer waiting in its socket: a secondary stopped while its miss waited
// for the primary.
func TestALaneAnswerInTimeCountsThoughTheCallerWasStoppedPastItsDeadline(t *testing.T) {
	const timeout = time.Second // room for a busy machine to stop the caller and answer in time
	for _, how := range []string{"call", "callctx", "call2", "call behind notices"} {
		t.Run(how, func(t *testing.T) {
			calls := 1
			if how == "call2" {
				calls = 2
			}
			var caller *testproc.Proc
			lane, raw := laneServerRaw(t, func(path string) { caller = testproc.Start(t, "lane-caller", []string{path}) })
			caller.Expect("ready", bound)
			buf := make([]byte, ipc.MaxMessage)
			var b []byte

			before := time.Now() // the calls' deadline is after timeout from here
			caller.Send("%s %v", strings.Fields(how)[0], timeout)
			var ids []uint64
			var err error
			for range calls {
				n, _, err := lane.RecvBy(buf, time.Now().Add(bound))
				require.NoError(t, err)
				req, err := ipc.ParseFrame(buf[:n])
				require.NoError(t, err)
				require.Equal(t, ipc.KindCreateMR, req.Kind)
				ids = append(ids, req.ID)
			}
			caller.Stop()
			if how == "call behind notices" {
				// Notices of messages with descriptors that never came
				// (a sender that failed after its notice, or one that
				// means harm), more than one receive that does not
				// wait takes.
				for range 20 {
					require.NoError(t, unix.Sendto(raw, []byte{filesNotice}, 0, nil))
				}
			}
			for _, id := range ids {
				b, err = ipc.AppendFrame(nil, id, ipc.KindReply, 0, &ipc.CreateMRReply{Start: 0x1234_5000, End: 0x1234_6000, LKey: 7})
				require.NoError(t, err)
				require.NoError(t, lane.Send(b, nil, time.Time{}))
			}
			if now := time.Now(); !now.Before(before.Add(timeout)) {
				t.Fatalf("the test answered %v after the deadline: it means to meet it", now.Sub(before.Add(timeout)))
			}
			// The caller stays stopped past the deadline.
			time.Sleep(time.Until(before.Add(2 * timeout)))
			caller.Continue()
			for range calls {
				assert.Equal(t, "> called <nil>", caller.Expect("> called", bound))
			}
		})
	}
}

func init() { testproc.Register("follow-server", helperFollowServer) }

// addrBusy is the MR helperFollowServer's handler works on for 300 ms.
const addrBusy = 0xb000

// helperFollowServer serves args[0] with lanes that follow the CPU a
// create names (followHandler). A create of addrBusy works 300 ms (by the
// clock) before its answer, and says "busy" 20 ms into it. On "stats" it
// says "> starved N". Its warnings go to standard error.
func helperFollowServer(args []string) int {
	l, err := ipc.Listen(args[0])
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 3
	}
	h := followHandler()
	follow := h.handle
	h.handle = func(ctx context.Context, p *ipc.Peer, kind ipc.Kind, body *ipc.Decoder) (any, error, bool) {
		var m ipc.CreateMR
		if kind == ipc.KindCreateMR && body.Decode(&m) == nil && m.Addr == addrBusy {
			start := time.Now()
			for said := false; time.Since(start) < 300*time.Millisecond; {
				if !said && time.Since(start) > 20*time.Millisecond {
					testproc.Say("busy")
					said = true
				}
			}
		}
		return follow(ctx, p, kind, body)
	}
	// Its warnings (a lane let go, with the interval it measured) go to
	// standard error.
	logger := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	s, err := ipc.NewServer(ipc.ServerConfig{Listener: l, Handler: quietHandler{h}, Logger: logger,
		HelloKind: ipc.KindHello, Inline: []ipc.Kind{ipc.KindCreateMR}})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 3
	}
	go s.Serve(context.Background())
	testproc.Say("ready")
	testproc.EachCommand(func(testproc.Line) {
		testproc.Say("> starved %d", s.Stats().StarvedLanes)
	})
	s.Close()
	return 0
}

// A server stopped while a lane bound to its peer's CPU works on a request
// does not let the lane go on resuming as though the peer had kept the
// CPU from it (which would count against the peer's process and user):
// the thread did not run because the whole server was stopped. (On a
// busy machine the lane may be kept from its CPU for real, and let go:
// then over a few milliseconds of its own, not over the stop.)
func TestAServerStoppedMidRequestLetsNoLaneGoAsStarved(t *testing.T) {
	cpu := lastCPU(t)
	path := filepath.Join(t.TempDir(), ipc.SocketName)
	srv := testproc.Start(t, "follow-server", []string{path})
	srv.Expect("ready", bound)
	c := dial(t, path, ipc.ClientConfig{})
	require.NoError(t, c.Call(ctxBound(t), ipc.KindHello, &ipc.Hello{ABI: ipc.ABI, PID: os.Getpid(), UID: os.Getuid(), Role: "secondary"}, &ipc.HelloReply{}))
	createOn(t, c, 0x1000, uint32(cpu)+1) // names the CPU
	createOn(t, c, 0x1000, uint32(cpu)+1) // answered there
	done := make(chan error, 1)
	go func() {
		done <- c.Call(ctxBound(t), ipc.KindCreateMR, &ipc.CreateMR{Addr: addrBusy, CPU: uint32(cpu) + 1}, &ipc.CreateMRReply{})
	}()
	srv.Expect("busy", bound) // the server's checker, looking every 5 ms, has seen the request
	srv.Stop()
	time.Sleep(200 * time.Millisecond) // stopped mid-request for longer than a starved lane is given
	srv.Continue()
	require.NoError(t, waitFor(t, done, "the busy create"))
	srv.Send("stats")
	var starved int
	_, err := fmt.Sscanf(srv.Expect("> starved", bound), "> starved %d", &starved)
	require.NoError(t, err)
	// Each let-go is counted before its warning is written, which comes
	// through a pipe of its own: wait for them all.
	said := regexp.MustCompile(`could not run there.* over=(\S+)`)
	var letGo [][]string
	require.Eventually(t, func() bool {
		letGo = said.FindAllStringSubmatch(srv.Stderr(), -1)
		return len(letGo) >= starved
	}, bound, time.Millisecond, "a warning for each of %d let-gos: %s", starved, srv.Stderr())
	for _, m := range letGo {
		over, err := time.ParseDuration(m[1])
		require.NoError(t, err)
		assert.Less(t, over, 100*time.Millisecond, "a let-go judged over the server's own stop")
	}
}

func init() { testproc.Register("flood-server", helperFloodServer) }

// helperFloodServer serves args[0] with WriteTimeout args[1], answering
// creates inline on the call lane. On "flood N" it makes N pushes at once
// to the peer that connected first, each waiting for an answer for as
// long as the test may take. It says "blocked" once a frame to the peer
// waits for room: in the connection's poller ("connection"), or in the
// lane's send ("lane"), as args[2] says.
func helperFloodServer(args []string) int {
	l, err := ipc.Listen(args[0])
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 3
	}
	wt, err := time.ParseDuration(args[1])
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 3
	}
	h := pushHandler{peers: make(chan *ipc.Peer, 16)}
	s, err := ipc.NewServer(ipc.ServerConfig{Listener: l, Handler: h, Logger: quiet, WriteTimeout: wt,
		Inline: []ipc.Kind{ipc.KindCreateMR}})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 3
	}
	go s.Serve(context.Background())
	where := []string{"internal/poll.(*pollDesc).waitWrite"}
	if args[2] == "lane" {
		where = []string{"sock.(*Blocking).sendOne", "sock.(*Blocking).wait"}
	}
	go sayWhenAGoroutineWaitsIn(where)
	testproc.Say("ready")
	testproc.EachCommand(func(c testproc.Line) {
		if c.Name != "flood" {
			return
		}
		peer := <-h.peers
		for range c.Num(0) {
			go func() {
				ctx, cancel := context.WithTimeout(context.Background(), bound)
				defer cancel()
				_ = peer.Push(ctx, ipc.KindSync, &ipc.Sync{Op: ipc.SyncUnmap, Count: 1}, &ipc.SyncAck{})
			}()
		}
	})
	s.Close()
	return 0
}

// sayWhenAGoroutineWaitsIn says "blocked" once the stack of a goroutine of
// this process holds every function named in where.
func sayWhenAGoroutineWaitsIn(where []string) {
	for testenv.GoroutinesIn(where...) == 0 {
		time.Sleep(time.Millisecond) // polling the runtime's answer
	}
	testproc.Say("blocked")
}

// waitUntilGoroutinesIn waits for n goroutines whose stacks hold every
// function named in where.
func waitUntilGoroutinesIn(t *testing.T, n int, where ...string) {
	t.Helper()
	for end := time.Now().Add(bound); testenv.GoroutinesIn(where...) < n; {
		require.True(t, time.Now().Before(end), "no %d goroutines in %v within %v", n, where, bound)
		time.Sleep(time.Millisecond) // polling the runtime's answer
	}
}

// A peer that made room while the server was stopped, its frame waiting
// for room past WriteTimeout, has read: the server, resumed, sends the
// frame and goes on, rather than drop the peer as one that does not read.
// On the connection (pushes) and on the call lane (answers).
func TestAPeerThatReadWhileTheServerWasStoppedIsNoSlowReader(t *testing.T) {
	const wt = 300 * time.Millisecond
	for i := range 6 {
		where := []string{"connection", "lane"}[i%2]
		t.Run(fmt.Sprintf("%s, attempt %d", where, i/2+1), func(t *testing.T) {
			path := filepath.Join(t.TempDir(), ipc.SocketName)
			srv := testproc.Start(t, "flood-server", []string{path, wt.String(), where})
			srv.Expect("ready", bound)
			c, f := rawHelloAt(t, path)
			lane, err := sock.NewBlocking(f, false)
			require.NoError(t, err)
			t.Cleanup(func() { lane.Close() })
			buf := make([]byte, ipc.MaxMessage)
			// next takes the next frame the server sent, where it floods,
			// waiting for it as long as wait says.
			next := func(wait time.Duration) (ipc.Frame, error) {
				var n int
				var err error
				if where == "connection" {
					require.NoError(t, c.SetReadDeadline(time.Now().Add(wait)))
					n, _, err = c.Recv(buf)
				} else {
					n, _, err = lane.RecvBy(buf, time.Now().Add(wait))
				}
				if err != nil {
					return ipc.Frame{}, err
				}
				return ipc.ParseFrame(buf[:n])
			}
			if where == "connection" {
				srv.Send("flood 4000")
				srv.Expect("blocked", bound)
			} else {
				// Requests until the server's lane reader, which answers
				// them, waits for room for an answer.
				req, err := ipc.AppendFrame(nil, 1, ipc.KindCreateMR, 0, &ipc.CreateMR{Addr: 0x1000})
				require.NoError(t, err)
				stop, stopped := make(chan struct{}), make(chan struct{})
				go func() {
					defer close(stopped)
					for {
						select {
						case <-stop:
							return
						default:
						}
						_ = lane.Send(req, nil, time.Now().Add(10*time.Millisecond))
					}
				}()
				srv.Expect("blocked", bound)
				close(stop)
				<-stopped
			}
			srv.Stop()
			stopped := time.Now()
			drained := 0
			for { // the server is stopped: nothing more comes
				if _, err := next(time.Millisecond); err != nil {
					require.ErrorIs(t, err, os.ErrDeadlineExceeded)
					break
				}
				drained++
			}
			require.NotZero(t, drained)
			time.Sleep(time.Until(stopped.Add(3 * wt))) // the server stays stopped past WriteTimeout
			srv.Continue()
			// The frame that waited for room comes: the peer was not
			// dropped (it would read the end, or the reason on the
			// connection).
			got, err := next(bound)
			require.NoError(t, err, "after %d frames drained", drained)
			require.NotEqual(t, ipc.KindError, got.Kind, "the server dropped the peer: %s", got.Body)
		})
	}
}

// laneServer plays a server, at a socket of its own, for the client that
// start connects there (start must not wait for the hello's answer): it
// answers the client's hello as a server does, the call lane first, and
// returns its end of the lane.
func laneServer(t *testing.T, start func(path string)) *sock.Blocking {
	t.Helper()
	lane, _ := laneServerRaw(t, start)
	return lane
}

// laneServerRaw is laneServer, and also returns a descriptor of the
// lane's server end on which the test may write what a Blocking would
// not (a notice with no message behind it).
func laneServerRaw(t *testing.T, start func(path string)) (*sock.Blocking, int) {
	t.Helper()
	path := filepath.Join(t.TempDir(), ipc.SocketName)
	l, err := sock.Listen(path, false)
	require.NoError(t, err)
	defer l.Close()
	accepted := make(chan *sock.Conn, 1)
	go func() {
		if c, err := l.Accept(); err == nil {
			accepted <- c
		}
	}()
	start(path)
	srv := waitFor(t, accepted, "the connection")
	t.Cleanup(func() { srv.Close() })
	hello := readFrame(t, srv, make([]byte, ipc.MaxMessage))
	require.Equal(t, ipc.KindHello, hello.Kind)
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	require.NoError(t, err)
	theirs := os.NewFile(uintptr(fds[1]), "lane")
	raw, err := unix.Dup(fds[0])
	require.NoError(t, err)
	t.Cleanup(func() { unix.Close(raw) })
	lane, err := sock.NewBlocking(os.NewFile(uintptr(fds[0]), "lane"), false)
	require.NoError(t, err)
	t.Cleanup(func() { lane.Close() })
	b, err := ipc.AppendFrame(nil, 0, ipc.KindChannel, 1, &ipc.Channel{})
	require.NoError(t, err)
	require.NoError(t, srv.Send(b, []*os.File{theirs}))
	theirs.Close()
	b, err = ipc.AppendFrame(nil, hello.ID, ipc.KindReply, 0, &ipc.HelloReply{})
	require.NoError(t, err)
	require.NoError(t, srv.Send(b, nil))
	return lane, raw
}

// filesNotice is the byte a Blocking connection sends ahead of a message
// with descriptors (the sock package's, as it goes on the wire).
const filesNotice = 0xc1

// rawLaneClient returns a client of this process connected to laneServer,
// and the server's end of its lane.
func rawLaneClient(t *testing.T) (*ipc.Client, *sock.Blocking) {
	t.Helper()
	return rawLaneClientWith(t, ipc.ClientConfig{Logger: quiet})
}

// rawLaneClientWith is rawLaneClient with the client's configuration.
func rawLaneClientWith(t *testing.T, cfg ipc.ClientConfig) (*ipc.Client, *sock.Blocking) {
	t.Helper()
	clients := make(chan *ipc.Client, 1)
	lane := laneServer(t, func(path string) {
		go func() {
			ctx, cancel := context.WithTimeout(context.Background(), bound)
			defer cancel()
			c, err := dialHelloWith(ctx, path, cfg)
			if err != nil {
				t.Error(err)
				close(clients)
				return
			}
			clients <- c
		}()
	})
	c := waitFor(t, clients, "the client")
	require.NotNil(t, c)
	t.Cleanup(func() { c.Close() })
	return c, lane
}

// A call on the lane past its deadline reads what is queued for a while
// (catchUpWait), not for as long as answers keep coming: a server that
// floods the lane with answers nobody waits for does not hold it.
func TestALateLaneCallGivesUpThoughAnswersKeepComing(t *testing.T) {
	c, lane := rawLaneClient(t)

	stop := make(chan struct{})
	var flood sync.WaitGroup
	defer flood.Wait()
	defer close(stop)
	stray, err := ipc.AppendFrame(nil, 1<<40, ipc.KindReply, 0, &ipc.CreateMRReply{})
	require.NoError(t, err)
	for range 4 {
		flood.Add(1)
		go func() {
			defer flood.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				_ = lane.TrySend(stray, nil)
			}
		}()
	}
	flood.Add(1)
	go func() { // the client's requests, taken so that its sends find room
		defer flood.Done()
		buf := make([]byte, ipc.MaxMessage)
		for {
			select {
			case <-stop:
				return
			default:
			}
			_, files, _ := lane.RecvBy(buf, time.Now().Add(10*time.Millisecond))
			sock.Drop(files)
		}
	}()
	calls := make(chan error, 10)
	go func() {
		for range 10 {
			calls <- c.CallTimeout(20*time.Millisecond, ipc.KindCreateMR, &ipc.CreateMR{Addr: 0x1000}, &ipc.CreateMRReply{})
		}
	}()
	for i := range 10 {
		select {
		case err := <-calls:
			require.ErrorIs(t, err, context.DeadlineExceeded, "call %d", i)
		case <-time.After(bound):
			t.Fatalf("call %d, with a 20 ms deadline, still reads the flooded lane after %v", i, bound)
		}
	}
}

// A reader with calls waiting behind it takes what is queued before it
// waits; past its deadline, or with its context ended, it still gives up
// in time, though an answer nobody waits for is queued each time it
// takes one.
func TestALaneReaderWithCallsBehindItGivesUpThoughAnswersKeepComing(t *testing.T) {
	const timeout = time.Second // the reader's: room for a busy machine to start the flood in time
	for _, how := range []string{"deadline", "cancelled"} {
		t.Run(how, func(t *testing.T) {
			lc, ctx, cancel := newLaneCalls(t, ipc.ClientConfig{Logger: quiet})
			c, lane := lc.c, lc.lane
			begun := time.Now() // the deadline is after timeout from here
			first := lc.bounded(how, timeout, ctx)
			waitUntilGoroutinesIn(t, 1, "ipc.(*Client).readLane(", "sock.(*Blocking).")
			behindDone := make(chan struct{})
			lc.behind(time.Hour, behindDone)

			// Each stray the reader takes queues the next, from the hook
			// that runs as it is received; the cancellation comes from
			// there too, once the reader is seen going round.
			const inLoop = 20
			stray, err := ipc.AppendFrame(nil, 1<<40, ipc.KindReply, 0, &ipc.CreateMRReply{})
			require.NoError(t, err)
			var taken atomic.Int64
			var flooding atomic.Bool
			flooding.Store(true)
			defer ipc.SetLaneReceivedHook(func(got *ipc.Client) {
				if got != c || !flooding.Load() {
					return
				}
				if taken.Add(1) == inLoop && how == "cancelled" {
					cancel()
				}
				// The next, before this one is dealt with (it may find
				// the client closing at the test's end).
				_ = lane.TrySend(stray, nil)
			})()
			defer func() {
				flooding.Store(false)
				c.Close() // ends the call behind, which reads the lane by then
				<-behindDone
			}()
			require.NoError(t, lane.Send(stray, nil, time.Time{}))
			want := context.DeadlineExceeded
			if how == "cancelled" {
				want = context.Canceled
			}
			select {
			case err := <-first:
				require.ErrorIs(t, err, want)
			case <-time.After(timeout + bound):
				t.Fatalf("the reader, its call %s, still reads the lane after %v", how, timeout+bound)
			}
			require.GreaterOrEqual(t, taken.Load(), int64(inLoop), "the reader took the strays before it gave up")
			if how == "deadline" && time.Since(begun) < timeout {
				t.Fatalf("gave up %v before its deadline", timeout-time.Since(begun))
			}
		})
	}
}

// laneCalls plays calls on c, a client of laneServer, whose
// lane's server end is lane: a first call that reads the lane (one that
// cannot be cancelled, "unwoken", waits in a plain blocking receive; else
// in a wait that a wake-up ends), then calls waiting behind it, each made
// once those before wait. Each call's error comes on its channel; its
// request is returned.
type laneCalls struct {
	t    *testing.T
	c    *ipc.Client
	lane *sock.Blocking
	buf  []byte
	// waiting counts the calls made that wait behind the first.
	waiting int
}

// first makes the call that reads the lane, as how says.
func (lc *laneCalls) first(how string) (ipc.Frame, <-chan error) {
	done := make(chan error, 1)
	go func() {
		if how == "unwoken" {
			done <- lc.c.CallTimeout(bound, ipc.KindCreateMR, &ipc.CreateMR{Addr: 0x1000}, &ipc.CreateMRReply{})
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), bound)
		defer cancel()
		done <- lc.c.Call(ctx, ipc.KindCreateMR, &ipc.CreateMR{Addr: 0x1000}, &ipc.CreateMRReply{})
	}()
	req := lc.request()
	waitUntilGoroutinesIn(lc.t, 1, "ipc.(*Client).readLane(", "sock.(*Blocking).")
	return req, done
}

// newLaneCalls returns laneCalls on a client of laneServer made with cfg,
// and a context for its calls that the test may cancel (it is cancelled
// when the test ends).
func newLaneCalls(t *testing.T, cfg ipc.ClientConfig) (*laneCalls, context.Context, context.CancelFunc) {
	t.Helper()
	c, lane := rawLaneClientWith(t, cfg)
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	return &laneCalls{t: t, c: c, lane: lane, buf: make([]byte, ipc.MaxMessage)}, ctx, cancel
}

// bounded makes a call that reads the lane, bounded by timeout (how is
// "deadline") or by ctx, and returns its error's channel once its
// request has come.
func (lc *laneCalls) bounded(how string, timeout time.Duration, ctx context.Context) <-chan error {
	done := make(chan error, 1)
	go func() {
		if how == "deadline" {
			done <- lc.c.CallTimeout(timeout, ipc.KindCreateMR, &ipc.CreateMR{Addr: 0x1000}, &ipc.CreateMRReply{})
			return
		}
		done <- lc.c.Call(ctx, ipc.KindCreateMR, &ipc.CreateMR{Addr: 0x1000}, &ipc.CreateMRReply{})
	}()
	lc.request()
	return done
}

// behind makes a call with timeout that waits behind the reader, and
// closes done once it has returned.
func (lc *laneCalls) behind(timeout time.Duration, done chan struct{}) (req ipc.Frame, err <-chan error) {
	errs := make(chan error, 1)
	go func() {
		defer close(done)
		errs <- lc.c.CallTimeout(timeout, ipc.KindCreateMR, &ipc.CreateMR{Addr: 0x2000}, &ipc.CreateMRReply{})
	}()
	req = lc.request()
	lc.waiting++
	waitUntilGoroutinesIn(lc.t, lc.waiting, "ipc.(*Client).await(")
	return req, errs
}

// request takes the next request off the lane.
func (lc *laneCalls) request() ipc.Frame {
	n, _, err := lc.lane.RecvBy(lc.buf, time.Now().Add(bound))
	require.NoError(lc.t, err)
	req, err := ipc.ParseFrame(lc.buf[:n])
	require.NoError(lc.t, err)
	return req
}

// answer answers the request of id.
func (lc *laneCalls) answer(id uint64) {
	b, err := ipc.AppendFrame(nil, id, ipc.KindReply, 0, &ipc.CreateMRReply{Start: 0x1000, End: 0x3000, LKey: 7})
	require.NoError(lc.t, err)
	require.NoError(lc.t, lc.lane.Send(b, nil, time.Time{}))
}

// A call waiting behind the lane's reader is answered though its deadline
// passed while the reader held its answer, taken off the socket in time
// but not handed over yet: the reader's thread did not run between the
// kernel's receive and its return (its process stopped, traced, starved
// of CPU). The reader waits for its own answer with a plain blocking
// receive (a call that cannot be cancelled: "unwoken") as long as no
// call waits behind it, or with a wait that a wake-up ends ("wakeable").
func TestALaneAnswerTakenInTimeCountsThoughItsReaderStalledBeforeHandingItOver(t *testing.T) {
	const timeout = time.Second // the waiting call's: room for a busy machine to answer in time
	for _, how := range []string{"unwoken", "wakeable"} {
		t.Run(how, func(t *testing.T) {
			c, lane := rawLaneClient(t)
			lc := &laneCalls{t: t, c: c, lane: lane, buf: make([]byte, ipc.MaxMessage)}
			waiterDone := make(chan struct{})
			// The reader stalls on its second message, until the call
			// waiting for it is past its deadline: given up, or waiting
			// for what the reader holds.
			received := 0
			defer ipc.SetLaneReceivedHook(func(got *ipc.Client) {
				if got != c {
					return
				}
				if received++; received != 2 {
					return
				}
				for testenv.GoroutinesIn("ipc.catchUp(", "ipc.(*Client).await(") == 0 {
					select {
					case <-waiterDone:
						return
					default:
					}
					time.Sleep(time.Millisecond) // polling the runtime's answer
				}
			})()

			first, reader := lc.first(how)
			// One call behind it is answered first, while the reader waits
			// as it began to, alone; the other, then, after the reader
			// began again to wait for one with a call waiting behind it.
			other, otherErr := lc.behind(bound, make(chan struct{}))
			before := time.Now() // the waiting call's deadline is after timeout from here
			second, waiter := lc.behind(timeout, waiterDone)
			lc.answer(other.ID)
			require.NoError(t, waitFor(t, otherErr, "the call answered first"))
			// With a call behind it, the reader waits in a receive that
			// marks what it takes before it leaves the socket's queue (a
			// plain one could not: see sock.Blocking.CaughtUp).
			waitUntilGoroutinesIn(t, 1, "ipc.(*Client).readLane(", "sock.(*Blocking).wait(")
			lc.answer(second.ID) // the reader takes it, and stalls
			if now := time.Now(); !now.Before(before.Add(timeout)) {
				t.Fatalf("the test answered %v after the deadline: it means to meet it", now.Sub(before.Add(timeout)))
			}
			assert.NoError(t, waitFor(t, waiter, "the waiting call"), "the waiting call, answered in time")
			lc.answer(first.ID)
			assert.NoError(t, waitFor(t, reader, "the reading call"))
		})
	}
}

// A call waiting behind the lane's reader whose deadline passes while the
// reader waits, with nothing taken off the socket, fails then: it does
// not wait on, nor take an answer sent after its deadline.
func TestACallWaitingBehindAReaderThatTookNothingFailsAtItsDeadline(t *testing.T) {
	const timeout = 50 * time.Millisecond // the waiting call's
	for _, how := range []string{"unwoken", "wakeable"} {
		t.Run(how, func(t *testing.T) {
			c, lane := rawLaneClient(t)
			lc := &laneCalls{t: t, c: c, lane: lane, buf: make([]byte, ipc.MaxMessage)}
			first, reader := lc.first(how)
			returned := make(chan struct{})
			second, waiter := lc.behind(timeout, returned)
			// Its answer goes once the call is past its deadline: once it
			// has returned, or waits (in a select) for the reader to catch
			// up, which it must not.
			for end := time.Now().Add(bound); testenv.GoroutinesIn("[select", "ipc.catchUp(", "ipc.(*Client).await(") == 0; {
				select {
				case <-returned:
				default:
					require.True(t, time.Now().Before(end), "the waiting call neither returned nor waited within %v", bound)
					time.Sleep(time.Millisecond) // polling the runtime's answer
					continue
				}
				break
			}
			lc.answer(second.ID)
			assert.ErrorIs(t, waitFor(t, waiter, "the waiting call"), context.DeadlineExceeded)
			lc.answer(first.ID)
			assert.NoError(t, waitFor(t, reader, "the reading call"))
		})
	}
}

// Pushes whose sends' bound ran out while the pushing process did not run
// (stopped, traced, starved of CPU) before they went are sent all the
// same, and the peer gets its time to answer: the bound is for waiting
// on the peer, who has not been waited on. (Else a primary stopped at
// that point would drop a secondary that had done nothing wrong; its
// syncs push to one secondary several at once.) The hook holds each
// round's pushes until their bound has passed and lets them go together,
// as a process that resumes: one takes the write turn, and the others
// wait for it a while.
func TestPushesWhoseSendBoundRanOutBeforeTheyWentAreSent(t *testing.T) {
	const pushes = 4
	p := syncAckingPeer(t)
	var held sync.WaitGroup // the round's pushes past their bound
	defer ipc.SetPushSendingHook(func(ctx context.Context) {
		<-ctx.Done()
		held.Done()
		held.Wait() // the process resumes: all at once
	})()
	for round := range 30 {
		held.Add(pushes)
		errs := make(chan error, pushes)
		for range pushes {
			go func() {
				errs <- p.PushWithin(context.Background(), 100*time.Millisecond, ipc.KindSync,
					&ipc.Sync{Op: ipc.SyncUnmap, Count: 1}, &ipc.SyncAck{})
			}()
		}
		for range pushes {
			require.NoError(t, waitFor(t, errs, "a push"), "round %d", round+1)
		}
	}
}

// A push whose send's bound ran out and that waits for the connection's
// turn to write, held by a send the peer keeps waiting (its queue full),
// ends with its caller's context: cancelled, it fails with the
// cancellation at once, not after its wait for the turn, nor sent.
func TestALatePushWaitingForTheWriteTurnEndsWithItsCaller(t *testing.T) {
	s := startServer(t, newHandler(), withHello)
	rawLane(t, s) // a peer that reads nothing
	p := waitFor(t, s.h.connected, "Connected")
	fillPeerQueue(t, p)
	caller, cancel := context.WithCancel(context.Background())
	defer ipc.SetPushSendingHook(func(ctx context.Context) {
		<-ctx.Done() // the bound ran out before the push went
		cancel()
	})()
	err := p.PushWithin(caller, 20*time.Millisecond, ipc.KindSync, &ipc.Sync{Op: ipc.SyncUnmap, Count: 1}, nil)
	assert.ErrorIs(t, err, context.Canceled)
}

// A late push whose write turn stays held (another send waits for room in
// a peer's full queue) gives up after catchUpWait with its deadline, and
// takes nothing with it: the connection stays, and the sends behind the
// turn go once the peer reads again.
func TestALatePushWhoseWriteTurnStaysHeldGivesUp(t *testing.T) {
	s := startServer(t, newHandler(), withHello)
	c, _ := rawLane(t, s)
	p := waitFor(t, s.h.connected, "Connected")
	pushes := fillPeerQueue(t, p)
	var late time.Time // when the late push's bound had run out (the hook runs on this goroutine)
	defer ipc.SetPushSendingHook(func(ctx context.Context) {
		<-ctx.Done()
		late = time.Now()
	})()
	err := p.PushWithin(context.Background(), 20*time.Millisecond, ipc.KindSync, &ipc.Sync{Op: ipc.SyncUnmap, Count: 1}, nil)
	gaveUp := time.Now()
	assert.ErrorIs(t, err, context.DeadlineExceeded)
	assert.GreaterOrEqual(t, gaveUp.Sub(late), ipc.CatchUpWait, "it gave up before waiting for the turn")
	require.NoError(t, p.Err(), "the connection ended")

	// The peer reads: every push held behind the turn goes, and the late
	// one does not.
	buf := make([]byte, ipc.MaxMessage)
	for range pushes {
		require.NoError(t, c.SetReadDeadline(time.Now().Add(bound)))
		_, _, err := c.Recv(buf)
		require.NoError(t, err, "a push behind the turn never came")
	}
	waitUntil(t, func() bool { return testenv.GoroutinesIn("writeBounded") == 0 }, "every push sent")
	require.NoError(t, c.SetReadDeadline(time.Now()))
	_, _, err = c.Recv(buf)
	assert.ErrorIs(t, err, os.ErrDeadlineExceeded, "the late push went after all")
	require.NoError(t, p.Err())
}

// fillPeerQueue pushes to p, whose peer reads nothing, until a send waits
// for room in the peer's queue and so holds the connection's write turn;
// it returns how many pushes it made (each bound by a minute, all but the
// ones the queue took waiting). The pushes end with the test's connection.
func fillPeerQueue(t *testing.T, p *ipc.Peer) int {
	t.Helper()
	waiting := func() int { return testenv.GoroutinesIn("writeBounded", "waitWrite") }
	pushes := 0
	for waiting() == 0 {
		require.Less(t, pushes, 10_000, "pushes and the peer's queue still not full")
		pushes += 64
		for range 64 {
			go func() {
				_ = p.PushWithin(context.Background(), time.Minute, ipc.KindSync, &ipc.Sync{Op: ipc.SyncUnmap, Count: 1}, nil)
			}()
		}
		// Each batch past the hook (sent and waiting for its answer,
		// waiting for the turn, or holding it) before the next.
		waitUntil(t, func() bool { return testenv.GoroutinesIn("callWithin", "[select")+waiting() == pushes },
			"the pushes past the hook")
	}
	return pushes
}

// A push whose send's bound ran out before it went, to a peer that no
// longer reads (it shut its receiving side down: sending to it fails),
// fails as the same push in time does, with the peer gone and the
// connection ended, not with a deadline: the peer was not waited on, and
// a primary judges a secondary whose connection failed by whether it is
// dying, not as one that did not answer.
func TestALatePushToAPeerThatStoppedReadingFailsWithThePeerGone(t *testing.T) {
	s := startServer(t, newHandler(), withHello)
	c := rawHelloNet(t, s.path)
	p := waitFor(t, s.h.connected, "Connected")
	require.NoError(t, c.CloseRead())
	defer ipc.SetPushSendingHook(func(ctx context.Context) { <-ctx.Done() })()
	err := p.PushWithin(context.Background(), 20*time.Millisecond, ipc.KindSync, &ipc.Sync{Op: ipc.SyncUnmap, Count: 1}, nil)
	assert.ErrorIs(t, err, ipc.ErrPeerGone)
	assert.ErrorIs(t, p.Err(), ipc.ErrPeerGone, "the connection ended")
}

// rawHelloNet is rawHelloAt on a plain net.UnixConn (whose sides can be
// shut down one at a time); the lane the server hands over is kept open,
// and both are closed with the test.
func rawHelloNet(t *testing.T, path string) *net.UnixConn {
	t.Helper()
	c, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: path, Net: "unixpacket"})
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() })
	b, err := ipc.AppendFrame(nil, 1, ipc.KindHello, 0, &ipc.Hello{ABI: ipc.ABI, PID: os.Getpid(), UID: os.Getuid(), Role: "secondary"})
	require.NoError(t, err)
	_, err = c.Write(b)
	require.NoError(t, err)
	require.NoError(t, c.SetReadDeadline(time.Now().Add(bound)))
	buf, oob := make([]byte, ipc.MaxMessage), make([]byte, unix.CmsgSpace(4))
	for _, want := range []ipc.Kind{ipc.KindChannel, ipc.KindReply} { // the lane, then the hello's answer
		n, oobn, _, _, err := c.ReadMsgUnix(buf, oob)
		require.NoError(t, err)
		if oobn > 0 {
			msgs, err := unix.ParseSocketControlMessage(oob[:oobn])
			require.NoError(t, err)
			for _, m := range msgs {
				fds, err := unix.ParseUnixRights(&m)
				require.NoError(t, err)
				for _, fd := range fds {
					lane := os.NewFile(uintptr(fd), "lane")
					t.Cleanup(func() { lane.Close() })
				}
			}
		}
		f, err := ipc.ParseFrame(buf[:n])
		require.NoError(t, err)
		require.Equal(t, want, f.Kind)
	}
	return c
}

// A server that closes its end of the lane and keeps the connection
// (careless, or meaning harm) does not hold the call reading the lane
// past its deadline and catchUpWait, nor past its context's end, for the
// while the client gives the connection to say why the lane ended; the
// connection still ends after that while.
func TestALaneEndedWhileTheConnectionStaysHoldsNoCallPastItsBound(t *testing.T) {
	const timeout = 300 * time.Millisecond // well under the grace, and room to close the lane before it
	for _, how := range []string{"deadline", "cancelled"} {
		t.Run(how, func(t *testing.T) {
			lc, ctx, cancel := newLaneCalls(t, ipc.ClientConfig{Logger: quiet})
			c, lane := lc.c, lc.lane
			done := lc.bounded(how, timeout, ctx)
			waitUntilGoroutinesIn(t, 1, "ipc.(*Client).readLane(", "sock.(*Blocking).")
			require.NoError(t, lane.Close()) // the connection stays
			// The call's own reader, not a drainer after it gave up.
			waitUntilGoroutinesIn(t, 1, "ipc.(*Client).laneEnded", "ipc.(*Client).readLane(")
			began := time.Now()
			want := context.DeadlineExceeded
			if how == "cancelled" {
				cancel()
				want = context.Canceled
			}
			select {
			case err := <-done:
				require.ErrorIs(t, err, want)
			case <-c.Done():
				t.Fatalf("the call still waited when the connection ended, %v after its %s", time.Since(began), how)
			}
			select {
			case <-c.Done():
				require.ErrorIs(t, c.Err(), ipc.ErrPeerGone, "the connection ends as the lane did")
			case <-time.After(bound):
				t.Fatalf("the connection stays up %v after its lane ended", bound)
			}
		})
	}
}

// A client that polls for its answers (ClientConfig.Spin) polls no
// longer than a call's deadline, and stops when its context ends.
func TestASpinningCallEndsAtItsDeadlineOrCancellation(t *testing.T) {
	const spin = bound // far longer than either call may take
	for _, how := range []string{"deadline", "cancelled"} {
		t.Run(how, func(t *testing.T) {
			lc, ctx, cancel := newLaneCalls(t, ipc.ClientConfig{Logger: quiet, Spin: spin})
			done := lc.bounded(how, 20*time.Millisecond, ctx)
			want := context.DeadlineExceeded
			if how == "cancelled" {
				waitUntilGoroutinesIn(t, 1, "sock.(*Blocking).spin(")
				cancel()
				want = context.Canceled
			}
			select {
			case err := <-done:
				require.ErrorIs(t, err, want)
			case <-time.After(spin / 2):
				t.Fatalf("the call, its %s come, still polls after %v", how, spin/2)
			}
		})
	}
}
