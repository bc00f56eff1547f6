package primary_test

import (
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/cache"
	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/primary"
)

// One secondary (A) is stopped (SIGSTOP) inside a read section of the
// global lock, and the primary frees memory A maps: the free's guard
// fences A's read hold after the lock's fence time, then its sync waits
// for A's acknowledgement, up to SyncTimeout (here a minute). Meanwhile
// another, healthy secondary (B) misses on other memory and asks the
// primary to create the MR. The create must be answered, with its key,
// while the free still waits: a stalled secondary holds up the memory
// changes that need its answer, not the creates of other processes. A
// create of the memory being freed is refused meanwhile, in B and in the
// primary: it would register memory about to go.
func TestACreateIsNotHeldUpByAFreeWaitingForAStoppedSecondary(t *testing.T) {
	const syncTimeout = time.Minute
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
	go func() { freed <- p.Free(r1) }()
	// Once A's read hold is fenced, the free goes on to wait for A.
	for p.Stats().Counters.ReadFences == fences {
		time.Sleep(time.Millisecond) // polling the primary's counter
	}
	stillFreeing := func(what string) {
		t.Helper()
		select {
		case err := <-freed:
			t.Fatalf("the free ended (%v) before %s: it waited for the free", err, what)
		default:
		}
	}

	answer := ask(t, b, "create %d", r2.Addr)
	stillFreeing("B's create was answered")
	require.True(t, strings.HasPrefix(answer, "key "),
		"a healthy secondary's create must be answered while a free waits for a stopped one: %q", answer)
	assert.True(t, strings.HasPrefix(ask(t, b, "create %d", r1.Addr), "err "), "a create of memory being freed")
	_, err = p.Global().Create(uint64(r1.Addr + uintptr(ps)))
	assert.ErrorIs(t, err, cache.ErrNoMemory, "a create of memory being freed, in the primary")
	stillFreeing("the creates of memory being freed were refused")

	a.Continue()
	require.NoError(t, <-freed)
	_, found, err = p.Global().Lookup(uint64(r1.Addr))
	require.NoError(t, err)
	assert.False(t, found, "nothing registered the freed memory meanwhile")
}
