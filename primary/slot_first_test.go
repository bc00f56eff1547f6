package primary_test

import (
	"context"
	"errors"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/instance"
	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/ipc"
	"github.com/mpmr/mpmr/primary"
	"github.com/mpmr/mpmr/shm"
)

func init() {
	testproc.Register("slot-games", helperSlotGames)
	// slot-games may end its main thread: it must run there.
	if os.Getenv("MPMR_TEST_HELPER") == "slot-games" {
		runtime.LockOSThread()
	}
}

// helperSlotGames (args: PREFIX RUNDIR OFF LEN) claims a slot, says hello,
// takes the memory files, keeps the first open and maps [OFF, +LEN) of it:
// "> mapped B". Its commands run on a goroutine of their own:
//
//	push nack|block     -> how it answers syncs from now on: with an error
//	                       (the first way), or holding the sync until
//	                       "answer": "> ok"
//	wait-sync           -> waits for a held sync: "> sync"
//	answer [ok]         -> answers the held sync with an error (with an
//	                       acknowledgement: "ok"): "> ok"
//	forget              -> unmaps the page, closes the file: "> forgot ERR"
//	unmap               -> unmaps the page, keeps the file: "> unmapped ERR"
//	memfd               -> opens a memfd besides: "> memfd ERR"
//	release             -> lets its slot go (shm Close): "> ok"
//	reclaim             -> claims a slot again: "> slot N epoch E"
//	detach              -> sends a Detach: "> detach ERR"
//	hangup              -> closes its connection: "> ok"
//	leader-exit         -> "> leaving"; its main thread exits
//	peek                -> "> byte B", the first of the mapping (mapped
//	                       again if unmapped)
func helperSlotGames(args []string) int {
	leave := make(chan struct{})
	go func() {
		os.Exit(slotGames(args, leave))
	}()
	<-leave
	syscall.Syscall(syscall.SYS_EXIT, 0, 0, 0)
	select {}
}

func slotGames(args []string, leave chan struct{}) int {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	off, _ := strconv.ParseInt(args[2], 10, 64)
	length, _ := strconv.Atoi(args[3])
	var mu sync.Mutex
	mode := "nack"
	held := make(chan struct{}, 16)
	answers := make(chan bool, 16) // true: acknowledge
	push := ipc.PushHandlerFunc(func(context.Context, ipc.Kind, *ipc.Decoder) (any, error) {
		mu.Lock()
		m := mode
		mu.Unlock()
		if m == "block" {
			held <- struct{}{}
			if <-answers {
				return &ipc.SyncAck{}, nil
			}
		}
		return nil, errors.New("not following")
	})
	seg, client, files, err := claimHelloAndFiles(ctx, args[0], args[1], ipc.ClientConfig{Logger: quiet, PushHandler: push})
	if err != nil {
		testproc.Say("> err %v", err)
		return 3
	}
	f := files[0]
	mem, err := unix.Mmap(int(f.Fd()), off, length, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		testproc.Say("> err mmap %v", err)
		return 3
	}
	testproc.Say("> mapped %d", mem[0])
	var segs []*shm.Segment
	testproc.EachCommand(func(c testproc.Line) {
		switch c.Name {
		case "push":
			mu.Lock()
			mode = c.Args[0]
			mu.Unlock()
			testproc.Say("> ok")
		case "wait-sync":
			<-held
			testproc.Say("> sync")
		case "answer":
			answers <- len(c.Args) > 0 && c.Args[0] == "ok"
			testproc.Say("> ok")
		case "forget":
			err := unix.Munmap(mem)
			if err == nil {
				err = f.Close()
			}
			testproc.Say("> forgot %v", err)
		case "release":
			seg.Close()
			testproc.Say("> ok")
		case "reclaim":
			dir, _ := instance.Dir(args[0], args[1])
			rd, err := ipc.OpenRunDir(dir, ipc.RunDirOptions{})
			if err != nil {
				testproc.Say("> err %v", err)
				return
			}
			defer rd.Close()
			info, _ := instance.ReadInfoIn(rd)
			lockf, _ := rd.OpenFile(instance.SlotsLockFile, os.O_RDWR, 0)
			s2, err := shm.Attach(shm.Options{Path: info.Segment, LockPath: lockf.Name(), LockFile: lockf,
				LayoutTag: instance.LayoutTag, Role: shm.RoleSecondary, Logger: quiet})
			if err != nil {
				testproc.Say("> err %v", err)
				return
			}
			segs = append(segs, s2)
			testproc.Say("> slot %d epoch %d", s2.Slot(), s2.Epoch())
		case "detach":
			err := client.Call(ctx, ipc.KindDetach, &ipc.Detach{}, &ipc.DetachReply{})
			testproc.Say("> detach %v", err)
		case "hangup":
			client.Close()
			testproc.Say("> ok")
		case "leader-exit":
			testproc.Say("> leaving")
			close(leave)
		case "peek":
			if mem == nil { // what it could do at any time: map the file again
				if mem, err = unix.Mmap(int(f.Fd()), off, length, unix.PROT_READ, unix.MAP_SHARED); err != nil {
					testproc.Say("> err mmap %v", err)
					return
				}
			}
			testproc.Say("> byte %d", mem[0])
		case "unmap":
			err := unix.Munmap(mem)
			mem = nil
			testproc.Say("> unmapped %v", err)
		case "memfd":
			_, err := unix.MemfdCreate("other", 0)
			testproc.Say("> memfd %v", err)
		default:
			testproc.Say("> err unknown command %q", c.Name)
		}
	})
	return 0
}

// slotGamesOverPage starts a primary, allocates a page r (first byte
// 0x11) and a slot-games helper mapping it.
func slotGamesOverPage(t *testing.T) (*primary.Primary, *testproc.Proc, hugetlb.Region) {
	t.Helper()
	p, cfg := startPrimary(t, testenv.Tmpfs(t), shortSync)
	r, err := p.Alloc(p.Backend().PageSize)
	require.NoError(t, err)
	li := p.Memory().Lists()[0]
	r.Bytes()[0] = 0x11
	h := testproc.Start(t, "slot-games", []string{cfg.Prefix, cfg.RuntimeDir,
		strconv.FormatUint(uint64(r.Addr-li.Base), 10), strconv.FormatUint(r.Len, 10)})
	require.Equal(t, "> mapped 17", h.Expect("> ", 0))
	return p, h, r
}

// fencedAndHeld checks that the helper, which still maps r, freed, is
// fenced and r waits in quarantine, also after the kernel is asked, until
// the helper is killed.
func fencedAndHeld(t *testing.T, p *primary.Primary, h *testproc.Proc, r hugetlb.Region, fenced0 uint64) {
	t.Helper()
	assert.Greater(t, p.Stats().Counters.Fenced, fenced0, "the process that still maps the page is fenced")
	assert.Equal(t, 1, p.Memory().Quarantined(), "the freed page waits in quarantine")
	p.Memory().ReleaseQuarantine()
	assert.Equal(t, 1, p.Memory().Quarantined(), "the page stays in quarantine while it is mapped")
	assert.Equal(t, "byte 17", ask(t, h, "peek"), "it still maps the page")
	h.Kill()
	_ = h.Wait(10 * time.Second)
	p.Memory().ReleaseQuarantine()
	assert.Zero(t, p.Memory().Quarantined(), "the page goes back once the process is gone")
}

// A secondary that lets its slot go while it lives on, and then hangs up,
// fails a sync or detaches, is not taken for dead: a process that dies
// lets its slot go only once its memory is gone, one that lives may map a
// backing file it kept open at any time. It is fenced, and a page freed
// while it could reach it waits in quarantine until it is gone. So is one
// whose main thread has exited (its other threads share its memory), and
// one that claimed another slot since.
func TestASecondaryThatLetsItsSlotGoFirstIsFenced(t *testing.T) {
	answers := map[string]string{"release": "ok", "hangup": "ok", "leader-exit": "leaving",
		"answer": "ok", "reclaim": "slot ", "detach": "detach <nil>", "unmap": "unmapped <nil>", "memfd": "memfd <nil>"}
	for _, v := range []struct {
		name  string
		held  bool     // a Free waits for the helper's answer to its sync meanwhile
		steps []string // the helper's commands, in order
		gone  bool     // the primary sees the end of its connection before it frees
	}{
		{"release-then-hangup", false, []string{"release", "hangup"}, true},
		{"leader-exit-then-hangup", false, []string{"release", "leader-exit", "hangup"}, true},
		{"release-reclaim-then-hangup", false, []string{"release", "reclaim", "hangup"}, true},
		// It maps nothing, but holds the file open, beside a memfd.
		{"memfd-unmap-release-then-hangup", false, []string{"memfd", "unmap", "release", "hangup"}, true},
		{"release-then-detach", false, []string{"release", "detach"}, false},
		{"release-then-nack", false, []string{"release"}, false},
		{"release-while-sync-held-then-nack", true, []string{"release", "answer"}, false},
		{"release-while-sync-held-then-hangup", true, []string{"release", "hangup"}, false},
	} {
		t.Run(v.name, func(t *testing.T) {
			p, h, r := slotGamesOverPage(t)
			fenced0 := p.Stats().Counters.Fenced
			freed := make(chan error, 1)
			if v.held {
				require.Equal(t, "ok", ask(t, h, "push block"))
				go func() { freed <- p.Free(r) }()
				require.Equal(t, "sync", ask(t, h, "wait-sync"))
			}
			for _, c := range v.steps {
				require.True(t, strings.HasPrefix(ask(t, h, c), answers[c]), c)
				if c == "leader-exit" {
					require.Eventually(t, func() bool { return b10State("/proc/"+strconv.Itoa(h.PID())) == 'Z' }, 5*time.Second, time.Millisecond)
				}
			}
			if v.gone {
				require.Eventually(t, func() bool { return p.Stats().Counters.Secondaries == 0 }, 5*time.Second, time.Millisecond)
			}
			if v.held {
				require.NoError(t, <-freed)
			} else {
				require.NoError(t, p.Free(r))
			}
			fencedAndHeld(t, p, h, r, fenced0)
		})
	}
}
