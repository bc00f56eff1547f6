package instance_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/internal/instance"
	"github.com/mpmr/mpmr/ipc"
)

// An instance's runtime directory named relative to the working
// directory, or through a link, gives its files the name the absolute,
// resolved path gives: a tool run with -rundir rd from the directory
// above must find the files of a primary that named it in full.
func TestNameIsTheRuntimeDirectorysWhateverItIsCalled(t *testing.T) {
	base, err := filepath.EvalSymlinks(t.TempDir())
	require.NoError(t, err)
	rd := filepath.Join(base, "rd")
	require.NoError(t, os.Mkdir(rd, 0o700))
	require.NoError(t, os.Symlink(rd, filepath.Join(base, "link")))
	want := instance.Name("app", 1000, rd)
	t.Chdir(base)
	for _, dir := range []string{"rd", "./rd", "link", "rd/../rd", filepath.Join(base, "link")} {
		assert.Equal(t, want, instance.Name("app", 1000, dir), "runtime directory given as %q", dir)
		assert.Equal(t, rd, instance.RealPath(dir), "%q", dir)
	}
	// One that does not exist yet is named by its absolute path too.
	gone := filepath.Join(base, "later")
	assert.Equal(t, instance.Name("app", 1000, gone), instance.Name("app", 1000, "later"))
	assert.Equal(t, gone, instance.RealPath("later"))
	assert.NotEqual(t, want, instance.Name("app", 1000, "later"), "two directories, two names")
}

// The record of backend directories reads back as written, whatever the
// directories' names hold but a newline, which it refuses; a new record
// replaces the old whole.
func TestTheBackendsRecordReadsBackAsWritten(t *testing.T) {
	rd, err := ipc.OpenRunDir(filepath.Join(t.TempDir(), "rd"), ipc.RunDirOptions{Create: true})
	require.NoError(t, err)
	defer rd.Close()
	_, err = instance.ReadBackendsIn(rd)
	require.ErrorIs(t, err, os.ErrNotExist)

	dirs := []string{"/dev/hugepages", "/mnt/huge pages", "/dev/shm/"}
	require.NoError(t, instance.WriteBackendsIn(rd, dirs))
	got, err := instance.ReadBackendsIn(rd)
	require.NoError(t, err)
	assert.Equal(t, dirs, got)
	require.NoError(t, instance.WriteBackendsIn(rd, dirs[2:]))
	got, err = instance.ReadBackendsIn(rd)
	require.NoError(t, err)
	assert.Equal(t, dirs[2:], got)

	assert.Error(t, instance.WriteBackendsIn(rd, []string{"/a\nb"}))
	assert.Error(t, instance.WriteBackendsIn(rd, []string{""}))
	got, err = instance.ReadBackendsIn(rd)
	require.NoError(t, err)
	assert.Equal(t, dirs[2:], got, "a refused record changes nothing")
	_, err = os.Stat(filepath.Join(rd.Path(), instance.BackendsFile+".tmp"))
	assert.ErrorIs(t, err, os.ErrNotExist, "and leaves no temporary file")
}

// A directory of an instance's own is told by its name: of that instance
// (IsPrivateDir), or of any instance of its prefix and user
// (IsPrivateDirOf), and of no other, whatever the prefixes.
func TestPrivateDirNamesAreTheInstances(t *testing.T) {
	a := instance.Name("app", 0, "/run/mpmr/app")
	b := instance.Name("app", 0, "/tmp/elsewhere/app")
	other := instance.Name("app.u0."+a[len("app.u0."):], 0, "/run/mpmr/x")
	d := instance.PrivateDirName(a)
	assert.NotEqual(t, d, instance.PrivateDirName(a), "each name is new")
	assert.True(t, instance.IsPrivateDir(d, a))
	assert.False(t, instance.IsPrivateDir(d, b))
	assert.True(t, instance.IsPrivateDirOf(d, "app", 0))
	assert.True(t, instance.IsPrivateDirOf(instance.PrivateDirName(b), "app", 0), "any runtime directory")
	assert.False(t, instance.IsPrivateDirOf(d, "app", 1000), "another user")
	assert.False(t, instance.IsPrivateDirOf(d, "ap", 0), "another prefix")
	assert.False(t, instance.IsPrivateDirOf(instance.PrivateDirName(other), "app", 0), "a prefix that begins with another's name")
	assert.False(t, instance.IsPrivateDir(instance.PrivateDirName(other), a))
	for _, base := range []string{d[:len(d)-1], d + "a", strings.ToUpper(d), "mpmr." + a + ".ctl", "mpmr." + a + ".p"} {
		assert.False(t, instance.IsPrivateDir(base, a), base)
		assert.False(t, instance.IsPrivateDirOf(base, "app", 0), base)
	}
}
