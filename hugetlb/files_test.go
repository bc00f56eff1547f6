package hugetlb_test

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/sys/ofd"
	"github.com/mpmr/mpmr/internal/test/testenv"
)

// Backend directories are shared by every user and instance: RemoveFiles
// removes only what it can prove a dead instance of this user left.
func TestRemoveFilesRemovesOnlyDeadFilesOfThisUser(t *testing.T) {
	testenv.ForEachBackend(t, 2, func(t *testing.T, b hugetlb.Backend) {
		in := newInstance(t, b, hugetlb.ListConfig{Pages: 2})
		live := filepath.Join(b.Dir, hugetlb.FileName(in.prefix, 0))
		r, err := in.mem.Alloc(b.PageSize)
		require.NoError(t, err)
		r.Bytes()[0] = 7

		err = hugetlb.RemoveFiles(b.Dir, in.prefix)
		assert.ErrorIs(t, err, hugetlb.ErrInUse, "a live memory's file")
		assert.Contains(t, err.Error(), live)
		assert.FileExists(t, live)
		assert.Equal(t, byte(7), r.Bytes()[0])
		require.NoError(t, in.mem.Free(r), "the live memory works on")

		// Once its memory is closed, nothing holds it.
		require.NoError(t, in.mem.Close())
		assert.NoFileExists(t, live, "Close removes its files")
	})
	t.Run("dead, foreign and linked files", func(t *testing.T) {
		b := testenv.Tmpfs(t)
		prefix := testenv.Name(t)
		path := func(n int) string { return filepath.Join(b.Dir, hugetlb.FileName(prefix, n)) }
		t.Cleanup(func() {
			for n := range 3 {
				os.Remove(path(n))
			}
		})
		require.NoError(t, os.WriteFile(path(0), []byte("dead"), 0o600))
		target := filepath.Join(t.TempDir(), "precious")
		require.NoError(t, os.WriteFile(target, []byte("precious"), 0o600))
		require.NoError(t, os.Symlink(target, path(1)))
		err := hugetlb.RemoveFiles(b.Dir, prefix)
		assert.ErrorIs(t, err, hugetlb.ErrNotOwned, "a link is nobody's backing file")
		assert.NoFileExists(t, path(0), "a dead file of this user goes")
		_, lerr := os.Lstat(path(1))
		assert.NoError(t, lerr, "the link is left")
		assert.FileExists(t, target)
		require.NoError(t, os.Remove(path(1)))

		if os.Geteuid() != 0 {
			t.Skip("needs root to give a file to another user (chown)")
		}
		require.NoError(t, os.WriteFile(path(2), nil, 0o600))
		require.NoError(t, os.Chown(path(2), 42021, 42021))
		err = hugetlb.RemoveFiles(b.Dir, prefix)
		assert.ErrorIs(t, err, hugetlb.ErrNotOwned)
		assert.Contains(t, err.Error(), "owner uid 42021")
		assert.FileExists(t, path(2), "another user's file is left alone")
	})
}

// A backing file handed to another process may be locked by it as Create
// locks it: RemoveEndedFiles, for a caller that proved the instance ended
// by other means, removes it anyway; links and other users' files it
// leaves alone as RemoveFiles does.
func TestRemoveEndedFilesRemovesLockedFilesOfThisUser(t *testing.T) {
	b := testenv.Tmpfs(t)
	prefix := testenv.Name(t)
	path := func(n int) string { return filepath.Join(b.Dir, hugetlb.FileName(prefix, n)) }
	t.Cleanup(func() {
		for n := range 2 {
			os.Remove(path(n))
		}
	})
	require.NoError(t, os.WriteFile(path(0), []byte("handed"), 0o600))
	holder, err := os.OpenFile(path(0), os.O_RDWR, 0)
	require.NoError(t, err)
	defer holder.Close()
	require.NoError(t, ofd.TryLock(holder, 0, true))
	require.NoError(t, os.Symlink(filepath.Join(t.TempDir(), "elsewhere"), path(1)))

	assert.ErrorIs(t, hugetlb.RemoveFiles(b.Dir, prefix), hugetlb.ErrInUse, "to RemoveFiles, a live memory's")
	assert.FileExists(t, path(0))
	err = hugetlb.RemoveEndedFiles(b.Dir, prefix)
	assert.ErrorIs(t, err, hugetlb.ErrNotOwned, "a link is nobody's backing file")
	assert.NotErrorIs(t, err, hugetlb.ErrInUse)
	assert.NoFileExists(t, path(0), "the locked file of this user goes")
	_, lerr := os.Lstat(path(1))
	assert.NoError(t, lerr, "the link is left")
}
