package primary_test

import (
	"context"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/primary"
	"github.com/mpmr/mpmr/secondary"
	"github.com/mpmr/mpmr/shm"
	"github.com/mpmr/mpmr/verbs"
)

// The breaker's own secondary helper. Commands, one per line:
//
//	poke ADDR B   -> "wrote" or "fault"
//	lookup ADDR   -> "key K" or "err TEXT"
//	hangup        -> shuts its connection to the primary down (as a peer
//	                 whose socket breaks would), without unmapping: "hung up"
//	exclusive     -> takes the global write lock and stays in it: "holding".
//	                 Global.Exclusive is the primary's alone, so this takes
//	                 the segment's lock directly, as a process that writes
//	                 the segment outside the library's rules would
//	release       -> leaves it: "released"
//	exclusive-api -> asks Global.Exclusive: "refused ERR" or "allowed"
func init() {
	testproc.Register("breaker-secondary", func(args []string) int {
		s, err := secondary.Attach(secondary.Config{Prefix: args[0], RuntimeDir: args[1], Logger: quiet})
		if err != nil {
			testproc.Say("attach-failed %v", err)
			return 3
		}
		q := s.NewQueue()
		testproc.Say("ready slot=%d", s.Slot())
		var release chan struct{}
		testproc.EachCommand(func(c testproc.Line) {
			switch c.Name {
			case "poke":
				if poke(uintptr(c.Num(0)), byte(c.Num(1))) {
					testproc.Say("> wrote")
				} else {
					testproc.Say("> fault")
				}
			case "lookup":
				testproc.SayKey(q.Lookup(uintptr(c.Num(0))))
			case "hangup":
				testproc.Say("> hung up %d", shutdownSockets())
			case "exclusive":
				release = make(chan struct{})
				l, err := s.Segment().RWLock(s.Global().LockState().Offset)
				if err != nil {
					testproc.Say("> err %v", err)
					break
				}
				go func() {
					if err := l.Lock(context.Background()); errors.Is(err, shm.ErrOwnerDied) {
						l.MarkConsistent()
					} else if err != nil {
						testproc.Say("> err %v", err)
						return
					}
					testproc.Say("> holding")
					<-release
					l.Unlock()
				}()
			case "exclusive-api":
				if err := s.Global().Exclusive(func() {}); err != nil {
					testproc.Say("> refused %v", err)
				} else {
					testproc.Say("> allowed")
				}
			case "release":
				close(release)
				testproc.Say("> released")
			default:
				testproc.Say("> err unknown command %q", c.Name)
			}
		})
		return 0
	})
}

// shutdownSockets shuts down every socket of this process (a secondary has
// one: its connection to the primary) and returns how many.
func shutdownSockets() int {
	ents, _ := os.ReadDir("/proc/self/fd")
	n := 0
	for _, e := range ents {
		link, err := os.Readlink(filepath.Join("/proc/self/fd", e.Name()))
		if err != nil || !strings.HasPrefix(link, "socket:") {
			continue
		}
		fd, _ := strconv.Atoi(e.Name())
		if syscall.Shutdown(fd, syscall.SHUT_RDWR) == nil {
			n++
		}
	}
	return n
}

// gateHandler is a log handler that discards everything, except that the
// record whose message is gate blocks its caller until open is closed (a
// slow log sink: a full stderr pipe, a stalled journald).
type gateHandler struct {
	gate    string
	entered chan struct{}
	open    chan struct{}
	once    *sync.Once
}

func (h gateHandler) Enabled(context.Context, slog.Level) bool { return true }
func (h gateHandler) WithAttrs([]slog.Attr) slog.Handler       { return h }
func (h gateHandler) WithGroup(string) slog.Handler            { return h }
func (h gateHandler) Handle(_ context.Context, r slog.Record) error {
	if r.Message == h.gate {
		h.once.Do(func() { close(h.entered) })
		<-h.open
	}
	return nil
}

// A secondary whose connection ends while it lives must at every moment be
// either in the sync set or fenced: were it removed from the set before it
// is fenced, a Free in between would neither sync it nor quarantine for
// it, punching out pages the live secondary still maps; its next write
// would fault a page back into the backing file, and the next Alloc would
// hand that page, with the secondary's bytes, to a new allocation shared
// with the stale process. A slow log sink in Disconnected holds the primary
// inside that window, if there is one.
func TestBreakerFreeWhileDisconnectedSecondaryIsNotYetFenced(t *testing.T) {
	testenv.ForEachBackend(t, 8, func(t *testing.T, b hugetlb.Backend) {
		gate := gateHandler{gate: "secondary detached", entered: make(chan struct{}), open: make(chan struct{}), once: &sync.Once{}}
		p, cfg := startPrimary(t, b, shortSync, func(c *primary.Config) { c.Logger = slog.New(gate) })
		t.Cleanup(func() { close(gate.open) }) // before the primary closes
		ps := p.Backend().PageSize
		r, err := p.Alloc(2 * ps)
		require.NoError(t, err)

		s := testproc.Start(t, "breaker-secondary", []string{cfg.Prefix, cfg.RuntimeDir})
		s.Expect("ready", 0)
		require.Equal(t, "wrote", ask(t, s, "poke %d 7", r.Addr), "the secondary maps the region")
		require.Contains(t, ask(t, s, "hangup"), "hung up ", "its connection (and call lane) shut down")
		select {
		case <-gate.entered:
		case <-time.After(5 * time.Second):
			t.Fatal("the primary did not notice the connection's end")
		}

		require.NoError(t, p.Free(r))
		// The secondary is alive and has not unmapped (it waits up to a
		// second for the fence before dropping itself): the pages it maps
		// must wait in quarantine.
		assert.Equal(t, 2, p.Memory().Quarantined(),
			"pages freed while a live, unfenced, unsynced secondary maps them are not quarantined")
		// Whether the write lands (in its old, quarantined page) or faults
		// (it found the fence and unmapped already), nobody else sees it.
		assert.Contains(t, []string{"wrote", "fault"}, ask(t, s, "poke %d 90", r.Addr))

		r2, err := p.Alloc(2 * ps)
		require.NoError(t, err)
		t.Logf("freed [0x%x, 0x%x), reallocated [0x%x, 0x%x)", r.Addr, r.End(), r2.Addr, r2.End())
		i, v := firstNonZero(r2.Bytes())
		assert.Equal(t, -1, i, "a new allocation reads as zeros, never a live process's stale writes: byte %d is 0x%x", i, v)
	})
}

// A process that dies holding the global write lock (Global.Exclusive)
// leaves its mark in the owner word. Only a writer repairs it, and only the
// primary's Free or Create write; readers get ErrOwnerDied. A queue's miss
// reads the global table before it would ever ask to create, so in every
// process — the primary's own queues included — every lookup that misses
// its local cache fails from then on, for as long as the primary happens
// not to free memory: the dead process blocks everybody, without bound.
// Secondaries are told the (live) primary is gone.
func TestBreakerDeadExclusiveHolderBlocksLookupsUntilAFree(t *testing.T) {
	p, cfg := startPrimary(t, testenv.Tmpfs(t))
	ps := p.Backend().PageSize
	r, err := p.Alloc(4 * ps)
	require.NoError(t, err)
	other := startSecondary(t, cfg)

	h := testproc.Start(t, "breaker-secondary", []string{cfg.Prefix, cfg.RuntimeDir})
	h.Expect("ready", 0)
	assert.Contains(t, ask(t, h, "exclusive-api"), "refused", "only the primary may hold the write lock through the API")
	require.Equal(t, "holding", ask(t, h, "exclusive"))
	h.Kill()
	_ = h.Wait(0)
	startSecondary(t, cfg) // a newcomer, in the dead writer's slot

	q := p.NewQueue()
	var lerr error
	deadline := time.Now().Add(3 * time.Second)
	for time.Now().Before(deadline) {
		if _, lerr = q.Lookup(r.Addr); lerr == nil {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	assert.NoError(t, lerr, "3 s after the death, the primary's own queue still cannot look up allocated memory")
	ans := ask(t, other, "lookup %d", r.Addr+uintptr(ps))
	assert.True(t, strings.HasPrefix(ans, "key "), "a secondary's lookup 3 s after the death: %q", ans)
	assert.NotContains(t, ans, "primary", "the primary is alive; the secondary is told otherwise")
}

// Free documents that, when it returns nil, the MRs it emptied are
// deregistered (the device refuses their keys). It deregisters them after
// the invalidation, in a collection that needs the global write lock
// again; if it cannot take it in time, Free must not return nil with the
// emptied MR still registered, or the device keeps validating the old key
// for the freed memory. Here another process takes the write lock
// (Global.Exclusive) between the invalidation and the collection, and is
// stopped there; a stalled secondary holds Free in its sync as well.
func TestBreakerFreeReturnsNilWithEmptiedMRStillRegistered(t *testing.T) {
	arm, reached, proceed := holdBeforeCollect(t)
	p, cfg := startPrimary(t, testenv.Tmpfs(t), func(c *primary.Config) { c.SyncTimeout = time.Second })
	ps := p.Backend().PageSize
	r, err := p.Alloc(ps)
	require.NoError(t, err)
	q := p.NewQueue()
	key, err := q.Lookup(r.Addr)
	require.NoError(t, err)

	staller := startSecondary(t, cfg)
	writer := testproc.Start(t, "breaker-secondary", []string{cfg.Prefix, cfg.RuntimeDir})
	writer.Expect("ready", 0)
	staller.Stop()

	freed := make(chan error, 1)
	start := time.Now()
	arm()
	go func() { freed <- p.Free(r) }()
	waitFor(t, reached, "the free between its invalidation and its collection")
	require.Equal(t, "holding", ask(t, writer, "exclusive"))
	writer.Stop()
	close(proceed)

	var ferr error
	select {
	case ferr = <-freed:
	case <-time.After(30 * time.Second):
		t.Fatal("Free hangs")
	}
	t.Logf("Free returned %v after %v", ferr, time.Since(start))
	if ferr == nil {
		assert.Error(t, p.Device().Validate(verbs.SGE{Addr: r.Addr, Len: 1, Key: key}, verbs.AccessLocalWrite),
			"Free returned nil, so the emptied MR's key must no longer validate")
		assert.Zero(t, p.Global().Stats().FreeMRs, "Free returned nil with an emptied MR still waiting to be deregistered")
	} else {
		assert.True(t, errors.Is(ferr, hugetlb.ErrNotFreed), "a failed Free says ErrNotFreed: %v", ferr)
	}
	writer.Continue()
	assert.Equal(t, "released", ask(t, writer, "release"))
	staller.Continue()
}

// holdBeforeCollect has the free that follows arm wait between its
// invalidation and its collection of the MRs it emptied: reached is
// closed once it waits there, and it goes on once proceed is closed. Call
// it before the primary starts.
func holdBeforeCollect(t *testing.T) (arm func(), reached <-chan struct{}, proceed chan struct{}) {
	var armed atomic.Bool
	at := make(chan struct{})
	proceed = make(chan struct{})
	t.Cleanup(primary.SetBeforeCollect(func() {
		if armed.CompareAndSwap(true, false) {
			close(at)
			<-proceed
		}
	}))
	return func() { armed.Store(true) }, at, proceed
}

// After a free trims an MR (a middle page of it), the MR stays registered
// with the device over its whole original range. The soft device then
// validates the MR's key for the freed page, and once the page is
// reallocated, a copy through the old key reads and writes the new
// allocation's bytes. The soft device is the tests' oracle for "no key for
// freed memory reaches the device"; here it accepts one.
func TestBreakerTrimmedMRKeyValidatesOverFreedPage(t *testing.T) {
	p, cfg := startPrimary(t, testenv.Tmpfs(t))
	ps := p.Backend().PageSize
	r, err := p.Alloc(3 * ps)
	require.NoError(t, err)
	q := p.NewQueue()
	key, err := q.Lookup(r.Addr)
	require.NoError(t, err)
	mid := r.Addr + uintptr(ps)
	s := startSecondary(t, cfg)
	require.Equal(t, key, parseKey(t, ask(t, s, "lookup %d", mid)), "one MR covers the three pages")

	require.NoError(t, p.Free(hugetlb.Region{Addr: mid, Len: ps}))
	assert.Error(t, p.Device().Validate(verbs.SGE{Addr: mid, Len: 1, Key: key}, verbs.AccessLocalWrite),
		"the device accepts the old key for the freed page")
	assert.Contains(t, ask(t, s, "validate %d %d", mid, key), "err", "so does the secondary's view of the device")

	r2, err := p.Alloc(ps)
	require.NoError(t, err)
	require.Equal(t, mid, r2.Addr, "first fit hands the freed page out again")
	copy(r2.Bytes(), []byte("another allocation's secret"))
	err = p.Device().Copy(verbs.SGE{Addr: r.Addr, Len: 27, Key: key}, verbs.SGE{Addr: mid, Len: 27, Key: key})
	assert.Error(t, err, "a copy through the trimmed MR's old key reaches the new allocation")
	assert.NotEqual(t, "another allocation's secret", string(r.Bytes()[:27]), "and leaks its bytes")
}

// firstNonZero returns the index and value of the first non-zero byte of b,
// or -1.
func firstNonZero(b []byte) (int, byte) {
	for i, v := range b {
		if v != 0 {
			return i, v
		}
	}
	return -1, 0
}

// slowDeregDevice is the soft device with a deregistration that takes as
// long as the test wants for one key (a hardware dereg_mr, or the soft
// device's mutex held by a long mlock in a concurrent registration).
type slowDeregDevice struct {
	*verbs.Soft
	slowKey atomic.Uint32
	entered chan struct{}
	release chan struct{}
}

type slowDeregPD struct {
	verbs.PD
	d *slowDeregDevice
}

func (d *slowDeregDevice) AllocPD() (verbs.PD, error) {
	pd, err := d.Soft.AllocPD()
	if err != nil {
		return nil, err
	}
	return slowDeregPD{PD: pd, d: d}, nil
}

func (p slowDeregPD) DeregMR(mr verbs.MR) error {
	if k := p.d.slowKey.Load(); k != 0 && mr.LKey == k {
		close(p.d.entered)
		<-p.d.release
	}
	return p.PD.DeregMR(mr)
}

// Free deregisters the MRs it emptied in a collection after its
// invalidation; collections detach the whole free list under the write
// lock and deregister outside it, and any Create runs one too (every miss
// of every process ends in one). If a Create's collection detaches the
// list between Free's invalidation and its own collection, Free's finds
// the list empty: it must still not return while the emptied MR is being
// deregistered by the other goroutine, or its key would still validate
// after Free returned. Here the Create's deregistration takes as long as
// the test wants.
func TestBreakerFreeReturnsBeforeAConcurrentGCDeregistersItsMR(t *testing.T) {
	arm, reached, proceed := holdBeforeCollect(t)
	var dev *slowDeregDevice
	p, cfg := startPrimary(t, testenv.Tmpfs(t), func(c *primary.Config) {
		c.SinglePage, c.SyncTimeout = true, time.Second
		primary.WithDeviceOpener(c, func(seg *shm.Segment, log *slog.Logger) (verbs.Device, error) {
			soft, err := verbs.CreateSoft(seg, verbs.SoftOptions{Logger: log})
			dev = &slowDeregDevice{Soft: soft, entered: make(chan struct{}), release: make(chan struct{})}
			return dev, err
		})
	})
	ps := p.Backend().PageSize
	rA, err := p.Alloc(ps)
	require.NoError(t, err)
	rB, err := p.Alloc(ps)
	require.NoError(t, err)
	q := p.NewQueue()
	keyA, err := q.Lookup(rA.Addr)
	require.NoError(t, err)
	dev.slowKey.Store(keyA)
	released := false
	defer func() {
		if !released {
			close(dev.release)
		}
	}()

	staller := startSecondary(t, cfg)
	staller.Stop() // Free waits SyncTimeout for it too
	freed := make(chan error, 1)
	arm()
	go func() { freed <- p.Free(rA) }()
	waitFor(t, reached, "the free between its invalidation and its collection")

	// Meanwhile, a queue misses on other memory: its create collects the
	// free list, and deregisters the emptied MR.
	go func() {
		q2 := p.NewQueue()
		_, _ = q2.Lookup(rB.Addr)
	}()
	waitFor(t, dev.entered, "the create's collection deregistering the emptied MR")
	require.Equal(t, 1, testenv.GoroutinesIn("(*Global).Create", "DeregMR"), "the create deregisters it")
	close(proceed)
	// The free's own collection waits for the create's.
	waitUntil(t, "the free's collection waiting", func() bool {
		return testenv.GoroutinesIn("(*Global).CollectFor", "(*Global).Collect") == 1
	})
	select {
	case err := <-freed:
		t.Fatalf("Free returned (%v) while the MR it emptied was still being deregistered", err)
	default:
	}
	close(dev.release)
	released = true
	select {
	case err = <-freed:
	case <-time.After(30 * time.Second):
		t.Fatal("Free hangs")
	}
	require.NoError(t, err)
	assert.Error(t, dev.Soft.Validate(verbs.SGE{Addr: rA.Addr, Len: 1, Key: keyA}, verbs.AccessLocalWrite),
		"Free returned nil while the MR it emptied is still registered: the device accepts its key for freed memory")
	staller.Continue()
}
