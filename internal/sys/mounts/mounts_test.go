package mounts

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestAtFindsTheLastLongestMount(t *testing.T) {
	tab := Table{{"/", "ext4"}, {"/mnt", "tmpfs"}, {"/mnt/a", "fuse.x"}, {"/mnt", "nfs"}}
	assert.Equal(t, Entry{"/mnt", "nfs"}, tab.At("/mnt"), "a later mount at a directory hides an earlier one")
	assert.Equal(t, Entry{"/mnt/a", "fuse.x"}, tab.At("/mnt/a/b"))
	assert.Equal(t, Entry{"/mnt", "nfs"}, tab.At("/mnt/ab"), "a name that only starts like a mount point")
	assert.Equal(t, Entry{"/", "ext4"}, tab.At("/usr"))
	assert.True(t, MayHang("fuse.sshfs"))
	assert.True(t, MayHang("nfs4"))
	assert.False(t, MayHang("tmpfs"))
	assert.Equal(t, "a b\\", Unescape(`a\040b\`))
}

// Resolve follows links, and looks nothing up on a file system that might
// hang: here the table says the directory a link leads to is a FUSE
// mount, and Resolve stops before it.
func TestResolveStopsBeforeAFileSystemThatMightHang(t *testing.T) {
	dir, err := filepath.EvalSymlinks(t.TempDir())
	require.NoError(t, err)
	real := filepath.Join(dir, "real")
	require.NoError(t, os.MkdirAll(filepath.Join(real, "sub"), 0o700))
	require.NoError(t, os.Symlink(real, filepath.Join(dir, "abs")))
	require.NoError(t, os.Symlink("real/sub/..", filepath.Join(dir, "rel")))
	require.NoError(t, os.Symlink("loop", filepath.Join(dir, "loop")))
	tab := Table{{"/", "ext4"}}

	got, err := tab.Resolve(filepath.Join(dir, "abs", "sub"))
	require.NoError(t, err)
	assert.Equal(t, filepath.Join(real, "sub"), got)
	got, err = tab.Resolve(filepath.Join(dir, "rel"))
	require.NoError(t, err)
	assert.Equal(t, real, got)
	_, err = tab.Resolve(filepath.Join(dir, "loop"))
	assert.Error(t, err)
	_, err = tab.Resolve("relative")
	assert.Error(t, err)

	tab = append(tab, Entry{real, "fuse"})
	_, err = tab.Resolve(filepath.Join(dir, "abs", "sub"))
	assert.ErrorIs(t, err, ErrMayHang, "the link leads into the mount")
	_, err = tab.Resolve(real)
	assert.ErrorIs(t, err, ErrMayHang, "the mount point itself is not looked at either")
}
