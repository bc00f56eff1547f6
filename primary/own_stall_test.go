package primary_test

import (
	"fmt"
	"os"
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
)

func init() { testproc.Register("stalling-primary", helperStallingPrimary) }

// helperStallingPrimary runs a primary (prefix args[0], runtime directory
// args[1], SyncTimeout args[2]) on tmpfs that, once armed, stops itself
// (SIGSTOP) in its next memory sync, as it is about to push it: a primary
// stopped by a debugger, say, at the worst moment. The stop is the
// process's: it lands when a thread of it takes the signal, as the push is
// about to go or, on a loaded machine, a little later, while the push is
// being sent. Commands:
//
//	alloc PAGES   -> "> region ADDR LEN"
//	arm           -> "> armed"
//	free ADDR LEN -> "> freed ERR"
//	stats         -> "> drops=N fenced=N secondaries=N"
func helperStallingPrimary(args []string) int {
	timeout, err := time.ParseDuration(args[2])
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 3
	}
	var armed atomic.Bool
	defer primary.SetSyncPushing(func() {
		if armed.CompareAndSwap(true, false) {
			_ = syscall.Kill(os.Getpid(), syscall.SIGSTOP)
		}
	})()
	p, err := primary.Start(primary.Config{Prefix: args[0], RuntimeDir: args[1], Backend: hugetlb.Tmpfs,
		MemoryPages: 16, Logger: quiet, SyncTimeout: timeout})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 3
	}
	defer p.Close()
	testproc.Say("ready")
	testproc.EachCommand(func(c testproc.Line) {
		switch c.Name {
		case "alloc":
			r, err := p.Alloc(c.Num(0) * p.Backend().PageSize)
			if err != nil {
				testproc.Say("> err %v", err)
				return
			}
			testproc.Say("> region %d %d", r.Addr, r.Len)
		case "arm":
			armed.Store(true)
			testproc.Say("> armed")
		case "free":
			testproc.Say("> freed %v", p.Free(hugetlb.Region{Addr: uintptr(c.Num(0)), Len: c.Num(1)}))
		case "stats":
			st := p.Stats().Counters
			testproc.Say("> drops=%d fenced=%d secondaries=%d", st.SyncDrops, st.Fenced, st.Secondaries)
		}
	})
	return 0
}

// A primary stopped (SIGSTOP, a debugger) in a free's sync, before the
// push went out, past SyncTimeout: the healthy secondary answers the push
// as soon as the primary resumes and sends it, and is not dropped for the
// primary's own stall.
func TestAPrimaryStoppedBeforeItsSyncGoesOutDropsNoSecondary(t *testing.T) {
	const syncTimeout = time.Second // room for a loaded machine's secondary to answer once the push goes
	cfg := primary.Config{Prefix: testenv.Prefix(t), RuntimeDir: testenv.RunDir(t), Backend: testenv.Tmpfs(t).Kind}
	t.Cleanup(func() { removeInstanceFiles(t, cfg.Prefix) })
	ph := testproc.Start(t, "stalling-primary", []string{cfg.Prefix, cfg.RuntimeDir, syncTimeout.String()})
	ph.Expect("ready", 0)
	t.Cleanup(func() { _ = syscall.Kill(ph.PID(), syscall.SIGCONT) })
	var gone, kept struct {
		addr uintptr
		len  uint64
	}
	_, err := fmt.Sscanf(ask(t, ph, "alloc 1"), "region %d %d", &gone.addr, &gone.len)
	require.NoError(t, err)
	_, err = fmt.Sscanf(ask(t, ph, "alloc 1"), "region %d %d", &kept.addr, &kept.len)
	require.NoError(t, err)
	s := startSecondary(t, cfg)
	require.Contains(t, ask(t, s, "lookup %d", gone.addr), "key")

	require.Equal(t, "armed", ask(t, ph, "arm"))
	ph.Send("free %d %d", gone.addr, gone.len)
	require.NoError(t, testproc.WaitStopped(ph.PID(), testproc.DefaultTimeout), "the primary stops itself in the free's sync")
	time.Sleep(syncTimeout + syncTimeout/2) // it stays stopped past SyncTimeout
	require.NoError(t, syscall.Kill(ph.PID(), syscall.SIGCONT))
	assert.Equal(t, "> freed <nil>", ph.Expect("> freed", 0))
	assert.Equal(t, "drops=0 fenced=0 secondaries=1", ask(t, ph, "stats"))
	assert.Contains(t, ask(t, s, "lookup %d", kept.addr), "key", "the secondary goes on working")
}
