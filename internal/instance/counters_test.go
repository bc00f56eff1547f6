package instance

import (
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"

	"github.com/mpmr/mpmr/ipc"
)

func TestHistogramQuantiles(t *testing.T) {
	var h Histogram
	assert.Zero(t, h.Quantile(0.5))
	rng := rand.New(rand.NewPCG(1, 2))
	var all []time.Duration
	for range 10000 {
		d := time.Duration(rng.ExpFloat64() * float64(30*time.Microsecond))
		h.Record(d)
		all = append(all, d)
	}
	slices.Sort(all)
	for _, q := range []float64{0.5, 0.9, 0.99} {
		exact := all[int(q*float64(len(all)))-1]
		got := h.Quantile(q)
		assert.InEpsilon(t, float64(exact), float64(got), 0.13, "q=%v exact %v got %v", q, exact, got)
	}
	assert.Equal(t, all[len(all)-1], h.Max())
	assert.Equal(t, uint64(10000), h.Count())
}

func TestBucketsCoverValues(t *testing.T) {
	for _, v := range []uint64{0, 1, 7, 8, 9, 15, 16, 100, 1 << 20, 1<<40 + 12345, 1<<63 - 1} {
		b := bucketOf(v)
		assert.LessOrEqual(t, v, bucketTop(b), "value %d in bucket %d", v, b)
		if b > 0 {
			assert.Greater(t, v, bucketTop(b-1), "value %d above bucket %d", v, b-1)
		}
	}
}

// Every server statistic SetIPC copies comes back out of the counters'
// vector under its own name, the lanes' ones too.
func TestIPCCountersKeepTheirPlaces(t *testing.T) {
	var c Counters
	c.SetIPC(ipc.ServerStats{Conns: 1, RefusedConns: 2, RefusedConnsUID: 3, HelloTimeouts: 4, RefusedFiles: 5,
		RefusedFilesInFlight: 6, QueueOverflows: 7, WriteTimeouts: 8, Violations: 9, StarvedLanes: 10, IdleLanes: 11,
		ShedConns: 12})
	got := fromVector(c.vector())
	assert.Equal(t, c, got)
	m := got.Map()
	assert.Equal(t, uint64(10), m["ipc_starved_lanes"])
	assert.Equal(t, uint64(11), m["ipc_idle_lanes"])
	assert.Equal(t, uint64(12), m["ipc_shed_conns"])
	assert.Equal(t, uint64(9), m["ipc_violations"])
}
