package shm

import (
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A closing process holds its slot until its mapping has gone: up to then
// its goroutines may still write the segment, and another process that saw
// the slot dead could take over a lock one of them holds and repair it
// under their writes. Marked free it is at once.
func TestCloseHoldsTheSlotUntilTheMappingHasGone(t *testing.T) {
	// On tmpfs, as the other tests' segments (testenv, which finds it,
	// imports this package).
	dir, err := os.MkdirTemp("/dev/shm", "mpmr-close-order-")
	if err != nil {
		t.Skipf("needs tmpfs at /dev/shm: %v", err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	for i, under := range []bool{false, true} {
		o := Options{Path: filepath.Join(dir, fmt.Sprint("segment", i)), LayoutTag: 0x5eed, Slots: 4,
			Role: RolePrimary, Logger: slog.New(slog.DiscardHandler)}
		owner, err := Create(o)
		require.NoError(t, err)
		t.Cleanup(func() { owner.Close() })
		require.NoError(t, owner.MarkReady())
		o.Role = RoleSecondary
		other, err := Attach(o)
		require.NoError(t, err)
		slot := other.Slot()
		var hooked, aliveThen, liveThen bool
		testHookBeforeUnmap = func(s *Segment) {
			if s == other {
				hooked, aliveThen, liveThen = true, owner.Alive(slot), owner.Proc(slot).Live
			}
		}
		t.Cleanup(func() { testHookBeforeUnmap = nil })
		if under {
			other.CloseUnderReaders()
		} else {
			require.NoError(t, other.Close())
		}
		require.True(t, hooked)
		assert.True(t, aliveThen, "underReaders=%v: the slot is held while the segment is mapped", under)
		assert.False(t, liveThen, "underReaders=%v: and already marked free", under)
		assert.False(t, owner.Alive(slot), "underReaders=%v: released once the mapping has gone", under)
		assert.Equal(t, -1, other.Slot())
	}
}
