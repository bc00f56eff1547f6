package primary_test

import (
	"fmt"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/internal/test/testproc"
)

// killAtEnd kills process pid, a helper's child, when the test ends, and
// reaps it if it is this process's (the helper reaps it while it lives;
// after, init does).
func killAtEnd(t *testing.T, pid int) {
	t.Cleanup(func() {
		_ = syscall.Kill(pid, syscall.SIGKILL)
		var ws syscall.WaitStatus
		_, _ = syscall.Wait4(pid, &ws, 0, nil)
	})
}

// A secondary's application forks a child (a helper, a daemonizing
// library). The child must not inherit the data memory: nobody asks it to
// unmap what the primary frees, so it would keep a freed page mapped, and
// a write through it would land in the page's next owner. It inherits
// none of it.
func TestAForkedChildMapsNoDataMemory(t *testing.T) {
	p, cfg := startPrimary(t, testenv.Tmpfs(t))
	file := p.Memory().Lists()[0].File
	r, err := p.Alloc(p.Backend().PageSize)
	require.NoError(t, err)
	s := startSecondary(t, cfg)
	require.Contains(t, ask(t, s, "lookup %d", r.Addr), "key")
	require.True(t, b10MapsAt(t, s.PID(), file, r.Addr), "the secondary maps r")

	var child int
	_, err = fmt.Sscanf(ask(t, s, "fork"), "child %d", &child)
	require.NoError(t, err)
	killAtEnd(t, child)
	assert.False(t, b10MapsAt(t, child, file, r.Addr), "the secondary's child maps r")
	assert.True(t, b10MapsAt(t, s.PID(), file, r.Addr), "the secondary still maps r")

	require.NoError(t, p.Free(r))
	assert.Zero(t, p.Memory().Quarantined(), "nothing waits for the child")
	assert.False(t, b10MapsAt(t, child, file, r.Addr), "nobody maps the freed page")
}

// The child of a secondary that then dies holds the secondary's
// connection and call lane (a raw fork shares every descriptor), so the
// connection never ends. The secondary's death must be noticed all the
// same, from its process: it leaves the sync set, and a free neither
// waits for it nor quarantines anything for it.
func TestADeadSecondaryWhoseChildHoldsItsConnectionIsNoticed(t *testing.T) {
	p, cfg := startPrimary(t, testenv.Tmpfs(t))
	r, err := p.Alloc(p.Backend().PageSize)
	require.NoError(t, err)
	s := startSecondary(t, cfg)
	require.Contains(t, ask(t, s, "lookup %d", r.Addr), "key")
	var child int
	_, err = fmt.Sscanf(ask(t, s, "fork"), "child %d", &child)
	require.NoError(t, err)
	killAtEnd(t, child)

	s.Kill() // its standard output stays open in the child: not waited for
	require.Eventually(t, func() bool { return p.Stats().Counters.Secondaries == 0 }, testproc.DefaultTimeout,
		time.Millisecond, "the dead secondary stays in the sync set while its child holds its connection")
	require.NoError(t, p.Free(r))
	assert.Zero(t, p.Memory().Quarantined(), "nothing waits for the dead secondary")
}
