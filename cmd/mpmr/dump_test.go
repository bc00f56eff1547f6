package main

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/instance"
	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/primary"
)

func TestDumpOfALiveInstanceDisturbsNothing(t *testing.T) {
	b := testenv.Tmpfs(t)
	rundir := testenv.RunDir(t)
	p, cfg := startPrimary(t, b, rundir)
	ps := b.PageSize
	r, err := p.Alloc(4 * ps)
	require.NoError(t, err)
	_, err = p.CreatePool("rx", 2048, 64)
	require.NoError(t, err)
	h := startSecondary(t, cfg.Prefix, rundir)
	key := parseKey(t, h.ask("lookup %d", r.Addr+8))
	// Free a page in the middle: the MR keeps two chunks, and the table
	// has an entry for each.
	require.NoError(t, p.Free(hugetlb.Region{Addr: r.Addr + uintptr(ps), Len: ps}))
	parseKey(t, h.ask("lookup %d", r.Addr+uintptr(2*ps)))
	procsBefore := p.Segment().Procs()
	lockBefore := p.Global().LockState()

	want, err := p.Dump()
	require.NoError(t, err)
	var got dumpOut
	toolJSON(t, &got, "-rundir", rundir, "dump", cfg.Prefix)
	assert.Empty(t, got.Errors)
	assert.True(t, got.Consistent)
	assert.Equal(t, want.Cache.MRs, got.Cache.MRs, "the MR list with chunks and keys")
	assert.Equal(t, want.Cache.Table, got.Cache.Table, "the global table")
	assert.Equal(t, want.Cache.FreeMRs, got.Cache.FreeMRs)
	assert.Equal(t, want.Cache.DevGen, got.Cache.DevGen)
	assert.Equal(t, want.Processes, got.Processes)
	assert.Equal(t, want.Pools, got.Pools)
	assert.Equal(t, want.Device, got.Device)
	require.Len(t, got.Memory, 1)
	assert.Equal(t, want.Memory[0].Allocated, got.Memory[0].Allocated)
	assert.Nil(t, got.Writer, "nobody holds the write lock")
	assert.Equal(t, "ready", got.Segment.State)
	require.NotEmpty(t, got.Cache.MRs)
	assert.Len(t, got.Cache.MRs[0].Chunks, 2, "the freed page split the MR")
	assert.Equal(t, key, got.Cache.MRs[0].LKey)

	// The JSON has primary.Dump's shape: it decodes into one as well.
	var asDump primary.Dump
	toolJSON(t, &asDump, "-rundir", rundir, "dump", cfg.Prefix)
	assert.Equal(t, want.Cache.MRs, asDump.Cache.MRs)
	assert.Equal(t, want.Cache.Table, asDump.Cache.Table)

	out, errOut, status := tool(t, "-rundir", rundir, "dump", cfg.Prefix)
	require.Equal(t, 0, status, errOut)
	for _, s := range []string{
		"INSTANCE " + cfg.Prefix + ": live",
		"PROCESSES (2)",
		strconv.Itoa(h.PID()),
		"secondary",
		"GLOBAL LOCK",
		"snapshot  consistent",
		fmt.Sprintf("0x%x", r.Addr),
		fmt.Sprintf("0x%x", key),
		"chunk",
		"GLOBAL TABLE (2 of",
		"MEMSEG LISTS (1)",
		"MEMPOOLS (1)",
		"rx",
		"SOFT DEVICE MRS",
		"ARENA",
	} {
		assert.Contains(t, out, s)
	}

	// The instance did not notice.
	assert.Equal(t, procsBefore, p.Segment().Procs(), "no slot was claimed")
	assert.Equal(t, lockBefore, p.Global().LockState(), "no lock was taken or left")
	assert.Equal(t, 1, p.Stats().Counters.Secondaries, "no extra secondary")
	parseKey(t, h.ask("lookup %d", r.Addr+uintptr(3*ps)))
	r2, err := p.Alloc(ps)
	require.NoError(t, err)
	parseKey(t, h.ask("lookup %d", r2.Addr))
}

func TestDumpOfADeadInstanceWhosePrimaryHeldTheLock(t *testing.T) {
	b := testenv.Tmpfs(t)
	rundir := testenv.RunDir(t)
	h, prefix := startDeadable(t, b, rundir)
	var addr uint64
	_, err := fmt.Sscanf(h.ask("alloc 2"), "region %d", &addr)
	require.NoError(t, err)
	key := parseKey(t, h.ask("mr %d", addr))
	require.Equal(t, "held", h.ask("hold"))
	h.kill()

	start := time.Now()
	var got dumpOut
	toolJSON(t, &got, "-rundir", rundir, "dump", prefix)
	assert.Less(t, time.Since(start), 5*time.Second, "an abandoned lock is reported, not waited for")
	require.NotNil(t, got.Writer)
	assert.Equal(t, h.PID(), got.Writer.PID)
	assert.False(t, got.Writer.Alive, "held by a dead owner")
	assert.Equal(t, got.Writer.Slot, got.Lock.WriterSlot)
	assert.False(t, got.Consistent, "a best-effort read, and it says so")
	require.Len(t, got.Cache.MRs, 1, "what the dead primary registered is still shown")
	assert.Equal(t, key, got.Cache.MRs[0].LKey)
	assert.Equal(t, "dead", got.Instance.State)
	for _, p := range got.Processes {
		assert.False(t, p.Alive, "slot %d", p.Slot)
	}

	out, _, status := tool(t, "-rundir", rundir, "dump", prefix)
	assert.Equal(t, 0, status)
	assert.Contains(t, out, "HELD BY A DEAD OWNER")
	assert.Contains(t, out, "BEST EFFORT")
	assert.Contains(t, out, "INSTANCE "+prefix+": dead")

	// Nothing was repaired or changed: the lock is still the dead
	// writer's, for the next primary to recover.
	var again dumpOut
	toolJSON(t, &again, "-rundir", rundir, "dump", prefix)
	assert.Equal(t, got.Lock, again.Lock)

	// And a new primary of the same prefix starts cleanly over it.
	p, err := primary.Start(primary.Config{Prefix: prefix, RuntimeDir: rundir, Backend: b.Kind, MemoryPages: 16, Logger: quiet})
	require.NoError(t, err)
	require.NoError(t, p.Close())
	_, err = os.Stat(got.Segment.Path)
	assert.ErrorIs(t, err, os.ErrNotExist)
}

func TestDumpOfAMissingInstance(t *testing.T) {
	rundir := testenv.RunDir(t)
	_, errOut, status := tool(t, "-rundir", rundir, "dump", "nobody")
	assert.Equal(t, 1, status)
	assert.Contains(t, errOut, "no instance")
}

// A primary that died while starting leaves a segment without the layers
// above: dump shows what there is and names what is missing, and clean
// removes it.
func TestDumpAndCleanOfAHalfBuiltInstance(t *testing.T) {
	b := testenv.Tmpfs(t)
	rundir := testenv.RunDir(t)
	prefix := testenv.Prefix(t)
	t.Cleanup(func() { removeLeftovers(t, b, rundir, prefix) })
	dir := filepath.Join(rundir, prefix)
	require.NoError(t, os.MkdirAll(dir, 0o700))
	segPath := instance.SegmentPath(b.Dir, instanceName(rundir, prefix))
	h := testproc.Start(t, "segment", []string{segPath, filepath.Join(dir, instance.SlotsLockFile)})
	h.Expect("created", 0)
	require.NoError(t, h.Wait(0))
	require.NoError(t, os.WriteFile(filepath.Join(dir, instance.PrimaryLockFile), nil, 0o600))

	out, errOut, status := tool(t, "-rundir", rundir, "-json", "dump", prefix)
	assert.Equal(t, 1, status, "some parts could not be read")
	assert.Contains(t, errOut, "part(s) could not be read")
	var got dumpOut
	require.NoError(t, json.Unmarshal([]byte(out), &got), "the JSON is printed all the same:\n%s", out)
	assert.Equal(t, "initializing", got.Segment.State)
	assert.Equal(t, "dead", got.Instance.State)
	assert.Nil(t, got.Writer)
	assert.Equal(t, -1, got.Lock.WriterSlot)
	assert.Len(t, got.Errors, 3, "memseg lists, global cache, soft device: %v", got.Errors)

	text, _, status := tool(t, "-rundir", rundir, "dump", prefix)
	assert.Equal(t, 1, status)
	assert.Contains(t, text, "the lock could not be read")
	assert.Contains(t, text, "ERRORS")

	var cleaned cleanOut
	toolJSON(t, &cleaned, "-rundir", rundir, "clean", prefix)
	assert.Contains(t, cleaned.Removed, segPath)
	assert.Empty(t, files(t, b, rundir, prefix))
}
