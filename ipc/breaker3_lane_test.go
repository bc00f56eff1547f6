package ipc_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"path/filepath"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/ipc"
)

// bigStats is a stats reply of about 60 KiB: a few fill a socket's queue.
func bigStats() *ipc.StatsReply {
	r := &ipc.StatsReply{Counters: map[string]uint64{}}
	for i := range 2000 {
		r.Counters[fmt.Sprintf("counter-%020d", i)] = uint64(i)
	}
	return r
}

// A client whose calls timed out (the server was slow for a moment) and
// that then makes no call for a while is still a client that reads: on
// the connection, its reader drops late answers as they come ("An answer
// that arrives after ctx ended is dropped"). On the lane nobody reads
// while no call waits, so the late answers pile up in the lane's queue,
// the server's writes wait for room, and after WriteTimeout the server
// drops the idle, well-behaved client as one "not reading its replies".
func TestBreaker3LaneIdleClientWithLateAnswersIsNotDropped(t *testing.T) {
	cases := []struct {
		name   string
		inline bool
		n      int
		big    bool // 60 KiB answers, else a create's small one
	}{
		{"large answers", false, 40, true},
		{"large answers, inline", true, 40, true},
		{"small answers, one call at a time", false, 600, false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			release := make(chan struct{})
			var answered atomic.Int32
			h := newHandler()
			h.handle = func(ctx context.Context, p *ipc.Peer, kind ipc.Kind, body *ipc.Decoder) (any, error, bool) {
				if kind != ipc.KindStats {
					return nil, nil, false
				}
				var m ipc.StatsRequest
				if err := body.Decode(&m); err != nil {
					return nil, err, true
				}
				select {
				case <-release:
				case <-ctx.Done():
				}
				answered.Add(1)
				if tc.big {
					return bigStats(), nil, true
				}
				return &ipc.StatsReply{PID: 1}, nil, true
			}
			opts := []serverOpt{withHello, func(c *ipc.ServerConfig) {
				// Long enough that a client's reader the machine does not
				// schedule for a while (other tests' processes run beside
				// these) is not taken for one that does not read.
				c.WriteTimeout = time.Second
				c.MaxInflightPerConn = tc.n
			}}
			if tc.inline {
				opts = append(opts, func(c *ipc.ServerConfig) { c.Inline = []ipc.Kind{ipc.KindStats} })
			}
			s := startServer(t, quietHandler{h}, opts...)
			c := laneClient(t, s, true, ipc.ClientConfig{})

			call := func() {
				err := c.CallTimeout(5*time.Millisecond, ipc.KindStats, &ipc.StatsRequest{}, nil)
				assert.ErrorIs(t, err, context.DeadlineExceeded)
			}
			if tc.big {
				var wg sync.WaitGroup
				for range tc.n {
					wg.Go(call)
				}
				wg.Wait()
			} else {
				for range tc.n {
					call()
				}
			}
			require.NoError(t, c.Err())
			close(release) // the server catches up; the client is idle
			// (Inline, the handlers run one after another, each writing its
			// answer before the next starts: a dropped peer stops them.)
			require.True(t, eventually(func() bool { return answered.Load() == int32(tc.n) || c.Err() != nil }), "all answered")
			// The client stays idle for two write timeouts: that is the
			// situation under test, not a stand-in for a condition.
			time.Sleep(2 * time.Second)
			assert.Zero(t, s.Stats().WriteTimeouts, "an idle client was dropped as a slow reader")
			assert.NoError(t, c.Err(), "the connection of an idle client ended")
			err := c.CallTimeout(bound, ipc.KindCreateMR, &ipc.CreateMR{Addr: 0x5000}, nil)
			assert.NoError(t, err, "a call after the idle time")
			if errors.Is(err, ipc.ErrPeerGone) {
				t.Logf("dropped: %v; stats %+v", err, s.Stats())
			}
		})
	}
}

// Many callers on the lane, leaders and followers, with contexts that
// end at random moments, while the connection ends under them at a
// random moment: Client.Close, the server dropping the peer, or the
// whole server closing. Every call returns (within bound) with its
// answer, its context's error, or the end of the connection; nothing is
// left behind: goroutines and descriptors come back to where they were.
func TestBreaker3LaneCallsRaceTheEndOfTheConnection(t *testing.T) {
	fds, goroutines := testenv.OpenFDs(), runtime.NumGoroutine()
	for round := range 24 {
		func() {
			h := newHandler()
			h.handle = func(ctx context.Context, p *ipc.Peer, kind ipc.Kind, body *ipc.Decoder) (any, error, bool) {
				var m ipc.CreateMR
				if kind == ipc.KindCreateMR && body.Decode(&m) == nil && m.Addr&3 == 1 {
					select { // some answers come late
					case <-time.After(time.Duration(m.Addr>>12%500) * time.Microsecond):
					case <-ctx.Done():
					}
				}
				return nil, nil, false
			}
			opts := []serverOpt{}
			if round%2 == 1 {
				opts = append(opts, withInline)
			}
			s := startServer(t, quietHandler{h}, opts...)
			defer s.Close()
			c := laneClient(t, s, false, ipc.ClientConfig{})
			defer c.Close()
			rng := rand.New(rand.NewPCG(uint64(round), 3))
			how := round % 3
			var wg sync.WaitGroup
			var answered, ended, gone atomic.Int64
			start := make(chan struct{})
			for g := range 10 {
				wg.Go(func() {
					rng := rand.New(rand.NewPCG(uint64(round), uint64(g)))
					<-start
					for i := range 200 {
						addr := uint64(g*1000+i+1)<<12 | uint64(i&1)
						var err error
						var r ipc.CreateMRReply
						switch rng.IntN(4) {
						case 0:
							err = c.CallTimeout(time.Duration(rng.IntN(300))*time.Microsecond, ipc.KindCreateMR, &ipc.CreateMR{Addr: addr}, &r)
						case 1:
							ctx, cancel := context.WithCancel(context.Background())
							time.AfterFunc(time.Duration(rng.IntN(300))*time.Microsecond, cancel)
							err = c.Call(ctx, ipc.KindCreateMR, &ipc.CreateMR{Addr: addr}, &r)
							cancel()
						default:
							err = c.Call(context.Background(), ipc.KindCreateMR, &ipc.CreateMR{Addr: addr}, &r)
						}
						switch {
						case err == nil:
							answered.Add(1)
							if r.LKey != uint32(addr>>12) {
								t.Errorf("call for 0x%x got lkey 0x%x", addr, r.LKey)
							}
						case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
							ended.Add(1)
						case errors.Is(err, ipc.ErrClosed), errors.Is(err, ipc.ErrPeerGone):
							gone.Add(1)
						default:
							t.Errorf("call for 0x%x: %v", addr, err)
						}
					}
				})
			}
			close(start)
			time.Sleep(time.Duration(rng.IntN(20)) * time.Millisecond) // a random moment
			switch how {
			case 0:
				c.Close()
			case 1:
				for _, p := range s.Peers() {
					p.Close()
				}
			case 2:
				s.Close()
			}
			finished := make(chan struct{})
			go func() { wg.Wait(); close(finished) }()
			select {
			case <-finished:
			case <-time.After(bound):
				buf := make([]byte, 1<<20)
				t.Fatalf("round %d (end %d): calls hang after the end:\n%s", round, how, buf[:runtime.Stack(buf, true)])
			}
			waitFor(t, c.Done(), "the client's end")
			if gone.Load() == 0 {
				t.Logf("round %d: the end came after every call", round)
			}
		}()
	}
	assert.True(t, eventually(func() bool { return runtime.NumGoroutine() <= goroutines+2 }),
		"goroutines: %d before, %d after", goroutines, runtime.NumGoroutine())
	assert.True(t, eventually(func() bool { return testenv.OpenFDs() <= fds }), "descriptors: %d before, %d after", fds, testenv.OpenFDs())
}

// A server process that is stopped (SIGSTOP) holds every call on the
// lane: leaders and followers alike end at their deadline or
// cancellation, not later; once it continues, the connection carries on
// and late answers are dropped; stopped again and killed, every pending
// call without any deadline fails at once.
func TestBreaker3LaneServerStoppedThenKilled(t *testing.T) {
	for _, inline := range []bool{false, true} {
		t.Run(fmt.Sprintf("inline=%t", inline), func(t *testing.T) {
			path := filepath.Join(t.TempDir(), ipc.SocketName)
			args := []string{path, "0"}
			if inline {
				args = append(args, "inline")
			}
			srv := testproc.Start(t, "serve", args)
			srv.Expect("ready", 0)
			c := dial(t, path, ipc.ClientConfig{})
			require.NoError(t, c.Call(ctxBound(t), ipc.KindCreateMR, &ipc.CreateMR{Addr: 0x4000}, nil))
			require.True(t, ipc.HasLane(c))

			srv.Stop()
			// An end "at once" against one that waits for some other
			// timeout or never comes; generous for the race detector on
			// two busy CPUs.
			const timeout = 100 * time.Millisecond
			const slack = 2 * time.Second
			var wg sync.WaitGroup
			for g := range 12 {
				wg.Go(func() {
					addr := uint64(0x1000 * (g + 1))
					start := time.Now()
					var err error
					switch g % 3 {
					case 0:
						err = c.CallTimeout(timeout, ipc.KindCreateMR, &ipc.CreateMR{Addr: addr}, nil)
					case 1:
						ctx, cancel := context.WithTimeout(context.Background(), timeout)
						err = c.Call(ctx, ipc.KindCreateMR, &ipc.CreateMR{Addr: addr}, nil)
						cancel()
					case 2:
						ctx, cancel := context.WithCancel(context.Background())
						time.AfterFunc(timeout, cancel)
						err = c.Call(ctx, ipc.KindCreateMR, &ipc.CreateMR{Addr: addr}, nil)
					}
					took := time.Since(start)
					if g%3 == 2 {
						assert.ErrorIs(t, err, context.Canceled)
					} else {
						assert.ErrorIs(t, err, context.DeadlineExceeded)
					}
					assert.Less(t, took, timeout+slack, "call %d ended late", g)
				})
			}
			wg.Wait()
			require.NoError(t, c.Err())

			srv.Continue()
			var r ipc.CreateMRReply
			require.NoError(t, c.Call(ctxBound(t), ipc.KindCreateMR, &ipc.CreateMR{Addr: 0x9000}, &r), "the connection carries on")
			assert.Equal(t, uint32(9), r.LKey)

			srv.Stop()
			type result struct {
				err error
				at  time.Time
			}
			results := make(chan result, 8)
			for g := range 8 {
				go func() {
					err := c.Call(context.Background(), ipc.KindCreateMR, &ipc.CreateMR{Addr: uint64(0x10000 * (g + 1))}, nil)
					results <- result{err, time.Now()}
				}()
			}
			// Each call has sent its request once it reads the lane or
			// waits for the one that does.
			require.True(t, eventually(func() bool {
				return testenv.GoroutinesIn("ipc.(*Client).lead")+testenv.GoroutinesIn("ipc.(*Client).await") == 8
			}), "8 calls pending")
			killed := time.Now()
			srv.Kill()
			var worst time.Duration
			for range 8 {
				res := waitFor(t, results, "a pending call's end")
				assert.ErrorIs(t, res.err, ipc.ErrPeerGone)
				worst = max(worst, res.at.Sub(killed))
			}
			assert.Less(t, worst, slack, "the calls fail at once when the server dies")
			t.Logf("pending calls failed at most %v after SIGKILL", worst)
		})
	}
}
