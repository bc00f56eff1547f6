package primary_test

import (
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/test/fusetest"
	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/primary"
)

// Breaker 11: the fence of a stalled secondary ends when the kernel says
// (/proc/PID/task/TID/maps and fdinfo) that the process reaches no backing
// file, or at its next hello where the kernel will not say. These tests
// attack what "the kernel says" and "the hello says" take for granted.

func init() {
	testproc.Register("b11-sec", b11Sec)
	testproc.Register("b11-fuse", b11Fuse)
	// The command loop keeps the main thread (tid = pid, the task a check
	// in directory order asks first): the thread that unshares its file
	// table is then another.
	if os.Getenv("MPMR_TEST_HELPER") == "b11-sec" {
		runtime.LockOSThread()
	}
}

// b11Sec is a secondary process driven by commands (args: PREFIX RUNDIR
// [UID]):
//
//	attach          -> "> attached slot=N epoch=E" or "> attach-failed ERR"
//	lookup ADDR     -> "> key K" or "> err TEXT"
//	peek ADDR       -> "> byte B" or "> fault"
//	nodump          -> prctl(PR_SET_DUMPABLE, 0): "> ok"
//	wait-dropped    -> waits (bounded) for PrimaryGone: "> dropped=B"
//	keep PATH       -> opens PATH (raw fd, kept): "> fd N"
//	unkeep          -> closes the kept fds: "> ok"
//	unshare PATH    -> a thread of its own unshares its file table (a copy
//	                   of the process's, with PATH open) and serves tpeek:
//	                   "> unshared tid=T fd=N"
//	tpeek OFF       -> that thread maps PATH at OFF through its own fd and
//	                   reads a byte: "> tbyte B" or "> terr TEXT"
//	attach2 FILE    -> secondary.Attach again, the first attachment not
//	                   closed: "> attach2 before=B after=B err=TEXT", B
//	                   whether this process mapped FILE before and after
//	epoll PATH      -> opens PATH and, on a thread of its own, adds it to
//	                   an epoll set (which may block): "> epolling"
func b11Sec(args []string) int {
	if len(args) > 2 && args[2] != "" {
		uid, _ := strconv.Atoi(args[2])
		if err := testenv.BecomeUser(uid); err != nil {
			testproc.Say("become-failed %v", err)
			return 3
		}
	}
	sec := &b10Secondary{prefix: args[0], dir: args[1]}
	var kept []int
	tcmd := make(chan string)
	tans := make(chan string)
	selfMaps := func(file string) bool {
		b, _ := os.ReadFile("/proc/self/maps")
		return strings.Contains(string(b), file)
	}
	testproc.Say("ready pid=%d", os.Getpid())
	testproc.EachCommand(func(c testproc.Line) {
		switch c.Name {
		case "keep":
			fd, err := syscall.Open(c.Args[0], syscall.O_RDWR|syscall.O_CLOEXEC, 0)
			if err != nil {
				testproc.Say("> err %v", err)
				return
			}
			kept = append(kept, fd)
			testproc.Say("> fd %d", fd)
		case "unkeep":
			for _, fd := range kept {
				syscall.Close(fd)
			}
			kept = nil
			testproc.Say("> ok")
		case "unshare":
			path := c.Args[0]
			ready := make(chan string)
			go func() {
				runtime.LockOSThread() // never unlocked: the thread is this goroutine's
				if err := syscall.Unshare(syscall.CLONE_FILES); err != nil {
					ready <- fmt.Sprintf("> err unshare %v", err)
					return
				}
				fd := -1
				ents, _ := os.ReadDir("/proc/thread-self/fd")
				for _, e := range ents {
					if l, err := os.Readlink("/proc/thread-self/fd/" + e.Name()); err == nil && l == path {
						fd, _ = strconv.Atoi(e.Name())
					}
				}
				ready <- fmt.Sprintf("> unshared tid=%d fd=%d", syscall.Gettid(), fd)
				for cmd := range tcmd {
					off, _ := strconv.ParseInt(cmd, 10, 64)
					pg := int64(os.Getpagesize())
					mem, err := syscall.Mmap(fd, off&^(pg-1), int(pg), syscall.PROT_READ, syscall.MAP_SHARED)
					if err != nil {
						tans <- fmt.Sprintf("> terr %v", err)
						continue
					}
					b := mem[off&(pg-1)]
					syscall.Munmap(mem)
					tans <- fmt.Sprintf("> tbyte %d", b)
				}
			}()
			testproc.Say("%s", <-ready)
		case "tpeek":
			tcmd <- c.Args[0]
			testproc.Say("%s", <-tans)
		case "attach2":
			before := selfMaps(c.Args[0])
			s2, err := sec.attach()
			after := selfMaps(c.Args[0])
			if s2 != nil {
				s2.Close()
			}
			testproc.Say("> attach2 before=%t after=%t err=%v", before, after, err)
		case "epoll":
			fd, err := syscall.Open(c.Args[0], syscall.O_RDONLY|syscall.O_CLOEXEC, 0)
			if err != nil {
				testproc.Say("> err open %v", err)
				return
			}
			ep, err := syscall.EpollCreate1(syscall.EPOLL_CLOEXEC)
			if err != nil {
				testproc.Say("> err epoll %v", err)
				return
			}
			go func() {
				runtime.LockOSThread()
				_ = syscall.EpollCtl(ep, syscall.EPOLL_CTL_ADD, fd, &syscall.EpollEvent{Events: syscall.EPOLLIN, Fd: int32(fd)})
			}()
			testproc.Say("> epolling")
		default:
			if !sec.serve(c) {
				testproc.Say("> err unknown command %q", c.Name)
			}
		}
	})
	return 0
}

func b11Start(t *testing.T, cfg primary.Config, uid string, env ...string) *testproc.Proc {
	t.Helper()
	h := testproc.Start(t, "b11-sec", []string{cfg.Prefix, cfg.RuntimeDir, uid}, env...)
	h.Expect("ready", 0)
	return h
}

// b11FirstTask returns the task of pid that a check going through
// /proc/PID/task in directory order asks first.
func b11FirstTask(pid int) string {
	ents, _ := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	names := make([]string, 0, len(ents))
	for _, e := range ents {
		names = append(names, e.Name())
	}
	sort.Strings(names)
	if len(names) == 0 {
		return ""
	}
	return names[0]
}

// ---------------------------------------------------------------------------
// One thread's file table is not the process's.

// A secondary has a thread with a file table of its own (clone without
// CLONE_FILES, or unshare(CLONE_FILES): a copy, backing files included).
// It is stopped through a free and fenced; it resumes, is dropped, and the
// runtime unmaps the data memory and closes its backing files — in the
// table the other threads share. The thread still holds a backing file
// open, which by the quarantine's own rule means it can still reach the
// pages: the fence must hold, and the freed page must not be handed out.
func TestBreaker11ThreadWithOwnFileTableKeepsTheFence(t *testing.T) {
	p, cfg := startPrimary(t, testenv.Tmpfs(t), shortSync)
	ps := p.Backend().PageSize
	li := p.Memory().Lists()[0]
	r, err := p.Alloc(ps)
	require.NoError(t, err)
	s := b11Start(t, cfg, "")
	b10Attach(t, s)
	require.Contains(t, ask(t, s, "lookup %d", r.Addr), "key")
	ans := ask(t, s, "unshare %s", li.File)
	var tid, fd int
	_, err = fmt.Sscanf(ans, "unshared tid=%d fd=%d", &tid, &fd)
	require.NoError(t, err, ans)
	require.GreaterOrEqual(t, fd, 0, "the thread's own table holds the backing file")

	s.Stop()
	require.NoError(t, p.Free(r))
	require.Equal(t, 1, p.Memory().Quarantined(), "r waits for the stopped secondary")
	s.Continue()
	require.Equal(t, "dropped=true", ask(t, s, "wait-dropped"))
	// The drop is done: the shared table has let go, the thread's has not.
	_, err = os.Readlink(fmt.Sprintf("/proc/%d/task/%d/fd/%d", s.PID(), tid, fd))
	require.NoError(t, err, "thread %d still holds the backing file", tid)
	first := b11FirstTask(s.PID())
	t.Logf("first task asked: %s (the thread with its own table: %d)", first, tid)
	if first == strconv.Itoa(tid) {
		t.Skipf("the thread with its own table (%d) is the one asked first; the case needs another", tid)
	}

	p.Memory().ReleaseQuarantine() // a housekeeping pass, now
	assert.Equal(t, 1, p.Memory().Quarantined(),
		"the fence ended while thread %d of the fenced process holds a backing file open", tid)
	r2, err := p.Alloc(ps)
	require.NoError(t, err)
	b10Fill(r2, 0xcd)
	got := ask(t, s, "tpeek %d", uint64(r.Addr-li.Base))
	assert.False(t, b10Overlap(r, r2) && got == "tbyte 205",
		"Alloc handed r's page out again; the fenced process's thread maps it through the file it kept and reads the new owner's byte: %s", got)
}

// ---------------------------------------------------------------------------
// The hello is not the word of the old attachment.

// A secondary of the primary's user made itself undumpable, so the primary
// may not read its maps; it is stopped through a free and fenced. It
// resumes and, told it was dropped, attaches again at once — before the
// old attachment's drop has unmapped (the drop waits up to its grace for
// the open queue, during which the datapath may still write). The new
// Attach waits for the old attachment to unmap; its hello is still not
// the old attachment's word: r waits in quarantine while the old claim's
// slot is held, and goes back once the old attachment lets it go.
func TestBreaker11ReattachWhileOldAttachmentMapsUndumpable(t *testing.T) {
	requireRoot(t)
	env := userEnv(sharedTmp(t))
	uid := strconv.Itoa(victimUID)
	b := b10StartAs(t, uid, env)
	addr, length := b.alloc(1)
	r := hugetlb.Region{Addr: uintptr(addr), Len: length}
	s := b11Start(t, b.cfg, uid, env...)
	require.Equal(t, "ok", ask(t, s, "nodump"))
	b10Attach(t, s)
	require.Equal(t, "byte 0", ask(t, s, "peek %d", r.Addr), "the secondary maps r")
	s.Stop()
	require.Equal(t, "ok", b.must("free %d %d", addr, length))
	q, fenced := b.quarantined()
	require.Equal(t, 1, q, "r waits for the stopped secondary")
	require.Equal(t, 1, fenced)
	s.Continue()
	ans := ask(t, s, "attach2 mpmr.%s.msl", b.name)
	t.Logf("the second attach: %s", ans)
	require.Contains(t, ans, "before=true", "the old attachment mapped the data memory when the second attach began")
	require.Contains(t, ans, "err=<nil>", "the second attach waits for the old attachment to unmap")
	require.False(t, b.maps(s.PID(), addr), "the old attachment has unmapped")

	b.must("release")
	q, _ = b.quarantined()
	assert.Equal(t, 1, q, "a hello from the fenced process ended the fence of its old claim, whose slot is held")
	require.Equal(t, "closed <nil>", ask(t, s, "close"))
	b.must("release")
	q, _ = b.quarantined()
	assert.Zero(t, q, "the old attachment let its slot go: r goes back")
}

// The same with the secondary dumpable: the new Attach waits for the old
// attachment to unmap, so at its hello the kernel says the process
// reaches no data memory, and the fence ends there: r goes back. (Judged
// while the old attachment mapped, the fence would outlive it: the new
// attachment's mappings cannot be told from the old one's.)
func TestBreaker11ReattachWhileOldAttachmentMapsDumpable(t *testing.T) {
	p, s, r := b10FencedOverPage(t, func(cfg primary.Config) *testproc.Proc { return b11Start(t, cfg, "") })
	li := p.Memory().Lists()[0]
	ans := ask(t, s, "attach2 %s", filepath.Base(li.File))
	t.Logf("the second attach: %s", ans)
	require.Contains(t, ans, "before=true")
	require.Contains(t, ans, "err=<nil>", "the second attach waits for the old attachment to unmap")
	require.False(t, b10MapsAt(t, s.PID(), li.File, r.Addr), "the old attachment has unmapped")
	p.Memory().ReleaseQuarantine()
	assert.Zero(t, p.Memory().Quarantined(), "the old attachment had unmapped at the hello: r goes back")
}

// ---------------------------------------------------------------------------
// fdinfo asks no file system — but it may ask a lock.

// b11Fuse mounts a FUSE file system at args[0] with one regular file, "f",
// and serves it, except for FUSE_POLL, which it never answers (a hung
// server). It says "ready" once mounted, and "poll" when a poll arrives.
func b11Fuse(args []string) int { return fusetest.Serve(args, b11FuseServe) }

func b11FuseServe(fd int) {
	const (
		opLookup = 1
		opOpen   = 14
		opFlush  = 25
		opPoll   = 40
	)
	buf := make([]byte, 1<<20+4096)
	le, u32, u64 := fusetest.LE, fusetest.U32, fusetest.U64
	attr := func(b []byte, node uint64) []byte {
		mode := uint32(syscall.S_IFDIR | 0o755)
		if node != 1 {
			mode = syscall.S_IFREG | 0o666
		}
		return le(b, node, uint64(0), uint64(0), uint64(0), uint64(0), uint64(0),
			uint32(0), uint32(0), uint32(0), mode, uint32(1), uint32(0), uint32(0), uint32(0), uint32(4096), uint32(0))
	}
	for {
		n, err := syscall.Read(fd, buf)
		if err == syscall.EINTR || err == syscall.ENOENT || err == syscall.EAGAIN {
			continue
		}
		if err != nil || n < 40 {
			return
		}
		op, unique, node := u32(buf[4:]), u64(buf[8:]), u64(buf[16:])
		reply := func(errno int32, body []byte) { fusetest.Reply(fd, unique, errno, body) }
		switch op {
		case fusetest.OpForget, fusetest.OpBatchForget, fusetest.OpInterrupt:
		case fusetest.OpInit:
			reply(0, fusetest.InitReply(buf[:n]))
		case opLookup:
			name := string(buf[40:n])
			if i := strings.IndexByte(name, 0); i >= 0 {
				name = name[:i]
			}
			if node != 1 || name != "f" {
				reply(-int32(syscall.ENOENT), nil)
				continue
			}
			reply(0, attr(le(nil, uint64(2), uint64(0), uint64(0), uint64(0), uint32(0), uint32(0)), 2))
		case fusetest.OpGetattr:
			reply(0, attr(le(nil, uint64(0), uint32(0), uint32(0)), node))
		case opOpen, fusetest.OpOpendir:
			reply(0, le(nil, uint64(1), uint32(0), uint32(0)))
		case opPoll:
			testproc.Say("poll") // and never answer it
		case opFlush, fusetest.OpRelease, fusetest.OpReleasedir, fusetest.OpDestroy:
			reply(0, nil)
			if op == fusetest.OpDestroy {
				return
			}
		default:
			reply(-int32(syscall.ENOSYS), nil)
		}
	}
}

// A fenced secondary, dropped, has unmapped its data memory but still
// holds a backing file open, so its fence holds. A thread of it adds a
// file of a FUSE mount to an epoll set just as the FUSE server hangs: the
// thread waits for the server's answer to FUSE_POLL, holding the epoll
// set's mutex. Then the process closes the backing file. The next
// housekeeping pass reads the fdinfo of each of its descriptors; the
// kernel's fdinfo of an epoll set takes that mutex. The pass must not hang
// (the housekeeping goroutine also reaps dead secondaries and repairs the
// global lock; a hello of that pid runs the same check).
func TestBreaker11EpollFdinfoDoesNotHangHousekeeping(t *testing.T) {
	dir, fuse := fusetest.Mount(t, "b11-fuse")
	var st syscall.Stat_t
	require.NoError(t, syscall.Stat(dir+"/f", &st), "the FUSE server answers")

	p, cfg := startPrimary(t, testenv.Tmpfs(t), shortSync)
	ps := p.Backend().PageSize
	file := p.Memory().Lists()[0].File
	r, err := p.Alloc(ps)
	require.NoError(t, err)
	s := b11Start(t, cfg, "")
	b10Attach(t, s)
	require.Contains(t, ask(t, s, "lookup %d", r.Addr), "key")
	require.Contains(t, ask(t, s, "keep %s", file), "fd ")
	s.Stop()
	require.NoError(t, p.Free(r))
	require.Equal(t, 1, p.Memory().Quarantined())
	s.Continue()
	require.Equal(t, "dropped=true", ask(t, s, "wait-dropped"))
	p.Memory().ReleaseQuarantine()
	require.Equal(t, 1, p.Memory().Quarantined(), "it holds the backing file: the fence holds")

	require.Equal(t, "epolling", ask(t, s, "epoll %s/f", dir))
	require.Equal(t, "poll", fuse.Expect("poll", 0), "the thread waits in FUSE_POLL, the epoll mutex held")
	require.Equal(t, "ok", ask(t, s, "unkeep"))

	ok, done, _ := b10Bounded(3*time.Second, func() error { p.Memory().ReleaseQuarantine(); return nil })
	if !ok {
		t.Logf("the primary's goroutines in the check:\n%s\n---\n%s", b10Stack("hugetlb.(*Memory).reaches"),
			b10Stack("primary.(*Primary).housekeeping"))
	}
	assert.True(t, ok, "ReleaseQuarantine (and the housekeeping pass) hangs reading the fdinfo of the fenced "+
		"process's epoll set, whose mutex a thread holds while a FUSE server does not answer")
	if !ok {
		fuse.Kill() // the mount's connection aborts; the poll ends, the mutex is released
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			t.Fatal("still hung after the FUSE server died")
		}
	}
	require.Eventually(t, func() bool { return p.Memory().Quarantined() == 0 }, 5*time.Second, time.Millisecond,
		"r goes back once the check can be made")
	// The thread in FUSE_POLL dies only once the mount's connection
	// aborts.
	fuse.Kill()
	s.Kill()
	_ = s.Wait(0)
}
