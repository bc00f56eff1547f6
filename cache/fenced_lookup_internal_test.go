package cache

import (
	"os"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/internal/test/testenv"
)

// A secondary that stops inside a lookup, after it found itself not
// fenced, may resume fenced: it no longer follows memory changes, and
// Lookup promises such a process ErrFenced, not the table's keys, whether
// the read went without the lock or under it (an overflowed table).
func TestALookupFencedWhileStoppedTakesNoKeyFromTheTable(t *testing.T) {
	for _, overflowed := range []bool{false, true} {
		name := "optimistic"
		if overflowed {
			name = "under the lock"
		}
		t.Run(name, func(t *testing.T) {
			p := newPrimary(t, fixtureConfig{pages: 16, single: true, tableSize: 4})
			view := p.attachView(t)
			r := p.alloc(t, 1)
			old, err := p.g.Create(uint64(r.Addr))
			require.NoError(t, err)
			if overflowed {
				p.g.noExpand = true
				for range 4 { // one page each: more MRs than the table holds
					_, err := p.g.Create(uint64(p.alloc(t, 1).Addr))
					require.NoError(t, err)
				}
				tbl, err := p.g.table()
				require.NoError(t, err)
				require.True(t, tbl.Overflowed())
			}
			e, found, err := view.Lookup(uint64(r.Addr))
			require.NoError(t, err)
			require.True(t, found)
			require.Equal(t, old.LKey, e.LKey)

			hook := func() {
				lookupEntered.Store(nil)
				// While it is stopped, the primary drops it.
				vs := view.seg
				pid := os.Getpid()
				require.True(t, p.seg.Fence(vs.Slot(), vs.Epoch(), pid, testenv.ProcessStart(t, pid)))
			}
			lookupEntered.Store(&hook)
			t.Cleanup(func() { lookupEntered.Store(nil) })

			e, found, err = view.Lookup(uint64(r.Addr))
			assert.ErrorIs(t, err, ErrFenced)
			assert.False(t, found, "answered %+v from the table", e)
			_, _, err = view.Lookup(uint64(r.Addr))
			assert.ErrorIs(t, err, ErrFenced, "and every lookup after")
		})
	}
}
