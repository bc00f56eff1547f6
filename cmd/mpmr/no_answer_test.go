package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/instance"
	"github.com/mpmr/mpmr/internal/test/fusetest"
	"github.com/mpmr/mpmr/internal/test/testenv"
)

// An instance's user points its description's backend directory at a
// file system that does not answer (here a FUSE mount whose server is
// stopped; it could be a hung network mount). The tool gives that
// instance's files a bounded time: ls lists it with why and every other
// instance as usual, and dump, stats and clean of it end, saying so.
func TestToolIsNotHeldByFilesThatDoNotAnswer(t *testing.T) {
	rundir, dir, prefix, _ := hostileInstance(t)
	fuseDir, fuse := fusetest.Mount(t, "fuse", "GORACE=atexit_sleep_ms=0")
	name := instance.Name(prefix, hostileOwnerUID, dir)
	info := instance.Info{Prefix: prefix, PID: 1, Backend: hugetlb.Tmpfs.String(), BackendDir: fuseDir,
		Segment: instance.SegmentPath(fuseDir, name)}
	js, err := json.Marshal(info)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(dir, instance.InfoFile), js, 0o600))
	require.NoError(t, os.Lchown(rundir, 0, 0)) // root's, so that a primary of root's lives there too
	_, healthy := startPrimary(t, testenv.Tmpfs(t), rundir)
	fuse.Stop()
	old := fsWait
	fsWait = 300 * time.Millisecond
	t.Cleanup(func() { fsWait = old })

	type result struct {
		out, errOut string
		status      int
	}
	within := func(args ...string) result {
		done := make(chan result, 1)
		go func() {
			out, errOut, status := tool(t, args...)
			done <- result{out, errOut, status}
		}()
		select {
		case r := <-done:
			return r
		case <-time.After(time.Minute):
			t.Fatalf("mpmr %v hangs", args)
			return result{}
		}
	}

	r := within("-json", "-rundir", rundir, "ls")
	require.Equal(t, 0, r.status, r.errOut)
	var entries []lsEntry
	require.NoError(t, json.Unmarshal([]byte(r.out), &entries), r.out)
	byPrefix := map[string]lsEntry{}
	for _, x := range entries {
		byPrefix[x.Prefix] = x
	}
	require.Contains(t, byPrefix, prefix)
	require.Contains(t, byPrefix, healthy.Prefix)
	assert.Equal(t, "unknown", byPrefix[prefix].State)
	if assert.Len(t, byPrefix[prefix].Errors, 1) {
		assert.Contains(t, byPrefix[prefix].Errors[0], errNoAnswer.Error())
	}
	assert.Equal(t, "live", byPrefix[healthy.Prefix].State, "the other instance is listed as usual")
	assert.Empty(t, byPrefix[healthy.Prefix].Errors)

	for _, cmd := range []string{"dump", "stats", "clean"} {
		r := within("-rundir", rundir, cmd, prefix)
		assert.NotEqual(t, 0, r.status, cmd)
		assert.Contains(t, r.errOut, errNoAnswer.Error(), cmd)
	}
}
