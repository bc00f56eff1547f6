package scenario

import (
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/test/harness"
	"github.com/mpmr/mpmr/internal/test/testenv"
)

// The soak: two secondaries with four queues each copy payloads between
// mempool buffers through the soft device, and check the region the
// primary keeps freeing and reallocating, for a minute (or as long as
// asked). No validation may fail, and open descriptors, goroutines and RSS
// must stay flat in every process (see harness.Flat for the tolerances),
// sampled every second by the processes themselves (under -race, RSS is
// only reported: the detector's memory grows with every goroutine
// started). It runs on hugetlbfs when that is usable, else on tmpfs, and
// only when asked:
//
//	go test ./internal/test/scenario -run Soak -mpmr.long         # one minute
//	go test ./internal/test/scenario -run Soak -mpmr.soak=10m     # ten
//	MPMR_SOAK=10m go test ./internal/test/scenario -run Soak
func TestSoak(t *testing.T) {
	d := harness.SoakDuration()
	if d == 0 {
		t.Skip("the soak runs with -mpmr.long or -mpmr.soak=DURATION (or MPMR_LONG=1, MPMR_SOAK=DURATION)")
	}
	b, err := hugetlb.Choose(hugetlb.Want{Kind: hugetlb.Hugetlbfs, Pages: 8})
	if err != nil {
		if testenv.HugetlbRequired() {
			t.Fatalf("%s=1 but hugetlbfs is unusable: %v", testenv.RequireHugetlbEnv, err)
		}
		t.Logf("soaking on tmpfs: %v", err)
		b = testenv.Tmpfs(t)
	}
	s := harness.New(t, b)
	p := s.StartPrimary()
	pool, err := p.CreatePool("soak", 2048, 1024)
	require.NoError(t, err)
	q := p.NewQueue()
	require.NoError(t, p.RegisterMempool(q, pool))
	q.Close()
	board, err := harness.NewBoard(p)
	require.NoError(t, err)

	every := max(d/60, 250*time.Millisecond)
	const secondaries, queues = 2, 4
	var secs []*harness.Proc
	for i := range secondaries {
		sec := s.StartSecondary()
		require.NoError(t, sec.Post("work", harness.WorkSpec{Queues: queues, Worker: i * queues, Pool: "soak",
			BufSize: 2048, CheckEvery: 16, SampleEvery: every, Limit: d + time.Minute}))
		secs = append(secs, sec)
	}
	start := time.Now()
	stopSampling := sample(start, every)

	var roundErr error
	for i := 0; roundErr == nil && time.Since(start) < d; i++ {
		_, roundErr = board.Round(harness.RoundOptions{Pages: 1 + i%3, While: func() error {
			return board.WaitLookups(200, hangBound)
		}})
	}
	board.Stop()
	primarySamples := stopSampling()
	elapsed := time.Since(start)

	for i, sec := range secs {
		var r harness.WorkResult
		require.NoError(t, sec.Answer(&r, time.Minute), "secondary %d", i)
		assert.Zero(t, r.Failures(), "secondary %d: %v", i, r.Problems)
		assert.Zero(t, r.ValidationFailures, "secondary %d", i)
		assert.NotZero(t, r.Copies, "secondary %d", i)
		assert.NotZero(t, r.Validated, "secondary %d", i)
		problems, summary := harness.Flat(r.Samples, !harness.RaceEnabled)
		assert.Empty(t, problems, "secondary %d is not flat: %s", i, summary)
		t.Logf("secondary %d (pid %d): %.0f lookups/s, %d copies, %d checks (%d keys validated, %d refused after their Free began, %d misses after a free), %d flushes, failures %d; %s",
			i, sec.PID(), float64(r.Lookups)/r.Seconds, r.Copies, r.Checks, r.Validated, r.Raced, r.Misses, r.Flushes, r.Failures(), summary)
	}
	problems, summary := harness.Flat(primarySamples, !harness.RaceEnabled)
	assert.Empty(t, problems, "the primary is not flat: %s", summary)
	st := p.Stats()
	t.Logf("primary: %d rounds in %v on %s, %d invalidations, %d syncs, %d MRs live; %s",
		board.Rounds(), elapsed.Round(time.Millisecond), b.Kind, st.Global.Invalidations, st.Counters.Syncs, st.Global.MRs, summary)
	require.NoError(t, roundErr)
}

// sample takes this process's samples every interval until the returned
// function is called, which returns them.
func sample(start time.Time, every time.Duration) func() []harness.Sample {
	var (
		samples []harness.Sample
		wg      sync.WaitGroup
		stop    = make(chan struct{})
	)
	wg.Add(1)
	go func() {
		defer wg.Done()
		t := time.NewTicker(every)
		defer t.Stop()
		for {
			select {
			case <-stop:
				return
			case <-t.C:
				samples = append(samples, harness.TakeSample(start))
			}
		}
	}()
	return func() []harness.Sample {
		close(stop)
		wg.Wait()
		return samples
	}
}
