package instance

import (
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
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
