package demo

import (
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/testenv"
	"github.com/mpmr/mpmr/internal/testproc"
)

func TestMain(m *testing.M) {
	testproc.Register("secondary", func(args []string) int {
		var o Options
		if err := json.Unmarshal([]byte(args[0]), &o); err != nil {
			return 2
		}
		o.Out = os.Stdout
		o.Logger = slog.New(slog.DiscardHandler)
		if _, err := RunSecondary(context.Background(), o); err != nil {
			os.Stderr.WriteString(err.Error() + "\n")
			return 1
		}
		return 0
	})
	testproc.Main(m)
}

// syncBuffer is a bytes.Buffer safe for the concurrent writers of a run.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// The main job, shortened: a primary and two secondary processes doing
// real work with churn, on each backend.
func TestMainJob(t *testing.T) {
	testenv.ForEachBackend(t, 16, func(t *testing.T, b hugetlb.Backend) {
		var out syncBuffer
		o := Options{Prefix: testenv.Prefix(t), RuntimeDir: testenv.RunDir(t), Backend: b.Kind.String(),
			Secondaries: 2, Queues: 2, Duration: 500 * time.Millisecond, BufSize: 2048, Buffers: 1024,
			Churn: true, Out: &out, Logger: slog.New(slog.DiscardHandler)}
		launch := func(ctx context.Context, o Options, n int) *exec.Cmd {
			o.Out, o.Logger = nil, nil
			js, err := json.Marshal(o)
			require.NoError(t, err)
			args, _ := json.Marshal([]string{string(js)})
			cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^$")
			cmd.Env = append(os.Environ(), "MPMR_TEST_HELPER=secondary", "MPMR_TEST_HELPER_ARGS="+string(args))
			return cmd
		}
		ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
		defer cancel()
		require.NoError(t, RunPrimary(ctx, o, launch), "output:\n%s", out.String())
		text := out.String()
		t.Log(text)
		assert.Equal(t, 2, strings.Count(text, "  secondary pid"), "a summary per secondary")
		assert.Contains(t, text, "validation failures 0")
		assert.NotContains(t, text, "ended without a summary")
	})
}
