package harness

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/ipc"
	"github.com/mpmr/mpmr/primary"
)

// Environment of helper processes.
const (
	// envScenario tags every helper with its scenario, so that the final
	// check finds any process of the scenario still running, children
	// of helpers included.
	envScenario = "MPMR_HARNESS_SCENARIO"
	// LongEnv, set to 1, selects the long versions of the scenarios, like
	// the -mpmr.long flag.
	LongEnv = "MPMR_LONG"
	// SoakEnv, set to a duration, runs the soak for that long, like the
	// -mpmr.soak flag.
	SoakEnv = "MPMR_SOAK"
)

var (
	longFlag = flag.Bool("mpmr.long", false, "run the long versions of the scenarios, and the soak")
	soakFlag = flag.Duration("mpmr.soak", 0, "run the soak for this long (0: only with -mpmr.long, for a minute)")
)

// Long reports whether the long versions of the scenarios were asked for
// (-mpmr.long or MPMR_LONG=1).
func Long() bool { return *longFlag || os.Getenv(LongEnv) == "1" }

// SoakDuration returns how long the soak should run, or 0 to skip it:
// -mpmr.soak or MPMR_SOAK if set, else a minute in long mode.
func SoakDuration() time.Duration {
	if *soakFlag > 0 {
		return *soakFlag
	}
	if d, err := time.ParseDuration(os.Getenv(SoakEnv)); err == nil && d > 0 {
		return d
	}
	if Long() {
		return time.Minute
	}
	return 0
}

// Pick returns short, or long in long mode.
func Pick[T any](short, long T) T {
	if Long() {
		return long
	}
	return short
}

// Environment of a helper process: its role and arguments.
const (
	envRole = "MPMR_HARNESS_ROLE"
	envArgs = "MPMR_HARNESS_ARGS"
)

// roles are the helper roles, by name.
var roles = map[string]func(args []byte) int{}

func register(name string, fn func(args []byte) int) {
	if _, dup := roles[name]; dup {
		panic("harness: role registered twice: " + name)
	}
	roles[name] = fn
}

// Main runs the helper role the environment names, or else (see
// testproc.Main) a testproc helper or the tests. Call it from the TestMain
// of every package that uses the harness.
func Main(m *testing.M) {
	if name := os.Getenv(envRole); name != "" {
		fn, ok := roles[name]
		if !ok {
			fmt.Fprintf(os.Stderr, "%s no role %q\n", lineFatal, name)
			os.Exit(2)
		}
		os.Exit(fn([]byte(os.Getenv(envArgs))))
	}
	testproc.Main(m)
}

var scenarioSeq atomic.Int64

// Scenario is one run of an instance: a prefix and runtime directory of
// its own on one backend, the processes started for it, and the check at
// its end that nothing is left. A Scenario belongs to one test and is used
// from its goroutine (Kill, Stop and Cont of its Procs excepted).
type Scenario struct {
	tb      testing.TB
	id      string
	Prefix  string
	RunDir  string
	Backend hugetlb.Backend

	log    *logBuffer
	logger *slog.Logger
	huge   *hugeSample // before the scenario; nil on tmpfs

	procs *procList // shared with the views In returns
}

// procList is the helpers a scenario started.
type procList struct {
	mu    sync.Mutex
	procs []*Proc
}

// New sets up a scenario on backend b and registers its final check: when
// the test ends, after every process of the scenario has been shut down
// (helpers get their input closed and are killed if they do not end), it
// reports as test errors any process, file, mapping or hugepage the
// scenario left behind, and then removes what it can.
func New(tb testing.TB, b hugetlb.Backend) *Scenario {
	tb.Helper()
	s := newScenario(tb, b)
	tb.Cleanup(s.finish)
	return s
}

// newScenario is New without the final check.
func newScenario(tb testing.TB, b hugetlb.Backend) *Scenario {
	s := &Scenario{
		tb:      tb,
		id:      fmt.Sprintf("%d-%d", os.Getpid(), scenarioSeq.Add(1)),
		RunDir:  testenv.RunDir(tb), // removed after the check below
		Prefix:  testenv.Prefix(tb),
		Backend: b,
		log:     &logBuffer{},
		procs:   &procList{},
	}
	s.logger = slog.New(slog.NewTextHandler(s.log, &slog.HandlerOptions{Level: slog.LevelInfo}))
	if b.Kind == hugetlb.Hugetlbfs {
		h := takeHugeSample(s.Name(), b.PageSize)
		s.huge = &h
	}
	return s
}

// In returns a view of the scenario for a subtest: helpers and runtimes
// started through it report to tb and end when tb's test does, while the
// final check stays with the scenario's own test.
func (s *Scenario) In(tb testing.TB) *Scenario {
	v := *s
	v.tb = tb
	return &v
}

// TB returns the test the scenario belongs to.
func (s *Scenario) TB() testing.TB { return s.tb }

// Logger returns a logger whose output is shown if the test fails.
func (s *Scenario) Logger() *slog.Logger { return s.logger }

// Config returns the primary configuration of the scenario: its prefix,
// runtime directory and backend, 16 pages of address space for data
// memory, and the scenario's logger; tweaks adjust it.
func (s *Scenario) Config(tweaks ...func(*primary.Config)) primary.Config {
	cfg := primary.Config{Prefix: s.Prefix, RuntimeDir: s.RunDir, Backend: s.Backend.Kind,
		BackendDir: s.Backend.Dir, MemoryPages: 16, Logger: s.logger}
	for _, f := range tweaks {
		f(&cfg)
	}
	return cfg
}

// addressInUsePatience bounds how long Start is retried while a killed
// primary's listening socket lingers.
const addressInUsePatience = 5 * time.Second

// startPrimary starts a primary for cfg, retrying while the socket
// address is still in use (a primary killed an instant ago).
func startPrimary(cfg primary.Config) (*primary.Primary, error) {
	deadline := time.Now().Add(addressInUsePatience)
	for {
		p, err := primary.Start(cfg)
		if !errors.Is(err, ipc.ErrAddressInUse) || time.Now().After(deadline) {
			return p, err
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// StartPrimary starts the scenario's primary in the test process. It is
// closed when the test ends (an error from Close fails the test).
func (s *Scenario) StartPrimary(tweaks ...func(*primary.Config)) *primary.Primary {
	s.tb.Helper()
	p, err := startPrimary(s.Config(tweaks...))
	if err != nil {
		s.tb.Fatalf("start primary: %v", err)
	}
	s.tb.Cleanup(func() {
		if err := p.Close(); err != nil {
			s.tb.Errorf("close primary: %v", err)
		}
	})
	return p
}

// Recover cleans up after a primary that was killed: it starts a primary
// on the prefix (which removes what the dead one left) and closes it.
// Call it once the scenario is done with processes of the dead instance.
func (s *Scenario) Recover() error {
	p, err := startPrimary(s.Config())
	if err != nil {
		return fmt.Errorf("harness: recover %s: %w", s.Prefix, err)
	}
	return p.Close()
}

// PrimaryArgs configures a primary helper process.
type PrimaryArgs struct {
	Prefix      string `json:"prefix"`
	RunDir      string `json:"rundir"`
	Backend     string `json:"backend"`
	BackendDir  string `json:"backend_dir"`
	MemoryPages int    `json:"memory_pages"`
	SinglePage  bool   `json:"single_page"`
	// Pages to allocate (and register) before the readiness line.
	Pages int `json:"pages"`
}

// PrimaryReady is the Data of a primary helper's readiness line.
type PrimaryReady struct {
	Addr     uint64 `json:"addr"` // the region allocated at start
	Len      uint64 `json:"len"`
	Key      uint32 `json:"key"` // its MR's key
	PageSize uint64 `json:"page_size"`
}

// StartPrimaryProcess starts the scenario's primary as a helper process
// with pages of data memory allocated and registered, and waits until it
// is ready. Closing its input (Proc.Close) closes the primary.
func (s *Scenario) StartPrimaryProcess(pages int, tweaks ...func(*PrimaryArgs)) (*Proc, PrimaryReady) {
	s.tb.Helper()
	a := PrimaryArgs{Prefix: s.Prefix, RunDir: s.RunDir, Backend: s.Backend.Kind.String(),
		BackendDir: s.Backend.Dir, MemoryPages: 16, Pages: pages}
	for _, f := range tweaks {
		f(&a)
	}
	p := s.Start(RolePrimary, a)
	var r PrimaryReady
	if err := json.Unmarshal(p.Ready.Data, &r); err != nil {
		s.tb.Fatalf("primary helper: readiness data %s: %v", p.Ready.Data, err)
	}
	return p, r
}

// SecondaryArgs configures a secondary helper process.
type SecondaryArgs struct {
	Prefix string `json:"prefix"`
	RunDir string `json:"rundir"`
}

// StartSecondary starts a secondary helper process and waits until it
// has attached.
func (s *Scenario) StartSecondary() *Proc {
	s.tb.Helper()
	return s.Start(RoleSecondary, SecondaryArgs{Prefix: s.Prefix, RunDir: s.RunDir})
}

// TryStartSecondary starts a secondary helper process that may fail to
// attach: it returns the process, and the error it reported (the process
// has then ended).
func (s *Scenario) TryStartSecondary() (*Proc, *ErrorReport) {
	s.tb.Helper()
	p := s.Spawn(RoleSecondary, SecondaryArgs{Prefix: s.Prefix, RunDir: s.RunDir})
	if p.Ready.Err != nil {
		p.wait(DefaultTimeout)
	}
	return p, p.Ready.Err
}

// Start starts a helper in role with args and waits for its readiness
// line, failing the test if the helper reports an error instead.
func (s *Scenario) Start(role string, args any) *Proc {
	s.tb.Helper()
	p := s.Spawn(role, args)
	if p.Ready.Err != nil {
		p.wait(DefaultTimeout)
		s.tb.Fatalf("%s helper could not start: %s; stderr:\n%s", role, p.Ready.Err, p.Stderr())
	}
	return p
}

// Spawn starts a helper in role with args and waits for its readiness
// line, which may carry an error. The helper ends with the test: its input
// is closed, which makes it end cleanly, and if it has not ended within
// DefaultTimeout it is killed (a test error). Helpers also die with the
// test process (PR_SET_PDEATHSIG).
func (s *Scenario) Spawn(role string, args any) *Proc {
	s.tb.Helper()
	b, err := json.Marshal(args)
	if err != nil {
		s.tb.Fatalf("harness: %s args: %v", role, err)
	}
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), envRole+"="+role, envArgs+"="+string(b), envScenario+"="+s.id,
		testproc.QuickRaceExit())
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	p := &Proc{s: s, Role: role, cmd: cmd, done: make(chan struct{}), more: make(chan struct{}, 1)}
	cmd.Stderr = &p.stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		s.tb.Fatalf("harness: %v", err)
	}
	if p.stdin, err = cmd.StdinPipe(); err != nil {
		s.tb.Fatalf("harness: %v", err)
	}
	if err := cmd.Start(); err != nil {
		s.tb.Fatalf("harness: start %s: %v", role, err)
	}
	go func() {
		p.readLines(out)
		p.err = cmd.Wait()
		close(p.done)
	}()
	s.tb.Cleanup(func() { s.shutdown(p) })
	s.procs.mu.Lock()
	s.procs.procs = append(s.procs.procs, p)
	s.procs.mu.Unlock()
	line, err := p.Next(lineReady+" ", DefaultTimeout)
	if err != nil {
		s.tb.Fatalf("%s helper: %v", role, err)
	}
	if err := json.Unmarshal([]byte(line[len(lineReady)+1:]), &p.Ready); err != nil {
		s.tb.Fatalf("%s helper: bad readiness line %q: %v", role, line, err)
	}
	return p
}

// shutdown ends a helper at the end of the test: its input closes and it
// must end by itself within DefaultTimeout, else it is killed.
func (s *Scenario) shutdown(p *Proc) {
	if !p.Ended() {
		p.closeInput()
		if !p.wait(DefaultTimeout) {
			if !s.tb.Failed() {
				s.tb.Errorf("%s helper (pid %d) did not end within %v of its input closing; killed", p.Role, p.PID(), DefaultTimeout)
			}
			p.Kill()
		}
	}
	p.mu.Lock()
	killed := !p.killedAt.IsZero()
	p.mu.Unlock()
	if p.err != nil && !killed && p.Ready.Err == nil && !s.tb.Failed() {
		s.tb.Errorf("%s helper (pid %d) ended with %v; stderr:\n%s", p.Role, p.PID(), p.err, p.Stderr())
	}
	if s.tb.Failed() && p.Stderr() != "" {
		s.tb.Logf("%s helper (pid %d) stderr:\n%s", p.Role, p.PID(), p.Stderr())
	}
}

// Procs returns every helper started so far.
func (s *Scenario) Procs() []*Proc {
	s.procs.mu.Lock()
	defer s.procs.mu.Unlock()
	return append([]*Proc(nil), s.procs.procs...)
}

// finish is the final check.
func (s *Scenario) finish() {
	problems := s.Leftovers()
	for _, p := range problems {
		s.tb.Errorf("scenario %s left behind: %s", s.Prefix, p)
	}
	if len(problems) > 0 {
		s.forceClean()
	}
	if s.tb.Failed() {
		if text := s.log.String(); text != "" {
			s.tb.Logf("log of the scenario's in-process runtimes (last %d KiB):\n%s", maxLog>>10, text)
		}
	}
}

// logBuffer keeps the last maxLog bytes of log output.
type logBuffer struct {
	mu sync.Mutex
	b  []byte
}

const maxLog = 64 << 10

func (l *logBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.b = append(l.b, p...)
	if len(l.b) > maxLog {
		l.b = append(l.b[:0], l.b[len(l.b)-maxLog:]...)
	}
	return len(p), nil
}

func (l *logBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return string(l.b)
}

// Program returns a command that runs the program at path with args as a
// process of the scenario: tagged like its helpers, so that the final
// check finds it and its children if they outlive the test, and killed
// with the test process. The caller starts and waits for it.
func (s *Scenario) Program(path string, args ...string) *exec.Cmd {
	cmd := exec.Command(path, args...)
	cmd.Env = append(os.Environ(), envScenario+"="+s.id)
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	return cmd
}
