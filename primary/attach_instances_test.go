package primary_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/primary"
	"github.com/mpmr/mpmr/secondary"
)

func init() { testproc.Register("two-attach", twoAttach) }

// twoAttach (args: PREFIX1 RUNDIR1 PREFIX2 RUNDIR2): on "go", attaches
// to instance 1 on a goroutine (AttachTimeout 4 s), and 300 ms later to
// instance 2 (AttachTimeout 1 s): "> b took=D err=E".
func twoAttach(args []string) int {
	testproc.Say("ready")
	testproc.EachCommand(func(c testproc.Line) {
		if c.Name != "go" {
			return
		}
		go func() {
			s, err := secondary.Attach(secondary.Config{Prefix: args[0], RuntimeDir: args[1], Logger: quiet,
				AttachTimeout: 4 * time.Second})
			if err == nil {
				s.Close()
			}
		}()
		// Let the first attach reach the stopped primary first: the order
		// of the workload, not a synchronisation (in the other order the
		// test shows nothing, and passes).
		time.Sleep(300 * time.Millisecond)
		start := time.Now()
		s, err := secondary.Attach(secondary.Config{Prefix: args[2], RuntimeDir: args[3], Logger: quiet,
			AttachTimeout: time.Second})
		took := time.Since(start).Round(10 * time.Millisecond)
		if err == nil {
			s.Close()
		}
		testproc.Say("> b took=%v err=%v", took, err)
	})
	return 0
}

// An attach to one instance whose primary does not answer (stopped) does
// not hold up an attach of the same process to another instance: that one,
// with a shorter AttachTimeout, starting while the first waits, succeeds.
func TestAnAttachStuckOnOneInstanceDoesNotHoldUpAnother(t *testing.T) {
	cfg1 := primary.Config{Prefix: testenv.Prefix(t), RuntimeDir: testenv.RunDir(t), Backend: testenv.Tmpfs(t).Kind}
	p1, _, _ := startPrimaryProcess(t, cfg1)
	_, cfg2 := startPrimary(t, testenv.Tmpfs(t))

	h := testproc.Start(t, "two-attach", []string{cfg1.Prefix, cfg1.RuntimeDir, cfg2.Prefix, cfg2.RuntimeDir})
	h.Expect("ready", 0)
	p1.Stop()
	t.Cleanup(func() { p1.Continue(); p1.Kill() })

	h.Send("go")
	got := h.Expect("> ", 15*time.Second)
	require.Contains(t, got, "err=<nil>", "the attach to the instance that answers")
}
