package primary_test

import (
	"bytes"
	"fmt"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/cache"
	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/primary"
	"github.com/mpmr/mpmr/shm"
	"github.com/mpmr/mpmr/verbs"
)

// shortSync makes a stalled secondary cost its tests little time.
func shortSync(c *primary.Config) { c.SyncTimeout = 200 * time.Millisecond }

// steadySync is shortSync for tests whose following secondaries must
// answer every sync in time, which on a busy machine 200 ms may not
// leave them: a stalled secondary still costs a second only.
func steadySync(c *primary.Config) { c.SyncTimeout = time.Second }

// filePages returns how many pages of pageSize the file at path holds: on
// hugetlbfs, the hugepages it takes from the pool.
func filePages(t *testing.T, path string, pageSize uint64) uint64 {
	t.Helper()
	var st syscall.Stat_t
	require.NoError(t, syscall.Stat(path, &st))
	return uint64(st.Blocks) * 512 / pageSize
}

// A secondary stopped inside the global read lock, which also cannot follow
// the free's sync: Free fences its read hold and drops it, completes, and
// no process gets a key for the freed memory afterwards. When it resumes it
// learns both.
func TestFreeWithSecondaryStoppedInReadSection(t *testing.T) {
	testenv.ForEachBackend(t, 8, func(t *testing.T, b hugetlb.Backend) {
		p, cfg := startPrimary(t, b, shortSync)
		ps := p.Backend().PageSize
		r, err := p.Alloc(2 * ps)
		require.NoError(t, err)
		q := p.NewQueue()
		key, err := q.Lookup(r.Addr)
		require.NoError(t, err)
		s := startSecondary(t, cfg)
		require.Equal(t, key, parseKey(t, ask(t, s, "lookup %d", r.Addr)))
		require.Equal(t, "in", ask(t, s, "shared"))
		s.Stop()

		require.NoError(t, p.Free(r), "Free completes although a secondary stalls holding the read lock")
		_, err = q.Lookup(r.Addr)
		assert.ErrorIs(t, err, cache.ErrNoMemory, "the primary's queue gets no key for freed memory")
		_, found, err := p.Global().Lookup(uint64(r.Addr))
		require.NoError(t, err)
		assert.False(t, found, "nor does the global table")
		assert.ErrorIs(t, p.Device().Validate(verbs.SGE{Addr: r.Addr, Len: 1, Key: key}, verbs.AccessLocalWrite),
			verbs.ErrInvalidKey, "the old key is deregistered")
		assert.Equal(t, uint64(1), p.Global().LockState().Fences, "the stalled read hold was fenced")
		assert.Equal(t, uint64(1), p.Stats().Counters.SyncDrops, "the stalled secondary was dropped")

		s.Continue()
		assert.Contains(t, ask(t, s, "leave"), shm.ErrFenced.Error(), "its read section is reported cut short")
		assert.Equal(t, "dropped=true", ask(t, s, "wait-dropped"))
		assert.Contains(t, ask(t, s, "lookup %d", r.Addr), "dropped this secondary", "it serves no key any more")
		assert.Contains(t, ask(t, s, "validate %d %d", r.Addr, key), "err", "and the device refuses the old key")
		assert.Equal(t, "fault", ask(t, s, "peek %d", r.Addr), "its data memory is unmapped")
		assert.Equal(t, "closed", ask(t, s, "close"))
		require.Eventually(t, func() bool { return p.Memory().Quarantined() == 0 }, 5*time.Second, time.Millisecond,
			"the quarantine ends once the dropped secondary unmapped its memory")
	})
}

// A secondary stopped while a free waits for its sync keeps the freed pages
// mapped: they stay in quarantine, away from Alloc and from the kernel,
// until it has unmapped them (it resumes and learns it was dropped) or it
// dies. No process ever sees another allocation's bytes.
func TestFreeWithSecondaryStoppedDuringSync(t *testing.T) {
	for _, ending := range []string{"resumes", "dies"} {
		t.Run(ending, func(t *testing.T) {
			testenv.ForEachBackend(t, 8, func(t *testing.T, b hugetlb.Backend) {
				p, cfg := startPrimary(t, b, shortSync)
				ps := p.Backend().PageSize
				file := p.Memory().Lists()[0].File
				start := filePages(t, file, ps)
				r, err := p.Alloc(2 * ps)
				require.NoError(t, err)
				s := startSecondary(t, cfg)
				require.Equal(t, "wrote", ask(t, s, "poke %d 7", r.Addr))
				s.Stop()

				require.NoError(t, p.Free(r), "Free completes without the stalled secondary")
				assert.Equal(t, uint64(1), p.Stats().Counters.SyncDrops)
				assert.Equal(t, 2, p.Memory().Quarantined(), "the freed pages wait in quarantine")
				assert.Equal(t, start+2, filePages(t, file, ps), "and keep their hugepages")

				r2, err := p.Alloc(2 * ps)
				require.NoError(t, err)
				assert.False(t, r2.Addr < r.End() && r.Addr < r2.End(), "Alloc does not hand out quarantined pages")
				assert.Equal(t, make([]byte, r2.Len), r2.Bytes(), "a new allocation reads as zeros")

				if ending == "dies" {
					s.Kill()
					require.Error(t, s.Wait(0))
				} else {
					s.Continue()
					// Whether the write lands in its old (quarantined)
					// page or faults depends on whether it has applied
					// the unmap yet; either way nobody else sees it.
					assert.Contains(t, []string{"wrote", "fault"}, ask(t, s, "poke %d 9", r.Addr))
					assert.Equal(t, "dropped=true", ask(t, s, "wait-dropped"))
					assert.Equal(t, "fault", ask(t, s, "peek %d", r.Addr), "a dropped secondary maps no data memory")
					assert.Contains(t, ask(t, s, "create %d", r2.Addr), "dropped this secondary")
				}
				assert.Equal(t, make([]byte, r2.Len), r2.Bytes(), "the stalled secondary's writes reach no new allocation")
				copy(r2.Bytes(), bytes.Repeat([]byte{0xab}, int(r2.Len)))
				if ending == "resumes" {
					assert.Equal(t, "fault", ask(t, s, "peek %d", r2.Addr), "nor does the primary's new data reach it")
				}

				require.Eventually(t, func() bool { return p.Memory().Quarantined() == 0 }, 5*time.Second, time.Millisecond,
					"the quarantine ends once the dropped secondary is gone")
				assert.Equal(t, start+2, filePages(t, file, ps), "its pages went back: only the new allocation holds any")
				require.NoError(t, p.Free(r2))
				assert.Equal(t, start, filePages(t, file, ps), "every hugepage is back")
				if ending == "resumes" {
					assert.Equal(t, "closed", ask(t, s, "close"))
				}
			})
		})
	}
}

// Stats tells selective flushes from full ones, in this process's counters
// and in what the stats request carries.
func TestStatsCountSelectiveFlushes(t *testing.T) {
	for _, full := range []bool{false, true} {
		t.Run(fmt.Sprintf("full=%t", full), func(t *testing.T) {
			p, _ := startPrimary(t, testenv.Tmpfs(t), func(c *primary.Config) { c.SinglePage, c.FullFlush = true, full })
			ps := p.Backend().PageSize
			keep, err := p.Alloc(ps)
			require.NoError(t, err)
			gone, err := p.Alloc(ps)
			require.NoError(t, err)
			q := p.NewQueue()
			for _, a := range []uintptr{keep.Addr, gone.Addr} {
				_, err := q.Lookup(a)
				require.NoError(t, err)
			}
			require.NoError(t, p.Free(gone))
			_, err = q.Lookup(keep.Addr)
			require.NoError(t, err)
			q.Publish()
			c := p.Stats().Counters
			assert.Equal(t, uint64(1), c.Flushes)
			if full {
				assert.Zero(t, c.SelectiveFlushes)
				assert.Equal(t, uint64(4), c.FullDropped, "both entries, in both halves")
			} else {
				assert.Equal(t, uint64(1), c.SelectiveFlushes)
				assert.Equal(t, uint64(2), c.SelectiveDropped, "the freed page's entry, in both halves")
				assert.Zero(t, c.FullDropped)
			}
			m := c.Map()
			assert.Equal(t, c.SelectiveFlushes, m["selective_flushes"])
			assert.Equal(t, c.SelectiveDropped, m["selective_flush_dropped"])
		})
	}
}

// A secondary that closes (unmaps, detaches) and lives on is not fenced:
// the kernel shows it reaching no data memory, and what the primary frees
// afterwards goes straight back.
func TestCleanDetachIsNotFenced(t *testing.T) {
	p, r := detachedCleanly(t)
	require.NoError(t, p.Free(r))
	assert.Zero(t, p.Stats().Counters.Fenced, "a secondary that closed cleanly and lives on is fenced")
	assert.Zero(t, p.Memory().Quarantined(), "a free after a clean detach waits in quarantine")
}

// A detaching secondary the kernel is slow to describe (it can hold a
// great many files open) is not waited for: it is fenced, and the
// questions Housekeep asks later, with no hurry, end the fence.
func TestDetachOfAProcessTooSlowToDescribeIsFenced(t *testing.T) {
	t.Cleanup(primary.SetDetachAsk(-time.Nanosecond)) // after the primary's Close
	// Housekeeping would ask too, whenever its turn came: here only the
	// test asks, so that the fence is still there for the free.
	t.Cleanup(primary.SetHousekeepEvery(time.Hour))
	p, r := detachedCleanly(t)
	assert.Equal(t, uint64(1), p.Stats().Counters.Fenced)
	require.NoError(t, p.Free(r))
	assert.Equal(t, 1, p.Memory().Quarantined(), "the free waits for the process's description")
	assert.Equal(t, 1, p.Memory().ReleaseQuarantine(), "which says it reaches nothing")
	assert.Empty(t, p.Segment().Holders())
}

// detachedCleanly starts a primary and a secondary that looks up a page
// r of it, then closes (unmaps, detaches) and lives on; it returns once
// the primary has let the secondary go.
func detachedCleanly(t *testing.T) (*primary.Primary, hugetlb.Region) {
	t.Helper()
	p, cfg := startPrimary(t, testenv.Tmpfs(t))
	r, err := p.Alloc(p.Backend().PageSize)
	require.NoError(t, err)
	s := startSecondary(t, cfg)
	parseKey(t, ask(t, s, "lookup %d", r.Addr))
	require.Equal(t, "closed", ask(t, s, "close"))
	require.Eventually(t, func() bool { return p.Stats().Counters.Secondaries == 0 }, 5*time.Second, time.Millisecond,
		"the secondary has left")
	return p, r
}
