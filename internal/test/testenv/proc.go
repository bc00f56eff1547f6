package testenv

import (
	"testing"

	"github.com/mpmr/mpmr/shm"
)

// ProcessStart returns process pid's start time (shm.ProcessStart), as an
// owner reads it when it admits the process, failing the test if it
// cannot be read.
func ProcessStart(tb testing.TB, pid int) uint64 {
	tb.Helper()
	start, err := shm.ProcessStart(pid)
	if err != nil {
		tb.Fatalf("the start time of process %d: %v", pid, err)
	}
	return start
}
