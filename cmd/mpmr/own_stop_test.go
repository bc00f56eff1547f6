package main

import (
	"os"
	"os/exec"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// stopSelf stops this whole process (SIGSTOP) for about d: a shell stops
// it and sends SIGCONT as it exits, whatever ends it, while the caller
// waits for the shell.
func stopSelf(t *testing.T, d time.Duration) {
	script := "trap 'kill -CONT $0' EXIT; kill -STOP $0; sleep " + strconv.FormatFloat(d.Seconds(), 'f', 3, 64)
	if err := exec.Command("/bin/sh", "-c", script, strconv.Itoa(os.Getpid())).Run(); err != nil {
		t.Error(err)
	}
}

// The tool itself is stopped (a job-control stop, a debugger) for longer
// than it gives an instance's files while it reads them: the stop costs
// the files little of their time, and they answer once the tool runs
// again, at once or after more work (ls would list a healthy instance as
// hung, and clean give up half done).
func TestAnsweredAfterTheToolsOwnStop(t *testing.T) {
	old := fsWait
	fsWait = 400 * time.Millisecond
	defer func() { fsWait = old }()
	for _, work := range []time.Duration{0, 150 * time.Millisecond} {
		v, err := answered("instance", 0, func() (int, error) {
			stopSelf(t, 600*time.Millisecond)
			time.Sleep(work) // the rest of the reading, slow but in time
			return 42, nil
		})
		require.NoError(t, err, "with %v of work after the stop", work)
		assert.Equal(t, 42, v)
	}
}
