package ipc_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
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

func init() {
	testproc.Register("flood", helperFlood)
}

const nobody = 65534

// helperFlood becomes user args[1] (when that is not already its user) and
// floods the server at args[0] the way args[2] says, args[3] times:
//
//	idle N         opens N connections and sends nothing on them; prints
//	               "open N" once they are dialled, then answers each
//	               "check" with "check closed=C limit=L" (of them, how
//	               many the server has closed, and how many of those with
//	               a reason that matches ErrLimit)
//	files N        sends N stats requests on one connection, each with
//	               MaxFiles descriptors, and reads nothing
//	hello-files N  says hello, then sends N create requests that the
//	               server's handler holds (blockAddr), each with 4
//	               descriptors, and reads nothing
//
// The senders print "ready" once connected, start on the input line "go",
// print "sent S err=E" when they are done (or the server hung up) and
// keep the connection until their input ends.
func helperFlood(args []string) int {
	uid, _ := strconv.Atoi(args[1])
	if uid != os.Geteuid() {
		if err := testenv.BecomeUser(uid); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 3
		}
	}
	n, _ := strconv.Atoi(args[3])
	switch args[2] {
	case "idle":
		return floodIdle(args[0], n)
	case "files", "hello-files":
		return floodFiles(args[0], n, args[2] == "hello-files")
	}
	fmt.Fprintln(os.Stderr, "unknown flood", args[2])
	return 2
}

// dialRetry dials path, retrying while the listen backlog is full (a
// flood outruns the server's accept loop).
func dialRetry(path string) (*sock.Conn, error) {
	for i := 0; ; i++ {
		ctx, cancel := context.WithTimeout(context.Background(), bound)
		c, err := sock.Dial(ctx, path)
		cancel()
		if err == nil || !errors.Is(err, syscall.EAGAIN) || i == 10000 {
			return c, err
		}
		runtime.Gosched()
	}
}

func floodIdle(path string, n int) int {
	var closed, limited atomic.Int64
	for range n {
		c, err := dialRetry(path)
		if err != nil {
			fmt.Fprintln(os.Stderr, "dial:", err)
			return 3
		}
		// Watch the connection: the server may tell why it ends it.
		go func() {
			buf := make([]byte, ipc.MaxMessage)
			why := false
			for {
				n, files, err := c.Recv(buf)
				for _, f := range files {
					f.Close()
				}
				if err != nil {
					break
				}
				f, err := ipc.ParseFrame(buf[:n])
				var r ipc.ErrorReply
				if err == nil && f.ID == 0 && f.Kind == ipc.KindError && ipc.Unmarshal(f.Body, &r) == nil && r.Code == "ipc.limit" {
					why = true
				}
			}
			if why {
				limited.Add(1)
			}
			closed.Add(1)
		}()
	}
	testproc.Say("open %d", n)
	in := testproc.Commands()
	for in.Scan() {
		if in.Text() == "check" {
			testproc.Say("check closed=%d limit=%d", closed.Load(), limited.Load())
		}
	}
	return 0
}

func floodFiles(path string, n int, hello bool) int {
	c, err := dialRetry(path)
	if err != nil {
		fmt.Fprintln(os.Stderr, "dial:", err)
		return 3
	}
	defer c.Close()
	devNull, err := os.Open(os.DevNull)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 3
	}
	files := make([]*os.File, ipc.MaxFiles)
	for i := range files {
		files[i] = devNull
	}
	if hello {
		b, _ := ipc.AppendFrame(nil, 1, ipc.KindHello, 0, &ipc.Hello{ABI: ipc.ABI, PID: os.Getpid(), UID: os.Getuid(), Role: "secondary"})
		if err := c.Send(b, nil); err != nil {
			fmt.Fprintln(os.Stderr, "hello:", err)
			return 3
		}
		buf := make([]byte, ipc.MaxMessage)
		if _, _, err := c.Recv(buf); err != nil {
			fmt.Fprintln(os.Stderr, "hello reply:", err)
			return 3
		}
		files = files[:4]
	}
	testproc.Say("ready")
	in := testproc.Commands()
	if !in.Scan() || in.Text() != "go" {
		return 0
	}
	sent := 0
	for i := range n {
		var b []byte
		if hello {
			b, _ = ipc.AppendFrame(nil, uint64(i+2), ipc.KindCreateMR, len(files), &ipc.CreateMR{Addr: blockAddr})
		} else {
			b, _ = ipc.AppendFrame(nil, uint64(i+2), ipc.KindStats, len(files), &ipc.StatsRequest{})
		}
		if err = c.Send(b, files); err != nil {
			break
		}
		sent++
	}
	testproc.Say("sent %d err=%v", sent, err)
	for in.Scan() {
	}
	return 0
}

// liveHeap returns the bytes of live heap objects.
func liveHeap() uint64 {
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapAlloc
}

func hello(t testing.TB, c *ipc.Client) {
	t.Helper()
	require.NoError(t, c.Call(ctxBound(t), ipc.KindHello, &ipc.Hello{ABI: ipc.ABI, PID: os.Getpid(), UID: os.Getuid(), Role: "secondary"}, &ipc.HelloReply{}))
}

func withHello(c *ipc.ServerConfig) { c.HelloKind = ipc.KindHello }

// Thousands of connections of another user that never speak cost the
// server no more than its per-user cap allows, are closed when their
// hello is overdue, and a legitimate client is served throughout.
func TestIdleConnectionFloodIsBounded(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: the flooding process switches to uid 65534 with setuid")
	}
	const flood = 2000
	path := openSocketPath(t)
	s := startServerOn(t, listen(t, path), quietHandler{newHandler()}, withHello, func(c *ipc.ServerConfig) {
		c.AllowUIDs = []int{nobody}
		c.Limits.HelloTimeout = time.Second
	})
	require.NoError(t, os.Chmod(path, 0o666))
	goroutines, heap := runtime.NumGoroutine(), liveHeap()

	h := testproc.Start(t, "flood", []string{path, strconv.Itoa(nobody), "idle", strconv.Itoa(flood)})
	h.Expect("open ", 0)
	st := s.Stats()
	held, grown := runtime.NumGoroutine(), liveHeap()
	t.Logf("%d idle connections dialled: the server holds %d connections, %d goroutines (%d before), %d KiB more heap; refused %d",
		flood, st.Conns, held, goroutines, (int64(grown)-int64(heap))>>10, st.RefusedConnsUID)
	assert.LessOrEqual(t, st.Conns, ipc.DefaultMaxConnsPerUID, "connections held for one user")
	assert.LessOrEqual(t, held, goroutines+2*ipc.DefaultMaxConnsPerUID+16, "goroutines")
	assert.Less(t, int64(grown)-int64(heap), int64(16<<20), "heap held for the idle connections")
	assert.NotZero(t, st.RefusedConnsUID)

	c := dial(t, path, ipc.ClientConfig{})
	hello(t, c)
	var r ipc.CreateMRReply
	require.NoError(t, c.Call(ctxBound(t), ipc.KindCreateMR, &ipc.CreateMR{Addr: 0x5000}, &r), "a legitimate client is served")

	var closed, limited int
	require.True(t, eventually(func() bool {
		h.Send("check")
		_, err := fmt.Sscanf(h.Expect("check ", 0), "check closed=%d limit=%d", &closed, &limited)
		require.NoError(t, err)
		return closed == flood
	}), "the server closed %d of the %d idle connections", closed, flood)
	assert.Equal(t, flood, limited, "every idle connection was told why it was closed")
	// The flood sees each connection end once the server closed it; the
	// server counts it gone once its goroutines are done with it.
	require.True(t, eventually(func() bool { st := s.Stats(); return st.Conns == 1 && st.Unadmitted == 0 }),
		"the server let go of the closed connections: %+v", s.Stats())
	st = s.Stats()
	t.Logf("refused at connect %d, closed for an overdue hello %d", st.RefusedConnsUID, st.HelloTimeouts)
	assert.EqualValues(t, flood, st.RefusedConnsUID+st.HelloTimeouts)
	assert.NotZero(t, st.HelloTimeouts)
	assert.Equal(t, 1, st.Conns, "the legitimate client")
	assert.Zero(t, st.Unadmitted)
	assert.NoError(t, c.Call(ctxBound(t), ipc.KindCreateMR, &ipc.CreateMR{Addr: 0x5000}, &r))
	assert.Contains(t, s.log.String(), "no hello")
	assert.Contains(t, s.log.String(), "per user")
}

// other is a second uid besides nobody for the tests of several users'
// connections.
const other = 65533

// floodAs starts a helper of uid that dials n connections to path that
// never say hello, and waits until it has.
func floodAs(t *testing.T, path string, uid, n int) *testproc.Proc {
	t.Helper()
	h := testproc.Start(t, "flood", []string{path, strconv.Itoa(uid), "idle", strconv.Itoa(n)})
	h.Expect(fmt.Sprintf("open %d", n), 0)
	return h
}

// floodEnded asks a flood helper how many of its connections the server
// closed, and of those how many it told they were over a limit.
func floodEnded(t *testing.T, h *testproc.Proc) (closed, limited int) {
	t.Helper()
	h.Send("check")
	_, err := fmt.Sscanf(h.Expect("check ", 0), "check closed=%d limit=%d", &closed, &limited)
	require.NoError(t, err)
	return closed, limited
}

// awaitEnded waits until n of a flood helper's connections were closed,
// and returns how many of them were told they were over a limit.
func awaitEnded(t *testing.T, h *testproc.Proc, n int, what string) (limited int) {
	t.Helper()
	var closed int
	require.True(t, eventually(func() bool { closed, limited = floodEnded(t, h); return closed == n }),
		"%s: %d closed, not %d", what, closed, n)
	return limited
}

// openServer starts a server with a hello and handler h, in a directory
// and on a socket anyone may use, that lets in root and allow, with the
// limits lim and an hour to say hello.
func openServer(t *testing.T, h ipc.Handler, lim ipc.Limits, allow ...int) (*testServer, string) {
	t.Helper()
	path := openSocketPath(t)
	lim.HelloTimeout = time.Hour
	s := startServerOn(t, listen(t, path), h, withHello, func(c *ipc.ServerConfig) {
		c.AllowUIDs, c.Limits = allow, lim
	})
	require.NoError(t, os.Chmod(path, 0o666))
	return s, path
}

// awaitTwoEnded waits until n of two flood helpers' connections in all
// were closed, and returns how many of each's were, and how many of those
// each was told were over a limit.
func awaitTwoEnded(t *testing.T, floods []*testproc.Proc, n int, what string) (closed, limited [2]int) {
	t.Helper()
	require.True(t, eventually(func() bool {
		for i, h := range floods {
			closed[i], limited[i] = floodEnded(t, h)
		}
		return closed[0]+closed[1] == n
	}), "%s: %v closed", what, closed)
	return closed, limited
}

// usersServer is openServer for root, nobody and other, with the caps
// given.
func usersServer(t *testing.T, maxConns, perUID int) (*testServer, string) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: helpers switch to uids 65534 and 65533 with setuid")
	}
	return openServer(t, quietHandler{newHandler()}, ipc.Limits{MaxConns: maxConns, MaxConnsPerUID: perUID}, nobody, other)
}

// The total and per-user caps count connections of real users.
func TestConnectionCaps(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: a helper switches to uid 65534 with setuid")
	}
	s, path := openServer(t, quietHandler{newHandler()}, ipc.Limits{MaxConns: 6, MaxConnsPerUID: 4}, nobody)
	h := floodAs(t, path, nobody, 6)
	require.True(t, eventually(func() bool { st := s.Stats(); return st.Conns == 4 && st.RefusedConnsUID == 2 }),
		"4 of uid 65534's 6 connections are served, 2 refused: %+v", s.Stats())
	assert.Equal(t, 2, awaitEnded(t, h, 2, "the refused connections end"), "and are told why")

	for range 2 { // root's own, without hello: served up to the total
		dial(t, path, ipc.ClientConfig{})
	}
	require.True(t, eventually(func() bool { return s.Stats().Conns == 6 }), "root's are served: %+v", s.Stats())
	// Over the total, root (2 without hello) holds fewer than uid 65534
	// (4, none admitted) less one: served, in the place of 65534's oldest.
	hello(t, dial(t, path, ipc.ClientConfig{}))
	assert.Equal(t, 3, awaitEnded(t, h, 3, "one of uid 65534's connections made room"), "and was told why")
	assert.EqualValues(t, 1, s.Stats().ShedConns)
	// Now root holds 2 without hello and 65534 3: not more than one more.
	over := dial(t, path, ipc.ClientConfig{})
	waitFor(t, over.Done(), "the end of a connection over the total")
	assert.ErrorIs(t, over.Err(), ipc.ErrLimit)
	assert.ErrorIs(t, over.Err(), ipc.ErrPeerGone)
	assert.ErrorContains(t, over.Err(), "connections")
	st := s.Stats()
	assert.Equal(t, 6, st.Conns)
	assert.EqualValues(t, 1, st.RefusedConns)
	assert.EqualValues(t, 2, st.RefusedConnsUID)
}

// Connections of users the server does not let in are refused before they
// count against any cap: users that may not connect cannot fill the caps
// of those who may.
func TestRefusedUsersCountAgainstNoCap(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: a helper switches to uid 65534 with setuid")
	}
	s, path := openServer(t, quietHandler{newHandler()}, ipc.Limits{MaxConns: 2, MaxConnsPerUID: 1})
	h := floodAs(t, path, nobody, 8)
	assert.Zero(t, awaitEnded(t, h, 8, "every connection of uid 65534 is refused"), "for its credentials, not a limit")
	st := s.Stats()
	assert.Zero(t, st.RefusedConnsUID, "none counted against the per-user cap")
	assert.Zero(t, st.RefusedConns)
	assert.Contains(t, s.log.String(), "refused a connection by credentials")
	hello(t, dial(t, path, ipc.ClientConfig{}))
}

// Users that fill the total with connections that never say hello, each
// within its own cap, lock no other user out: a user holding fewer
// connections than the one holding the most, less one, takes the place of
// that user's oldest connection not admitted yet. A user no lighter than
// that is refused as before.
func TestTheTotalCapMakesRoomForALighterUser(t *testing.T) {
	s, path := usersServer(t, 8, 4)
	floods := []*testproc.Proc{floodAs(t, path, nobody, 4), floodAs(t, path, other, 4)}
	require.True(t, eventually(func() bool { return s.Stats().Conns == 8 }), "both users' connections are served: %+v", s.Stats())

	for range 2 { // root, 0 then 1, against two users of 4: served
		hello(t, dial(t, path, ipc.ClientConfig{}))
	}
	closed, limited := awaitTwoEnded(t, floods, 2, "two of the flooders' connections made room")
	assert.Equal(t, [2]int{1, 1}, closed, "one of each user's: each was the heavier in turn (the older first)")
	assert.Equal(t, closed, limited, "each told why")
	st := s.Stats()
	assert.Equal(t, 8, st.Conns)
	assert.EqualValues(t, 2, st.ShedConns)
	assert.Zero(t, st.RefusedConns)

	// uid 65534 (3) against 3 and 2: no lighter than the heaviest less
	// one. Refused, and nobody's connection goes.
	again := floodAs(t, path, nobody, 1)
	assert.Equal(t, 1, awaitEnded(t, again, 1, "the connection of a user that is not lighter is refused"))
	st = s.Stats()
	assert.EqualValues(t, 1, st.RefusedConns)
	assert.EqualValues(t, 2, st.ShedConns)
	assert.Equal(t, 8, st.Conns)
}

// Only connections without hello weigh in the choice, since only they can
// be shed: a user whose connections said hello, more of them than either
// flooder holds, is let in all the same, and a flooder is not let in in
// the place of another that holds as many without hello.
func TestSheddingWeighsOnlyConnectionsWithoutHello(t *testing.T) {
	s, path := usersServer(t, 8, 4)
	for range 2 {
		hello(t, dial(t, path, ipc.ClientConfig{}))
	}
	floods := []*testproc.Proc{floodAs(t, path, nobody, 3), floodAs(t, path, other, 3)}
	require.True(t, eventually(func() bool { return s.Stats().Conns == 8 }), "every connection is served: %+v", s.Stats())

	// Root holds 2, each flooder 3; but root holds none without hello.
	hello(t, dial(t, path, ipc.ClientConfig{}))
	closed, limited := awaitTwoEnded(t, floods, 1, "one of the flooders' connections made room")
	assert.Equal(t, [2]int{1, 0}, closed, "the older flooder's")
	assert.Equal(t, closed, limited, "told why")

	// 65533 (3 without hello) against 65534 (2): not lighter by two.
	awaitEnded(t, floodAs(t, path, other, 1), 1, "refused")
	st := s.Stats()
	assert.EqualValues(t, 1, st.ShedConns)
	assert.EqualValues(t, 1, st.RefusedConns)
	assert.Equal(t, 8, st.Conns)
}

// Connections of a user accepted back to back weigh from the moment they
// are accepted, before they are peers: a burst sheds no more than the same
// connections one by one would.
func TestABurstShedsNoMoreThanItsConnectionsOneByOne(t *testing.T) {
	s, path := usersServer(t, 8, 8)
	floodAs(t, path, other, 6)
	floodAs(t, path, nobody, 2)
	require.True(t, eventually(func() bool { return len(s.Peers()) == 8 }), "every connection a peer: %+v", s.Stats())

	// 65534's four, all accepted before any becomes a peer: two shed one
	// of 65533's each (2 against 6, then 3 against 5), then 4 against 4.
	gate := make(chan struct{})
	ipc.HoldNewConnections(gate)
	t.Cleanup(func() { ipc.HoldNewConnections(nil) })
	floodAs(t, path, nobody, 4)
	require.True(t, eventually(func() bool { st := s.Stats(); return st.ShedConns+st.RefusedConns == 4 }),
		"every connection of the burst judged: %+v", s.Stats())
	close(gate)
	st := s.Stats()
	assert.EqualValues(t, 2, st.ShedConns)
	assert.EqualValues(t, 2, st.RefusedConns)

	// 65533, now 4 against 4, is refused: the flooders do not shed each
	// other in turn.
	floodAs(t, path, other, 1)
	require.True(t, eventually(func() bool { return s.Stats().RefusedConns == 3 }), "%+v", s.Stats())
	assert.EqualValues(t, 2, s.Stats().ShedConns)
	require.True(t, eventually(func() bool { return s.Stats().Unadmitted == 8 }), "%+v", s.Stats())
}

// A connection over its user's cap is refused for that cap, whatever the
// total: with ErrConnsInUse when every connection of the user said hello
// (only their leaving makes room: an attach need not try again), plain
// ErrLimit when some did not (they go by themselves).
func TestTheUsersOwnCapIsNamedFirst(t *testing.T) {
	s, path := usersServer(t, 3, 2)
	for range 2 {
		hello(t, dial(t, path, ipc.ClientConfig{}))
	}
	floodAs(t, path, nobody, 1)
	require.True(t, eventually(func() bool { return s.Stats().Conns == 3 }), "%+v", s.Stats())

	over := dial(t, path, ipc.ClientConfig{}) // root: 2 of 2, both said hello; the total full too
	waitFor(t, over.Done(), "the end of a connection over its user's cap")
	assert.ErrorIs(t, over.Err(), ipc.ErrConnsInUse)
	assert.ErrorContains(t, over.Err(), "per user")
	st := s.Stats()
	assert.EqualValues(t, 1, st.RefusedConnsUID)
	assert.Zero(t, st.RefusedConns)

	// uid 65534, 1 of 2 without hello, against the full total: the total,
	// held in part by a connection that goes by itself.
	assert.Equal(t, 1, awaitEnded(t, floodAs(t, path, nobody, 1), 1, "refused"))
	st = s.Stats()
	assert.EqualValues(t, 1, st.RefusedConns)
	assert.EqualValues(t, 1, st.RefusedConnsUID)
}

// heldGone is a handler whose Disconnected waits until gate is closed, as
// the primary's may (its judgement of a secondary that went); entered
// gets each peer as its Disconnected starts.
type heldGone struct {
	quietHandler
	gate    chan struct{}
	entered chan *ipc.Peer
}

func (h heldGone) Disconnected(p *ipc.Peer, err error) {
	h.entered <- p
	<-h.gate
}

// heldGoneServer is openServer with a heldGone handler, whose gate opens
// before the server closes.
func heldGoneServer(t *testing.T, lim ipc.Limits, allow ...int) (*testServer, heldGone, string) {
	t.Helper()
	h := heldGone{quietHandler{newHandler()}, make(chan struct{}), make(chan *ipc.Peer, 64)}
	s, path := openServer(t, h, lim, allow...)
	t.Cleanup(func() { close(h.gate) }) // before the server's Close: cleanups run last first
	return s, h, path
}

// A cap held in part by connections that are closing passes by itself:
// refused with plain ErrLimit (an attach tries again), not ErrConnsInUse —
// whether the connection's end is still being handled, or has not even
// been read yet (its peer hung up a moment ago).
func TestACapHeldByAClosingConnectionIsNotInUse(t *testing.T) {
	for _, c := range []struct {
		name string
		lim  ipc.Limits
	}{{"per-user", ipc.Limits{MaxConnsPerUID: 1}}, {"total", ipc.Limits{MaxConns: 1, MaxConnsPerUID: 2}}} {
		t.Run(c.name+"/ending", func(t *testing.T) {
			_, h, path := heldGoneServer(t, c.lim)
			a := dial(t, path, ipc.ClientConfig{})
			hello(t, a)
			a.Close()
			waitFor(t, h.entered, "the end of the first connection, being handled")
			b := dial(t, path, ipc.ClientConfig{})
			waitFor(t, b.Done(), "the refusal")
			assert.ErrorIs(t, b.Err(), ipc.ErrLimit)
			assert.NotErrorIs(t, b.Err(), ipc.ErrConnsInUse)
		})
		t.Run(c.name+"/hung-up", func(t *testing.T) {
			s, _, path := heldGoneServer(t, c.lim)
			// A client played by hand, which keeps its call lane open
			// when it closes its connection: the peer lives on, its
			// connection hung up.
			ctx, cancel := context.WithTimeout(context.Background(), bound)
			defer cancel()
			a, err := sock.Dial(ctx, path)
			require.NoError(t, err)
			defer a.Close()
			buf := make([]byte, ipc.MaxMessage)
			require.NoError(t, a.Send(frame(t, 1, ipc.KindHello, 0, &ipc.Hello{ABI: ipc.ABI, PID: os.Getpid(), UID: os.Getuid(), Role: "secondary"}), nil))
			for replied := false; !replied; {
				n, files, err := a.Recv(buf)
				require.NoError(t, err)
				for _, f := range files {
					defer f.Close() // the lane
				}
				f, err := ipc.ParseFrame(buf[:n])
				require.NoError(t, err)
				replied = f.Kind == ipc.KindReply
			}
			// The server's reader holds the next frame it takes (the
			// answer to a push), and does not read the end that follows.
			gate := make(chan struct{})
			defer close(gate)
			held := ipc.HoldNextFrame(gate, true)
			t.Cleanup(func() { ipc.OnSendToClosedPeer(nil) })
			p := s.Peers()[0]
			go p.PushWithin(context.Background(), bound, ipc.KindSync, &ipc.Sync{}, &ipc.SyncAck{}) //nolint:errcheck // it ends with the connection
			n, _, err := a.Recv(buf)
			require.NoError(t, err)
			push, err := ipc.ParseFrame(buf[:n])
			require.NoError(t, err)
			require.NoError(t, a.Send(frame(t, push.ID, ipc.KindReply, 0, &ipc.SyncAck{}), nil))
			waitFor(t, held, "the server's reader holding a frame")
			require.NoError(t, a.Close())
			assert.NoError(t, p.Err(), "the peer lives on")
			b := dial(t, path, ipc.ClientConfig{})
			waitFor(t, b.Done(), "the refusal")
			assert.ErrorIs(t, b.Err(), ipc.ErrLimit)
			assert.NotErrorIs(t, b.Err(), ipc.ErrConnsInUse)
		})
	}
}

// Connections without hello that have ended weigh no more in the
// shedding, while their end is handled.
func TestEndedConnectionsWeighNothingInTheShedding(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: a helper switches to uid 65534 with setuid")
	}
	s, h, path := heldGoneServer(t, ipc.Limits{MaxConns: 3, MaxConnsPerUID: 3}, nobody)
	var cs []*ipc.Client
	for range 3 { // root's, without hello
		cs = append(cs, dial(t, path, ipc.ClientConfig{}))
	}
	require.True(t, eventually(func() bool { return len(s.Peers()) == 3 }), "root's three are peers: %+v", s.Stats())
	for i := range 2 {
		cs[i].Close()
		waitFor(t, h.entered, "an ended connection, being handled")
	}
	// Root holds one live without hello; 65534 none: 1 is not more than
	// 0 + 1. Refused (the total still counts the two ending).
	awaitEnded(t, floodAs(t, path, nobody, 1), 1, "refused")
	st := s.Stats()
	assert.Zero(t, st.ShedConns)
	assert.EqualValues(t, 1, st.RefusedConns)
	assert.NoError(t, cs[2].Err(), "root's live connection stays")
}

// A connection shed while its hello is handled is not admitted, and its
// hello is answered with the reason (a limit: an attach tries again), not
// with a success the connection's end would then contradict.
func TestAHelloShedWhileHandledFails(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: a helper switches to uid 65534 with setuid")
	}
	h := newHandler()
	entered, release := make(chan struct{}, 1), make(chan struct{})
	h.handle = func(ctx context.Context, p *ipc.Peer, kind ipc.Kind, body *ipc.Decoder) (any, error, bool) {
		if kind == ipc.KindHello {
			entered <- struct{}{}
			<-release
		}
		return nil, nil, false
	}
	s, path := openServer(t, quietHandler{h}, ipc.Limits{MaxConns: 3, MaxConnsPerUID: 3}, nobody)
	var once sync.Once
	t.Cleanup(func() { once.Do(func() { close(release) }) })

	first := dial(t, path, ipc.ClientConfig{}) // root's oldest: the one shed
	done := make(chan error, 1)
	go func() {
		done <- first.Call(ctxBound(t), ipc.KindHello, &ipc.Hello{ABI: ipc.ABI, PID: os.Getpid(), UID: os.Getuid(), Role: "secondary"}, &ipc.HelloReply{})
	}()
	waitFor(t, entered, "the hello in its handler")
	for range 2 {
		dial(t, path, ipc.ClientConfig{})
	}
	require.True(t, eventually(func() bool { return len(s.Peers()) == 3 }), "root's three are peers")
	gate := make(chan struct{})
	ipc.HoldShedDrops(gate)
	t.Cleanup(func() { ipc.HoldShedDrops(nil) })
	defer close(gate)
	floodAs(t, path, nobody, 1) // 0 against root's 3 without hello
	require.True(t, eventually(func() bool { return s.Stats().ShedConns == 1 }), "%+v", s.Stats())

	once.Do(func() { close(release) }) // the hello's handler returns, its connection not closed yet
	err := waitFor(t, done, "the hello's answer")
	assert.ErrorIs(t, err, ipc.ErrLimit)
	assert.ErrorContains(t, err, "to make room")
}

// A connection that does not complete its hello in time is closed and
// told why; a failed hello does not count, and requests before the hello
// are still served.
func TestHelloDeadline(t *testing.T) {
	h := newHandler()
	h.handle = func(ctx context.Context, p *ipc.Peer, kind ipc.Kind, body *ipc.Decoder) (any, error, bool) {
		var m ipc.Hello
		if kind == ipc.KindHello && body.Decode(&m) == nil && m.Role == "intruder" {
			return nil, errors.New("not one of ours"), true
		}
		return nil, nil, false
	}
	// Time for good's hello, bad's and idle's first calls on a busy
	// machine; bad and idle are then closed when it is up.
	s := startServer(t, quietHandler{h}, withHello, func(c *ipc.ServerConfig) { c.Limits.HelloTimeout = time.Second })
	good := dial(t, s.path, ipc.ClientConfig{})
	hello(t, good)
	bad := dial(t, s.path, ipc.ClientConfig{})
	err := bad.Call(ctxBound(t), ipc.KindHello, &ipc.Hello{ABI: ipc.ABI, PID: 1, Role: "intruder"}, nil)
	require.ErrorContains(t, err, "not one of ours")
	idle := dial(t, s.path, ipc.ClientConfig{})
	var st ipc.StatsReply
	require.NoError(t, idle.Call(ctxBound(t), ipc.KindStats, &ipc.StatsRequest{}, &st), "a stats request needs no hello")

	for _, c := range []*ipc.Client{bad, idle} {
		waitFor(t, c.Done(), "the end of a connection without hello")
		assert.ErrorIs(t, c.Err(), ipc.ErrLimit)
		assert.ErrorIs(t, c.Err(), ipc.ErrPeerGone)
		assert.ErrorContains(t, c.Err(), "no hello within 1s")
		cred, err := c.ServerCred()
		assert.NoError(t, err, "who the server was is known after the end too")
		assert.Equal(t, os.Getpid(), cred.PID)
	}
	// good was dialled first: its deadline passed too.
	assert.NoError(t, good.Err())
	assert.NoError(t, good.Call(ctxBound(t), ipc.KindCreateMR, &ipc.CreateMR{Addr: 0x1000}, nil))
	assert.EqualValues(t, 2, s.Stats().HelloTimeouts)
	assert.Contains(t, s.log.String(), "no hello")
}

// Descriptors: none before the hello (they are closed on arrival and the
// request goes on without them), at most MaxFilesPerMessage in one
// message and MaxFilesPerPeer held at once after it (a request over a
// limit is refused with ErrLimit and its files closed at once). The
// connection carries on.
func TestDescriptorLimits(t *testing.T) {
	release := make(chan struct{})
	holding := make(chan struct{}, 2)
	h := fileHandler()
	files := h.handle
	h.handle = func(ctx context.Context, p *ipc.Peer, kind ipc.Kind, body *ipc.Decoder) (any, error, bool) {
		var m ipc.CreateMR
		if kind == ipc.KindCreateMR && body.Decode(&m) == nil && m.Addr == 0x401d {
			holding <- struct{}{}
			<-release // hold the request and its files
			return nil, nil, true
		}
		return files(ctx, p, kind, body)
	}
	s := startServer(t, h, withHello, func(c *ipc.ServerConfig) {
		c.Limits.MaxFilesPerMessage = 2
		c.Limits.MaxFilesPerPeer = 3
	})
	c := dial(t, s.path, ipc.ClientConfig{})
	r, w := pipe(t)
	call := func(addr uint64, n int) error {
		fs := make([]*os.File, n)
		for i := range fs {
			fs[i] = w
		}
		return c.Call(ctxBound(t), ipc.KindCreateMR, ipc.WithFiles{Body: &ipc.CreateMR{Addr: addr}, Files: fs}, nil)
	}

	require.NoError(t, call(0xf11e, 1), "a request with a descriptor before the hello is served...")
	assert.EqualValues(t, 1, s.Stats().RefusedFiles, "...without its descriptor")
	assert.Contains(t, s.log.String(), "before the hello")
	hello(t, c)
	callWithFiles(t, c)
	err := call(0xf11e, 3)
	assert.ErrorIs(t, err, ipc.ErrLimit, "3 descriptors in one message")
	assert.ErrorContains(t, err, "at most 2")

	// A request in its handler holds 2 descriptors; another with 2 would
	// make 4, over the peer's 3.
	done := make(chan error, 1)
	go func() { done <- call(0x401d, 2) }()
	waitFor(t, holding, "the first request in its handler")
	err = call(0x401d, 2)
	assert.ErrorIs(t, err, ipc.ErrLimit, "descriptors held by the peer")
	assert.ErrorContains(t, err, "held")
	close(release)
	require.NoError(t, <-done)
	require.NoError(t, call(0x1000, 2), "room again once the request is done")
	require.NoError(t, c.Err())

	require.NoError(t, w.Close())
	assert.Equal(t, "", readAll(t, r), "no handler wrote into the file, and the server closed every copy")
	st := s.Stats()
	assert.EqualValues(t, 2, st.RefusedFiles)
	assert.EqualValues(t, 1, st.RefusedFilesInFlight)
}

// A process that sends requests with descriptors as fast as it can and
// never reads its replies cannot make the server hold more than its
// limits allow: before its hello none at all, after it MaxFilesPerPeer.
func TestDescriptorFloodIsBounded(t *testing.T) {
	for _, tc := range []struct {
		mode string
		most int // descriptors the server may hold for the flood
	}{
		{"files", 0},
		{"hello-files", ipc.DefaultMaxFilesPerPeer},
	} {
		t.Run(tc.mode, func(t *testing.T) {
			s := startServer(t, quietHandler{newHandler()}, withHello, func(c *ipc.ServerConfig) {
				c.WriteTimeout = 200 * time.Millisecond
			})
			base := testenv.OpenFDs()
			h := testproc.Start(t, "flood", []string{s.path, strconv.Itoa(os.Geteuid()), tc.mode, "5000"})
			h.Expect("ready", 0)
			// Its peer, not only the connection: the peer's process is
			// pinned (a pidfd) before the peer is listed, and must count in
			// before.
			require.True(t, eventually(func() bool { return len(s.Peers()) == 1 }), "the server has the peer")
			before := testenv.OpenFDs()
			stop := make(chan struct{})
			peak := testenv.PeakFDs(stop)
			h.Send("go")
			line := h.Expect("sent ", 0)
			close(stop)
			most := <-peak
			// One message's descriptors are open between its receipt and
			// the check that refuses them.
			t.Logf("%s; descriptors of the server: %d before, at most %d during the flood", line, before, most)
			assert.LessOrEqual(t, most, before+tc.most+ipc.MaxFiles)
			require.True(t, eventually(func() bool { st := s.Stats(); return st.QueueOverflows+st.WriteTimeouts == 1 && st.Conns == 0 }),
				"the flooding connection is dropped: %+v", s.Stats())
			h.CloseInput()
			require.NoError(t, h.Wait(0))
			before = base
			st := s.Stats()
			t.Logf("%+v", st)
			assert.NotZero(t, st.RefusedFiles+st.RefusedFilesInFlight)
			assert.True(t, eventually(func() bool { return testenv.OpenFDs() <= before }), "descriptors: %d before, %d after", before, testenv.OpenFDs())
		})
	}
}

// Requests beyond the running and the queued are not waited for: the
// connection is dropped (before the hello, far fewer are allowed).
func TestQueueLimit(t *testing.T) {
	for _, tc := range []struct {
		name  string
		hello bool
		calls int // the one that overflows
	}{
		{"admitted", true, 1 + 3 + 1},
		{"before hello", false, 1 + 4 + 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := startServer(t, quietHandler{newHandler()}, withHello, func(c *ipc.ServerConfig) {
				c.MaxInflightPerConn = 1
				c.Limits.MaxQueued = 3
			})
			c := dial(t, s.path, ipc.ClientConfig{})
			if tc.hello {
				hello(t, c)
			}
			errs := make(chan error, tc.calls)
			for range tc.calls {
				go func() { errs <- c.Call(ctxBound(t), ipc.KindCreateMR, &ipc.CreateMR{Addr: blockAddr}, nil) }()
			}
			for range tc.calls {
				assert.ErrorIs(t, waitFor(t, errs, "a call's end"), ipc.ErrPeerGone)
			}
			assert.EqualValues(t, 1, s.Stats().QueueOverflows)
			assert.Contains(t, s.log.String(), "queued")
		})
	}
}

// A client that does not read its replies is dropped once a reply has
// waited WriteTimeout, which frees the handlers.
func TestSlowReaderIsDropped(t *testing.T) {
	h := newHandler()
	h.handle = func(ctx context.Context, p *ipc.Peer, kind ipc.Kind, body *ipc.Decoder) (any, error, bool) {
		if kind != ipc.KindStats {
			return nil, nil, false
		}
		// Replies of 60 KiB: a few fill the socket's buffer.
		r := &ipc.StatsReply{Counters: map[string]uint64{}}
		for i := range 2000 {
			r.Counters[fmt.Sprintf("counter-%020d", i)] = uint64(i)
		}
		return r, nil, true
	}
	s := startServer(t, quietHandler{h}, func(c *ipc.ServerConfig) { c.WriteTimeout = 50 * time.Millisecond })
	c, err := sock.Dial(ctxBound(t), s.path)
	require.NoError(t, err)
	defer c.Close()
	b, err := ipc.AppendFrame(nil, 1, ipc.KindStats, 0, &ipc.StatsRequest{})
	require.NoError(t, err)
	for range 40 { // more replies than the socket queues
		require.NoError(t, c.Send(b, nil))
	}
	require.True(t, eventually(func() bool { st := s.Stats(); return st.WriteTimeouts == 1 && st.Conns == 0 }),
		"the connection is dropped: %+v", s.Stats())
	assert.Contains(t, s.log.String(), "not reading")
}

// threadsInPoll counts this process's threads blocked in ppoll, where a
// frame waits for room on a call lane.
func threadsInPoll() int { return testenv.ThreadsInSyscall(unix.SYS_PPOLL) }

// A peer that asks on its call lane and never reads the answers keeps
// the server's handlers waiting for room until the write timeout, but
// not a thread each: frames that wait for room on one lane wait their
// turn parked, and one thread at a time waits in the kernel (the limit
// on threads of a Go program is fatal, and a peer can have
// MaxInflightPerConn answers waiting on each of its connections).
// The one that waits is still dropped after WriteTimeout.
func TestLaneWritesThatWaitHoldNoThreadEach(t *testing.T) {
	const inflight = 64
	base := threadsInPoll()
	s, _ := bigAnswersOnALane(t, inflight, 2*time.Second)
	most := 0
	for s.Stats().WriteTimeouts == 0 {
		most = max(most, threadsInPoll())
		if most > base+inflight/2 {
			break
		}
		time.Sleep(time.Millisecond)
	}
	t.Logf("threads in ppoll: %d before, at most %d while %d answers waited", base, most, inflight)
	assert.LessOrEqual(t, most, base+2, "threads blocked for answers that wait for room")
	require.True(t, eventually(func() bool { st := s.Stats(); return st.WriteTimeouts == 1 && st.Conns == 0 }),
		"the peer that does not read is dropped: %+v", s.Stats())
}

// A peer that reads its lane slowly but steadily, one answer every quarter
// of the write timeout while the rest wait for room, is a peer that
// reads: it is not dropped. (A unix socket reports room to poll only once
// three quarters of what waits has been read, while a frame fits as soon
// as one has: the waiting answer must try again rather than trust poll.)
// The pauses between reads are the slowness under test.
func TestSteadySlowReaderIsNotDropped(t *testing.T) {
	const n = 12
	const wt = time.Second
	s, lane := bigAnswersOnALane(t, n, wt)
	buf := make([]byte, ipc.MaxMessage)
	got := 0
	for got < n {
		time.Sleep(wt / 4)
		if _, _, err := lane.Recv(buf, time.Now().Add(wt)); err != nil {
			t.Logf("after %d answers: %v; stats %+v", got, err, s.Stats())
			break
		}
		got++
	}
	assert.Equal(t, n, got, "answers taken by a peer reading one every %v", wt/4)
	assert.Zero(t, s.Stats().WriteTimeouts, "dropped as a slow reader while it read")
}

// bigAnswersOnALane starts a server whose stats answers are 60 KiB (a
// few fill a lane) and that runs n requests of a peer at once, with the
// write timeout wt; it asks n stats of it on a bare lane, reads nothing,
// and returns once every request has been handled.
func bigAnswersOnALane(t *testing.T, n int, wt time.Duration) (*testServer, *sock.Blocking) {
	t.Helper()
	var answered atomic.Int32
	h := newHandler()
	h.handle = func(ctx context.Context, p *ipc.Peer, kind ipc.Kind, body *ipc.Decoder) (any, error, bool) {
		if kind != ipc.KindStats {
			return nil, nil, false
		}
		answered.Add(1)
		return bigStats(), nil, true
	}
	s := startServer(t, quietHandler{h}, withHello, func(c *ipc.ServerConfig) {
		c.WriteTimeout = wt
		c.MaxInflightPerConn = n
	})
	_, lane := rawLane(t, s)
	b, err := ipc.AppendFrame(nil, 1, ipc.KindStats, 0, &ipc.StatsRequest{})
	require.NoError(t, err)
	for range n {
		require.NoError(t, lane.Send(b, nil, time.Now().Add(bound)))
	}
	require.True(t, eventually(func() bool { return answered.Load() == int32(n) }), "every request is handled")
	return s, lane
}

// A connection refused for a limit tells its client why, and that reason
// is what a call on it then gets, even a call whose time ran out before it
// was made (an Attach that spent its time elsewhere would otherwise say
// only "deadline exceeded", and not that it may try again).
func TestACallOnARefusedConnectionSaysWhyPastItsDeadline(t *testing.T) {
	path := openSocketPath(t)
	startServerOn(t, listen(t, path), quietHandler{newHandler()}, withHello, func(c *ipc.ServerConfig) {
		c.Limits = ipc.Limits{MaxConnsPerUID: 1, HelloTimeout: time.Hour}
	})
	hello(t, dial(t, path, ipc.ClientConfig{}))
	c := dial(t, path, ipc.ClientConfig{})
	select {
	case <-c.Done():
	case <-time.After(bound):
		t.Fatal("the second connection of the user was not refused")
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	err := c.Call(ctx, ipc.KindHello, &ipc.Hello{ABI: ipc.ABI, PID: os.Getpid(), UID: os.Getuid(), Role: "secondary"}, &ipc.HelloReply{})
	require.ErrorIs(t, err, ipc.ErrLimit)
}

// The same once the client has its call lane (after the hello), where
// calls take another path: a connection the server ended answers a call
// whose time ran out, or that has none, with why it ended.
func TestALaneCallOnAnEndedConnectionSaysWhyPastItsDeadline(t *testing.T) {
	s := startServer(t, newHandler(), withHello)
	c := dial(t, s.path, ipc.ClientConfig{})
	hello(t, c)
	require.True(t, ipc.HasLane(c))
	for _, p := range s.Peers() {
		p.Close()
	}
	select {
	case <-c.Done():
	case <-time.After(bound):
		t.Fatal("the connection did not end")
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	require.ErrorIs(t, c.Call(ctx, ipc.KindStats, &ipc.StatsRequest{}, &ipc.StatsReply{}), ipc.ErrPeerGone)
	require.ErrorIs(t, c.CallTimeout(0, ipc.KindStats, &ipc.StatsRequest{}, &ipc.StatsReply{}), ipc.ErrPeerGone)
}
