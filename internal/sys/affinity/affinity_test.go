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
