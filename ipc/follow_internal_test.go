package ipc

import (
	"log/slog"
	"runtime"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// A hint the lane's thread could not use when it came is ignored, and
// costs no system call while the peer repeats it; once the peer has named
// no CPU, the same hint is tried again, and binds if the CPU has become
// usable meanwhile (back online, a wider cpuset).
func TestLaneTriesAnIgnoredCPUAgain(t *testing.T) {
	var all unix.CPUSet
	require.NoError(t, unix.SchedGetaffinity(0, &all))
	if !all.IsSet(0) || !all.IsSet(1) {
		t.Skip("needs a process that may use CPUs 0 and 1")
	}
	// This goroutine's thread stands for a lane's: its CPUs are {0} when
	// the peer first names CPU 1, and {0, 1} afterwards.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	defer func() { require.NoError(t, unix.SchedSetaffinity(0, &all)) }()
	var zero unix.CPUSet
	zero.Set(0)
	require.NoError(t, unix.SchedSetaffinity(0, &zero))

	p := &Peer{srv: &Server{log: slog.New(slog.DiscardHandler)}}
	var l laneCPU
	step := func(cpu int) int32 {
		p.Follow(cpu)
		l.apply(p)
		return l.bound - 1
	}
	assert.Equal(t, int32(-1), step(1), "CPU 1 is not usable yet")
	assert.False(t, l.locked, "an ignored hint leaves the thread to the runtime")
	require.NoError(t, unix.SchedSetaffinity(0, &all))
	assert.Equal(t, int32(-1), step(1), "repeated, the hint is still ignored")
	assert.Equal(t, int32(-1), step(-1))
	assert.Equal(t, int32(1), step(1), "after a request that names none, the hint binds")
	assert.True(t, l.locked)
	assert.Equal(t, int32(-1), step(-1))
	assert.False(t, l.locked, "unbound, the thread goes back to the runtime")
}
