package hugetlb

import (
	"bufio"
	"bytes"
	"errors"
	"io/fs"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mpmr/mpmr/internal/sys/mounts"
	"github.com/mpmr/mpmr/shm"
)

// Whether a fenced process can still reach data memory is asked of the
// kernel: /proc/PID/task/TID/maps lists every file a process maps (by
// device and inode), and fdinfo every file it holds open (by mount and
// inode; only descriptors whose link names a file are looked at). The
// process table's words (Unmapped, State, Epoch) can be rewritten by any
// process mapping the segment, so they decide nothing. A process whose
// /proc this one may not read (another user's, or one that made itself
// undumpable) holds its fence until it dies or nobody holds its claim's
// slot any more. Nothing here follows a descriptor to its file (a stat of
// a file on a hung network mount would never return), and nothing runs
// with the memory lock held: the answers come from Housekeep, on a
// goroutine of its own, from ReleaseQuarantine, and from ReachesWithin,
// which the primary asks on the detach, the hello and the end of the
// connection of a process and on a sync it failed (and hands the hello's
// answer to ForgetHolders).

// mapID names a file as a maps line does: device and inode.
type mapID struct {
	major, minor uint32
	ino          uint64
}

// fileIDs names every backing file by device and inode. They are read
// once, the first time a question is asked, while the files are open; the
// round of questions Housekeep starts may outlive them.
func (m *Memory) fileIDs() map[mapID]bool {
	m.idsOnce.Do(func() {
		m.mapIDs = make(map[mapID]bool, len(m.lists))
		for _, l := range m.lists {
			if l.f == nil {
				continue
			}
			var st unix.Stat_t
			if err := unix.Fstat(l.fd(), &st); err == nil {
				m.mapIDs[mapID{unix.Major(st.Dev), unix.Minor(st.Dev), st.Ino}] = true
			}
		}
	})
	return m.mapIDs
}

// reaches reports whether process pid can reach this memory's pages: it
// maps a backing file, or holds one open (and could map it again, acting
// on a message it read late, say). known is false when the kernel would
// not say. Threads share their memory but not always their open files (a
// thread made without CLONE_FILES, or after unshare, has a table of its
// own), so the maps are read once, from the first thread that still has
// them (a process whose main thread has exited lives on in the others),
// and the open files of every thread.
//
// Threads that share one table of open files (all of a process's, as a
// rule) have it read once: a process with many threads and many files
// would otherwise cost threads × files reads. And a caller that cannot
// wait gives a patience (nil: none): done is false if it ran out first,
// and then reach and known say nothing.
func (m *Memory) reaches(pid int, p *patience) (reach, known, done bool) {
	dir := "/proc/" + strconv.Itoa(pid) + "/task/"
	tasks, err := os.ReadDir(dir)
	if err != nil {
		return false, errors.Is(err, fs.ErrNotExist), true // gone: it reaches nothing
	}
	ids := m.fileIDs()
	// The mounts as a thread that still runs sees them: those of a thread
	// that has exited (the main thread of a process that lives on in its
	// others, or every thread of a dead process not yet reaped) cannot be
	// read.
	var mounts map[uint64][2]uint32
	for _, t := range tasks {
		var err error
		mounts, err = mountDevices(dir+t.Name()+"/mountinfo", p)
		if errors.Is(err, os.ErrDeadlineExceeded) {
			return false, false, false
		}
		if err == nil || !errors.Is(err, fs.ErrNotExist) && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ESRCH) {
			break // read, or refused: every thread would say the same
		}
	}
	switch {
	case mounts != nil:
	case exited(dir, tasks):
		return false, true, true // dead, not yet reaped: it maps and holds nothing
	default:
		return false, false, true
	}
	mapsRead := false
	var read []int // threads whose open files were read
	for _, t := range tasks {
		if p.out() {
			return false, false, false
		}
		task := dir + t.Name()
		if !mapsRead {
			maps, empty, known, done := mapsAny(task+"/maps", ids, p)
			switch {
			case !done:
				return false, false, false
			case !known:
				return false, false, true
			case maps:
				return true, true, true
			}
			mapsRead = !empty // empty: an exited thread, no memory to show
		}
		tid, err := strconv.Atoi(t.Name())
		if err == nil && slices.ContainsFunc(read, func(r int) bool { return sameFiles(r, tid) }) {
			continue
		}
		holds, known, done := holdsAny(task, ids, mounts, p)
		if !known && exited(dir, []os.DirEntry{t}) {
			continue // an exited thread (the main one, say) holds nothing
		}
		if holds || !known || !done {
			return holds, known, done
		}
		if err == nil {
			read = append(read, tid)
		}
	}
	return false, true, true
}

// patience is how long a question about a process may take. One interval
// between two of its looks at the clock, the first longer than
// patienceStep, counts for patienceStep only: a stop of the asking process
// itself (a debugger, SIGSTOP, a CPU it did not get) then costs one step,
// not the whole allowance. Every other interval counts in full, so that a
// process that makes the kernel slow to describe it (a file with many
// locks, whose fdinfo lists them all) gains one interval at most, as it
// would against a plain deadline. A nil patience never runs out.
type patience struct {
	left     time.Duration
	at       time.Time // the last look
	forgiven bool      // an interval was counted short already
}

// patienceStep is what the one forgiven interval counts for. Looks come
// every few hundred lines or files read, well within it unless the kernel
// is slow to answer.
const patienceStep = 20 * time.Millisecond

func newPatience(d time.Duration) *patience { return &patience{left: d, at: time.Now()} }

// out counts the time since the last look and reports whether the
// allowance has run out.
func (p *patience) out() bool {
	if p == nil {
		return false
	}
	if hook := describeLook.Load(); hook != nil {
		(*hook)()
	}
	now := time.Now()
	gap := now.Sub(p.at)
	if gap > patienceStep && !p.forgiven {
		gap, p.forgiven = patienceStep, true
	}
	p.left -= gap
	p.at = now
	return p.left <= 0
}

// sameFiles reports whether threads a and b share one table of open files,
// as kcmp says. Where it cannot say (no kcmp in this kernel, or a thread
// gone), they do not.
func sameFiles(a, b int) bool {
	const kcmpFiles = 2
	r, _, e := unix.Syscall6(unix.SYS_KCMP, uintptr(a), uintptr(b), kcmpFiles, 0, 0, 0)
	return e == 0 && r == 0
}

// mapsAny reports whether the maps file at path lists a mapping of one of
// ids, and whether it lists nothing at all. A process can make its maps
// file as long as it likes (many mappings of a file at a long path): done
// is false if p ran out while it was read.
func mapsAny(path string, ids map[mapID]bool, p *patience) (maps, empty, known, done bool) {
	f, err := os.Open(path)
	if err != nil {
		return false, true, errors.Is(err, fs.ErrNotExist), true // gone: it maps nothing
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 0, 4096), 1<<20)
	empty = true
	for i := 0; sc.Scan(); i++ {
		mapsLines.Add(1)
		if i%256 == 255 && p.out() {
			return false, false, false, false
		}
		empty = false
		// address perms offset dev inode [path]
		fields := bytes.Fields(sc.Bytes())
		if len(fields) < 5 {
			continue
		}
		ino, err := strconv.ParseUint(string(fields[4]), 10, 64)
		if err != nil || ino == 0 {
			continue
		}
		maj, min, ok := bytes.Cut(fields[3], []byte{':'})
		if !ok {
			continue
		}
		a, err1 := strconv.ParseUint(string(maj), 16, 32)
		b, err2 := strconv.ParseUint(string(min), 16, 32)
		if err1 == nil && err2 == nil && ids[mapID{uint32(a), uint32(b), ino}] {
			return true, false, true, true
		}
	}
	if sc.Err() != nil {
		return false, false, false, true
	}
	return false, empty, true, true
}

// holdsAny reports whether the thread at /proc directory task holds open
// a file among ids. Only what a descriptor's link names as a file is
// looked at: the fdinfo of an epoll set, an io_uring or the like takes
// locks that a thread stuck in the kernel can hold for ever, and a backing
// file is none of those. A link names without asking the file's file
// system. fdinfo names the file by mount and inode; mounts gives each of
// the process's mounts its device, so that a file opened through another
// mount of the same file system (a bind mount, another mount namespace) is
// still found. A descriptor on a mount that no mountinfo lists (a
// memfd's, secret memory's) is no backing file unless its inode is one of
// theirs.
func holdsAny(task string, ids map[mapID]bool, mounts map[uint64][2]uint32, p *patience) (holds, known, done bool) {
	fds, err := os.ReadDir(task + "/fd")
	if err != nil {
		return false, errors.Is(err, fs.ErrNotExist), true
	}
	for i, fd := range fds {
		if i%64 == 63 && p.out() {
			return false, false, false
		}
		link, err := os.Readlink(task + "/fd/" + fd.Name())
		if err != nil || !strings.HasPrefix(link, "/") {
			continue // gone meanwhile, or a socket, pipe or anonymous inode
		}
		mnt, ino, ok := fdInfo(task + "/fdinfo/" + fd.Name())
		if !ok || !anyInode(ids, ino) {
			continue // no backing file has its inode, whatever its mount
		}
		// A backing file's inode number: the mount's device says whether
		// it is that file. A mount no mountinfo lists is one of the
		// kernel's own (a memfd's, whose inode numbers come from a counter
		// of their own) or one that came, or was detached, after the
		// mounts were read: where the kernel's own do not name it either,
		// the file is taken for a backing file.
		dev, found := mounts[mnt]
		if !found {
			dev, found = kernelMounts()[mnt]
		}
		if !found || ids[mapID{dev[0], dev[1], ino}] {
			return true, true, true
		}
	}
	return false, true, true
}

// kernelMounts returns the mount ids, and their devices, of the kernel's
// own mounts behind memfds (shmem, and hugetlb of the default size):
// files that no mountinfo lists and that processes hold as a rule. Mount
// ids are the same in every process, so they are learnt from memfds of
// this process's own, once the shmem one could be made (until then, a
// memfd with a backing file's inode number is taken for that file). A
// kind this kernel does not make is left out; so is secret memory, whose
// system call a process's seccomp filter may kill it for.
func kernelMounts() map[uint64][2]uint32 {
	kmounts.Lock()
	defer kmounts.Unlock()
	if kmounts.learnt {
		return kmounts.ids
	}
	ids := map[uint64][2]uint32{}
	learn := func(flags int) bool {
		fd, err := unix.MemfdCreate("mpmr-mount", unix.MFD_CLOEXEC|flags)
		if err != nil {
			return false
		}
		defer unix.Close(fd)
		var st unix.Stat_t
		mnt, _, ok := mounts.FDInfo("/proc/self/fdinfo/" + strconv.Itoa(fd))
		if !ok || unix.Fstat(fd, &st) != nil {
			return false
		}
		ids[mnt] = [2]uint32{unix.Major(st.Dev), unix.Minor(st.Dev)}
		return true
	}
	kmounts.learnt = learn(0)
	learn(unix.MFD_HUGETLB)
	kmounts.ids = ids
	return ids
}

// kmounts holds what kernelMounts learnt.
var kmounts struct {
	sync.Mutex
	learnt bool
	ids    map[uint64][2]uint32
}

// anyInode reports whether one of ids has inode ino.
func anyInode(ids map[mapID]bool, ino uint64) bool {
	for id := range ids {
		if id.ino == ino {
			return true
		}
	}
	return false
}

// exited reports whether every one of the tasks in /proc directory dir has
// exited (a zombie, or dead) or gone.
func exited(dir string, tasks []os.DirEntry) bool {
	for _, t := range tasks {
		b, err := os.ReadFile(dir + t.Name() + "/stat")
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		// pid (comm) state ...: comm may hold anything, the state
		// follows its last ')'.
		i := bytes.LastIndexByte(b, ')')
		if err != nil || i < 0 || i+2 >= len(b) || b[i+2] != 'Z' && b[i+2] != 'X' {
			return false
		}
	}
	return true
}

// mountDevices reads a thread's mountinfo: each mount's id and the
// major:minor of its file system. Reading it asks no file system. That of
// a thread that is gone (ENOENT) or has exited (EINVAL) cannot be read.
// A process can have as many mounts as it likes (in a namespace of its
// own): once p runs out it gives up, with an error matching
// os.ErrDeadlineExceeded.
func mountDevices(path string, p *patience) (map[uint64][2]uint32, error) {
	info, err := mounts.ReadInfoUntil(path, p.out)
	if err != nil {
		return nil, err
	}
	out := make(map[uint64][2]uint32, len(info))
	for id, m := range info {
		out[id] = m.Dev
	}
	return out, nil
}

// describeLook, when set (by tests), runs as a bounded question about a
// process looks at the clock: where its process may stop.
var describeLook atomic.Pointer[func()]

// mapsLines counts the lines of maps files read, for tests.
var mapsLines atomic.Int64

// fdInfos counts the fdinfo entries read, for tests.
var fdInfos atomic.Int64

// fdInfo reads the mount and inode of an open file from its fdinfo entry
// (see mounts.FDInfo), counting the reads.
func fdInfo(path string) (mnt, ino uint64, ok bool) {
	fdInfos.Add(1)
	return mounts.FDInfo(path)
}

// Reaches reports whether process pid maps or holds open a backing file of
// this memory, by the kernel's word; known is false when the kernel will
// not say (another user's process, or one that made itself undumpable).
// Primary only; it takes no lock.
func (m *Memory) Reaches(pid int) (reach, known bool) {
	reach, known, _ = m.reaches(pid, nil)
	return reach, known
}

// ReachesWithin is Reaches for a caller that cannot wait: done is false
// if the kernel's description of the process took longer than d (a
// process can hold a great many files open), and then reach and known say
// nothing. One stop of this process meanwhile counts for patienceStep
// only (see patience).
func (m *Memory) ReachesWithin(pid int, d time.Duration) (reach, known, done bool) {
	return m.reaches(pid, newPatience(d))
}

// mayReach reports whether holder h, fenced by the owner, is alive and may
// still reach data memory. Where the kernel will not say, it may until it
// dies or nobody holds its claim's slot (a secondary lets its slot go only
// after it has unmapped its memory): the process table's declaration
// (Unmapped) could have been written by any process mapping the segment.
func (m *Memory) mayReach(h shm.Proc) bool {
	if !shm.SameProcess(h.PID, h.Start) {
		return false
	}
	reach, known, _ := m.reaches(h.PID, nil)
	return reach || !known && m.seg.Alive(h.Slot)
}

// ForgetHolders ends those of fences (of one process, as Holders gave them)
// that the kernel's answer reach and known (ReachesWithin's, asked whole,
// after fences were read) shows let go (a record that a fence changed since
// it was read stays; see shm.Segment.Forget). The primary calls it when a
// fenced process attaches again: the new attachment maps the data memory
// only after the hello, at the addresses the old one used, so what the
// process reaches before then is the old attachments'; an answer given in
// part must not be passed in (once the new attachment maps the memory, no
// answer could tell the two apart), nor fences read after the kernel was
// asked (one made while it read may be of an attachment that maps what the
// reading had passed).
// Where the kernel will not say (another user's process, or one that made
// itself undumpable), a fence ends only once nobody holds the old claim's
// slot: a secondary lets its slot go after it has unmapped its memory. A
// fence that has come to name a later claim of its slot meanwhile, or
// whose record another fence changed, stays (see shm.Segment.Forget). Primary only; it takes no lock.
func (m *Memory) ForgetHolders(fences []shm.Proc, reach, known bool) {
	for _, h := range fences {
		if !reach && (known || !m.seg.Alive(h.Slot)) {
			m.seg.Forget(h)
		}
	}
}
