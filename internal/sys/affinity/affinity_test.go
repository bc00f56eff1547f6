package affinity_test

import (
	"runtime"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/mpmr/mpmr/internal/sys/affinity"
)

func TestUsableFollowsTheThreadsAffinity(t *testing.T) {
	runtime.LockOSThread() // the thread ends with the test: its binding goes with it
	all, err := affinity.Usable()
	require.NoError(t, err)
	require.NotEmpty(t, all)
	for i := 1; i < len(all); i++ {
		assert.Less(t, all[i-1], all[i], "in order")
	}

	last := all[len(all)-1]
	var one unix.CPUSet
	one.Set(last)
	require.NoError(t, unix.SchedSetaffinity(0, &one))
	got, err := affinity.Usable()
	require.NoError(t, err)
	assert.Equal(t, []int{last}, got, "bound to one CPU")
}

// Pin binds a thread that may use several CPUs to the one it is on, and
// gives it back every CPU it had; a thread bound to one CPU already is
// left as it is.
func TestPinKeepsAThreadWhereItIsAndGivesItsCPUsBack(t *testing.T) {
	runtime.LockOSThread() // the thread ends with the test if it stays bound
	home, err := affinity.Usable()
	require.NoError(t, err)
	if len(home) < 2 {
		t.Skipf("needs a thread that may use 2 CPUs; this one may use %v", home)
	}

	var pin affinity.Pin
	require.NoError(t, pin.Here())
	got, err := affinity.Usable()
	require.NoError(t, err)
	assert.Equal(t, []int{pin.CPU()}, got, "bound to one CPU")
	assert.Contains(t, home, pin.CPU())
	require.NoError(t, pin.Release())
	got, err = affinity.Usable()
	require.NoError(t, err)
	assert.Equal(t, home, got, "its CPUs given back")
	require.NoError(t, pin.Release(), "a second release changes nothing")

	// Bound to one CPU by its owner, the thread keeps that binding.
	last := home[len(home)-1]
	var one unix.CPUSet
	one.Set(last)
	require.NoError(t, unix.SchedSetaffinity(0, &one))
	require.NoError(t, pin.Here())
	assert.Equal(t, last, pin.CPU())
	require.NoError(t, pin.Release())
	got, err = affinity.Usable()
	require.NoError(t, err)
	assert.Equal(t, []int{last}, got, "its owner's binding kept")
}
