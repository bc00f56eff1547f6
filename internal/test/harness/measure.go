package harness

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Sample is a process's resource use at one moment.
type Sample struct {
	At         float64 `json:"at"` // seconds since the workload started
	Goroutines int     `json:"goroutines"`
	FDs        int     `json:"fds"`
	RSSKiB     int64   `json:"rss_kib"`
	// The parts of RSS: anonymous memory (the Go heap above all), file
	// mappings, and shared memory (tmpfs data memory and segment).
	AnonKiB  int64 `json:"anon_kib"`
	FileKiB  int64 `json:"file_kib"`
	ShmemKiB int64 `json:"shmem_kib"`
}

// TakeSample measures this process: goroutines, open descriptors
// (/proc/self/fd) and resident set size (VmRSS and its parts, from
// /proc/self/status).
func TakeSample(since time.Time) Sample {
	st := status("self")
	return Sample{At: time.Since(since).Seconds(), Goroutines: runtime.NumGoroutine(),
		FDs: countFDs("self"), RSSKiB: st["VmRSS"], AnonKiB: st["RssAnon"], FileKiB: st["RssFile"], ShmemKiB: st["RssShmem"]}
}

// countFDs counts the open descriptors of process pid ("self" for this
// one); the directory read itself holds one, which is not counted.
func countFDs(pid string) int {
	ents, err := os.ReadDir("/proc/" + pid + "/fd")
	if err != nil {
		return -1
	}
	if pid == "self" {
		return len(ents) - 1
	}
	return len(ents)
}

// status reads the kB fields of /proc/PID/status.
func status(pid string) map[string]int64 {
	out := map[string]int64{}
	b, err := os.ReadFile("/proc/" + pid + "/status")
	if err != nil {
		return out
	}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), ":")
		v, kb := strings.CutSuffix(strings.TrimSpace(v), " kB")
		if !ok || !kb {
			continue
		}
		if n, err := strconv.ParseInt(v, 10, 64); err == nil {
			out[k] = n
		}
	}
	return out
}

// Flatness tolerances: what "flat" means for a soak. Samples of the first
// WarmupFraction of the run are ignored (caches fill, the heap finds its
// size); of the rest, the first and last thirds are compared.
const (
	WarmupFraction = 0.2
	// FDSlack: open descriptors may vary by this much over the run.
	FDSlack = 2
	// GoroutineSlack: the most goroutines of the last third may exceed
	// the most of the first third by this many (requests in flight come
	// and go).
	GoroutineSlack = 8
	// RSSGrowth and RSSSlackKiB: the mean RSS of the last third may exceed
	// that of the first third by this fraction plus this much.
	RSSGrowth   = 0.10
	RSSSlackKiB = 4 << 10
)

// Flat checks that samples (taken at regular intervals over a run) show no
// growth in descriptors, goroutines or (with rss) RSS beyond the
// tolerances above. It returns what is not flat, and a one-line summary of
// the figures.
func Flat(samples []Sample, rss bool) (problems []string, summary string) {
	if len(samples) < 6 {
		return []string{fmt.Sprintf("only %d samples: too few to judge", len(samples))}, ""
	}
	end := samples[len(samples)-1].At
	var rest []Sample
	for _, s := range samples {
		if s.At >= WarmupFraction*end {
			rest = append(rest, s)
		}
	}
	third := max(len(rest)/3, 1)
	first, last := rest[:third], rest[len(rest)-third:]

	fds := func(s Sample) int { return s.FDs }
	gs := func(s Sample) int { return s.Goroutines }
	minFD, maxFD := minMax(rest, fds)
	if maxFD-minFD > FDSlack {
		problems = append(problems, fmt.Sprintf("open descriptors range %d..%d after warm-up (slack %d)", minFD, maxFD, FDSlack))
	}
	_, g0 := minMax(first, gs)
	_, g1 := minMax(last, gs)
	if g1 > g0+GoroutineSlack {
		problems = append(problems, fmt.Sprintf("goroutines grew: at most %d early, %d late (slack %d)", g0, g1, GoroutineSlack))
	}
	r0, r1 := meanRSS(first), meanRSS(last)
	if limit := r0*(1+RSSGrowth) + RSSSlackKiB; rss && r1 > limit {
		problems = append(problems, fmt.Sprintf("RSS grew: mean %.0f KiB early, %.0f KiB late (limit %.0f KiB)", r0, r1, limit))
	}
	mean := func(ss []Sample, f func(Sample) int64) float64 {
		var sum float64
		for _, s := range ss {
			sum += float64(f(s))
		}
		return sum / float64(len(ss)) / 1024
	}
	anon := func(s Sample) int64 { return s.AnonKiB }
	file := func(s Sample) int64 { return s.FileKiB }
	shmem := func(s Sample) int64 { return s.ShmemKiB }
	summary = fmt.Sprintf("%d samples over %.0fs: fds %d..%d, goroutines %d early / %d late, RSS %.1f MiB early / %.1f MiB late (anon %.1f/%.1f, file %.1f/%.1f, shmem %.1f/%.1f)",
		len(samples), end, minFD, maxFD, g0, g1, r0/1024, r1/1024,
		mean(first, anon), mean(last, anon), mean(first, file), mean(last, file), mean(first, shmem), mean(last, shmem))
	return problems, summary
}

func minMax(ss []Sample, f func(Sample) int) (lo, hi int) {
	lo, hi = f(ss[0]), f(ss[0])
	for _, s := range ss[1:] {
		lo, hi = min(lo, f(s)), max(hi, f(s))
	}
	return lo, hi
}

func meanRSS(ss []Sample) float64 {
	var sum float64
	for _, s := range ss {
		sum += float64(s.RSSKiB)
	}
	return sum / float64(len(ss))
}

// Durations summarises measured times.
type Durations []time.Duration

// Quantile returns the q-quantile (0..1) by nearest rank.
func (d Durations) Quantile(q float64) time.Duration {
	if len(d) == 0 {
		return 0
	}
	s := slices.Clone(d)
	slices.Sort(s)
	i := int(q*float64(len(s)-1) + 0.5)
	return s[min(max(i, 0), len(s)-1)]
}

// Max returns the longest time.
func (d Durations) Max() time.Duration {
	if len(d) == 0 {
		return 0
	}
	return slices.Max(d)
}

func (d Durations) String() string {
	if len(d) == 0 {
		return "no samples"
	}
	r := func(x time.Duration) time.Duration { return x.Round(10 * time.Microsecond) }
	return fmt.Sprintf("n=%d min %v p50 %v p90 %v p99 %v max %v", len(d), r(d.Quantile(0)), r(d.Quantile(0.5)),
		r(d.Quantile(0.9)), r(d.Quantile(0.99)), r(d.Max()))
}
