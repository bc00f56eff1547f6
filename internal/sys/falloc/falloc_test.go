package falloc

import (
	"os"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

func allocatedBytes(t *testing.T, f *os.File) int64 {
	t.Helper()
	var st unix.Stat_t
	require.NoError(t, unix.Fstat(int(f.Fd()), &st))
	return st.Blocks * 512
}

func TestAllocateAndPunch(t *testing.T) {
	dir := "/dev/shm"
	if _, err := os.Stat(dir); err != nil {
		dir = t.TempDir()
	}
	f, err := os.CreateTemp(dir, "falloc-test-")
	require.NoError(t, err)
	defer os.Remove(f.Name())
	defer f.Close()

	const mb = 1 << 20
	require.NoError(t, Allocate(int(f.Fd()), 0, 2*mb))
	st, err := f.Stat()
	require.NoError(t, err)
	assert.Equal(t, int64(2*mb), st.Size())
	assert.GreaterOrEqual(t, allocatedBytes(t, f), int64(2*mb))

	require.NoError(t, PunchHole(int(f.Fd()), 0, mb))
	st, err = f.Stat()
	require.NoError(t, err)
	assert.Equal(t, int64(2*mb), st.Size(), "punching keeps the size")
	assert.Less(t, allocatedBytes(t, f), int64(2*mb), "punching frees blocks")
}

func TestAllocateFailsClearly(t *testing.T) {
	f, err := os.CreateTemp(t.TempDir(), "falloc-nospace-")
	require.NoError(t, err)
	defer f.Close()
	// No file system here holds an exabyte.
	err = Allocate(int(f.Fd()), 0, 1<<60)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "0x1000000000000000", "the error names the range")
}
