package primary_test

import (
	"context"
	"io"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/ipc"
	"github.com/mpmr/mpmr/primary"
)

// The primary holds a connection to the limits of a stranger until its
// hello succeeds: descriptors, which the primary never takes, are refused
// by the kernel where it can (the request is not sent, the connection
// goes on) and closed on arrival elsewhere, and a connection that never
// says hello is closed when its time is up, while an attached secondary
// goes on. Stats and the stats request count both.
func TestConnectionsBeforeHello(t *testing.T) {
	// Time for idle's calls before its hello is due, on a busy machine.
	p, cfg := startPrimary(t, testenv.Tmpfs(t), func(c *primary.Config) { c.Limits.HelloTimeout = time.Second })
	region, err := p.Alloc(p.Backend().PageSize)
	require.NoError(t, err)
	sec := startSecondary(t, cfg)
	sock := filepath.Join(p.RuntimeDir(), ipc.SocketName)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	idle, err := ipc.DialClient(ctx, sock, ipc.ClientConfig{Logger: quiet})
	require.NoError(t, err)
	defer idle.Close()
	r, w, err := os.Pipe()
	require.NoError(t, err)
	defer r.Close()
	err = idle.Call(ctx, ipc.KindStats, ipc.WithFiles{Body: &ipc.StatsRequest{}, Files: []*os.File{w}}, &ipc.StatsReply{})
	refusedFiles := 1
	if testenv.KernelRefusesRights() {
		assert.ErrorIs(t, err, ipc.ErrFilesRefused, "a stats request with a descriptor is not sent")
		require.NoError(t, idle.Call(ctx, ipc.KindStats, &ipc.StatsRequest{}, &ipc.StatsReply{}), "the connection goes on")
		refusedFiles = 0 // none came
	} else {
		assert.NoError(t, err, "a stats request with a descriptor before the hello is served, without it")
	}
	require.NoError(t, w.Close())
	require.NoError(t, r.SetReadDeadline(time.Now().Add(10*time.Second)))
	b, err := io.ReadAll(r)
	require.NoError(t, err)
	assert.Empty(t, b, "the primary closed its copy at once")

	select {
	case <-idle.Done():
	case <-ctx.Done():
		t.Fatal("a connection without hello outlived its time")
	}
	assert.ErrorIs(t, idle.Err(), ipc.ErrLimit)
	assert.ErrorContains(t, idle.Err(), "no hello within 1s")
	parseKey(t, ask(t, sec, "create %d", region.Addr)) // attached long before, and still served

	c := p.Stats().Counters
	assert.EqualValues(t, 1, c.IPCHelloTimeouts)
	assert.EqualValues(t, refusedFiles, c.IPCRefusedFiles)
	assert.Equal(t, 1, c.IPCConns, "the secondary's")

	asker, err := ipc.DialClient(ctx, sock, ipc.ClientConfig{Logger: quiet})
	require.NoError(t, err)
	defer asker.Close()
	var st ipc.StatsReply
	require.NoError(t, asker.Call(ctx, ipc.KindStats, &ipc.StatsRequest{}, &st), "a stats request needs no hello")
	assert.EqualValues(t, 1, st.Counters["ipc_hello_timeouts"])
	assert.EqualValues(t, refusedFiles, st.Counters["ipc_refused_files"])
	assert.EqualValues(t, 2, st.Counters["ipc_conns"], "the secondary's and this one")
	for _, name := range []string{"ipc_refused_conns", "ipc_refused_conns_per_uid", "ipc_refused_files_in_flight",
		"ipc_queue_overflows", "ipc_write_timeouts"} {
		v, ok := st.Counters[name]
		assert.True(t, ok, "counter %s is reported", name)
		assert.Zero(t, v, name)
	}
}
