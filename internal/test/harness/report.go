package harness

import (
	"context"
	"errors"
	"os"
	"slices"
	"strings"

	"github.com/mpmr/mpmr/cache"
	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/ipc"
	"github.com/mpmr/mpmr/secondary"
	"github.com/mpmr/mpmr/shm"
	"github.com/mpmr/mpmr/verbs"
)

// ErrorReport is an error as a helper process reports it: its text and the
// names of the sentinel errors it matches (errors.Is), so the test can
// check the kind of an error that happened in another process.
type ErrorReport struct {
	Text string   `json:"text"`
	Is   []string `json:"is,omitempty"`
}

func (e *ErrorReport) Error() string { return e.Text }

// Matches reports whether the error matched the sentinel called name
// (such as "shm.ErrBadMagic").
func (e *ErrorReport) Matches(name string) bool { return e != nil && slices.Contains(e.Is, name) }

// sentinels are the errors reports are classified by.
var sentinels = []struct {
	name string
	err  error
}{
	{"secondary.ErrPrimaryGone", secondary.ErrPrimaryGone},
	{"secondary.ErrNoPrimary", secondary.ErrNoPrimary},
	{"secondary.ErrClosed", secondary.ErrClosed},
	{"secondary.ErrPermission", secondary.ErrPermission},
	{"secondary.ErrDropped", secondary.ErrDropped},
	{"cache.ErrNoMemory", cache.ErrNoMemory},
	{"cache.ErrExternalMemory", cache.ErrExternalMemory},
	{"shm.ErrBadMagic", shm.ErrBadMagic},
	{"shm.ErrVersionMismatch", shm.ErrVersionMismatch},
	{"shm.ErrLayoutMismatch", shm.ErrLayoutMismatch},
	{"shm.ErrNotReady", shm.ErrNotReady},
	{"shm.ErrDead", shm.ErrDead},
	{"shm.ErrCorrupt", shm.ErrCorrupt},
	{"shm.ErrOwnerDied", shm.ErrOwnerDied},
	{"hugetlb.ErrAddressInUse", hugetlb.ErrAddressInUse},
	{"ipc.ErrRefused", ipc.ErrRefused},
	{"ipc.ErrLimit", ipc.ErrLimit},
	{"ipc.ErrPeerGone", ipc.ErrPeerGone},
	{"ipc.ErrClosed", ipc.ErrClosed},
	{"ipc.ErrMalformed", ipc.ErrMalformed},
	{"verbs.ErrInvalidKey", verbs.ErrInvalidKey},
	{"verbs.ErrStaleKey", verbs.ErrStaleKey},
	{"verbs.ErrLocalProtection", verbs.ErrLocalProtection},
	{"verbs.ErrFault", verbs.ErrFault},
	{"os.ErrPermission", os.ErrPermission},
	{"os.ErrNotExist", os.ErrNotExist},
	{"context.DeadlineExceeded", context.DeadlineExceeded},
}

// Report describes err for the test (nil for nil).
func Report(err error) *ErrorReport {
	if err == nil {
		return nil
	}
	r := &ErrorReport{Text: err.Error()}
	for _, s := range sentinels {
		if errors.Is(err, s.err) {
			r.Is = append(r.Is, s.name)
		}
	}
	return r
}

// String lists the matched sentinels after the text.
func (e *ErrorReport) String() string {
	if e == nil {
		return "<nil>"
	}
	return e.Text + " [" + strings.Join(e.Is, " ") + "]"
}
