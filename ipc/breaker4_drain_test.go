package ipc_test

import (
	"context"
	"fmt"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/ipc"
)

// A server that never answers the calls that gave up (their handlers wait
// for the peer to go) keeps answers owed for good, so the lane's drainer
// leads for as long as the connection lasts. Every call made meanwhile
// must still get its own answer, or its deadline, in time — whether it
// comes while the drainer reads, follows it, or gives up while waiting
// for the hand-over — and Close must end the drainer and leave no
// goroutine behind.
func TestBreaker4DrainerThatNeverFinishes(t *testing.T) {
	goroutines := runtime.NumGoroutine()
	for _, inline := range []bool{false, true} {
		t.Run(fmt.Sprintf("inline=%v", inline), func(t *testing.T) {
			opts := []serverOpt{withHello, func(c *ipc.ServerConfig) { c.MaxInflightPerConn = 4096 }}
			if inline {
				// Inline handlers run one at a time on the lane's reader:
				// a blocked one would hold every later call, so only the
				// other kinds are inline here.
				opts = append(opts, func(c *ipc.ServerConfig) { c.Inline = []ipc.Kind{ipc.KindStats} })
			}
			s := startServer(t, quietHandler{newHandler()}, opts...)
			c := laneClient(t, s, true, ipc.ClientConfig{})

			abandon := func(timeout time.Duration) {
				start := time.Now()
				err := c.CallTimeout(timeout, ipc.KindCreateMR, &ipc.CreateMR{Addr: blockAddr}, nil)
				assert.ErrorIs(t, err, context.DeadlineExceeded)
				assert.Less(t, time.Since(start), timeout+bound/4, "a call that gives up returns near its deadline")
			}
			var wg sync.WaitGroup
			for range 32 { // many give up at once: their answers never come
				wg.Go(func() { abandon(5 * time.Millisecond) })
			}
			wg.Wait()
			require.NoError(t, c.Err())

			check := func(addr uint64) {
				var r ipc.CreateMRReply
				start := time.Now()
				err := c.CallTimeout(bound, ipc.KindCreateMR, &ipc.CreateMR{Addr: addr}, &r)
				if assert.NoError(t, err, "0x%x", addr) {
					assert.Equal(t, uint32(addr>>12), r.LKey, "0x%x got another call's answer", addr)
				}
				assert.Less(t, time.Since(start), bound/2, "0x%x waited for the drainer", addr)
			}
			for i := range 200 { // one at a time: each takes the reading from the drainer
				check(uint64(0x10_0000 + i*0x1000))
			}
			for g := range 8 { // and all at once, with more giving up among them
				wg.Go(func() {
					for i := range 40 {
						if i%5 == g%5 {
							abandon(time.Duration(1+i%3) * time.Millisecond)
							continue
						}
						check(uint64(0x100_0000 + (g*100+i)*0x1000))
					}
				})
			}
			wg.Wait()
			require.NoError(t, c.Err(), "the connection lasts")

			done := make(chan struct{})
			go func() { c.Close(); close(done) }()
			select {
			case <-done:
			case <-time.After(bound):
				t.Fatal("Close did not return while the drainer waited for answers that never come")
			}
		})
	}
	assert.True(t, eventually(func() bool { return runtime.NumGoroutine() <= goroutines }),
		"goroutines: %d before, %d after", goroutines, runtime.NumGoroutine())
}
