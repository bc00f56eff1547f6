package ipc_test

import (
	"context"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/ipc"
)

var errDetached = fmt.Errorf("%w: detached", ipc.ErrLimit)

// retiring is a handler whose detach retires the peer, as the primary's
// does.
func retiring() ipc.Handler {
	h := newHandler()
	h.handle = func(ctx context.Context, p *ipc.Peer, kind ipc.Kind, body *ipc.Decoder) (any, error, bool) {
		if kind == ipc.KindDetach {
			p.Retire(errDetached)
			return &ipc.DetachReply{}, nil, true
		}
		return nil, nil, false
	}
	return quietHandler{h}
}

// helloAndDetach dials path, says hello and detaches, keeping the
// connection open.
func helloAndDetach(t *testing.T, path string) *ipc.Client {
	t.Helper()
	c := dial(t, path, ipc.ClientConfig{})
	hello(t, c)
	require.NoError(t, c.Call(ctxBound(t), ipc.KindDetach, &ipc.Detach{}, &ipc.DetachReply{}))
	return c
}

// A retired connection (a secondary that detached and kept it open)
// counts as one without hello: it holds no cap in use (a client over the
// cap is told to try again, not that the cap is taken for good), and no
// hello admits it again.
func TestARetiredConnectionHoldsNoCapInUse(t *testing.T) {
	s, path := openServer(t, retiring(), ipc.Limits{MaxConnsPerUID: 2})
	cs := []*ipc.Client{helloAndDetach(t, path), helloAndDetach(t, path)}
	assert.Equal(t, 2, s.Stats().Unadmitted, "both count as connections without hello")

	over := dial(t, path, ipc.ClientConfig{})
	waitFor(t, over.Done(), "the refusal")
	assert.ErrorIs(t, over.Err(), ipc.ErrLimit)
	assert.NotErrorIs(t, over.Err(), ipc.ErrConnsInUse)

	err := cs[0].Call(ctxBound(t), ipc.KindHello, &ipc.Hello{ABI: ipc.ABI, PID: os.Getpid(), UID: os.Getuid(), Role: "secondary"}, &ipc.HelloReply{})
	assert.ErrorIs(t, err, ipc.ErrLimit, "a hello on a retired connection")
	assert.ErrorContains(t, err, "retired")
	assert.Equal(t, 2, s.Stats().Unadmitted, "and it still counts as one without hello")
}

// Over the total, a retired connection is shed to make room for a user
// holding fewer connections without hello, as one that never said hello
// is.
func TestARetiredConnectionIsShedForALighterUser(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: a helper switches to uid 65534 with setuid")
	}
	s, path := openServer(t, retiring(), ipc.Limits{MaxConns: 3, MaxConnsPerUID: 3}, nobody)
	var cs []*ipc.Client
	for range 3 {
		cs = append(cs, helloAndDetach(t, path))
	}
	h := floodAs(t, path, nobody, 1) // 0 against root's 3 retired
	require.True(t, eventually(func() bool { return s.Stats().ShedConns == 1 }), "%+v", s.Stats())
	waitFor(t, cs[0].Done(), "the end of root's oldest retired connection")
	assert.ErrorIs(t, cs[0].Err(), ipc.ErrLimit)
	assert.ErrorContains(t, cs[0].Err(), "to make room")
	closed, _ := floodEnded(t, h)
	assert.Zero(t, closed, "uid 65534's connection is served")
	assert.NoError(t, cs[1].Err())
	assert.NoError(t, cs[2].Err())
}

// A retired connection that its peer keeps open closes, told why, after
// the time a new connection has to say hello; counted and logged.
func TestARetiredConnectionCloses(t *testing.T) {
	s := startServer(t, retiring(), withHello, func(c *ipc.ServerConfig) { c.Limits.HelloTimeout = 200 * time.Millisecond })
	kept := dial(t, s.path, ipc.ClientConfig{})
	hello(t, kept)
	c := helloAndDetach(t, s.path)
	waitFor(t, c.Done(), "the end of the retired connection")
	assert.ErrorIs(t, c.Err(), ipc.ErrLimit)
	assert.ErrorContains(t, c.Err(), "detached")
	assert.NoError(t, kept.Err(), "a connection still admitted stays")
	assert.EqualValues(t, 1, s.Stats().HelloTimeouts, "counted with the overdue hellos")
	assert.Contains(t, s.log.String(), "closed a retired connection")
	assert.True(t, eventually(func() bool { return s.Stats().Conns == 1 }), "%+v", s.Stats())
}

// A reply wrapped in AndRetire retires the peer only once it is sent: a
// connection that comes over the total cap while the handler runs cannot
// shed the connection the answer is for, whose request then succeeds.
func TestARetireAfterTheAnswerIsNotShedBeforeIt(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: a helper switches to uid 65534 with setuid")
	}
	h := newHandler()
	entered, release := make(chan struct{}, 1), make(chan struct{})
	var holdNext atomic.Bool
	h.handle = func(ctx context.Context, p *ipc.Peer, kind ipc.Kind, body *ipc.Decoder) (any, error, bool) {
		if kind != ipc.KindDetach {
			return nil, nil, false
		}
		if holdNext.CompareAndSwap(true, false) {
			entered <- struct{}{}
			<-release
		}
		return ipc.AndRetire{Reply: &ipc.DetachReply{}, Why: errDetached}, nil, true
	}
	s, path := openServer(t, quietHandler{h}, ipc.Limits{MaxConns: 3, MaxConnsPerUID: 3}, nobody)
	var once sync.Once
	t.Cleanup(func() { once.Do(func() { close(release) }) })

	first := dial(t, path, ipc.ClientConfig{}) // root's oldest: its detach is held
	hello(t, first)
	for range 2 {
		helloAndDetach(t, path)
	}
	done := make(chan error, 1)
	holdNext.Store(true)
	go func() { done <- first.Call(ctxBound(t), ipc.KindDetach, &ipc.Detach{}, &ipc.DetachReply{}) }()
	waitFor(t, entered, "the detach in its handler")
	floodAs(t, path, nobody, 1) // 0 against root's 2 retired: sheds one of them
	require.True(t, eventually(func() bool { return s.Stats().ShedConns == 1 }), "%+v", s.Stats())
	once.Do(func() { close(release) })
	assert.NoError(t, waitFor(t, done, "the held detach's answer"), "its connection was not shed")
	assert.NoError(t, first.Err())
	// Root's two retired (one of three shed), and 65534's.
	assert.True(t, eventually(func() bool { return s.Stats().Unadmitted == 3 }), "retired once answered: %+v", s.Stats())
}

// A retire without a reason still closes the connection at its time,
// telling the peer it was over a limit.
func TestARetireWithoutAReasonClosesWithALimit(t *testing.T) {
	h := newHandler()
	h.handle = func(ctx context.Context, p *ipc.Peer, kind ipc.Kind, body *ipc.Decoder) (any, error, bool) {
		if kind == ipc.KindDetach {
			return ipc.AndRetire{Reply: &ipc.DetachReply{}}, nil, true
		}
		return nil, nil, false
	}
	s := startServer(t, quietHandler{h}, withHello, func(c *ipc.ServerConfig) { c.Limits.HelloTimeout = 200 * time.Millisecond })
	c := helloAndDetach(t, s.path)
	waitFor(t, c.Done(), "the end of the retired connection")
	assert.ErrorIs(t, c.Err(), ipc.ErrLimit)
	assert.ErrorContains(t, c.Err(), "retired")
}
