package primary_test

import (
	"fmt"
	"slices"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/internal/instance"
	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/secondary"
	"github.com/mpmr/mpmr/shm"
)

func init() { testproc.Register("left-secondary", helperLeftSecondary) }

// helperLeftSecondary is a secondary process (args: PREFIX RUNDIR [UID]) driven by
// commands:
//
//	nodump        -> "> ok"
//	attach        -> "> attached slot=N epoch=E" or "> attach-failed ERR"
//	create ADDR   -> "> key K" / "> err ..."
//	close         -> "> closed ERR"
//	attach-bg     -> starts an Attach: "> started"
//	attach-bg-wait-> "> attached slot=N epoch=E" / "> attach-failed ERR"
func helperLeftSecondary(args []string) int {
	if len(args) > 2 && args[2] != "" {
		uid, _ := strconv.Atoi(args[2])
		if err := testenv.BecomeUser(uid); err != nil {
			testproc.Say("become-failed %v", err)
			return 3
		}
	}
	cfg := secondary.Config{Prefix: args[0], RuntimeDir: args[1], Logger: quiet,
		AttachTimeout: 10 * time.Second, RequestTimeout: 300 * time.Millisecond}
	var s *secondary.Secondary
	var again chan string
	var next *secondary.Secondary
	testproc.Say("ready pid=%d", syscall.Getpid())
	testproc.EachCommand(func(c testproc.Line) {
		switch c.Name {
		case "nodump":
			if err := b10Prctl(syscall.PR_SET_DUMPABLE, 0); err != nil {
				testproc.Say("> err %v", err)
			} else {
				testproc.Say("> ok")
			}
		case "attach":
			var err error
			if s, err = secondary.Attach(cfg); err != nil {
				testproc.Say("> attach-failed %v", err)
				return
			}
			testproc.Say("> attached slot=%d epoch=%d", s.Slot(), s.Segment().Epoch())
		case "create":
			r, err := s.CreateMR(c.Num(0))
			if err != nil {
				testproc.Say("> err %v", err)
				return
			}
			testproc.Say("> key %d", r.LKey)
		case "close":
			testproc.Say("> closed %v", s.Close())
		case "attach-bg":
			again = make(chan string, 1)
			go func() {
				n, err := secondary.Attach(cfg)
				if err != nil {
					again <- fmt.Sprintf("attach-failed %v", err)
					return
				}
				next = n
				again <- fmt.Sprintf("attached slot=%d epoch=%d", n.Slot(), n.Segment().Epoch())
			}()
			testproc.Say("> started")
		case "attach-bg-wait":
			ans := <-again
			s = next
			testproc.Say("> %s", ans)
		default:
			testproc.Say("> err unknown command %q", c.Name)
		}
	})
	return 0
}

// A secondary of the primary's user that made itself undumpable (so the
// kernel will not describe it to the primary) attaches; its primary is
// stopped; it closes, its detach unanswered within RequestTimeout, and
// attaches again while the primary is stopped, with the slot number of
// its old claim. The primary resumes: the old claim is judged on the
// process's word (its hello names it as left), since its slot's words
// are the new claim's by then, and what the primary frees does not wait
// in quarantine for the healthy process.
func TestUndumpableReattachIsNotFenced(t *testing.T) {
	requireRoot(t)
	env := userEnv(sharedTmp(t))
	uid := strconv.Itoa(victimUID)
	b := b10StartAs(t, uid, env)
	addr, _ := b.alloc(1)
	s := testproc.Start(t, "left-secondary", []string{b.cfg.Prefix, b.cfg.RuntimeDir, uid}, env...)
	s.Expect("ready", 0)
	require.Equal(t, "ok", ask(t, s, "nodump"))
	first := ask(t, s, "attach")
	require.Contains(t, first, "attached", first)
	require.Contains(t, ask(t, s, "create %d", addr), "key")

	b.h.Stop()
	require.Equal(t, "closed <nil>", ask(t, s, "close")) // its detach times out
	require.Equal(t, "started", ask(t, s, "attach-bg"))
	// Resumed once the new attachment holds its claim (its hello waits).
	var slot int
	var epoch uint32
	_, err := fmt.Sscanf(first, "attached slot=%d epoch=%d", &slot, &epoch)
	require.NoError(t, err, first)
	ro, _, err := shm.OpenReadOnly(shm.Options{Path: b.seg, LayoutTag: instance.LayoutTag})
	require.NoError(t, err)
	defer ro.Close()
	deadline := time.Now().Add(testproc.DefaultTimeout) // a hang guard
	for !slices.ContainsFunc(ro.Procs(), func(pr shm.Proc) bool {
		return pr.Live && pr.PID == s.PID() && pr.Role == shm.RoleSecondary && pr.Epoch != epoch
	}) {
		require.True(t, time.Now().Before(deadline), "the new attachment claimed no slot")
	}
	b.h.Continue()
	second := ask(t, s, "attach-bg-wait")
	require.Contains(t, second, "attached", second)
	t.Logf("first %s, then %s", first, second)

	// The old attachment leaves the primary's count once it is judged:
	// only then is the quarantine below final.
	waitSecondaries(t, b, 1)
	a, l := b.alloc(1)
	require.Equal(t, "ok", b.must("free %d %d", a, l))
	q, _ := b.quarantined()
	require.Zero(t, q, "freed pages wait in quarantine for a healthy process, fenced for an attachment that detached")
}
