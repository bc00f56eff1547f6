package instance

import (
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/internal/sys/ofd"
)

func TestTakeLife(t *testing.T) {
	dir := t.TempDir()
	me := os.Geteuid()
	path := LifePath(dir, "n")

	life, err := TakeLife(dir, "n", me)
	require.NoError(t, err, "none there: made")
	_, err = TakeLife(dir, "n", me)
	assert.ErrorIs(t, err, ofd.ErrLocked, "held by its taker")
	require.NoError(t, life.Close())
	life, err = TakeLife(dir, "n", me)
	require.NoError(t, err, "left by one that ended: claimed")
	require.NoError(t, life.Remove())

	// A file others could hold, under the name and locked: its name goes,
	// and a life file of the taker's own takes it.
	shared := filepath.Join(dir, "shared")
	require.NoError(t, os.WriteFile(shared, nil, 0o666))
	require.NoError(t, os.Chmod(shared, 0o666))
	require.NoError(t, os.Link(shared, path))
	holder, err := os.OpenFile(shared, os.O_RDWR, 0)
	require.NoError(t, err)
	defer holder.Close()
	require.NoError(t, ofd.TryLock(holder, 0, true))
	life, err = TakeLife(dir, "n", me)
	require.NoError(t, err)
	defer life.Remove()
	was, err := os.Stat(shared)
	require.NoError(t, err)
	now, err := os.Stat(path)
	require.NoError(t, err)
	assert.False(t, os.SameFile(was, now))
	assert.Equal(t, uint64(1), was.Sys().(*syscall.Stat_t).Nlink, "the shared file keeps its own name only")
	assert.Zero(t, now.Mode().Perm()&0o077)

	if me != 0 {
		t.Skip("needs root to give a file to another user (chown)")
	}
	other := LifePath(dir, "o")
	require.NoError(t, os.WriteFile(other, nil, 0o600))
	require.NoError(t, os.Chown(other, 42021, 42021))
	_, err = TakeLife(dir, "o", me)
	assert.ErrorIs(t, err, ofd.ErrNotOwned, "another user's file is left alone")
	assert.FileExists(t, other)
}
