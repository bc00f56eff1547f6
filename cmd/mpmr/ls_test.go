package main

import (
	"os"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/internal/test/testenv"
)

func TestLsShowsLiveAndDeadInstances(t *testing.T) {
	b := testenv.Tmpfs(t)
	rundir := testenv.RunDir(t)
	live, liveCfg := startPrimary(t, b, rundir)
	_, err := live.Alloc(2 * b.PageSize)
	require.NoError(t, err)

	h, deadPrefix := startDeadable(t, b, rundir)
	assert.Contains(t, h.ask("alloc 1"), "region")
	h.kill()

	var got []lsEntry
	toolJSON(t, &got, "-rundir", rundir, "ls")
	require.Len(t, got, 2)
	byPrefix := map[string]lsEntry{}
	for _, x := range got {
		byPrefix[x.Prefix] = x
	}

	l := byPrefix[liveCfg.Prefix]
	assert.Equal(t, "live", l.State)
	assert.True(t, l.Live)
	assert.Equal(t, os.Getpid(), l.PID)
	assert.Equal(t, "tmpfs", l.Backend)
	assert.Equal(t, b.PageSize, l.PageSize)
	assert.Equal(t, 2, l.Pages, "memory in use")
	assert.Equal(t, 2*b.PageSize, l.Bytes)
	assert.Equal(t, 1, l.Processes, "the primary alone is attached")
	assert.Empty(t, l.Errors)

	d := byPrefix[deadPrefix]
	assert.Equal(t, "dead", d.State)
	assert.False(t, d.Live)
	assert.Equal(t, h.PID(), d.PID)
	assert.Equal(t, 1, d.Pages, "the dead instance's memory is still there")
	assert.Zero(t, d.Processes, "nobody is alive in its process table")
	assert.Empty(t, d.Errors)

	out, _, status := tool(t, "ls", "-rundir", rundir)
	require.Equal(t, 0, status)
	lines := strings.Split(out, "\n")
	require.GreaterOrEqual(t, len(lines), 3)
	assert.Contains(t, lines[0], "PREFIX")
	assert.Regexp(t, `(?m)^`+liveCfg.Prefix+`\s+live\s+`, out)
	assert.Regexp(t, `(?m)^`+deadPrefix+`\s+dead\s+`, out)
	assert.Contains(t, out, "2 pages (4 MiB)")

	assert.Len(t, live.Segment().Procs(), 1, "ls claimed no slot")
}

func TestLsOfAnEmptyRuntimeDirectory(t *testing.T) {
	rundir := testenv.RunDir(t)
	out, _, status := tool(t, "-rundir", rundir, "ls")
	assert.Equal(t, 0, status)
	assert.Contains(t, out, "no instances")

	var got []lsEntry
	toolJSON(t, &got, "ls", "-rundir", rundir+"/missing")
	assert.Empty(t, got)
}
