package secondary_test

import (
	"fmt"
	"log/slog"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/primary"
	"github.com/mpmr/mpmr/secondary"
)

func init() { testproc.Register("churn-primary", helperChurnPrimary) }

// helperChurnPrimary runs a primary (args: prefix, runtime directory) on
// tmpfs with a page allocated, whose address it prints with "ready". It
// answers "state" with what it counts ("state SECONDARIES FENCED DROPS
// QUARANTINED"), "churn" with the same after allocating and freeing a
// page, and "churn on" / "churn off" by starting and stopping a loop that
// does that without pause ("churn off" answers with the loop's failures).
func helperChurnPrimary(args []string) int {
	p, err := primary.Start(primary.Config{Prefix: args[0], RuntimeDir: args[1], Backend: hugetlb.Tmpfs,
		MemoryPages: 16, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer p.Close()
	r, err := p.Alloc(p.Backend().PageSize)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	churn := func() error {
		r, err := p.Alloc(p.Backend().PageSize)
		if err == nil {
			err = p.Free(r)
		}
		return err
	}
	state := func() string {
		st := p.Stats()
		return fmt.Sprintf("state %d %d %d %d", st.Counters.Secondaries, st.Counters.Fenced, st.Counters.SyncDrops,
			p.Memory().Quarantined())
	}
	var stop chan struct{}
	var loop sync.WaitGroup
	var failed atomic.Int64
	testproc.Say("ready %d", r.Addr)
	testproc.EachCommand(func(l testproc.Line) {
		switch {
		case l.Name == "state":
		case l.Name == "churn" && len(l.Args) == 0:
			if err := churn(); err != nil {
				fmt.Fprintln(os.Stderr, err)
				failed.Add(1)
			}
		case l.Name == "churn" && l.Args[0] == "on":
			stop = make(chan struct{})
			loop.Go(func() {
				for {
					select {
					case <-stop:
						return
					default:
					}
					if err := churn(); err != nil {
						fmt.Fprintln(os.Stderr, err)
						failed.Add(1)
					}
				}
			})
		case l.Name == "churn" && l.Args[0] == "off":
			close(stop)
			loop.Wait()
		}
		testproc.Say("%s failed %d", state(), failed.Load())
	})
	return 0
}

// churnState is what the churn primary counts.
type churnState struct{ secondaries, fenced, drops, quarantined, failed int }

func askChurnPrimary(t *testing.T, p *testproc.Proc, cmd string) churnState {
	t.Helper()
	p.Send("%s", cmd)
	var st churnState
	line := p.Expect("state ", 0)
	_, err := fmt.Sscanf(line, "state %d %d %d %d failed %d", &st.secondaries, &st.fenced, &st.drops, &st.quarantined, &st.failed)
	require.NoError(t, err, "%q", line)
	return st
}

func startChurnPrimary(t *testing.T) (*testproc.Proc, secondary.Config, uint64) {
	t.Helper()
	testenv.Tmpfs(t)
	cfg := secondary.Config{Prefix: testenv.Prefix(t), RuntimeDir: testenv.RunDir(t), Logger: slog.New(slog.DiscardHandler)}
	p := testproc.Start(t, "churn-primary", []string{cfg.Prefix, cfg.RuntimeDir})
	t.Cleanup(func() { p.End(0) }) // a clean exit removes the instance's files
	var addr uint64
	_, err := fmt.Sscanf(p.Expect("ready", 0), "ready %d", &addr)
	require.NoError(t, err)
	return p, cfg, addr
}

// A secondary that closes while the primary frees and allocates memory
// without pause detaches in the middle of syncs: a sync that found it in
// the sync set meets its connection closed just after its detach was
// answered. It detached, with its memory unmapped: it is neither dropped
// nor fenced for that, even when its next attachment holds the same slot,
// and nothing the primary frees waits in quarantine for it.
func TestClosingDuringMemoryChangesIsNoDrop(t *testing.T) {
	p, cfg, _ := startChurnPrimary(t)
	askChurnPrimary(t, p, "churn on")
	for i := range 100 {
		s, err := secondary.Attach(cfg)
		require.NoError(t, err, "attach %d", i)
		require.NoError(t, s.Close(), "close %d", i)
	}
	st := askChurnPrimary(t, p, "churn off")
	require.Zero(t, st.failed, "the primary's allocations and frees failed:\n%s", p.Stderr())
	require.Zero(t, st.drops, "secondaries that detached were dropped")
	require.Zero(t, st.fenced, "secondaries that detached were fenced")
	require.Zero(t, st.quarantined, "freed pages wait in quarantine for secondaries that detached")
}

// A secondary whose primary is stopped closes within its RequestTimeout,
// its detach unanswered, and attaches again; the primary resumes with the
// old attachment's creates queued ahead of its detach on the call lane and
// the end of its connection seen at once. The old attachment had unmapped
// its memory and said so: the primary must not fence the process for it
// (the fence would last as long as the process, which maps the memory
// again), and what it frees must not wait in quarantine.
func TestReattachAfterAnUnansweredDetachIsNotFenced(t *testing.T) {
	for round := range 3 {
		p, cfg, addr := startChurnPrimary(t)
		cfg.RequestTimeout = 300 * time.Millisecond
		s, err := secondary.Attach(cfg)
		require.NoError(t, err)
		_, err = s.CreateMR(addr)
		require.NoError(t, err)

		p.Stop()
		var wg sync.WaitGroup
		for range 100 {
			wg.Go(func() { _, _ = s.CreateMR(addr) }) // each fails at its deadline
		}
		wg.Wait()
		require.NoError(t, s.Close()) // its detach times out
		again := make(chan *secondary.Secondary, 1)
		go func() {
			s, err := secondary.Attach(cfg)
			if err != nil {
				t.Errorf("round %d: attach again: %v", round, err)
			}
			again <- s
		}()
		p.Continue()
		if s = <-again; s == nil {
			t.FailNow()
		}

		// The old attachment leaves the primary's count once it is judged
		// (fenced or not): only then is the count below final.
		deadline := time.Now().Add(testproc.DefaultTimeout) // a hang guard
		for st := askChurnPrimary(t, p, "state"); st.secondaries != 1; st = askChurnPrimary(t, p, "state") {
			require.True(t, time.Now().Before(deadline), "round %d: %d secondaries counted", round, st.secondaries)
		}
		st := askChurnPrimary(t, p, "churn")
		require.Zero(t, st.fenced, "round %d: the process was fenced for an attachment that detached:\n%s", round, p.Stderr())
		require.Zero(t, st.quarantined, "round %d: freed pages wait in quarantine for a healthy process", round)
		require.Zero(t, st.failed, "round %d: the primary's allocations and frees failed:\n%s", round, p.Stderr())
		require.NoError(t, s.Close())
		p.End(0)
	}
}
