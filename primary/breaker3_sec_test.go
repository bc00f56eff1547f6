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
	"github.com/mpmr/mpmr/internal/test/testenv"
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
		require.NoError(t, os.WriteFile(path, nil, 0o600))
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

// README, Robustness: "A new primary removes a leftover only if it is a
// regular file of its user that nobody holds locked; ... another user's
// [fails Start] with ErrPermission". A squatter who makes a directory
// under the instance's segment or memseg name gets Start refused with
// the raw EISDIR of an open (segment) or with hugetlb.ErrExists, "left
// by an instance that ended?" (memseg list) instead: ofd.ClaimFile opens
// before it looks at what the file is, and recoverLeftovers passes
// errors other than ErrNotOwned through (segment) or only logs them
// (memseg lists).
func TestBreaker3SecSquattedDirectoryAtABackendNameIsNotErrPermission(t *testing.T) {
	requireRoot(t)
	b := testenv.Tmpfs(t)
	for _, which := range []string{"segment", "memseg list", "life file"} {
		t.Run(which, func(t *testing.T) {
			cfg := primary.Config{Prefix: testenv.Prefix(t), RuntimeDir: testenv.RunDir(t), Backend: b.Kind,
				MemoryPages: 16, Logger: quiet}
			name := instance.Name(cfg.Prefix, os.Geteuid(), filepath.Join(cfg.RuntimeDir, cfg.Prefix))
			path := b3secBackendPath(b.Dir, name, which)
			b3secSquat(t, path, "dir")
			p, err := primary.Start(cfg)
			if err == nil {
				p.Close()
			}
			require.Error(t, err)
			assert.ErrorIs(t, err, primary.ErrPermission,
				"uid %d's directory at %s: Start failed with another error", squatterUID, path)
			assert.Contains(t, err.Error(), "owner uid "+strconv.Itoa(squatterUID))
			fi, serr := os.Lstat(path)
			require.NoError(t, serr, "another user's file is left alone")
			assert.Equal(t, uint32(squatterUID), fi.Sys().(*syscall.Stat_t).Uid)
		})
	}
}

// The same promise for a primary that does not run as root: a squatter's
// file of mode 0600 under the victim's segment or memseg name (in /dev/shm,
// where anyone may make one, with the name the victim's uid and runtime
// directory predict) cannot be opened by the victim, and Start fails with
// the open's EACCES ("permission denied", fs.ErrPermission, naming no
// owner) or hugetlb.ErrExists, not ErrPermission naming the squatter.
func TestBreaker3SecSquattersPrivateFileAtABackendNameIsNotErrPermission(t *testing.T) {
	requireRoot(t)
	for _, which := range []string{"segment", "memseg list", "life file"} {
		t.Run(which, func(t *testing.T) {
			tmp := sharedTmp(t)
			prefix := testenv.Prefix(t)
			t.Cleanup(func() { removeInstanceFiles(t, prefix) })
			name := runtimeName(prefix, victimUID, filepath.Join(tmp, "mpmr-"+strconv.Itoa(victimUID)))
			path := b3secBackendPath(hugetlb.DefaultTmpfsDir, name, which)
			b3secSquat(t, path, "private")

			h, res := userProc(t, "user-primary", userEnv(tmp), strconv.Itoa(victimUID), prefix, "", "", "")
			require.NotEqual(t, "<nil>", res, "the victim's primary started beside uid %d's %s", squatterUID, path)
			assert.Contains(t, res, primary.ErrPermission.Error(),
				"uid %d's primary, refused by uid %d's file %s, says", victimUID, squatterUID, path)
			assert.Contains(t, res, "owner uid "+strconv.Itoa(squatterUID))
			require.NoError(t, h.Wait(0))
			fi, err := os.Lstat(path)
			require.NoError(t, err, "another user's file is left alone")
			assert.Equal(t, uint32(squatterUID), fi.Sys().(*syscall.Stat_t).Uid)
		})
	}
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
