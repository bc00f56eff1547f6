package primary_test

import (
	"context"
	"errors"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/ipc"
	"github.com/mpmr/mpmr/primary"
	"github.com/mpmr/mpmr/secondary"
)

func init() {
	testproc.Register("b7-mempool-flood", b7MempoolFlood)
	testproc.Register("b7-stats-after-close", b7StatsAfterClose)
}

// b7MempoolFlood is a careless secondary of the primary's own user. It
// attaches to instance args[0] (runtime directory args[1]), makes args[2]
// more claims of slots that each say hello on a connection of their own
// (one connection speaks for a claim), and from as many goroutines on
// each as a connection may have requests in flight asks, over and over,
// for the registration of a mempool of args[5] chunks, all [args[3],
// +args[4]) (one frame, well under MaxMessage). It says "flooding
// conns=N", then answers each input line with "> ok=N failed=N".
func b7MempoolFlood(args []string) int {
	s, err := secondary.Attach(secondary.Config{Prefix: args[0], RuntimeDir: args[1], Logger: quiet})
	if err != nil {
		testproc.Say("attach-failed %v", err)
		return 3
	}
	defer s.Close()
	conns, _ := strconv.Atoi(args[2])
	addr, _ := strconv.ParseUint(args[3], 0, 64)
	length, _ := strconv.ParseUint(args[4], 0, 64)
	nchunks, _ := strconv.Atoi(args[5])
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ack := ipc.PushHandlerFunc(func(context.Context, ipc.Kind, *ipc.Decoder) (any, error) { return &ipc.SyncAck{}, nil })
	var clients []*ipc.Client
	for range conns {
		seg, c, err := claimAndSayHello(ctx, args[0], args[1], ipc.ClientConfig{Logger: quiet, PushHandler: ack})
		if err != nil {
			testproc.Say("hello-failed %v", err)
			return 3
		}
		defer seg.Close()
		clients = append(clients, c)
	}
	chunks := make([]ipc.Chunk, nchunks)
	for i := range chunks {
		chunks[i] = ipc.Chunk{Addr: addr, Len: length}
	}
	req := &ipc.RegisterMempool{Name: "flood", Chunks: chunks}
	var ok, failed atomic.Int64
	var wg sync.WaitGroup
	for _, c := range clients {
		for range ipc.DefaultMaxInflight {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for ctx.Err() == nil && c.Err() == nil {
					if c.Call(ctx, ipc.KindRegisterMempool, req, &ipc.RegisterMempoolReply{}) != nil {
						failed.Add(1)
					} else {
						ok.Add(1)
					}
				}
			}()
		}
	}
	testproc.Say("flooding conns=%d", len(clients))
	for in := testproc.Commands(); in.Scan(); {
		testproc.Say("> ok=%d failed=%d", ok.Load(), failed.Load())
	}
	cancel()
	wg.Wait()
	return 0
}

// A careless secondary (the primary's own user; any user in AllowUIDs can
// do the same) keeps the 64 requests a connection may have in flight busy
// with mempool registrations of 1,500 chunks that all name the same page,
// then is killed. Each such frame used to cost the primary 1,500
// write-locked creates, and its handlers looked neither at their context
// (which ends when the peer goes) nor at Close: the primary went on
// registering for the dead peer, and Close waited for all of it (9.4 s
// with two connections; with 32, over 8 minutes, while attached
// secondaries' creates took over a second). "A dead or stalled process
// blocks nobody for long": Close now takes milliseconds.
func TestBreaker7KilledPeersMempoolRegistrationsOutliveIt(t *testing.T) {
	p, cfg := startPrimary(t, testenv.Tmpfs(t))
	region, err := p.Alloc(p.Backend().PageSize)
	require.NoError(t, err)
	legit := startSecondary(t, cfg)
	parseKey(t, ask(t, legit, "create %d", region.Addr))

	flood := testproc.Start(t, "b7-mempool-flood", []string{cfg.Prefix, cfg.RuntimeDir, "2",
		strconv.FormatUint(uint64(region.Addr), 10), "64", "1500", filepath.Join(p.RuntimeDir(), ipc.SocketName)})
	line := flood.Expect("", 0)
	require.True(t, strings.HasPrefix(line, "flooding"), line)
	for {
		// Once one registration came back, the others are in flight.
		flood.Send("count")
		line := flood.Expect("> ", 0)
		if !strings.HasPrefix(line, "> ok=0 ") {
			t.Logf("flood: %s", line)
			break
		}
	}
	start := time.Now()
	ans := ask(t, legit, "create %d", region.Addr+64)
	t.Logf("an attached secondary's create during the flood: %s after %v", ans, time.Since(start))

	flood.Kill()
	require.Error(t, flood.Wait(0))
	start = time.Now()
	require.NoError(t, p.Close())
	took := time.Since(start)
	t.Logf("Close took %v after the flooding secondary was killed", took)
	assert.Less(t, took, 3*time.Second, "the primary works on for requests of a peer that is gone")
}

// b7StatsAfterClose starts a primary (prefix args[0], runtime directory
// args[1]), closes it and asks for its stats, as a monitoring goroutine
// racing an application's shutdown does. It says "survived" if it did.
func b7StatsAfterClose(args []string) int {
	p, err := primary.Start(primary.Config{Prefix: args[0], RuntimeDir: args[1], Backend: hugetlb.Tmpfs,
		MemoryPages: 16, Logger: quiet})
	if err != nil {
		testproc.Say("start-failed %v", err)
		return 3
	}
	p.Close()
	st := p.Stats()
	_, err = p.Dump()
	testproc.Say("survived mrs=%d dump=%v", st.Global.MRs, errors.Is(err, primary.ErrClosed))
	return 0
}

// Primary is safe for concurrent use, and Close is idempotent: Stats after
// (or during) Close must not read the unmapped control segment, which
// kills the process with SIGSEGV ("fatal error: fault", no panic to
// recover), as a metrics goroutine that outlives the primary would. Stats
// is empty then, and Dump fails with ErrClosed.
func TestBreaker7StatsAfterCloseDoesNotCrash(t *testing.T) {
	h := testproc.Start(t, "b7-stats-after-close", []string{testenv.Prefix(t), testenv.RunDir(t)})
	line, err := h.Next("", 0)
	err2 := h.Wait(0)
	assert.Equal(t, "survived mrs=0 dump=true", line, "next line %v; exit %v; stderr:\n%.600s", err, err2, h.Stderr())
}

// A careless secondary that keeps the requests its connections may have
// in flight busy with mempool registrations (b7-mempool-flood: two
// connections, each a peer of its own, 64 requests each, 1,500 chunks a
// request) had the primary work on as many at once as its handlers could
// (3 to 13 at once here): a registration's work grows with its frame, so
// they kept every P of the primary busy, and its frees waited behind them
// (5–10 ms instead of 0.3–0.5). Registrations now take turns, one at a
// time, and a peer queues at most one for the primary's turn: another
// peer's registration waits behind at most one turn of each flooding
// peer's (with one turn for all and none of a peer's own, 35–54 here).
func TestMempoolRegistrationsTakeTurnsFairly(t *testing.T) {
	var mu sync.Mutex
	var working, most, done int
	var o overtakes
	t.Cleanup(primary.SetMempoolTurns(func(event string, pid int) { // restored after the primary closes
		o.see(event, pid)
		mu.Lock()
		defer mu.Unlock()
		switch event {
		case "start":
			working++
			most = max(most, working)
		case "end":
			working--
			done++
		}
	}))
	p, cfg := startPrimary(t, testenv.Tmpfs(t))
	region, err := p.Alloc(p.Backend().PageSize)
	require.NoError(t, err)
	other := startSecondary(t, cfg)
	o.watch(other.PID())
	flood := startFlood(t, cfg, 2, region.Addr)
	assert.Equal(t, "ok", ask(t, other, "regpool %d %d", region.Addr, 4096))
	flood.Kill()
	require.Error(t, flood.Wait(0))
	mu.Lock()
	defer mu.Unlock()
	t.Logf("%d registrations done; %d of the flooding peers' started while the other peer's waited", done, o.count())
	assert.Equal(t, 1, most, "mempool registrations at work at once (%d done)", done)
	// At most one of each flooding peer's, 2, but the report of the wait
	// and the queueing are two steps, between which the flood may run on.
	assert.LessOrEqual(t, o.count(), 10, "registrations of the two flooding peers that started while another peer's waited")
}

// With registrations taking turns, a cheap one waited for each expensive
// one ahead of it to finish: in single-page mode, with 2,000 pages each
// an MR of its own, a registration of 2,500 chunks (a frame's worth) that
// each span all of them takes 5 million steps, and with twelve
// connections flooding those,
// another secondary's registration of one page waited past its request
// timeout. A registration now yields the turn every slice of work to
// those waiting for it.
func TestAnExpensiveRegistrationLetsOthersThrough(t *testing.T) {
	const pages, conns = 2000, 12
	var mu sync.Mutex
	flooder, waits := 0, 0
	busy := make(chan struct{})
	t.Cleanup(primary.SetMempoolTurns(func(event string, pid int) { // restored after the primary closes
		mu.Lock()
		defer mu.Unlock()
		if event == "wait" && pid == flooder {
			if waits++; waits == conns {
				close(busy) // one in from every connection, or as many turns
			}
		}
	}))
	_, cfg, region := costlyMemory(t, pages) // registered here: no request's timeout to meet
	other := startSecondary(t, cfg)
	flood := testproc.Start(t, "b7-mempool-flood", []string{cfg.Prefix, cfg.RuntimeDir, strconv.Itoa(conns),
		strconv.FormatUint(uint64(region.Addr), 10), strconv.Itoa(pages * 4096), "2500"})
	mu.Lock()
	flooder = flood.PID()
	mu.Unlock()
	line := flood.Expect("", 0)
	require.True(t, strings.HasPrefix(line, "flooding"), line)
	<-busy
	for i := range 3 {
		assert.Equal(t, "ok", ask(t, other, "regpool %d %d", region.Addr+uintptr(i)*4096, 4096), "registration %d during the flood", i)
	}
	flood.Kill()
	require.Error(t, flood.Wait(0))
}

// A registration looked at the clock only every 64 steps, and a step that
// registers fresh memory costs tens of microseconds: it held the turn for
// 64 of them, 1.6–5.4 ms, not a slice. It looks every 8 steps now: with a
// slice of zero, it must yield that often.
func TestARegistrationYieldsAfterAnyStepPastItsSlice(t *testing.T) {
	const pages = 256
	var mu sync.Mutex
	asker, starts := 0, 0
	t.Cleanup(primary.SetMempoolSlice(0))
	t.Cleanup(primary.SetMempoolTurns(func(event string, pid int) { // restored after the primary closes
		mu.Lock()
		defer mu.Unlock()
		if event == "start" && pid == asker {
			starts++
		}
	}))
	p, cfg := startPrimary(t, testenv.Tmpfs(t), func(c *primary.Config) {
		c.SinglePage, c.MemoryPages, c.PageSize = true, pages, 4096
	})
	region, err := p.Alloc(pages * 4096)
	require.NoError(t, err)
	s := startSecondary(t, cfg)
	mu.Lock()
	asker = s.PID()
	mu.Unlock()
	require.Equal(t, "ok", ask(t, s, "regpool %d %d", region.Addr, pages*4096)) // a step, a fresh MR, a page
	mu.Lock()
	defer mu.Unlock()
	assert.GreaterOrEqual(t, starts, pages/8, "turns taken by a registration of %d fresh pages", pages)
}

// The turn a registration queues for is its process's, not its
// attachment's: a process that makes sixteen claims, each with a
// connection flooding registrations, puts one of them ahead of another
// secondary's at a time, not sixteen.
func TestAProcessQueuesOneRegistrationAtATime(t *testing.T) {
	const conns = 16
	var o overtakes
	t.Cleanup(primary.SetMempoolTurns(o.see)) // restored after the primary closes
	p, cfg := startPrimary(t, testenv.Tmpfs(t))
	region, err := p.Alloc(p.Backend().PageSize)
	require.NoError(t, err)
	other := startSecondary(t, cfg)
	o.watch(other.PID())
	flood := startFlood(t, cfg, conns, region.Addr)
	for i := range 5 {
		assert.Equal(t, "ok", ask(t, other, "regpool %d %d", region.Addr, 4096), "registration %d", i)
	}
	flood.Kill()
	require.Error(t, flood.Wait(0))
	t.Logf("%d of the flooding process's registrations started while the other's waited, in 5 waits", o.count())
	// One of the flooding process's at a time, and the report of the wait
	// and the queueing are two steps, between which the flood may run on.
	assert.LessOrEqual(t, o.count(), 5*3, "registrations of the flooding process that started while another's waited")
}

// startFlood starts b7-mempool-flood on conns connections, registering
// 1,500 chunks of the 64 bytes at addr a request, and waits until one of
// its registrations came back: the others are in flight then.
func startFlood(t *testing.T, cfg primary.Config, conns int, addr uintptr) *testproc.Proc {
	t.Helper()
	flood := testproc.Start(t, "b7-mempool-flood", []string{cfg.Prefix, cfg.RuntimeDir, strconv.Itoa(conns),
		strconv.FormatUint(uint64(addr), 10), "64", "1500"})
	line := flood.Expect("", 0)
	require.True(t, strings.HasPrefix(line, "flooding"), line)
	for busy := false; !busy; {
		flood.Send("count")
		busy = !strings.HasPrefix(flood.Expect("> ", 0), "> ok=0 ")
	}
	return flood
}

// overtakes counts, from the mempool turns' hook (see), the
// registrations that start while one of the watched process's waits for
// the primary's turn.
type overtakes struct {
	mu      sync.Mutex
	watched int
	waiting bool
	n       int
}

func (o *overtakes) watch(pid int) { o.mu.Lock(); o.watched = pid; o.mu.Unlock() }

func (o *overtakes) count() int { o.mu.Lock(); defer o.mu.Unlock(); return o.n }

func (o *overtakes) see(event string, pid int) {
	o.mu.Lock()
	defer o.mu.Unlock()
	switch {
	case event == "wait" && pid == o.watched:
		o.waiting = true
	case event == "start" && pid == o.watched:
		o.waiting = false
	case event == "start" && o.waiting:
		o.n++
	}
}
