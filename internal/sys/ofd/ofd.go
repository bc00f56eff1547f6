// Package ofd wraps open-file-description byte-range locks (F_OFD_SETLK).
//
// An OFD lock belongs to the open file description, not to a process id: the
// kernel drops it when the last descriptor for that description is closed,
// which for a process that dies means at its death. A lock held on a byte for
// a process's lifetime is therefore a liveness signal that pid reuse cannot
// fake. Two descriptions opened by the same process conflict with each other
// like those of different processes.
package ofd

import (
	"errors"
	"fmt"
	"io"
	"os"

	"golang.org/x/sys/unix"
)

// ErrLocked means another open file description holds a conflicting lock.
var ErrLocked = errors.New("ofd: byte is locked by another holder")

// TryLock takes a lock on byte off of f without waiting: exclusive (write)
// or shared (read). It fails with ErrLocked when a conflicting lock is held.
func TryLock(f *os.File, off int64, exclusive bool) error {
	typ := int16(unix.F_RDLCK)
	if exclusive {
		typ = unix.F_WRLCK
	}
	lk := unix.Flock_t{Type: typ, Whence: io.SeekStart, Start: off, Len: 1}
	err := flock(f, unix.F_OFD_SETLK, &lk)
	if errors.Is(err, unix.EAGAIN) || errors.Is(err, unix.EACCES) {
		return fmt.Errorf("%w: %s byte %d", ErrLocked, f.Name(), off)
	}
	if err != nil {
		return fmt.Errorf("ofd: lock %s byte %d: %w", f.Name(), off, err)
	}
	return nil
}

// Unlock drops this description's lock on byte off of f.
func Unlock(f *os.File, off int64) error {
	lk := unix.Flock_t{Type: unix.F_UNLCK, Whence: io.SeekStart, Start: off, Len: 1}
	if err := flock(f, unix.F_OFD_SETLK, &lk); err != nil {
		return fmt.Errorf("ofd: unlock %s byte %d: %w", f.Name(), off, err)
	}
	return nil
}

// Held reports whether an open file description other than f's holds any
// lock on byte off.
func Held(f *os.File, off int64) (bool, error) {
	lk := unix.Flock_t{Type: unix.F_WRLCK, Whence: io.SeekStart, Start: off, Len: 1}
	if err := flock(f, unix.F_OFD_GETLK, &lk); err != nil {
		return false, fmt.Errorf("ofd: query %s byte %d: %w", f.Name(), off, err)
	}
	return lk.Type != unix.F_UNLCK, nil
}

func flock(f *os.File, cmd int, lk *unix.Flock_t) error {
	for {
		err := unix.FcntlFlock(f.Fd(), cmd, lk)
		if err != unix.EINTR {
			return err
		}
	}
}
