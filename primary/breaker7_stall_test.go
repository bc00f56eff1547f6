package primary_test

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/primary"
	"github.com/mpmr/mpmr/secondary"
	"github.com/mpmr/mpmr/verbs"
)

// A primary that is alive but stopped (SIGSTOP) answers nothing: every
// call a secondary makes must fail within its configured bound, and
// neither a new attach nor a Close may hang.
func TestBreaker7StoppedPrimaryBoundsSecondaryCalls(t *testing.T) {
	cfg := primary.Config{Prefix: testenv.Prefix(t), RuntimeDir: testenv.RunDir(t), Backend: testenv.Tmpfs(t).Kind}
	h, addr, length := startPrimaryProcess(t, cfg)
	scfg := secondary.Config{Prefix: cfg.Prefix, RuntimeDir: cfg.RuntimeDir, Logger: quiet,
		RequestTimeout: 300 * time.Millisecond, AttachTimeout: time.Second}
	s, err := secondary.Attach(scfg)
	require.NoError(t, err)
	t.Cleanup(func() { s.Close() })
	q := s.NewQueue()
	_, err = q.Lookup(addr)
	require.NoError(t, err)

	h.Stop()
	t.Cleanup(h.Continue)

	took, err := testenv.Bounded(t, "CreateMR", 5*time.Second, func() error {
		_, err := s.CreateMR(uint64(addr) + length/2)
		return err
	})
	t.Logf("CreateMR against a stopped primary: %v after %v", err, took)
	assert.Error(t, err)

	took, err = testenv.Bounded(t, "Lookup of new memory", 5*time.Second, func() error {
		_, err := q.Lookup(addr + uintptr(length) + 1) // outside the MR: it asks the primary
		return err
	})
	t.Logf("Lookup: %v after %v", err, took)
	assert.Error(t, err)

	took, err = testenv.Bounded(t, "Close", 5*time.Second, s.Close)
	t.Logf("Close with a stopped primary: %v after %v", err, took)
	assert.Less(t, took, 3*time.Second)

	// Attached no longer, the process attaches again.
	took, err = testenv.Bounded(t, "Attach", 10*time.Second, func() error {
		s2, err := secondary.Attach(scfg)
		if err == nil {
			s2.Close()
		}
		return err
	})
	t.Logf("Attach against a stopped primary: %v after %v", err, took)
	assert.Error(t, err)
	assert.NotErrorIs(t, err, hugetlb.ErrAddressInUse, "refused for the attachment before, not for the stopped primary")
}

// A primary stopped while it holds the global write lock: lookups in a
// secondary that miss their local cache wait for the lock; they must fail
// within the secondary's bound.
func TestBreaker7StoppedPrimaryHoldingTheLockBoundsLookups(t *testing.T) {
	cfg := primary.Config{Prefix: testenv.Prefix(t), RuntimeDir: testenv.RunDir(t), Backend: testenv.Tmpfs(t).Kind}
	h, addr, _ := startPrimaryProcess(t, cfg)
	scfg := secondary.Config{Prefix: cfg.Prefix, RuntimeDir: cfg.RuntimeDir, Logger: quiet,
		RequestTimeout: 300 * time.Millisecond}
	s, err := secondary.Attach(scfg)
	require.NoError(t, err)
	t.Cleanup(func() { s.Close() })
	h.Send("hold")
	h.Expect("holding", 0)
	h.Stop()
	t.Cleanup(h.Continue)

	q := s.NewQueue()
	took, err := testenv.Bounded(t, "Lookup", 5*time.Second, func() error {
		_, err := q.Lookup(addr)
		return err
	})
	t.Logf("Lookup under a stopped writer: %v after %v", err, took)
	assert.Error(t, err)
	took, err = testenv.Bounded(t, "Close", 5*time.Second, s.Close)
	t.Logf("Close: %v after %v", err, took)
}

func init() {
	// b7-sec PREFIX RUNDIR: a process that attaches on command.
	//
	//	attach        -> "> attached slot=N dropped=B" or "> attach-failed ERR"
	//	lookup ADDR   -> "> key K" or "> err TEXT"
	//	peek ADDR     -> "> byte B" or "> fault"
	//	dropped       -> "> dropped=B"
	//	wait-dropped  -> waits (bounded) for PrimaryGone: "> dropped=B"
	//	close         -> "> closed ERR"
	testproc.Register("b7-sec", func(args []string) int {
		var s *secondary.Secondary
		var q *secondary.Queue
		testproc.Say("ready")
		testproc.EachCommand(func(c testproc.Line) {
			switch c.Name {
			case "attach":
				var err error
				s, err = secondary.Attach(secondary.Config{Prefix: args[0], RuntimeDir: args[1], Logger: quiet,
					AttachTimeout: 10 * time.Second})
				if err != nil {
					testproc.Say("> attach-failed %v", err)
					break
				}
				q = s.NewQueue()
				testproc.Say("> attached slot=%d dropped=%t", s.Slot(), s.Dropped())
			case "lookup":
				testproc.SayKey(q.Lookup(uintptr(c.Num(0))))
			case "peek":
				if b, ok := peek(uintptr(c.Num(0))); ok {
					testproc.Say("> byte %d", b)
				} else {
					testproc.Say("> fault")
				}
			case "dropped":
				testproc.Say("> dropped=%t", s.Dropped())
			case "wait-dropped":
				select {
				case <-s.PrimaryGone():
				case <-time.After(testproc.DefaultTimeout):
				}
				testproc.Say("> dropped=%t", s.Dropped())
			case "close":
				q.Close()
				testproc.Say("> closed %v", s.Close())
			}
		})
		return 0
	})
}

// A secondary stopped while its hello waits in the primary (behind a free
// that waits for another stopped secondary) is admitted while stopped, then
// dropped and fenced by the next free. When it resumes, its attach must not
// hand the application a secondary that serves keys for memory freed
// meanwhile, or that maps it; and the pages freed while it was fenced must
// go back once it is done with them.
func TestBreaker7SecondaryStoppedMidHelloIsDroppedAndResumesSafely(t *testing.T) {
	p, cfg := startPrimary(t, testenv.Tmpfs(t), func(c *primary.Config) { c.SyncTimeout = time.Second })
	ps := p.Backend().PageSize
	r, err := p.Alloc(ps)
	require.NoError(t, err)
	y, err := p.Alloc(ps)
	require.NoError(t, err)

	s2 := startSecondary(t, cfg)
	s3 := testproc.Start(t, "b7-sec", []string{cfg.Prefix, cfg.RuntimeDir})
	s3.Expect("ready", 0)

	s2.Stop()
	t.Cleanup(s2.Continue)
	freed := make(chan error, 1)
	go func() { freed <- p.Free(r) }()
	require.Eventually(t, func() bool { return b7Waiting("syncSecondaries") }, 5*time.Second, time.Millisecond,
		"the free waits for the stopped secondary")
	s3.Send("attach")
	require.Eventually(t, func() bool { return b7Waiting("(*handler).hello", "(*Memory).HoldChanges") }, 5*time.Second, time.Millisecond,
		"the hello waits behind the free")
	s3.Stop()
	t.Cleanup(s3.Continue)
	require.NoError(t, <-freed)
	require.Eventually(t, func() bool { return p.Stats().Counters.Secondaries == 1 }, 5*time.Second, time.Millisecond,
		"the stopped s3 was admitted")

	require.NoError(t, p.Free(y), "Free completes without the stopped s3")
	assert.Greater(t, p.Memory().Quarantined(), 0, "y waits in quarantine for s3")

	s3.Continue()
	ans := strings.TrimPrefix(s3.Expect("> ", 0), "> ")
	require.True(t, strings.HasPrefix(ans, "attached"), "the resumed attach starts again on a fresh slot: %s", ans)
	assert.Contains(t, ans, "dropped=false", "Attach hands over no secondary the primary has dropped")
	got := ask(t, s3, "lookup %d", y.Addr)
	assert.NotContains(t, got, "key", "no key for freed memory")
	assert.Equal(t, "fault", ask(t, s3, "peek %d", y.Addr), "freed y is not mapped")
	z, err := p.Alloc(ps)
	require.NoError(t, err)
	assert.Contains(t, ask(t, s3, "lookup %d", z.Addr), "key", "the new attachment works")
	assert.Equal(t, "dropped=false", ask(t, s3, "dropped"))
	s2.Continue() // the other holder: it finds its fence and unmaps
	require.Eventually(t, func() bool { return p.Memory().Quarantined() == 0 }, 5*time.Second, time.Millisecond,
		"the quarantine is released once s2 and s3 have unmapped or left")
}

// b7Waiting is b3Waiting: some goroutine of this process is in every frame.
func b7Waiting(frames ...string) bool { return b3Waiting(frames...) }

// A secondary stopped while it holds the global read lock: Alloc, Free and
// then Close of the primary each finish within their bounds (the read hold
// is fenced, the secondary dropped at the first sync), and the secondary,
// resumed, learns of its drop and serves no key for the freed memory.
func TestBreaker7SecondaryStoppedInReadSectionBlocksNobody(t *testing.T) {
	p, cfg := startPrimary(t, testenv.Tmpfs(t), shortSync)
	ps := p.Backend().PageSize
	r, err := p.Alloc(ps)
	require.NoError(t, err)
	s := startSecondary(t, cfg)
	k := parseKey(t, ask(t, s, "lookup %d", r.Addr))
	require.Equal(t, "in", ask(t, s, "shared"))
	s.Stop()
	t.Cleanup(s.Continue)

	took, err := testenv.Bounded(t, "Free", 5*time.Second, func() error { return p.Free(r) })
	require.NoError(t, err)
	t.Logf("Free with a reader stopped in its read section: %v", took)
	assert.Error(t, p.Device().Validate(verbs.SGE{Addr: r.Addr, Len: 1, Key: k}, verbs.AccessLocalWrite))
	took, err = testenv.Bounded(t, "Alloc", 5*time.Second, func() error {
		var err error
		r, err = p.Alloc(ps)
		return err
	})
	require.NoError(t, err)
	t.Logf("Alloc: %v", took)
	_, err = p.Global().Create(uint64(r.Addr))
	require.NoError(t, err)

	s.Continue()
	left := ask(t, s, "leave")
	t.Logf("resumed reader: %s", left)
	got := ask(t, s, "lookup %d", r.Addr)
	assert.NotContains(t, got, "key", "a dropped secondary serves no key")
	got = ask(t, s, "peek %d", r.Addr)
	t.Logf("peek of the new region in the dropped secondary: %s", got)

	took, err = testenv.Bounded(t, "Close", 5*time.Second, p.Close)
	t.Logf("Close: %v after %v", err, took)
	assert.NoError(t, err)
}

// Primary.Close while a secondary is stopped, idle or holding the read
// lock: bounded.
func TestBreaker7PrimaryCloseWithAStoppedSecondary(t *testing.T) {
	for _, shared := range []bool{false, true} {
		t.Run(fmt.Sprint("shared=", shared), func(t *testing.T) {
			p, cfg := startPrimary(t, testenv.Tmpfs(t), shortSync)
			r, err := p.Alloc(p.Backend().PageSize)
			require.NoError(t, err)
			s := startSecondary(t, cfg)
			parseKey(t, ask(t, s, "lookup %d", r.Addr))
			if shared {
				require.Equal(t, "in", ask(t, s, "shared"))
			}
			s.Stop()
			t.Cleanup(s.Continue)
			took, err := testenv.Bounded(t, "Close", 5*time.Second, p.Close)
			t.Logf("Close: %v after %v", err, took)
			assert.NoError(t, err)
			s.Continue()
			assert.Equal(t, "dropped=false", ask(t, s, "wait-dropped"), "the primary ended; it did not drop s")
		})
	}
}
