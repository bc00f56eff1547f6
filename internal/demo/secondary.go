package demo

import (
	"context"
	"errors"
	"fmt"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/mpmr/mpmr/secondary"
	"github.com/mpmr/mpmr/verbs"
)

// RunSecondary attaches to the primary and runs o.Queues queues for
// o.Duration. Each queue repeatedly takes two buffers, writes a payload
// into one, looks up both keys and has the soft device copy the payload
// over (which validates both elements, as an HCA would), checks the copy,
// and gives the buffers back. Every so often it also looks up the scratch
// region the primary churns and validates the key, unless the region
// changed meanwhile. It prints a progress line each second and its Summary
// at the end.
func RunSecondary(ctx context.Context, o Options) (Summary, error) {
	sum := Summary{Role: "secondary", PID: os.Getpid()}
	s, err := secondary.Attach(secondary.Config{Prefix: o.Prefix, RuntimeDir: o.RuntimeDir, Logger: o.Logger})
	if err != nil {
		return sum, err
	}
	defer s.Close()
	if s.Device() == nil {
		return sum, fmt.Errorf("the workload validates through the soft device; the primary uses %s", s.DeviceName())
	}
	pool, err := s.Pool(PoolName)
	if err != nil {
		return sum, err
	}
	sc, err := openScratch(s.Segment())
	if err != nil {
		return sum, err
	}
	ctx, cancel := context.WithTimeout(ctx, o.Duration)
	defer cancel()

	var (
		copies, checks, valErrs atomic.Uint64
		errMu                   sync.Mutex
		errs                    []string
		wg                      sync.WaitGroup
	)
	fail := func(err error) {
		errMu.Lock()
		defer errMu.Unlock()
		if len(errs) < 10 {
			errs = append(errs, err.Error())
		}
	}
	start := time.Now()
	for qi := range o.Queues {
		q := s.NewQueue()
		if err := s.RegisterMempool(q, pool); err != nil {
			return sum, fmt.Errorf("queue %d: %w", qi, err)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer q.Close()
			w := worker{Mover: Mover{Dev: s.Device(), Q: q, Pool: pool, Size: uint32(o.BufSize), Seed: byte(qi + 1)},
				s: s, q: q, sc: sc}
			for i := 0; ctx.Err() == nil; i++ {
				if err := w.Move(); err != nil {
					if errors.Is(err, verbs.ErrLocalProtection) || errors.Is(err, verbs.ErrInvalidKey) ||
						errors.Is(err, verbs.ErrLocalAccess) || errors.Is(err, verbs.ErrLength) {
						valErrs.Add(1)
					}
					fail(err)
					if errors.Is(err, secondary.ErrPrimaryGone) {
						return
					}
					continue
				}
				copies.Add(1)
				if i%256 == 0 {
					// More queues than cores: let the IPC reader run
					// before the scheduler's 10 ms time slice is up.
					runtime.Gosched()
				}
				if sc != nil && i%64 == 0 {
					if checked, err := w.checkScratch(); err != nil {
						valErrs.Add(1)
						fail(err)
					} else if checked {
						checks.Add(1)
					}
				}
			}
		}()
	}

	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	var last uint64
	for running := true; running; {
		select {
		case <-done:
			running = false
		case <-tick.C:
			st := s.Stats().Counters
			fmt.Fprintf(o.Out, "pid %d: %d lookups/s, %d copies, %d invalidations seen, %d validation failures\n",
				os.Getpid(), st.Lookups-last, copies.Load(), st.Flushes, valErrs.Load())
			last = st.Lookups
		}
	}
	s.ReportValidationErrors(valErrs.Load())
	st := s.Stats().Counters
	sum.Seconds = time.Since(start).Seconds()
	sum.Lookups, sum.TopHits, sum.BottomHits = st.Lookups, st.TopHits, st.BottomHits
	sum.GlobalHits, sum.Created, sum.Invalidations = st.GlobalHits, st.Created, st.Flushes
	sum.CreateP50, sum.CreateP99 = st.LatencyP50, st.LatencyP99
	sum.Copies, sum.ChurnChecks, sum.ValidationErrors = copies.Load(), checks.Load(), valErrs.Load()
	sum.Errors = errs
	fmt.Fprintln(o.Out, sum.line())
	return sum, nil
}

// worker is one queue's datapath.
type worker struct {
	Mover
	s  *secondary.Secondary
	q  *secondary.Queue
	sc *scratch
}

// checkScratch looks up a key for the churned region and validates it,
// touching no byte of it. A failure counts only if the region did not
// change while the lookup and the validation ran.
func (w *worker) checkScratch() (bool, error) {
	seq, addr, length, ok := w.sc.read()
	if !ok {
		return false, nil
	}
	a := uintptr(addr + length/2)
	k, err := w.q.Lookup(a)
	if err == nil {
		err = w.s.Device().Validate(verbs.SGE{Addr: a, Len: 64, Key: k}, verbs.AccessLocalWrite)
	}
	if w.sc.changed(seq) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("scratch region 0x%x: %w", addr, err)
	}
	return true, nil
}
