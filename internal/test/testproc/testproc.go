// Package testproc runs the test binary again as a helper process, the way
// the standard library's os/exec tests do: TestMain calls Main, which runs a
// registered helper instead of the tests when the environment asks for one.
//
// A helper talks over its standard streams: it prints lines (one readiness
// line first), and reads command lines from its standard input. Processes
// started here end with the test: they get the test's context and are killed
// and reaped at cleanup.
package testproc

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

const (
	envHelper = "MPMR_TEST_HELPER"
	envArgs   = "MPMR_TEST_HELPER_ARGS"
)

var helpers = map[string]func(args []string) int{}

// Register makes fn runnable as helper name. Call it from init or from
// TestMain before Main.
func Register(name string, fn func(args []string) int) {
	if _, dup := helpers[name]; dup {
		panic("testproc: helper registered twice: " + name)
	}
	helpers[name] = fn
}

// Main runs the helper named by the environment, or the tests.
func Main(m *testing.M) {
	name := os.Getenv(envHelper)
	if name == "" {
		os.Exit(m.Run())
	}
	fn, ok := helpers[name]
	if !ok {
		fmt.Fprintf(os.Stderr, "testproc: no helper %q\n", name)
		os.Exit(2)
	}
	var args []string
	if err := json.Unmarshal([]byte(os.Getenv(envArgs)), &args); err != nil {
		fmt.Fprintf(os.Stderr, "testproc: bad args: %v\n", err)
		os.Exit(2)
	}
	os.Exit(fn(args))
}

// IsHelper reports whether this process runs as a helper.
func IsHelper() bool { return os.Getenv(envHelper) != "" }

// Proc is a running helper process.
type Proc struct {
	tb     testing.TB
	name   string
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	lines  chan string
	stderr *LockedBuffer
	done   chan struct{}
	err    error // Wait's result, after done
}

// DefaultTimeout bounds Expect when no deadline is given.
const DefaultTimeout = 20 * time.Second

// Command returns the command that runs helper name with args, for code
// without a testing.TB (runnable examples). The caller starts, stops and
// reaps it. Built with the race detector, the helper exits without its
// one-second sleep (QuickRaceExit).
func Command(ctx context.Context, name string, args ...string) *exec.Cmd {
	a, _ := json.Marshal(args)
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), envHelper+"="+name, envArgs+"="+string(a), QuickRaceExit())
	return cmd
}

// QuickRaceExit returns the environment entry ("GORACE=...") that has a
// program built with the race detector exit at once: by default it sleeps
// a second first, and helpers end by the hundred. Other GORACE options
// are kept.
func QuickRaceExit() string {
	return "GORACE=" + strings.TrimSpace(os.Getenv("GORACE")+" atexit_sleep_ms=0")
}

// Start runs helper name with args and extra environment entries ("K=V").
func Start(tb testing.TB, name string, args []string, env ...string) *Proc {
	tb.Helper()
	// Not the test's context: that ends before cleanups run, which would
	// kill the helper before a cleanup registered later (End) could let it
	// exit cleanly. The helper is killed by this cleanup, the first
	// registered and so the last to run.
	ctx, cancel := context.WithCancel(context.WithoutCancel(tb.Context()))
	cmd := Command(ctx, name, args...)
	cmd.Env = append(cmd.Env, env...)
	cmd.Cancel = func() error { return cmd.Process.Kill() }
	p := &Proc{tb: tb, name: name, cmd: cmd, lines: make(chan string, 1024),
		stderr: &LockedBuffer{}, done: make(chan struct{})}
	cmd.Stderr = p.stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		tb.Fatalf("testproc: %v", err)
	}
	if p.stdin, err = cmd.StdinPipe(); err != nil {
		tb.Fatalf("testproc: %v", err)
	}
	if err := cmd.Start(); err != nil {
		tb.Fatalf("testproc: start %s: %v", name, err)
	}
	go func() {
		sc := bufio.NewScanner(out)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			p.lines <- sc.Text()
		}
		close(p.lines)
		p.err = cmd.Wait()
		close(p.done)
	}()
	tb.Cleanup(func() {
		cancel()
		p.Kill()
		<-p.done
		if tb.Failed() && p.stderr.Len() > 0 {
			tb.Logf("helper %s (pid %d) stderr:\n%s", name, p.PID(), p.stderr.String())
		}
	})
	return p
}

// Lines returns the helper's output lines that Expect and Next have not
// taken yet, for a test that must not block on them; it is closed when the
// helper's output ends.
func (p *Proc) Lines() <-chan string { return p.lines }

// PID returns the helper's process id.
func (p *Proc) PID() int { return p.cmd.Process.Pid }

// Expect waits for the next line that starts with prefix, skipping others,
// and returns it. It fails the test if the helper ends first or timeout
// passes (DefaultTimeout when 0).
func (p *Proc) Expect(prefix string, timeout time.Duration) string {
	p.tb.Helper()
	line, err := p.Next(prefix, timeout)
	if err != nil {
		p.tb.Fatalf("%v; stderr:\n%s", err, p.stderr.String())
	}
	return line
}

// Next is Expect returning an error instead of failing.
func (p *Proc) Next(prefix string, timeout time.Duration) (string, error) {
	if timeout == 0 {
		timeout = DefaultTimeout
	}
	t := time.NewTimer(timeout)
	defer t.Stop()
	for {
		select {
		case line, ok := <-p.lines:
			if !ok {
				<-p.done
				return "", fmt.Errorf("helper %s ended (%v) before printing %q", p.name, p.err, prefix)
			}
			if strings.HasPrefix(line, prefix) {
				return line, nil
			}
		case <-t.C:
			return "", fmt.Errorf("helper %s printed no %q within %v", p.name, prefix, timeout)
		}
	}
}

// Send writes one command line to the helper's standard input.
func (p *Proc) Send(format string, args ...any) {
	p.tb.Helper()
	if _, err := fmt.Fprintf(p.stdin, format+"\n", args...); err != nil {
		p.tb.Fatalf("testproc: send to %s: %v", p.name, err)
	}
}

// CloseInput closes the helper's standard input: its command loop sees EOF.
// A helper that has exited already had it closed when it was reaped.
func (p *Proc) CloseInput() {
	p.tb.Helper()
	if err := p.stdin.Close(); err != nil && !errors.Is(err, os.ErrClosed) {
		p.tb.Fatalf("testproc: close input of %s: %v", p.name, err)
	}
}

// End closes the helper's input, unless that was done already, so that it
// shuts down cleanly, and waits up to timeout (DefaultTimeout when 0) for
// it to exit. Unlike Wait it does not fail the test; a helper still
// running afterwards is killed at cleanup as usual. Register it with
// t.Cleanup for helpers that must release what they hold (a primary's
// files) instead of dying by SIGKILL.
func (p *Proc) End(timeout time.Duration) {
	if timeout == 0 {
		timeout = DefaultTimeout
	}
	_ = p.stdin.Close()
	select {
	case <-p.done:
	case <-time.After(timeout):
	}
}

// Stop stops the helper with SIGSTOP and returns once every one of its
// threads is stopped (kill returns before they are), so that what the test
// does next meets a process that cannot answer. Cleanup resumes it, so that
// the kill at the end of the test can reap it.
func (p *Proc) Stop() {
	p.tb.Helper()
	StopPID(p.tb, p.PID())
}

// Continue resumes a stopped helper.
func (p *Proc) Continue() {
	p.tb.Helper()
	if err := syscall.Kill(p.PID(), syscall.SIGCONT); err != nil {
		p.tb.Fatalf("resume helper %s: %v", p.name, err)
	}
}

// StopPID stops process pid (one the test started) as Proc.Stop does.
func StopPID(tb testing.TB, pid int) {
	tb.Helper()
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		tb.Fatalf("stop pid %d: %v", pid, err)
	}
	tb.Cleanup(func() { _ = syscall.Kill(pid, syscall.SIGCONT) })
	if err := WaitStopped(pid, DefaultTimeout); err != nil {
		tb.Fatal(err)
	}
}

// WaitStopped waits until every thread of pid is stopped (after a SIGSTOP),
// up to timeout.
func WaitStopped(pid int, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for !allStopped(pid) {
		if time.Now().After(deadline) {
			return fmt.Errorf("pid %d did not stop within %v", pid, timeout)
		}
		time.Sleep(100 * time.Microsecond) // polling the kernel's answer, not waiting for a guess
	}
	return nil
}

// allStopped reports whether every thread of pid is in the stopped state.
func allStopped(pid int) bool {
	tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	if err != nil || len(tasks) == 0 {
		return false
	}
	for _, t := range tasks {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/stat", pid, t.Name()))
		if err != nil {
			return false
		}
		// The state follows the command name's closing parenthesis.
		i := bytes.LastIndexByte(b, ')')
		if i < 0 || i+2 >= len(b) || b[i+2] != 'T' {
			return false
		}
	}
	return true
}

// Kill sends SIGKILL (if the helper still runs).
func (p *Proc) Kill() {
	_ = p.cmd.Process.Signal(syscall.SIGKILL)
}

// Wait waits for the helper to end and returns its exit error (nil for
// status 0).
func (p *Proc) Wait(timeout time.Duration) error {
	p.tb.Helper()
	if timeout == 0 {
		timeout = DefaultTimeout
	}
	select {
	case <-p.done:
		return p.err
	case <-time.After(timeout):
		p.tb.Fatalf("helper %s did not end within %v", p.name, timeout)
		return nil
	}
}

// Killed reports whether the helper ended by SIGKILL; call after Wait.
func (p *Proc) Killed() bool {
	ws, ok := p.cmd.ProcessState.Sys().(syscall.WaitStatus)
	return ok && ws.Signaled() && ws.Signal() == syscall.SIGKILL
}

// Signal returns the signal that ended the helper, or 0; call after Wait.
func (p *Proc) Signal() syscall.Signal {
	if ws, ok := p.cmd.ProcessState.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
		return ws.Signal()
	}
	return 0
}

// Stderr returns what the helper wrote to its standard error so far.
func (p *Proc) Stderr() string { return p.stderr.String() }

// Commands returns a scanner over the helper's standard input, for use in
// the helper process.
func Commands() *bufio.Scanner { return bufio.NewScanner(os.Stdin) }

// Line is one line of a helper's input, split into words: Name and its
// arguments.
type Line struct {
	Name string
	Args []string
}

// Num returns argument i as an unsigned number (any base strconv accepts
// with base 0), or 0 when it is missing or is no number.
func (c Line) Num(i int) uint64 {
	if i < 0 || i >= len(c.Args) {
		return 0
	}
	n, _ := strconv.ParseUint(c.Args[i], 0, 64)
	return n
}

// EachCommand runs do for every non-empty line of the helper's input,
// until the input ends (the test closed it, or ended), for use in the
// helper process.
func EachCommand(do func(Line)) {
	in := Commands()
	for in.Scan() {
		if f := strings.Fields(in.Text()); len(f) > 0 {
			do(Line{Name: f[0], Args: f[1:]})
		}
	}
}

// SayKey answers a lookup to the test: "> key K", or "> err ERR" when err
// is not nil, for use in the helper process.
func SayKey(k uint32, err error) {
	if err != nil {
		Say("> err %v", err)
		return
	}
	Say("> key %d", k)
}

// Say prints one line to the test, for use in the helper process.
func Say(format string, args ...any) {
	fmt.Fprintf(os.Stdout, format+"\n", args...)
}

// LockedBuffer is a bytes.Buffer that a process's output can be written
// to while tests read it.
type LockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *LockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *LockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

func (l *LockedBuffer) Len() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Len()
}
