package primary_test

import (
	"context"
	"os"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
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
	seg, client, files, err := claimHelloAndFiles(ctx, args[0], args[1], ipc.ClientConfig{Logger: quiet})
	if err != nil {
		testproc.Say("> err %v", err)
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
	if err := unix.Dup2(int(files[0].Fd()), fd); err != nil {
		testproc.Say("> err dup %v", err)
		return 3
	}
	for _, f := range files {
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
			strconv.FormatUint(uint64(r.Addr-li.Base), 10), strconv.FormatUint(r.Len, 10), strconv.Itoa((i % 5) * 200)})
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

func init() { testproc.Register("hello-naming", helperHelloNaming) }

// helperHelloNaming (args: PREFIX RUNDIR SLOT EPOCH [N]) claims a slot of
// its own and says hello naming, as left, the claim SLOT/EPOCH, N times
// (1 if not given); it says "> hello ERR" and waits for its input to end,
// acknowledging the primary's syncs (it maps nothing).
func helperHelloNaming(args []string) int {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	slot, _ := strconv.Atoi(args[2])
	epoch, _ := strconv.ParseUint(args[3], 10, 32)
	n := 1
	if len(args) > 4 {
		n, _ = strconv.Atoi(args[4])
	}
	left := make([]ipc.Claim, n)
	for i := range left {
		left[i] = ipc.Claim{Slot: slot, Epoch: uint32(epoch)}
	}
	ack := ipc.PushHandlerFunc(func(context.Context, ipc.Kind, *ipc.Decoder) (any, error) { return &ipc.SyncAck{}, nil })
	seg, client, err := claimAndSayHello(ctx, args[0], args[1], ipc.ClientConfig{Logger: quiet, PushHandler: ack}, left...)
	testproc.Say("> hello %v", err)
	if err == nil {
		defer seg.Close()
		defer client.Close()
	}
	testproc.EachCommand(func(testproc.Line) {})
	return 0
}

// A hello that names, as left, the claim of another process's attachment
// (a peer guessing, or lying) detaches nothing: that secondary stays in
// the sync set, unfenced, and follows the next free. A hello that names
// more claims than ipc.MaxLeft is refused (a malformed frame: the
// connection ends), and changes nothing.
func TestAHelloNamingAnotherProcessesClaimDetachesNothing(t *testing.T) {
	p, cfg := startPrimary(t, testenv.Tmpfs(t))
	r, err := p.Alloc(p.Backend().PageSize)
	require.NoError(t, err)
	victim := startSecondary(t, cfg)
	require.Contains(t, ask(t, victim, "lookup %d", r.Addr), "key")
	i := slices.IndexFunc(p.Segment().Procs(), func(pr shm.Proc) bool { return pr.PID == victim.PID() && pr.Live })
	require.GreaterOrEqual(t, i, 0, "the victim's claim")
	claim := p.Segment().Procs()[i]
	fenced := p.Stats().Counters.Fenced

	h := testproc.Start(t, "hello-naming", []string{cfg.Prefix, cfg.RuntimeDir,
		strconv.Itoa(claim.Slot), strconv.FormatUint(uint64(claim.Epoch), 10)})
	require.Equal(t, "> hello <nil>", h.Expect("> hello", 0))
	st := p.Stats()
	assert.Equal(t, 2, st.Counters.Secondaries, "both attachments in the sync set")
	assert.Equal(t, fenced, st.Counters.Fenced, "nobody fenced")

	tooMany := testproc.Start(t, "hello-naming", []string{cfg.Prefix, cfg.RuntimeDir,
		strconv.Itoa(claim.Slot), strconv.FormatUint(uint64(claim.Epoch), 10), strconv.Itoa(ipc.MaxLeft + 1)})
	assert.NotEqual(t, "> hello <nil>", tooMany.Expect("> hello", 0), "a hello naming more than MaxLeft claims")
	assert.Equal(t, 2, p.Stats().Counters.Secondaries, "the hello naming too many was not admitted")

	require.NoError(t, p.Free(r))
	assert.Zero(t, p.Memory().Quarantined(), "the free waited for nobody")
	assert.False(t, b10MapsAt(t, victim.PID(), p.Memory().Lists()[0].File, r.Addr), "the victim followed the free")
	assert.Equal(t, fenced, p.Stats().Counters.Fenced, "nobody fenced")
}
