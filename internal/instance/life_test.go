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

	life, err := TakeLife(dir, "n", me, nil)
	require.NoError(t, err, "none there: made")
	_, err = TakeLife(dir, "n", me, nil)
	assert.ErrorIs(t, err, ofd.ErrLocked, "held by its taker")
	require.NoError(t, life.Close())
	life, err = TakeLife(dir, "n", me, nil)
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
	var removed []string
	life, err = TakeLife(dir, "n", me, func(p string) { removed = append(removed, p) })
	require.NoError(t, err)
	defer life.Remove()
	assert.Equal(t, []string{path}, removed, "and says so")
	was, err := os.Stat(shared)
	require.NoError(t, err)
	now, err := os.Stat(path)
	require.NoError(t, err)
	assert.False(t, os.SameFile(was, now))
	assert.Equal(t, uint64(1), was.Sys().(*syscall.Stat_t).Nlink, "the shared file keeps its own name only")
	assert.Equal(t, os.FileMode(ofd.PrivateMode), now.Mode().Perm())

	if me != 0 {
		t.Skip("needs root to give a file to another user (chown)")
	}
	other := LifePath(dir, "o")
	require.NoError(t, os.WriteFile(other, nil, 0o600))
	require.NoError(t, os.Chown(other, 42021, 42021))
	_, err = TakeLife(dir, "o", me, nil)
	assert.ErrorIs(t, err, ofd.ErrNotOwned, "another user's file is left alone")
	assert.FileExists(t, other)

}

// ClaimLife makes nothing: it claims a life file that is there, and
// reports none where there is none, or no directory.
func TestClaimLife(t *testing.T) {
	dir := t.TempDir()
	me := os.Geteuid()
	c, err := ClaimLife(dir, "n", me, nil)
	assert.NoError(t, err)
	assert.Nil(t, c)
	assert.NoFileExists(t, LifePath(dir, "n"), "none made")
	c, err = ClaimLife(filepath.Join(dir, "gone"), "n", me, nil)
	assert.NoError(t, err)
	assert.Nil(t, c)

	life, err := TakeLife(dir, "n", me, nil)
	require.NoError(t, err)
	_, err = ClaimLife(dir, "n", me, nil)
	assert.ErrorIs(t, err, ofd.ErrLocked)
	require.NoError(t, life.Close())
	c, err = ClaimLife(dir, "n", me, nil)
	require.NoError(t, err, "a dead taker's")
	require.NotNil(t, c)
	require.NoError(t, c.Remove())
}

// A taker stopped between opening a dead primary's life file and locking
// it, while another primary claims that file, ends (removing it), and a
// third makes a life file of its own and runs: the first must find the
// third alive, not take the lock it got on the removed file for the life
// file, nor remove the third's.
func TestATakerStoppedBeforeItsLockFindsTheLiveOne(t *testing.T) {
	dir := t.TempDir()
	me := os.Geteuid()
	dead, err := TakeLife(dir, "n", me, nil)
	require.NoError(t, err)
	require.NoError(t, dead.Close()) // its primary died

	var third interface{ Remove() error }
	stopped := false
	restore := ofd.SetBeforeLock(func() {
		if stopped {
			return // the first taker's next tries, and the others' claims
		}
		stopped = true
		second, err := TakeLife(dir, "n", me, nil)
		require.NoError(t, err, "the dead primary's file, claimed")
		require.NoError(t, second.Remove(), "the second primary ends")
		c, err := TakeLife(dir, "n", me, nil)
		require.NoError(t, err, "the third makes its own")
		third = c
	})
	first, err := TakeLife(dir, "n", me, nil)
	restore()
	if err == nil {
		first.Close()
	}
	require.NotNil(t, third, "the others ran while the first was stopped")
	defer third.Remove()
	assert.ErrorIs(t, err, ofd.ErrLocked, "the third primary lives")
	assert.FileExists(t, LifePath(dir, "n"), "its life file stays")
}
