package ofd

import (
	"fmt"
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

	// A directory's path, even one that ends in a slash, is not the path
	// of the file of the same name inside it.
	require.NoError(t, os.WriteFile(filepath.Join(dir, "d", "d"), nil, 0o600))
	// Nor is a path whose ".." the kernel would resolve after a link.
	require.NoError(t, os.Symlink(filepath.Join(dir, "d"), filepath.Join(dir, "l")))
	for _, p := range []string{dir + "/d/", dir + "/d/.", dir + "/d/d/..", dir + "/l/../d/d", dir + "//d/d"} {
		_, err = ClaimFile(p, me)
		assert.ErrorIs(t, err, ErrNotOwned, p)
	}
	assert.FileExists(t, filepath.Join(dir, "d", "d"))
}

// A file its maker made with CreateLocked is claimed by nobody while the
// maker holds it, and by ClaimPrivate once it ended; a file others could
// have held is no private file. ClaimEnded, for a caller that knows the
// maker ended, claims a file whoever else holds locked, and removes it
// under them.
func TestCreateLockedAndClaimEnded(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "life")
	me := os.Geteuid()

	life, err := CreateLocked(path)
	require.NoError(t, err)
	_, err = CreateLocked(path)
	assert.ErrorIs(t, err, os.ErrExist, "made once")
	_, err = ClaimPrivate(path, me)
	assert.ErrorIs(t, err, ErrLocked, "its maker lives")
	fi, err := os.Stat(path)
	require.NoError(t, err)
	assert.Equal(t, os.FileMode(PrivateMode), fi.Mode().Perm(), "nobody else may open it")
	require.NoError(t, life.Close())
	c, err := ClaimPrivate(path, me)
	require.NoError(t, err, "its maker ended: a private file nobody holds")
	require.NoError(t, c.Close())
	require.NoError(t, os.Link(path, path+".2"))
	c, err = ClaimPrivate(path, me)
	require.NoError(t, err, "another name does not let anyone else open it")
	require.NoError(t, c.Close())
	require.NoError(t, os.Remove(path+".2"))
	for _, mode := range []os.FileMode{0o600, 0o640, 0o400} {
		require.NoError(t, os.Chmod(path, mode))
		_, err = ClaimPrivate(path, me)
		assert.ErrorIs(t, err, ErrNotPrivate, "mode %04o: a file its owner could have handed on", mode)
		c, err = ClaimEnded(path, me)
		require.NoError(t, err)
		ok, err := c.Private()
		require.NoError(t, err)
		assert.False(t, ok, "mode %04o", mode)
		require.NoError(t, c.Close())
	}
	require.NoError(t, os.WriteFile(path, []byte("x"), 0o200))
	require.NoError(t, os.Chmod(path, PrivateMode))
	_, err = ClaimPrivate(path, me)
	assert.ErrorIs(t, err, ErrNotPrivate, "a file with data")
	require.NoError(t, os.Truncate(path, 0))
	require.NoError(t, os.Chmod(path, PrivateMode))
	life, err = ClaimPrivate(path, me)
	require.NoError(t, err)
	require.NoError(t, life.Remove())
	assert.NoFileExists(t, path, "its holder removes it")

	// Another holder of an open file may lock it as its maker did.
	other := filepath.Join(dir, "handed")
	require.NoError(t, os.WriteFile(other, []byte("x"), 0o600))
	holder, err := os.OpenFile(other, os.O_RDWR, 0)
	require.NoError(t, err)
	defer holder.Close()
	require.NoError(t, TryLock(holder, 0, true))
	_, err = ClaimEnded(other, me+1)
	assert.ErrorIs(t, err, ErrNotOwned, "another user's file, ended or not")
	c, err = ClaimEnded(other, me)
	require.NoError(t, err, "locked, but proven ended")
	require.NoError(t, c.Remove())
	assert.NoFileExists(t, other)
	again, err := os.OpenFile(fmt.Sprintf("/proc/self/fd/%d", holder.Fd()), os.O_RDWR, 0)
	require.NoError(t, err)
	defer again.Close()
	assert.ErrorIs(t, TryLock(again, 0, true), ErrLocked, "the holder's lock is left as it was")

	require.NoError(t, os.Symlink(path, filepath.Join(dir, "link")))
	_, err = ClaimEnded(filepath.Join(dir, "link"), me)
	assert.ErrorIs(t, err, ErrNotOwned, "links are nobody's")
	_, err = CreateLocked(filepath.Join(dir, "link"))
	assert.Error(t, err, "nor made through")
	assert.NoFileExists(t, path)
}

// A claim that opened a file its holder then removed finds, once it has
// locked it, that the name no longer names it: its lock would hold
// nothing anyone looks at.
func TestALockTakenAfterTheRemovalIsStale(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "life")
	me := os.Geteuid()
	for _, how := range []string{"claim", "create"} {
		t.Run(how, func(t *testing.T) {
			if how == "claim" {
				made, err := CreateLocked(path)
				require.NoError(t, err)
				require.NoError(t, made.Close())
			}
			var holder *Claim
			testHookBeforeLock = func() {
				testHookBeforeLock = nil
				var err error
				holder, err = ClaimPrivate(path, me) // another claimant gets in first...
				require.NoError(t, err)
				require.NoError(t, holder.Remove()) // ...and is done with it
			}
			t.Cleanup(func() { testHookBeforeLock = nil })
			var err error
			if how == "claim" {
				_, err = ClaimPrivate(path, me)
			} else {
				_, err = CreateLocked(path)
			}
			assert.ErrorIs(t, err, ErrStale)
			assert.NotNil(t, holder, "the other claimant ran")
			assert.NoFileExists(t, path)
		})
	}
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

func openFDs() int {
	ents, _ := os.ReadDir("/proc/self/fd")
	return len(ents) - 1
}

// Every failure path of ClaimFile, and Remove/Close in any order, leave
// no descriptor behind.
func TestClaimLeavesNoDescriptor(t *testing.T) {
	dir := t.TempDir()
	me := os.Geteuid()
	f := filepath.Join(dir, "f")
	require.NoError(t, os.WriteFile(f, nil, 0o600))
	require.NoError(t, os.Symlink(f, filepath.Join(dir, "link")))
	require.NoError(t, os.Mkdir(filepath.Join(dir, "d"), 0o700))
	require.NoError(t, os.Symlink(filepath.Join(dir, "loop"), filepath.Join(dir, "loop")))
	holder, err := os.OpenFile(f, os.O_RDWR, 0)
	require.NoError(t, err)
	defer holder.Close()

	before := openFDs()
	for _, c := range []struct {
		path string
		uid  int
	}{
		{filepath.Join(dir, "none"), me},
		{filepath.Join(dir, "nodir", "x"), me},
		{filepath.Join(f, "x"), me},           // ENOTDIR
		{filepath.Join(dir, "loop", "x"), me}, // ELOOP on the directory
		{filepath.Join(dir, "link"), me},      // symlink
		{filepath.Join(dir, "d"), me},         // directory
		{f, me + 1},                           // another owner
	} {
		_, err := ClaimFile(c.path, c.uid)
		assert.Error(t, err, c.path)
	}
	require.NoError(t, TryLock(holder, 0, true))
	_, err = ClaimFile(f, me)
	assert.ErrorIs(t, err, ErrLocked)
	require.NoError(t, Unlock(holder, 0))
	assert.Equal(t, before, openFDs(), "failed claims leak nothing")

	c, err := ClaimFile(f, me)
	require.NoError(t, err)
	require.NoError(t, c.Remove())
	require.NoError(t, c.Close(), "Close after Remove")
	require.NoError(t, c.Close(), "and again")
	assert.Equal(t, before, openFDs())

	require.NoError(t, os.WriteFile(f, nil, 0o600))
	c, err = ClaimFile(f, me)
	require.NoError(t, err)
	require.NoError(t, c.Close())
	assert.Equal(t, before, openFDs())
	assert.FileExists(t, f)
}

// The directory itself replaced (renamed away, another put at its path)
// after the claim: Remove unlinks in the directory claimed through, and
// the new directory's same-named file stays.
func TestRemoveAfterTheDirectoryIsReplaced(t *testing.T) {
	base := t.TempDir()
	inst := filepath.Join(base, "inst")
	require.NoError(t, os.Mkdir(inst, 0o700))
	path := filepath.Join(inst, "seg")
	require.NoError(t, os.WriteFile(path, []byte("claimed"), 0o600))
	c, err := ClaimFile(path, os.Geteuid())
	require.NoError(t, err)
	require.NoError(t, os.Rename(inst, inst+".old"))
	require.NoError(t, os.Mkdir(inst, 0o700))
	require.NoError(t, os.WriteFile(path, []byte("other"), 0o600))
	require.NoError(t, c.Remove())
	assert.FileExists(t, path, "the other directory's file stays")
	assert.NoFileExists(t, filepath.Join(inst+".old", "seg"), "the claimed one goes")
}

// A hard link of the claimed file put under the name elsewhere; the name
// in the claimed directory replaced by a hard link of the same inode.
func TestRemoveTakesOnlyTheClaimedName(t *testing.T) {
	base := t.TempDir()
	path := filepath.Join(base, "seg")
	require.NoError(t, os.WriteFile(path, []byte("claimed"), 0o600))
	c, err := ClaimFile(path, os.Geteuid())
	require.NoError(t, err)
	other := filepath.Join(base, "keep")
	require.NoError(t, os.Link(path, other))
	require.NoError(t, c.Remove())
	assert.NoFileExists(t, path)
	assert.FileExists(t, other, "only the claimed name goes")
}
