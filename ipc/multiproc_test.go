package ipc_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/ipc"
)

func init() {
	testproc.Register("serve", helperServe)
	testproc.Register("client", helperClient)
	testproc.Register("dial-as", helperDialAs)
}

func waitForEOF() {
	in := testproc.Commands()
	for in.Scan() {
	}
}

// procHandler is the helper server's handler: serve, files, and a line
// for each request that blocks, so the test knows it is in flight.
type procHandler struct{}

func (procHandler) Connected(*ipc.Peer)           {}
func (procHandler) Disconnected(*ipc.Peer, error) {}

func (procHandler) Handle(ctx context.Context, p *ipc.Peer, kind ipc.Kind, body *ipc.Decoder) (any, error) {
	if reply, err, ok := serveFiles(kind, body); ok {
		return reply, err
	}
	var m ipc.CreateMR
	if kind == ipc.KindCreateMR && body.Decode(&m) == nil && m.Addr == blockAddr {
		testproc.Say("blocked")
	}
	return serve(ctx, kind, body)
}

// helperServe serves args[0] until its input ends. args[1], when given,
// is ServerConfig.Spin; args[2] "inline" answers create requests inline.
func helperServe(args []string) int {
	l, err := ipc.Listen(args[0])
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 3
	}
	var spin time.Duration
	if len(args) > 1 {
		spin, _ = time.ParseDuration(args[1])
	}
	cfg := ipc.ServerConfig{Listener: l, Handler: procHandler{}, Logger: quiet, Spin: spin}
	if len(args) > 2 && args[2] == "inline" {
		cfg.Inline = []ipc.Kind{ipc.KindCreateMR}
	}
	s, err := ipc.NewServer(cfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 3
	}
	go s.Serve(context.Background())
	testproc.Say("ready")
	waitForEOF()
	s.Close()
	return 0
}

// helperClient attaches to args[0] and acknowledges syncs; a resync blocks
// until the connection ends, like a stuck secondary.
func helperClient(args []string) int {
	push := ipc.PushHandlerFunc(func(ctx context.Context, kind ipc.Kind, body *ipc.Decoder) (any, error) {
		var m ipc.Sync
		if err := body.Decode(&m); err != nil {
			return nil, err
		}
		if m.Op == ipc.SyncResync {
			testproc.Say("resync")
			<-ctx.Done()
			return nil, ctx.Err()
		}
		return &ipc.SyncAck{}, nil
	})
	ctx, cancel := context.WithTimeout(context.Background(), bound)
	defer cancel()
	c, err := ipc.DialClient(ctx, args[0], ipc.ClientConfig{PushHandler: push, Logger: quiet})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 3
	}
	if err := c.Call(ctx, ipc.KindHello, &ipc.Hello{ABI: ipc.ABI, PID: os.Getpid(), UID: os.Getuid(), Role: "secondary"}, &ipc.HelloReply{}); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 3
	}
	testproc.Say("ready")
	waitForEOF()
	return 0
}

// helperDialAs becomes user args[1] and connects to args[0]. With args[2]
// "wait" it sends nothing and reports how the connection ended; with
// "call" it reports the result of a call.
func helperDialAs(args []string) int {
	uid, _ := strconv.Atoi(args[1])
	if err := testenv.BecomeUser(uid); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 3
	}
	ctx, cancel := context.WithTimeout(context.Background(), bound)
	defer cancel()
	c, err := ipc.DialClient(ctx, args[0], ipc.ClientConfig{Logger: quiet})
	if err != nil {
		testproc.Say("result dial %v", err)
		return 0
	}
	defer c.Close()
	switch args[2] {
	case "wait":
		select {
		case <-c.Done():
		case <-ctx.Done():
		}
		err = c.Err()
	case "call":
		err = c.Call(ctx, ipc.KindHello, &ipc.Hello{ABI: ipc.ABI, PID: os.Getpid(), UID: os.Getuid(), Role: "secondary"}, &ipc.HelloReply{})
	}
	testproc.Say("result uid=%d refused=%t gone=%t err=%v", os.Getuid(),
		errors.Is(err, ipc.ErrRefused), errors.Is(err, ipc.ErrPeerGone), err)
	return 0
}

func TestServerDeathFailsCallsAtOnce(t *testing.T) {
	path := filepath.Join(t.TempDir(), ipc.SocketName)
	srv := testproc.Start(t, "serve", []string{path})
	srv.Expect("ready", 0)
	c := dial(t, path, ipc.ClientConfig{})
	cred, err := c.ServerCred()
	require.NoError(t, err)
	require.Equal(t, srv.PID(), cred.PID)

	var r ipc.CreateMRReply
	require.NoError(t, c.Call(ctxBound(t), ipc.KindCreateMR, &ipc.CreateMR{Addr: 0x4000}, &r))
	require.Equal(t, uint32(4), r.LKey, "answered by the other process")

	const pending = 4
	type result struct {
		err error
		at  time.Time
	}
	results := make(chan result, pending)
	for range pending {
		go func() {
			ctx, cancel := context.WithTimeout(context.Background(), bound)
			defer cancel()
			err := c.Call(ctx, ipc.KindCreateMR, &ipc.CreateMR{Addr: blockAddr}, nil)
			results <- result{err, time.Now()}
		}()
	}
	for range pending {
		srv.Expect("blocked", 0)
	}

	killed := time.Now()
	srv.Kill()
	var worst time.Duration
	for range pending {
		res := waitFor(t, results, "a pending call's end")
		assert.ErrorIs(t, res.err, ipc.ErrPeerGone, "not a timeout: the call ends with the server")
		worst = max(worst, res.at.Sub(killed))
	}
	t.Logf("%d pending calls failed at most %v after SIGKILL of the server (their context allowed %v)", pending, worst, bound)
	waitFor(t, c.Done(), "the client's end")

	start := time.Now()
	assert.ErrorIs(t, c.Call(ctxBound(t), ipc.KindDetach, &ipc.Detach{}, nil), ipc.ErrPeerGone)
	t.Logf("a later call failed in %v", time.Since(start))

	// The dead server left its socket file; a new server takes the path
	// once the process is gone for good (its descriptors close at exit).
	require.Error(t, srv.Wait(0))
	_, err = os.Lstat(path)
	require.NoError(t, err, "a killed server cannot remove its socket")
	s := startServerOn(t, listen(t, path), newHandler())
	assert.NoError(t, dial(t, s.path, ipc.ClientConfig{}).Call(ctxBound(t), ipc.KindDetach, &ipc.Detach{}, nil))
}

func TestClientDeathEndsItsPushesAndDisconnects(t *testing.T) {
	s := startServer(t, newHandler())
	cl := testproc.Start(t, "client", []string{s.path})
	cl.Expect("ready", 0)
	p := waitFor(t, s.h.connected, "Connected")
	assert.Equal(t, cl.PID(), p.PID())

	require.NoError(t, p.Push(ctxBound(t), ipc.KindSync, &ipc.Sync{Op: ipc.SyncMap, List: 0, First: 2, Count: 3}, &ipc.SyncAck{}),
		"the other process acknowledges")

	pushed := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), bound)
		defer cancel()
		pushed <- p.Push(ctx, ipc.KindSync, &ipc.Sync{Op: ipc.SyncResync}, &ipc.SyncAck{})
	}()
	cl.Expect("resync", 0)
	killed := time.Now()
	cl.Kill()
	err := waitFor(t, pushed, "the pending push's end")
	assert.ErrorIs(t, err, ipc.ErrPeerGone)
	t.Logf("the pending push failed %v after SIGKILL of the client", time.Since(killed))

	d := waitFor(t, s.h.disconnected, "Disconnected")
	assert.Same(t, p, d.peer)
	assert.ErrorIs(t, d.err, ipc.ErrPeerGone)
	assert.Error(t, p.Context().Err())
	assert.ErrorIs(t, p.Push(ctxBound(t), ipc.KindSync, &ipc.Sync{Op: ipc.SyncResync}, nil), ipc.ErrPeerGone)
	assert.Empty(t, s.Peers())
}

// A directory and socket anyone may use, so that only the server's
// credentials check stands between another user and the server.
func openSocketPath(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "mpmr-ipc-uid-")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(dir) })
	require.NoError(t, os.Chmod(dir, 0o755))
	return filepath.Join(dir, ipc.SocketName)
}

func TestOtherUserIsRefused(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: the helper switches to uid 65534 with setuid")
	}
	const nobody = 65534

	t.Run("refused by credentials", func(t *testing.T) {
		path := openSocketPath(t)
		s := startServerOn(t, listen(t, path), newHandler())
		require.NoError(t, os.Chmod(path, 0o666), "file permissions let anyone connect")

		h := testproc.Start(t, "dial-as", []string{path, strconv.Itoa(nobody), "wait"})
		line := h.Expect("result ", 0)
		assert.Contains(t, line, "uid=65534 ")
		assert.Contains(t, line, "refused=true gone=true", "the client learns why: %s", line)
		assert.Contains(t, s.log.String(), "refused a connection by credentials")
		assert.Contains(t, s.log.String(), "uid=65534")
		assert.Empty(t, s.h.connected, "the handler never saw the refused peer")

		c := dial(t, path, ipc.ClientConfig{})
		assert.NoError(t, c.Call(ctxBound(t), ipc.KindDetach, &ipc.Detach{}, nil), "root is still served")
	})
	t.Run("a refused caller's request fails with the reason", func(t *testing.T) {
		path := openSocketPath(t)
		startServerOn(t, listen(t, path), newHandler())
		require.NoError(t, os.Chmod(path, 0o666))
		h := testproc.Start(t, "dial-as", []string{path, strconv.Itoa(nobody), "call"})
		line := h.Expect("result ", 0)
		// The request was already queued when the refusal went out: the
		// server drains it before closing, so the reason is not lost to a
		// connection reset.
		assert.Contains(t, line, "refused=true gone=true", "%s", line)
	})
	t.Run("allowed by the list", func(t *testing.T) {
		path := openSocketPath(t)
		s := startServerOn(t, listen(t, path), newHandler(), func(c *ipc.ServerConfig) { c.AllowUIDs = []int{nobody} })
		require.NoError(t, os.Chmod(path, 0o666))
		h := testproc.Start(t, "dial-as", []string{path, strconv.Itoa(nobody), "call"})
		line := h.Expect("result ", 0)
		assert.Contains(t, line, "err=<nil>", "%s", line)
		p := waitFor(t, s.h.connected, "Connected")
		assert.Equal(t, nobody, p.UID())
	})
}

func TestFilesAcrossProcesses(t *testing.T) {
	path := filepath.Join(t.TempDir(), ipc.SocketName)
	srv := testproc.Start(t, "serve", []string{path})
	srv.Expect("ready", 0)
	callWithFiles(t, dial(t, path, ipc.ClientConfig{}))
}

// Two client processes and this one, many goroutines each, one server.
func TestManyClientsOfOneServer(t *testing.T) {
	s := startServer(t, newHandler())
	var procs []*testproc.Proc
	for range 2 {
		p := testproc.Start(t, "client", []string{s.path})
		p.Expect("ready", 0)
		procs = append(procs, p)
	}
	peers := map[int]*ipc.Peer{}
	for range procs {
		p := waitFor(t, s.h.connected, "Connected")
		peers[p.PID()] = p
	}
	c := dial(t, s.path, ipc.ClientConfig{})
	ctx := ctxBound(t)
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			for i := range 16 {
				addr := uint64(g*16+i+1) << 12
				var r ipc.CreateMRReply
				if assert.NoError(t, c.Call(ctx, ipc.KindCreateMR, &ipc.CreateMR{Addr: addr}, &r)) {
					assert.Equal(t, uint32(addr>>12), r.LKey)
				}
			}
		})
	}
	for _, p := range peers {
		wg.Go(func() {
			for i := range 16 {
				assert.NoError(t, p.Push(ctx, ipc.KindSync, &ipc.Sync{Op: ipc.SyncMap, First: i, Count: 1}, &ipc.SyncAck{}))
			}
		})
	}
	wg.Wait()
	pids := []string{}
	for _, p := range s.Peers() {
		pids = append(pids, strconv.Itoa(p.PID()))
	}
	assert.Len(t, pids, 3, strings.Join(pids, " "))
}
