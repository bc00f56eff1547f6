package ipc_test

import (
	"context"
	"errors"
	"math/rand/v2"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/ipc"
)

// raceHandler answers hellos around the moment the peer's hello deadline
// runs out (from 400 µs before to 100 µs after), and records which peers' hellos
// it accepted and why each connection ended.
type raceHandler struct {
	timeout time.Duration
	mu      sync.Mutex
	at      map[*ipc.Peer]time.Time     // when Connected saw it: its hello timer started just before
	ok      map[*ipc.Peer]bool          // its hello was accepted
	delta   map[*ipc.Peer]time.Duration // its handler's end, from its deadline
	hits    []time.Duration             // the delta of each one dropped after acceptance
	dropped atomic.Int64                // accepted, then closed for an overdue hello
	done    chan struct{}
}

func (h *raceHandler) Connected(p *ipc.Peer) {
	h.mu.Lock()
	h.at[p] = time.Now()
	h.mu.Unlock()
}

func (h *raceHandler) Disconnected(p *ipc.Peer, err error) {
	h.mu.Lock()
	ok := h.ok[p]
	delete(h.ok, p)
	delete(h.at, p)
	h.mu.Unlock()
	if ok && errors.Is(err, ipc.ErrLimit) {
		h.dropped.Add(1)
		h.mu.Lock()
		h.hits = append(h.hits, h.delta[p])
		h.mu.Unlock()
	}
	h.done <- struct{}{}
}

func (h *raceHandler) Handle(ctx context.Context, p *ipc.Peer, kind ipc.Kind, body *ipc.Decoder) (any, error) {
	var m ipc.Hello
	if err := body.Decode(&m); err != nil {
		return nil, err
	}
	h.mu.Lock()
	d := time.Duration(rand.IntN(500)-400) * time.Microsecond
	h.delta[p] = d
	until := h.at[p].Add(h.timeout + d)
	h.mu.Unlock()
	for time.Now().Before(until) { // spin: a sleep is far coarser than the window
	}
	h.mu.Lock()
	h.ok[p] = true
	h.mu.Unlock()
	return &ipc.HelloReply{Slot: 1}, nil
}

// "A hello still in its handler when the time is up is waited for"
// (Limits.HelloTimeout), and a hello that its handler accepts admits the
// peer. But the handler's end and the admission are two steps: the
// handle path uncounts the running hello (releaseFiles) and only then
// admits the peer (admit). A hello timer that fires between the two sees
// no hello running and a peer not admitted, and closes the connection for
// an overdue hello, after the handler accepted it. In the primary the
// handler has by then put the secondary in its sync set, so the
// disconnect fences a secondary that did everything right, and its Attach
// fails with "no hello within 5s".
//
// The window is a few instructions wide; 6,000 hellos answered around
// their deadline, with the garbage collector stopping the world all along,
// hit it 1 to 9 times in each of six runs here (about 9 s; 19 s with
// -race).
func TestBreakerHelloAcceptedAtItsDeadlineIsDropped(t *testing.T) {
	const timeout = time.Millisecond
	h := &raceHandler{timeout: timeout, at: map[*ipc.Peer]time.Time{}, ok: map[*ipc.Peer]bool{},
		delta: map[*ipc.Peer]time.Duration{}, done: make(chan struct{}, 1)}
	s := startServer(t, h, withHello, func(c *ipc.ServerConfig) { c.Limits.HelloTimeout = timeout })
	trials, lost := 6000, 0
	// Stop-the-world pauses stop the handling goroutine wherever it is,
	// between two of its steps too, and let the timer's goroutine overtake
	// it: they widen the window that a busy machine opens now and then.
	stopGC := make(chan struct{})
	defer close(stopGC)
	go func() {
		for {
			select {
			case <-stopGC:
				return
			default:
				runtime.GC()
			}
		}
	}()
	for range trials {
		ctx, cancel := context.WithTimeout(context.Background(), bound)
		c, err := ipc.DialClient(ctx, s.path, ipc.ClientConfig{Logger: quiet})
		require.NoError(t, err)
		err = c.Call(ctx, ipc.KindHello, &ipc.Hello{ABI: ipc.ABI, PID: 1, Role: "secondary"}, &ipc.HelloReply{})
		if errors.Is(err, ipc.ErrLimit) {
			lost++
		}
		c.Close()
		cancel()
		waitFor(t, h.done, "the end of the connection")
	}
	t.Logf("%d hellos answered at their deadline: %d accepted by the handler and then dropped as overdue, "+
		"%d calls failed with ErrLimit", trials, h.dropped.Load(), lost)
	t.Logf("accepted and dropped with the handler's end at deadline%+v", h.hits)
	assert.Zero(t, h.dropped.Load(), "peers whose hello the handler accepted were closed for an overdue hello")
}

// refusingHello refuses every hello, after a little work.
type refusingHello struct{ work time.Duration }

func (refusingHello) Connected(*ipc.Peer)           {}
func (refusingHello) Disconnected(*ipc.Peer, error) {}
func (h refusingHello) Handle(ctx context.Context, p *ipc.Peer, kind ipc.Kind, body *ipc.Decoder) (any, error) {
	time.Sleep(h.work) // the handler's own work, not a wait for anything
	return nil, errors.New("not you")
}

// A peer that keeps several hellos in flight (one running, more queued),
// each refused, is closed once its time is up all the same: the hello
// that runs when the time is up is waited for, not every one the peer
// queues after it.
func TestPipelinedRefusedHellosDoNotOutliveTheHelloTimeout(t *testing.T) {
	const timeout = 100 * time.Millisecond
	s := startServer(t, refusingHello{work: time.Millisecond}, withHello,
		func(c *ipc.ServerConfig) { c.Limits.HelloTimeout = timeout })
	c, err := ipc.DialClient(context.Background(), s.path, ipc.ClientConfig{Logger: quiet})
	require.NoError(t, err)
	defer c.Close()
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			for {
				err := c.Call(context.Background(), ipc.KindHello, &ipc.Hello{ABI: ipc.ABI, PID: 1, Role: "secondary"}, &ipc.HelloReply{})
				if err == nil || !strings.Contains(err.Error(), "not you") {
					return
				}
			}
		})
	}
	select {
	case <-c.Done():
	case <-time.After(50 * timeout):
		t.Errorf("a peer with refused hellos in flight is still connected %v after its hello timeout of %v; %+v",
			50*timeout, timeout, s.Stats())
		c.Close()
	}
	wg.Wait()
	assert.EqualValues(t, 1, s.Stats().HelloTimeouts)
}

// lateThenAccepting refuses a peer's first hello once its time is up, and
// accepts the next; it counts hellos its handler ran for a peer whose
// connection had already ended.
type lateThenAccepting struct {
	timeout time.Duration
	mu      sync.Mutex
	seen    map[*ipc.Peer]int
	onDead  atomic.Int64
	ended   chan struct{}
}

func (h *lateThenAccepting) Connected(*ipc.Peer)           {}
func (h *lateThenAccepting) Disconnected(*ipc.Peer, error) { h.ended <- struct{}{} }
func (h *lateThenAccepting) Handle(ctx context.Context, p *ipc.Peer, kind ipc.Kind, body *ipc.Decoder) (any, error) {
	if p.Err() != nil {
		h.onDead.Add(1)
	}
	h.mu.Lock()
	h.seen[p]++
	n := h.seen[p]
	h.mu.Unlock()
	if n == 1 {
		time.Sleep(2 * h.timeout) // past the hello timeout, then refused
		return nil, errors.New("not you")
	}
	return &ipc.HelloReply{Slot: 1}, nil
}

// The hello that runs when the time is up is refused, and the connection
// closes: a hello the peer queued behind it is not handled on the ended
// connection (in the primary it would put a peer that has gone in the
// sync set), whichever end notices the end first.
func TestHelloQueuedBehindALateRefusedOneIsNotHandled(t *testing.T) {
	const timeout = 2 * time.Millisecond
	h := &lateThenAccepting{timeout: timeout, seen: map[*ipc.Peer]int{}, ended: make(chan struct{}, 1)}
	s := startServer(t, h, withHello, func(c *ipc.ServerConfig) { c.Limits.HelloTimeout = timeout })
	for range 100 {
		c, err := ipc.DialClient(context.Background(), s.path, ipc.ClientConfig{Logger: quiet})
		require.NoError(t, err)
		var wg sync.WaitGroup
		for range 2 {
			wg.Go(func() {
				_ = c.Call(context.Background(), ipc.KindHello, &ipc.Hello{ABI: ipc.ABI, PID: 1, Role: "secondary"}, &ipc.HelloReply{})
				c.Close() // the client ends as soon as it has an answer, or the end
			})
		}
		wg.Wait()
		waitFor(t, h.ended, "the end of the connection")
	}
	assert.Zero(t, h.onDead.Load(), "hellos handled for a peer whose connection had ended")
}
