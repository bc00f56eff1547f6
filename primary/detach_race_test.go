package primary_test

import (
	"context"
	"os"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/ipc"
	"github.com/mpmr/mpmr/shm"
)

func init() { testproc.Register("hello-detach", helperHelloDetach) }

// helperHelloDetach (args: PREFIX RUNDIR OFF LEN DELAYUS) claims a slot,
// says hello and takes the memory files; it keeps the backing file open at
// a high descriptor (behind 3000 other open files, so that the kernel's
// description of it takes a while). Then it sends a Detach and, DELAYUS µs
// later (to vary how the two meet in the primary), the same hello again on
// the same connection; it maps [OFF, +LEN) of the backing file and says
// "> done detach=ERR hello=ERR". "peek" then reads the first byte of the
// mapping ("> byte B").
func helperHelloDetach(args []string) int {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	off, _ := strconv.ParseInt(args[2], 10, 64)
	length, _ := strconv.Atoi(args[3])
	delay, _ := strconv.Atoi(args[4])
	seg, client, err := claimAndSayHello(ctx, args[0], args[1], ipc.ClientConfig{Logger: quiet})
	if err != nil {
		testproc.Say("> err %v", err)
		return 3
	}
	got := &ipc.WithFiles{Body: &ipc.MemoryFilesReply{}}
	if err := client.Call(ctx, ipc.KindMemoryFiles, &ipc.MemoryFiles{First: 0}, got); err != nil || len(got.Files) == 0 {
		testproc.Say("> err files %v", err)
		return 3
	}
	for i := range 3000 {
		_ = i
		if _, err := os.Open("/etc/hostname"); err != nil {
			break
		}
	}
	var lim unix.Rlimit
	_ = unix.Getrlimit(unix.RLIMIT_NOFILE, &lim)
	fd := int(lim.Cur) - 1
	if err := unix.Dup2(int(got.Files[0].Fd()), fd); err != nil {
		testproc.Say("> err dup %v", err)
		return 3
	}
	for _, f := range got.Files {
		f.Close()
	}
	var derr, herr error
	start, _ := shm.ProcessStart(os.Getpid())
	var wg sync.WaitGroup
	wg.Go(func() { derr = client.Call(ctx, ipc.KindDetach, &ipc.Detach{}, &ipc.DetachReply{}) })
	time.Sleep(time.Duration(delay) * time.Microsecond) // a spread of timings, not a synchronisation
	wg.Go(func() {
		herr = client.Call(ctx, ipc.KindHello, &ipc.Hello{ABI: ipc.ABI, PID: os.Getpid(), UID: os.Getuid(),
			Start: start, Role: "secondary", Slot: seg.Slot(), Epoch: seg.Epoch()}, &ipc.WithFiles{Body: &ipc.HelloReply{}})
	})
	wg.Wait()
	mem, err := unix.Mmap(fd, off, length, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		testproc.Say("> err mmap %v", err)
		return 3
	}
	testproc.Say("> done detach=%v hello=%v", derr, herr)
	testproc.EachCommand(func(c testproc.Line) {
		switch c.Name {
		case "peek":
			testproc.Say("> byte %d", mem[0])
		}
	})
	return 0
}

// A Detach that races a hello again on the same connection, from a
// process that keeps a backing file open (so the Detach must fence it):
// whichever way the two meet in the primary, the process is either fenced
// or still in the sync set, never out of it unfenced, and a page freed
// while it maps it waits in quarantine.
func TestADetachRacingAHelloAgainIsJudged(t *testing.T) {
	p, cfg := startPrimary(t, testenv.Tmpfs(t))
	for i := range 40 {
		r, err := p.Alloc(p.Backend().PageSize)
		require.NoError(t, err)
		li := p.Memory().Lists()[0]
		fenced := p.Stats().Counters.Fenced
		h := testproc.Start(t, "hello-detach", []string{cfg.Prefix, cfg.RuntimeDir,
			strconv.FormatUint(uint64(r.Addr-li.Base), 10), strconv.FormatUint(r.Len, 10), strconv.Itoa((i % 5) * 200)}, b9Env)
		line := h.Expect("> ", 0)
		require.Contains(t, line, "done", line)
		// Both requests are answered: what they did in the primary is done.
		st := p.Stats()
		r.Bytes()[0] = 0x5a
		require.Equal(t, "byte 90", ask(t, h, "peek"), "the helper maps the page")
		require.True(t, st.Counters.Fenced > fenced || st.Counters.Secondaries == 1,
			"attempt %d (%s): out of the sync set, not fenced, while it maps data memory", i, line)
		require.NoError(t, p.Free(r))
		if st.Counters.Secondaries == 0 {
			require.NotZero(t, p.Memory().Quarantined(), "attempt %d: a page freed under a fenced process was not quarantined", i)
		}
		h.Kill()
		_ = h.Wait(0)                  // killed
		p.Memory().ReleaseQuarantine() // its process is gone
	}
}
