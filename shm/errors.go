package shm

import "errors"

// Header validation errors, returned (wrapped) by Attach and Probe.
var (
	ErrBadMagic        = errors.New("shm: not an mpmr segment (bad magic)")
	ErrVersionMismatch = errors.New("shm: segment ABI version mismatch")
	ErrLayoutMismatch  = errors.New("shm: segment layout mismatch")
	ErrNotReady        = errors.New("shm: segment is still being initialized")
	ErrDead            = errors.New("shm: segment belongs to an instance that has ended")
	ErrTruncated       = errors.New("shm: segment file is truncated")
	ErrCorrupt         = errors.New("shm: segment header is inconsistent")
)

// Errors of the segment's own operations.
var (
	ErrExists     = errors.New("shm: segment file already exists")
	ErrClosed     = errors.New("shm: segment is closed")
	ErrNotOwner   = errors.New("shm: only the creating process may do this")
	ErrArenaFull  = errors.New("shm: segment arena is full")
	ErrBadBlock   = errors.New("shm: not an allocated arena block")
	ErrNoSlot     = errors.New("shm: process table is full")
	ErrBadOffset  = errors.New("shm: offset outside the segment")
	ErrTooManyLks = errors.New("shm: no room to register another lock")
)

// Lock errors.
var (
	// ErrOwnerDied is returned by Lock together with the lock: the previous
	// writer died holding it, so the protected state may be half-updated.
	// Repair it, call MarkConsistent, then Unlock. RLock returns it (without
	// the lock) when the writer is dead and nobody has taken over yet.
	ErrOwnerDied = errors.New("shm: lock owner died")
	// ErrNotRecoverable means a writer that got ErrOwnerDied unlocked without
	// marking the state consistent: the lock can no longer be taken.
	ErrNotRecoverable = errors.New("shm: lock state not recoverable")
	// ErrFenced is returned by RUnlock when a writer stopped waiting for
	// this process's read holds (it kept them past the fence time) and went
	// ahead: what was read under the hold may be torn and must be thrown
	// away.
	ErrFenced = errors.New("shm: read hold fenced by a writer")
)
