package harness

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
)

func TestFlat(t *testing.T) {
	steady := func(n int, f func(i int) Sample) []Sample {
		var ss []Sample
		for i := range n {
			s := f(i)
			s.At = float64(i + 1)
			ss = append(ss, s)
		}
		return ss
	}
	flat := steady(60, func(i int) Sample { return Sample{Goroutines: 10 + i%3, FDs: 13, RSSKiB: 12<<10 + int64(i%5)*100} })
	problems, summary := Flat(flat, true)
	assert.Empty(t, problems, summary)

	for name, c := range map[string]struct {
		f    func(i int) Sample
		want string
	}{
		"descriptor leak": {func(i int) Sample { return Sample{Goroutines: 10, FDs: 13 + i/10, RSSKiB: 12 << 10} }, "descriptors"},
		"goroutine leak":  {func(i int) Sample { return Sample{Goroutines: 10 + i, FDs: 13, RSSKiB: 12 << 10} }, "goroutines"},
		"memory leak":     {func(i int) Sample { return Sample{Goroutines: 10, FDs: 13, RSSKiB: 12<<10 + int64(i)<<8} }, "RSS"},
	} {
		problems, _ := Flat(steady(60, c.f), true)
		if assert.Len(t, problems, 1, name) {
			assert.Contains(t, problems[0], c.want, name)
		}
	}
	leaky := steady(60, func(i int) Sample { return Sample{Goroutines: 10, FDs: 13, RSSKiB: 12<<10 + int64(i)<<8} })
	problems, _ = Flat(leaky, false)
	assert.Empty(t, problems, "RSS not checked")
	problems, _ = Flat(leaky[:3], true)
	assert.NotEmpty(t, problems, "too few samples")
}

func TestDurations(t *testing.T) {
	var d Durations
	assert.Equal(t, "no samples", d.String())
	for i := 100; i >= 1; i-- {
		d = append(d, time.Duration(i)*time.Millisecond)
	}
	assert.Equal(t, 51*time.Millisecond, d.Quantile(0.5), "nearest rank")
	assert.Equal(t, time.Millisecond, d.Quantile(0))
	assert.Equal(t, 100*time.Millisecond, d.Quantile(1))
	assert.Equal(t, 100*time.Millisecond, d.Max())
	assert.Equal(t, 100*time.Millisecond, d[0], "Quantile leaves the order alone")
}
