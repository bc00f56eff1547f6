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
// ErrNotOwned): it fails with ErrLocked while any other open
// file description holds a lock on byte 0 of it, that is, while the
// process that made it lives.
func ClaimFile(path string, uid int) (*Claim, error) {
	return claimFile(path, func(dir *os.File, name string) (*Claim, error) {
		return claimAt(dir, name, path, uid, claimHow{lock: true})
	})
}

// ClaimPrivate is ClaimFile for a file made by CreateLocked and never
// shared: a lock on it proves a live maker only if nobody else could ever
// have held it. A regular file of uid that others may open (any group or
// other permission bit: an ACL's mask shows there), that has data, or
// that has another name (a hard link made to something that was shared)
// is no such file, whoever holds it or a lock on it: ErrNotPrivate.
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
// exist, as an empty regular file of mode 0600, and locks byte 0 of it:
// the claim is the lifetime lock ClaimFile and ClaimPrivate look for.
// Remove unlinks it before the lock goes.
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
	fd, err := unix.Openat(int(dir.Fd()), name, unix.O_RDWR|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, &os.PathError{Op: "create", Path: path, Err: err}
	}
	f := os.NewFile(uintptr(fd), path)
	if err := TryLock(f, 0, true); err != nil {
		// Someone opened and locked it between its making and this: it
		// is theirs to remove now.
		f.Close()
		return nil, err
	}
	return &Claim{f: f, dir: dir, name: name, path: path}, nil
}

// claimHow is what claimAt checks beyond owner and type.
type claimHow struct {
	lock    bool // that no other open file description holds byte 0
	private bool // that only its owner could ever have held it
}

func claimAt(dir *os.File, name, path string, uid int, how claimHow) (*Claim, error) {
	dfd := int(dir.Fd())
	fd, err := unix.Openat(dfd, name, unix.O_RDWR|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if errors.Is(err, unix.ELOOP) {
		return nil, fmt.Errorf("%w: %s is a symbolic link", ErrNotOwned, path)
	}
	if err != nil {
		// What cannot be opened (a directory, another user's private
		// file) is judged by what it is, not by why open failed.
		var st unix.Stat_t
		if errors.Is(err, unix.ENOENT) || unix.Fstatat(dfd, name, &st, unix.AT_SYMLINK_NOFOLLOW) != nil ||
			st.Mode&unix.S_IFMT == unix.S_IFREG && int(st.Uid) == uid {
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
	if how.private && (st.Mode&0o077 != 0 || st.Size != 0 || st.Nlink != 1) {
		f.Close()
		return nil, fmt.Errorf("%w: %s (mode %04o, %d bytes, %d names) may have been held by others",
			ErrNotPrivate, path, st.Mode&0o7777, st.Size, st.Nlink)
	}
	if how.lock {
		if err := TryLock(f, 0, true); err != nil {
			f.Close()
			return nil, err
		}
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

// File returns the claimed file, open for reading and writing.
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

// testHookBeforeUnlink, if set, runs in Remove just before the unlink.
var testHookBeforeUnlink func()
