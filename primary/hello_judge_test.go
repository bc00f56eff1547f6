package primary_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/ipc"
	"github.com/mpmr/mpmr/primary"
	"github.com/mpmr/mpmr/shm"
)

func init() { testproc.Register("judged", helperJudged) }

// helperJudged (args PREFIX RUNDIR) claims slots and says hello the way
// Attach does, and runs commands:
//
//	fenced        claims a slot, says hello and hangs up holding the slot
//	              until the primary fences the claim, then lets it go:
//	              "> fenced"
//	hello         claims a slot and says hello: "> admitted" or
//	              "> refused limit=BOOL ERR"
//	hello-bg      the same, answered later by "wait"; two may be under way
//	wait          "> admitted" or "> refused ..." for a hello-bg
//	again N       says hello again N times on the last admitted connection,
//	              each naming an earlier claim the primary never knew:
//	              "> again ERRS"
//	claim         claims a slot and says hello, and keeps both; the
//	              connection acknowledges every push: "> claimed"
//	left-bg       hello-bg, naming the kept claim as left
//	map OFF LEN   another attachment: claims a slot, says hello, takes the
//	              backing files, maps [OFF, OFF+LEN) of the first and keeps
//	              it; it follows no memory change: "> mapped"
//	peek          "> byte B", the first byte mapped
func helperJudged(args []string) int {
	prefix, rundir := args[0], args[1]
	var kept ipc.Claim
	var mem []byte
	var keep []io.Closer
	defer func() {
		for _, c := range keep {
			c.Close()
		}
	}()
	var seg *shm.Segment
	var client *ipc.Client
	bg := make(chan string, 2)
	var mu sync.Mutex
	hello := func(left ...ipc.Claim) string {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		s, c, err := claimAndSayHello(ctx, prefix, rundir, ipc.ClientConfig{Logger: quiet}, left...)
		if err != nil {
			return fmt.Sprintf("refused limit=%t %v", errors.Is(err, ipc.ErrLimit), err)
		}
		mu.Lock()
		defer mu.Unlock()
		seg, client = s, c // the last admitted, for "again"
		return "admitted"
	}
	testproc.EachCommand(func(c testproc.Line) {
		switch c.Name {
		case "fenced":
			if err := claimAndHangUp(prefix, rundir); err != nil {
				testproc.Say("> err %v", err)
				return
			}
			testproc.Say("> fenced")
		case "hello":
			testproc.Say("> %s", hello())
		case "hello-bg":
			go func() { bg <- hello() }()
			testproc.Say("> started")
		case "wait":
			testproc.Say("> %s", <-bg)
		case "claim":
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			// It acknowledges every push (it maps nothing to change), so
			// that it follows what the primary frees.
			acks := ipc.PushHandlerFunc(func(context.Context, ipc.Kind, *ipc.Decoder) (any, error) {
				return &ipc.SyncAck{}, nil
			})
			s, cl, err := claimAndSayHello(ctx, prefix, rundir, ipc.ClientConfig{Logger: quiet, PushHandler: acks})
			if err != nil {
				testproc.Say("> err %v", err)
				return
			}
			keep = append(keep, cl, s)
			kept = ipc.Claim{Slot: s.Slot(), Epoch: s.Epoch()}
			testproc.Say("> claimed")
		case "left-bg":
			go func() { bg <- hello(kept) }()
			testproc.Say("> started")
		case "map":
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			s, cl, files, err := claimHelloAndFiles(ctx, prefix, rundir, ipc.ClientConfig{Logger: quiet})
			if err != nil {
				testproc.Say("> err %v", err)
				return
			}
			keep = append(keep, cl, s)
			mem = mapFirst(files, c.Num(0), c.Num(1))
		case "peek":
			testproc.Say("> byte %d", mem[0])
		case "again":
			start, _ := shm.ProcessStart(os.Getpid())
			mu.Lock()
			seg, client := seg, client
			mu.Unlock()
			errs := 0
			for range c.Num(0) {
				err := client.CallTimeout(time.Minute, ipc.KindHello, &ipc.Hello{ABI: ipc.ABI, PID: os.Getpid(),
					UID: os.Getuid(), Start: start, Role: "secondary", Slot: seg.Slot(), Epoch: seg.Epoch(),
					Left: []ipc.Claim{{Slot: 999, Epoch: 1}}}, &ipc.WithFiles{Body: &ipc.HelloReply{}})
				if err != nil {
					errs++
				}
			}
			testproc.Say("> again %d", errs)
		default:
			testproc.Say("> err unknown command %q", c.Name)
		}
	})
	return 0
}

// fencedHolder starts the judged helper and has the primary fence one of
// its claims; the fence stands (housekeeping, which would end it, is
// off). It returns the helper.
func fencedHolder(t *testing.T, p *primary.Primary, cfg primary.Config) *testproc.Proc {
	t.Helper()
	h := testproc.Start(t, "judged", []string{cfg.Prefix, cfg.RuntimeDir})
	require.Equal(t, "fenced", ask(t, h, "fenced"))
	require.True(t, slices.ContainsFunc(p.Segment().Holders(), func(f shm.Proc) bool { return f.PID == h.PID() }),
		"the primary holds a fence of the helper's claim")
	return h
}

// holdQuestions holds every hello's question to the kernel, once the
// kernel has read the process (standing for the rest of a slow reading),
// until answer is called; asked gets the pid of each question held. Call
// it before the primary starts, and register answer as a cleanup after
// it has started, so that no hello stays held when the primary closes.
func holdQuestions(t *testing.T) (asked <-chan int, answer func()) {
	questions := make(chan int, 8)
	release := make(chan struct{})
	var once sync.Once
	t.Cleanup(primary.SetKernelQuestion(func(pid int) {
		questions <- pid
		<-release
	}))
	return questions, func() { once.Do(func() { close(release) }) }
}

// A hello of a process the primary fenced is admitted only once the
// kernel has said whether the process still reaches data memory: after
// the new attachment maps it, no answer could tell the two apart. A
// process the kernel does not describe within the hello's bound is
// refused, as a limit (Attach tries again), and its fence stands, so that
// neither the primary's Close nor its other secondaries wait on its /proc.
func TestAHelloTheKernelCannotJudgeInTimeIsRefusedAndTheFenceStands(t *testing.T) {
	t.Cleanup(primary.SetDetachAsk(time.Nanosecond))
	t.Cleanup(primary.SetHousekeepEvery(time.Hour))
	p, cfg := startPrimary(t, testenv.Tmpfs(t), shortSync)
	h := fencedHolder(t, p, cfg)

	got := ask(t, h, "hello")
	assert.Contains(t, got, "refused limit=true", "a hello judged too slowly is refused as a limit")
	assert.Contains(t, got, "describe", "and says why")
	assert.True(t, slices.ContainsFunc(p.Segment().Holders(), func(f shm.Proc) bool { return f.PID == h.PID() }),
		"the fence stands")
}

// Hellos of one process that come while one of them waits for the
// kernel's word on the process wait their turn, and ask only if there is
// still something to judge: a process that says hello on many connections
// at once costs one reading of its /proc at a time, and here one in all
// (the first hello's answer ended the fence).
func TestHellosOfOneProcessAskTheKernelOnce(t *testing.T) {
	asking, answer := holdQuestions(t)
	t.Cleanup(primary.SetHousekeepEvery(time.Hour))
	p, cfg := startPrimary(t, testenv.Tmpfs(t), shortSync)
	t.Cleanup(answer) // before the primary closes: no hello stays held in the question
	h := fencedHolder(t, p, cfg)

	require.Equal(t, "started", ask(t, h, "hello-bg"))
	select {
	case pid := <-asking:
		require.Equal(t, h.PID(), pid)
	case <-time.After(time.Minute): // a hang guard
		t.Fatal("the first hello asked the kernel nothing")
	}
	require.Equal(t, "started", ask(t, h, "hello-bg"))
	waiting := false
	for end := time.Now().Add(time.Minute); !waiting && len(asking) == 0 && time.Now().Before(end); time.Sleep(time.Millisecond) {
		waiting = testenv.GoroutinesIn("primary.(*handler).judgeEarlier") == 2
	}
	answer()
	assert.True(t, waiting, "the second hello waits its turn")
	assert.Empty(t, asking, "the kernel was asked once")
	assert.Equal(t, "admitted", ask(t, h, "wait"))
	assert.Equal(t, "admitted", ask(t, h, "wait"))
}

// A hello that names earlier claims the primary never knew, from a
// process it never fenced, costs no question to the kernel, however
// often it is said again on one connection.
func TestAHelloNamingUnknownClaimsAsksTheKernelNothing(t *testing.T) {
	var asked atomic.Int64
	t.Cleanup(primary.SetKernelQuestion(func(int) { asked.Add(1) }))
	_, cfg := startPrimary(t, testenv.Tmpfs(t), shortSync)
	h := testproc.Start(t, "judged", []string{cfg.Prefix, cfg.RuntimeDir})
	require.Equal(t, "admitted", ask(t, h, "hello"))
	assert.Equal(t, "again 0", ask(t, h, "again 50"))
	assert.Zero(t, asked.Load(), "questions asked of the kernel")
}

// The answer to a hello's question ends only the fences made before the
// kernel was asked. Here the kernel has read a process that maps nothing
// when another attachment of it (admitted without a question: it names
// nothing and the process has no fence yet) maps a page, stops following
// memory changes, and is fenced as the primary frees the page; the
// question's answer, "reaches nothing", must not end that fence, or the
// page would go back to the allocator while the process maps it.
func TestAFenceMadeWhileAHelloIsJudgedIsNotEndedByItsAnswer(t *testing.T) {
	asked, answer := holdQuestions(t)
	t.Cleanup(primary.SetHousekeepEvery(time.Hour))
	p, cfg := startPrimary(t, testenv.Tmpfs(t), shortSync)
	t.Cleanup(answer)
	r, err := p.Alloc(p.Backend().PageSize)
	require.NoError(t, err)
	list := p.Memory().Lists()[0]
	h := testproc.Start(t, "judged", []string{cfg.Prefix, cfg.RuntimeDir})
	require.Equal(t, "claimed", ask(t, h, "claim"))
	require.Equal(t, "started", ask(t, h, "left-bg"))
	select {
	case <-asked: // the kernel has read the process: it maps nothing
	case <-time.After(time.Minute): // a hang guard
		t.Fatal("the hello naming a left claim asked the kernel nothing")
	}
	require.Equal(t, "mapped", ask(t, h, "map %d %d", r.Addr-list.Base, r.Len))
	r.Bytes()[0] = 0x11
	require.Equal(t, "byte 17", ask(t, h, "peek"))
	require.NoError(t, p.Free(r)) // the new attachment follows no change: fenced
	require.True(t, slices.ContainsFunc(p.Segment().Holders(), func(f shm.Proc) bool { return f.PID == h.PID() }))
	require.Equal(t, 1, p.Memory().Quarantined())
	answer()
	assert.Equal(t, "admitted", ask(t, h, "wait"))

	assert.True(t, slices.ContainsFunc(p.Segment().Holders(), func(f shm.Proc) bool { return f.PID == h.PID() }),
		"the fence made while the kernel was asked stands")
	assert.Equal(t, 1, p.Memory().Quarantined(), "the page it maps stays in quarantine")
	again, err := p.Alloc(p.Backend().PageSize)
	require.NoError(t, err)
	assert.NotEqual(t, r.Addr, again.Addr, "the page the process maps is not handed out again")
}
