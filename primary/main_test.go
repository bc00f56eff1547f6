package primary_test

import (
	"bufio"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/primary"
	"github.com/mpmr/mpmr/secondary"
	"github.com/mpmr/mpmr/verbs"
)

func TestMain(m *testing.M) {
	testproc.Register("secondary", helperSecondary)
	testproc.Main(m)
}

var quiet = slog.New(slog.DiscardHandler)

// startPrimary starts a primary on a fresh prefix with its runtime files in
// a temporary directory, closed at cleanup.
func startPrimary(t testing.TB, b hugetlb.Backend, tweak ...func(*primary.Config)) (*primary.Primary, primary.Config) {
	t.Helper()
	cfg := primary.Config{Prefix: testenv.Prefix(t), RuntimeDir: testenv.RunDir(t), Backend: b.Kind,
		MemoryPages: 64, Logger: quiet}
	for _, f := range tweak {
		f(&cfg)
	}
	p, err := primary.Start(cfg)
	require.NoError(t, err)
	t.Cleanup(func() { p.Close() })
	return p, cfg
}

// startSecondary runs a secondary helper process attached to cfg's
// instance and waits for it to be ready.
func startSecondary(t testing.TB, cfg primary.Config) *testproc.Proc {
	t.Helper()
	h := testproc.Start(t, "secondary", []string{cfg.Prefix, cfg.RuntimeDir})
	h.Expect("ready", 0)
	return h
}

// startSecondaryOnCommand runs a secondary helper process that attaches
// to cfg's instance only when told (attachNow): its start, which takes a
// while on a loaded machine, is then out of whatever the test times.
func startSecondaryOnCommand(t testing.TB, cfg primary.Config) *testproc.Proc {
	t.Helper()
	h := testproc.Start(t, "secondary", []string{cfg.Prefix, cfg.RuntimeDir, "on-command"})
	h.Expect("started", 0)
	return h
}

// attachNow has a helper of startSecondaryOnCommand attach; it says
// "ready" (or "attach-failed") once it is done.
func attachNow(h *testproc.Proc) { h.Send("attach") }

// readLine reads one line from r a byte at a time, so that nothing after
// it is taken from r.
func readLine(r io.Reader) (string, error) {
	var line []byte
	b := make([]byte, 1)
	for {
		if _, err := r.Read(b); err != nil {
			return string(line), err
		}
		if b[0] == '\n' {
			return string(line), nil
		}
		line = append(line, b[0])
	}
}

// ask sends a command to a secondary helper and returns its answer line.
func ask(t testing.TB, h *testproc.Proc, format string, args ...any) string {
	t.Helper()
	h.Send(format, args...)
	return strings.TrimPrefix(h.Expect("> ", 0), "> ")
}

// helperSecondary attaches (with args[2] "on-command", only once a line
// "attach" comes: it says "started" first) and then runs commands, one
// per line:
//
//	lookup ADDR          -> "key K" or "err TEXT"
//	create ADDR          -> the same, asking the primary directly
//	validate ADDR KEY    -> "ok" or "err TEXT"
//	read ADDR            -> "byte B"
//	hammer G N ADDR LEN  -> G goroutines, each with its own queue, make N
//	                        lookups of addresses in [ADDR, ADDR+LEN) and
//	                        validate every key: "done LOOKUPS FAILURES"
//	devfile              -> reads a line from the device file the primary
//	                        handed over: "devfile NAME pd=N soft=B read=LINE"
//	stats                -> "stats lookups=.. created=.. requests=.."
//	shared               -> enters the global read lock and stays: "in"
//	leave                -> leaves it: "left ERR" (nil, or why the read
//	                        section did not count)
//	poke ADDR B          -> writes byte B at ADDR, surviving a fault:
//	                        "wrote" or "fault"
//	peek ADDR            -> reads the byte at ADDR, surviving a fault:
//	                        "byte B" or "fault"
//	wait-dropped         -> waits (bounded) until the primary is gone or
//	                        has dropped this process: "dropped=BOOL"
//	regpool ADDR LEN     -> registers a mempool of the one chunk [ADDR, +LEN):
//	                        "ok" or "err TEXT"
//	fork                 -> forks a child that only pauses (raw system
//	                        calls, no runtime): "child PID"
//	close                -> "closed"
func helperSecondary(args []string) int {
	if len(args) > 2 && args[2] == "on-command" {
		testproc.Say("started")
		if line, err := readLine(os.Stdin); err != nil || line != "attach" {
			fmt.Fprintf(os.Stderr, "want a line \"attach\", got %q (%v)\n", line, err)
			return 3
		}
	}
	s, err := secondary.Attach(secondary.Config{Prefix: args[0], RuntimeDir: args[1], Logger: quiet})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		testproc.Say("attach-failed %v", err)
		return 3
	}
	q := s.NewQueue()
	testproc.Say("ready slot=%d", s.Slot())
	var leave chan struct{}
	var left chan error
	testproc.EachCommand(func(c testproc.Line) {
		switch c.Name {
		case "lookup":
			testproc.SayKey(q.Lookup(uintptr(c.Num(0))))
		case "create":
			e, err := s.CreateMR(c.Num(0))
			testproc.SayKey(e.LKey, err)
		case "validate":
			err := s.Device().Validate(verbs.SGE{Addr: uintptr(c.Num(0)), Len: 1, Key: uint32(c.Num(1))}, verbs.AccessLocalWrite)
			if err != nil {
				testproc.Say("> err %v", err)
			} else {
				testproc.Say("> ok")
			}
		case "read":
			b := *(*byte)(pointer(uintptr(c.Num(0))))
			testproc.Say("> byte %d", b)
		case "hammer":
			lookups, failures := hammer(s, int(c.Num(0)), int(c.Num(1)), uintptr(c.Num(2)), c.Num(3))
			testproc.Say("> done %d %d", lookups, failures)
		case "devfile":
			f, pd := s.DeviceFile()
			if f == nil {
				testproc.Say("> err no device file (device %s)", s.DeviceName())
				break
			}
			line, err := bufio.NewReader(f).ReadString('\n')
			testproc.Say("> devfile %s pd=%d soft=%t read=%q err=%v", s.DeviceName(), pd, s.Device() != nil,
				strings.TrimSpace(line), err)
		case "regpool":
			err := s.RegisterMempool(q, chunkPool{{Addr: uintptr(c.Num(0)), Len: c.Num(1)}})
			if err != nil {
				testproc.Say("> err %v", err)
			} else {
				testproc.Say("> ok")
			}
		case "stats":
			c := s.Stats().Counters
			testproc.Say("> stats lookups=%d created=%d requests=%d flushes=%d", c.Lookups, c.Created, c.Requests, c.Flushes)
		case "shared":
			leave, left = make(chan struct{}), make(chan error, 1)
			go func() {
				left <- s.Global().Shared(func() {
					testproc.Say("> in")
					<-leave
				})
			}()
		case "leave":
			close(leave)
			testproc.Say("> left %v", <-left)
		case "poke":
			if poke(uintptr(c.Num(0)), byte(c.Num(1))) {
				testproc.Say("> wrote")
			} else {
				testproc.Say("> fault")
			}
		case "fork":
			pid, _, errno := syscall.RawSyscall(syscall.SYS_FORK, 0, 0, 0)
			if errno != 0 {
				testproc.Say("> err fork: %v", errno)
				break
			}
			if pid == 0 {
				for {
					syscall.RawSyscall(syscall.SYS_PAUSE, 0, 0, 0)
				}
			}
			testproc.Say("> child %d", pid)
		case "peek":
			if b, ok := peek(uintptr(c.Num(0))); ok {
				testproc.Say("> byte %d", b)
			} else {
				testproc.Say("> fault")
			}
		case "wait-dropped":
			select {
			case <-s.PrimaryGone():
			case <-time.After(testproc.DefaultTimeout):
			}
			testproc.Say("> dropped=%t", s.Dropped())
		case "close":
			if err := s.Close(); err != nil {
				testproc.Say("> err %v", err)
			} else {
				testproc.Say("> closed")
			}
		default:
			testproc.Say("> err unknown command %q", c.Name)
		}
	})
	return 0
}

func hammer(s *secondary.Secondary, goroutines, n int, addr uintptr, length uint64) (lookups, failures int64) {
	type result struct{ lookups, failures int64 }
	out := make(chan result)
	for g := range goroutines {
		go func() {
			q := s.NewQueue()
			defer q.Close()
			var r result
			for i := range n {
				a := addr + uintptr((uint64(g*7919+i*104729))%length)
				k, err := q.Lookup(a)
				r.lookups++
				if err == nil {
					err = s.Device().Validate(verbs.SGE{Addr: a, Len: 1, Key: k}, verbs.AccessLocalWrite)
				}
				if err != nil {
					r.failures++
					fmt.Fprintln(os.Stderr, err)
				}
			}
			out <- r
		}()
	}
	for range goroutines {
		r := <-out
		lookups += r.lookups
		failures += r.failures
	}
	return lookups, failures
}

func parseKey(t testing.TB, answer string) uint32 {
	t.Helper()
	var k uint32
	_, err := fmt.Sscanf(answer, "key %d", &k)
	require.NoError(t, err, "answer %q", answer)
	return k
}
