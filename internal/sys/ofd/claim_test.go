package ofd

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestClaimFile(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "f")
	require.NoError(t, os.WriteFile(path, []byte("x"), 0o600))
	me := os.Geteuid()

	holder, err := os.OpenFile(path, os.O_RDWR, 0)
	require.NoError(t, err)
	require.NoError(t, TryLock(holder, 0, true))
	_, err = ClaimFile(path, me)
	assert.ErrorIs(t, err, ErrLocked, "a live holder's file")
	_, err = ClaimFile(path, me+1)
	assert.ErrorIs(t, err, ErrNotOwned, "another user's file")
	holder.Close()

	c, err := ClaimFile(path, me)
	require.NoError(t, err, "nobody holds it any more")
	_, err = ClaimFile(path, me)
	assert.ErrorIs(t, err, ErrLocked, "one claim at a time")
	require.NoError(t, c.Remove())
	assert.NoFileExists(t, path)

	// A file replaced while claimed is left alone.
	require.NoError(t, os.WriteFile(path, []byte("old"), 0o600))
	c, err = ClaimFile(path, me)
	require.NoError(t, err)
	require.NoError(t, os.Rename(path, path+".old"))
	require.NoError(t, os.WriteFile(path, []byte("new"), 0o600))
	assert.Error(t, c.Remove())
	assert.FileExists(t, path)

	// Links and directories are nobody's.
	require.NoError(t, os.Symlink(path, filepath.Join(dir, "link")))
	_, err = ClaimFile(filepath.Join(dir, "link"), me)
	assert.ErrorIs(t, err, ErrNotOwned)
	require.NoError(t, os.Mkdir(filepath.Join(dir, "d"), 0o700))
	_, err = ClaimFile(filepath.Join(dir, "d"), me)
	assert.Error(t, err)
	_, err = ClaimFile(filepath.Join(dir, "none"), me)
	assert.ErrorIs(t, err, os.ErrNotExist)
}
