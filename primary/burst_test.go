package primary_test

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/cache"
	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/primary"
	"github.com/mpmr/mpmr/secondary"
)

func init() { testproc.Register("burst-secondary", helperBurstSecondary) }

// helperBurstSecondary attaches and runs commands, one per line:
//
//	burst ADDR...     -> "n=N keys=K,K,... err=ERR"
//	range ADDR LEN    -> "key K", "split S key K" or "err ERR"
//	wait-dropped      -> "dropped=BOOL" once the primary dropped it (bounded)
func helperBurstSecondary(args []string) int {
	s, err := secondary.Attach(secondary.Config{Prefix: args[0], RuntimeDir: args[1], Logger: quiet})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 3
	}
	defer s.Close()
	q := s.NewQueue()
	testproc.Say("ready")
	in := testproc.Commands()
	for in.Scan() {
		f := strings.Fields(in.Text())
		if len(f) == 0 {
			continue
		}
		nums := make([]uint64, len(f)-1)
		for i := range nums {
			nums[i], _ = strconv.ParseUint(f[i+1], 0, 64)
		}
		switch f[0] {
		case "burst":
			addrs := make([]uintptr, len(nums))
			for i, a := range nums {
				addrs[i] = uintptr(a)
			}
			keys := make([]uint32, len(addrs))
			n, err := q.LookupBurst(addrs, keys)
			ks := make([]string, n)
			for i := range ks {
				ks[i] = strconv.FormatUint(uint64(keys[i]), 10)
			}
			testproc.Say("> n=%d keys=%s err=%v", n, strings.Join(ks, ","), err)
		case "range":
			k, err := q.LookupRange(uintptr(nums[0]), nums[1])
			var se *cache.SplitError
			switch {
			case errors.As(err, &se):
				testproc.Say("> split %d key %d", se.Split, se.Key)
			case err != nil:
				testproc.Say("> err %v", err)
			default:
				testproc.Say("> key %d", k)
			}
		case "wait-dropped":
			select {
			case <-s.PrimaryGone():
			case <-time.After(testproc.DefaultTimeout):
			}
			testproc.Say("> dropped=%t", s.Dropped())
		default:
			testproc.Say("> err unknown command %q", f[0])
		}
	}
	return 0
}

// Burst and whole-buffer lookups give a secondary's queue the answers the
// primary's queue gets, and stop answering once the primary dropped the
// secondary, as Lookup does.
func TestQueueBurstAndRangeLookups(t *testing.T) {
	p, cfg := startPrimary(t, testenv.Tmpfs(t), shortSync, func(c *primary.Config) { c.SinglePage = true })
	ps := p.Backend().PageSize
	r, err := p.Alloc(3 * ps)
	require.NoError(t, err)
	page := func(i uint64) uintptr { return r.Addr + uintptr(i*ps) }
	q := p.NewQueue()
	defer q.Close()
	addrs := []uintptr{page(0), page(0) + 64, page(1) + 5, page(2), page(0) + 9}
	keys := make([]uint32, len(addrs))
	n, err := q.LookupBurst(addrs, keys)
	require.NoError(t, err)
	require.Equal(t, len(addrs), n)
	require.NotEqual(t, keys[0], keys[2], "single-page mode: one MR per page")

	h := testproc.Start(t, "burst-secondary", []string{cfg.Prefix, cfg.RuntimeDir})
	h.Expect("ready", 0)
	var cmd []string
	for _, a := range addrs {
		cmd = append(cmd, strconv.FormatUint(uint64(a), 10))
	}
	want := fmt.Sprintf("n=%d keys=%d,%d,%d,%d,%d err=<nil>", len(addrs), keys[0], keys[1], keys[2], keys[3], keys[4])
	assert.Equal(t, want, ask(t, h, "burst %s", strings.Join(cmd, " ")))

	assert.Equal(t, fmt.Sprintf("key %d", keys[0]), ask(t, h, "range %d %d", page(0)+10, 2176))
	split := page(1) - 100
	assert.Equal(t, fmt.Sprintf("split %d key %d", page(1), keys[0]), ask(t, h, "range %d %d", split, 2176),
		"a buffer over two MRs is split where the first ends")
	k, err := q.LookupRange(split, 2176)
	assert.Equal(t, cache.InvalidKey, k)
	var se *cache.SplitError
	require.ErrorAs(t, err, &se, "the primary's queue says the same")
	assert.Equal(t, page(1), se.Split)

	// Drop the secondary: it is stopped while a free needs its sync.
	h.Stop()
	require.NoError(t, p.Free(hugetlb.Region{Addr: page(2), Len: ps}))
	h.Continue()
	assert.Equal(t, "dropped=true", ask(t, h, "wait-dropped"))
	assert.Equal(t, "n=0 keys= err="+secondary.ErrDropped.Error(), ask(t, h, "burst %d", page(0)),
		"a dropped secondary answers no burst, though its cache still holds the key")
	assert.Equal(t, "err "+secondary.ErrDropped.Error(), ask(t, h, "range %d 64", page(0)))
}
