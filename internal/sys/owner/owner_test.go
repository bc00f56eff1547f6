package owner

import (
	"os"
	"path/filepath"
	"strconv"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

func TestForeign(t *testing.T) {
	dir := t.TempDir()
	mine := filepath.Join(dir, "mine")
	require.NoError(t, os.WriteFile(mine, nil, 0o600))
	assert.Empty(t, Foreign(mine), "a regular file of this user")
	assert.Empty(t, Foreign(filepath.Join(dir, "gone")))

	link := filepath.Join(dir, "link")
	require.NoError(t, os.Symlink(mine, link))
	me := strconv.Itoa(os.Geteuid())
	assert.Equal(t, "a symbolic link of uid "+me, Foreign(link), "not followed")
	assert.Equal(t, "a directory of uid "+me, Foreign(dir))

	if os.Geteuid() != 0 {
		t.Skip("needs root: to give a file to another user")
	}
	theirs := filepath.Join(dir, "theirs")
	require.NoError(t, os.WriteFile(theirs, nil, 0o600))
	require.NoError(t, unix.Lchown(theirs, 42099, 42099))
	assert.Equal(t, "a file of uid 42099", Foreign(theirs))
}
