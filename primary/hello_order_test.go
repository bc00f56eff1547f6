package primary_test

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/ipc"
	"github.com/mpmr/mpmr/primary"
	"github.com/mpmr/mpmr/shm"
)

func init() { testproc.Register("attachments", helperAttachments) }

// helperAttachments (PREFIX RUNDIR) keeps named raw attachments of one
// process, made as Attach begins one, which need not behave as Attach's:
//
//	claim NAME ACK [LEFT...]  claims a slot, says hello naming the claims of
//	                          the kept attachments LEFT as left; ACK 1: the
//	                          connection acknowledges every push (without
//	                          doing anything), 0: it answers none:
//	                          "> claimed SLOT EPOCH" / "> err ..."
//	claim-bg ...              the same in the background, kept by its name
//	                          once made: "> started"
//	wait                      the background result
//	files-map NAME OFF LEN    NAME takes the backing files now and maps
//	                          [OFF, OFF+LEN) of the first: "> mapped"
//	peek                      "> byte B"
//	release NAME              lets NAME's slot go, keeping its connection
//	hangup NAME               closes NAME's connection, keeping its slot
type rawAttachment struct {
	seg    *shm.Segment
	client *ipc.Client
}

func helperAttachments(args []string) int {
	prefix, rundir := args[0], args[1]
	atts := map[string]*rawAttachment{} // by name; guarded by mu
	var mu sync.Mutex
	get := func(name string) *rawAttachment {
		mu.Lock()
		defer mu.Unlock()
		return atts[name]
	}
	keep := func(name string, a *rawAttachment) {
		mu.Lock()
		defer mu.Unlock()
		atts[name] = a
	}
	var mem []byte
	bg := make(chan string, 4)
	type claimReq struct {
		name string
		ack  bool
		left []ipc.Claim
	}
	parse := func(c testproc.Line) claimReq {
		r := claimReq{name: c.Args[0], ack: c.Args[1] == "1"}
		for _, n := range c.Args[2:] {
			a := get(n)
			r.left = append(r.left, ipc.Claim{Slot: a.seg.Slot(), Epoch: a.seg.Epoch()})
		}
		return r
	}
	claim := func(r claimReq) (*rawAttachment, string) {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		cfg := ipc.ClientConfig{Logger: quiet}
		if r.ack {
			cfg.PushHandler = ipc.PushHandlerFunc(func(context.Context, ipc.Kind, *ipc.Decoder) (any, error) {
				return &ipc.SyncAck{}, nil
			})
		}
		s, cl, err := claimAndSayHello(ctx, prefix, rundir, cfg, r.left...)
		if err != nil {
			return nil, fmt.Sprintf("err %v", err)
		}
		return &rawAttachment{seg: s, client: cl}, fmt.Sprintf("claimed %d %d", s.Slot(), s.Epoch())
	}
	testproc.Say("ready")
	testproc.EachCommand(func(c testproc.Line) {
		switch c.Name {
		case "claim":
			r := parse(c)
			a, res := claim(r)
			if a != nil {
				keep(r.name, a)
			}
			testproc.Say("> %s", res)
		case "claim-bg":
			r := parse(c)
			go func() {
				a, res := claim(r)
				if a != nil {
					keep(r.name, a)
				}
				bg <- res
			}()
			testproc.Say("> started")
		case "wait":
			testproc.Say("> %s", <-bg)
		case "files-map":
			a := get(c.Args[0])
			got := &ipc.WithFiles{Body: &ipc.MemoryFilesReply{}}
			if err := a.client.CallTimeout(time.Minute, ipc.KindMemoryFiles, &ipc.MemoryFiles{First: 0}, got); err != nil || len(got.Files) == 0 {
				testproc.Say("> err files %d %v", len(got.Files), err)
				return
			}
			mem = mapFirst(got.Files, c.Num(1), c.Num(2))
		case "peek":
			testproc.Say("> byte %d", mem[0])
		case "release":
			get(c.Args[0]).seg.Close()
			testproc.Say("> released")
		case "hangup":
			get(c.Args[0]).client.Close()
			testproc.Say("> hung")
		default:
			testproc.Say("> err unknown command %q", c.Name)
		}
	})
	return 0
}

// mapFirst maps [off, off+length) of the first of files, the backing
// files a helper was handed, closes them all, and says "> mapped" or why
// not. It returns the mapping, nil if there is none.
func mapFirst(files []*os.File, off, length uint64) []byte {
	mem, err := unix.Mmap(int(files[0].Fd()), int64(off), int(length), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	for _, f := range files {
		f.Close()
	}
	if err != nil {
		testproc.Say("> err mmap %v", err)
		return nil
	}
	testproc.Say("> mapped")
	return mem
}

// judgedInstance is a primary whose hellos' questions to the kernel are
// held (holdQuestions) and whose housekeeping is off, with pages of data
// memory allocated, and the attachments helper started beside it.
type judgedInstance struct {
	p      *primary.Primary
	h      *testproc.Proc
	asked  <-chan int
	answer func()
	pages  []hugetlb.Region
}

// startJudged starts a judgedInstance with n pages allocated.
func startJudged(t *testing.T, n int) *judgedInstance {
	t.Helper()
	asked, answer := holdQuestions(t)
	t.Cleanup(primary.SetHousekeepEvery(time.Hour))
	p, cfg := startPrimary(t, testenv.Tmpfs(t), shortSync)
	t.Cleanup(answer)
	in := &judgedInstance{p: p, asked: asked, answer: answer}
	for range n {
		r, err := p.Alloc(p.Backend().PageSize)
		require.NoError(t, err)
		in.pages = append(in.pages, r)
	}
	in.h = testproc.Start(t, "attachments", []string{cfg.Prefix, cfg.RuntimeDir})
	in.h.Expect("ready", 0)
	return in
}

// notHandedOutAgain checks that the page r, which the helper h maps and
// the primary p freed, is not handed out again (once p has released
// what it may from quarantine), and that the helper does not see a write
// to what p allocates next.
func notHandedOutAgain(t *testing.T, p *primary.Primary, h *testproc.Proc, r hugetlb.Region) {
	t.Helper()
	p.Memory().ReleaseQuarantine()
	again, err := p.Alloc(p.Backend().PageSize)
	require.NoError(t, err)
	again.Bytes()[0] = 0x22
	got := ask(t, h, "peek")
	assert.NotEqual(t, r.Addr, again.Addr, "the page the process maps is not handed out again")
	assert.NotEqual(t, "byte 34", got, "the helper does not see the new owner's write")
}

// fencesOfProcess returns the primary's fences of process pid.
func fencesOfProcess(p *primary.Primary, pid int) []shm.Proc {
	return slices.DeleteFunc(p.Segment().Holders(), func(f shm.Proc) bool { return f.PID != pid })
}

// questionAsked waits for a hello's question to the kernel, held by
// holdQuestions.
func questionAsked(t *testing.T, asked <-chan int) {
	t.Helper()
	select {
	case <-asked:
	case <-time.After(time.Minute): // a hang guard
		t.Fatal("no question to the kernel")
	}
}

// An attachment that a later hello of its process names as left is
// handed no backing file once the kernel is asked about the process: the
// answer is true of the moment the kernel read the process, and the
// attachment leaves the sync set on it, unfenced if it "reaches nothing".
// Had it been handed its files after the reading, it would map a page the
// primary then frees and hands out again while the process maps it.
func TestAnAttachmentNamedAsLeftIsHandedNoFilesOnceItsProcessIsJudged(t *testing.T) {
	in := startJudged(t, 1)
	p, h, asked, answer := in.p, in.h, in.asked, in.answer
	r := in.pages[0]
	list := p.Memory().Lists()[0]
	require.True(t, strings.HasPrefix(ask(t, h, "claim A 0"), "claimed"))
	require.Equal(t, "started", ask(t, h, "claim-bg C 1 A"))
	questionAsked(t, asked) // the kernel has read the process: it maps nothing
	got := ask(t, h, "files-map A %d %d", r.Addr-list.Base, r.Len)
	assert.Contains(t, got, "err files", "the attachment named as left is handed no files")
	assert.Contains(t, got, "left")
	answer()
	require.True(t, strings.HasPrefix(ask(t, h, "wait"), "claimed"))

	require.NoError(t, p.Free(r))
	p.Memory().ReleaseQuarantine()
	again, err := p.Alloc(p.Backend().PageSize)
	require.NoError(t, err)
	if got == "mapped" && assert.NotEqual(t, r.Addr, again.Addr, "the page the process maps is not handed out again") {
		again.Bytes()[0] = 0x22
		assert.NotEqual(t, "byte 34", ask(t, h, "peek"), "the helper does not see the new owner's write")
	}
}

// A hello that comes while another hello of its process waits for the
// kernel's word asks the kernel for itself, in its turn: here attachment
// A mapped a page after the first hello's reading and before the second
// hello, which names A as left, came; an answer taken from the first
// hello would detach A unfenced, and the page would be handed out again
// while the process maps it.
func TestAHelloWaitingItsTurnAsksTheKernelForItself(t *testing.T) {
	in := startJudged(t, 1)
	p, h, asked, answer := in.p, in.h, in.asked, in.answer
	r := in.pages[0]
	list := p.Memory().Lists()[0]
	require.True(t, strings.HasPrefix(ask(t, h, "claim K 0"), "claimed"))
	require.Equal(t, "started", ask(t, h, "claim-bg H1 1 K"))
	questionAsked(t, asked) // the reading: the process maps nothing
	require.True(t, strings.HasPrefix(ask(t, h, "claim A 0"), "claimed"), "admitted without a question")
	require.Equal(t, "mapped", ask(t, h, "files-map A %d %d", r.Addr-list.Base, r.Len))
	r.Bytes()[0] = 0x11
	require.Equal(t, "byte 17", ask(t, h, "peek"))
	require.Equal(t, "started", ask(t, h, "claim-bg H2 1 A"))
	for end := time.Now().Add(time.Minute); testenv.GoroutinesIn("primary.(*handler).judgeEarlier") < 2; time.Sleep(time.Millisecond) {
		require.True(t, time.Now().Before(end), "the second hello in the primary") // a hang guard
	}
	require.Empty(t, asked, "the second hello waits its turn")
	answer()
	require.True(t, strings.HasPrefix(ask(t, h, "wait"), "claimed"))
	require.True(t, strings.HasPrefix(ask(t, h, "wait"), "claimed"))

	t.Logf("fences of the helper after the hellos: %v", fencesOfProcess(p, h.PID()))
	require.NoError(t, p.Free(r))
	t.Logf("quarantined after the free: %d", p.Memory().Quarantined())
	notHandedOutAgain(t, p, h, r)
}

// A fence refused because the record of its process and slot names a
// later claim (shm.Segment.Fence) still keeps that record from an answer
// read before it: claim A (slot i, epoch e) lets its slot go but stays
// connected; B claims slot i again (e+1) and is fenced; a hello's question
// reads the process (maps nothing); A maps a page and is dropped by the
// free (its fence refused); the answer must not end the record (e+1), or
// the page would go back while A maps it.
func TestARefusedFenceKeepsTheRecordFromAnOlderAnswer(t *testing.T) {
	in := startJudged(t, 1)
	p, h, asked, answer := in.p, in.h, in.asked, in.answer
	r := in.pages[0]
	list := p.Memory().Lists()[0]
	var slotA, epochA, slotB, epochB int
	_, err := fmt.Sscanf(ask(t, h, "claim A 0"), "claimed %d %d", &slotA, &epochA)
	require.NoError(t, err)
	require.Equal(t, "released", ask(t, h, "release A"))
	_, err = fmt.Sscanf(ask(t, h, "claim B 0"), "claimed %d %d", &slotB, &epochB)
	require.NoError(t, err)
	require.Equal(t, slotA, slotB, "B claims A's slot again")
	require.Greater(t, epochB, epochA)
	require.Equal(t, "hung", ask(t, h, "hangup B"))
	for end := time.Now().Add(time.Minute); len(fencesOfProcess(p, h.PID())) == 0; time.Sleep(time.Millisecond) {
		require.True(t, time.Now().Before(end), "B fenced") // a hang guard
	}
	t.Logf("fences before the hello: %v", fencesOfProcess(p, h.PID()))

	require.Equal(t, "started", ask(t, h, "claim-bg C 1"))
	questionAsked(t, asked) // the reading: the process maps nothing
	require.Equal(t, "mapped", ask(t, h, "files-map A %d %d", r.Addr-list.Base, r.Len))
	r.Bytes()[0] = 0x11
	require.Equal(t, "byte 17", ask(t, h, "peek"))
	before := p.Stats().Counters
	require.NoError(t, p.Free(r)) // A answers no sync: dropped, and its fence refused
	after := p.Stats().Counters
	t.Logf("after the free: quarantined %d, fences %v, drops %d->%d, fenced %d->%d", p.Memory().Quarantined(),
		fencesOfProcess(p, h.PID()), before.SyncDrops, after.SyncDrops, before.Fenced, after.Fenced)
	assert.Equal(t, before.SyncDrops+1, after.SyncDrops, "A was dropped as live")
	require.Equal(t, 1, p.Memory().Quarantined())
	answer()
	require.True(t, strings.HasPrefix(ask(t, h, "wait"), "claimed"))
	t.Logf("after the hello: fences %v", fencesOfProcess(p, h.PID()))
	assert.NotEmpty(t, fencesOfProcess(p, h.PID()), "the process that maps the freed page keeps a fence")

	notHandedOutAgain(t, p, h, r)
}

// An attachment that a hello of its process names as left, and whose
// connection ends while the kernel reads the process, is judged by the
// hello's answer: a fence taken then, on the end of the connection (it
// still holds its slot), would stand on no answer at all, and once the
// process's new attachment maps the memory no answer could end it, so
// that everything the primary frees would stay in quarantine for as long
// as the process lives.
func TestALeftAttachmentWhoseConnectionEndsWhileItsProcessIsJudgedIsJudgedByTheHello(t *testing.T) {
	in := startJudged(t, 2)
	p, h, asked, answer := in.p, in.h, in.asked, in.answer
	r := in.pages[0]
	r2 := in.pages[1]
	list := p.Memory().Lists()[0]
	require.True(t, strings.HasPrefix(ask(t, h, "claim A 1"), "claimed"))
	require.Equal(t, "started", ask(t, h, "claim-bg C 1 A"))
	questionAsked(t, asked) // the kernel has read the process: it maps nothing
	require.Equal(t, "hung", ask(t, h, "hangup A"))
	// The end of A's connection is judged: fenced at once, or left to the
	// hello's answer.
	for end := time.Now().Add(time.Minute); len(fencesOfProcess(p, h.PID())) == 0 &&
		testenv.GoroutinesIn("primary.(*handler).awaitJudgement") == 0; time.Sleep(time.Millisecond) {
		require.True(t, time.Now().Before(end), "the end of A's connection judged") // a hang guard
	}
	answer()
	require.True(t, strings.HasPrefix(ask(t, h, "wait"), "claimed"))
	require.Equal(t, "released", ask(t, h, "release A")) // A lets its slot go, as Close does
	require.Equal(t, "mapped", ask(t, h, "files-map C %d %d", r2.Addr-list.Base, r2.Len))

	require.NoError(t, p.Free(r)) // C follows
	p.Memory().ReleaseQuarantine()
	assert.Empty(t, fencesOfProcess(p, h.PID()), "no fence of A stands: it let its memory go before C mapped")
	assert.Zero(t, p.Memory().Quarantined(), "nothing stays in quarantine for the process")
}

// A free whose sync an attachment named as left fails waits for the
// hello judging the attachment only so long: a question the kernel holds
// up past its bound (one read of /proc it does not answer) must not hold
// every change of memory, and the primary's Close, with it. Past the
// wait, the attachment is judged on its own, and fenced while it lives.
func TestAFreeWaitsForAHellosJudgementOnlySoLong(t *testing.T) {
	in := startJudged(t, 1)
	p, h, asked, answer := in.p, in.h, in.asked, in.answer
	r := in.pages[0]
	require.True(t, strings.HasPrefix(ask(t, h, "claim A 0"), "claimed"), "an attachment that answers no push")
	require.Equal(t, "started", ask(t, h, "claim-bg C 1 A"))
	questionAsked(t, asked) // held: a read the kernel does not answer

	freed := make(chan error, 1)
	go func() { freed <- p.Free(r) }()
	select {
	case err := <-freed:
		require.NoError(t, err)
	case <-time.After(time.Minute): // a hang guard
		t.Fatal("the free waits for the hello's question")
	}
	assert.NotEmpty(t, fencesOfProcess(p, h.PID()), "A, judged on its own, is fenced")
	answer()
	assert.True(t, strings.HasPrefix(ask(t, h, "wait"), "claimed"))
}

// A fence that the end of a left attachment's connection takes on no
// answer, while a hello of its process judges it, ends on the hello's
// answer where that says the process reaches nothing: the attachment was
// handed no backing file after it was marked leaving, before the kernel
// read, and once the process's new attachment maps the memory no later
// answer could end the fence. Here it is taken once the end of the
// connection has waited for the hello as long as it may
// (judgementWait), and, in the second case, by an end of connection that
// came a moment before the hello marked the attachment, and so did not
// wait for it.
func TestAFenceTakenOnNoAnswerEndsOnTheHellosAnswer(t *testing.T) {
	for _, tc := range []struct {
		name        string
		hangupFirst bool
	}{{"past the wait", false}, {"before the mark", true}} {
		t.Run(tc.name, func(t *testing.T) {
			in := startJudged(t, 2)
			p, h, asked, answer := in.p, in.h, in.asked, in.answer
			r := in.pages[0]
			r2 := in.pages[1]
			list := p.Memory().Lists()[0]
			require.True(t, strings.HasPrefix(ask(t, h, "claim A 1"), "claimed"))
			if tc.hangupFirst {
				require.Equal(t, "hung", ask(t, h, "hangup A"))
			}
			require.Equal(t, "started", ask(t, h, "claim-bg C 1 A"))
			questionAsked(t, asked) // held: the kernel has read the process, which maps nothing
			if !tc.hangupFirst {
				require.Equal(t, "hung", ask(t, h, "hangup A"))
			}
			for end := time.Now().Add(time.Minute); len(fencesOfProcess(p, h.PID())) == 0; time.Sleep(time.Millisecond) {
				require.True(t, time.Now().Before(end), "A fenced on the end of its connection") // a hang guard
			}
			answer()
			require.True(t, strings.HasPrefix(ask(t, h, "wait"), "claimed"))
			require.Equal(t, "released", ask(t, h, "release A")) // as Close does
			require.Equal(t, "mapped", ask(t, h, "files-map C %d %d", r2.Addr-list.Base, r2.Len))

			require.NoError(t, p.Free(r)) // C follows
			p.Memory().ReleaseQuarantine()
			assert.Empty(t, fencesOfProcess(p, h.PID()), "A's fence, taken on no answer, ended on the hello's")
			assert.Zero(t, p.Memory().Quarantined(), "nothing stays in quarantine for the process")
		})
	}
}
