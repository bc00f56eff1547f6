package secondary_test

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"os"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/ipc"
	"github.com/mpmr/mpmr/primary"
	"github.com/mpmr/mpmr/secondary"
	"github.com/mpmr/mpmr/shm"
)

func init() {
	testproc.Register("leak-primary", helperLeakPrimary)
	testproc.Register("leak-holder", helperLeakHolder)
}

// helperLeakHolder attaches to the instance (args: prefix, runtime
// directory), says "attached", and stays until its input ends.
func helperLeakHolder(args []string) int {
	s, err := secondary.Attach(secondary.Config{Prefix: args[0], RuntimeDir: args[1], Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer s.Close()
	testproc.Say("attached")
	for in := testproc.Commands(); in.Scan(); {
	}
	return 0
}

// helperLeakPrimary runs a primary (args: prefix, runtime directory,
// backend, slots, connections per user) with a few pages allocated, so
// that attaching maps data memory too, and a mempool "pkts". It prints
// "ready", then answers "sample" with its goroutines, descriptors and
// attached secondaries, until its input ends.
func helperLeakPrimary(args []string) int {
	backend, _ := hugetlb.ParseKind(args[2])
	slots, _ := strconv.Atoi(args[3])
	perUID, _ := strconv.Atoi(args[4])
	p, err := primary.Start(primary.Config{Prefix: args[0], RuntimeDir: args[1], Backend: backend,
		MemoryPages: 16, Slots: slots, Logger: slog.New(slog.DiscardHandler),
		Limits: ipc.Limits{MaxConnsPerUID: perUID, HelloTimeout: time.Minute}})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer p.Close()
	if _, err := p.Alloc(4 * p.Backend().PageSize); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	if _, err := p.CreatePool("pkts", 64, 16); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	testproc.Say("ready")
	in := testproc.Commands()
	for in.Scan() {
		if in.Text() == "sample" {
			r := takeResources()
			testproc.Say("> sample %d %d %d", r.goroutines, r.fds, p.Stats().Counters.Secondaries)
		}
	}
	return 0
}

// resources is what a process holds that attach and detach must give
// back.
type resources struct {
	goroutines int
	fds        int
	mappings   int      // lines of /proc/self/maps
	ours       []string // mappings of the instance's files
}

func takeResources() resources {
	r := resources{goroutines: runtime.NumGoroutine()}
	if ents, err := os.ReadDir("/proc/self/fd"); err == nil {
		r.fds = len(ents) - 1 // the directory being read
	}
	if b, err := os.ReadFile("/proc/self/maps"); err == nil {
		sc := bufio.NewScanner(bytes.NewReader(b))
		for sc.Scan() {
			r.mappings++
			if strings.Contains(sc.Text(), "/mpmr.") {
				r.ours = append(r.ours, sc.Text())
			}
		}
	}
	return r
}

// Slack over the baseline that "flat" allows: goroutines of the runtime
// and the test machinery that come and go, a descriptor for a directory
// read, and mappings the Go heap and the race detector add as the heap
// grows.
const (
	goroutineSlack = 4
	fdSlack        = 2
	mappingSlack   = 16
)

// settled waits, within a bound, for this process's goroutines to fall to
// at most want (goroutines of a closed connection end an instant after
// Close returns) and returns what it holds then.
func settled(want int) resources {
	deadline := time.Now().Add(10 * time.Second)
	for {
		runtime.GC() // finalizers of closed files, and a heap that shrank
		r := takeResources()
		if r.goroutines <= want || time.Now().After(deadline) {
			return r
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func checkFlat(t *testing.T, what string, before, after resources) {
	t.Helper()
	t.Logf("%s: goroutines %d -> %d, descriptors %d -> %d, mappings %d -> %d", what,
		before.goroutines, after.goroutines, before.fds, after.fds, before.mappings, after.mappings)
	assert.LessOrEqual(t, after.goroutines, before.goroutines+goroutineSlack, "goroutines after %s", what)
	assert.LessOrEqual(t, after.fds, before.fds+fdSlack, "descriptors after %s", what)
	assert.LessOrEqual(t, after.mappings, before.mappings+mappingSlack, "mappings after %s", what)
	assert.Empty(t, after.ours, "mappings of the instance's files after %s", what)
	if after.goroutines > before.goroutines+goroutineSlack {
		buf := make([]byte, 1<<20)
		t.Logf("goroutines:\n%s", buf[:runtime.Stack(buf, true)])
	}
}

// stopped waits, within a bound, for process pid to be stopped by a
// signal (state T in /proc), and reports whether it is.
func stopped(pid int) bool {
	deadline := time.Now().Add(10 * time.Second)
	for {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			return false
		}
		// The state follows the command name, which is in parentheses.
		if i := bytes.LastIndexByte(b, ')'); i > 0 && i+2 < len(b) && b[i+2] == 'T' {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(time.Millisecond)
	}
}

// startLeakPrimary runs a primary on backend b in another process (a
// secondary maps data memory at the primary's addresses, which this
// process must keep free) and returns it with its config. slots and
// perUID are its Slots and Limits.MaxConnsPerUID (0: the default).
func startLeakPrimary(t *testing.T, b hugetlb.Backend, slots, perUID int) (*testproc.Proc, secondary.Config) {
	t.Helper()
	cfg := secondary.Config{Prefix: testenv.Prefix(t), RuntimeDir: testenv.RunDir(t),
		Logger: slog.New(slog.DiscardHandler)}
	p := testproc.Start(t, "leak-primary", []string{cfg.Prefix, cfg.RuntimeDir, b.Kind.String(),
		strconv.Itoa(slots), strconv.Itoa(perUID)})
	t.Cleanup(func() { p.End(0) }) // a clean exit removes the instance's files
	p.Expect("ready", 0)
	return p, cfg
}

// sample asks the primary helper for its goroutines, descriptors and
// attached secondaries.
func sample(t *testing.T, p *testproc.Proc) (goroutines, fds, secondaries int) {
	t.Helper()
	p.Send("sample")
	line := p.Expect("> sample ", 0)
	_, err := fmt.Sscanf(line, "> sample %d %d %d", &goroutines, &fds, &secondaries)
	require.NoError(t, err, "%q", line)
	return goroutines, fds, secondaries
}

// Attaching and closing a secondary again and again leaves goroutines,
// descriptors and mappings where they were, in the secondary and in the
// primary.
func TestAttachCloseLeavesNothing(t *testing.T) {
	testenv.ForEachBackend(t, 8, attachCloseLeavesNothing)
}

func attachCloseLeavesNothing(t *testing.T, b hugetlb.Backend) {
	p, cfg := startLeakPrimary(t, b, 0, 0)
	cycle := func() {
		s, err := secondary.Attach(cfg)
		require.NoError(t, err)
		q := s.NewQueue()
		q.Close()
		require.NoError(t, s.Close())
	}
	start := takeResources()
	cycle() // the first attach sets up what stays: pools, the poller
	before := settled(start.goroutines)
	pg, pfds, _ := sample(t, p)
	for range 500 {
		cycle()
	}
	after := settled(before.goroutines)
	checkFlat(t, "500 attach/close cycles", before, after)

	deadline := time.Now().Add(10 * time.Second)
	for {
		g, fds, secs := sample(t, p)
		if (g <= pg && fds <= pfds && secs == 0) || time.Now().After(deadline) {
			t.Logf("primary: goroutines %d -> %d, descriptors %d -> %d", pg, g, pfds, fds)
			assert.LessOrEqual(t, g, pg+goroutineSlack, "the primary's goroutines")
			assert.LessOrEqual(t, fds, pfds+fdSlack, "the primary's descriptors")
			assert.Zero(t, secs, "secondaries the primary still counts")
			break
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// A failed Attach gives back everything it took: with no primary at all,
// with a primary that turns it away (its process table is full, or the
// user has all the connections it may), and with one that does not
// answer.
func TestFailedAttachLeavesNothing(t *testing.T) {
	t.Run("no primary", func(t *testing.T) {
		cfg := secondary.Config{Prefix: testenv.Prefix(t), RuntimeDir: testenv.RunDir(t),
			Logger: slog.New(slog.DiscardHandler)}
		start := takeResources()
		_, err := secondary.Attach(cfg)
		require.ErrorIs(t, err, secondary.ErrNoPrimary)
		before := settled(start.goroutines)
		for range 100 {
			_, err := secondary.Attach(cfg)
			require.ErrorIs(t, err, secondary.ErrNoPrimary)
		}
		checkFlat(t, "100 attaches without a primary", before, settled(before.goroutines))
	})
	refused := func(t *testing.T, cfg secondary.Config, want error, why string) {
		start := takeResources()
		_, err := secondary.Attach(cfg)
		require.ErrorIs(t, err, want)
		require.ErrorContains(t, err, why)
		before := settled(start.goroutines)
		var last error
		for range 100 {
			_, last = secondary.Attach(cfg)
			require.ErrorIs(t, last, want)
		}
		t.Logf("attach failed with: %v", last)
		checkFlat(t, "100 refused attaches", before, settled(before.goroutines))
	}
	t.Run("process table full", func(t *testing.T) {
		_, cfg := startLeakPrimary(t, testenv.Tmpfs(t), 1, 0) // room for the primary only
		refused(t, cfg, shm.ErrNoSlot, "process table is full")
	})
	t.Run("connections of the user", func(t *testing.T) {
		_, cfg := startLeakPrimary(t, testenv.Tmpfs(t), 0, 1)
		// Another process's secondary holds the one connection the user may
		// have. (A connection that has not said hello would make room.)
		first := testproc.Start(t, "leak-holder", []string{cfg.Prefix, cfg.RuntimeDir})
		t.Cleanup(func() { first.End(0) })
		first.Expect("attached", 0)
		// The primary closes the connection before the hello is answered,
		// and says why: a limit, not its end. Attach tries again until its
		// timeout, which is kept short here.
		cfg.AttachTimeout = 20 * time.Millisecond
		refused(t, cfg, ipc.ErrLimit, "at most 1 per user")
	})
	t.Run("primary does not answer", func(t *testing.T) {
		p, cfg := startLeakPrimary(t, testenv.Tmpfs(t), 0, 0)
		require.NoError(t, syscall.Kill(p.PID(), syscall.SIGSTOP))
		t.Cleanup(func() { syscall.Kill(p.PID(), syscall.SIGCONT) })
		require.True(t, stopped(p.PID()), "the primary stops")
		cfg.AttachTimeout = 20 * time.Millisecond
		refused(t, cfg, context.DeadlineExceeded, "hello")
	})
}
