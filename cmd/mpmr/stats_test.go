package main

import (
	"os"
	"path/filepath"
	"strconv"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/internal/instance"
	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/shm"
)

func TestStatsShowsWhatProcessesPublished(t *testing.T) {
	b := testenv.Tmpfs(t)
	rundir := testenv.RunDir(t)
	p, cfg := startPrimary(t, b, rundir)
	r, err := p.Alloc(2 * b.PageSize)
	require.NoError(t, err)
	h := startSecondary(t, cfg.Prefix, rundir)
	for i := range 5 {
		parseKey(t, h.ask("lookup %d", r.Addr+uintptr(i*64)))
	}
	require.Equal(t, "published lookups=5", h.ask("publish"))

	var got statsOut
	toolJSON(t, &got, "-rundir", rundir, "stats", cfg.Prefix)
	assert.Equal(t, "live", got.State)
	require.NotNil(t, got.Primary, got.PrimaryError)
	assert.Equal(t, os.Getpid(), got.Primary.PID)
	assert.Equal(t, 1, got.Primary.Secondaries, "asking for stats does not attach")
	assert.Equal(t, 1, got.Primary.MRs)
	assert.GreaterOrEqual(t, got.Primary.Counters.Requests, uint64(1), "the secondary's create was served")
	assert.Equal(t, 2, got.Primary.Counters.IPCConns, "the secondary's connection and the tool's")

	var sec *instance.ProcCounters
	for i, pc := range got.Processes {
		if pc.PID == h.PID() {
			sec = &got.Processes[i]
		}
	}
	require.NotNil(t, sec, "the secondary's published line: %+v", got.Processes)
	assert.Equal(t, shm.RoleSecondary, sec.Role)
	c := sec.Counters
	assert.Equal(t, uint64(5), c.Lookups)
	assert.Equal(t, uint64(1), c.Created, "the first lookup created the MR")
	assert.Equal(t, uint64(4), c.TopHits, "the others hit the top half")
	assert.Equal(t, uint64(1), c.Requests, "one create request")
	assert.Positive(t, c.LatencyP50)
	assert.Positive(t, c.LatencyP99)
	assert.Equal(t, 1, c.Queues)

	out, errOut, status := tool(t, "-rundir", rundir, "stats", cfg.Prefix)
	require.Equal(t, 0, status, errOut)
	assert.Contains(t, out, "primary pid "+strconv.Itoa(os.Getpid()))
	assert.Contains(t, out, "1 secondaries attached")
	assert.Contains(t, out, "ipc: 2 connections open; refused 0 over the total")
	assert.Regexp(t, `\s`+strconv.Itoa(h.PID())+`\s+secondary\s+5\s+4\s+0\s+0\s+1\s`, out,
		"slot, pid, role, lookups, top, bottom, global, created")
	assert.Equal(t, 1, p.Stats().Counters.Secondaries)
}

// A live primary whose runtime directory was given relative to the
// working directory, or through a link, and the tool given it either way:
// the tool dials the primary's socket, which its description names.
func TestStatsOfAPrimaryWhoseRuntimeDirectoryIsSpelledOtherwise(t *testing.T) {
	b := testenv.Tmpfs(t)
	rundir := testenv.RunDir(t)
	link := filepath.Join(t.TempDir(), "rd")
	require.NoError(t, os.Symlink(rundir, link))
	t.Chdir(filepath.Dir(rundir))
	rel := filepath.Base(rundir)
	for _, c := range []struct{ name, given string }{{"relative", rel}, {"link", link}} {
		t.Run(c.name, func(t *testing.T) {
			p, cfg := startPrimary(t, b, c.given)
			for _, asked := range []string{rundir, rel, link} {
				var got statsOut
				toolJSON(t, &got, "-rundir", asked, "stats", cfg.Prefix)
				require.NotNil(t, got.Primary, "primary given %s, tool %s: %s", c.given, asked, got.PrimaryError)
				assert.Equal(t, os.Getpid(), got.Primary.PID)
			}
			require.NoError(t, p.Close())
		})
	}
}

func TestStatsOfADeadInstance(t *testing.T) {
	b := testenv.Tmpfs(t)
	rundir := testenv.RunDir(t)
	h, prefix := startDeadable(t, b, rundir)
	h.kill()

	var got statsOut
	toolJSON(t, &got, "-rundir", rundir, "stats", prefix)
	assert.Equal(t, "dead", got.State)
	assert.Nil(t, got.Primary)
	assert.Contains(t, got.PrimaryError, "not running")
	assert.Empty(t, got.Processes, "no process is alive to have published")
}
