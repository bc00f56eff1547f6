package primary_test

import (
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/primary"
	"github.com/mpmr/mpmr/secondary"
)

func init() {
	// patient-secondary PREFIX RUNDIR ATTACHTIMEOUT: a process that
	// attaches on command, and stays alive when an attach fails.
	//
	//	attach       -> "> attached slot=N" or "> attach-failed ERR"
	//	lookup ADDR  -> "> key K" or "> err TEXT"
	testproc.Register("patient-secondary", func(args []string) int {
		d, err := time.ParseDuration(args[2])
		if err != nil {
			panic(err)
		}
		var q *secondary.Queue
		testproc.Say("ready")
		testproc.EachCommand(func(c testproc.Line) {
			switch c.Name {
			case "attach":
				s, err := secondary.Attach(secondary.Config{Prefix: args[0], RuntimeDir: args[1], Logger: quiet, AttachTimeout: d})
				if err != nil {
					testproc.Say("> attach-failed %v", err)
					break
				}
				q = s.NewQueue()
				testproc.Say("> attached slot=%d", s.Slot())
			case "lookup":
				testproc.SayKey(q.Lookup(uintptr(c.Num(0))))
			}
		})
		return 0
	})
}

// A secondary (T) attaches while a free waits for a stopped secondary (S),
// and gives up (its AttachTimeout is shorter than the primary's
// SyncTimeout): it closes its connection while its hello still waits in the
// primary for the change under way. The primary must not admit the ended
// connection once the free is done: in its sync set, the next free would
// find it wanting and fence T's process, whose later attachment, healthy,
// then kept every page freed from there on in quarantine for as long as it
// lived.
func TestAHelloWhoseConnectionEndedIsNotAdmitted(t *testing.T) {
	p, cfg := startPrimary(t, testenv.Tmpfs(t), func(c *primary.Config) { c.SyncTimeout = 3 * time.Second; c.MemoryPages = 16 })
	ps := p.Backend().PageSize
	r1, err := p.Alloc(ps)
	require.NoError(t, err)
	r2, err := p.Alloc(ps)
	require.NoError(t, err)
	s := startSecondary(t, cfg)
	require.Contains(t, ask(t, s, "lookup %d", r1.Addr), "key")
	tp := testproc.Start(t, "patient-secondary", []string{cfg.Prefix, cfg.RuntimeDir, "1s"})
	tp.Expect("ready", 0)

	s.Stop()
	t.Cleanup(s.Continue)
	freed := make(chan error, 1)
	go func() { freed <- p.Free(r1) }()
	require.Eventually(t, func() bool { return b3Waiting("(*Primary).syncSecondaries", "(*Memory).Free") }, 20*time.Second,
		100*time.Microsecond, "the free waits for S")
	first := ask(t, tp, "attach")
	require.True(t, strings.HasPrefix(first, "attach-failed"), "T's attach gave up while the free waited: %s", first)
	require.NoError(t, <-freed)
	require.Eventually(t, func() bool { return !b3Waiting("(*handler).hello") }, 20*time.Second, 100*time.Microsecond,
		"the hello handler done")
	assert.Equal(t, 0, p.Stats().Counters.Secondaries, "a hello whose connection ended is not admitted")

	// S resumes, finds its drop and lets go: its quarantine goes.
	s.Continue()
	require.Eventually(t, func() bool { return p.Memory().Quarantined() == 0 }, 20*time.Second, time.Millisecond,
		"S's quarantine released")
	second := ask(t, tp, "attach")
	require.True(t, strings.HasPrefix(second, "attached"), "T attaches again: %s", second)
	require.Contains(t, ask(t, tp, "lookup %d", r2.Addr), "key")
	before := p.Stats().Counters
	require.NoError(t, p.Free(r2))
	after := p.Stats().Counters
	assert.Equal(t, before.SyncDrops, after.SyncDrops, "nobody stalled: nobody dropped")
	assert.Equal(t, before.Fenced, after.Fenced, "nobody stalled: nobody fenced")
	assert.Zero(t, p.Memory().Quarantined(), "T followed the free: nothing waits")
	assert.Contains(t, ask(t, tp, "lookup %d", r2.Addr), "err", "no key for freed r2")
}
