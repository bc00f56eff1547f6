package scenario

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/test/harness"
	"github.com/mpmr/mpmr/internal/test/testenv"
)

// Once the primary's Free returns, no lookup that starts afterwards, in
// any process, returns a key for the freed region; and every key of a live
// region validates on the device.
//
// The primary (this process) runs rounds on the board: allocate a region
// of 1 to 3 pages (usually where the last one was), register it, publish
// it, wait until the secondaries have looked it up a few hundred times,
// then free it, counting the free on the board before Free is called and
// once it has returned. Two secondaries with two queues each look up random
// addresses of the newest region without pause; before each lookup a queue
// reads how many Frees have returned, and the key it gets must belong to a
// later round (keys map back to rounds through the board). The queues'
// caches never ask the primary to create MRs (a miss in the global table is
// a miss), so each round has exactly the one MR the primary registered and
// recorded; creation across processes is exercised by the other scenarios.
func TestInvalidationAcrossProcesses(t *testing.T) {
	testenv.ForEachBackend(t, 8, func(t *testing.T, b hugetlb.Backend) {
		s := harness.New(t, b)
		p := s.StartPrimary()
		board, err := harness.NewBoard(p)
		require.NoError(t, err)
		const secondaries, queues = 2, 2
		var secs []*harness.Proc
		for i := range secondaries {
			sec := s.StartSecondary()
			require.NoError(t, sec.Post("work", harness.WorkSpec{Queues: queues, Worker: i * queues, Limit: 5 * time.Minute}))
			secs = append(secs, sec)
		}

		minRounds := harness.Pick(150, 3000)
		minLookups := harness.Pick[uint64](100_000, 5_000_000)
		perRound := max(minLookups/uint64(minRounds), 200)
		start := time.Now()
		var roundErr error
		for i := 0; roundErr == nil && (i < minRounds || board.Lookups() < minLookups); i++ {
			_, roundErr = board.Round(harness.RoundOptions{Pages: 1 + i%3, While: func() error {
				return board.WaitLookups(perRound, 10*time.Second)
			}})
		}
		board.Stop()
		elapsed := time.Since(start)

		var total harness.WorkResult
		for i, sec := range secs {
			var r harness.WorkResult
			require.NoError(t, sec.Answer(&r, time.Minute), "secondary %d", i)
			assert.Zero(t, r.Stale, "secondary %d: keys of freed regions: %v", i, r.Problems)
			assert.Zero(t, r.ValidationFailures, "secondary %d: keys of live regions refused: %v", i, r.Problems)
			assert.Zero(t, r.Errors, "secondary %d: %v", i, r.Problems)
			assert.NotZero(t, r.Flushes, "secondary %d saw invalidations", i)
			total.Checks += r.Checks
			total.Hits += r.Hits
			total.Misses += r.Misses
			total.Validated += r.Validated
			total.Raced += r.Raced
			total.Flushes += r.Flushes
		}
		require.NoError(t, roundErr)
		assert.GreaterOrEqual(t, total.Hits, minLookups)
		assert.NotZero(t, total.Validated)
		gst := p.Global().Stats()
		assert.GreaterOrEqual(t, gst.Invalidations, uint64(board.Rounds()), "every Free invalidated")
		t.Logf("%d rounds in %v: %d lookups across processes (%d hits, %d misses after a free), %d keys validated, %d refused after their Free began, %d cache flushes; %d invalidations in the primary",
			board.Rounds(), elapsed.Round(time.Millisecond), total.Checks, total.Hits, total.Misses,
			total.Validated, total.Raced, total.Flushes, gst.Invalidations)
	})
}
