package ipc_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/ipc"
)

// b8Held marks a create request the server holds until the peer goes: a
// call that is never answered.
const b8Held = 0x800

// b8Server answers creates after a delay drawn from the address (out of
// order), and never answers those marked b8Held.
func b8Server(t *testing.T) (*testServer, *atomic.Int64) {
	heldNow := new(atomic.Int64)
	h := newHandler()
	h.handle = func(ctx context.Context, p *ipc.Peer, kind ipc.Kind, body *ipc.Decoder) (any, error, bool) {
		var m ipc.CreateMR
		if kind != ipc.KindCreateMR || body.Decode(&m) != nil {
			return nil, nil, false
		}
		if m.Addr&b8Held != 0 {
			heldNow.Add(1)
			<-ctx.Done()
			return nil, ctx.Err(), true
		}
		if d := time.Duration(m.Addr>>12%7) * time.Millisecond; d > 0 {
			t := time.NewTimer(d)
			select {
			case <-t.C:
			case <-ctx.Done():
			}
			t.Stop()
		}
		return nil, nil, false
	}
	return startServer(t, h), heldNow
}

// Calls bounded by CallTimeout (which wait in one blocking receive under
// the socket's receive timeout), calls with contexts that end, and calls
// that can neither be cancelled nor time out, all at once on one lane,
// some never answered: each answered call gets its own answer, each call
// bounded by a timeout ends near it, and the lane carries on. Leaders of
// every kind hand the reading over to followers of every kind.
func TestBreaker8MixedLaneCallsEndNearTheirDeadlines(t *testing.T) {
	s, _ := b8Server(t)
	c := laneClient(t, s, false, ipc.ClientConfig{})
	const slack = 2 * time.Second // the kernel's timer, the race detector, 2 busy CPUs: catches a call that hangs

	var wg sync.WaitGroup
	var answered, timedOut, held atomic.Int64
	for g := range 6 {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(g), 8))
			for i := range 120 {
				addr := uint64(g*1000+i+1) << 12
				hold := rng.IntN(40) == 0 && held.Load() < 8 // a few, within the server's in-flight bound
				if hold {
					held.Add(1)
					addr |= b8Held
				}
				var r ipc.CreateMRReply
				var err error
				var limit time.Duration
				start := time.Now()
				switch k := rng.IntN(5); {
				case k <= 1 || hold:
					limit = time.Duration(1+rng.IntN(40)) * time.Millisecond
					if k == 0 && !hold {
						limit = bound // long: it keeps the reading while others come and go
					}
					err = c.CallTimeout(limit, ipc.KindCreateMR, &ipc.CreateMR{Addr: addr}, &r)
				case k == 2:
					limit = time.Duration(1+rng.IntN(30)) * time.Millisecond
					ctx, cancel := context.WithTimeout(context.Background(), limit)
					err = c.Call(ctx, ipc.KindCreateMR, &ipc.CreateMR{Addr: addr}, &r)
					cancel()
				default: // neither cancellable nor bounded: always answered
					err = c.Call(context.Background(), ipc.KindCreateMR, &ipc.CreateMR{Addr: addr}, &r)
				}
				took := time.Since(start)
				switch {
				case err == nil:
					answered.Add(1)
					assert.False(t, hold, "a held call for 0x%x was answered", addr)
					assert.Equal(t, uint32(addr>>12), r.LKey, "call for 0x%x got another's answer", addr)
				case errors.Is(err, context.DeadlineExceeded):
					timedOut.Add(1)
					assert.NotZero(t, limit, "a call without a bound timed out")
					assert.Equal(t, ipc.CreateMRReply{}, r, "an ended call's reply stays untouched")
				default:
					t.Errorf("call for 0x%x: %v", addr, err)
				}
				if limit != 0 {
					assert.Less(t, took, limit+slack, "call for 0x%x bounded by %v took %v", addr, limit, took)
				}
			}
		})
	}
	wg.Wait()
	t.Logf("%d answered, %d timed out, %d held", answered.Load(), timedOut.Load(), held.Load())
	require.NoError(t, c.Err())
	var r ipc.CreateMRReply
	require.NoError(t, c.Call(context.Background(), ipc.KindCreateMR, &ipc.CreateMR{Addr: 0x5000}, &r),
		"a call without a deadline after all those with one")
	assert.Equal(t, uint32(5), r.LKey)
	require.NoError(t, c.CallTimeout(bound, ipc.KindCreateMR, &ipc.CreateMR{Addr: 0x6000}, &r))
	assert.Equal(t, uint32(6), r.LKey)
}

// A call that reads the lane in a blocking receive with a deadline far
// away, never answered, and calls waiting behind it: Close ends them all
// at once, with ErrClosed, not at the deadline.
func TestBreaker8CloseEndsBlockingLaneReaders(t *testing.T) {
	s, heldNow := b8Server(t)
	c := laneClient(t, s, false, ipc.ClientConfig{})
	const n = 4
	errs := make(chan error, n)
	for i := range n {
		go func() {
			timeout := bound * 100 // far: only Close can end it in time
			if i > 0 {
				timeout = time.Duration(i) * bound * 50
			}
			errs <- c.CallTimeout(timeout, ipc.KindCreateMR, &ipc.CreateMR{Addr: uint64(i+1)<<12 | b8Held}, nil)
		}()
	}
	// Every call has gone out and waits (the server holds them all).
	require.True(t, eventually(func() bool { return heldNow.Load() >= n }), "the calls reached the server")
	start := time.Now()
	require.NoError(t, c.Close())
	for i := range n {
		err := waitFor(t, errs, fmt.Sprintf("call %d after Close", i))
		assert.ErrorIs(t, err, ipc.ErrClosed)
	}
	assert.Less(t, time.Since(start), bound/2, "Close ended the blocked readers")
}
