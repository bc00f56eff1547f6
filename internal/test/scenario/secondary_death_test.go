package scenario

import (
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/test/harness"
	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/primary"
)

// hangBound bounds every wait for something that must happen: far above
// any recovery time, it only turns a hang into a failure. Recovery times
// themselves are measured and logged, and the benchmarks report them.
const hangBound = 5 * time.Second

// Ways a secondary is killed in TestSecondaryDeath.
const (
	killHoldingReadLock = "holding the read lock" // a Free waits for it
	killMidCreate       = "mid-create"            // create requests in flight
	killMidSync         = "mid-sync"              // stopped while an Alloc waits for its ack
	killWhilePushing    = "while pushes flow"     // idle, while the primary churns memory
)

// A secondary killed with SIGKILL at any point blocks nobody for long:
// the primary's next free completes, its slot is reclaimed, and the other
// secondaries carry on. Each trial starts a victim, kills it in one of four
// situations at a random moment, and then checks all three; a background
// goroutine frees and reallocates a page throughout, so memory syncs are
// always flowing.
func TestSecondaryDeath(t *testing.T) {
	s := harness.New(t, testenv.Tmpfs(t))
	p := s.StartPrimary(func(c *primary.Config) {
		c.SinglePage = true            // every page is its own MR: creates keep registering
		c.SyncTimeout = 10 * hangBound // only the victim's death may release a sync
	})
	ps := p.Backend().PageSize
	region, err := p.Alloc(4 * ps)
	require.NoError(t, err)
	survivors := []*harness.Proc{s.StartSecondary(), s.StartSecondary()}
	for _, sv := range survivors {
		sv.MustCall("check", harness.Span{Addr: uint64(region.Addr), Len: 64}, nil)
	}
	churn := startChurn(t, p)

	seed := uint64(time.Now().UnixNano())
	rng := rand.New(rand.NewPCG(seed, 7))
	t.Logf("random seed %d", seed)
	kinds := []string{killHoldingReadLock, killMidCreate, killMidSync, killWhilePushing}
	trials := harness.Pick(52, 400)
	var (
		released = map[string]harness.Durations{} // death -> blocked operation done
		nextOp   harness.Durations                // alloc+register+free after the death
		reclaim  harness.Durations                // death -> slot free
	)
	for i := range trials {
		kind := kinds[i%len(kinds)]
		victim := s.StartSecondary()
		var killedAt time.Time
		switch kind {
		case killHoldingReadLock:
			// Register a page, have the victim take the read lock, start
			// freeing the page (its MR must go, under the write lock) and
			// kill the victim once the writer waits for it.
			x, err := p.Alloc(ps)
			require.NoError(t, err)
			_, err = p.Global().Create(uint64(x.Addr))
			require.NoError(t, err)
			require.NoError(t, victim.Post("hold-read", nil))
			victim.MustAwait("holding")
			done := goTimed(func() error { return p.Free(x) })
			require.Eventually(t, func() bool {
				st := p.Global().LockState()
				return st.WriterSlot >= 0 && st.Readers[victim.Ready.Slot] > 0
			}, hangBound, 100*time.Microsecond, "a writer waits for the victim's read hold")
			killedAt = victim.KillWithin(rng, time.Millisecond)
			d := awaitDone(t, done, killedAt, "Free after the reader's death")
			require.Positive(t, d, "trial %d: Free returned while a reader held the lock", i)
			released[kind] = append(released[kind], d)
		case killMidCreate:
			before := p.Stats().Counters.Requests
			require.NoError(t, victim.Post("hammer", harness.HammerArgs{Goroutines: 4, N: 1 << 30,
				Addr: uint64(region.Addr), Len: region.Len + 2*ps, Create: true}))
			want := before + 1 + rng.Uint64N(200)
			require.Eventually(t, func() bool { return p.Stats().Counters.Requests >= want },
				hangBound, 100*time.Microsecond, "the victim's requests reach the primary")
			killedAt = victim.Kill()
		case killMidSync:
			// Frozen, the victim cannot acknowledge the map that Alloc
			// pushes; Alloc (and the churn) wait for it until it dies.
			require.NoError(t, victim.Stop())
			done := goTimed(func() error {
				x, err := p.Alloc(ps)
				if err == nil {
					err = p.Free(x)
				}
				return err
			})
			killedAt = victim.KillWithin(rng, 3*time.Millisecond)
			d := awaitDone(t, done, killedAt, "Alloc after the frozen secondary's death")
			require.Positive(t, d, "trial %d: Alloc returned while a secondary could not acknowledge it", i)
			released[kind] = append(released[kind], d)
		case killWhilePushing:
			killedAt = victim.KillWithin(rng, 5*time.Millisecond)
		}
		require.True(t, victim.Killed(), "trial %d (%s): the victim died of SIGKILL", i, kind)

		// The victim's slot is reclaimed.
		pid := victim.PID()
		require.Eventually(t, func() bool {
			for _, proc := range p.Segment().Procs() {
				if proc.PID == pid && proc.Live {
					return false
				}
			}
			return true
		}, hangBound, 100*time.Microsecond, "trial %d (%s): the dead secondary's slot is reclaimed", i, kind)
		reclaim = append(reclaim, time.Since(killedAt))
		// The primary's next free (with an MR to invalidate) completes.
		start := time.Now()
		done := goTimed(func() error {
			x, err := p.Alloc(ps)
			if err != nil {
				return err
			}
			if _, err = p.Global().Create(uint64(x.Addr)); err != nil {
				return err
			}
			return p.Free(x)
		})
		nextOp = append(nextOp, awaitDone(t, done, start, fmt.Sprintf("trial %d (%s): alloc, register, free", i, kind)))
		// The others carry on.
		for j, sv := range survivors {
			addr := uint64(region.Addr) + rng.Uint64N(region.Len)
			require.NoError(t, sv.Call("check", harness.Span{Addr: addr, Len: 1}, nil), "trial %d (%s): survivor %d", i, kind, j)
		}
	}
	churned, churnErr := churn()
	require.NoError(t, churnErr)

	for _, sv := range survivors {
		var r harness.HammerResult
		sv.MustCall("hammer", harness.HammerArgs{Goroutines: 4, N: 2000, Addr: uint64(region.Addr), Len: region.Len}, &r)
		assert.Zero(t, r.Failures, "%v", r.Problems)
	}
	live := 0
	for _, proc := range p.Segment().Procs() {
		if proc.Live {
			live++
		}
	}
	assert.Equal(t, 1+len(survivors), live, "only the primary and the survivors hold slots")
	assert.Equal(t, len(survivors), p.Stats().Counters.Secondaries)
	for _, k := range []string{killHoldingReadLock, killMidSync} {
		t.Logf("%s: death to release of the blocked operation: %v", k, released[k])
	}
	t.Logf("alloc+register+free right after each death: %v", nextOp)
	t.Logf("death to slot reclaimed: %v", reclaim)
	t.Logf("%d trials, %d background alloc/free cycles, %d syncs dropped", trials, churned, p.Stats().Counters.SyncDrops)
}

// timed is an operation's outcome and when it finished.
type timed struct {
	at  time.Time
	err error
}

// goTimed runs fn in a goroutine and reports when it returned.
func goTimed(fn func() error) <-chan timed {
	ch := make(chan timed, 1)
	go func() {
		err := fn()
		ch <- timed{time.Now(), err}
	}()
	return ch
}

// awaitDone waits (bounded) for an operation and returns how long after
// since it finished.
func awaitDone(t testing.TB, ch <-chan timed, since time.Time, what string) time.Duration {
	t.Helper()
	select {
	case r := <-ch:
		require.NoError(t, r.err, what)
		return r.at.Sub(since)
	case <-time.After(hangBound):
		t.Fatalf("%s: not done within %v", what, hangBound)
		return 0
	}
}

// startChurn frees and reallocates a page (registering it) every
// millisecond until the returned function is called, which reports how
// many cycles ran and the first error.
func startChurn(t testing.TB, p *primary.Primary) func() (int, error) {
	var (
		wg   sync.WaitGroup
		n    int
		err  error
		stop = make(chan struct{})
	)
	ps := p.Backend().PageSize
	wg.Add(1)
	go func() {
		defer wg.Done()
		tick := time.NewTicker(time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-stop:
				return
			case <-tick.C:
			}
			var x hugetlb.Region
			if x, err = p.Alloc(ps); err != nil {
				return
			}
			if _, err = p.Global().Create(uint64(x.Addr)); err != nil {
				return
			}
			if err = p.Free(x); err != nil {
				return
			}
			n++
		}
	}()
	var once sync.Once
	finish := func() (int, error) {
		once.Do(func() { close(stop); wg.Wait() })
		return n, err
	}
	t.Cleanup(func() { finish() })
	return finish
}
