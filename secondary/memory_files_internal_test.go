package secondary

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/ipc"
)

// scriptedFiles answers memory-files requests from a script: each answer
// says how many lists there are and carries so many files (of /dev/null).
type scriptedFiles struct {
	mu      sync.Mutex
	answers [][2]int // lists, files
}

func (*scriptedFiles) Connected(*ipc.Peer)           {}
func (*scriptedFiles) Disconnected(*ipc.Peer, error) {}

func (h *scriptedFiles) Handle(ctx context.Context, p *ipc.Peer, kind ipc.Kind, body *ipc.Decoder) (any, error) {
	var m ipc.MemoryFiles
	if err := body.Decode(&m); err != nil {
		return nil, err
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if len(h.answers) == 0 {
		return nil, fmt.Errorf("no more answers")
	}
	a := h.answers[0]
	h.answers = h.answers[1:]
	var files []*os.File
	for range a[1] {
		f, err := os.Open(os.DevNull)
		if err != nil {
			return nil, err
		}
		files = append(files, f)
	}
	return ipc.WithFiles{Body: &ipc.MemoryFilesReply{Lists: a[0]}, Files: files, CloseAfterSend: true}, nil
}

// devNulls counts this process's descriptors of /dev/null: the files the
// scripted primary hands over.
func devNulls(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	require.NoError(t, err)
	n := 0
	for _, e := range ents {
		if target, err := os.Readlink(filepath.Join("/proc/self/fd", e.Name())); err == nil && target == os.DevNull {
			n++
		}
	}
	return n
}

// The memory files a primary hands over are taken only as they should
// come: one per list, 1 to hugetlb.MaxLists lists, each answer bringing
// some. Any other answer fails the attach with ErrBadDescriptor, and
// leaves no descriptor open.
func TestMemoryFilesTakesOnlyWhatFits(t *testing.T) {
	for _, c := range []struct {
		name    string
		answers [][2]int
		files   int // taken, when it succeeds
	}{
		{"one list", [][2]int{{1, 1}}, 1},
		{"two answers", [][2]int{{2, 1}, {2, 1}}, 2},
		{"no list", [][2]int{{0, 0}}, -1},
		{"too many lists", [][2]int{{hugetlb.MaxLists + 1, 1}}, -1},
		{"more files than lists", [][2]int{{1, 2}}, -1},
		{"no progress", [][2]int{{2, 1}, {2, 0}}, -1},
	} {
		t.Run(c.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), ipc.SocketName)
			l, err := ipc.Listen(path)
			require.NoError(t, err)
			srv, err := ipc.NewServer(ipc.ServerConfig{Listener: l, Handler: &scriptedFiles{answers: c.answers}})
			require.NoError(t, err)
			go srv.Serve(context.Background())
			t.Cleanup(func() { srv.Close() })
			ctx := context.Background()
			client, err := ipc.DialClient(ctx, path, ipc.ClientConfig{})
			require.NoError(t, err)
			before := devNulls(t)
			s := &Secondary{client: client, log: slog.New(slog.NewTextHandler(io.Discard, nil))}
			files, err := s.memoryFiles(ctx)
			if c.files >= 0 {
				require.NoError(t, err)
				assert.Len(t, files, c.files)
				for _, f := range files {
					f.Close()
				}
			} else {
				assert.ErrorIs(t, err, hugetlb.ErrBadDescriptor)
				assert.Nil(t, files)
			}
			// The server closes its copies after it sent them: once it
			// has ended, every copy left is one the secondary kept.
			client.Close()
			srv.Close()
			assert.Equal(t, before, devNulls(t), "descriptors handed over and left open")
		})
	}
}
