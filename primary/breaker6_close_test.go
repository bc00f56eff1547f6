package primary_test

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/secondary"
)

func init() {
	// b6-closerace PREFIX RUNDIR ROUNDS GOROUTINES ADDR: ROUNDS times,
	// attach, have GOROUTINES goroutines ask the primary for the MR at
	// ADDR over and over, and close the secondary under them once each
	// has had an answer. "done" at the end.
	testproc.Register("b6-closerace", b6CloseRace)
}

func b6CloseRace(args []string) int {
	rounds, _ := strconv.Atoi(args[2])
	goroutines, _ := strconv.Atoi(args[3])
	addr, _ := strconv.ParseUint(args[4], 0, 64)
	testproc.Say("ready")
	for range rounds {
		s, err := secondary.Attach(secondary.Config{Prefix: args[0], RuntimeDir: args[1], Logger: quiet})
		if err != nil {
			testproc.Say("attach-failed %v", err)
			return 3
		}
		var wg sync.WaitGroup
		answered := make(chan struct{}, goroutines)
		for range goroutines {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := 0; ; i++ {
					_, err := s.CreateMR(addr)
					if i == 0 {
						answered <- struct{}{}
					}
					if err != nil {
						if !errors.Is(err, secondary.ErrClosed) && !errors.Is(err, secondary.ErrPrimaryGone) {
							fmt.Fprintln(os.Stderr, "unexpected error:", err)
						}
						return
					}
				}
			}()
		}
		for range goroutines {
			<-answered
		}
		if err := s.Close(); err != nil {
			testproc.Say("close-failed %v", err)
			return 4
		}
		wg.Wait()
	}
	testproc.Say("done")
	return 0
}

// Secondary "is safe for concurrent use", and a request that meets Close
// is meant to fail (ErrClosed, or ErrPrimaryGone once the connection is
// closed). But Close does not wait for requests in flight: it closes the
// client, then unmaps the data memory and the control segment, while the
// goroutines whose calls the closed client just failed go on into
// requestError, which reads the process table (s.seg.Fenced()) through
// the mapping Close has just removed: SIGSEGV in shm.(*Segment).Fenced,
// and the whole process dies. (call's own check after an answer,
// `if s.seg.Fenced()`, and its isGone branch read it the same way.)
func TestBreaker6CloseDuringInFlightRequestsDoesNotCrash(t *testing.T) {
	p, cfg := startPrimary(t, testenv.Tmpfs(t))
	r, err := p.Alloc(p.Backend().PageSize)
	require.NoError(t, err)
	h := testproc.Start(t, "b6-closerace", []string{cfg.Prefix, cfg.RuntimeDir, "300", "8", fmt.Sprint(r.Addr)})
	h.Expect("ready", 0)
	_, err = h.Next("done", 0)
	werr := h.Wait(0)
	assert.NoError(t, err, "the helper closes its secondary 300 times under in-flight requests")
	assert.NoError(t, werr, "and exits cleanly (not killed by SIGSEGV: see its stderr)")
}
