package shm

import (
	"errors"
	"fmt"
	"os"
	"sync/atomic"
	"syscall"

	"github.com/mpmr/mpmr/internal/sys/vm"
)

// OpenReadOnly maps the segment file at o.Path for looking only, the way an
// operator's tool inspects an instance without disturbing it: the mapping is
// read-only (a store through it faults) and reserves no hugepages, no
// process-table slot is claimed, and no file is created. Options other than
// Path, LockPath, LockFile, NoLockFile and LayoutTag are ignored.
//
// The header is validated as Attach does, except that a segment that is
// still initializing or already dead is accepted too: the returned Info
// says which state it was in. The lock file (o.LockFile, taken over as
// Attach takes it; else o.LockPath, default Path + ".lock", opened
// read-only) tells live slots from dead ones; when it does not exist, or
// o.NoLockFile says so, no slot is alive.
//
// The Segment reads everything (Procs, Proc, Alive, Root, At, Slice,
// ViewLock, ArenaStats) and writes nothing: the owner's operations fail with
// ErrNotOwner, RWLock fails for want of a slot, and MarkDead does nothing.
// What it reads while other processes write is a snapshot of each word;
// use a LockView's optimistic reads where several words must agree. Close
// unmaps it.
func OpenReadOnly(o Options) (*Segment, Info, error) {
	// Never waiting on a FIFO where a file should be.
	f, err := os.OpenFile(o.Path, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		if o.LockFile != nil {
			o.LockFile.Close()
		}
		return nil, Info{Path: o.Path}, fmt.Errorf("shm: open read-only: %w", err)
	}
	info, err := probeFile(f, o.LayoutTag)
	switch {
	case err == nil, errors.Is(err, ErrDead):
	case errors.Is(err, ErrNotReady) && info.State == stateName(stateInitializing):
	default:
		if o.LockFile != nil {
			o.LockFile.Close()
		}
		f.Close()
		return nil, info, fmt.Errorf("shm: open %s read-only: %w", o.Path, err)
	}
	lockf := o.LockFile
	if lockf == nil && !o.NoLockFile {
		lockf, err = os.OpenFile(o.lockPath(), os.O_RDONLY|syscall.O_NONBLOCK, 0)
		if err != nil && !errors.Is(err, os.ErrNotExist) {
			f.Close()
			return nil, info, fmt.Errorf("shm: open %s read-only: lock file: %w", o.Path, err)
		}
		if err != nil {
			lockf = nil // no lock file: nobody holds a slot
		}
	}
	base, err := vm.MapSharedReadOnly(int(f.Fd()), uintptr(info.MaxSize))
	if err != nil {
		if lockf != nil {
			lockf.Close()
		}
		f.Close()
		return nil, info, fmt.Errorf("shm: open %s read-only: %w", o.Path, err)
	}
	s := &Segment{
		path:     o.Path,
		f:        f,
		lockf:    lockf,
		base:     base,
		mapLen:   uintptr(info.MaxSize),
		hdr:      (*header)(vm.Pointer(base)),
		procs:    procTable(vm.Pointer(base), info.Slots),
		log:      o.logger(),
		readOnly: true,
	}
	s.slot.Store(-1)
	// The header was validated through another mapping; make sure this one
	// shows the same segment before anything trusts it.
	if atomic.LoadUint64(&s.hdr.Magic) != Magic || atomic.LoadUint64(&s.hdr.MaxSize) != info.MaxSize {
		s.unmap()
		return nil, info, fmt.Errorf("shm: open %s read-only: %w: header changed while opening", o.Path, ErrCorrupt)
	}
	return s, info, nil
}

// ReadOnly reports whether the segment was opened with OpenReadOnly.
func (s *Segment) ReadOnly() bool { return s.readOnly }
