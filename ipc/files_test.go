package ipc_test

import (
	"context"
	"io"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/ipc"
)

func pipe(t *testing.T) (r, w *os.File) {
	t.Helper()
	r, w, err := os.Pipe()
	require.NoError(t, err)
	t.Cleanup(func() { r.Close(); w.Close() })
	return r, w
}

// readAll reads r to end of file within bound.
func readAll(t *testing.T, r *os.File) string {
	t.Helper()
	require.NoError(t, r.SetReadDeadline(time.Now().Add(bound)))
	b, err := io.ReadAll(r)
	require.NoError(t, err)
	return string(b)
}

// serveFiles serves KindCreateMR requests for 0xf11e, which carry files: it
// writes the address into each file it receives, and answers with a new
// pipe whose other end already holds "key 0xf1". It runs in the helper
// server process too.
func serveFiles(kind ipc.Kind, body *ipc.Decoder) (any, error, bool) {
	var m ipc.CreateMR
	if kind != ipc.KindCreateMR || body.Decode(&m) != nil || m.Addr != 0xf11e {
		return nil, nil, false
	}
	for _, f := range body.Files() {
		_, err := f.WriteString("addr 0xf11e")
		f.Close()
		if err != nil {
			return nil, err, true
		}
	}
	r, w, err := os.Pipe()
	if err != nil {
		return nil, err, true
	}
	_, err = w.WriteString("key 0xf1")
	w.Close()
	if err != nil {
		r.Close()
		return nil, err, true
	}
	reply := &ipc.CreateMRReply{Start: 0xf000, End: 0x10000, LKey: 0xf1}
	return &ipc.WithFiles{Body: reply, Files: []*os.File{r}, CloseAfterSend: true}, nil, true
}

func fileHandler() *handler {
	h := newHandler()
	h.handle = func(ctx context.Context, p *ipc.Peer, kind ipc.Kind, body *ipc.Decoder) (any, error, bool) {
		return serveFiles(kind, body)
	}
	return h
}

// callWithFiles sends a pipe's write end with a request for 0xf11e and
// checks what comes back through both files.
func callWithFiles(t *testing.T, c *ipc.Client) {
	t.Helper()
	r, w := pipe(t)
	var reply ipc.CreateMRReply
	got := &ipc.WithFiles{Body: &reply}
	req := ipc.WithFiles{Body: &ipc.CreateMR{Addr: 0xf11e}, Files: []*os.File{w}}
	require.NoError(t, c.Call(ctxBound(t), ipc.KindCreateMR, req, got))
	require.NoError(t, w.Close()) // the server closed its copy already
	assert.Equal(t, "addr 0xf11e", readAll(t, r), "the server wrote through the file it was sent")

	assert.Equal(t, uint32(0xf1), reply.LKey)
	require.Len(t, got.Files, 1)
	defer got.Files[0].Close()
	assert.Equal(t, "key 0xf1", readAll(t, got.Files[0]), "the client reads through the file it was answered")
}

func TestFilesTravelBothWays(t *testing.T) {
	s := startServer(t, fileHandler())
	callWithFiles(t, dial(t, s.path, ipc.ClientConfig{}))
}

func TestUntakenFilesAreClosed(t *testing.T) {
	s := startServer(t, newHandler()) // its handler never takes files
	c := dial(t, s.path, ipc.ClientConfig{})
	r, w := pipe(t)
	req := ipc.WithFiles{Body: &ipc.CreateMR{Addr: 0x1000}, Files: []*os.File{w}}
	require.NoError(t, c.Call(ctxBound(t), ipc.KindCreateMR, req, nil))
	require.NoError(t, w.Close())
	// End of file only comes once every write end is closed, the
	// server's copy included.
	assert.Equal(t, "", readAll(t, r))

}

// A reply's files the caller did not ask for are closed on arrival, and
// CloseAfterSend closes the sender's: the read end of a pipe whose write
// end was sent then sees end of file.
func TestUnwantedReplyFilesAreClosed(t *testing.T) {
	readEnds := make(chan *os.File, 1)
	h := newHandler()
	h.handle = func(ctx context.Context, p *ipc.Peer, kind ipc.Kind, body *ipc.Decoder) (any, error, bool) {
		r, w, err := os.Pipe()
		if err != nil {
			return nil, err, true
		}
		readEnds <- r
		return &ipc.WithFiles{Body: &ipc.DetachReply{}, Files: []*os.File{w}, CloseAfterSend: true}, nil, true
	}
	s := startServer(t, h)
	c := dial(t, s.path, ipc.ClientConfig{})
	require.NoError(t, c.Call(ctxBound(t), ipc.KindDetach, &ipc.Detach{}, &ipc.DetachReply{}))
	r := waitFor(t, readEnds, "the pipe")
	defer r.Close()
	assert.Equal(t, "", readAll(t, r))
}

func TestPushCarriesFiles(t *testing.T) {
	push := ipc.PushHandlerFunc(func(ctx context.Context, kind ipc.Kind, body *ipc.Decoder) (any, error) {
		var m ipc.Sync
		if err := body.Decode(&m); err != nil {
			return nil, err
		}
		for _, f := range body.Files() {
			f.WriteString("synced")
			f.Close()
		}
		return &ipc.SyncAck{}, nil
	})
	s := startServer(t, newHandler())
	dial(t, s.path, ipc.ClientConfig{PushHandler: push})
	p := waitFor(t, s.h.connected, "Connected")
	r, w := pipe(t)
	require.NoError(t, p.Push(ctxBound(t), ipc.KindSync,
		&ipc.WithFiles{Body: &ipc.Sync{Op: ipc.SyncResync}, Files: []*os.File{w}}, &ipc.SyncAck{}))
	require.NoError(t, w.Close())
	assert.Equal(t, "synced", readAll(t, r))
}

func TestTooManyFilesAreRefusedBeforeSending(t *testing.T) {
	s := startServer(t, newHandler())
	c := dial(t, s.path, ipc.ClientConfig{})
	_, w := pipe(t)
	files := make([]*os.File, ipc.MaxFiles+1)
	for i := range files {
		files[i] = w
	}
	err := c.Call(ctxBound(t), ipc.KindCreateMR, ipc.WithFiles{Body: &ipc.CreateMR{Addr: 1}, Files: files}, nil)
	assert.Error(t, err)
	assert.NoError(t, c.Err(), "the connection is intact")
}
