package primary_test

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/instance"
	"github.com/mpmr/mpmr/internal/test/fusetest"
	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/ipc"
	"github.com/mpmr/mpmr/primary"
	"github.com/mpmr/mpmr/secondary"
	"github.com/mpmr/mpmr/shm"
)

// Breaker 10: the quarantine of pages freed while a secondary is fenced
// ends when the kernel says (/proc/PID/task/TID/maps and fdinfo) that the
// fenced process neither maps nor holds open a backing file, or when it
// dies; the primary keeps its own record of what it fenced, by pid and
// start time, and asks the kernel outside its memory lock. These tests are
// a stalled process, a careless peer and a hostile peer of the same user
// against that.

func init() {
	testproc.Register("b10-sec", b10Sec)
	testproc.Register("b10-fuse", fusetest.Helper)
	testproc.Register("b10-primary-as", func(args []string) int {
		uid, _ := strconv.Atoi(args[0])
		if err := testenv.BecomeUser(uid); err != nil {
			testproc.Say("start-failed %v", err)
			return 3
		}
		return b9Primary(args[1:])
	})
	// b10-sec may be told to end its main thread (leader-exit): it must
	// run on the main thread for that, which only init can arrange.
	if os.Getenv("MPMR_TEST_HELPER") == "b10-sec" {
		runtime.LockOSThread()
	}
}

// b10Sec is a secondary process driven by commands (args: PREFIX RUNDIR
// [UID]; with UID it becomes that user first). The command loop runs on a
// goroutine of its own, so that its main thread can leave (leader-exit)
// while the rest of the process goes on:
//
//	attach          -> "> attached slot=N epoch=E" or "> attach-failed ERR"
//	attach-bg       -> starts attaching again, keeping the first
//	                   attachment: "> started"
//	attach-bg-wait  -> what that attach gave, as attach says it
//	close-queue     -> closes the first attachment's queue: "> ok"
//	stack-has F...  -> whether a goroutine is in every frame F: "> B"
//	lookup ADDR     -> "> key K" or "> err TEXT"
//	peek ADDR       -> "> byte B" or "> fault"
//	poke ADDR B     -> "> wrote" or "> fault"
//	dropped         -> "> dropped=B"
//	wait-dropped    -> waits (bounded) for PrimaryGone: "> dropped=B"
//	close           -> "> closed ERR"
//	open PATH       -> opens PATH and keeps it open: "> fd N" or "> err"
//	nodump          -> prctl(PR_SET_DUMPABLE, 0): "> ok" or "> err"
//	dump            -> prctl(PR_SET_DUMPABLE, 1): the same
//	shutconn        -> shuts down its connection to the primary (the
//	                   process lives on): "> shut N" (sockets shut)
//	leader-exit     -> "> leaving", then its main thread exits
func b10Sec(args []string) int {
	if len(args) > 2 && args[2] != "" {
		uid, _ := strconv.Atoi(args[2])
		if err := testenv.BecomeUser(uid); err != nil {
			testproc.Say("become-failed %v", err)
			return 3
		}
	}
	leave := make(chan struct{})
	go func() {
		sec := &b10Secondary{prefix: args[0], dir: args[1]}
		var kept []*os.File
		testproc.Say("ready pid=%d", os.Getpid())
		testproc.EachCommand(func(c testproc.Line) {
			switch c.Name {
			case "open":
				f, err := os.Open(c.Args[0])
				if err != nil {
					testproc.Say("> err %v", err)
					break
				}
				kept = append(kept, f)
				testproc.Say("> fd %d", f.Fd())
			case "shutconn":
				testproc.Say("> shut %d", b10ShutConn(filepath.Join(args[1], args[0], ipc.SocketName)))
			case "leader-exit":
				testproc.Say("> leaving")
				close(leave)
			default:
				if !sec.serve(c) {
					testproc.Say("> err unknown command %q", c.Name)
				}
			}
		})
		os.Exit(0) // the whole process, whichever thread is left
	}()
	<-leave
	// Only this thread: the process lives on in its others.
	syscall.Syscall(syscall.SYS_EXIT, 0, 0, 0)
	select {}
}

// b10Secondary serves the commands the secondary helpers of these tests
// share (attach, lookup, peek, poke, dropped, wait-dropped, close, nodump,
// dump); serve reports whether c was one of them.
type b10Secondary struct {
	prefix, dir string
	s           *secondary.Secondary
	q           *secondary.Queue
	again       chan string // the answer of an attach-bg
}

func (b *b10Secondary) attach() (*secondary.Secondary, error) {
	return secondary.Attach(secondary.Config{Prefix: b.prefix, RuntimeDir: b.dir, Logger: quiet,
		AttachTimeout: 5 * time.Second})
}

func (b *b10Secondary) serve(c testproc.Line) bool {
	switch c.Name {
	case "attach":
		s, err := b.attach()
		if err != nil {
			testproc.Say("> attach-failed %v", err)
			return true
		}
		b.s, b.q = s, s.NewQueue()
		testproc.Say("> attached slot=%d epoch=%d", s.Slot(), s.Segment().Epoch())
	case "attach-bg":
		// A second attachment, made on a goroutine of its own while the
		// first one is kept (and its queue stays open).
		b.again = make(chan string, 1)
		go func() {
			s, err := b.attach()
			if err != nil {
				b.again <- fmt.Sprintf("attach-failed %v", err)
				return
			}
			b.again <- fmt.Sprintf("attached slot=%d epoch=%d", s.Slot(), s.Segment().Epoch())
		}()
		testproc.Say("> started")
	case "attach-bg-wait":
		testproc.Say("> %s", <-b.again)
	case "close-queue":
		b.q.Close()
		testproc.Say("> ok")
	case "stack-has":
		testproc.Say("> %t", b3Waiting(c.Args...))
	case "lookup":
		testproc.SayKey(b.q.Lookup(uintptr(c.Num(0))))
	case "peek":
		if v, ok := peek(uintptr(c.Num(0))); ok {
			testproc.Say("> byte %d", v)
		} else {
			testproc.Say("> fault")
		}
	case "poke":
		if poke(uintptr(c.Num(0)), byte(c.Num(1))) {
			testproc.Say("> wrote")
		} else {
			testproc.Say("> fault")
		}
	case "dropped":
		testproc.Say("> dropped=%t", b.s.Dropped())
	case "wait-dropped":
		select {
		case <-b.s.PrimaryGone():
		case <-time.After(5 * time.Second):
		}
		testproc.Say("> dropped=%t", b.s.Dropped())
	case "close":
		b.q.Close()
		testproc.Say("> closed %v", b.s.Close())
	case "nodump", "dump":
		v := 0
		if c.Name == "dump" {
			v = 1
		}
		if err := b10Prctl(syscall.PR_SET_DUMPABLE, v); err != nil {
			testproc.Say("> err %v", err)
		} else {
			testproc.Say("> ok")
		}
	default:
		return false
	}
	return true
}

func b10Prctl(op, arg int) error {
	if _, _, e := syscall.RawSyscall(syscall.SYS_PRCTL, uintptr(op), uintptr(arg), 0); e != 0 {
		return e
	}
	return nil
}

// b10ShutConn shuts down every socket of this process connected to the
// primary's socket at path, and says how many.
func b10ShutConn(path string) int {
	ents, _ := os.ReadDir("/proc/self/fd")
	n := 0
	for _, e := range ents {
		fd, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		sa, err := syscall.Getpeername(fd)
		if err != nil {
			continue
		}
		if u, ok := sa.(*syscall.SockaddrUnix); ok && u.Name == path {
			if syscall.Shutdown(fd, syscall.SHUT_RDWR) == nil {
				n++
			}
		}
	}
	return n
}

// b10Start starts a b10-sec helper (as uid, unless it is "") and waits
// for it to be ready.
func b10Start(t *testing.T, cfg primary.Config, uid string, env ...string) *testproc.Proc {
	t.Helper()
	h := testproc.Start(t, "b10-sec", []string{cfg.Prefix, cfg.RuntimeDir, uid}, env...)
	h.Expect("ready", 0)
	return h
}

// b10FencedOverPage starts a primary and a secondary helper (start makes
// it, from the primary's config), has the secondary map a new page r, and
// frees r while the secondary is stopped: the secondary is fenced and r
// waits in quarantine for it. It returns with the secondary resumed.
func b10FencedOverPage(t *testing.T, start func(primary.Config) *testproc.Proc) (*primary.Primary, *testproc.Proc, hugetlb.Region) {
	t.Helper()
	p, cfg := startPrimary(t, testenv.Tmpfs(t), shortSync)
	r, err := p.Alloc(p.Backend().PageSize)
	require.NoError(t, err)
	s := start(cfg)
	b10Attach(t, s)
	require.Equal(t, "byte 0", ask(t, s, "peek %d", r.Addr), "the secondary maps r")
	s.Stop()
	require.NoError(t, p.Free(r))
	require.Equal(t, 1, p.Memory().Quarantined(), "r waits for the stopped secondary")
	s.Continue()
	return p, s, r
}

// b10Attach has helper h attach and returns its slot and epoch.
func b10Attach(t *testing.T, h *testproc.Proc) (slot int, epoch uint32) {
	t.Helper()
	ans := ask(t, h, "attach")
	_, err := fmt.Sscanf(ans, "attached slot=%d epoch=%d", &slot, &epoch)
	require.NoError(t, err, ans)
	return slot, epoch
}

// b10Maps reports whether process (or task) dir, a /proc directory, maps
// file.
func b10Maps(t *testing.T, dir, file string) bool {
	t.Helper()
	b, err := os.ReadFile(dir + "/maps")
	require.NoError(t, err)
	return bytes.Contains(b, []byte(file))
}

// b10ReadMem reads n bytes at addr of the process (or task) of /proc
// directory dir, as a debugger would.
func b10ReadMem(t *testing.T, dir string, addr uintptr, n int) []byte {
	t.Helper()
	f, err := os.Open(dir + "/mem")
	require.NoError(t, err)
	defer f.Close()
	buf := make([]byte, n)
	_, err = f.ReadAt(buf, int64(addr))
	require.NoError(t, err)
	return buf
}

func b10Overlap(a, b hugetlb.Region) bool { return a.Addr < b.End() && b.Addr < a.End() }

// b10Fill writes v over all of r (in the primary, where it is mapped).
func b10Fill(r hugetlb.Region, v byte) { copy(r.Bytes(), bytes.Repeat([]byte{v}, int(r.Len))) }

// ---------------------------------------------------------------------------
// A fence record must not outlive the claim it was made for.

// A secondary process stopped through a free is fenced; it resumes, is
// told it was dropped, unmaps, and the quarantine ends. The application
// does what it must after ErrDropped: it closes the secondary and
// attaches again, in the same process. The new attachment follows every
// change, so what the primary frees from now on must go straight back to
// the allocator: the old fence must end with the old attachment, not with
// the process.
func TestBreaker10ReattachedProcessIsNotFencedForever(t *testing.T) {
	p, cfg := startPrimary(t, testenv.Tmpfs(t), steadySync)
	ps := p.Backend().PageSize
	r, err := p.Alloc(ps)
	require.NoError(t, err)
	s := b10Start(t, cfg, "")
	b10Attach(t, s)
	require.Contains(t, ask(t, s, "lookup %d", r.Addr), "key")

	s.Stop()
	require.NoError(t, p.Free(r))
	require.Equal(t, 1, p.Memory().Quarantined(), "r waits for the stopped secondary")
	s.Continue()
	require.Equal(t, "dropped=true", ask(t, s, "wait-dropped"))
	require.Eventually(t, func() bool { return p.Memory().ReleaseQuarantine() >= 0 && p.Memory().Quarantined() == 0 },
		5*time.Second, time.Millisecond, "the dropped secondary unmapped: r goes back")
	require.Equal(t, "closed <nil>", ask(t, s, "close"))

	// The same process attaches again, as a new, following secondary.
	b10Attach(t, s)
	drops := p.Stats().Counters.SyncDrops
	for i := range 2 * 64 {
		y, err := p.Alloc(ps)
		require.NoError(t, err, "alloc %d after the process re-attached: %d pages in quarantine", i, p.Memory().Quarantined())
		if i == 0 {
			require.Contains(t, ask(t, s, "lookup %d", y.Addr), "key", "the new attachment follows")
		}
		require.NoError(t, p.Free(y))
		require.Equal(t, drops, p.Stats().Counters.SyncDrops, "the new attachment followed every change")
		if i == 0 {
			assert.Zero(t, p.Memory().Quarantined(),
				"a page freed while every secondary follows waits in quarantine for the process fenced once")
		}
	}
}

// The same when the application attaches again at once, on the dropped
// attachment's ErrDropped, while that one still maps the data memory (its
// queue still open), and the new attachment's hello waits in the primary
// (for the changes under way, behind an Alloc) until the old one has unmapped:
// the fence must still end with the old attachment. Were it judged at a
// hello that came while the old attachment mapped, the new attachment's
// mappings would keep it for as long as the process lives, and every page
// freed meanwhile would stay in quarantine.
func TestBreaker10ReattachWhileTheDroppedAttachmentUnmaps(t *testing.T) {
	p, s, r := b10FencedOverPage(t, func(cfg primary.Config) *testproc.Proc { return b10Start(t, cfg, "") })
	ps := p.Backend().PageSize
	m := p.Memory()
	li := m.Lists()[0]

	// An Alloc waits for the memory lock; so will the hello behind it.
	m.RLock()
	allocated := make(chan error, 1)
	go func() {
		_, err := p.Alloc(ps)
		allocated <- err
	}()
	// (Or for a quarantine release under way, which waits for it: the
	// primary's housekeeping may be releasing r's batch.)
	for !b3Waiting("(*Memory).Alloc", "sync.(*RWMutex).Lock") &&
		!b3Waiting("(*Memory).Alloc", "(*Memory).releaseQuarantine", "sync.(*Mutex).Lock") {
		runtime.Gosched()
	}
	require.Equal(t, "started", ask(t, s, "attach-bg"))
	// The hello waits in the primary, or the attach waits in the
	// secondary for the dropped attachment to let go.
	for !b3Waiting("(*handler).hello", "(*Memory).HoldChanges") &&
		ask(t, s, "stack-has secondary.waitForDrops") != "true" {
		runtime.Gosched()
	}
	require.Equal(t, "ok", ask(t, s, "close-queue"))
	for b10MapsAt(t, s.PID(), li.File, r.Addr) {
		runtime.Gosched() // the dropped attachment unmaps once its queue is closed
	}
	for !b3Waiting("(*handler).hello", "(*Memory).HoldChanges") {
		runtime.Gosched()
	}
	m.RUnlock()
	require.NoError(t, <-allocated)
	require.Contains(t, ask(t, s, "attach-bg-wait"), "attached")

	m.ReleaseQuarantine()
	assert.Zero(t, m.Quarantined(), "the old attachment has unmapped: r goes back")
	y, err := p.Alloc(ps)
	require.NoError(t, err)
	require.NoError(t, p.Free(y))
	assert.Zero(t, m.Quarantined(), "a page freed while every secondary follows waits for the process fenced once")
}

// ---------------------------------------------------------------------------
// A file system that does not answer.

// b10Mount mounts a fusetest file system on a fresh directory and returns
// the directory and the server; the file system is unmounted at cleanup,
// after the server was killed.
func b10Mount(t *testing.T) (string, *testproc.Proc) {
	t.Helper()
	return fusetest.Mount(t, "b10-fuse")
}

// b10Stack returns the function names of the first goroutine of this
// process with frame in its stack.
func b10Stack(frame string) string {
	buf := make([]byte, 4<<20)
	buf = buf[:runtime.Stack(buf, true)]
	for _, g := range strings.Split(string(buf), "\n\n") {
		if strings.Contains(g, frame) {
			var keep []string
			for _, l := range strings.Split(g, "\n") {
				if !strings.HasPrefix(l, "\t") {
					keep = append(keep, l)
				}
			}
			return strings.Join(keep, "\n")
		}
	}
	return "(none)"
}

// b10Bounded runs fn and reports whether it returned within limit, and
// its error; if it did not, done is closed when it does.
func b10Bounded(limit time.Duration, fn func() error) (ok bool, done <-chan error, err error) {
	ch := make(chan error, 1)
	go func() { ch <- fn() }()
	select {
	case err := <-ch:
		return true, ch, err
	case <-time.After(limit):
		return false, ch, nil
	}
}

// A fenced secondary holds open a file on a file system whose server does
// not answer (a hung NFS or FUSE mount; here a FUSE server that is
// stopped). It resumes, learns it was dropped and unmaps its data memory.
// Deciding that it reaches no backing file must not ask that file system
// anything (a stat of /proc/PID/fd/N would follow the link and wait for
// ever), and no Alloc or Free of the instance may wait behind it.
func TestBreaker10FencedProcessWithHungFileDoesNotHangThePrimary(t *testing.T) {
	dir, fuse := b10Mount(t)
	p, cfg := startPrimary(t, testenv.Tmpfs(t), shortSync)
	ps := p.Backend().PageSize
	r, err := p.Alloc(ps)
	require.NoError(t, err)
	s := b10Start(t, cfg, "")
	b10Attach(t, s)
	require.Contains(t, ask(t, s, "lookup %d", r.Addr), "key")
	require.Contains(t, ask(t, s, "open %s", dir), "fd ", "the secondary holds a file of the FUSE mount open")

	s.Stop()
	require.NoError(t, p.Free(r))
	require.Equal(t, 1, p.Memory().Quarantined())
	fuse.Stop() // the file system's server stalls
	s.Continue()
	require.Equal(t, "dropped=true", ask(t, s, "wait-dropped"))

	var y hugetlb.Region
	ok, done, err := b10Bounded(3*time.Second, func() error {
		var err error
		y, err = p.Alloc(ps)
		return err
	})
	inStat := b3Waiting("hugetlb.(*Memory).reaches", "Stat")
	assert.True(t, ok, "Alloc hangs once a fenced process holds a file whose file system does not answer "+
		"(a goroutine of the primary stats /proc/PID/fd/N under the memory lock: %t)", inStat)
	if !ok {
		t.Logf("the primary's goroutine in the stat:\n%s", b10Stack("hugetlb.(*Memory).reaches"))
		fuse.Kill() // the mount's connection aborts; the stat fails
		select {
		case err = <-done:
		case <-time.After(5 * time.Second):
			t.Fatal("Alloc still hangs after the FUSE server died")
		}
	}
	require.NoError(t, err)
	require.NoError(t, p.Free(y))
	// The housekeeping passes, which ask the kernel, are not stuck either:
	// the secondary let go, and the page goes back.
	require.Eventually(t, func() bool { return p.Memory().Quarantined() == 0 }, 5*time.Second, time.Millisecond,
		"the quarantine ends while the file system still does not answer")
}

// ---------------------------------------------------------------------------
// /proc/PID is the thread group leader.

// b10State returns the state letter of /proc task directory dir.
func b10State(dir string) byte {
	b, err := os.ReadFile(dir + "/stat")
	if err != nil {
		return 0
	}
	i := bytes.LastIndexByte(b, ')')
	if i < 0 || i+2 >= len(b) {
		return 0
	}
	return b[i+2]
}

// b10LiveTask returns the /proc directory of a thread of pid other than
// its leader that has not exited.
func b10LiveTask(t *testing.T, pid int) string {
	t.Helper()
	ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	require.NoError(t, err)
	for _, e := range ents {
		dir := fmt.Sprintf("/proc/%d/task/%s", pid, e.Name())
		if e.Name() != strconv.Itoa(pid) && b10State(dir) != 'Z' && b10State(dir) != 0 {
			return dir
		}
	}
	t.Fatalf("pid %d has no live thread but its leader", pid)
	return ""
}

// b10StopAll stops pid with SIGSTOP and waits until each of its threads
// that has not exited is stopped (testproc's Stop waits for the leader
// too, which may have exited).
func b10StopAll(t *testing.T, pid int) {
	t.Helper()
	require.NoError(t, syscall.Kill(pid, syscall.SIGSTOP))
	t.Cleanup(func() { _ = syscall.Kill(pid, syscall.SIGCONT) })
	require.Eventually(t, func() bool {
		ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
		if err != nil {
			return false
		}
		for _, e := range ents {
			if st := b10State(fmt.Sprintf("/proc/%d/task/%s", pid, e.Name())); st != 'T' && st != 'Z' {
				return false
			}
		}
		return true
	}, 5*time.Second, 100*time.Microsecond)
}

// A secondary whose main thread has exited (pthread_exit from main in a C
// host of the library; here the raw exit of its main thread) lives on in
// its other threads, which map the data memory and follow nothing once
// stopped. /proc/PID/maps and /proc/PID/fd describe the leader, and are
// empty: the primary must ask a thread that lives, and keep the page it
// maps from the next Alloc.
func TestBreaker10SecondaryWithoutItsLeaderThreadIsStillFenced(t *testing.T) {
	p, cfg := startPrimary(t, testenv.Tmpfs(t), shortSync)
	ps := p.Backend().PageSize
	file := p.Memory().Lists()[0].File
	r, err := p.Alloc(ps)
	require.NoError(t, err)
	s := b10Start(t, cfg, "")
	b10Attach(t, s)
	require.Equal(t, "wrote", ask(t, s, "poke %d 7", r.Addr))
	require.Equal(t, "leaving", ask(t, s, "leader-exit"))
	leader := fmt.Sprintf("/proc/%d", s.PID())
	require.Eventually(t, func() bool { return b10State(leader) == 'Z' }, 5*time.Second, time.Millisecond,
		"the main thread exited")
	require.Equal(t, "byte 7", ask(t, s, "peek %d", r.Addr), "the process lives on and maps r")
	task := b10LiveTask(t, s.PID())
	require.True(t, b10Maps(t, task, file), "its threads map the backing file")
	t.Logf("/proc/PID/maps lists the backing file: %t; %s/maps: %t", b10Maps(t, leader, file), task, b10Maps(t, task, file))

	b10StopAll(t, s.PID())
	require.NoError(t, p.Free(r))
	t.Logf("secondaries fenced: %d, dropped: %d, quarantined: %d", p.Stats().Counters.Fenced,
		p.Stats().Counters.SyncDrops, p.Memory().Quarantined())
	assert.Equal(t, 1, p.Memory().Quarantined(), "r waits for the stopped secondary, which maps it")
	p.Memory().ReleaseQuarantine() // a housekeeping pass asks the kernel
	assert.Equal(t, 1, p.Memory().Quarantined(), "r still waits: the secondary's threads map it")
	r2, err := p.Alloc(ps)
	require.NoError(t, err)
	b10Fill(r2, 0xcd)
	seen := b10ReadMem(t, task, r2.Addr, 1)[0]
	assert.False(t, b10Overlap(r, r2) && seen == 0xcd,
		"Alloc handed r's page out again while the stopped secondary maps it: its thread reads the new owner's byte 0x%x", seen)
}

// ---------------------------------------------------------------------------
// Processes the primary may not look into.

// b10StartAs starts a b9-primary helper as user uid (its runtime
// directory under TMPDIR of env) and returns it as a b9Inst.
func b10StartAs(t *testing.T, uid string, env []string) *b9Inst {
	t.Helper()
	cfg := primary.Config{Prefix: testenv.Prefix(t)}
	h := testproc.Start(t, "b10-primary-as", []string{uid, cfg.Prefix, ""}, env...)
	line := h.Expect("", 0)
	b := &b9Inst{t: t, h: h, cfg: cfg}
	_, err := fmt.Sscanf(line, "ready seg=%s page=%d name=%s dir=%s", &b.seg, &b.page, &b.name, &b.dir)
	require.NoError(t, err, "%s; stderr:\n%s", line, h.Stderr())
	t.Cleanup(func() {
		h.End(5 * time.Second)
		h.Kill()
		ms, _ := filepath.Glob(filepath.Join(b.dir, "mpmr."+b.name+".*"))
		for _, m := range ms {
			os.Remove(m)
		}
	})
	return b
}

// b10ForgedUnmapped: a secondary that made itself undumpable (as programs
// that hold secrets do) is stopped through a free and fenced. A peer of
// the user then writes the secondary's Unmapped word: the declaration the
// primary falls back on where the kernel will not let it read
// /proc/PID/maps. The stopped secondary still maps r; the primary's next
// Alloc must not hand r out.
func b10ForgedUnmapped(t *testing.T, b *b9Inst, uid string, env []string, dumpable bool) {
	addr, length := b.alloc(1)
	r := hugetlb.Region{Addr: uintptr(addr), Len: length}
	s := b10Start(t, b.cfg, uid, env...)
	if dumpable {
		require.Equal(t, "ok", ask(t, s, "dump"))
	} else {
		require.Equal(t, "ok", ask(t, s, "nodump"))
	}
	slot, epoch := b10Attach(t, s)
	require.Equal(t, "byte 0", ask(t, s, "peek %d", r.Addr), "the secondary maps r")
	s.Stop()
	require.Equal(t, "ok", b.must("free %d %d", addr, length))
	q, fenced := b.quarantined()
	require.Equal(t, 1, q, "r waits for the stopped secondary")
	require.Equal(t, 1, fenced)

	at := int64(b9Table + b9SlotSize*slot)
	require.Equal(t, epoch, b.u32(at+b9SlotEpoch))
	b.put32(at+b9SlotUnmapped, epoch) // the forged declaration
	b.must("release")
	addr2, length2 := b.alloc(1)
	r2 := hugetlb.Region{Addr: uintptr(addr2), Len: length2}
	maps := b10Maps(t, fmt.Sprintf("/proc/%d", s.PID()), b.name)
	q, _ = b.quarantined()
	assert.False(t, b10Overlap(r, r2) && maps,
		"after a peer wrote the stopped, undumpable secondary's Unmapped word, Alloc handed r [0x%x, +0x%x) out again "+
			"while the secondary maps it (quarantined now: %d)", r.Addr, r.Len, q)
}

// As root (with CAP_SYS_PTRACE) the primary reads an undumpable process's
// maps: the forged word decides nothing.
func TestBreaker10UndumpableSecondaryForgedUnmappedAsRoot(t *testing.T) {
	requireRoot(t)
	b10ForgedUnmapped(t, b9Start(t), "", nil, false)
}

// A primary of an ordinary user may not read the maps of an undumpable
// process of that same user. The Unmapped word of the process table,
// which any process of the user can write, must not stand in for the
// kernel's answer: the fence holds until the process dies or attaches
// again.
func TestBreaker10UndumpableSecondaryForgedUnmappedAsUser(t *testing.T) {
	requireRoot(t)
	env := userEnv(sharedTmp(t))
	uid := strconv.Itoa(victimUID)
	b10ForgedUnmapped(t, b10StartAs(t, uid, env), uid, env, false)
}

// The same, with the secondary dumpable (the control): the primary of the
// same user reads its maps, and the forged word decides nothing.
func TestBreaker10DumpableSecondaryForgedUnmappedAsUser(t *testing.T) {
	requireRoot(t)
	env := userEnv(sharedTmp(t))
	uid := strconv.Itoa(victimUID)
	b10ForgedUnmapped(t, b10StartAs(t, uid, env), uid, env, true)
}

// ---------------------------------------------------------------------------
// What held.

// b10MapsAt reports whether process pid maps file at addr.
func b10MapsAt(t *testing.T, pid int, file string, addr uintptr) bool {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/maps", pid))
	require.NoError(t, err)
	for _, l := range strings.Split(string(b), "\n") {
		var lo, hi uint64
		if _, err := fmt.Sscanf(l, "%x-%x", &lo, &hi); err == nil && strings.Contains(l, file) &&
			uint64(addr) >= lo && uint64(addr) < hi {
			return true
		}
	}
	return false
}

// A secondary whose connection ends while it lives (here it shuts its
// socket down itself, as a careless peer might) is told it was dropped,
// serves no key and maps nothing any more; what the primary frees meanwhile
// waits until it has let go, and goes back once it has: no Alloc hands r
// out while it maps r.
func TestBreaker10ConnectionLostWhileAliveIsDroppedAndReleased(t *testing.T) {
	p, cfg := startPrimary(t, testenv.Tmpfs(t), shortSync)
	ps := p.Backend().PageSize
	file := p.Memory().Lists()[0].File
	r, err := p.Alloc(ps)
	require.NoError(t, err)
	s := b10Start(t, cfg, "")
	b10Attach(t, s)
	require.Contains(t, ask(t, s, "lookup %d", r.Addr), "key")
	require.Equal(t, "shut 1", ask(t, s, "shutconn"))
	require.NoError(t, p.Free(r))
	r2, err := p.Alloc(ps)
	require.NoError(t, err)
	assert.False(t, b10Overlap(r, r2) && b10MapsAt(t, s.PID(), file, r.Addr),
		"r handed out again while the disconnected secondary maps it")
	assert.Equal(t, "dropped=true", ask(t, s, "wait-dropped"), "it learns it was dropped")
	assert.Contains(t, ask(t, s, "lookup %d", r2.Addr), "dropped this secondary")
	assert.Equal(t, "fault", ask(t, s, "peek %d", r2.Addr))
	require.Eventually(t, func() bool { p.Memory().ReleaseQuarantine(); return p.Memory().Quarantined() == 0 },
		5*time.Second, time.Millisecond, "what waited for it goes back once it let go")
	t.Logf("fenced %d, dropped %d", p.Stats().Counters.Fenced, p.Stats().Counters.SyncDrops)
	require.NoError(t, p.Free(r2))
	assert.Zero(t, p.Memory().Quarantined(), "nothing waits for a secondary that let go and still lives")
}

// A secondary fenced while stopped, that dies: the quarantine ends, and
// the fence record goes with it — hundreds of fenced secondaries that died
// leave nothing that makes later frees wait or cost more.
func TestBreaker10FencedSecondariesThatDieLeaveNothing(t *testing.T) {
	p, cfg := startPrimary(t, testenv.Tmpfs(t), shortSync)
	ps := p.Backend().PageSize
	const rounds = 4
	for i := range rounds {
		r, err := p.Alloc(ps)
		require.NoError(t, err)
		s := b10Start(t, cfg, "")
		b10Attach(t, s)
		require.Contains(t, ask(t, s, "lookup %d", r.Addr), "key")
		s.Stop()
		require.NoError(t, p.Free(r))
		require.Equal(t, 1, p.Memory().Quarantined(), "round %d", i)
		s.Kill()
		_ = s.Wait(0)
		require.Eventually(t, func() bool { return p.Memory().Quarantined() == 0 }, 5*time.Second, time.Millisecond,
			"round %d: the quarantine ends with the fenced process", i)
	}
	assert.Equal(t, uint64(rounds), p.Stats().Counters.Fenced)
	y, err := p.Alloc(ps)
	require.NoError(t, err)
	require.NoError(t, p.Free(y))
	assert.Zero(t, p.Memory().Quarantined())
}

// The arena against the MR cache's churn: thousands of MR records made
// and freed by the primary. The owner's own record and what a read-only
// opener (the tool) reads from the segment's mirror agree, and all of it
// comes back.
func TestBreaker10ArenaOwnerAndReaderAgreeUnderChurn(t *testing.T) {
	p, _ := startPrimary(t, testenv.Tmpfs(t), func(c *primary.Config) { c.SinglePage = true })
	ps := p.Backend().PageSize
	seg := p.Segment()
	ro, _, err := shm.OpenReadOnly(shm.Options{Path: seg.Path(), LayoutTag: instance.LayoutTag})
	require.NoError(t, err)
	t.Cleanup(func() { ro.Close() })
	agree := func(when string) {
		t.Helper()
		own, seen := seg.ArenaStats(), ro.ArenaStats()
		require.Equal(t, own, seen, "%s: the owner's arena and the segment's mirror disagree", when)
		require.Equal(t, own.End-own.Start, own.UsedBytes+own.FreeBytes, "%s: bytes lost or counted twice", when)
	}
	agree("start")
	base := seg.ArenaStats()
	var regions []hugetlb.Region
	for round := range 25 {
		for range 20 {
			r, err := p.Alloc(ps * uint64(1+len(regions)%3))
			require.NoError(t, err)
			regions = append(regions, r)
			for off := uint64(0); off < r.Len; off += ps {
				_, err := p.Global().Create(uint64(r.Addr) + off)
				require.NoError(t, err)
			}
		}
		agree(fmt.Sprintf("round %d, allocated", round))
		require.Greater(t, seg.ArenaStats().Blocks, base.Blocks, "the MR records live in the arena")
		// Free every other region, then the rest: blocks freed next to
		// free neighbours on one side, then on both.
		for i := 0; i < len(regions); i += 2 {
			require.NoError(t, p.Free(regions[i]))
		}
		agree(fmt.Sprintf("round %d, half freed", round))
		for i := 1; i < len(regions); i += 2 {
			require.NoError(t, p.Free(regions[i]))
		}
		regions = regions[:0]
		agree(fmt.Sprintf("round %d, all freed", round))
	}
	end := seg.ArenaStats()
	assert.Equal(t, base.Blocks, end.Blocks, "every MR record went back")
	assert.Equal(t, base.UsedBytes, end.UsedBytes)
}
