package ipc_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/ipc"
)

func TestMain(m *testing.M) { testproc.Main(m) }

// bound is the most any single wait in these tests may take.
const bound = 10 * time.Second

// dialHello connects to the server at path and says hello, as a
// secondary does.
func dialHello(ctx context.Context, path string) (*ipc.Client, error) {
	return dialHelloWith(ctx, path, ipc.ClientConfig{Logger: quiet})
}

// dialHelloWith is dialHello with the client's configuration.
func dialHelloWith(ctx context.Context, path string, cfg ipc.ClientConfig) (*ipc.Client, error) {
	c, err := ipc.DialClient(ctx, path, cfg)
	if err != nil {
		return nil, err
	}
	if err := c.Call(ctx, ipc.KindHello, &ipc.Hello{ABI: ipc.ABI, PID: os.Getpid(), UID: os.Getuid(), Role: "secondary"}, &ipc.HelloReply{}); err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}

// errNotMapped stands for a runtime's sentinel error travelling back.
var errNotMapped = errors.New("test: address not in any memory")

func init() { ipc.RegisterError("test.not-mapped", errNotMapped) }

// logBuffer collects log output for checks; safe for concurrent use.
type logBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *logBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *logBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

func (l *logBuffer) logger() *slog.Logger {
	return slog.New(slog.NewTextHandler(l, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

var quiet = slog.New(slog.DiscardHandler)

// handler is the server side of the tests: it answers every request kind
// the way a primary would, with values the tests can check, and reports
// connects and disconnects on channels. handle, when set, serves first;
// it returns handled=false to fall back to the default.
type handler struct {
	connected    chan *ipc.Peer
	disconnected chan disconnect
	handle       func(ctx context.Context, p *ipc.Peer, kind ipc.Kind, body *ipc.Decoder) (reply any, err error, handled bool)
}

type disconnect struct {
	peer *ipc.Peer
	err  error
}

func newHandler() *handler {
	return &handler{connected: make(chan *ipc.Peer, 64), disconnected: make(chan disconnect, 64)}
}

func (h *handler) Connected(p *ipc.Peer) { h.connected <- p }

func (h *handler) Disconnected(p *ipc.Peer, err error) { h.disconnected <- disconnect{p, err} }

func (h *handler) Handle(ctx context.Context, p *ipc.Peer, kind ipc.Kind, body *ipc.Decoder) (any, error) {
	if h.handle != nil {
		if reply, err, ok := h.handle(ctx, p, kind, body); ok {
			return reply, err
		}
	}
	return serve(ctx, kind, body)
}

// serve answers each kind with values derived from the request. The same
// logic runs in the helper server process.
func serve(ctx context.Context, kind ipc.Kind, body *ipc.Decoder) (any, error) {
	switch kind {
	case ipc.KindHello:
		var m ipc.Hello
		if err := body.Decode(&m); err != nil {
			return nil, err
		}
		return &ipc.HelloReply{Slot: m.PID % 7, Segment: "/dev/shm/seg", LockFile: "/dev/shm/seg.lock",
			LayoutTag: 9, Backend: "tmpfs", PageSize: 4096, PrimaryPID: os.Getpid()}, nil
	case ipc.KindCreateMR:
		var m ipc.CreateMR
		if err := body.Decode(&m); err != nil {
			return nil, err
		}
		switch m.Addr {
		case 0:
			return nil, fmt.Errorf("create MR for 0x0: %w", errNotMapped)
		case blockAddr: // answer only when the peer goes
			<-ctx.Done()
			return nil, ctx.Err()
		}
		start := m.Addr &^ 0xfff
		return &ipc.CreateMRReply{Start: start, End: start + 0x1000, LKey: uint32(m.Addr >> 12)}, nil
	case ipc.KindRegisterMempool:
		var m ipc.RegisterMempool
		if err := body.Decode(&m); err != nil {
			return nil, err
		}
		keys := make([]uint32, len(m.Chunks))
		for i, c := range m.Chunks {
			keys[i] = uint32(c.Addr >> 12)
		}
		return &ipc.RegisterMempoolReply{Keys: keys}, nil
	case ipc.KindStats:
		var m ipc.StatsRequest
		if err := body.Decode(&m); err != nil {
			return nil, err
		}
		return &ipc.StatsReply{PID: os.Getpid(), Secondaries: 1, Counters: map[string]uint64{"creates": 3}}, nil
	case ipc.KindDetach:
		var m ipc.Detach
		if err := body.Decode(&m); err != nil {
			return nil, err
		}
		return &ipc.DetachReply{}, nil
	}
	return nil, fmt.Errorf("no handler for %s", kind)
}

// blockAddr makes the serving side hold the request until the peer goes.
const blockAddr = 0xb10c_0000

// testServer is a running server on a fresh socket.
type testServer struct {
	*ipc.Server
	path string
	h    *handler
	log  *logBuffer
}

type serverOpt func(*ipc.ServerConfig)

func startServer(t testing.TB, h ipc.Handler, opts ...serverOpt) *testServer {
	t.Helper()
	path := filepath.Join(t.TempDir(), "rt", ipc.SocketName)
	l, err := ipc.Listen(path)
	require.NoError(t, err)
	return startServerOn(t, l, h, opts...)
}

func startServerOn(t testing.TB, l *ipc.Listener, h ipc.Handler, opts ...serverOpt) *testServer {
	t.Helper()
	th, _ := h.(*handler)
	if q, ok := h.(quietHandler); ok {
		th = q.handler
	}
	lb := &logBuffer{}
	cfg := ipc.ServerConfig{Listener: l, Handler: h, Logger: lb.logger()}
	for _, o := range opts {
		o(&cfg)
	}
	s, err := ipc.NewServer(cfg)
	require.NoError(t, err)
	served := make(chan error, 1)
	go func() { served <- s.Serve(context.Background()) }()
	t.Cleanup(func() {
		require.NoError(t, s.Close())
		select {
		case err := <-served:
			require.NoError(t, err)
		case <-time.After(bound):
			t.Error("Serve did not return after Close")
		}
	})
	return &testServer{Server: s, path: l.Path(), h: th, log: lb}
}

func dial(t testing.TB, path string, cfg ipc.ClientConfig) *ipc.Client {
	t.Helper()
	if cfg.Logger == nil {
		cfg.Logger = quiet
	}
	ctx, cancel := context.WithTimeout(context.Background(), bound)
	defer cancel()
	c, err := ipc.DialClient(ctx, path, cfg)
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() })
	return c
}

// syncAckingPeer starts a server and dials it with a client that
// acknowledges memory syncs, and returns the server's peer for it.
func syncAckingPeer(t testing.TB) *ipc.Peer {
	t.Helper()
	s := startServer(t, newHandler())
	push := ipc.PushHandlerFunc(func(ctx context.Context, kind ipc.Kind, body *ipc.Decoder) (any, error) {
		var m ipc.Sync
		return &ipc.SyncAck{}, body.Decode(&m)
	})
	dial(t, s.path, ipc.ClientConfig{PushHandler: push})
	return waitFor(t, s.h.connected, "Connected")
}

func ctxBound(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), bound)
	t.Cleanup(cancel)
	return ctx
}

// waitFor receives from ch within bound.
func waitFor[T any](t testing.TB, ch <-chan T, what string) T {
	t.Helper()
	return testenv.Receive(t, ch, bound, what)
}

// quietHandler is handler without the connect and disconnect reports,
// which a flood would fill.
type quietHandler struct{ *handler }

func (quietHandler) Connected(*ipc.Peer)           {}
func (quietHandler) Disconnected(*ipc.Peer, error) {}

// eventually polls cond until it holds or bound passes, and reports
// whether it held.
func eventually(cond func() bool) bool {
	deadline := time.Now().Add(bound)
	for !cond() {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(time.Millisecond)
	}
	return true
}
