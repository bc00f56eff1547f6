package primary_test

import (
	"context"
	"errors"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/instance"
	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/ipc"
	"github.com/mpmr/mpmr/primary"
)

func init() { testproc.Register("b8-stats-during-close", b8StatsDuringClose) }

// b8StatsDuringClose starts a primary (prefix args[0], runtime directory
// args[1]) and closes it from two goroutines at once while others call
// Stats and Dump in a loop and a stranger asks for stats over IPC (the
// handler calls Stats too). It says "survived" with what it saw if
// nothing faulted or hung.
func b8StatsDuringClose(args []string) int {
	p, err := primary.Start(primary.Config{Prefix: args[0], RuntimeDir: args[1], Backend: hugetlb.Tmpfs,
		MemoryPages: 16, Logger: quiet})
	if err != nil {
		testproc.Say("start-failed %v", err)
		return 3
	}
	dir, err := instance.Dir(args[0], args[1])
	if err != nil {
		testproc.Say("dir-failed %v", err)
		return 3
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := ipc.DialClient(ctx, filepath.Join(dir, ipc.SocketName), ipc.ClientConfig{Logger: quiet})
	if err != nil {
		testproc.Say("dial-failed %v", err)
		return 3
	}
	defer c.Close()

	var stop atomic.Bool
	var wg sync.WaitGroup
	var stats, dumps, closedDumps, ipcStats atomic.Int64
	started := make(chan struct{}, 4)
	for range 2 {
		wg.Go(func() {
			started <- struct{}{}
			for !stop.Load() {
				p.Stats()
				stats.Add(1)
				if _, err := p.Dump(); errors.Is(err, primary.ErrClosed) {
					closedDumps.Add(1)
				}
				dumps.Add(1)
			}
		})
	}
	wg.Go(func() {
		first := true
		for !stop.Load() {
			var r ipc.StatsReply
			err := c.CallTimeout(time.Second, ipc.KindStats, &ipc.StatsRequest{}, &r)
			if first {
				first = false
				started <- struct{}{} // Close starts once one request was served
			}
			if err != nil {
				return // the connection ended with the primary, or the stranger budget ran out
			}
			ipcStats.Add(1)
		}
	})
	for range 3 {
		<-started
	}
	var closers sync.WaitGroup
	for range 2 {
		closers.Go(func() { p.Close() })
	}
	closers.Wait()
	stop.Store(true)
	wg.Wait()
	st := p.Stats()
	_, err = p.Dump()
	testproc.Say("survived mrs=%d dump=%v", st.Global.MRs, errors.Is(err, primary.ErrClosed))
	testproc.Say("counts stats=%d dumps=%d closed-dumps=%d ipc=%d", stats.Load(), dumps.Load(), closedDumps.Load(), ipcStats.Load())
	return 0
}

// Stats and Dump racing two Close calls and a stats request over IPC:
// nothing faults or deadlocks, and afterwards Stats is empty and Dump
// fails with ErrClosed.
func TestBreaker8StatsAndDumpDuringConcurrentClose(t *testing.T) {
	for range 3 {
		h := testproc.Start(t, "b8-stats-during-close", []string{testenv.Prefix(t), testenv.RunDir(t)})
		line, err := h.Next("", 20*time.Second)
		counts, _ := h.Next("", 5*time.Second)
		err2 := h.Wait(10 * time.Second)
		assert.Equal(t, "survived mrs=0 dump=true", line, "next line %v; exit %v; stderr:\n%.600s", err, err2, h.Stderr())
		assert.NoError(t, err2)
		t.Log(counts)
	}
}
