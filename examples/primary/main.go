// Command primary runs the main job: it starts a primary, puts a mempool of
// packet buffers in shared hugepage memory, launches secondary processes
// (examples/secondary) whose queues move payloads between those buffers
// through the soft device, keeps freeing and reallocating a region of
// memory while they work, and prints what every process did.
//
//	go run ./examples/primary                        # the main job: 2 secondaries, 1 queue each, 3 s
//	go run ./examples/primary -duration 10s -secondaries 3 -backend hugetlbfs
//	go run ./examples/primary -secondaries 0 -duration 1h &   # a primary alone...
//	go run ./examples/secondary -duration 5s                   # ...and a secondary by hand
//
// It exits 0 only if every secondary finished with every copy intact and
// every key validated.
package main

import (
	"bufio"
	"cmp"
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mpmr/mpmr/examples/internal/job"
	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/primary"
)

type config struct {
	job.Flags
	backend      string
	device       string
	secondaries  int
	buffers      int
	churn        bool
	secondaryBin string
	grace        time.Duration
}

func main() {
	var c config
	c.Register(flag.CommandLine)
	flag.StringVar(&c.backend, "backend", "auto", "memory backend: auto, hugetlbfs or tmpfs")
	flag.StringVar(&c.device, "device", "soft", "device: soft, or an rdma-core device name (needs -tags rdma)")
	flag.IntVar(&c.secondaries, "secondaries", 2, "secondary processes to launch (0: serve secondaries started by hand)")
	flag.IntVar(&c.buffers, "buffers", 8192, "buffers in the pool")
	flag.BoolVar(&c.churn, "churn", true, "free and reallocate memory while the secondaries work")
	flag.StringVar(&c.secondaryBin, "secondary-bin", "", "the examples/secondary program to launch (default: built from this module)")
	flag.DurationVar(&c.grace, "grace", 20*time.Second, "how long past -duration a secondary may take to attach and detach before it is stopped")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, c)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "primary:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, c config) error {
	kind, err := hugetlb.ParseKind(c.backend)
	if err != nil {
		return err
	}
	// Start creates the control segment, the data memory, the device and
	// the global MR cache, and serves secondaries on a unix socket. Only
	// one primary runs per prefix; a dead one's leftovers are cleaned up.
	p, err := primary.Start(primary.Config{Prefix: c.Prefix, RuntimeDir: c.RuntimeDir, Backend: kind,
		Device: c.device, FollowCPU: c.Bind >= 0, Logger: c.Logger()})
	if err != nil {
		return err
	}
	defer p.Close()
	fmt.Printf("primary pid %d: backend %s (%s)\n", os.Getpid(), p.Backend(), p.RuntimeDir())

	// The pool lives in data memory, mapped at the same address in every
	// process; secondaries open it by name.
	pool, err := p.CreatePool(job.PoolName, c.BufSize, c.buffers)
	if err != nil {
		return err
	}
	fmt.Printf("primary: pool %q of %d buffers of %d bytes at 0x%x\n", job.PoolName, pool.Count(), pool.ObjSize(), pool.Chunks()[0].Addr)
	// Register the pool before any queue starts, as DPDK's drivers do: the
	// MRs exist before the datapath needs them (secondaries then find them
	// in the global table instead of asking over IPC), and memory outside
	// the memseg lists could only be registered here.
	q := p.NewQueue()
	if err := p.RegisterMempool(q, pool); err != nil {
		return err
	}
	q.Close()

	// The churn proves the library's first promise while traffic runs:
	// once Free returns, no lookup in any process gets a key for the freed
	// memory. Secondaries look the churned region up and validate the key.
	// Queues whose buffers are elsewhere keep their cached keys (a free
	// drops only what it touched).
	var churns atomic.Uint64
	stopChurn := func() {}
	if c.churn {
		if stopChurn, err = churn(p, &churns); err != nil {
			return err
		}
	}
	defer func() { stopChurn() }()

	start := time.Now()
	var sums []job.Summary
	var failed []error
	if c.secondaries == 0 {
		fmt.Printf("primary: serving for %v (prefix %s); attach with examples/secondary\n", c.Duration, c.Prefix)
		select {
		case <-ctx.Done():
		case <-time.After(c.Duration):
		}
	} else {
		bin, cleanup, err := secondaryProgram(c.secondaryBin)
		if err != nil {
			return err
		}
		sums, failed = launch(ctx, bin, c)
		cleanup()
		if ctx.Err() != nil {
			// Interrupted: the secondaries were told to stop too, and
			// those that did not finish have no summary to give.
			failed = append(failed, errors.New("interrupted"))
		}
	}
	stopChurn()
	stopChurn = func() {}

	st := p.Stats()
	fmt.Printf("\nsummary after %v: %d memory churns, %d MRs live, %d invalidations; %d requests served (p50 %v, p99 %v); %d secondaries fenced\n",
		time.Since(start).Round(time.Millisecond), churns.Load(), st.Global.MRs, st.Global.Invalidations,
		st.Counters.Requests, st.Counters.LatencyP50.Round(time.Microsecond), st.Counters.LatencyP99.Round(time.Microsecond),
		st.Counters.Fenced)
	for _, s := range sums {
		fmt.Printf("  %s\n", s)
		if s.Failed() {
			failed = append(failed, fmt.Errorf("secondary pid %d: %d validation failures, errors %v", s.PID, s.ValidationErrors, s.Errors))
		}
	}
	return errors.Join(failed...)
}

// churn frees and reallocates a region every 20 ms and publishes where it
// is, until the returned function is called.
func churn(p *primary.Primary, count *atomic.Uint64) (stop func(), err error) {
	sc, err := job.NewScratch(p.Segment())
	if err != nil {
		return nil, err
	}
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
			// Mark the region changing before it goes; publish the new
			// one only once every secondary has mapped it (Alloc returns
			// then).
			sc.Begin()
			if cur.Len != 0 {
				if err := p.Free(cur); err != nil {
					fmt.Fprintln(os.Stderr, "primary: churn:", err)
					sc.End(0, 0)
					return
				}
				cur = hugetlb.Region{}
			}
			if r, err := p.Alloc(size); err == nil {
				cur = r
				count.Add(1)
			}
			sc.End(uint64(cur.Addr), cur.Len)
			select {
			case <-done:
				if cur.Len != 0 {
					sc.Begin()
					_ = p.Free(cur)
					sc.End(0, 0)
				}
				return
			case <-t.C:
			}
		}
	}()
	var once sync.Once
	return func() { once.Do(func() { close(done); wg.Wait() }) }, nil
}

// launch runs the secondaries, relays what they print and collects their
// summaries. A secondary that fails or ends without a summary is an error.
func launch(ctx context.Context, bin string, c config) ([]job.Summary, []error) {
	sums := make([]job.Summary, c.secondaries)
	errs := make([]error, c.secondaries)
	var wg sync.WaitGroup
	for i := range c.secondaries {
		wg.Add(1)
		go func() {
			defer wg.Done()
			// A secondary that is alive but does not end (stopped, hung)
			// must not keep the main job waiting: past its duration and
			// the grace for attaching and detaching, it is stopped as an
			// interrupted one is.
			sctx, cancel := context.WithTimeout(ctx, c.Duration+c.grace)
			defer cancel()
			sc := c.Flags
			if c.Bind >= 0 { // each secondary's queues on CPUs of their own, as far as they go
				sc.Bind = c.Bind + i*c.Queues
			}
			cmd := exec.CommandContext(sctx, bin, sc.Args()...)
			// Interrupted, a secondary is asked to stop (it detaches
			// cleanly), and killed only if it does not (SIGKILL ends a
			// stopped process too). One that has ended already is left
			// to be reported as it ended: this process may find its time
			// up only because it did not run itself (stopped, traced).
			var stopped atomic.Bool
			cmd.Cancel = func() error {
				if exited(cmd.Process.Pid) {
					return os.ErrProcessDone
				}
				err := cmd.Process.Signal(syscall.SIGTERM) // os.ErrProcessDone once Wait has reaped it
				if err == nil {
					stopped.Store(true)
				}
				return err
			}
			cmd.WaitDelay = 5 * time.Second
			sums[i], errs[i] = runSecondary(cmd, i)
			if stopped.Load() {
				err := cmp.Or(errs[i], sctx.Err())
				if ctx.Err() == nil {
					err = fmt.Errorf("still running %v after its %v of work: stopped (%w)", c.grace, c.Duration, err)
				}
				errs[i] = err
			}
		}()
	}
	wg.Wait()
	var got []job.Summary
	var failed []error
	for i := range sums {
		if errs[i] != nil {
			failed = append(failed, fmt.Errorf("secondary %d: %w", i, errs[i]))
		} else {
			got = append(got, sums[i])
		}
	}
	return got, failed
}

// exited reports whether the child pid has ended, without reaping it
// (WNOWAIT): its exit status stays for cmd.Wait, and a signal sent to it
// now would reach an ended process, and succeed.
func exited(pid int) bool {
	var info unix.Siginfo
	err := unix.Waitid(unix.P_PID, pid, &info, unix.WEXITED|unix.WNOHANG|unix.WNOWAIT, nil)
	return err == nil && info.Signo == int32(unix.SIGCHLD)
}

// runSecondary runs cmd, the secondary numbered n, passing its lines on,
// and returns its summary.
func runSecondary(cmd *exec.Cmd, n int) (job.Summary, error) {
	var sum job.Summary
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return sum, err
	}
	// Its standard error is this process's, not a pipe through it: if
	// this process dies, the secondary can still say what it did about it.
	// Its lines name its pid.
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		return sum, err
	}
	got := false
	sc := bufio.NewScanner(stdout)
	for sc.Scan() {
		if s, ok := job.ParseLine(sc.Text()); ok {
			sum, got = s, true
			continue
		}
		fmt.Printf("[secondary %d] %s\n", n, sc.Text())
	}
	if err := cmd.Wait(); err != nil {
		return sum, err
	}
	if !got {
		return sum, errors.New("ended without a summary")
	}
	return sum, nil
}

// secondaryProgram finds the secondary example: the -secondary-bin flag,
// a program named secondary beside this one, or one built now from this
// module (what "go run ./examples/primary" needs).
func secondaryProgram(flagged string) (bin string, cleanup func(), err error) {
	if flagged != "" {
		return flagged, func() {}, nil
	}
	if exe, err := os.Executable(); err == nil {
		beside := filepath.Join(filepath.Dir(exe), "secondary")
		if st, err := os.Stat(beside); err == nil && st.Mode().IsRegular() && st.Mode()&0o111 != 0 {
			return beside, func() {}, nil
		}
	}
	dir, err := os.MkdirTemp("", "mpmr-example-")
	if err != nil {
		return "", nil, err
	}
	cleanup = func() { os.RemoveAll(dir) }
	bin = filepath.Join(dir, "secondary")
	fmt.Println("primary: building examples/secondary")
	build := exec.Command("go", "build", "-o", bin, "github.com/mpmr/mpmr/examples/secondary")
	build.Stdout, build.Stderr = os.Stderr, os.Stderr
	if err := build.Run(); err != nil {
		cleanup()
		return "", nil, fmt.Errorf("building examples/secondary (run from inside the module, or give -secondary-bin): %w", err)
	}
	return bin, cleanup, nil
}
