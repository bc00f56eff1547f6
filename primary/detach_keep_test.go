package primary_test

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/ipc"
	"github.com/mpmr/mpmr/primary"
)

func init() { testproc.Register("detach-keep", helperDetachKeep) }

// helperDetachKeep (args: PREFIX RUNDIR N) attaches N times in turn, each
// time on a connection of its own: it claims a slot, says hello, detaches
// and gives the slot up, but keeps the connection open. It says "> kept
// N" (or "> err ...") and then "> ended K" for each line "ended": how
// many of the connections the primary has closed.
func helperDetachKeep(args []string) int {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	n, _ := strconv.Atoi(args[2])
	var kept []*ipc.Client
	for range n {
		seg, client, err := claimAndSayHello(ctx, args[0], args[1], ipc.ClientConfig{Logger: quiet})
		if err != nil {
			testproc.Say("> err %v", err)
			return 3
		}
		defer client.Close()
		if err := client.Call(ctx, ipc.KindDetach, &ipc.Detach{}, &ipc.DetachReply{}); err != nil {
			testproc.Say("> err detach %v", err)
			return 3
		}
		seg.Close()
		kept = append(kept, client)
	}
	testproc.Say("> kept %d", len(kept))
	testproc.EachCommand(func(testproc.Line) {
		ended := 0
		for _, c := range kept {
			if c.Err() != nil {
				ended++
			}
		}
		testproc.Say("> ended %d", ended)
	})
	return 0
}

// A process that detaches and keeps its connection open, again and
// again, holds its user's connections no longer than one that never says
// hello: the detached connections do not count as in use (a secondary of
// the same user attaching over the cap tries again rather than fail), and
// they close at the hello deadline.
func TestDetachedConnectionsKeptOpenAreClosed(t *testing.T) {
	p, cfg := startPrimary(t, testenv.Tmpfs(t), func(c *primary.Config) {
		c.Limits.MaxConnsPerUID = 3
		c.Limits.HelloTimeout = 1500 * time.Millisecond
	})
	h := testproc.Start(t, "detach-keep", []string{cfg.Prefix, cfg.RuntimeDir, "3"})
	require.Equal(t, "kept 3", strings.TrimPrefix(h.Expect("> ", 0), "> "))

	startSecondary(t, cfg) // over the cap until the detached ones close
	waitUntil(t, "the detached connections' end", func() bool { return ask(t, h, "ended") == "ended 3" })
	waitUntil(t, "the count of the closed connections", func() bool { return p.Stats().Counters.IPCConns == 1 }) // the secondary's
}
