package primary_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"

	"github.com/mpmr/mpmr/internal/instance"
	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/ipc"
	"github.com/mpmr/mpmr/primary"
	"github.com/mpmr/mpmr/secondary"
	"github.com/mpmr/mpmr/shm"
)

func init() { testproc.Register("claim-and-hang-up", helperClaimAndHangUp) }

// helperClaimAndHangUp attaches once, and keeps that attachment (its data
// memory stays mapped). On "claims N W" it makes N more claims, W at a
// time, each as Attach begins one: a slot in the process table, a
// connection, a hello naming the slot; then it hangs up while it holds
// the slot, waits for the primary to fence the claim, and lets the slot
// go. It answers "> claims FENCED FAILED".
func helperClaimAndHangUp(args []string) int {
	prefix, rundir := args[0], args[1]
	s, err := secondary.Attach(secondary.Config{Prefix: prefix, RuntimeDir: rundir, Logger: quiet})
	if err != nil {
		testproc.Say("attach-failed %v", err)
		return 3
	}
	defer s.Close()
	testproc.Say("ready")
	testproc.EachCommand(func(c testproc.Line) {
		n, _ := strconv.Atoi(c.Args[0])
		w, _ := strconv.Atoi(c.Args[1])
		work := make(chan struct{}, n)
		for range n {
			work <- struct{}{}
		}
		close(work)
		var mu sync.Mutex
		fenced, failed := 0, 0
		var wg sync.WaitGroup
		for range w {
			wg.Go(func() {
				for range work {
					err := claimAndHangUp(prefix, rundir)
					mu.Lock()
					if err != nil {
						failed++
						fmt.Fprintln(os.Stderr, err)
					} else {
						fenced++
					}
					mu.Unlock()
				}
			})
		}
		wg.Wait()
		testproc.Say("> claims %d %d", fenced, failed)
	})
	return 0
}

func claimAndHangUp(prefix, rundir string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	seg, client, err := claimAndSayHello(ctx, prefix, rundir, ipc.ClientConfig{Logger: quiet})
	if err != nil {
		return err
	}
	defer seg.Close()
	client.Close()
	for !seg.Fenced() {
		if ctx.Err() != nil {
			return fmt.Errorf("claim of slot %d not fenced: %w", seg.Slot(), ctx.Err())
		}
		time.Sleep(time.Millisecond)
	}
	return nil
}

// claimAndSayHello does what Attach does before it maps anything: it
// claims a slot in the process table of the instance prefix (runtime
// directory rundir), connects with cfg, and says hello naming the slot
// (and, as left, the claims in left).
// The caller closes both.
func claimAndSayHello(ctx context.Context, prefix, rundir string, cfg ipc.ClientConfig, left ...ipc.Claim) (*shm.Segment, *ipc.Client, error) {
	dir, err := instance.Dir(prefix, rundir)
	if err != nil {
		return nil, nil, err
	}
	rd, err := ipc.OpenRunDir(dir, ipc.RunDirOptions{})
	if err != nil {
		return nil, nil, err
	}
	defer rd.Close()
	info, err := instance.ReadInfoIn(rd)
	if err != nil {
		return nil, nil, err
	}
	lockf, err := rd.OpenFile(instance.SlotsLockFile, os.O_RDWR, 0)
	if err != nil {
		return nil, nil, err
	}
	seg, err := shm.Attach(shm.Options{Path: info.Segment, LockPath: lockf.Name(), LockFile: lockf,
		LayoutTag: instance.LayoutTag, Role: shm.RoleSecondary, Logger: quiet})
	if err != nil {
		return nil, nil, err
	}
	client, err := ipc.DialClient(ctx, filepath.Join(rd.Path(), ipc.SocketName), cfg)
	if err != nil {
		seg.Close()
		return nil, nil, err
	}
	start, _ := shm.ProcessStart(os.Getpid())
	if err := client.Call(ctx, ipc.KindHello, &ipc.Hello{ABI: ipc.ABI, PID: os.Getpid(), UID: os.Getuid(),
		Start: start, Role: "secondary", Slot: seg.Slot(), Epoch: seg.Epoch(), Left: left}, &ipc.WithFiles{Body: &ipc.HelloReply{}}); err != nil {
		client.Close()
		seg.Close()
		return nil, nil, err
	}
	return seg, client, nil
}

// claimHelloAndFiles is claimAndSayHello, and then takes the backing
// files of the first list of data memory, as Attach does before it maps
// them; at least one, or an error.
func claimHelloAndFiles(ctx context.Context, prefix, rundir string, cfg ipc.ClientConfig) (*shm.Segment, *ipc.Client, []*os.File, error) {
	seg, client, err := claimAndSayHello(ctx, prefix, rundir, cfg)
	if err != nil {
		return nil, nil, nil, err
	}
	got := &ipc.WithFiles{Body: &ipc.MemoryFilesReply{}}
	if err := client.Call(ctx, ipc.KindMemoryFiles, &ipc.MemoryFiles{First: 0}, got); err != nil || len(got.Files) == 0 {
		client.Close()
		seg.Close()
		return nil, nil, nil, fmt.Errorf("files: %d, %w", len(got.Files), err)
	}
	return seg, client, got.Files, nil
}

// A process the primary must fence again and again costs it one record
// per slot, not one per claim: each record is asked about, and copied
// into every quarantined batch, for as long as the process lives. Here
// one process keeps an attachment (so that it still reaches data memory)
// and claims slots, says hello and hangs up, 150 times.
func TestFencesOfOneProcessAreBoundedBySlots(t *testing.T) {
	p, cfg := startPrimary(t, testenv.Tmpfs(t), func(c *primary.Config) { c.MemoryPages = 64 })
	h := testproc.Start(t, "claim-and-hang-up", []string{cfg.Prefix, cfg.RuntimeDir})
	h.Expect("ready", 0)
	h.Send("claims 150 8")
	var fenced, failed int
	_, err := fmt.Sscanf(h.Expect("> claims", 2*time.Minute), "> claims %d %d", &fenced, &failed)
	if assert.NoError(t, err) {
		assert.Equal(t, 150, fenced)
		assert.Zero(t, failed)
	}
	holders := p.Segment().Holders()
	assert.LessOrEqual(t, len(holders), 8+1, "one record per slot the process held at once, at most")
	for _, f := range holders {
		assert.Equal(t, h.PID(), f.PID)
	}

	// Frees while the process lives are quarantined on its account, and
	// go back once it has gone.
	r, err := p.Alloc(p.Backend().PageSize)
	if assert.NoError(t, err) {
		assert.NoError(t, p.Free(r))
		assert.Equal(t, 1, p.Memory().Quarantined())
	}
	h.Kill()
	_ = h.Wait(10 * time.Second)
	p.Memory().ReleaseQuarantine()
	assert.Zero(t, p.Memory().Quarantined())
	assert.Empty(t, p.Segment().Holders())
}
