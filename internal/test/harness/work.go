package harness

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/mpmr/mpmr/cache"
	"github.com/mpmr/mpmr/secondary"
	"github.com/mpmr/mpmr/shm"
	"github.com/mpmr/mpmr/verbs"
)

// noCreate is the create path of the caches workloads check the board
// with: they never ask the primary to register memory. Otherwise a lookup
// of a region the primary is registering could register part of it first
// (under a key the board does not know), or a stale request for a freed
// address could land on the next round's region; with it, every MR those
// caches see is the one the primary registered for its round.
type noCreate struct{}

func (noCreate) CreateMR(addr uint64) (cache.Entry, error) {
	return cache.Entry{LKey: cache.InvalidKey}, cache.ErrNoMemory
}

func (noCreate) RegisterExternal(addr, length uint64) (cache.Entry, error) {
	return cache.Entry{LKey: cache.InvalidKey}, cache.ErrExternalMemory
}

// problems collects descriptions of failures, keeping the first few.
type problems struct {
	mu   sync.Mutex
	list []string
}

const maxProblems = 20

func (p *problems) add(format string, args ...any) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.list) < maxProblems {
		p.list = append(p.list, fmt.Sprintf(format, args...))
	}
}

func (p *problems) get() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]string(nil), p.list...)
}

// HammerArgs has goroutines, each with its own queue, make N operations on
// addresses spread over [Addr, Addr+Len): a lookup and validation, or with
// Create a create request straight to the primary (so that every operation
// is a request in flight).
type HammerArgs struct {
	Goroutines int    `json:"goroutines"`
	N          int    `json:"n"`
	Addr       uint64 `json:"addr"`
	Len        uint64 `json:"len"`
	Create     bool   `json:"create"`
}

// HammerResult counts a hammer's operations. A goroutine stops at its
// first ErrPrimaryGone.
type HammerResult struct {
	Ops      uint64   `json:"ops"`
	Failures uint64   `json:"failures"`
	Gone     uint64   `json:"gone"`    // goroutines stopped by ErrPrimaryGone
	GoneAt   int64    `json:"gone_at"` // first such failure, Unix nanoseconds
	Problems []string `json:"problems,omitempty"`
}

func hammer(sh *secHelper, a HammerArgs) HammerResult {
	var (
		res   HammerResult
		ops   atomic.Uint64
		fails atomic.Uint64
		gone  atomic.Uint64
		first atomic.Int64
		probs problems
		wg    sync.WaitGroup
	)
	s := sh.s
	for g := range a.Goroutines {
		wg.Add(1)
		go func() {
			defer wg.Done()
			q := s.NewQueue()
			defer q.Close()
			for i := range a.N {
				addr := a.Addr + (uint64(g)*7919+uint64(i)*104729)*64%a.Len
				var err error
				if a.Create {
					_, err = s.CreateMR(addr)
				} else {
					var k uint32
					if k, err = q.Lookup(uintptr(addr)); err == nil {
						err = s.Device().Validate(verbs.SGE{Addr: uintptr(addr), Len: 1, Key: k}, verbs.AccessLocalWrite)
					}
				}
				ops.Add(1)
				if err == nil {
					continue
				}
				if errors.Is(err, secondary.ErrPrimaryGone) {
					first.CompareAndSwap(0, time.Now().UnixNano())
					gone.Add(1)
					return
				}
				fails.Add(1)
				probs.add("0x%x: %v", addr, err)
			}
		}()
	}
	wg.Wait()
	res.Ops, res.Failures, res.Gone, res.GoneAt, res.Problems = ops.Load(), fails.Load(), gone.Load(), first.Load(), probs.get()
	return res
}

// FloodArgs has goroutines send N create requests in all, for Addrs in
// turn.
type FloodArgs struct {
	Goroutines int      `json:"goroutines"`
	N          int      `json:"n"`
	Addrs      []uint64 `json:"addrs"`
}

// FloodResult counts a flood's answers by kind.
type FloodResult struct {
	Requests uint64        `json:"requests"`
	NoMemory uint64        `json:"no_memory"` // answered with cache.ErrNoMemory
	Created  uint64        `json:"created"`   // answered with a key
	Other    uint64        `json:"other"`
	Problems []string      `json:"problems,omitempty"`
	P50      time.Duration `json:"p50"`
	Max      time.Duration `json:"max"`
}

func flood(s *secondary.Secondary, a FloodArgs) FloodResult {
	var (
		next              atomic.Int64
		noMem, ok, others atomic.Uint64
		probs             problems
		mu                sync.Mutex
		times             Durations
		wg                sync.WaitGroup
	)
	for range a.Goroutines {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var mine Durations
			for i := next.Add(1) - 1; i < int64(a.N); i = next.Add(1) - 1 {
				addr := a.Addrs[i%int64(len(a.Addrs))]
				start := time.Now()
				_, err := s.CreateMR(addr)
				mine = append(mine, time.Since(start))
				switch {
				case err == nil:
					ok.Add(1)
					probs.add("0x%x: registered", addr)
				case errors.Is(err, cache.ErrNoMemory):
					noMem.Add(1)
				default:
					others.Add(1)
					probs.add("0x%x: %v", addr, err)
				}
			}
			mu.Lock()
			times = append(times, mine...)
			mu.Unlock()
		}()
	}
	wg.Wait()
	return FloodResult{Requests: uint64(len(times)), NoMemory: noMem.Load(), Created: ok.Load(), Other: others.Load(),
		Problems: probs.get(), P50: times.Quantile(0.5), Max: times.Max()}
}

// WorkSpec is a workload of Queues queues (a goroutine each) that runs
// until the board says stop (or Limit passes). Each iteration copies a
// payload between two buffers of mempool Pool through the soft device
// (looking up both keys, as a driver's datapath does) if Pool is set, and
// every CheckEvery iterations checks the region the board publishes: it
// reads the board's count of finished Frees, looks up a random address of
// the newest region, and requires the key to belong to a round that was
// not freed before the lookup started, and to validate on the device
// unless that round's Free had begun by then. Checks look up through a
// local cache of their own that never asks the primary to create an MR
// (see noCreate), over the same global table; copies use the secondary's
// regular queue.
type WorkSpec struct {
	Queues      int           `json:"queues"`
	Worker      int           `json:"worker"` // board counter of the first queue
	Pool        string        `json:"pool"`
	BufSize     int           `json:"buf_size"`
	CheckEvery  int           `json:"check_every"`
	SampleEvery time.Duration `json:"sample_every"` // 0: no samples
	Limit       time.Duration `json:"limit"`        // default 1 h
}

// WorkResult is what a workload did.
type WorkResult struct {
	Seconds float64 `json:"seconds"`
	// Lookups made by the queues, checks and copies together.
	Lookups uint64 `json:"lookups"`
	// Checks of the board's region: hits found a key, misses none (the
	// region was freed: cache.ErrNoMemory).
	Checks uint64 `json:"checks"`
	Hits   uint64 `json:"hits"`
	Misses uint64 `json:"misses"`
	// Stale counts keys of rounds freed before the lookup started (or of
	// no round at all): each is a broken invalidation.
	Stale uint64 `json:"stale"`
	// Of the hits: keys the device accepted; keys it refused after their
	// round's Free had begun (a legitimate race); keys it refused although
	// their round was live (a failure).
	Validated          uint64 `json:"validated"`
	Raced              uint64 `json:"raced"`
	ValidationFailures uint64 `json:"validation_failures"`
	Copies             uint64 `json:"copies"`
	CopyFailures       uint64 `json:"copy_failures"`
	// Errors counts other failed operations.
	Errors uint64 `json:"errors"`
	// Flushes is how often the caches saw the generation move.
	Flushes  uint64   `json:"flushes"`
	Problems []string `json:"problems,omitempty"`
	Samples  []Sample `json:"samples,omitempty"`
}

// Failures is the number of failed operations of every kind.
func (r WorkResult) Failures() uint64 {
	return r.Stale + r.ValidationFailures + r.CopyFailures + r.Errors
}

// counters are a workload's totals, added to by every queue.
type counters struct {
	lookups, checks, hits, misses, stale         atomic.Uint64
	validated, raced, valFails, copies, copyFail atomic.Uint64
	errs                                         atomic.Uint64
}

func work(s *secondary.Secondary, spec WorkSpec) (WorkResult, error) {
	if spec.Limit <= 0 {
		spec.Limit = time.Hour
	}
	board, err := openBoard(s.Segment())
	if err != nil {
		return WorkResult{}, err
	}
	if board == nil {
		return WorkResult{}, errors.New("harness: work needs a board in the segment")
	}
	var pool *cache.Pool
	if spec.Pool != "" {
		if pool, err = s.Pool(spec.Pool); err != nil {
			return WorkResult{}, err
		}
		spec.BufSize = min(max(spec.BufSize, 64), int(pool.ObjSize()))
	} else {
		spec.CheckEvery = 1
	}
	start := time.Now()
	deadline := start.Add(spec.Limit)
	var (
		c       counters
		probs   problems
		wg      sync.WaitGroup
		workers []*worker
		done    = make(chan struct{})
	)
	for i := range spec.Queues {
		q := s.NewQueue()
		if pool != nil {
			if err := s.RegisterMempool(q, pool); err != nil {
				return WorkResult{}, fmt.Errorf("queue %d: %w", i, err)
			}
		}
		w := &worker{s: s, q: q, checkQ: cache.NewLocal(s.Global(), noCreate{}, 0), board: board, line: spec.Worker + i,
			c: &c, probs: &probs, rng: rand.New(rand.NewPCG(uint64(os.Getpid()), uint64(i)))}
		if pool != nil {
			w.mover = &mover{dev: s.Device(), q: q, pool: pool, size: uint32(spec.BufSize), seed: byte(i)}
		}
		workers = append(workers, w)
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer q.Close()
			w.run(spec.CheckEvery, deadline)
		}()
	}
	var samples []Sample
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		if spec.SampleEvery <= 0 {
			return
		}
		t := time.NewTicker(spec.SampleEvery)
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-t.C:
				samples = append(samples, TakeSample(start))
			}
		}
	}()
	wg.Wait()
	close(done)
	<-sampled
	st := s.Stats().Counters
	for _, w := range workers {
		st.Flushes += w.checkQ.Stats().Flushes
	}
	return WorkResult{Seconds: time.Since(start).Seconds(), Lookups: c.lookups.Load(), Checks: c.checks.Load(),
		Hits: c.hits.Load(), Misses: c.misses.Load(), Stale: c.stale.Load(), Validated: c.validated.Load(),
		Raced: c.raced.Load(), ValidationFailures: c.valFails.Load(), Copies: c.copies.Load(),
		CopyFailures: c.copyFail.Load(), Errors: c.errs.Load(), Flushes: st.Flushes, Problems: probs.get(),
		Samples: samples}, nil
}

// worker is one queue of a workload.
type worker struct {
	s      *secondary.Secondary
	q      *secondary.Queue // copies: the secondary's regular queue
	checkQ *cache.Local     // checks: a cache that never creates
	board  *boardView
	mover  *mover // copies, when the workload has a pool
	line   int
	c      *counters
	probs  *problems
	rng    *rand.Rand
}

func (w *worker) run(checkEvery int, deadline time.Time) {
	for i := 0; ; i++ {
		if i%256 == 0 {
			if w.board.stopped() || time.Now().After(deadline) {
				return
			}
			// Let the secondary's other goroutines (the primary's memory
			// syncs above all) run without waiting for preemption.
			runtime.Gosched()
		}
		if w.mover != nil {
			w.c.lookups.Add(2)
			if err := w.mover.move(); err != nil {
				if errors.Is(err, secondary.ErrPrimaryGone) {
					w.probs.add("queue %d: %v", w.line, err)
					w.c.errs.Add(1)
					return
				}
				w.c.copyFail.Add(1)
				w.probs.add("copy: %v", err)
			} else {
				w.c.copies.Add(1)
			}
		}
		if checkEvery > 0 && i%checkEvery == 0 {
			if !w.check() {
				return
			}
		}
	}
}

// missBackoff bounds how long a check that found the region freed waits
// for the next one before it looks again.
const missBackoff = 20 * time.Millisecond

// check judges one lookup of the board's newest region; it returns false
// when the workload should end (the primary is gone).
func (w *worker) check() bool {
	b := w.board
	freed := b.freed() // every round below this was freed before the lookup starts
	pub := b.pub()
	if pub == 0 {
		return true
	}
	cur, ok := b.round(pub - 1)
	if !ok || cur.Len == 0 {
		return true
	}
	addr := cur.Addr + w.rng.Uint64N(cur.Len)
	k, err := w.checkQ.Lookup(uintptr(addr))
	w.c.lookups.Add(1)
	w.c.checks.Add(1)
	if err != nil {
		switch {
		case errors.Is(err, cache.ErrNoMemory):
			// Freed. The next region comes once the primary's Alloc has
			// synced every secondary, whose push handlers need the CPU:
			// wait for it rather than spin on the freed one.
			w.c.misses.Add(1)
			b.awaitRound(pub, missBackoff)
		case errors.Is(err, secondary.ErrPrimaryGone), errors.Is(err, shm.ErrOwnerDied):
			w.c.errs.Add(1)
			w.probs.add("queue %d: %v", w.line, err)
			return false
		default:
			w.c.errs.Add(1)
			w.probs.add("lookup of 0x%x: %v", addr, err)
		}
		return true
	}
	w.c.hits.Add(1)
	b.countLookup(w.line)
	n, found := b.owner(k)
	switch {
	case !found:
		w.c.stale.Add(1)
		b.countFailure()
		w.probs.add("lookup of 0x%x, started after %d rounds were freed, returned key 0x%x, which no round published", addr, freed, k)
		return true
	case n < freed:
		w.c.stale.Add(1)
		b.countFailure()
		r, _ := b.round(n)
		w.probs.add("lookup of 0x%x, started after round %d's Free returned, returned its key 0x%x (region [0x%x, 0x%x))",
			addr, n, k, r.Addr, r.Addr+r.Len)
		return true
	}
	if err := w.s.Device().Validate(verbs.SGE{Addr: uintptr(addr), Len: 1, Key: k}, verbs.AccessLocalWrite); err != nil {
		if b.freeing() > n {
			w.c.raced.Add(1) // its round's Free began meanwhile
		} else {
			w.c.valFails.Add(1)
			b.countFailure()
			w.probs.add("key 0x%x of live round %d for 0x%x: %v", k, n, addr, err)
		}
		return true
	}
	w.c.validated.Add(1)
	return true
}
