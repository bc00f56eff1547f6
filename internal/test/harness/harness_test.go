package harness

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/internal/sys/vm"
	"github.com/mpmr/mpmr/internal/test/testenv"
)

func TestMain(m *testing.M) { Main(m) }

func contains(list []string, part string) bool {
	for _, l := range list {
		if strings.Contains(l, part) {
			return true
		}
	}
	return false
}

// The final check finds each kind of leftover, and nothing once it is gone.
func TestLeftoversAreFound(t *testing.T) {
	s := newScenario(t, testenv.Tmpfs(t))
	require.Empty(t, s.Leftovers(), "a fresh scenario")

	t.Run("file in the backend directory", func(t *testing.T) {
		path := filepath.Join(s.Backend.Dir, "mpmr."+s.Name()+".msl0")
		require.NoError(t, os.WriteFile(path, []byte("x"), 0o600))
		assert.True(t, contains(s.Leftovers(), path))
		require.NoError(t, os.Remove(path))
		assert.Empty(t, s.Leftovers())
	})
	t.Run("runtime directory", func(t *testing.T) {
		require.NoError(t, os.MkdirAll(filepath.Join(s.instanceDir()), 0o700))
		require.NoError(t, os.WriteFile(filepath.Join(s.instanceDir(), "ipc.sock"), nil, 0o600))
		assert.True(t, contains(s.Leftovers(), "ipc.sock"))
		require.NoError(t, os.RemoveAll(s.instanceDir()))
		assert.Empty(t, s.Leftovers())
	})
	t.Run("mapping in this process", func(t *testing.T) {
		path := s.SegmentPath()
		f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
		require.NoError(t, err)
		require.NoError(t, f.Truncate(4096))
		addr, err := vm.MapShared(int(f.Fd()), 4096, false)
		require.NoError(t, err)
		f.Close()
		require.NoError(t, os.Remove(path))
		assert.True(t, contains(s.Leftovers(), "mapping in the test process"))
		require.NoError(t, vm.Unmap(addr, 4096))
		assert.Empty(t, s.Leftovers())
	})
}

// A helper that is running shows up in the check until it ends.
func TestRunningHelperIsFound(t *testing.T) {
	s := newScenario(t, testenv.Tmpfs(t))
	p, _ := s.StartPrimaryProcess(1)
	left := s.Leftovers()
	assert.True(t, contains(left, "is running"), "%v", left)
	assert.True(t, contains(left, ".ctl"), "%v", left)
	require.NoError(t, p.Close())
	assert.Empty(t, s.Leftovers(), "a primary closed cleanly leaves nothing")
}
