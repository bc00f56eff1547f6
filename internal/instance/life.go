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
// lifetime (see TakeLife): mode 0600, handed to nobody, so that only the
// instance's user (and root) may open it, and a lock on it is a live
// primary's. The segment and the backing files prove nothing of the
// kind: the users the primary lets in hold them open, and may lock them.
func LifePath(backendDir, name string) string {
	return filepath.Join(backendDir, "mpmr."+name+".live")
}

// TakeLife takes the life file of the instance called name, of user uid,
// in backendDir: it claims the file if it is there and nobody holds it,
// makes it (locked) if it is not, and removes what is at its name if
// that is a file of uid but no life file (ofd.ErrNotPrivate: a file that
// others could have held, such as a hard link to the segment). While the
// claim is held no primary of the instance lives or starts there, so its
// files there may be removed whoever holds them. It fails with
// ofd.ErrLocked while a live process holds the life file, and with
// ofd.ErrNotOwned when another user's file, or no regular file, is at its
// name.
func TakeLife(backendDir, name string, uid int) (*ofd.Claim, error) {
	path := LifePath(backendDir, name)
	for range 16 {
		c, err := ofd.ClaimPrivate(path, uid)
		switch {
		case errors.Is(err, os.ErrNotExist):
			c, err = ofd.CreateLocked(path)
			if errors.Is(err, os.ErrExist) {
				continue // made meanwhile: judge that one
			}
			return c, err
		case errors.Is(err, ofd.ErrNotPrivate):
			bad, err := ofd.ClaimEnded(path, uid)
			if err == nil {
				err = bad.Remove()
			}
			if err != nil && !errors.Is(err, os.ErrNotExist) {
				return nil, err
			}
			continue
		}
		return c, err
	}
	return nil, fmt.Errorf("instance: %s keeps changing under this process; not taken", path)
}
