package scenario

import (
	"errors"
	"testing"
	"time"

	"github.com/mpmr/mpmr/internal/test/harness"
	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/secondary"
)

// reportMs reports a distribution's median and maximum in milliseconds.
func reportMs(b *testing.B, d harness.Durations, name string) {
	b.ReportMetric(float64(d.Quantile(0.5).Microseconds())/1000, name+"-ms-p50")
	b.ReportMetric(float64(d.Max().Microseconds())/1000, name+"-ms-max")
}

// BenchmarkFreeAfterReaderDeath measures how long after a secondary dies
// holding the global read lock a Free that waits for that lock completes
// (target: 100 ms). Each iteration starts a secondary, has it take the read
// lock, starts freeing a registered page (whose MR must be invalidated
// under the write lock), waits until the writer waits for the reader, and
// kills the reader. Reported: free-ms-p50 and free-ms-max, from SIGKILL to
// Free's return; reclaim-ms-*, from SIGKILL to the slot being free.
func BenchmarkFreeAfterReaderDeath(b *testing.B) {
	b.ReportAllocs()
	s := harness.New(b, testenv.Tmpfs(b))
	p := s.StartPrimary()
	ps := p.Backend().PageSize
	var freed, reclaimed harness.Durations
	b.ResetTimer()
	for range b.N {
		b.StopTimer()
		victim := s.StartSecondary()
		x, err := p.Alloc(ps)
		if err != nil {
			b.Fatal(err)
		}
		if _, err := p.Global().Create(uint64(x.Addr)); err != nil {
			b.Fatal(err)
		}
		if err := victim.Post("hold-read", nil); err != nil {
			b.Fatal(err)
		}
		victim.MustAwait("holding")
		done := goTimed(func() error { return p.Free(x) })
		if !waitFor(func() bool {
			st := p.Global().LockState()
			return st.WriterSlot >= 0 && st.Readers[victim.Ready.Slot] > 0
		}) {
			b.Fatal("no writer waits for the reader")
		}
		b.StartTimer()
		killedAt := victim.Kill()
		freed = append(freed, awaitDone(b, done, killedAt, "Free after the reader's death"))
		pid := victim.PID()
		if !waitFor(func() bool {
			for _, proc := range p.Segment().Procs() {
				if proc.PID == pid && proc.Live {
					return false
				}
			}
			return true
		}) {
			b.Fatal("the dead reader's slot was not reclaimed")
		}
		reclaimed = append(reclaimed, time.Since(killedAt))
	}
	b.StopTimer()
	reportMs(b, freed, "free")
	reportMs(b, reclaimed, "reclaim")
}

// BenchmarkPrimaryDeathNoticed measures how long after its primary dies a
// secondary (this process) sees PrimaryGone close (target: 50 ms; DPDK's
// secondaries learn it from a 5 s request timeout), and how long a create
// request then takes to fail with ErrPrimaryGone. Each iteration starts a
// primary process (over the previous, dead one), attaches, and kills it.
// Reported: notice-ms-p50/max and create-fail-µs-p50.
func BenchmarkPrimaryDeathNoticed(b *testing.B) {
	b.ReportAllocs()
	s := harness.New(b, testenv.Tmpfs(b))
	var noticed, failed harness.Durations
	b.ResetTimer()
	for range b.N {
		b.StopTimer()
		pp, pr := s.StartPrimaryProcess(2)
		sec, err := secondary.Attach(secondary.Config{Prefix: s.Prefix, RuntimeDir: s.RunDir, Logger: s.Logger()})
		if err != nil {
			b.Fatal(err)
		}
		if _, err := sec.NewQueue().Lookup(uintptr(pr.Addr)); err != nil {
			b.Fatal(err)
		}
		gone := make(chan time.Time, 1)
		go func() {
			<-sec.PrimaryGone()
			gone <- time.Now()
		}()
		b.StartTimer()
		killedAt := pp.Kill()
		select {
		case at := <-gone:
			noticed = append(noticed, at.Sub(killedAt))
		case <-time.After(hangBound):
			b.Fatalf("the primary's death went unnoticed for %v", hangBound)
		}
		start := time.Now()
		_, err = sec.CreateMR(pr.Addr + pr.Len)
		failed = append(failed, time.Since(start))
		if !errors.Is(err, secondary.ErrPrimaryGone) {
			b.Fatalf("create after the primary's death: %v", err)
		}
		b.StopTimer()
		if err := sec.Close(); err != nil {
			b.Fatal(err)
		}
	}
	if err := s.Recover(); err != nil {
		b.Fatal(err)
	}
	reportMs(b, noticed, "notice")
	b.ReportMetric(float64(failed.Quantile(0.5).Nanoseconds())/1000, "create-fail-µs-p50")
}

// waitFor polls cond until it holds or hangBound passes.
func waitFor(cond func() bool) bool {
	deadline := time.Now().Add(hangBound)
	for !cond() {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(50 * time.Microsecond)
	}
	return true
}
