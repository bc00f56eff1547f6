package primary_test

import (
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/cache"
	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/secondary"
)

func init() { testproc.Register("pool-secondary", helperPoolSecondary) }

// helperPoolSecondary: "pool NAME" -> "ok", "corrupt ERR", "dropped ERR",
// "closed ERR" or "err ERR"; "wait-dropped" -> "dropped=BOOL".
func helperPoolSecondary(args []string) int {
	s, err := secondary.Attach(secondary.Config{Prefix: args[0], RuntimeDir: args[1], Logger: quiet})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 3
	}
	defer s.Close()
	testproc.Say("ready")
	in := testproc.Commands()
	for in.Scan() {
		f := strings.Fields(in.Text())
		if len(f) == 0 {
			continue
		}
		switch f[0] {
		case "pool":
			_, err := s.Pool(f[1])
			switch {
			case err == nil:
				testproc.Say("> ok")
			case errors.Is(err, secondary.ErrDropped):
				testproc.Say("> dropped %v", err)
			case errors.Is(err, secondary.ErrClosed):
				testproc.Say("> closed %v", err)
			case errors.Is(err, cache.ErrCorrupt):
				testproc.Say("> corrupt %v", err)
			default:
				testproc.Say("> err %v", err)
			}
		case "wait-dropped":
			<-s.PrimaryGone()
			testproc.Say("> dropped=%t", s.Dropped())
		}
	}
	return 0
}

// A secondary stopped while the primary creates a pool is dropped (it
// could not follow the allocation). Its Pool then should say so
// (ErrDropped, as every other request does), not call a pool the primary
// made cache.ErrCorrupt.
func TestPoolOfADroppedSecondarySaysDropped(t *testing.T) {
	p, cfg := startPrimary(t, testenv.Tmpfs(t), shortSync)
	_, err := p.CreatePool("before", 2048, 64)
	require.NoError(t, err)
	h := testproc.Start(t, "pool-secondary", []string{cfg.Prefix, cfg.RuntimeDir})
	h.Expect("ready", 0)
	require.Equal(t, "ok", ask(t, h, "pool before"))

	h.Stop()
	_, err = p.CreatePool("during", 2048, 64)
	require.NoError(t, err)
	h.Continue()

	// Right after SIGCONT, before the drop is noticed: the new pool.
	first := ask(t, h, "pool during")
	t.Logf("pool during, just resumed: %s", first)
	require.Equal(t, "dropped=true", ask(t, h, "wait-dropped"))
	for _, name := range []string{"before", "during"} {
		got := ask(t, h, "pool %s", name)
		t.Logf("pool %s after the drop: %s", name, got)
		assert.True(t, strings.HasPrefix(got, "dropped "), "pool %s of a dropped secondary: %s", name, got)
	}
	assert.False(t, strings.HasPrefix(first, "corrupt "), "pool during, just resumed: %s", first)
}
