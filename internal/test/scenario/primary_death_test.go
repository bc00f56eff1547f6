package scenario

import (
	"os"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/test/harness"
	"github.com/mpmr/mpmr/internal/test/testenv"
)

// A primary killed with SIGKILL: its secondaries notice at once (an idle
// one through PrimaryGone, a busy one through its requests in flight),
// creates and misses fail with ErrPrimaryGone without any timeout, cached
// keys keep resolving; a new primary on the same prefix starts cleanly
// over the dead instance's files, and secondaries, new and old, attach to
// it and work. Each trial kills the primary that the previous one started.
func TestPrimaryDeath(t *testing.T) {
	testenv.ForEachBackend(t, 8, func(t *testing.T, b hugetlb.Backend) {
		s := harness.New(t, b)
		segPath := s.SegmentPath()
		trials := harness.Pick(3, 20)
		var notice, busyNotice, createFail, restart harness.Durations
		pp, pr := s.StartPrimaryProcess(4)
		for i := range trials {
			idle, busy := s.StartSecondary(), s.StartSecondary()
			var cached harness.KeyReply
			idle.MustCall("check", harness.Span{Addr: pr.Addr, Len: 64}, &cached)
			miss := pr.Addr + pr.Len + pr.PageSize // in the memseg list, never allocated
			require.NoError(t, idle.Post("await-gone", harness.AwaitArgs{Cached: pr.Addr + 8, Miss: miss}))
			idle.MustAwait("waiting")
			require.NoError(t, busy.Post("hammer", harness.HammerArgs{Goroutines: 4, N: 1 << 30,
				Addr: pr.Addr, Len: pr.Len, Create: true}))
			require.Eventually(t, func() bool {
				var st struct{ Requests uint64 }
				return pp.Call("stats", nil, &st) == nil && st.Requests > 100
			}, hangBound, time.Millisecond, "the busy secondary's requests reach the primary")
			oldSeg := inode(t, segPath)

			killedAt := pp.Kill()
			var ar harness.AwaitResult
			require.NoError(t, idle.Answer(&ar, hangBound), "trial %d: the idle secondary", i)
			notice = append(notice, time.Unix(0, ar.GoneAt).Sub(killedAt))
			assert.True(t, ar.Create.Matches("secondary.ErrPrimaryGone"), "trial %d: create after the death: %s", i, ar.Create)
			assert.True(t, ar.Miss.Matches("secondary.ErrPrimaryGone"), "trial %d: lookup that misses: %s", i, ar.Miss)
			createFail = append(createFail, time.Duration(ar.CreateNs), time.Duration(ar.MissNs))
			assert.Nil(t, ar.Cached, "trial %d: a cached key still resolves", i)
			assert.Equal(t, cached.Key, ar.CachedKey)
			var hr harness.HammerResult
			require.NoError(t, busy.Answer(&hr, hangBound), "trial %d: the busy secondary", i)
			assert.EqualValues(t, 4, hr.Gone, "trial %d: every goroutine of the busy secondary got ErrPrimaryGone", i)
			assert.Zero(t, hr.Failures, "trial %d: %v", i, hr.Problems)
			busyNotice = append(busyNotice, time.Unix(0, hr.GoneAt).Sub(killedAt))

			// A new primary on the prefix (the helper retries while the
			// dead one's socket address is still in use).
			start := time.Now()
			pp, pr = s.StartPrimaryProcess(4)
			restart = append(restart, time.Since(start))
			assert.NotEqual(t, oldSeg, inode(t, segPath), "trial %d: the dead instance's segment was replaced", i)
			fresh := s.StartSecondary()
			fresh.MustCall("check", harness.Span{Addr: pr.Addr, Len: 64}, nil)
			for _, old := range []*harness.Proc{idle, busy} {
				old.MustCall("close", nil, nil)
				old.MustCall("attach", nil, nil)
				old.MustCall("check", harness.Span{Addr: pr.Addr + pr.Len/2, Len: 64}, nil)
				require.NoError(t, old.Close(), "trial %d: an old secondary shuts down cleanly", i)
			}
			require.NoError(t, fresh.Close())
		}
		require.NoError(t, pp.Close(), "the last primary shuts down cleanly")
		t.Logf("death to PrimaryGone in an idle secondary: %v", notice)
		t.Logf("death to ErrPrimaryGone in a secondary with requests in flight: %v", busyNotice)
		t.Logf("a create or missing lookup after the death fails in: %v", createFail)
		t.Logf("a new primary over the dead instance is ready in (process start included): %v", restart)
	})
}

func inode(t testing.TB, path string) uint64 {
	t.Helper()
	fi, err := os.Stat(path)
	require.NoError(t, err)
	return fi.Sys().(*syscall.Stat_t).Ino
}
