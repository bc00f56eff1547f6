package ofd

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"
)

// ErrNotOwned means a file is not a regular file of the expected user: it
// is not one of ours to remove, whatever its name says.
var ErrNotOwned = errors.New("ofd: not a regular file of the expected owner")

// ErrNotPrivate means a regular file of the expected user is not one that
// only that user may ever have held (see ClaimPrivate).
var ErrNotPrivate = errors.New("ofd: not a private file")

// ErrStale means the file was unlinked, or another put under its name,
// between its opening and its locking: a lock on it holds nothing that
// anyone looking under the name will find. Try again.
var ErrStale = errors.New("ofd: file unlinked or replaced before it was locked")

// PrivateMode is the mode of the files CreateLocked makes: writable by
// their owner, and by nobody else, readable by nobody. No file a process
// shares with others (which they open, or are handed) has it, and nobody
// but root and its owner can open a file that has it.
const PrivateMode = 0o200

// A Claim is a file proven to belong to no live holder: opened without
// following links, checked to be a regular file of its expected owner,
// and locked (byte 0, exclusively) by this process, which is what every
// holder of such a file does for as long as it lives (or, from
// ClaimEnded, proven so by the caller and not locked; from CreateLocked,
// made and locked by this process). Its holder may then remove it without
// racing a live one. The claim keeps the directory the
// file was found in: whatever the path's directories are made to name
// later, Remove unlinks in that one.
type Claim struct {
	f    *os.File
	dir  *os.File // the directory the file was found in (O_PATH)
	name string   // its name there
	path string
}

// ClaimFile claims the file at path (a clean one: filepath.Clean leaves
// it as it is), which must be a regular file owned by uid (else
// ErrNotOwned): it fails with ErrLocked while any other open file
// description holds a lock on byte 0 of it: its maker's, which holds one
// for as long as it lives, or that of anyone else who holds it open.
func ClaimFile(path string, uid int) (*Claim, error) {
	return claimFile(path, func(dir *os.File, name string) (*Claim, error) {
		return claimAt(dir, name, path, uid, claimHow{lock: true})
	})
}

// ClaimPrivate is ClaimFile for a file made by CreateLocked and never
// shared: a lock on it proves a live maker only if nobody else could ever
// have held it. A regular file of uid whose mode is not PrivateMode (a
// file others may open, or one that was handed to others, all of which
// their owner may read), or that has data, is no such file, whoever holds
// it or a lock on it: ErrNotPrivate. (Another name does not make a file
// of PrivateMode less private: whoever links it still cannot open it.)
func ClaimPrivate(path string, uid int) (*Claim, error) {
	return claimFile(path, func(dir *os.File, name string) (*Claim, error) {
		return claimAt(dir, name, path, uid, claimHow{lock: true, private: true})
	})
}

// ClaimEnded is ClaimFile for a file whose maker the caller has proven
// ended by other means: it makes the same checks but does not look at
// locks, and takes none. Anyone who holds a file open may lock it, so a
// lock on a file others were handed proves nothing; ClaimEnded leaves
// such locks as they are, and Remove unlinks the file under them.
func ClaimEnded(path string, uid int) (*Claim, error) {
	return claimFile(path, func(dir *os.File, name string) (*Claim, error) {
		return claimAt(dir, name, path, uid, claimHow{})
	})
}

// CreateLocked makes the file at path (a clean one), which must not
// exist, as an empty regular file of mode PrivateMode, and locks byte 0
// of it: the claim is the lifetime lock ClaimFile and ClaimPrivate look
// for. Remove unlinks it before the lock goes. It fails with ErrLocked if
// another process opened and locked the file before this one did, and
// with ErrStale if another claimed and removed it meanwhile.
func CreateLocked(path string) (*Claim, error) {
	return claimFile(path, func(dir *os.File, name string) (*Claim, error) { return createAt(dir, name, path) })
}

// claimFile checks path and claims its file with at, in the directory
// path names, opened once.
func claimFile(path string, at func(dir *os.File, name string) (*Claim, error)) (*Claim, error) {
	name := filepath.Base(path)
	if strings.HasSuffix(path, "/") || name == "." || name == ".." || name == "/" {
		return nil, fmt.Errorf("%w: %s names a directory", ErrNotOwned, path)
	}
	if filepath.Clean(path) != path {
		// The claim is made in filepath.Dir(path), which reads ".." as
		// text where the kernel would resolve it after a link.
		return nil, fmt.Errorf("%w: %s is not a clean path", ErrNotOwned, path)
	}
	dfd, err := unix.Open(filepath.Dir(path), unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: filepath.Dir(path), Err: err}
	}
	dir := os.NewFile(uintptr(dfd), filepath.Dir(path))
	c, err := at(dir, name)
	if err != nil {
		dir.Close()
		return nil, err
	}
	return c, nil
}

// createAt makes name in dir, exclusively, and locks it.
func createAt(dir *os.File, name, path string) (*Claim, error) {
	fd, err := unix.Openat(int(dir.Fd()), name, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, PrivateMode)
	if err != nil {
		return nil, &os.PathError{Op: "create", Path: path, Err: err}
	}
	f := os.NewFile(uintptr(fd), path)
	if err := unix.Fchmod(fd, PrivateMode); err != nil { // whatever the umask took away
		f.Close()
		return nil, &os.PathError{Op: "make private", Path: path, Err: err}
	}
	return lockClaim(f, dir, name, path)
}

// lockClaim locks byte 0 of f, found as name in dir, and makes sure name
// still names it: an opener that locks after the holder of a claim
// removed the file would hold a lock nobody sees.
func lockClaim(f *os.File, dir *os.File, name, path string) (*Claim, error) {
	if testHookBeforeLock != nil {
		testHookBeforeLock()
	}
	if err := TryLock(f, 0, true); err != nil {
		f.Close()
		return nil, err
	}
	var held, now unix.Stat_t
	err := unix.Fstat(int(f.Fd()), &held)
	if err == nil {
		err = unix.Fstatat(int(dir.Fd()), name, &now, unix.AT_SYMLINK_NOFOLLOW)
	}
	switch {
	case errors.Is(err, unix.ENOENT), err == nil && (held.Nlink == 0 || held.Dev != now.Dev || held.Ino != now.Ino):
		f.Close()
		return nil, fmt.Errorf("%w: %s", ErrStale, path)
	case err != nil:
		f.Close()
		return nil, &os.PathError{Op: "stat", Path: path, Err: err}
	}
	return &Claim{f: f, dir: dir, name: name, path: path}, nil
}

// private reports whether st is of a file CreateLocked made: of
// PrivateMode, and empty.
func private(st *unix.Stat_t) bool { return st.Mode&0o7777 == PrivateMode && st.Size == 0 }

// Private reports whether the claimed file is, by its mode and size, one
// that CreateLocked made (see ClaimPrivate).
func (c *Claim) Private() (bool, error) {
	var st unix.Stat_t
	if err := unix.Fstat(int(c.f.Fd()), &st); err != nil {
		return false, &os.PathError{Op: "fstat", Path: c.path, Err: err}
	}
	return private(&st), nil
}

// claimHow is what claimAt checks beyond owner and type.
type claimHow struct {
	lock    bool // that no other open file description holds byte 0
	private bool // that only its owner could ever have held it
}

func claimAt(dir *os.File, name, path string, uid int, how claimHow) (*Claim, error) {
	dfd := int(dir.Fd())
	access := unix.O_RDWR
	if how.private {
		access = unix.O_WRONLY // all PrivateMode lets its owner do
	}
	fd, err := unix.Openat(dfd, name, access|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if errors.Is(err, unix.ELOOP) {
		return nil, fmt.Errorf("%w: %s is a symbolic link", ErrNotOwned, path)
	}
	if err != nil {
		// What cannot be opened (a directory, another user's private
		// file) is judged by what it is, not by why open failed.
		var st unix.Stat_t
		if errors.Is(err, unix.ENOENT) || unix.Fstatat(dfd, name, &st, unix.AT_SYMLINK_NOFOLLOW) != nil {
			return nil, &os.PathError{Op: "open", Path: path, Err: err}
		}
		if st.Mode&unix.S_IFMT == unix.S_IFREG && int(st.Uid) == uid {
			if how.private && errors.Is(err, unix.EACCES) && st.Mode&0o7777 != PrivateMode {
				// Its owner may not write it: it is no file of PrivateMode.
				return nil, fmt.Errorf("%w: %s (mode %04o) was not made private", ErrNotPrivate, path, st.Mode&0o7777)
			}
			return nil, &os.PathError{Op: "open", Path: path, Err: err}
		}
		return nil, notOwned(path, &st, uid)
	}
	f := os.NewFile(uintptr(fd), path)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		f.Close()
		return nil, &os.PathError{Op: "fstat", Path: path, Err: err}
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG || int(st.Uid) != uid {
		f.Close()
		return nil, notOwned(path, &st, uid)
	}
	if how.private {
		switch {
		case st.Nlink == 0:
			f.Close()
			return nil, fmt.Errorf("%w: %s", ErrStale, path)
		case !private(&st):
			f.Close()
			return nil, fmt.Errorf("%w: %s (mode %04o, %d bytes) may have been held by others",
				ErrNotPrivate, path, st.Mode&0o7777, st.Size)
		}
	}
	if how.lock {
		return lockClaim(f, dir, name, path)
	}
	return &Claim{f: f, dir: dir, name: name, path: path}, nil
}

func notOwned(path string, st *unix.Stat_t, uid int) error {
	what := "a regular file"
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFDIR:
		what = "a directory"
	case unix.S_IFIFO:
		what = "a FIFO"
	case unix.S_IFSOCK:
		what = "a socket"
	case unix.S_IFCHR, unix.S_IFBLK:
		what = "a device"
	case unix.S_IFLNK:
		what = "a symbolic link"
	}
	return fmt.Errorf("%w: %s is %s with owner uid %d and mode %o; expected a regular file of uid %d",
		ErrNotOwned, path, what, st.Uid, st.Mode&0o7777, uid)
}

// File returns the claimed file, open for reading and writing (for
// writing only, from ClaimPrivate and CreateLocked).
func (c *Claim) File() *os.File { return c.f }

// Remove unlinks the claimed file, if its name in the directory it was
// found in still names it, and drops the claim. The lock is held until
// the file is unlinked, so no holder ever finds it unlocked under its
// name. Whoever may write the directory can still put another file under
// the name between the check and the unlink; what goes then is a name in
// that directory, never one elsewhere.
func (c *Claim) Remove() error {
	defer c.Close()
	var held, now unix.Stat_t
	if err := unix.Fstat(int(c.f.Fd()), &held); err != nil {
		return &os.PathError{Op: "fstat", Path: c.path, Err: err}
	}
	dfd := int(c.dir.Fd())
	if err := unix.Fstatat(dfd, c.name, &now, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		if errors.Is(err, unix.ENOENT) {
			return nil // gone already
		}
		return &os.PathError{Op: "fstatat", Path: c.path, Err: err}
	}
	if now.Dev != held.Dev || now.Ino != held.Ino {
		return fmt.Errorf("ofd: %s was replaced while claimed: left alone", c.path)
	}
	if testHookBeforeUnlink != nil {
		testHookBeforeUnlink()
	}
	if err := unix.Unlinkat(dfd, c.name, 0); err != nil && !errors.Is(err, unix.ENOENT) {
		return &os.PathError{Op: "unlink", Path: c.path, Err: err}
	}
	return nil
}

// Close drops the claim, leaving the file. Idempotent.
func (c *Claim) Close() error {
	c.dir.Close()
	if err := c.f.Close(); err != nil && !errors.Is(err, os.ErrClosed) {
		return err
	}
	return nil
}

// testHookBeforeUnlink, if set, runs in Remove just before the unlink;
// testHookBeforeLock in a claim between the opening and the locking.
var testHookBeforeUnlink, testHookBeforeLock func()

// SetBeforeLock has f run in every claim that locks, between its opening
// (and checking) of the file and its locking, until restore is called:
// for tests of what is built on claims to stop one there. Not for use
// while claims run.
func SetBeforeLock(f func()) (restore func()) {
	old := testHookBeforeLock
	testHookBeforeLock = f
	return func() { testHookBeforeLock = old }
}
