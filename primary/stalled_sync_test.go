package primary_test

import (
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/primary"
)

// One secondary (A) is stopped (SIGSTOP) inside a read section of the
// global lock. The primary frees memory: its guard waits up to the
// lock's fence time for A's read hold before fencing it, then the free's
// sync waits SyncTimeout for A's acknowledgement, all with the memory
// write lock held. Another, healthy secondary (B) misses on memory it
// maps and asks the primary to create the MR while the free runs. Its
// create waits in the primary for the memory lock behind the free, for
// longer than its own RequestTimeout (2 s, the default) when the
// primary's SyncTimeout is as long or longer (here 3 s); the primary's
// hello says how long such a wait can be, and B's create must wait it out
// and get its key, not fail because another process stopped.
func TestACreateOutlastsAFreeHeldUpByAStoppedSecondary(t *testing.T) {
	const syncTimeout = 3 * time.Second
	p, cfg := startPrimary(t, testenv.Tmpfs(t), func(c *primary.Config) { c.SyncTimeout = syncTimeout })
	ps := p.Backend().PageSize
	r1, err := p.Alloc(2 * ps)
	require.NoError(t, err)
	q := p.NewQueue()
	defer q.Close()
	_, err = q.Lookup(r1.Addr) // an MR over r1: its free takes the global write lock
	require.NoError(t, err)
	r2, err := p.Alloc(2 * ps) // allocated after: no MR covers it yet
	require.NoError(t, err)
	_, found, err := p.Global().Lookup(uint64(r2.Addr))
	require.NoError(t, err)
	require.False(t, found)

	a := startSecondary(t, cfg)
	b := startSecondary(t, cfg) // default RequestTimeout
	require.Contains(t, ask(t, a, "lookup %d", r1.Addr), "key")
	require.Equal(t, "in", ask(t, a, "shared"))
	a.Stop()
	t.Cleanup(a.Continue)

	fences := p.Stats().Counters.ReadFences
	freed := make(chan error, 1)
	start := time.Now()
	go func() { freed <- p.Free(r1) }()
	// Once A's read hold is fenced, the free holds the memory lock and
	// goes on to wait SyncTimeout for A.
	for p.Stats().Counters.ReadFences == fences {
		time.Sleep(time.Millisecond) // polling the primary's counter
	}

	sent := time.Now()
	answer := ask(t, b, "create %d", r2.Addr)
	took := time.Since(sent)
	require.NoError(t, <-freed)
	t.Logf("free took %v; B's create answered %q after %v", time.Since(start), answer, took)
	require.True(t, strings.HasPrefix(answer, "key "),
		"a healthy secondary's create must outlast a free held up by a stopped one: %q after %v", answer, took)
	assert.Greater(t, took, 2*time.Second, "B's create did not wait for the free: the test shows nothing")
}
