package verbs

import (
	"errors"
	"fmt"
)

// Errors of device, PD and MR operations, returned wrapped with what
// failed; test with errors.Is.
var (
	// ErrBadRange: a zero length, an address range that wraps around, or
	// (DeregMR) a range that does not match the MR.
	ErrBadRange = errors.New("verbs: bad address range")
	// ErrBadAccess: unknown access bits, or remote write without local
	// write (which verbs refuses too).
	ErrBadAccess = errors.New("verbs: bad access flags")
	// ErrNoResources: the MR table (or the device) is full.
	ErrNoResources = errors.New("verbs: out of resources")
	// ErrPermission: this process may not do this, e.g. register memory
	// with a soft device it did not create.
	ErrPermission = errors.New("verbs: operation not permitted in this process")
	// ErrNotMapped: part of the range is not mapped readable in the
	// calling process. Errors with it also match vm.ErrNotMapped.
	ErrNotMapped = errors.New("verbs: range not mapped readable in this process")
	// ErrClosed: the device or PD was closed.
	ErrClosed = errors.New("verbs: device or protection domain is closed")
	// ErrNoDevice: no device of that name, or no soft device in the
	// segment yet.
	ErrNoDevice = errors.New("verbs: no such device")
	// ErrExists: the segment already has a soft device.
	ErrExists = errors.New("verbs: segment already has a soft device")
	// ErrCorrupt: the soft device's shared state fails validation.
	ErrCorrupt = errors.New("verbs: soft device state in the segment is inconsistent")
)

// Completion errors: what Validate and Copy report, as a device reports a
// failed work request. Validate returns these values themselves (or the
// pre-allocated errors below that wrap them), so a failure allocates
// nothing either.
//
//	failure                                   error (errors.Is)
//	zero length                               ErrLength
//	addr+len wraps around                     ErrLength and ErrBadRange
//	key 0, InvalidKey, outside the table,
//	  or never handed out                     ErrInvalidKey
//	key of a deregistered MR (slot free or
//	  reused)                                 ErrStaleKey and ErrInvalidKey
//	range not inside the key's MR             ErrLocalProtection
//	access not granted by the MR              ErrLocalAccess
//	memory fault during Copy                  ErrFault
var (
	ErrInvalidKey      = errors.New("verbs: invalid key")
	ErrStaleKey        = fmt.Errorf("%w: its MR was deregistered", ErrInvalidKey)
	ErrLocalProtection = errors.New("verbs: local protection error: element outside its MR")
	ErrLocalAccess     = errors.New("verbs: local access error: access not granted by the MR")
	ErrLength          = errors.New("verbs: local length error")
	ErrFault           = errors.New("verbs: memory fault during copy")
)

// multiError is a pre-allocated error that matches several sentinels.
type multiError struct {
	msg  string
	errs []error
}

func (e *multiError) Error() string   { return e.msg }
func (e *multiError) Unwrap() []error { return e.errs }

var (
	errZeroLength = fmt.Errorf("%w: zero-length element", ErrLength)
	errWraps      = &multiError{"verbs: local length error: element addr+len wraps around", []error{ErrLength, ErrBadRange}}
	errDstShort   = fmt.Errorf("%w: copy destination shorter than source", ErrLength)
)
