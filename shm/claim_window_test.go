package shm_test

import (
	"os"
	"path/filepath"
	"strconv"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/shm"
)

func init() {
	testproc.Register("claim-again", helperClaimAgain)
}

// helperClaimAgain attaches to the two-slot segment args[0] at each
// "attach", saying its slot and epoch, and closes it at each "close".
func helperClaimAgain(args []string) int {
	o := shm.Options{Path: args[0], LayoutTag: testTag, Slots: 2, Role: shm.RoleSecondary, Logger: quiet}
	var s *shm.Segment
	testproc.EachCommand(func(l testproc.Line) {
		switch l.Name {
		case "attach":
			var err error
			if s, err = shm.Attach(o); err != nil {
				testproc.Say("failed %v", err)
				return
			}
			testproc.Say("attached %d %d", s.Slot(), s.Epoch())
		case "close":
			s.Close()
			testproc.Say("closed")
		}
	})
	return 0
}

// A slot's next claim never shows its previous claimant's pid and start
// time beside the new epoch: a process that let the slot go could
// otherwise say hello for the new claim in its own name (the primary
// admits a hello whose slot, epoch, pid and start time match), and get
// the new claimant fenced for what it does. While another process claims
// the slot this one left, every snapshot the owner takes of it names the
// new claimant or nobody.
func TestANewClaimNeverShowsThePreviousClaimant(t *testing.T) {
	dir, err := os.MkdirTemp("/dev/shm", "mpmr-claim-")
	if err != nil {
		t.Skipf("needs tmpfs at /dev/shm: %v", err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	o := shm.Options{Path: filepath.Join(dir, "segment"), LayoutTag: testTag, Slots: 2, Role: shm.RolePrimary, Logger: quiet}
	owner, err := shm.Create(o)
	require.NoError(t, err)
	t.Cleanup(func() { owner.Close() })
	require.NoError(t, owner.MarkReady())
	o.Role = shm.RoleSecondary
	other := testproc.Start(t, "claim-again", []string{o.Path})
	me := os.Getpid()
	start, err := shm.ProcessStart(me)
	require.NoError(t, err)
	stale := 0
	for range 300 {
		x, err := shm.Attach(o)
		require.NoError(t, err)
		require.Equal(t, 1, x.Slot())
		epoch := x.Epoch()
		require.NoError(t, x.Close())
		var stop atomic.Bool
		seen := make(chan int)
		go func() {
			n := 0
			for !stop.Load() {
				if p := owner.Proc(1); p.Epoch == epoch+1 && p.PID == me && p.Start == start {
					n++
				}
			}
			seen <- n
		}()
		other.Send("attach")
		require.Equal(t, "attached 1 "+itoa(epoch+1), other.Expect("attached", 0))
		stop.Store(true)
		stale += <-seen
		other.Send("close")
		other.Expect("closed", 0)
	}
	require.Zero(t, stale, "snapshots of the new claim naming the previous claimant")
}

func itoa(n uint32) string { return strconv.FormatUint(uint64(n), 10) }
