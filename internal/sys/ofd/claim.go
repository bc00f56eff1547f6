package ofd

import (
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// ErrNotOwned means a file is not a regular file of the expected user: it
// is not one of ours to remove, whatever its name says.
var ErrNotOwned = errors.New("ofd: not a regular file of the expected owner")

// A Claim is a file proven to belong to no live holder: opened without
// following links, checked to be a regular file of its expected owner,
// and locked (byte 0, exclusively) by this process, which is what every
// holder of such a file does for as long as it lives. Its holder may then
// remove it without racing a live one.
type Claim struct {
	f    *os.File
	path string
}

// ClaimFile claims the file at path, which must be a regular file owned
// by uid (else ErrNotOwned): it fails with ErrLocked while any other open
// file description holds a lock on byte 0 of it, that is, while the
// process that made it lives.
func ClaimFile(path string, uid int) (*Claim, error) {
	fd, err := unix.Open(path, unix.O_RDWR|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if errors.Is(err, unix.ELOOP) {
		return nil, fmt.Errorf("%w: %s is a symbolic link", ErrNotOwned, path)
	}
	if err != nil {
		// What cannot be opened (a directory, another user's private
		// file) is judged by what it is, not by why open failed.
		var st unix.Stat_t
		if errors.Is(err, unix.ENOENT) || unix.Lstat(path, &st) != nil ||
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
	if err := TryLock(f, 0, true); err != nil {
		f.Close()
		return nil, err
	}
	return &Claim{f: f, path: path}, nil
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

// Remove unlinks the claimed file, if its path still names it, and drops
// the claim. The lock is held until the file is unlinked, so no holder
// ever finds it unlocked under its name.
func (c *Claim) Remove() error {
	defer c.f.Close()
	var held, now unix.Stat_t
	if err := unix.Fstat(int(c.f.Fd()), &held); err != nil {
		return &os.PathError{Op: "fstat", Path: c.path, Err: err}
	}
	if err := unix.Lstat(c.path, &now); err != nil {
		if errors.Is(err, unix.ENOENT) {
			return nil // gone already
		}
		return &os.PathError{Op: "lstat", Path: c.path, Err: err}
	}
	if now.Dev != held.Dev || now.Ino != held.Ino {
		return fmt.Errorf("ofd: %s was replaced while claimed: left alone", c.path)
	}
	if err := os.Remove(c.path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return nil
}

// Close drops the claim, leaving the file. Idempotent.
func (c *Claim) Close() error {
	if err := c.f.Close(); err != nil && !errors.Is(err, os.ErrClosed) {
		return err
	}
	return nil
}
