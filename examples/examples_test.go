package examples_test

import (
	"bufio"
	"bytes"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/examples/internal/job"
	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/test/testenv"
)

// build compiles both examples, once per test binary, into a directory
// every user may read, so that a secondary can run as another user.
var build = sync.OnceValues(func() (string, error) {
	dir, err := os.MkdirTemp("", "mpmr-examples-")
	if err != nil {
		return "", err
	}
	if err := os.Chmod(dir, 0o755); err != nil {
		return "", err
	}
	cmd := exec.Command("go", "build", "-o", dir+string(filepath.Separator),
		"github.com/mpmr/mpmr/examples/primary", "github.com/mpmr/mpmr/examples/secondary")
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", errors.New(string(out))
	}
	return dir, nil
})

func TestMain(m *testing.M) {
	code := m.Run()
	if dir, err := build(); err == nil {
		os.RemoveAll(dir)
	}
	os.Exit(code)
}

func programs(t *testing.T) (primary, secondary string) {
	t.Helper()
	if _, err := exec.LookPath("go"); err != nil {
		t.Skipf("the examples are built with the go command, which is not on PATH: %v", err)
	}
	dir, err := build()
	require.NoError(t, err, "building the examples")
	return filepath.Join(dir, "primary"), filepath.Join(dir, "secondary")
}

// runDir is a runtime directory every user may traverse (the instance's
// own directory inside stays private).
func runDir(t *testing.T) string {
	t.Helper()
	dir := testenv.RunDir(t)
	require.NoError(t, os.Chmod(dir, 0o755))
	return dir
}

// The main job as the README runs it, shortened: a primary launches two
// secondaries that copy payloads while memory churns, and every process
// reports; the run fails on any validation failure.
func TestMainJob(t *testing.T) {
	prim, sec := programs(t)
	testenv.ForEachBackend(t, 16, func(t *testing.T, b hugetlb.Backend) {
		text := runMainJob(t, prim, sec, "-backend", b.Kind.String())
		t.Log(text)
		assert.Regexp(t, `summary after .*: [1-9][0-9]* memory churns`, text, "memory churned during the run")
	})
}

// With -bind, each secondary binds its queue to a CPU of its own and the
// primary answers its misses there: the job does the same work, with no
// error and no validation failure (a binding refused would be one).
func TestMainJobBound(t *testing.T) {
	prim, sec := programs(t)
	text := runMainJob(t, prim, sec, "-backend", "tmpfs", "-bind", "0")
	for _, line := range strings.Split(text, "\n") {
		if strings.HasPrefix(line, "  secondary pid") {
			assert.Regexp(t, `created [1-9]`, line, "misses went to the primary")
		}
	}
}

// runMainJob runs the main job, shortened, with two secondaries and args
// added, and returns its output once it has checked that it succeeded and
// that each secondary reported, with no validation failure.
func runMainJob(t *testing.T, prim, sec string, args ...string) string {
	t.Helper()
	cmd := exec.CommandContext(t.Context(), prim, append([]string{"-prefix", testenv.Prefix(t), "-rundir", runDir(t),
		"-secondaries", "2", "-duration", "500ms", "-buffers", "1024", "-secondary-bin", sec}, args...)...)
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "output:\n%s", out)
	text := string(out)
	assert.Equal(t, 2, strings.Count(text, "\n  secondary pid"), "a summary per secondary")
	assert.NotContains(t, text, "ended without a summary")
	for _, line := range strings.Split(text, "\n") {
		if strings.HasPrefix(line, "  secondary pid") {
			assert.Contains(t, line, "validation failures 0")
		}
	}
	return text
}

// startPrimary runs the primary example alone (-secondaries 0, churning
// on tmpfs), waits until it serves, and returns it with a channel of its
// standard error lines. It is stopped with SIGTERM at cleanup (killed if
// it does not end): the primary closes cleanly and removes its files.
func startPrimary(t *testing.T, prim, prefix, rundir string) (*exec.Cmd, <-chan string) {
	t.Helper()
	cmd := exec.Command(prim, "-prefix", prefix, "-rundir", rundir, "-backend", "tmpfs",
		"-secondaries", "0", "-duration", "2m")
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	stderr, err := cmd.StderrPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	errLines := make(chan string, 1024)
	go func() {
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			select {
			case errLines <- sc.Text():
			default:
			}
		}
		close(errLines)
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		done := make(chan struct{})
		go func() { _ = cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
	})
	sc := bufio.NewScanner(stdout)
	for sc.Scan() {
		if strings.Contains(sc.Text(), "serving for") {
			go func() {
				for sc.Scan() {
				}
			}()
			return cmd, errLines
		}
	}
	t.Fatalf("the primary ended before serving")
	return nil, nil
}

// A secondary whose primary dies stops its queues, says so in one line and
// exits with status 2 — it does not keep copying until its time is up.
func TestSecondaryStopsWhenPrimaryDies(t *testing.T) {
	prim, sec := programs(t)
	prefix, rundir := testenv.Prefix(t), runDir(t)
	p, _ := startPrimary(t, prim, prefix, rundir)

	s := exec.CommandContext(t.Context(), sec, "-prefix", prefix, "-rundir", rundir, "-duration", "1m")
	stdout, err := s.StdoutPipe()
	require.NoError(t, err)
	var stderr bytes.Buffer
	s.Stderr = &stderr
	require.NoError(t, s.Start())
	t.Cleanup(func() { _ = s.Process.Kill() })
	sc := bufio.NewScanner(stdout)
	require.True(t, sc.Scan(), "a progress line")
	require.Contains(t, sc.Text(), "copies")

	require.NoError(t, p.Process.Signal(syscall.SIGKILL))
	done := make(chan error, 1)
	go func() {
		for sc.Scan() {
		}
		done <- s.Wait()
	}()
	select {
	case err = <-done:
	case <-time.After(30 * time.Second):
		t.Fatalf("the secondary still runs 30 s after its primary was killed; stderr:\n%s", stderr.String())
	}
	var exit *exec.ExitError
	require.ErrorAs(t, err, &exit, "stderr:\n%s", stderr.String())
	assert.Equal(t, 2, exit.ExitCode())
	lines := strings.Split(strings.TrimSpace(stderr.String()), "\n")
	last := lines[len(lines)-1]
	assert.Regexp(t, `secondary pid \d+: the primary has gone: stopped 1 queues after \d+ copies; exiting`, last)

	// A new primary on the prefix cleans up what the killed one left.
	out, err := exec.CommandContext(t.Context(), prim, "-prefix", prefix, "-rundir", rundir, "-backend", "tmpfs",
		"-secondaries", "0", "-duration", "1ms").CombinedOutput()
	require.NoError(t, err, "output:\n%s", out)
}

// A secondary of another user is told it lacks permission — which path,
// whose, and which uid it runs as — and not that no primary runs.
func TestSecondaryOfAnotherUser(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("running a secondary as another user needs root")
	}
	prim, sec := programs(t)
	prefix, rundir := testenv.Prefix(t), runDir(t)
	startPrimary(t, prim, prefix, rundir)

	const uid = 42061
	s := exec.CommandContext(t.Context(), sec, "-prefix", prefix, "-rundir", rundir, "-duration", "1s")
	s.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uid, Gid: uid}}
	out, err := s.CombinedOutput()
	var exit *exec.ExitError
	require.ErrorAs(t, err, &exit, "output:\n%s", out)
	assert.Equal(t, 1, exit.ExitCode())
	text := string(out)
	assert.Contains(t, text, "permission problem")
	assert.Contains(t, text, filepath.Join(rundir, prefix), "names the path")
	assert.Contains(t, text, "belongs to uid 0", "its owner")
	assert.Contains(t, text, "runs as uid 42061", "and the uid we are")
	assert.NotContains(t, text, "no primary is running")
}

// The summary a secondary prints is the one the primary parses.
func TestSummaryLine(t *testing.T) {
	in := job.Summary{Role: "secondary", PID: 7, Lookups: 3, ValidationErrors: 1, Errors: []string{"x"}}
	out, ok := job.ParseLine(in.Line())
	require.True(t, ok)
	assert.Equal(t, in, out)
	assert.True(t, out.Failed())
	_, ok = job.ParseLine("secondary pid 7: 3 lookups/s")
	assert.False(t, ok)
}

// oneSecondaryJob is the main job with one secondary, on tmpfs, started
// with args and read until the secondary's first progress line, whose pid
// it returns with the job, its output so far and its output to come.
type oneSecondaryJob struct {
	cmd    *exec.Cmd
	lines  *bufio.Scanner
	out    strings.Builder
	stderr bytes.Buffer
	pid    int // the secondary's
}

func startOneSecondaryJob(t *testing.T, args ...string) *oneSecondaryJob {
	t.Helper()
	prim, sec := programs(t)
	j := &oneSecondaryJob{}
	j.cmd = exec.CommandContext(t.Context(), prim, append([]string{"-prefix", testenv.Prefix(t), "-rundir", runDir(t),
		"-backend", "tmpfs", "-secondaries", "1", "-buffers", "1024", "-secondary-bin", sec}, args...)...)
	stdout, err := j.cmd.StdoutPipe()
	require.NoError(t, err)
	j.cmd.Stderr = &j.stderr
	require.NoError(t, j.cmd.Start())
	progress := regexp.MustCompile(`^\[secondary 0\] secondary pid (\d+): `)
	j.lines = bufio.NewScanner(stdout)
	for j.pid == 0 && j.lines.Scan() {
		j.out.WriteString(j.lines.Text() + "\n")
		if m := progress.FindStringSubmatch(j.lines.Text()); m != nil {
			j.pid, _ = strconv.Atoi(m[1])
		}
	}
	require.NotZero(t, j.pid, "a progress line from the secondary:\n%s", j.out.String())
	return j
}

// wait reads the rest of the job's output and waits for it to end: it
// returns everything it said and how it ended.
func (j *oneSecondaryJob) wait() (string, error) {
	for j.lines.Scan() {
		j.out.WriteString(j.lines.Text() + "\n")
	}
	err := j.cmd.Wait()
	return j.out.String() + j.stderr.String(), err
}

// A secondary that is alive but never ends (stopped here) does not keep
// the main job waiting: past its duration and the grace, the primary
// stops it as an interrupted one (SIGTERM, then SIGKILL, which ends a
// stopped process too), says so and fails.
func TestMainJobStopsASecondaryThatDoesNotEnd(t *testing.T) {
	j := startOneSecondaryJob(t, "-duration", "3s", "-grace", "1s")
	// A handle on the process itself (a pidfd), not its number: once the
	// primary has reaped it, the number may be another process's.
	proc, err := os.FindProcess(j.pid)
	require.NoError(t, err)
	t.Cleanup(func() { _ = proc.Kill() }) // if the primary did not
	require.NoError(t, proc.Signal(syscall.SIGSTOP))
	text, err := j.wait()
	require.Error(t, err, "the main job fails:\n%s", text)
	assert.NoError(t, t.Context().Err(), "the main job ended by itself")
	assert.Contains(t, text, "still running 1s after its 3s of work: stopped", "and says why")
}

// The main job's primary stopped (a debugger, SIGSTOP) while its
// secondary works, past the secondary's duration and grace: the secondary
// finishes, says its summary and exits meanwhile, and the primary, once
// resumed, reports it as it ended, not as one it had to stop.
func TestMainJobDoesNotBlameASecondaryForItsOwnStop(t *testing.T) {
	j := startOneSecondaryJob(t, "-duration", "2s", "-grace", "2s", "-churn=false")
	t.Cleanup(func() { _ = j.cmd.Process.Signal(syscall.SIGCONT) })
	stopped := time.Now()
	require.NoError(t, j.cmd.Process.Signal(syscall.SIGSTOP))
	// The secondary ends by itself: a zombie, its parent being stopped.
	for procState(t, j.pid) != "Z" {
		require.Less(t, time.Since(stopped), time.Minute, "the secondary ends while the primary is stopped")
		time.Sleep(10 * time.Millisecond) // polling the kernel's answer
	}
	time.Sleep(time.Until(stopped.Add(4 * time.Second))) // the primary stays stopped past the secondary's duration and grace
	require.NoError(t, j.cmd.Process.Signal(syscall.SIGCONT))
	text, err := j.wait()
	assert.NoError(t, err, "the main job:\n%s", text)
	assert.NotContains(t, text, "still running", "a secondary that finished is not said to have been stopped")
}

// procState is the state letter in /proc/pid/stat.
func procState(t *testing.T, pid int) string {
	t.Helper()
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	require.NoError(t, err)
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	require.Less(t, i+2, len(s), "/proc/%d/stat: %s", pid, s)
	return s[i+2 : i+3]
}
