package primary_test

import (
	"os"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/instance"
	"github.com/mpmr/mpmr/primary"
)

// squat makes what another user may make in /dev/shm (mode 1777) under a
// backend file name of someone else's instance: kind "dir" (a directory)
// or "private" (a regular file of mode 0600), owned by squatterUID.
func b3secSquat(t *testing.T, path, kind string) {
	t.Helper()
	switch kind {
	case "dir":
		require.NoError(t, os.Mkdir(path, 0o700))
	case "private":
		f, err := os.OpenFile(path, os.O_CREATE|os.O_EXCL|os.O_RDONLY, 0o600) // hugetlbfs takes no write
		require.NoError(t, err)
		require.NoError(t, f.Close())
	}
	t.Cleanup(func() { os.Remove(path) })
	require.NoError(t, os.Lchown(path, squatterUID, squatterUID))
}

// b3secBackendPath is the path of the instance's file which ("segment",
// "memseg list" or "life file") in backend directory dir.
func b3secBackendPath(dir, name, which string) string {
	switch which {
	case "segment":
		return instance.SegmentPath(dir, name)
	case "life file":
		return instance.LifePath(dir, name)
	}
	return filepath.Join(dir, hugetlb.FileName(name, 0))
}

// README, Robustness: the instance directory's files "are opened through
// that descriptor", never following a link (ipc.RunDir.OpenFile refuses
// a symbolic link, and a file of anyone but the directory's owner or
// root). The secondary opens the one file it writes there, slots.lock,
// by path instead (secondary.attach: shm.Attach with LockPath
// rundir/slots.lock, opened O_RDWR|O_CREATE in shm.mapSegment): a
// primary's user whom a secondary of another user trusts (TrustUIDs) —
// trusted to serve it, not to write its files — puts a symbolic link
// there, and the secondary, attaching, creates a file of its own user
// wherever the link points (and takes its locks in it).
func TestBreaker3SecSecondaryFollowsALinkAtSlotsLock(t *testing.T) {
	requireRoot(t)
	prefix, shared, home := twoUserInstance(t, victimUID, squatterUID)
	// The primary of uid victimUID lets uid squatterUID in ...
	_, res := userProc(t, "user-primary", nil, strconv.Itoa(victimUID), prefix, shared,
		strconv.Itoa(squatterUID), "open")
	require.Equal(t, "<nil>", res)
	// ... and its user points slots.lock into the secondary's home.
	target := filepath.Join(home, ".planted-by-uid-"+strconv.Itoa(victimUID))
	lock := filepath.Join(shared, prefix, instance.SlotsLockFile)
	require.NoError(t, os.Remove(lock))
	require.NoError(t, os.Symlink(target, lock))
	require.NoError(t, os.Lchown(lock, victimUID, victimUID))

	s, res := userProc(t, "user-secondary", nil, strconv.Itoa(squatterUID), prefix, shared, strconv.Itoa(victimUID))
	t.Logf("the secondary's attach: %s", res)
	s.CloseInput()
	require.NoError(t, s.Wait(0))
	fi, err := os.Lstat(target)
	if err == nil {
		t.Errorf("uid %d's secondary, attaching, followed uid %d's symbolic link %s and created %s "+
			"(owner uid %d, mode %04o)", squatterUID, victimUID, lock, target,
			fi.Sys().(*syscall.Stat_t).Uid, fi.Mode().Perm())
	} else {
		assert.ErrorIs(t, err, os.ErrNotExist)
	}
	assert.Contains(t, res, primary.ErrPermission.Error(), "the link is refused")
}
