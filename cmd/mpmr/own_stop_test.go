package main

import (
	"os"
	"os/exec"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// stopSelf stops this whole process (SIGSTOP) for about d: a shell started
// first sends SIGCONT once it has seen the process stopped and d has
// passed.
func stopSelf(t *testing.T, d time.Duration) {
	pid := strconv.Itoa(os.Getpid())
	cont := exec.Command("/bin/sh", "-c", "until grep -q '^State:[[:space:]]*T' /proc/"+pid+"/status; do sleep 0.01; done; "+
		"sleep "+strconv.FormatFloat(d.Seconds(), 'f', 3, 64)+"; kill -CONT "+pid)
	if err := cont.Start(); err != nil {
		t.Error(err)
		return
	}
	if err := syscall.Kill(os.Getpid(), syscall.SIGSTOP); err != nil {
		t.Error(err)
	}
	if err := cont.Wait(); err != nil {
		t.Error(err)
	}
}

// The tool itself is stopped (a job-control stop, a debugger) for longer
// than it gives an instance's files while it reads them, and they answer
// as soon as it runs again: the tool reports what it read, not files that
// do not answer (ls would list a healthy instance as hung, and clean give
// up half done).
func TestAnsweredAfterTheToolsOwnStop(t *testing.T) {
	old := fsWait
	fsWait = 100 * time.Millisecond
	defer func() { fsWait = old }()
	for range 3 {
		v, err := answered("instance", 0, func() (int, error) {
			stopSelf(t, 3*fsWait)
			return 42, nil
		})
		require.NoError(t, err)
		assert.Equal(t, 42, v)
	}
}
