package primary_test

import (
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/primary"
)

// b6SmallHugetlbfs mounts a private hugetlbfs limited to pages pages, so
// that hugepages run short without draining the machine's pool.
func b6SmallHugetlbfs(t *testing.T, pages uint64) (dir string, pageSize uint64) {
	t.Helper()
	b := testenv.Hugetlb(t, pages)
	dir = t.TempDir()
	err := unix.Mount("none", dir, "hugetlbfs", 0, fmt.Sprintf("pagesize=%d,size=%d", b.PageSize, pages*b.PageSize))
	if err != nil {
		if testenv.HugetlbRequired() {
			t.Fatalf("mount a size-limited hugetlbfs at %s: %v", dir, err)
		}
		t.Skipf("cannot mount a size-limited hugetlbfs (needs CAP_SYS_ADMIN): %v", err)
	}
	t.Cleanup(func() { unix.Unmount(dir, unix.MNT_DETACH) })
	return dir, b.PageSize
}

// b6FreePages is what the mount at dir can still give.
func b6FreePages(t *testing.T, dir string) uint64 {
	t.Helper()
	var st unix.Statfs_t
	require.NoError(t, unix.Statfs(dir, &st))
	return st.Bavail
}

// README, Robustness: quarantined pages are "never returned to the
// kernel", and "an Alloc that fails for want of them names the processes
// they wait for". On hugetlbfs the pages a stalled secondary holds in
// quarantine keep their hugepages, so when hugepages are short it is the
// quarantine that makes Alloc fail — with ErrNoHugepages ("asked 1 pages
// of 2 MiB, 0 free"), which says nothing of the quarantine or of the
// process it waits for: only the no-free-run error names them. Alloc
// fails cleanly (no SIGBUS from the populated mapping), and succeeds once
// the secondary is gone.
func TestBreaker6AllocShortOfHugepagesHeldInQuarantineNamesTheHolder(t *testing.T) {
	dir, ps := b6SmallHugetlbfs(t, 8)
	p, cfg := startPrimary(t, hugetlb.Backend{Kind: hugetlb.Hugetlbfs}, shortSync, func(c *primary.Config) {
		c.BackendDir, c.PageSize, c.MemoryPages = dir, ps, 16
	})
	r, err := p.Alloc(2 * ps)
	require.NoError(t, err)
	s := startSecondary(t, cfg)
	require.Equal(t, "wrote", ask(t, s, "poke %d 7", r.Addr))
	// Take what the mount has left, so that only the quarantine stands
	// between the next Alloc and a hugepage.
	if free := b6FreePages(t, dir); free > 0 {
		_, err := p.Alloc(free * ps)
		require.NoError(t, err)
	}
	require.Zero(t, b6FreePages(t, dir))
	s.Stop()

	require.NoError(t, p.Free(r), "Free completes without the stalled secondary")
	require.Equal(t, 2, p.Memory().Quarantined(), "the freed pages wait in quarantine, keeping their hugepages")

	_, err = p.Alloc(ps)
	require.Error(t, err, "no hugepage is free: the quarantine holds them")
	assert.ErrorIs(t, err, hugetlb.ErrNoHugepages)
	assert.Contains(t, err.Error(), "quarantine", "the error says the quarantine holds hugepages")
	assert.Contains(t, err.Error(), "pid "+strconv.Itoa(s.PID()), "and names the process they wait for")

	s.Kill()
	require.Error(t, s.Wait(0))
	var got error
	require.Eventually(t, func() bool {
		_, got = p.Alloc(ps)
		return got == nil
	}, 5*time.Second, 5*time.Millisecond, "once the holder is dead its hugepages come back: %v", got)
}
