package primary_test

import (
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/primary"
)

// A primary configured with a long SyncTimeout (an operator who would
// rather never drop a slow secondary; Config puts no upper bound on it)
// says in its hello how long a memory change may hold requests up, at
// most ipc.MaxHold: secondaries attach to it and ask it as any other.
func TestSecondariesAttachToAPrimaryWithALongSyncTimeout(t *testing.T) {
	p, cfg := startPrimary(t, testenv.Tmpfs(t), func(c *primary.Config) { c.SyncTimeout = 10 * time.Minute })
	r, err := p.Alloc(p.Backend().PageSize)
	require.NoError(t, err)
	h := testproc.Start(t, "secondary", []string{cfg.Prefix, cfg.RuntimeDir})
	line := h.Expect("", 0)
	require.True(t, strings.HasPrefix(line, "ready"), "the secondary did not attach: %s", line)
	require.True(t, strings.HasPrefix(ask(t, h, "create %d", r.Addr), "key "))
}
