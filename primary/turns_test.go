package primary_test

import (
	"context"
	"errors"
	"fmt"
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
	"github.com/mpmr/mpmr/shm"
)

func init() { testproc.Register("raw-claims", helperRawClaims) }

// helperRawClaims makes claims of instance args[0] (runtime directory
// args[1]) and says hello for each on a connection of its own, mapping
// nothing; with args[2] "refuse" it answers every memory sync with an
// error. Commands, each answered with one line:
//
//	claim              -> "> claimed I"
//	detach I           -> detaches claim I, its connection left open: "> detached I ERR"
//	flood I ADDR LEN N -> from as many goroutines as a connection may have
//	                      requests in flight, asks on connection I over and
//	                      over for the registration of a mempool of N chunks
//	                      [ADDR, +LEN), until one fails: "> flooding I"
//	flood-end I        -> waits for connection I's flood to end: "> flood-ended OK FAILED"
func helperRawClaims(args []string) int {
	refuse := len(args) > 2 && args[2] == "refuse"
	push := ipc.PushHandlerFunc(func(context.Context, ipc.Kind, *ipc.Decoder) (any, error) {
		if refuse {
			return nil, errors.New("refused")
		}
		return &ipc.SyncAck{}, nil
	})
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	type flood struct {
		wg         sync.WaitGroup
		ok, failed atomic.Int64
	}
	floods := map[int]*flood{}
	var segs []*shm.Segment
	var clients []*ipc.Client
	defer func() {
		cancel()
		wg.Wait()
		for i, c := range clients {
			c.Close()
			segs[i].Close()
		}
	}()
	testproc.Say("ready")
	testproc.EachCommand(func(c testproc.Line) {
		i := int(c.Num(0))
		switch c.Name {
		case "claim":
			seg, cl, err := claimAndSayHello(ctx, args[0], args[1], ipc.ClientConfig{Logger: quiet, PushHandler: push})
			if err != nil {
				testproc.Say("> claim-failed %v", err)
				return
			}
			segs, clients = append(segs, seg), append(clients, cl)
			testproc.Say("> claimed %d", len(clients)-1)
		case "detach":
			err := clients[i].Call(ctx, ipc.KindDetach, &ipc.Detach{}, &ipc.DetachReply{})
			testproc.Say("> detached %d %v", i, err)
		case "flood":
			chunks := make([]ipc.Chunk, c.Num(3))
			for j := range chunks {
				chunks[j] = ipc.Chunk{Addr: c.Num(1), Len: c.Num(2)}
			}
			req, cl, f := &ipc.RegisterMempool{Name: "flood", Chunks: chunks}, clients[i], &flood{}
			floods[i] = f
			for range ipc.DefaultMaxInflight {
				f.wg.Add(1)
				wg.Go(func() {
					defer f.wg.Done()
					for ctx.Err() == nil {
						if cl.Call(ctx, ipc.KindRegisterMempool, req, &ipc.RegisterMempoolReply{}) != nil {
							f.failed.Add(1)
							return
						}
						f.ok.Add(1)
					}
				})
			}
			testproc.Say("> flooding %d", i)
		case "flood-end":
			f := floods[i]
			f.wg.Wait()
			testproc.Say("> flood-ended %d %d", f.ok.Load(), f.failed.Load())
		}
	})
	return 0
}

// startRawClaims starts the raw-claims helper for cfg's instance with
// extra arguments, tells seen its pid before it claims anything, and
// waits until it is ready.
func startRawClaims(t *testing.T, cfg primary.Config, seen func(pid int), extra ...string) *testproc.Proc {
	t.Helper()
	h := testproc.Start(t, "raw-claims", append([]string{cfg.Prefix, cfg.RuntimeDir}, extra...))
	seen(h.PID())
	h.Expect("ready", 0)
	return h
}

// costlyMemory starts a primary in single-page mode with pages pages of
// 4 KiB, allocates them all as one region and registers each page as an
// MR of its own, here: a registration of chunks that span the region
// takes a step per page each.
func costlyMemory(t *testing.T, pages int) (*primary.Primary, primary.Config, hugetlb.Region) {
	t.Helper()
	p, cfg := startPrimary(t, testenv.Tmpfs(t), func(c *primary.Config) {
		c.SinglePage, c.MemoryPages, c.PageSize = true, pages, 4096
	})
	region, err := p.Alloc(uint64(pages) * 4096)
	require.NoError(t, err)
	q := p.NewQueue()
	defer q.Close()
	for i := range uintptr(pages) {
		_, err := q.Lookup(region.Addr + i*4096)
		require.NoError(t, err)
	}
	return p, cfg, region
}

// until waits until n is at least want (see waitUntil).
func until(t *testing.T, n func() int, want int, what string) {
	t.Helper()
	waitUntil(t, fmt.Sprintf("%s: %d", what, want), func() bool { return n() >= want })
}

// processTurns waits until the primary has attached attachments (see
// waitUntil), and returns the references its process turns hold then, by
// pid.
func processTurns(t *testing.T, p *primary.Primary, attached int) map[int]int {
	t.Helper()
	var refs map[int]int
	waitUntil(t, fmt.Sprintf("%d attachments", attached), func() bool {
		var n int
		refs, n = primary.ProcessTurns(p)
		return n == attached
	})
	return refs
}

// A process that detaches an attachment with registrations under way on
// its connection, which stays open, and attaches again, finds its turn
// as it left it: the detach of its last attachment forgot the turn while
// those registrations still used it, and each new attachment made a
// fresh one, so that after four such rounds four of its registrations
// held a process turn at once.
func TestAProcessTurnOutlivesADetachWhileItsRegistrationsRun(t *testing.T) {
	const pages, rounds = 2000, 4
	var mu sync.Mutex
	flooder, queued, holding, most := -1, 0, 0, 0
	t.Cleanup(primary.SetMempoolTurns(func(event string, pid int) { // restored after the primary closes
		mu.Lock()
		defer mu.Unlock()
		if pid != flooder {
			return
		}
		switch event {
		case "queue":
			queued++
		case "wait": // holds its process's turn, queued for the primary's
			holding++
			most = max(most, holding)
		case "end", "left": // gives the primary's turn back, or the detach stopped it
			holding--
		}
	}))
	_, cfg, region := costlyMemory(t, pages)
	h := startRawClaims(t, cfg, func(pid int) { mu.Lock(); flooder = pid; mu.Unlock() })
	for i := range rounds {
		require.Equal(t, fmt.Sprintf("claimed %d", i), ask(t, h, "claim"))
		mu.Lock()
		before := queued
		mu.Unlock()
		require.Equal(t, fmt.Sprintf("flooding %d", i), ask(t, h, "flood %d %d %d 2500", i, region.Addr, pages*4096))
		// Every registration of the connection queued, before it detaches.
		until(t, func() int { mu.Lock(); defer mu.Unlock(); return queued - before }, ipc.DefaultMaxInflight, "registrations queued")
		require.Equal(t, fmt.Sprintf("detached %d <nil>", i), ask(t, h, "detach %d", i))
	}
	h.Kill()
	require.Error(t, h.Wait(0))
	mu.Lock()
	defer mu.Unlock()
	assert.Equal(t, 1, most, "registrations of one process holding a process turn at once, after %d rounds", rounds)
}

// An attachment dropped for a memory sync it failed, or did not answer in
// time, let go of its process's turn: the drop took it out of the
// attachments without, and its connection's end found nothing to let go,
// so each dropped process's turn stayed, referenced by nobody.
func TestADroppedAttachmentLetsGoOfItsProcessTurn(t *testing.T) {
	t.Run("refusing syncs", func(t *testing.T) {
		p, cfg := startPrimary(t, testenv.Tmpfs(t))
		for range 3 {
			h := startRawClaims(t, cfg, func(int) {}, "refuse")
			require.Equal(t, "claimed 0", ask(t, h, "claim"))
			require.Len(t, processTurns(t, p, 1), 1)
			_, err := p.Alloc(p.Backend().PageSize) // its sync fails: dropped
			require.NoError(t, err)
			h.Kill()
			require.Error(t, h.Wait(0))
			assert.Empty(t, processTurns(t, p, 0), "process turns kept after the dropped process went")
		}
	})
	t.Run("stalled", func(t *testing.T) {
		p, cfg := startPrimary(t, testenv.Tmpfs(t), func(c *primary.Config) { c.SyncTimeout = 200 * time.Millisecond })
		s := startSecondary(t, cfg)
		require.Len(t, processTurns(t, p, 1), 1)
		s.Stop()
		_, err := p.Alloc(p.Backend().PageSize) // it does not answer in time: dropped
		require.NoError(t, err)
		s.Continue()
		s.Kill()
		require.Error(t, s.Wait(0))
		assert.Empty(t, processTurns(t, p, 0), "process turns kept after the stalled process was dropped and went")
	})
}

// A detach stops the registrations under way on its connection: they
// were for an attachment that has left, and ran to their end, each of
// millions of steps, taking turns with everyone else's.
func TestADetachStopsItsConnectionsRegistrations(t *testing.T) {
	ev, h, region := startWatchedClaims(t)
	require.Equal(t, "claimed 0", ask(t, h, "claim"))
	require.Equal(t, "flooding 0", ask(t, h, "flood 0 %d %d 2500", region.Addr, watchedPages*4096))
	until(t, func() int { return ev.count("queue") }, ipc.DefaultMaxInflight, "registrations queued")
	require.Equal(t, "detached 0 <nil>", ask(t, h, "detach 0"))
	before := ev.count("start")
	assert.Regexp(t, `^flood-ended \d+ 64$`, ask(t, h, "flood-end 0"), "every registration under way fails")
	// One may have taken its turn as the detach was answered.
	assert.LessOrEqual(t, ev.count("start")-before, 1, "turns that registrations of the detached attachment took after its detach")
}

// A registration of an attachment that left, behind the live ones of its
// process, gives up as its process's turn comes, without queueing for the
// primary's first: a process flooding on two connections, one of them
// detached, put each of the detached one's registrations in the
// primary's queue once more, for nothing.
func TestAStaleRegistrationDoesNotQueueForThePrimarysTurn(t *testing.T) {
	ev, h, region := startWatchedClaims(t)
	for i := range 2 {
		require.Equal(t, fmt.Sprintf("claimed %d", i), ask(t, h, "claim"))
		require.Equal(t, fmt.Sprintf("flooding %d", i), ask(t, h, "flood %d %d %d 10", i, region.Addr, watchedPages*4096))
	}
	until(t, func() int { return ev.count("queue") }, 2*ipc.DefaultMaxInflight, "registrations queued")
	require.Equal(t, "detached 0 <nil>", ask(t, h, "detach 0"))
	assert.Regexp(t, `^flood-ended \d+ 64$`, ask(t, h, "flood-end 0"), "every registration of the detached attachment fails")
	// "left" comes only after the detach, and the one that held the
	// process's turn as it came may have been queued for, or at work in,
	// the primary's.
	assert.LessOrEqual(t, ev.count("left"), 1, "registrations of the detached attachment that queued for the primary's turn after it left")
}

// watchedPages is how many pages startWatchedClaims registers.
const watchedPages = 2000

// startWatchedClaims starts a primary with watchedPages pages registered
// one MR each (see costlyMemory) and the raw-claims helper for it, and
// counts the turns' events of the helper's registrations.
func startWatchedClaims(t *testing.T) (*turnEvents, *testproc.Proc, hugetlb.Region) {
	t.Helper()
	ev := &turnEvents{}
	t.Cleanup(primary.SetMempoolTurns(ev.see)) // restored after the primary closes
	_, cfg, region := costlyMemory(t, watchedPages)
	return ev, startRawClaims(t, cfg, ev.watch), region
}

// turnEvents counts the mempool turns' events of the watched process, by
// name, from the hook (see).
type turnEvents struct {
	mu  sync.Mutex
	pid int
	n   map[string]int
}

func (e *turnEvents) watch(pid int) { e.mu.Lock(); e.pid = pid; e.mu.Unlock() }

func (e *turnEvents) see(event string, pid int) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if pid == e.pid && pid != 0 {
		if e.n == nil {
			e.n = map[string]int{}
		}
		e.n[event]++
	}
}

func (e *turnEvents) count(event string) int { e.mu.Lock(); defer e.mu.Unlock(); return e.n[event] }
