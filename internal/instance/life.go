package instance

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/mpmr/mpmr/internal/sys/ofd"
)

// LifePath is the life file of the instance called name in a backend
// directory. The instance's primary holds it locked on byte 0 for its
// lifetime (see TakeLife): of mode ofd.PrivateMode (0200), handed to
// nobody, so that only the instance's user (and root) may open it, and a
// lock on it is a live primary's. The segment and the backing files prove nothing of the
// kind: the users the primary lets in hold them open, and may lock them.
func LifePath(backendDir, name string) string {
	return filepath.Join(backendDir, "mpmr."+name+".live")
}

// TakeLife takes the life file of the instance called name, of user uid
// (this process's), in backendDir: it claims the file if it is there and
// nobody holds it, makes it (locked) if it is not, and removes what is at
// its name if that is a file of uid but no life file (ofd.ErrNotPrivate:
// a file that others could have held, such as a hard link to the segment
// or to a backing file; removed, if not nil, is told its path). While the
// claim is held no primary of the instance lives or starts there, so its
// files there may be removed whoever holds them. It fails with
// ofd.ErrLocked while a live process holds the life file, and with
// ofd.ErrNotOwned when another user's file, or no regular file, is at its
// name.
func TakeLife(backendDir, name string, uid int, removed func(path string)) (*ofd.Claim, error) {
	return takeLife(backendDir, name, uid, true, removed)
}

// ClaimLife is TakeLife for a process that is no primary of the instance
// (mpmr clean, which may run as root): it makes no life file, and returns
// nil and no error when there is none (or no backendDir).
func ClaimLife(backendDir, name string, uid int, removed func(path string)) (*ofd.Claim, error) {
	return takeLife(backendDir, name, uid, false, removed)
}

func takeLife(backendDir, name string, uid int, make bool, removed func(string)) (*ofd.Claim, error) {
	path := LifePath(backendDir, name)
	for range 16 {
		c, err := ofd.ClaimPrivate(path, uid)
		switch {
		case errors.Is(err, os.ErrNotExist) && !make:
			return nil, nil
		case errors.Is(err, os.ErrNotExist):
			c, err = ofd.CreateLocked(path)
			if errors.Is(err, os.ErrExist) || errors.Is(err, ofd.ErrStale) {
				continue // made, or claimed and removed, meanwhile: look again
			}
			return c, err
		case errors.Is(err, ofd.ErrStale):
			continue // removed by its claimant before this claim locked it
		case errors.Is(err, ofd.ErrNotPrivate):
			// Removed only if what is at the name now is still such a
			// file: a life file made there meanwhile stays.
			bad, err := ofd.ClaimEnded(path, uid)
			if errors.Is(err, os.ErrNotExist) {
				continue
			}
			if err != nil {
				return nil, err
			}
			ok, err := bad.Private()
			if err == nil && !ok {
				if err = bad.Remove(); err == nil && removed != nil {
					removed(path)
				}
			} else {
				bad.Close()
			}
			if err != nil {
				return nil, err
			}
			continue
		}
		return c, err
	}
	return nil, fmt.Errorf("instance: %s keeps changing under this process; not taken", path)
}
