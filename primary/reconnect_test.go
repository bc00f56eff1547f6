package primary_test

import (
	"errors"
	"fmt"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/sys/vm"
	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/primary"
	"github.com/mpmr/mpmr/secondary"
)

// A fence of a process's old attachment decided after the process's new
// attachment said hello.
//
// A secondary process closes its attachment and attaches again at once (a
// reconnect). The old attachment unmaps its data memory, declares it, and
// detaches; the primary judges the detach by asking the kernel whether the
// process still reaches data memory (half a second at most: a process with
// many open files takes longer to describe, and is then fenced for
// housekeeping to ask about). Meanwhile the new attachment's hello came
// (ForgetHolder found no fence to end) and it mapped the data memory: from
// then on the kernel's answer about the process is the new attachment's,
// and the old attachment's fence lasts as long as the process, while the
// new attachment follows every change. Every page freed from then on waits
// in quarantine, for good.

func init() {
	testproc.Register("reconnect-sec", reconnectSec)
}

// reconnectSec is a secondary process (args: PREFIX RUNDIR):
//
//	attach     -> "> attached slot=N"
//	fds N      -> holds N more descriptors open (of /dev/null): "> fds N"
//	swap       -> closes the attachment on a goroutine while attaching
//	              again at once (retrying while the old one still maps the
//	              data memory): "> swapped slot=N close=ERR took=D tries=T"
//	lookup A   -> through the new attachment's queue: "> key K" / "> err E"
//	again      -> attaches once more while attached: "> again ERR"
//	blocked    -> closes the attachment, maps something where the data
//	              memory goes, attaches (which fails after its hello),
//	              unmaps it and attaches again at once:
//	              "> blocked ERR reattached ERR slot=N"
//	close      -> "> closed ERR"
func reconnectSec(args []string) int {
	cfg := secondary.Config{Prefix: args[0], RuntimeDir: args[1], Logger: quiet, AttachTimeout: 5 * time.Second}
	var s *secondary.Secondary
	var q *secondary.Queue
	var kept []int
	testproc.Say("ready pid=%d", os.Getpid())
	testproc.EachCommand(func(c testproc.Line) {
		switch c.Name {
		case "attach":
			var err error
			if s, err = secondary.Attach(cfg); err != nil {
				testproc.Say("> attach-failed %v", err)
				return
			}
			q = s.NewQueue()
			testproc.Say("> attached slot=%d", s.Slot())
		case "fds":
			n := int(c.Num(0))
			var lim syscall.Rlimit
			_ = syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim)
			lim.Cur = lim.Max
			if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
				testproc.Say("> err setrlimit %v", err)
				return
			}
			f, err := os.Open("/dev/null")
			if err != nil {
				testproc.Say("> err %v", err)
				return
			}
			for range n {
				fd, err := syscall.Dup(int(f.Fd()))
				if err != nil {
					testproc.Say("> err dup %v", err)
					return
				}
				kept = append(kept, fd)
			}
			testproc.Say("> fds %d", len(kept))
		case "swap":
			old := s
			closed := make(chan string, 1)
			start := time.Now()
			go func() {
				err := old.Close()
				closed <- fmt.Sprintf("close=%v took=%v", err, time.Since(start).Round(time.Millisecond))
			}()
			tries := 0
			var err error
			for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); {
				tries++
				if s, err = secondary.Attach(cfg); err == nil || !errors.Is(err, hugetlb.ErrAddressInUse) {
					break
				}
				time.Sleep(time.Millisecond)
			}
			if err != nil {
				testproc.Say("> attach-failed %v", err)
				return
			}
			q = s.NewQueue()
			testproc.Say("> swapped slot=%d %s tries=%d", s.Slot(), <-closed, tries)
		case "blocked":
			li := s.Memory().Lists()[0]
			if err := s.Close(); err != nil {
				testproc.Say("> err close %v", err)
				return
			}
			blk, err := vm.Reserve(li.Base, uintptr(li.PageSize))
			if err != nil {
				testproc.Say("> err reserve %v", err)
				return
			}
			_, blockedErr := secondary.Attach(cfg)
			if err := vm.Unmap(blk, uintptr(li.PageSize)); err != nil {
				testproc.Say("> err unmap %v", err)
				return
			}
			s, err = secondary.Attach(cfg)
			slot := -1
			if err == nil {
				q, slot = s.NewQueue(), s.Slot()
			}
			testproc.Say("> blocked %v reattached %v slot=%d", blockedErr, err, slot)
		case "again":
			s2, err := secondary.Attach(cfg)
			if err == nil {
				s2.Close()
			}
			testproc.Say("> again %v", err)
		case "lookup":
			testproc.SayKey(q.Lookup(uintptr(c.Num(0))))
		case "close":
			if q != nil {
				q.Close()
			}
			testproc.Say("> closed %v", s.Close())
		}
	})
	return 0
}

// A process that holds many descriptors (a server with many files open,
// say) reconnects: it closes its attachment and attaches again at once.
// Its new attachment follows every memory change, so once the old one has
// unmapped and detached, what the primary frees must go back to the
// allocator; nothing may wait in quarantine for this process for good.
func TestReattachDuringASlowDetachLeavesNoFence(t *testing.T) {
	p, cfg := startPrimary(t, testenv.Tmpfs(t), steadySync)
	ps := p.Backend().PageSize
	r, err := p.Alloc(ps)
	require.NoError(t, err)

	h := testproc.Start(t, "reconnect-sec", []string{cfg.Prefix, cfg.RuntimeDir})
	h.Expect("ready", 0)
	require.Contains(t, ask(t, h, "attach"), "attached")
	require.Equal(t, "fds 19000", ask(t, h, "fds 19000"))
	swapped := ask(t, h, "swap")
	t.Logf("helper: %s", swapped)
	require.Contains(t, swapped, "swapped", swapped)
	require.Contains(t, swapped, "close=<nil>", swapped)
	require.Contains(t, ask(t, h, "lookup %d", r.Addr), "key", "the new attachment works")

	var holders []string
	for _, hd := range p.Segment().Holders() {
		holders = append(holders, fmt.Sprintf("pid %d slot %d epoch %d", hd.PID, hd.Slot, hd.Epoch))
	}
	t.Logf("fence records after the reconnect: %v", holders)

	// The new attachment follows every change: pages freed now must go
	// back (housekeeping asks the kernel every few milliseconds).
	drops := p.Stats().Counters.SyncDrops
	y, err := p.Alloc(ps)
	require.NoError(t, err)
	require.Contains(t, ask(t, h, "lookup %d", y.Addr), "key", "the new attachment maps and follows")
	require.NoError(t, p.Free(y))
	require.Equal(t, drops, p.Stats().Counters.SyncDrops, "the new attachment followed the free")
	deadline := time.Now().Add(3 * time.Second)
	for p.Memory().Quarantined() != 0 && time.Now().Before(deadline) {
		p.Memory().ReleaseQuarantine()
		time.Sleep(10 * time.Millisecond)
	}
	q := p.Memory().Quarantined()
	if q != 0 {
		// Show it lasts: the whole memory goes, a page at a time.
		n := 0
		for ; n < 2*64; n++ {
			y, err := p.Alloc(ps)
			if err != nil {
				t.Logf("alloc %d failed: %v", n, err)
				break
			}
			require.NoError(t, p.Free(y))
		}
		require.Failf(t, "pages freed while every secondary follows wait in quarantine for good",
			"%d page(s) still quarantined 3 s after a free that every secondary acknowledged; fence records %s; "+
				"after %d more alloc/free rounds %d pages are quarantined (pid %d, whose new attachment follows every change)",
			q, strings.Join(holders, ", "), n, p.Memory().Quarantined(), h.PID())
	}
	require.Equal(t, "closed <nil>", ask(t, h, "close"))
}

// The same without many descriptors: a plain reconnect, repeated. The
// detach of a process with a few dozen files takes a millisecond or two
// to describe, and the new attachment's hello and mapping fit in it often
// enough.
func TestReconnectsLeaveNoFence(t *testing.T) {
	p, cfg := startPrimary(t, testenv.Tmpfs(t), shortSync)
	h := testproc.Start(t, "reconnect-sec", []string{cfg.Prefix, cfg.RuntimeDir})
	h.Expect("ready", 0)
	require.Contains(t, ask(t, h, "attach"), "attached")
	rounds := 0
	for ; rounds < 300 && len(p.Segment().Holders()) == 0; rounds++ {
		swapped := ask(t, h, "swap")
		require.Contains(t, swapped, "close=<nil>", swapped)
	}
	t.Logf("reconnects until a fence record appeared: %d (records %v)", rounds, p.Segment().Holders())
	requireFreesGoBack(t, p, h, fmt.Sprintf("after %d plain reconnects", rounds))
}

// requireFreesGoBack has the secondary h look up a page the primary
// allocates, frees the page and requires it back from quarantine: h's
// attachment follows every change, and nothing is fenced for its process.
func requireFreesGoBack(t *testing.T, p *primary.Primary, h *testproc.Proc, when string) {
	t.Helper()
	y, err := p.Alloc(p.Backend().PageSize)
	require.NoError(t, err)
	require.Contains(t, ask(t, h, "lookup %d", y.Addr), "key", "%s: the attachment maps and follows", when)
	require.NoError(t, p.Free(y))
	require.Eventually(t, func() bool { p.Memory().ReleaseQuarantine(); return p.Memory().Quarantined() == 0 },
		3*time.Second, 10*time.Millisecond, "%s: a page freed while the attachment follows waits in quarantine "+
			"for pid %d (fence records %v)", when, h.PID(), p.Segment().Holders())
}

// An attach that fails after its hello (something of the process's own
// is where the data memory goes), tried again at once and succeeding,
// again and again: the end of the failed attempt's claim is judged before
// the new one says hello, so nothing is fenced for the process while its
// new attachment follows every change, and what the primary frees goes
// back.
func TestAnAttachThatFailedAfterItsHelloLeavesNoFence(t *testing.T) {
	p, cfg := startPrimary(t, testenv.Tmpfs(t), shortSync)
	h := testproc.Start(t, "reconnect-sec", []string{cfg.Prefix, cfg.RuntimeDir})
	h.Expect("ready", 0)
	require.Contains(t, ask(t, h, "attach"), "attached")
	for round := range 10 {
		got := ask(t, h, "blocked")
		require.Contains(t, got, "address range already in use", "round %d: %s", round, got)
		require.Contains(t, got, "reattached <nil>", "round %d: %s", round, got)
		// The failed attempt's connection is gone from the primary's
		// sync set once its end has been judged.
		require.Eventually(t, func() bool { return p.Stats().Counters.Secondaries == 1 }, 5*time.Second, time.Millisecond,
			"round %d: the failed attempt's end is judged", round)
		requireFreesGoBack(t, p, h, fmt.Sprintf("round %d", round))
	}
	require.Equal(t, "closed <nil>", ask(t, h, "close"))
}

// A process attached to an instance attaches to it once more, by mistake.
// The second attach is refused before its hello: had it been admitted and
// then failed to map the memory the first one holds, the primary would
// have judged its end by the first one's mappings and fenced the process
// for as long as it lives.
func TestASecondAttachOfAProcessLeavesNoFence(t *testing.T) {
	p, cfg := startPrimary(t, testenv.Tmpfs(t), shortSync)
	h := testproc.Start(t, "reconnect-sec", []string{cfg.Prefix, cfg.RuntimeDir})
	h.Expect("ready", 0)
	require.Contains(t, ask(t, h, "attach"), "attached")
	got := ask(t, h, "again")
	require.Contains(t, got, "attached to the instance already", got)
	require.Contains(t, got, "address range already in use", got)
	require.Empty(t, p.Segment().Holders(), "no fence record")
	requireFreesGoBack(t, p, h, "after a second attach")
	require.Equal(t, "closed <nil>", ask(t, h, "close"))
}
