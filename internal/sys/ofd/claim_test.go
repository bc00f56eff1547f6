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

// TestRemoveStaysInTheClaimedDirectory swaps the directory a claim was
// made through for another, holding a file of the same name, at the last
// moment before the unlink: the instance's user can do that to a tool
// run by root. Only the claimed file may go.
func TestRemoveStaysInTheClaimedDirectory(t *testing.T) {
	base := t.TempDir()
	mine, theirs := filepath.Join(base, "mine"), filepath.Join(base, "theirs")
	require.NoError(t, os.Mkdir(mine, 0o700))
	require.NoError(t, os.Mkdir(theirs, 0o700))
	require.NoError(t, os.WriteFile(filepath.Join(mine, "f"), []byte("claimed"), 0o600))
	require.NoError(t, os.WriteFile(filepath.Join(theirs, "f"), []byte("someone else's"), 0o600))
	link := filepath.Join(base, "dir")
	require.NoError(t, os.Symlink(mine, link))
	swap := func(to string) {
		tmp := link + ".new"
		require.NoError(t, os.Symlink(to, tmp))
		require.NoError(t, os.Rename(tmp, link))
	}

	c, err := ClaimFile(filepath.Join(link, "f"), os.Geteuid())
	require.NoError(t, err)
	testHookBeforeUnlink = func() { swap(theirs) }
	t.Cleanup(func() { testHookBeforeUnlink = nil })
	require.NoError(t, c.Remove())
	assert.FileExists(t, filepath.Join(theirs, "f"), "the file the name led to at the unlink")
	assert.NoFileExists(t, filepath.Join(mine, "f"), "the claimed file")

	// Swapped before Remove looks at all: the same.
	swap(mine)
	require.NoError(t, os.WriteFile(filepath.Join(mine, "f"), []byte("claimed"), 0o600))
	c, err = ClaimFile(filepath.Join(link, "f"), os.Geteuid())
	require.NoError(t, err)
	testHookBeforeUnlink = nil
	swap(theirs)
	require.NoError(t, c.Remove())
	assert.FileExists(t, filepath.Join(theirs, "f"))
	assert.NoFileExists(t, filepath.Join(mine, "f"))
}
