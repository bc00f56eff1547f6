package secondary_test

import (
	"context"
	"os/exec"
	"runtime"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/secondary"
)

// Yield hands the CPU to a thread of another process that waits for it,
// not only to this process's goroutines: a queue that polls and yields
// between bursts lets the primary's thread, woken on its CPU to answer a
// miss, run at the next burst instead of at the end of the poller's time
// slice. A yield that hands the CPU over is a switch away from the
// caller's thread, which the kernel counts as involuntary. The waiter here
// never sleeps, and the kernel gives it the CPU at a yield only while it
// is owed time: about every other yield, not every one.
func TestYieldGivesTheCPUToAnotherProcessWaitingForIt(t *testing.T) {
	cpu := testenv.NeedCPUs(t, 1)[0]
	var set unix.CPUSet
	set.Set(cpu)

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	spinner := exec.CommandContext(ctx, "/bin/sh", "-c", "while :; do :; done")
	require.NoError(t, spinner.Start())
	defer func() { cancel(); _ = spinner.Wait() }()
	require.NoError(t, unix.SchedSetaffinity(spinner.Process.Pid, &set))

	const yields = 40
	switches := make(chan int64, 1)
	go func() {
		// The thread ends with the goroutine, binding and all.
		runtime.LockOSThread()
		var before, after unix.Rusage
		if err := unix.SchedSetaffinity(0, &set); err != nil {
			t.Error(err)
			switches <- 0
			return
		}
		_ = unix.Getrusage(unix.RUSAGE_THREAD, &before)
		for range yields {
			secondary.Yield()
		}
		_ = unix.Getrusage(unix.RUSAGE_THREAD, &after)
		switches <- after.Nivcsw - before.Nivcsw
	}()
	n := <-switches
	t.Logf("%d yields beside a spinning process on CPU %d: %d switches away", yields, cpu, n)
	assert.GreaterOrEqual(t, n, int64(yields/4), "yields that gave the CPU to the process waiting for it")
}
