package harness

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/mpmr/mpmr/internal/test/testproc"
)

// Lines a helper prints: a prefix word, a space and a JSON value.
const (
	lineReady = "ready"  // once, first: Ready
	lineReply = ">"      // one per command: envelope
	lineEvent = "event"  // an Event, whenever the helper has news
	lineFatal = "fatal:" // the helper gives up (free text)
)

// Ready is a helper's readiness line. Err is set (and nothing else) if
// the helper could not start, e.g. a secondary that could not attach.
type Ready struct {
	PID  int          `json:"pid"`
	Slot int          `json:"slot"`
	Err  *ErrorReport `json:"err,omitempty"`
	// Data is what the role adds (a primary's first region, ...).
	Data json.RawMessage `json:"data,omitempty"`
}

// envelope carries a command's answer.
type envelope struct {
	Err  *ErrorReport    `json:"err,omitempty"`
	Data json.RawMessage `json:"data,omitempty"`
}

// Event is news a helper prints outside the command/answer sequence, such
// as "holding" (it holds a lock now) or "gone" (it saw the primary die).
type Event struct {
	Name string          `json:"name"`
	At   int64           `json:"at"` // wall clock, Unix nanoseconds
	Data json.RawMessage `json:"data,omitempty"`
}

// Time returns when the event happened.
func (e Event) Time() time.Time { return time.Unix(0, e.At) }

// Decode decodes the event's data into v.
func (e Event) Decode(v any) error { return json.Unmarshal(e.Data, v) }

// Proc is a helper process of a scenario: the test binary re-executed in
// a role. Its methods are for the test's goroutine, except Kill, Stop,
// Cont, PID, Stderr and Ended, which any goroutine may call.
type Proc struct {
	s     *Scenario
	Role  string
	Ready Ready

	cmd    *exec.Cmd
	stdin  io.WriteCloser
	stderr testproc.LockedBuffer
	done   chan struct{} // closed once the process has ended and been reaped
	err    error         // cmd.Wait's result, once done

	lmu     sync.Mutex
	lines   []string      // printed and not yet read
	more    chan struct{} // signalled when lines grow or output ends
	outDone bool

	mu       sync.Mutex
	inClosed bool
	killedAt time.Time
}

// DefaultTimeout bounds a command's answer and an expected event.
const DefaultTimeout = 20 * time.Second

// Call sends command name with args (JSON-encoded; nil for none) and waits
// for the answer, decoding its data into reply (may be nil). A failure the
// helper reports comes back as an *ErrorReport; a helper that ends or
// stays silent for DefaultTimeout gives another error.
func (p *Proc) Call(name string, args, reply any) error {
	if err := p.Post(name, args); err != nil {
		return err
	}
	return p.Answer(reply, DefaultTimeout)
}

// MustCall is Call that fails the test on any error.
func (p *Proc) MustCall(name string, args, reply any) {
	p.s.tb.Helper()
	if err := p.Call(name, args, reply); err != nil {
		p.s.tb.Fatalf("%s %s: %s: %v", p.Role, p.label(), name, describe(err))
	}
}

// Post sends a command without waiting for its answer; collect it later
// with Answer. Commands are answered in order.
func (p *Proc) Post(name string, args any) error {
	line := name
	if args != nil {
		b, err := json.Marshal(args)
		if err != nil {
			return err
		}
		line += " " + string(b)
	}
	return p.Send("%s", line)
}

// Answer waits for the next answer and decodes it like Call.
func (p *Proc) Answer(reply any, timeout time.Duration) error {
	line, err := p.Next(lineReply+" ", timeout)
	if err != nil {
		return err
	}
	var env envelope
	if err := json.Unmarshal([]byte(line[len(lineReply)+1:]), &env); err != nil {
		return fmt.Errorf("harness: bad answer %q: %w", line, err)
	}
	if env.Err != nil {
		return env.Err
	}
	if reply != nil && env.Data != nil {
		return json.Unmarshal(env.Data, reply)
	}
	return nil
}

// Await waits for the next event called name (skipping other lines) for
// up to timeout (DefaultTimeout if 0).
func (p *Proc) Await(name string, timeout time.Duration) (Event, error) {
	if timeout == 0 {
		timeout = DefaultTimeout
	}
	deadline := time.Now().Add(timeout)
	for {
		line, err := p.Next(lineEvent+" ", time.Until(deadline))
		if err != nil {
			return Event{}, fmt.Errorf("awaiting %q: %w", name, err)
		}
		var ev Event
		if err := json.Unmarshal([]byte(line[len(lineEvent)+1:]), &ev); err != nil {
			return Event{}, fmt.Errorf("harness: bad event %q: %w", line, err)
		}
		if ev.Name == name {
			return ev, nil
		}
	}
}

// MustAwait is Await that fails the test on error.
func (p *Proc) MustAwait(name string) Event {
	p.s.tb.Helper()
	ev, err := p.Await(name, 0)
	if err != nil {
		p.s.tb.Fatalf("%s %s: %v", p.Role, p.label(), err)
	}
	return ev
}

// PID returns the process id.
func (p *Proc) PID() int { return p.cmd.Process.Pid }

// Send writes one line to the helper's input.
func (p *Proc) Send(format string, args ...any) error {
	if _, err := fmt.Fprintf(p.stdin, format+"\n", args...); err != nil {
		return fmt.Errorf("harness: send to %s %s: %w", p.Role, p.label(), err)
	}
	return nil
}

// Next returns the next line that starts with prefix, dropping the lines
// before it, waiting up to timeout (DefaultTimeout if 0). It fails if the
// helper's output ends first.
func (p *Proc) Next(prefix string, timeout time.Duration) (string, error) {
	if timeout <= 0 {
		timeout = DefaultTimeout
	}
	t := time.NewTimer(timeout)
	defer t.Stop()
	for {
		p.lmu.Lock()
		for len(p.lines) > 0 {
			line := p.lines[0]
			p.lines = p.lines[1:]
			if strings.HasPrefix(line, prefix) {
				p.lmu.Unlock()
				return line, nil
			}
		}
		ended := p.outDone
		p.lmu.Unlock()
		if ended {
			<-p.done
			return "", fmt.Errorf("%s %s ended (%v) before printing %q; stderr:\n%s", p.Role, p.label(), p.err, prefix, p.Stderr())
		}
		select {
		case <-p.more:
		case <-t.C:
			return "", fmt.Errorf("%s %s printed no %q within %v", p.Role, p.label(), prefix, timeout)
		}
	}
}

// readLines collects the helper's output lines until it ends.
func (p *Proc) readLines(out io.Reader) {
	sc := bufio.NewScanner(out)
	sc.Buffer(make([]byte, 64<<10), 64<<20)
	for sc.Scan() {
		p.lmu.Lock()
		p.lines = append(p.lines, sc.Text())
		p.lmu.Unlock()
		p.signal()
	}
	p.lmu.Lock()
	p.outDone = true
	p.lmu.Unlock()
	p.signal()
}

func (p *Proc) signal() {
	select {
	case p.more <- struct{}{}:
	default:
	}
}

// Stderr returns what the helper wrote to its standard error so far.
func (p *Proc) Stderr() string { return p.stderr.String() }

// Kill sends SIGKILL and waits (bounded) for the process to end. It
// returns the moment just before the signal was sent.
func (p *Proc) Kill() time.Time {
	at := time.Now()
	_ = p.cmd.Process.Signal(syscall.SIGKILL)
	p.mu.Lock()
	if p.killedAt.IsZero() {
		p.killedAt = at
	}
	p.mu.Unlock()
	if !p.wait(DefaultTimeout) {
		p.s.tb.Errorf("%s %s did not end within %v of SIGKILL", p.Role, p.label(), DefaultTimeout)
	}
	return at
}

// KillWithin kills the process at a random moment within max from now
// (drawn from rng, so that a logged seed replays a run), like Kill.
func (p *Proc) KillWithin(rng *rand.Rand, max time.Duration) time.Time {
	if max > 0 {
		time.Sleep(time.Duration(rng.Int64N(int64(max))))
	}
	return p.Kill()
}

// Stop sends SIGSTOP and returns once every thread of the process is
// stopped: the process freezes, holding whatever it holds.
func (p *Proc) Stop() error {
	if err := p.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		return err
	}
	return testproc.WaitStopped(p.cmd.Process.Pid, DefaultTimeout)
}

// Cont sends SIGCONT.
func (p *Proc) Cont() error { return p.cmd.Process.Signal(syscall.SIGCONT) }

// Close closes the helper's input, which makes it shut down cleanly, and
// waits (bounded) for it to end; it returns the exit error (nil for
// status 0).
func (p *Proc) Close() error {
	p.closeInput()
	if !p.wait(DefaultTimeout) {
		return fmt.Errorf("%s %s did not end within %v of its input closing", p.Role, p.label(), DefaultTimeout)
	}
	return p.err
}

func (p *Proc) closeInput() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.inClosed {
		p.inClosed = true
		p.stdin.Close()
	}
}

// wait waits up to timeout for the process to end and be reaped.
func (p *Proc) wait(timeout time.Duration) bool {
	select {
	case <-p.done:
		return true
	case <-time.After(timeout):
		return false
	}
}

// Ended reports whether the process has ended (and been reaped).
func (p *Proc) Ended() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// Killed reports whether the process ended by SIGKILL.
func (p *Proc) Killed() bool {
	if !p.Ended() {
		return false
	}
	ws, ok := p.cmd.ProcessState.Sys().(syscall.WaitStatus)
	return ok && ws.Signaled() && ws.Signal() == syscall.SIGKILL
}

func (p *Proc) label() string { return "pid " + strconv.Itoa(p.PID()) }

// running reports whether pid exists and is not a zombie.
func running(pid int) bool {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return false
	}
	i := strings.LastIndexByte(string(b), ')')
	return i < 0 || i+2 >= len(b) || b[i+2] != 'Z'
}

// describe adds the sentinels of a helper's error to its text.
func describe(err error) string {
	var r *ErrorReport
	if errors.As(err, &r) {
		return r.String()
	}
	return err.Error()
}
