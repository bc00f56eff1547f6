package mounts

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"syscall"
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

func TestOpenDirFollowsLinksAndSaysWhereItIs(t *testing.T) {
	dir, err := filepath.EvalSymlinks(t.TempDir())
	require.NoError(t, err)
	real := filepath.Join(dir, "real")
	require.NoError(t, os.MkdirAll(filepath.Join(real, "sub"), 0o700))
	require.NoError(t, os.Symlink(real, filepath.Join(dir, "abs")))
	require.NoError(t, os.Symlink("real/sub/..", filepath.Join(dir, "rel")))
	require.NoError(t, os.Symlink("loop", filepath.Join(dir, "loop")))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "file"), nil, 0o600))
	want, err := Read()
	require.NoError(t, err)

	for p, resolved := range map[string]string{
		filepath.Join(dir, "abs", "sub"): filepath.Join(real, "sub"),
		filepath.Join(dir, "rel"):        real,
		dir + "/./real/../real":          real,
	} {
		f, got, m, err := OpenDir(p)
		if assert.NoError(t, err, p) {
			assert.Equal(t, resolved, got, p)
			assert.Equal(t, want.At(resolved).Type, m.Type, p)
			f.Close()
		}
	}
	for _, p := range []string{filepath.Join(dir, "loop"), filepath.Join(dir, "file"), filepath.Join(dir, "none"), "relative"} {
		_, _, _, err := OpenDir(p)
		assert.Error(t, err, p)
	}
	f, got, m, err := OpenDir("/proc/self")
	require.NoError(t, err, "a mount crossed, a link followed")
	assert.Equal(t, "proc", m.Type)
	assert.Contains(t, got, "/proc/")
	f.Close()
}

func TestReadInfoAndFDInfo(t *testing.T) {
	p := filepath.Join(t.TempDir(), "mountinfo")
	require.NoError(t, os.WriteFile(p, []byte(
		"22 1 0:21 / /proc rw,nosuid shared:5 - proc proc rw\n"+
			"30 22 0:44 / /mnt/a\\040b rw shared:1 master:2 - fuse.sshfs host:/ rw\n"+
			"31 22 0:45 / /x rw - tmpfs tmpfs rw\n"+
			"garbage\n"), 0o600))
	info, err := ReadInfo(p)
	require.NoError(t, err)
	assert.Equal(t, Mount{Entry{"/proc", "proc"}, [2]uint32{0, 21}}, info[22])
	assert.Equal(t, Mount{Entry{"/mnt/a b", "fuse.sshfs"}, [2]uint32{0, 44}}, info[30], "optional fields before the separator")
	assert.Equal(t, "tmpfs", info[31].Type)
	assert.Len(t, info, 3)
	_, err = ReadInfo(filepath.Join(t.TempDir(), "none"))
	assert.ErrorIs(t, err, os.ErrNotExist)

	f, err := os.Open(p)
	require.NoError(t, err)
	defer f.Close()
	mnt, ino, ok := FDInfo("/proc/self/fdinfo/" + strconv.Itoa(int(f.Fd())))
	require.True(t, ok)
	var st syscall.Stat_t
	require.NoError(t, syscall.Fstat(int(f.Fd()), &st))
	assert.Equal(t, st.Ino, ino)
	m, err := Of(int(f.Fd()))
	require.NoError(t, err)
	own, err := ReadInfo("/proc/self/mountinfo")
	require.NoError(t, err)
	assert.Equal(t, own[mnt].Entry, m)
}

// A process can have as many mounts as it likes: a reader that cannot
// wait gives up in the middle of a long mountinfo, and one that can reads
// it all.
func TestReadInfoUntilGivesUpWhenTold(t *testing.T) {
	p := filepath.Join(t.TempDir(), "mountinfo")
	var b []byte
	const n = 5000
	for i := range n {
		b = fmt.Appendf(b, "%d 1 0:%d / /m/%d rw - tmpfs tmpfs rw\n", i+2, i%256, i)
	}
	require.NoError(t, os.WriteFile(p, b, 0o600))
	asked := 0
	_, err := ReadInfoUntil(p, func() bool { asked++; return asked == 3 })
	assert.ErrorIs(t, err, os.ErrDeadlineExceeded)
	assert.Equal(t, 3, asked, "it gave up when told")
	info, err := ReadInfoUntil(p, func() bool { return false })
	require.NoError(t, err)
	assert.Len(t, info, n)
}

// StatAt tells a file, a link and a missing name apart without following
// the link, and says ErrMayHang of a mount on the name without crossing
// into it.
func TestStatAtCrossesNoMountAndFollowsNoLink(t *testing.T) {
	dir := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(dir, "file"), nil, 0o600))
	require.NoError(t, os.Symlink("/", filepath.Join(dir, "link")))
	d, err := os.Open(dir)
	require.NoError(t, err)
	defer d.Close()

	st, err := StatAt(d, "file")
	require.NoError(t, err)
	assert.Equal(t, uint32(syscall.S_IFREG), st.Mode&syscall.S_IFMT)
	st, err = StatAt(d, "link")
	require.NoError(t, err)
	assert.Equal(t, uint32(syscall.S_IFLNK), st.Mode&syscall.S_IFMT, "the link itself")
	_, err = StatAt(d, "none")
	assert.ErrorIs(t, err, os.ErrNotExist)
	st, err = Lstat(filepath.Join(dir, "link"))
	require.NoError(t, err)
	assert.Equal(t, uint32(syscall.S_IFLNK), st.Mode&syscall.S_IFMT, "the link itself, by path")

	if os.Geteuid() != 0 {
		t.Skip("needs root: to mount")
	}
	mnt := filepath.Join(dir, "mnt")
	require.NoError(t, os.Mkdir(mnt, 0o755))
	require.NoError(t, syscall.Mount("none", mnt, "tmpfs", 0, "size=4k"))
	defer syscall.Unmount(mnt, syscall.MNT_DETACH)
	_, err = StatAt(d, "mnt")
	assert.ErrorIs(t, err, ErrMayHang)
}
