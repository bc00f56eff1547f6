package primary_test

import (
	"bytes"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/hugetlb"
)

// A secondary maps its data memory from the files the primary hands
// over, not from the paths the segment names. A primary's user whom a
// secondary of another user trusts is trusted to serve it, not to make
// it open files as itself: here that user swaps its backing file in the
// shared directory (its own file, so it may) for a link to a private file
// of the secondary's user. The secondary still maps the primary's memory:
// what it writes to a buffer the primary reads, and the private file does
// not change.
func TestSecondaryMapsTheFilesThePrimaryHandsOver(t *testing.T) {
	requireRoot(t)
	const primaryUID, secondaryUID = victimUID, squatterUID // the primary's user is the attacker here
	prefix, shared, home := twoUserInstance(t, primaryUID, secondaryUID)

	p, res := userProc(t, "user-primary", nil, strconv.Itoa(primaryUID), prefix, shared,
		strconv.Itoa(secondaryUID), "open")
	require.Equal(t, "<nil>", res)
	r := askProc(t, p, "alloc")
	v, err := strconv.ParseUint(strings.TrimPrefix(r, "region "), 10, 64)
	require.NoError(t, err, r)
	addr := uintptr(v)

	msl, err := filepath.Glob(filepath.Join(hugetlb.DefaultTmpfsDir, "mpmr."+prefix+".*.msl0"))
	require.NoError(t, err)
	require.Len(t, msl, 1, "the primary's one backing file")
	fi, err := os.Stat(msl[0])
	require.NoError(t, err)
	secret := filepath.Join(home, "private.db")
	content := make([]byte, max(fi.Size(), 1<<20))
	copy(content, "private data of uid "+strconv.Itoa(secondaryUID))
	require.NoError(t, os.WriteFile(secret, content, 0o600))
	require.NoError(t, os.Chown(secret, secondaryUID, secondaryUID))
	// The open file keeps the primary's memory; the name now leads to the
	// private file.
	require.NoError(t, os.Remove(msl[0]))
	require.NoError(t, os.Symlink(secret, msl[0]))
	require.NoError(t, os.Lchown(msl[0], primaryUID, primaryUID))

	s, res := userProc(t, "user-secondary", nil, strconv.Itoa(secondaryUID), prefix, shared, strconv.Itoa(primaryUID))
	require.Equal(t, "<nil>", res, "the secondary attaches")
	for i := uintptr(0); i < 64; i++ {
		require.Equal(t, "wrote", askProc(t, s, "write %d %d", addr+i, 0x5a))
	}
	assert.Equal(t, "byte 90", askProc(t, p, "read %d", addr+63), "the primary reads what the secondary wrote")
	s.CloseInput()
	require.NoError(t, s.Wait(0))
	after, err := os.ReadFile(secret)
	require.NoError(t, err)
	assert.Equal(t, -1, bytes.IndexByte(after, 0x5a), "the secondary's user's private file, behind the link")
}
