package primary_test

import (
	"bufio"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/primary"
	"github.com/mpmr/mpmr/secondary"
)

// noFenceAfterFree frees a fresh page and checks that nothing was
// fenced since fenced0 and nothing waits in quarantine.
func noFenceAfterFree(t *testing.T, p *primary.Primary, fenced0 uint64, what string) {
	t.Helper()
	r, err := p.Alloc(p.Backend().PageSize)
	require.NoError(t, err)
	require.NoError(t, p.Free(r))
	assert.Equal(t, fenced0, p.Stats().Counters.Fenced, "%s: fenced", what)
	assert.Zero(t, p.Memory().Quarantined(), "%s: a freed page waits in quarantine", what)
}

// A secondary killed with SIGKILL is not fenced: not when the primary
// frees right after the kill (its sync fails while the process dies),
// not once its connection's end is seen.
func TestAKilledSecondaryIsNotFenced(t *testing.T) {
	p, cfg := startPrimary(t, testenv.Tmpfs(t))
	fenced0 := p.Stats().Counters.Fenced
	for i := range 6 {
		r, err := p.Alloc(p.Backend().PageSize)
		require.NoError(t, err)
		h := startSecondary(t, cfg)
		require.Contains(t, ask(t, h, "lookup %d", r.Addr), "key")
		h.Kill()
		if i%2 == 0 {
			// Racing the death.
			require.NoError(t, p.Free(r))
		} else {
			require.Eventually(t, func() bool { return p.Stats().Counters.Secondaries == 0 }, 5*time.Second, time.Millisecond)
			require.NoError(t, p.Free(r))
		}
		assert.Equal(t, fenced0, p.Stats().Counters.Fenced, "round %d: a killed secondary was fenced", i)
		assert.Zero(t, p.Memory().Quarantined(), "round %d", i)
		_ = h.Wait(10 * time.Second)
	}
	noFenceAfterFree(t, p, fenced0, "after the kills")
}

// The same, with the killed secondary left a zombie: its parent (this
// test) reaps it only at the end.
func TestAKilledUnreapedSecondaryIsNotFenced(t *testing.T) {
	p, cfg := startPrimary(t, testenv.Tmpfs(t))
	fenced0 := p.Stats().Counters.Fenced
	r, err := p.Alloc(p.Backend().PageSize)
	require.NoError(t, err)
	cmd := testproc.Command(t.Context(), "secondary", cfg.Prefix, cfg.RuntimeDir)
	out, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	lines := bufio.NewScanner(out)
	for lines.Scan() && !strings.Contains(lines.Text(), "ready") {
	}
	require.NoError(t, lines.Err())
	require.Equal(t, 1, p.Stats().Counters.Secondaries)
	require.NoError(t, syscall.Kill(cmd.Process.Pid, syscall.SIGKILL))
	require.NoError(t, p.Free(r)) // racing the death
	require.Eventually(t, func() bool { return p.Stats().Counters.Secondaries == 0 }, 5*time.Second, time.Millisecond)
	require.Equal(t, byte('Z'), b10State("/proc/"+strconv.Itoa(cmd.Process.Pid)), "unreaped")
	assert.Equal(t, fenced0, p.Stats().Counters.Fenced, "a killed, unreaped secondary was fenced")
	noFenceAfterFree(t, p, fenced0, "killed, unreaped")
}

// A clean Close racing a stream of Alloc/Free syncs from the primary, and
// a process that exits right after its Close: neither is fenced.
func TestACloseRacingSyncsIsNotFenced(t *testing.T) {
	p, cfg := startPrimary(t, testenv.Tmpfs(t))
	fenced0 := p.Stats().Counters.Fenced
	for i := range 8 {
		h := startSecondary(t, cfg)
		stop := churnPages(t, p)
		assert.Equal(t, "closed", ask(t, h, "close"), "round %d", i)
		require.NoError(t, stop(), "round %d", i)
		assert.Equal(t, fenced0, p.Stats().Counters.Fenced, "round %d: a secondary that closed cleanly while syncs ran was fenced", i)
		h.CloseInput() // it exits normally
		require.NoError(t, h.Wait(10*time.Second))
		noFenceAfterFree(t, p, fenced0, fmt.Sprintf("round %d, exited after close", i))
	}
}

// churnPages allocates and frees a page without pause until the function
// it returns is called, which returns the first error met.
func churnPages(t *testing.T, p *primary.Primary) (stop func() error) {
	var halt atomic.Bool
	var wg sync.WaitGroup
	var first error
	wg.Go(func() {
		for !halt.Load() {
			r, err := p.Alloc(p.Backend().PageSize)
			if err == nil {
				err = p.Free(r)
			}
			if err != nil {
				first = err
				return
			}
		}
	})
	var once sync.Once
	stop = func() error {
		once.Do(func() { halt.Store(true); wg.Wait() })
		return first
	}
	t.Cleanup(func() { _ = stop() })
	return stop
}

// Secondaries killed with SIGKILL while the primary frees and allocates
// without pause (a sync is nearly always in flight to the dying process).
func TestSecondariesKilledDuringSyncsAreNotFenced(t *testing.T) {
	p, cfg := startPrimary(t, testenv.Tmpfs(t))
	fenced0 := p.Stats().Counters.Fenced
	stop := churnPages(t, p)
	for i := range 40 {
		h := startSecondary(t, cfg)
		if !assert.Equal(t, fenced0, p.Stats().Counters.Fenced, "round %d: an attaching secondary was fenced (attach racing syncs)", i) {
			t.Logf("secondary: %s", h.Stderr())
			break
		}
		h.Kill()
		_ = h.Wait(10 * time.Second)
		require.Eventually(t, func() bool { return p.Stats().Counters.Secondaries == 0 }, 5*time.Second, time.Millisecond)
		if !assert.Equal(t, fenced0, p.Stats().Counters.Fenced, "round %d: a killed secondary was fenced", i) {
			break
		}
	}
	require.NoError(t, stop())
	noFenceAfterFree(t, p, fenced0, "after the kills")
}

func init() { testproc.Register("occupied-attach", helperOccupiedAttach) }

// helperOccupiedAttach (args: PREFIX RUNDIR BASE) maps a page of its own at
// BASE, where the data memory goes, and then attaches: the attach fails
// after its hello. It says "> attach-failed ERR" (or "> attached") and
// lives on.
func helperOccupiedAttach(args []string) int {
	base, _ := strconv.ParseUint(args[2], 10, 64)
	_, _, errno := syscall.Syscall6(syscall.SYS_MMAP, uintptr(base), uintptr(os.Getpagesize()),
		syscall.PROT_READ, syscall.MAP_PRIVATE|syscall.MAP_ANONYMOUS|0x100000 /* MAP_FIXED_NOREPLACE */, ^uintptr(0), 0)
	if errno != 0 {
		testproc.Say("> err mmap %v", errno)
		return 3
	}
	s, err := secondary.Attach(secondary.Config{Prefix: args[0], RuntimeDir: args[1], Logger: quiet})
	if err != nil {
		testproc.Say("> attach-failed %v", err)
	} else {
		testproc.Say("> attached")
		defer s.Close()
	}
	testproc.EachCommand(func(testproc.Line) {})
	return 0
}

// An Attach that fails after its hello (the data memory's addresses are
// taken in the process), while the primary frees and allocates without
// pause: the process, which lives on, is not fenced.
func TestAnAttachFailingAfterItsHelloIsNotFenced(t *testing.T) {
	p, cfg := startPrimary(t, testenv.Tmpfs(t))
	fenced0 := p.Stats().Counters.Fenced
	base := p.Memory().Lists()[0].Base
	stop := churnPages(t, p)
	for i := range 10 {
		h := testproc.Start(t, "occupied-attach", []string{cfg.Prefix, cfg.RuntimeDir, strconv.FormatUint(uint64(base), 10)})
		ans := h.Expect("> ", 0)
		require.Contains(t, ans, "attach-failed", ans)
		if i == 0 {
			t.Log(ans)
		}
		require.Eventually(t, func() bool { return p.Stats().Counters.Secondaries == 0 }, 5*time.Second, time.Millisecond)
		if !assert.Equal(t, fenced0, p.Stats().Counters.Fenced, "round %d: fenced", i) {
			break
		}
	}
	require.NoError(t, stop())
	noFenceAfterFree(t, p, fenced0, "after the failed attaches")
}

// waitSecondaries polls the primary helper until it counts n
// secondaries.
func waitSecondaries(t *testing.T, b *b9Inst, n int) {
	t.Helper()
	deadline := time.Now().Add(testproc.DefaultTimeout)
	for {
		ans := b.must("stats")
		var mrs, secs int
		_, err := fmt.Sscanf(ans, "stats mrs=%d secondaries=%d", &mrs, &secs)
		require.NoError(t, err, ans)
		if secs == n {
			return
		}
		require.True(t, time.Now().Before(deadline), ans)
	}
}

// A well-behaved library secondary closes while its primary is stopped:
// its detach goes unanswered (RequestTimeout 300 ms), it unmaps, lets its
// slot go, closes its connection, and lives on without attaching again.
// Once the primary resumes, nothing of it reaches data memory; a free must
// not be quarantined for it, and it must not be fenced.
func TestACloseWhosePrimaryWasStoppedIsNotFenced(t *testing.T) {
	for i := range 8 {
		t.Run(fmt.Sprint(i), func(t *testing.T) {
			b := b9Start(t)
			s := testproc.Start(t, "left-secondary", []string{b.cfg.Prefix, b.cfg.RuntimeDir})
			s.Expect("ready", 0)
			require.Contains(t, ask(t, s, "attach"), "attached")
			waitSecondaries(t, b, 1)

			b.h.Stop()
			require.Equal(t, "closed <nil>", ask(t, s, "close")) // its detach times out
			b.h.Continue()
			waitSecondaries(t, b, 0)

			a, l := b.alloc(1)
			require.Equal(t, "ok", b.must("free %d %d", a, l))
			q, fenced := b.quarantined()
			assert.Zero(t, fenced, "a secondary that closed cleanly (detach unanswered) is fenced")
			assert.Zero(t, q, "a page freed after it left waits in quarantine for it")
		})
	}
}

// A free is under way; a secondary acknowledges its sync in time, but
// its primary is stopped before it reads the acknowledgement; while it is
// stopped the secondary leaves as one whose detach had no answer does (it
// unmaps, closes the backing file, lets its slot go and hangs up) and
// lives on. When the primary resumes, past the sync's deadline, the sync
// has timed out or found the connection ended: either way the process has
// let its slot go and the kernel says it reaches nothing, so it is not
// fenced.
func TestAnAcknowledgementReadLateFencesNoSecondaryThatLeft(t *testing.T) {
	b := b9Start(t)
	a, l := b.alloc(1)
	h := testproc.Start(t, "slot-games", []string{b.cfg.Prefix, b.cfg.RuntimeDir, "0", strconv.FormatUint(b.page, 10)})
	require.True(t, strings.HasPrefix(h.Expect("> ", 0), "> mapped"))
	waitSecondaries(t, b, 1)

	require.Equal(t, "ok", ask(t, h, "push block"))
	b.h.Send("free %d %d", a, l)
	require.Equal(t, "sync", ask(t, h, "wait-sync"))
	t0 := time.Now() // the sync was pushed before: its deadline is before t0 + 1 s
	b.h.Stop()
	require.Equal(t, "ok", ask(t, h, "answer ok"))
	require.Equal(t, "forgot <nil>", ask(t, h, "forget"))
	require.Equal(t, "ok", ask(t, h, "release"))
	require.Equal(t, "ok", ask(t, h, "hangup"))
	// Resume the primary after the sync's deadline (b9: SyncTimeout 1 s).
	// This places the resumption in time; it waits for nothing that could
	// be watched instead.
	<-time.After(time.Until(t0.Add(1200 * time.Millisecond)))
	b.h.Continue()
	line, err := b.h.Next("> ", b9Patience)
	require.NoError(t, err)
	require.Equal(t, "> ok", line, "the free")
	waitSecondaries(t, b, 0) // the end of its connection judged too
	_, fenced := b.quarantined()
	assert.Zero(t, fenced, "a secondary that acknowledged in time and left while its primary was stopped is fenced")
}

func init() { testproc.Register("memfd-app", helperMemfdApp) }

// helperMemfdApp (args: PREFIX RUNDIR INODE) is an application that holds
// a memfd of its own whose inode number is INODE and attaches ("ready",
// or "cannot ERR" if no such memfd can be made); on "close" it closes the
// attachment ("> closed ERR") and lives on.
func helperMemfdApp(args []string) int {
	ino, _ := strconv.ParseUint(args[2], 10, 64)
	fd, err := testenv.MemfdWithInode(ino)
	if err != nil {
		testproc.Say("cannot %v", err)
		return 0
	}
	s, err := secondary.Attach(secondary.Config{Prefix: args[0], RuntimeDir: args[1], Logger: quiet})
	if err != nil {
		testproc.Say("attach-failed %v", err)
		return 3
	}
	testproc.Say("ready")
	testproc.EachCommand(func(testproc.Line) { testproc.Say("> closed %v", s.Close()) })
	runtime.KeepAlive(fd)
	return 0
}

// A library secondary in an application that holds a memfd whose inode
// number is a backing file's closes cleanly and lives on: it is not
// fenced (the memfd is no backing file), and what the primary frees
// afterwards does not wait for it.
func TestACleanCloseBesideAMemfdIsNotFenced(t *testing.T) {
	p, cfg := startPrimary(t, testenv.Tmpfs(t))
	var st unix.Stat_t
	require.NoError(t, unix.Stat(p.Memory().Lists()[0].File, &st))
	h := testproc.Start(t, "memfd-app", []string{cfg.Prefix, cfg.RuntimeDir, strconv.FormatUint(st.Ino, 10)})
	if line := h.Expect("", 0); line != "ready" {
		t.Skipf("no memfd with the backing file's inode %d can be made here: %s", st.Ino, line)
	}
	fenced0 := p.Stats().Counters.Fenced
	require.Equal(t, "closed <nil>", ask(t, h, "close"))
	noFenceAfterFree(t, p, fenced0, "after a clean close beside a memfd")
}
