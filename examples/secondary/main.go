// Command secondary is the main job's secondary: it attaches to a running
// primary, and each of its queues moves payloads between packet buffers
// through the soft device, looking up the key of every buffer on the way,
// as a NIC driver's datapath does. The primary example launches it; it can
// also attach by hand to a primary started with -secondaries 0.
//
//	go run ./examples/primary -secondaries 0 -duration 1h &
//	go run ./examples/secondary -duration 5s
//
// It prints a progress line each second and, at the end, one SUMMARY line
// of JSON for the primary that launched it. It exits 0 if every copy
// arrived intact and every key validated, 1 on any failure, and 2 if the
// primary went away (or dropped it) while it ran.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/mpmr/mpmr/cache"
	"github.com/mpmr/mpmr/examples/internal/job"
	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/secondary"
	"github.com/mpmr/mpmr/verbs"
)

func main() {
	var f job.Flags
	f.Register(flag.CommandLine)
	flag.Parse()
	// Standard output may be a pipe to the primary that launched this
	// process: if that primary dies, a write must fail, not kill the
	// process before it has stopped its queues and said so.
	signal.Ignore(syscall.SIGPIPE)
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, f)
	stop()
	os.Exit(code)
}

// counts are what the queues did, shared by all of them.
type counts struct {
	copies, checks, failures atomic.Uint64
	ended                    atomic.Bool // a queue stopped: the primary died or dropped this process
	mu                       sync.Mutex
	errs                     []string
}

func (c *counts) fail(err error, validation bool) {
	if validation {
		c.failures.Add(1)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.errs) < 10 {
		c.errs = append(c.errs, err.Error())
	}
}

func run(ctx context.Context, f job.Flags) int {
	// Attach maps the primary's control segment and data memory at the
	// primary's addresses. It fails with secondary.ErrNoPrimary when
	// nothing listens, and with a permission error when the instance
	// belongs to someone else.
	s, err := secondary.Attach(secondary.Config{Prefix: f.Prefix, RuntimeDir: f.RuntimeDir, Logger: f.Logger().With("secondary_pid", os.Getpid())})
	if err != nil {
		say("%v", err)
		if errors.Is(err, secondary.ErrNoPrimary) {
			say("start a primary first: go run ./examples/primary -secondaries 0")
		}
		return 1
	}
	defer s.Close()
	dev := s.Device()
	if dev == nil {
		say("this job validates through the soft device; the primary uses %s", s.DeviceName())
		return 1
	}
	pool, err := s.Pool(job.PoolName)
	if err != nil {
		say("%v", err)
		return 1
	}
	scratch, err := job.OpenScratch(s.Segment())
	if err != nil {
		say("%v", err)
		return 1
	}

	cpus, err := secondary.UsableCPUs() // -bind counts from the first of them
	if err != nil {
		say("%v", err)
		return 1
	}
	work, stopWork := context.WithTimeout(ctx, f.Duration)
	defer stopWork()
	var c counts
	var wg sync.WaitGroup
	queues := make([]*secondary.Queue, f.Queues)
	start := time.Now()
	for i := range queues {
		// A queue is a cache used by one goroutine only: no locks on its
		// hit path. Registering the mempool up front has the primary
		// create the MRs now and fills the queue's cache, so the datapath
		// never waits for the primary (DPDK registers mempools the same
		// way when a queue starts).
		q := s.NewQueue()
		if err := s.RegisterMempool(q, pool); err != nil {
			// Stop the queues already working before Close unmaps the
			// memory they use.
			q.Close()
			stopWork()
			wg.Wait()
			if ended(err) {
				say("queue %d: %v: stopped %d queues; exiting", i, err, i)
				return 2
			}
			say("queue %d: %v", i, err)
			return 1
		}
		queues[i] = q
		wg.Add(1)
		go func() {
			defer wg.Done()
			if f.Bind >= 0 {
				// From the goroutine that uses the queue: it is its
				// thread that is bound.
				if err := q.BindCPU(cpus[(f.Bind+i)%len(cpus)]); err != nil {
					c.fail(err, false)
				}
			}
			datapath(work, s, q, dev, pool, scratch, f.BufSize, byte(i+1), &c)
		}()
	}

	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	var last uint64
	// stopped says how the primary ended this process's work, if it did:
	// it died, or it dropped this process because it did not follow a
	// memory change in time (stopped, say). Keys already cached would keep
	// resolving after a death, but nothing new can be registered, and
	// after a drop the data memory goes: stop the queues and say so.
	stopped := func() int {
		stopWork()
		<-done
		// A queue may have seen the end before the library did: let it
		// finish saying why (it takes a second at most), so that this
		// process's last line is its own.
		select {
		case <-s.PrimaryGone():
		case <-time.After(2 * time.Second):
		}
		why := "the primary has gone"
		if s.Dropped() {
			why = "the primary dropped this process (it did not follow a memory change in time)"
		}
		say("%s: stopped %d queues after %d copies; exiting", why, len(queues), c.copies.Load())
		return 2
	}
	for running := true; running; {
		select {
		case <-done:
			running = false
			// The queues stop by themselves when a lookup or a request
			// says the primary dropped this process or died, which may be
			// before PrimaryGone says so.
			if c.ended.Load() || s.Dropped() || primaryGone(s) {
				return stopped()
			}
		case <-s.PrimaryGone():
			return stopped()
		case <-tick.C:
			st := s.Stats().Counters
			fmt.Printf("secondary pid %d: %d lookups/s, %d copies, %d flushes, %d validation failures\n",
				os.Getpid(), st.Lookups-last, c.copies.Load(), st.Flushes, c.failures.Load())
			last = st.Lookups
		}
	}
	if ctx.Err() != nil {
		return 1 // interrupted
	}

	s.ReportValidationErrors(c.failures.Load())
	st := s.Stats().Counters
	sum := job.Summary{Role: "secondary", PID: os.Getpid(), Seconds: time.Since(start).Seconds(), Queues: len(queues),
		Lookups: st.Lookups, TopHits: st.TopHits, BottomHits: st.BottomHits, GlobalHits: st.GlobalHits,
		Created: st.Created, Copies: c.copies.Load(), ChurnChecks: c.checks.Load(),
		FullFlushes: st.Flushes - st.SelectiveFlushes, SelectiveFlushes: st.SelectiveFlushes,
		FullDropped: st.FullDropped, SelectiveDropped: st.SelectiveDropped, CreateP50: st.LatencyP50, CreateP99: st.LatencyP99,
		ValidationErrors: c.failures.Load(), Errors: c.errs}
	fmt.Println(sum.Line())
	if sum.Failed() {
		return 1
	}
	return 0
}

// primaryGone reports whether s's primary has gone (or dropped it).
func primaryGone(s *secondary.Secondary) bool {
	select {
	case <-s.PrimaryGone():
		return true
	default:
		return false
	}
}

// datapath is one queue's loop: take two buffers, write a payload into one,
// look up both keys, have the device copy the payload across (the soft
// device validates both scatter-gather elements as an HCA would), check
// what arrived, give the buffers back. Every so often it also looks up the
// region the primary keeps freeing and validates the key.
func datapath(ctx context.Context, s *secondary.Secondary, q *secondary.Queue, dev *verbs.Soft, pool *cache.Pool,
	scratch *job.Scratch, size int, seed byte, c *counts) {
	defer q.Close()
	for i := 0; ctx.Err() == nil; i++ {
		err := move(q, dev, pool, uint32(size), seed+byte(i))
		switch {
		case ended(err):
			c.ended.Store(true)
			return
		case err != nil:
			c.fail(err, isValidation(err))
			continue
		}
		c.copies.Add(1)
		if scratch != nil && i%64 == 0 {
			checked, err := checkScratch(q, dev, scratch)
			switch {
			case ended(err):
				c.ended.Store(true)
				return
			case err != nil:
				c.fail(err, true)
			case checked:
				c.checks.Add(1)
			}
		}
		if i%256 == 255 {
			// A busy-polling queue must let the goroutines that apply
			// the primary's memory syncs and carry its answers run, and
			// the primary's thread woken on this CPU to answer a miss,
			// or a Free or a miss waits for a scheduler's time slice.
			secondary.Yield()
		}
	}
}

// ended reports whether err says the primary died or dropped this
// process: the queue must stop.
// say writes a diagnostic line, naming this process: the primary that
// launched it passes its standard error through.
func say(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "secondary pid %d: "+format+"\n", append([]any{os.Getpid()}, args...)...)
}

func ended(err error) bool {
	return errors.Is(err, secondary.ErrPrimaryGone) || errors.Is(err, secondary.ErrDropped)
}

// move makes one copy between two buffers of the pool.
func move(q *secondary.Queue, dev *verbs.Soft, pool *cache.Pool, size uint32, seed byte) error {
	src, err := pool.Get()
	if err != nil {
		return err
	}
	defer pool.Put(src)
	dst, err := pool.Get()
	if err != nil {
		return err
	}
	defer pool.Put(dst)
	payload := hugetlb.Region{Addr: src, Len: uint64(size)}.Bytes()
	for i := range payload {
		payload[i] = seed + byte(i)
	}
	// Keys are in host byte order; a hardware descriptor wants
	// verbs.KeyToBE(key).
	sk, err := q.Lookup(src)
	if err != nil {
		return err
	}
	dk, err := q.Lookup(dst)
	if err != nil {
		return err
	}
	if err := dev.Copy(verbs.SGE{Addr: dst, Len: size, Key: dk}, verbs.SGE{Addr: src, Len: size, Key: sk}); err != nil {
		return err
	}
	out := hugetlb.Region{Addr: dst, Len: uint64(size)}.Bytes()
	if out[0] != seed || out[size-1] != seed+byte(size-1) {
		return fmt.Errorf("copy 0x%x -> 0x%x: payload not delivered", src, dst)
	}
	return nil
}

// checkScratch looks up a key for the churned region and validates it on
// the device, touching no byte of it. A failure counts only if the region
// did not change meanwhile: the contract is that no lookup that starts
// after a Free returns gets a key for the freed memory.
func checkScratch(q *secondary.Queue, dev *verbs.Soft, sc *job.Scratch) (bool, error) {
	seq, addr, length, ok := sc.Read()
	if !ok {
		return false, nil
	}
	a := uintptr(addr + length/2)
	k, err := q.Lookup(a)
	if err == nil {
		err = dev.Validate(verbs.SGE{Addr: a, Len: 64, Key: k}, verbs.AccessLocalWrite)
	}
	if sc.Changed(seq) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("scratch region 0x%x: %w", addr, err)
	}
	return true, nil
}

// isValidation reports whether err is the device refusing a key or a range.
func isValidation(err error) bool {
	return errors.Is(err, verbs.ErrLocalProtection) || errors.Is(err, verbs.ErrInvalidKey) ||
		errors.Is(err, verbs.ErrLocalAccess) || errors.Is(err, verbs.ErrLength)
}
