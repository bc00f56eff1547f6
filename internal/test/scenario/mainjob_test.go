package scenario

import (
	"bufio"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/test/harness"
	"github.com/mpmr/mpmr/internal/test/testenv"
)

// examplePrograms builds the example programs into a directory of the
// test's own.
func examplePrograms(t *testing.T) (primary, secondary string) {
	t.Helper()
	if _, err := exec.LookPath("go"); err != nil {
		t.Skipf("the examples are built with the go command, which is not on PATH: %v", err)
	}
	dir := t.TempDir()
	out, err := exec.Command("go", "build", "-o", dir+string(filepath.Separator),
		"github.com/mpmr/mpmr/examples/primary", "github.com/mpmr/mpmr/examples/secondary").CombinedOutput()
	require.NoError(t, err, "building the examples:\n%s", out)
	return filepath.Join(dir, "primary"), filepath.Join(dir, "secondary")
}

var (
	progressLine = regexp.MustCompile(`^\[secondary (\d+)\] secondary pid (\d+): `)
	summaryLine  = regexp.MustCompile(`^  secondary pid (\d+) .* validation failures (\d+)$`)
)

// The main job, run as the README runs it — the real examples/primary
// launching the real examples/secondary — as processes of a scenario,
// so that the scenario's final check holds it to the same contracts as
// every other scenario: no process, file, mapping or hugepage of the
// instance left once it has ended. In "whole" the job runs to its end and
// every secondary reports copies and churn checks with no validation
// failure (no key for freed memory was ever served, no copy lost a byte).
// In "secondary killed" one secondary is killed (SIGKILL) while it works:
// the primary and the other secondary carry on to the end, the other's
// summary shows no failure, and the job reports the dead one.
func TestMainJob(t *testing.T) {
	prim, sec := examplePrograms(t)
	for _, kill := range []bool{false, true} {
		name := "whole"
		if kill {
			name = "secondary killed"
		}
		t.Run(name, func(t *testing.T) {
			testenv.ForEachBackend(t, 16, func(t *testing.T, b hugetlb.Backend) {
				s := harness.New(t, b)
				runMainJob(t, s, prim, sec, kill)
			})
		})
	}
}

func runMainJob(t *testing.T, s *harness.Scenario, prim, sec string, kill bool) {
	d := harness.Pick("1s", "5s")
	if kill {
		d = harness.Pick("3s", "10s") // the secondary is killed at its first progress line, after a second
	}
	cmd := s.Program(prim, "-prefix", s.Prefix, "-rundir", s.RunDir, "-backend", s.Backend.Kind.String(),
		"-secondaries", "2", "-duration", d, "-buffers", "1024", "-secondary-bin", sec)
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	require.NoError(t, cmd.Start())
	ended := make(chan error, 1)
	var lines []string
	killed := 0
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			line := sc.Text()
			lines = append(lines, line)
			// The first progress line of secondary 1 (a second into
			// its work): kill it there.
			if m := progressLine.FindStringSubmatch(line); kill && killed == 0 && m != nil && m[1] == "1" {
				killed, _ = strconv.Atoi(m[2])
				_ = syscall.Kill(killed, syscall.SIGKILL)
			}
		}
		ended <- cmd.Wait()
	}()
	var waitErr error
	select {
	case waitErr = <-ended:
	case <-time.After(2 * time.Minute):
		_ = cmd.Process.Kill()
		t.Fatalf("the main job did not end; output so far:\n%s", strings.Join(lines, "\n"))
	}
	out := strings.Join(lines, "\n")
	t.Logf("stdout:\n%s\nstderr:\n%s", out, stderr.String())

	summaries := map[int]int{} // pid -> validation failures
	for _, l := range lines {
		if m := summaryLine.FindStringSubmatch(l); m != nil {
			pid, _ := strconv.Atoi(m[1])
			summaries[pid], _ = strconv.Atoi(m[2])
		}
	}
	assert.Regexp(t, `summary after .*: [1-9][0-9]* memory churns`, out, "memory churned while they worked")
	if !kill {
		require.NoError(t, waitErr, "the whole job succeeds")
		assert.Len(t, summaries, 2, "a summary per secondary")
	} else {
		require.NotZero(t, killed, "a secondary was killed while it worked")
		assert.Error(t, waitErr, "the job reports the secondary it lost")
		assert.Contains(t, stderr.String(), "secondary 1", "and names it")
		assert.Len(t, summaries, 1, "the other secondary finished")
		assert.NotContains(t, summaries, killed)
	}
	for pid, failures := range summaries {
		assert.Zero(t, failures, "secondary pid %d: validation failures", pid)
	}
}
