package hugetlb_test

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/shm"
)

// A bounded question counts the time it takes, not the time its own
// process was stopped (a debugger, SIGSTOP, a CPU it did not get): a
// primary stopped longer than the allowance while it asks about a
// detaching secondary still gets its answer, and does not fence the
// secondary for want of one.
func TestABoundedQuestionDoesNotCountItsOwnStop(t *testing.T) {
	in := newInstance(t, testenv.Tmpfs(t), hugetlb.ListConfig{Pages: 4})
	_, err := in.mem.Alloc(in.mem.Lists()[0].PageSize)
	require.NoError(t, err)
	hugetlb.StallDescribingOnce(300 * time.Millisecond)
	t.Cleanup(hugetlb.NoDescribingStall)
	reach, known, done := in.mem.ReachesWithin(os.Getpid(), 100*time.Millisecond)
	assert.True(t, done, "stopped 300 ms with 100 ms allowed: the stop is not the question's")
	assert.True(t, known)
	assert.True(t, reach, "this process maps the memory")
}

// Only one interval between looks is forgiven as a stop: a process that
// makes the kernel slow to describe it (a file with many locks, whose
// fdinfo lists them all) gains one interval over the allowance at most,
// as against a plain deadline. Every interval here is 100 ms with 100 ms
// allowed: the first counts as a stop, the second ends the question.
func TestAProcessSlowToDescribeGainsOneIntervalAtMost(t *testing.T) {
	in := newInstance(t, testenv.Tmpfs(t), hugetlb.ListConfig{Pages: 4})
	_, err := in.mem.Alloc(in.mem.Lists()[0].PageSize)
	require.NoError(t, err)
	h := testproc.Start(t, "many-files", []string{"1000", "0"})
	require.Equal(t, "ready", h.Expect("", 30*time.Second))
	looks := hugetlb.StallDescribingEvery(100 * time.Millisecond)
	t.Cleanup(hugetlb.NoDescribingStall)
	_, _, done := in.mem.ReachesWithin(h.PID(), 100*time.Millisecond)
	assert.False(t, done, "two intervals of 100 ms with 100 ms allowed")
	assert.Equal(t, int64(2), looks(), "the question went on past its second interval")
}

func init() { testproc.Register("many-files", helperManyFiles) }

// helperManyFiles opens args[0] descriptors of /dev/null, parks args[1]
// goroutines each on a thread of its own, says "ready" and waits for its
// input to end. It maps no data memory.
func helperManyFiles(args []string) int {
	files, _ := strconv.Atoi(args[0])
	threads, _ := strconv.Atoi(args[1])
	var open []*os.File
	for range files {
		f, err := os.Open(os.DevNull)
		if err != nil {
			testproc.Say("open-failed %v", err)
			return 3
		}
		open = append(open, f)
	}
	park := make(chan struct{})
	for range threads {
		started := make(chan struct{})
		go func() {
			runtime.LockOSThread()
			close(started)
			<-park
		}()
		<-started
	}
	testproc.Say("ready")
	testproc.Commands().Scan() // until the test ends
	close(park)
	runtime.KeepAlive(open)
	return 0
}

// The threads of a process share one table of open files, as a rule: it
// is read once, not once a thread. Here 40 threads hold 1,000 files.
func TestReachesReadsASharedTableOfFilesOnce(t *testing.T) {
	in := newInstance(t, testenv.Tmpfs(t), hugetlb.ListConfig{Pages: 4})
	const files, threads = 1000, 40
	h := testproc.Start(t, "many-files", []string{strconv.Itoa(files), strconv.Itoa(threads)})
	h.Expect("ready", 0)
	tasks, err := os.ReadDir("/proc/" + strconv.Itoa(h.PID()) + "/task")
	require.NoError(t, err)
	require.GreaterOrEqual(t, len(tasks), threads)

	before := hugetlb.FDInfosRead()
	reach, known := in.mem.Reaches(h.PID())
	assert.True(t, known)
	assert.False(t, reach, "it maps and holds nothing of the memory")
	read := hugetlb.FDInfosRead() - before
	assert.GreaterOrEqual(t, read, int64(files), "every file is looked at")
	assert.Less(t, read, int64(2*files), "%d threads, one table: read once", len(tasks))
}

func init() { testproc.Register("memfd-holder", helperMemfdHolder) }

// helperMemfdHolder (args: PATH) holds a memfd open at descriptor 100 and
// the file PATH at 999, so that the memfd comes first in /proc/PID/fd; the
// memfd's inode is not PATH's. It says "ready"; "close" closes the file
// ("> closed").
func helperMemfdHolder(args []string) int {
	f, err := os.Open(args[0])
	if err != nil {
		testproc.Say("err %v", err)
		return 3
	}
	var st, mst unix.Stat_t
	_ = unix.Fstat(int(f.Fd()), &st)
	for mst.Ino = st.Ino; mst.Ino == st.Ino; {
		m, err := unix.MemfdCreate("other", 0)
		if err == nil {
			err = unix.Fstat(m, &mst)
		}
		if err == nil {
			err = unix.Dup2(m, 100)
		}
		if err != nil {
			testproc.Say("err %v", err)
			return 3
		}
	}
	if err := unix.Dup2(int(f.Fd()), 999); err != nil {
		testproc.Say("err %v", err)
		return 3
	}
	f.Close()
	testproc.Say("ready")
	testproc.EachCommand(func(testproc.Line) {
		_ = unix.Close(999)
		testproc.Say("> closed")
	})
	return 0
}

// A descriptor on a mount the process's mountinfo does not list, a
// memfd's, hides nothing: the kernel's answer goes on past it to the
// backing file the process holds, and without that file says it reaches
// nothing. (Taken for "the kernel will not say", it ended the fence of a
// process that had let its slot go and still held a backing file.)
func TestAMemfdHidesNoBackingFile(t *testing.T) {
	in := newInstance(t, testenv.Tmpfs(t), hugetlb.ListConfig{Pages: 4})
	h := testproc.Start(t, "memfd-holder", []string{in.mem.Lists()[0].File})
	h.Expect("ready", 0)
	reach, known := in.mem.Reaches(h.PID())
	assert.True(t, known, "a memfd does not make the answer unknown")
	assert.True(t, reach, "it holds a backing file")
	h.Send("close")
	h.Expect("> closed", 0)
	reach, known = in.mem.Reaches(h.PID())
	assert.True(t, known)
	assert.False(t, reach, "a memfd is no backing file")
}

func init() { testproc.Register("memfd-twin", helperMemfdTwin) }

// helperMemfdTwin (args: INODE) holds a memfd whose inode number is INODE,
// and nothing else of note: "ready" (or "cannot ERR").
func helperMemfdTwin(args []string) int {
	ino, _ := strconv.ParseUint(args[0], 10, 64)
	fd, err := testenv.MemfdWithInode(ino)
	if err != nil {
		testproc.Say("cannot %v", err)
		return 0
	}
	testproc.Say("ready")
	testproc.Commands().Scan()
	runtime.KeepAlive(fd)
	return 0
}

// A memfd whose inode number is a backing file's (tmpfs numbers are small,
// and so are the kernel's shmem mount's) is no backing file: its mount,
// which no mountinfo lists, is the kernel's own. A process that holds only
// such a memfd reaches nothing, and a page quarantined for it goes back.
func TestAMemfdWithABackingFilesInodeIsNoBackingFile(t *testing.T) {
	in := newInstance(t, testenv.Tmpfs(t), hugetlb.ListConfig{Pages: 4})
	var st unix.Stat_t
	require.NoError(t, unix.Stat(in.mem.Lists()[0].File, &st))
	h := testproc.Start(t, "memfd-twin", []string{strconv.FormatUint(st.Ino, 10)})
	if line := h.Expect("", 0); line != "ready" {
		t.Skipf("no memfd with the backing file's inode %d can be made here: %s", st.Ino, line)
	}
	reach, known := in.mem.Reaches(h.PID())
	assert.True(t, known)
	assert.False(t, reach, "a process holding only a memfd with a backing file's inode number (%d)", st.Ino)
	quarantineFor(t, in, h.PID())
	in.mem.ReleaseQuarantine()
	assert.Zero(t, in.mem.Quarantined(), "the page waits in quarantine for a process that reaches nothing")
}

func init() { testproc.Register("many-maps", helperManyMaps) }

// helperManyMaps (args: DIR N) maps one page of a file of its own, at a
// path about 4,000 bytes long under DIR, N times, so that its maps file is
// N long lines, and says "ready".
func helperManyMaps(args []string) int {
	p := args[0]
	for comp := strings.Repeat("d", 250); len(p)+260 < 4000; {
		p = filepath.Join(p, comp)
	}
	f, err := os.Create(filepath.Join(p, "f"))
	if os.IsNotExist(err) {
		if err = os.MkdirAll(p, 0o755); err == nil {
			f, err = os.Create(filepath.Join(p, "f"))
		}
	}
	if err == nil {
		err = f.Truncate(int64(os.Getpagesize()))
	}
	n, _ := strconv.Atoi(args[1])
	for i := 0; err == nil && i < n; i++ {
		_, err = unix.Mmap(int(f.Fd()), 0, os.Getpagesize(), unix.PROT_READ, unix.MAP_SHARED)
	}
	if err != nil {
		testproc.Say("err %v", err)
		return 3
	}
	testproc.Say("ready")
	testproc.Commands().Scan()
	return 0
}

// Any process can make its maps file hundreds of megabytes long (a file
// at a long path, mapped many times): a caller that cannot wait is told
// the answer did not come in time, however long the maps file.
func TestReachesWithinGivesUpInALongMapsFile(t *testing.T) {
	in := newInstance(t, testenv.Tmpfs(t), hugetlb.ListConfig{Pages: 4})
	h := testproc.Start(t, "many-maps", []string{t.TempDir(), "32000"})
	require.Equal(t, "ready", h.Expect("", 30*time.Second))
	before := hugetlb.MapsLinesRead()
	_, _, done := in.mem.ReachesWithin(h.PID(), 20*time.Millisecond)
	assert.False(t, done, "the deadline passed while the maps (some 125 MB) were read")
	assert.Less(t, hugetlb.MapsLinesRead()-before, int64(16000), "the maps were read on past the deadline")
}

// A caller that cannot wait is told the answer did not come in time, not
// a wrong answer.
func TestReachesWithinGivesUpAtTheDeadline(t *testing.T) {
	in := newInstance(t, testenv.Tmpfs(t), hugetlb.ListConfig{Pages: 4})
	_, err := in.mem.Alloc(in.mem.Lists()[0].PageSize)
	require.NoError(t, err)
	_, _, done := in.mem.ReachesWithin(os.Getpid(), -time.Nanosecond)
	assert.False(t, done, "no time at all")
	reach, known, done := in.mem.ReachesWithin(os.Getpid(), time.Minute)
	assert.True(t, done)
	assert.True(t, known)
	assert.True(t, reach, "this process maps the memory")
}

func init() {
	testproc.Register("leader-exited", helperLeaderExited)
	// The helper's main thread must be the one that exits: only init can
	// keep the main goroutine on it.
	if os.Getenv("MPMR_TEST_HELPER") == "leader-exited" {
		runtime.LockOSThread()
	}
}

// helperLeaderExited ends its main thread and lives on in its others; it maps
// no data memory and holds no backing file. It says "ready" once the
// main thread is gone, and waits for its input to end.
func helperLeaderExited([]string) int {
	go func() {
		for {
			b, _ := os.ReadFile(fmt.Sprintf("/proc/self/task/%d/stat", os.Getpid()))
			if i := bytes.LastIndexByte(b, ')'); i < 0 || i+2 >= len(b) || b[i+2] == 'Z' {
				break
			}
			time.Sleep(time.Millisecond)
		}
		testproc.Say("ready")
		testproc.Commands().Scan()
		os.Exit(0)
	}()
	syscall.Syscall(syscall.SYS_EXIT, 0, 0, 0) // this thread only
	select {}
}

// processState returns the state letter of /proc/PID.
func processState(pid int) byte {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	i := bytes.LastIndexByte(b, ')')
	if i < 0 || i+2 >= len(b) {
		return 0
	}
	return b[i+2]
}

// quarantineFor fences pid on the slot held by another attachment of the
// segment (a slot the fenced claim let go of, claimed again: by the same
// process re-attaching, or by anyone), and frees a page: it waits in
// quarantine for pid.
func quarantineFor(t *testing.T, in *instance, pid int) {
	t.Helper()
	r, err := in.mem.Alloc(in.mem.Lists()[0].PageSize)
	require.NoError(t, err)
	again, err := shm.Attach(in.opts) // holds a slot, as the claim after the fenced one does
	require.NoError(t, err)
	t.Cleanup(func() { again.Close() })
	require.True(t, in.seg.Fence(again.Slot(), 1000, pid, testenv.ProcessStart(t, pid)))
	require.NoError(t, in.mem.Free(r))
	require.Equal(t, 1, in.mem.Quarantined())
}

// A fenced secondary that died is a zombie until its parent reaps it. It
// reaches nothing, and the kernel says so: its maps are empty, it has no
// open files; only its mounts cannot be read. Were it taken for a process
// the kernel will not describe, its fence would last for as long as
// anyone holds its old slot: the next secondary to attach claims the
// first free slot, which is the dead one's.
func TestAZombieHolderReachesNothing(t *testing.T) {
	in := newInstance(t, testenv.Tmpfs(t), hugetlb.ListConfig{Pages: 4})
	cmd := exec.Command("sleep", "1000")
	require.NoError(t, cmd.Start())
	pid := cmd.Process.Pid
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	quarantineFor(t, in, pid)

	require.NoError(t, cmd.Process.Kill())
	require.Eventually(t, func() bool { return processState(pid) == 'Z' }, 5*time.Second, time.Millisecond)

	reach, known := in.mem.Reaches(pid)
	assert.True(t, known, "a zombie is described: empty maps, no open files")
	assert.False(t, reach)
	assert.Equal(t, 1, in.mem.ReleaseQuarantine(), "the fenced process is dead (a zombie): the page goes back")
	assert.Empty(t, in.seg.Holders())
}

// The same for a live process whose main thread has exited (pthread_exit
// from main in a C host): its mounts are read from a thread that lives.
// Re-attaching, such a process claims its old slot again (the first free
// one); were it taken for one the kernel will not describe, its old fence
// would last as long as the new attachment, which follows every change.
func TestAHolderWhoseMainThreadExitedIsDescribed(t *testing.T) {
	in := newInstance(t, testenv.Tmpfs(t), hugetlb.ListConfig{Pages: 4})
	h := testproc.Start(t, "leader-exited", nil)
	h.Expect("ready", 0)
	quarantineFor(t, in, h.PID())

	reach, known := in.mem.Reaches(h.PID())
	assert.True(t, known, "its live threads are described: maps and open files")
	assert.False(t, reach, "it maps and holds nothing of the memory")
	assert.Equal(t, 1, in.mem.ReleaseQuarantine(), "it reaches nothing: the page goes back")
	assert.Empty(t, in.seg.Holders())
}

// Such a process runs: its main thread is a zombie, its other threads are
// not, and they share its memory.
func TestAProcessWhoseMainThreadExitedRuns(t *testing.T) {
	h := testproc.Start(t, "leader-exited", nil)
	h.Expect("ready", 0)
	require.Equal(t, byte('Z'), processState(h.PID()))
	st, err := shm.ProcessStart(h.PID())
	require.NoError(t, err)
	assert.True(t, shm.Running(h.PID(), st))
}
