package primary_test

import (
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/internal/test/testproc"
)

// A fenced secondary no longer follows memory changes: what it maps at an
// address may be pages the primary freed and holds in quarantine for it,
// while the global table names the pages the primary handed out there
// since. It learns of the fence a moment later (its watch, or its
// connection's end); a lookup in that moment must not take a key from the
// global table, which would let a device write pages the process does not
// see. (TestBreaker7SecondaryStoppedInReadSectionBlocksNobody met that
// moment now and then.) Here the fence comes alone, without the drop of
// the connection that would follow it.
func TestFencedSecondaryTakesNoKeyFromTheGlobalTable(t *testing.T) {
	p, cfg := startPrimary(t, testenv.Tmpfs(t))
	r, err := p.Alloc(p.Backend().PageSize)
	require.NoError(t, err)
	e, err := p.Global().Create(uint64(r.Addr))
	require.NoError(t, err)
	h := testproc.Start(t, "secondary", []string{cfg.Prefix, cfg.RuntimeDir})
	slot, err := strconv.Atoi(strings.TrimPrefix(h.Expect("ready", 0), "ready slot="))
	require.NoError(t, err)

	seg := p.Segment()
	require.True(t, seg.Fence(slot, seg.Proc(slot).Epoch, h.PID(), seg.Proc(slot).Start))
	got := ask(t, h, "lookup %d", r.Addr)
	assert.NotContains(t, got, "key", "the global table's key %d for a fenced process", e.LKey)
	assert.Contains(t, got, "dropped", "the lookup says the process was dropped")
}
