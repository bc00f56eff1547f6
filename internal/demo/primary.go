package demo

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/primary"
	"github.com/mpmr/mpmr/shm"
)

// Launch says how to start a secondary process: the command line runs
// RunSecondary with the same options.
type Launch func(ctx context.Context, o Options, n int) *exec.Cmd

// RunPrimary starts the primary, creates the packet pool, launches the
// secondaries, churns memory while they work, and prints every process's
// summary. It fails if a secondary failed or saw a validation failure.
func RunPrimary(ctx context.Context, o Options, launch Launch) error {
	kind, err := hugetlb.ParseKind(o.Backend)
	if err != nil {
		return err
	}
	p, err := primary.Start(primary.Config{Prefix: o.Prefix, RuntimeDir: o.RuntimeDir, Backend: kind,
		Device: o.Device, Logger: o.Logger})
	if err != nil {
		return err
	}
	defer p.Close()
	b := p.Backend()
	fmt.Fprintf(o.Out, "primary pid %d: backend %s (%s)\n", os.Getpid(), b, p.RuntimeDir())
	pool, err := p.CreatePool(PoolName, o.BufSize, o.Buffers)
	if err != nil {
		return err
	}
	fmt.Fprintf(o.Out, "primary: pool %q of %d buffers of %d bytes at 0x%x\n", PoolName, pool.Count(), pool.ObjSize(), pool.Chunks()[0].Addr)
	q := p.NewQueue()
	if err := p.RegisterMempool(q, pool); err != nil {
		return err
	}
	q.Close()

	var churned atomic.Uint64
	stopChurn := func() {}
	if o.Churn {
		if stopChurn, err = startChurn(p, &churned); err != nil {
			return err
		}
	}

	start := time.Now()
	results := make([]Summary, o.Secondaries)
	errs := make([]error, o.Secondaries)
	var wg sync.WaitGroup
	for i := range o.Secondaries {
		wg.Add(1)
		go func() {
			defer wg.Done()
			results[i], errs[i] = runChild(ctx, launch(ctx, o, i), i, o.Out)
		}()
	}
	wg.Wait()
	if o.Secondaries == 0 {
		// A primary alone serves secondaries started by hand.
		fmt.Fprintf(o.Out, "primary: serving for %v (prefix %s); attach with examples/secondary\n", o.Duration, o.Prefix)
		select {
		case <-ctx.Done():
		case <-time.After(o.Duration):
		}
	}
	stopChurn()
	elapsed := time.Since(start)

	st := p.Stats()
	fmt.Fprintf(o.Out, "\nsummary after %v (%d memory churns, %d MRs live, %d invalidations, %d IPC requests served, p50 %v p99 %v):\n",
		elapsed.Round(time.Millisecond), churned.Load(), st.Global.MRs, st.Global.Invalidations,
		st.Counters.Requests, st.Counters.LatencyP50.Round(time.Microsecond), st.Counters.LatencyP99.Round(time.Microsecond))
	var failed []error
	for i, r := range results {
		if errs[i] != nil {
			failed = append(failed, fmt.Errorf("secondary %d: %w", i, errs[i]))
			continue
		}
		fmt.Fprintf(o.Out, "  %s\n", r)
		if r.ValidationErrors != 0 || len(r.Errors) != 0 {
			failed = append(failed, fmt.Errorf("secondary %d (pid %d): %d validation failures, errors %v",
				i, r.PID, r.ValidationErrors, r.Errors))
		}
	}
	return errors.Join(failed...)
}

// runChild runs one secondary, relays its output and returns its summary.
func runChild(ctx context.Context, cmd *exec.Cmd, n int, out io.Writer) (Summary, error) {
	var sum Summary
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return sum, err
	}
	cmd.Stderr = &prefixWriter{w: out, prefix: fmt.Sprintf("[secondary %d] ", n)}
	cmd.Cancel = func() error { return cmd.Process.Kill() }
	if err := cmd.Start(); err != nil {
		return sum, err
	}
	got := false
	sc := bufio.NewScanner(stdout)
	for sc.Scan() {
		line := sc.Text()
		if js, ok := strings.CutPrefix(line, summaryPrefix); ok {
			if err := json.Unmarshal([]byte(js), &sum); err == nil {
				got = true
				continue
			}
		}
		fmt.Fprintf(out, "[secondary %d] %s\n", n, line)
	}
	if err := cmd.Wait(); err != nil {
		return sum, err
	}
	if !got {
		return sum, errors.New("ended without a summary")
	}
	return sum, ctx.Err()
}

// startChurn frees and reallocates a scratch region every few milliseconds,
// publishing where it is for the secondaries' checks.
func startChurn(p *primary.Primary, count *atomic.Uint64) (stop func(), err error) {
	off, err := p.Segment().Alloc(64, 64)
	if err != nil {
		return nil, err
	}
	if err := p.Segment().SetRoot(shm.RootUser, off); err != nil {
		return nil, err
	}
	sc := shm.At[scratch](p.Segment(), off)
	size := 2 * p.Backend().PageSize
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		t := time.NewTicker(20 * time.Millisecond)
		defer t.Stop()
		var cur hugetlb.Region
		for {
			// Mark the region changing before it goes, and publish the new
			// one only once it is mapped everywhere.
			atomic.AddUint64(&sc.Seq, 1)
			if cur.Len != 0 {
				if err := p.Free(cur); err != nil {
					return
				}
				cur = hugetlb.Region{}
			}
			r, err := p.Alloc(size)
			if err == nil {
				cur = r
				atomic.StoreUint64(&sc.Addr, uint64(r.Addr))
				atomic.StoreUint64(&sc.Len, r.Len)
				count.Add(1)
			}
			atomic.AddUint64(&sc.Seq, 1)
			select {
			case <-done:
				atomic.AddUint64(&sc.Seq, 1)
				if cur.Len != 0 {
					_ = p.Free(cur)
				}
				atomic.StoreUint64(&sc.Addr, 0)
				atomic.AddUint64(&sc.Seq, 1)
				return
			case <-t.C:
			}
		}
	}()
	return func() { close(done); wg.Wait() }, nil
}

// prefixWriter prefixes each line written through it.
type prefixWriter struct {
	mu     sync.Mutex
	w      io.Writer
	prefix string
	rest   []byte
}

func (p *prefixWriter) Write(b []byte) (int, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.rest = append(p.rest, b...)
	for {
		i := strings.IndexByte(string(p.rest), '\n')
		if i < 0 {
			return len(b), nil
		}
		fmt.Fprintf(p.w, "%s%s\n", p.prefix, p.rest[:i])
		p.rest = p.rest[i+1:]
	}
}
