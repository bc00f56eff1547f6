package primary_test

import (
	"context"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/ipc"
	"github.com/mpmr/mpmr/primary"
)

func init() { testproc.Register("regpool-give-up", helperRegpoolGiveUp) }

// helperRegpoolGiveUp is a secondary of instance args[0] (runtime
// directory args[1]) with two claims, each with a connection of its own,
// that registers the one-chunk mempool [args[2], +args[3]) on command:
//
//	first   -> on the first connection, to the end: later "first ERR"
//	second  -> on the second, until "give-up": later "second ERR"
//	give-up -> cancels the second's call
//
// (ERR is nil or why it failed). It says "ready" first.
func helperRegpoolGiveUp(args []string) int {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var clients []*ipc.Client
	for range 2 {
		seg, c, err := claimAndSayHello(ctx, args[0], args[1], ipc.ClientConfig{Logger: quiet})
		if err != nil {
			testproc.Say("hello-failed %v", err)
			return 3
		}
		defer seg.Close()
		defer c.Close()
		clients = append(clients, c)
	}
	addr, _ := strconv.ParseUint(args[2], 0, 64)
	length, _ := strconv.ParseUint(args[3], 0, 64)
	req := &ipc.RegisterMempool{Name: "given-up", Chunks: []ipc.Chunk{{Addr: addr, Len: length}}}
	second, giveUp := context.WithCancel(ctx)
	defer giveUp()
	var wg sync.WaitGroup
	defer wg.Wait()
	call := func(name string, ctx context.Context, c *ipc.Client) {
		wg.Go(func() {
			testproc.Say("%s %v", name, c.Call(ctx, ipc.KindRegisterMempool, req, &ipc.RegisterMempoolReply{}))
		})
	}
	testproc.Say("ready")
	for in := testproc.Commands(); in.Scan(); {
		switch in.Text() {
		case "first":
			call("first", ctx, clients[0])
		case "second":
			call("second", second, clients[1])
		case "give-up":
			giveUp()
		}
	}
	return 0
}

// A secondary that gives a mempool registration up (its context ended,
// or its request's time ran out) tells the primary, which stops working
// on it: here it waits for a turn held by another registration, its own
// process's or the primary's, and leaves the queue at once instead of
// working on for nobody once its turn comes.
func TestAGivenUpRegistrationStops(t *testing.T) {
	for _, tc := range []struct {
		name    string
		another bool // the registration ahead is another process's
		queued  string
	}{
		{"behind its own process's", false, "queue"},
		{"behind another process's", true, "wait"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var mu sync.Mutex
			firstPID, secondPID, starts := 0, 0, 0
			started, queued, abandoned := make(chan struct{}, 8), make(chan struct{}, 8), make(chan struct{}, 8)
			hold := make(chan struct{})
			t.Cleanup(primary.SetMempoolTurns(func(event string, pid int) { // restored after the primary closes
				mu.Lock()
				first, second := pid == firstPID, pid == secondPID
				if first && event == "start" {
					starts++
				}
				holdIt := first && event == "start" && starts == 1
				mu.Unlock()
				switch {
				case holdIt:
					started <- struct{}{}
					<-hold // the first keeps the turn until the test lets it go
				case event == "start" && second:
					started <- struct{}{}
				case event == tc.queued && second:
					queued <- struct{}{}
				case event == "abandon" && second:
					abandoned <- struct{}{}
				}
			}))
			p, cfg := startPrimary(t, testenv.Tmpfs(t))
			region, err := p.Alloc(p.Backend().PageSize)
			require.NoError(t, err)
			args := []string{cfg.Prefix, cfg.RuntimeDir, strconv.FormatUint(uint64(region.Addr), 10), strconv.Itoa(int(p.Backend().PageSize))}
			h1 := testproc.Start(t, "regpool-give-up", args)
			h1.Expect("ready", 0)
			h2 := h1
			if tc.another {
				h2 = testproc.Start(t, "regpool-give-up", args)
				h2.Expect("ready", 0)
			}
			mu.Lock()
			firstPID, secondPID = h1.PID(), h2.PID()
			if !tc.another {
				secondPID = -1 // told apart by order below
			}
			mu.Unlock()
			var once sync.Once
			release := func() { once.Do(func() { close(hold) }) }
			t.Cleanup(release) // before the primary's Close, which waits for the registration

			h1.Send("first")
			waitFor(t, started, "the first registration's start")
			if !tc.another {
				mu.Lock()
				secondPID = h1.PID() // from now on its events are the second's
				mu.Unlock()
			}
			h2.Send("second")
			waitFor(t, queued, "the second registration's wait for its turn")
			h2.Send("give-up")
			assert.Equal(t, "second context canceled", h2.Expect("second ", 0))
			waitFor(t, abandoned, "the primary's notice that the second registration was given up")
			release()
			assert.Equal(t, "first <nil>", h1.Expect("first ", 0))
			select {
			case <-started:
				t.Error("the given-up registration started")
			default:
			}
		})
	}
}

// waitFor receives from ch, failing the test if nothing comes within
// 30 s.
func waitFor[T any](t *testing.T, ch <-chan T, what string) T {
	t.Helper()
	return testenv.Receive(t, ch, 30*time.Second, what)
}

// A registration whose caller gave it up before its turn came takes no
// turn, even one that is free: it reaches its handler with its context
// ended when it was given up while it waited for a slot, and a select
// between a free turn and an ended context picks either.
func TestAnEndedContextTakesNoTurn(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	turn := make(chan struct{}, 1)
	taken := 0
	for range 1000 {
		if err := primary.EnterTurn(ctx, turn); err == nil {
			taken++
			<-turn
		} else {
			require.ErrorIs(t, err, context.Canceled)
		}
	}
	assert.Zero(t, taken, "turns taken, of 1,000, with the context ended")
}
