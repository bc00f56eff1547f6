package shm

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"testing"

	"github.com/mpmr/mpmr/internal/sys/vm"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A closing process holds its slot until its mapping has gone: up to then
// its goroutines may still write the segment, and another process that saw
// the slot dead could take over a lock one of them holds and repair it
// under their writes. Marked free it is at once.
func TestCloseHoldsTheSlotUntilTheMappingHasGone(t *testing.T) {
	newDir := closeOrderDir(t)
	for _, under := range []bool{false, true} {
		owner, other := ownerAndOther(t, newDir())
		slot := other.Slot()
		var hooked, aliveThen, liveThen bool
		var pidThen int
		testHookBeforeUnmap = func(s *Segment) {
			if s == other {
				p := owner.Proc(slot)
				hooked, aliveThen, liveThen, pidThen = true, owner.Alive(slot), p.Live, p.PID
			}
		}
		t.Cleanup(func() { testHookBeforeUnmap = nil })
		if under {
			vacated, err := other.CloseUnderReaders()
			require.NoError(t, err)
			require.True(t, vacated)
		} else {
			require.NoError(t, other.Close())
		}
		require.True(t, hooked)
		assert.True(t, aliveThen, "underReaders=%v: the slot is held while the segment is mapped", under)
		assert.False(t, liveThen, "underReaders=%v: and already marked free", under)
		assert.Equal(t, os.Getpid(), pidThen, "underReaders=%v: tools see whose slot is closing", under)
		assert.False(t, owner.Alive(slot), "underReaders=%v: released once the mapping has gone", under)
		assert.Equal(t, -1, other.Slot())
	}
}

// A mapping that would not go keeps its slot held: this process can still
// write the segment through it, so no other process may see it dead (and
// take over a lock it holds) until it exits. Close says so.
func TestCloseKeepsTheSlotWhenTheMappingStays(t *testing.T) {
	newDir := closeOrderDir(t)
	for _, under := range []bool{false, true} {
		owner, other := ownerAndOther(t, newDir())
		slot := other.Slot()
		injected := errors.New("injected unmap failure")
		unmapSegment = func(uintptr, uintptr) error { return injected }
		vacateSegment = func(uintptr, uintptr) error { return injected }
		t.Cleanup(func() { unmapSegment, vacateSegment = vm.Unmap, vm.Vacate })
		if under {
			vacated, err := other.CloseUnderReaders()
			assert.False(t, vacated, "nothing was vacated")
			assert.ErrorIs(t, err, injected)
		} else {
			assert.ErrorIs(t, other.Close(), injected)
		}
		assert.True(t, owner.Alive(slot), "underReaders=%v: the slot is held while the segment stays mapped", under)
		p := owner.Proc(slot)
		assert.False(t, p.Live, "underReaders=%v: marked free", under)
		assert.Equal(t, os.Getpid(), p.PID, "underReaders=%v: tools still see whose slot it is", under)
		assert.NoError(t, other.Close(), "a second Close does nothing")
		assert.True(t, owner.Alive(slot), "underReaders=%v: and lets nothing go", under)
		// What the process's exit would do.
		unmapSegment, vacateSegment = vm.Unmap, vm.Vacate
		require.NoError(t, vm.Unmap(other.base, other.mapLen))
		other.releaseSlot()
		other.closeFiles()
		assert.False(t, owner.Alive(slot), "underReaders=%v", under)
	}
}

// closeOrderDir returns a function that makes a new segment path in a
// directory on tmpfs, as the other tests' segments are (testenv, which
// finds it, imports this package), skipping t without one.
func closeOrderDir(t *testing.T) func() string {
	dir, err := os.MkdirTemp("/dev/shm", "mpmr-close-order-")
	if err != nil {
		t.Skipf("needs tmpfs at /dev/shm: %v", err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	n := 0
	return func() string {
		n++
		return filepath.Join(dir, fmt.Sprint("segment", n))
	}
}

// ownerAndOther creates a ready segment at path and attaches another
// Segment to it, as a secondary would: the owner looks on while the other
// closes.
func ownerAndOther(t *testing.T, path string) (owner, other *Segment) {
	o := Options{Path: path, LayoutTag: 0x5eed, Slots: 4, Role: RolePrimary, Logger: slog.New(slog.DiscardHandler)}
	owner, err := Create(o)
	require.NoError(t, err)
	t.Cleanup(func() { owner.Close() })
	require.NoError(t, owner.MarkReady())
	o.Role = RoleSecondary
	other, err = Attach(o)
	require.NoError(t, err)
	t.Cleanup(func() { other.Close() })
	return owner, other
}
