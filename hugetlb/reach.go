package hugetlb

import (
	"bufio"
	"bytes"
	"errors"
	"io/fs"
	"os"
	"strconv"

	"golang.org/x/sys/unix"

	"github.com/mpmr/mpmr/shm"
)

// Whether a fenced process can still reach data memory is asked of the
// kernel: /proc/PID/task/TID/maps lists every file a process maps (by
// device and inode), and .../fdinfo every file it holds open (by mount and
// inode). The process table's words (Unmapped, State, Epoch) can be
// rewritten by any process mapping the segment, so they decide nothing.
// A process whose /proc this one may not read (another user's, or one that
// made itself undumpable) holds its fence until it dies or attaches again
// (see ForgetHolder). Nothing here follows a descriptor to its file
// (a stat of a file on a hung network mount would never return), and
// nothing runs with the memory lock held: the answers come from
// ReleaseQuarantine, on the housekeeping goroutine, and from
// ForgetHolder, on the hello of a process attaching again.

// mapID names a backing file as a maps line does; fdID as fdinfo does.
type mapID struct {
	major, minor uint32
	ino          uint64
}

type fdID struct {
	mnt, ino uint64
}

// fileIDs names every backing file both ways. The lists are fixed once
// the Memory is built; no lock is needed.
func (m *Memory) fileIDs() (map[mapID]bool, map[fdID]bool) {
	maps, fds := make(map[mapID]bool, len(m.lists)), make(map[fdID]bool, len(m.lists))
	for _, l := range m.lists {
		var st unix.Stat_t
		if err := unix.Fstat(l.fd(), &st); err != nil {
			continue
		}
		maps[mapID{unix.Major(st.Dev), unix.Minor(st.Dev), st.Ino}] = true
		if mnt, ino, ok := fdInfo("/proc/self/fdinfo/" + strconv.Itoa(l.fd())); ok {
			fds[fdID{mnt, ino}] = true
		}
	}
	return maps, fds
}

// reaches reports whether process pid can reach this memory's pages: it
// maps a backing file, or holds one open (and could map it again, acting
// on a message it read late, say). known is false when the kernel would
// not say. A process whose main thread has exited lives on in its other
// threads, which share its memory: the first thread that still has a
// memory map answers.
func (m *Memory) reaches(pid int) (reach, known bool) {
	dir := "/proc/" + strconv.Itoa(pid) + "/task/"
	tasks, err := os.ReadDir(dir)
	if err != nil {
		return false, errors.Is(err, fs.ErrNotExist) // gone: it reaches nothing
	}
	mapIDs, fdIDs := m.fileIDs()
	for _, t := range tasks {
		task := dir + t.Name()
		maps, empty, known := mapsAny(task+"/maps", mapIDs)
		if !known {
			return false, false
		}
		if empty {
			continue // an exited thread: no memory of its own to show
		}
		if maps {
			return true, true
		}
		return holdsAny(task+"/fdinfo/", fdIDs)
	}
	return false, true
}

// mapsAny reports whether the maps file at path lists a mapping of one of
// ids, and whether it lists nothing at all.
func mapsAny(path string, ids map[mapID]bool) (maps, empty, known bool) {
	f, err := os.Open(path)
	if err != nil {
		return false, true, errors.Is(err, fs.ErrNotExist) // gone: it maps nothing
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 0, 4096), 1<<20)
	empty = true
	for sc.Scan() {
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
			return true, false, true
		}
	}
	if sc.Err() != nil {
		return false, false, false
	}
	return false, empty, true
}

// holdsAny reports whether the fdinfo directory at dir names an open file
// among ids.
func holdsAny(dir string, ids map[fdID]bool) (holds, known bool) {
	fds, err := os.ReadDir(dir)
	if err != nil {
		return false, errors.Is(err, fs.ErrNotExist)
	}
	for _, fd := range fds {
		if mnt, ino, ok := fdInfo(dir + fd.Name()); ok && ids[fdID{mnt, ino}] {
			return true, true
		}
	}
	return false, true
}

// fdInfo reads the mount and inode of an open file from its fdinfo entry,
// which the kernel writes without asking the file's file system.
func fdInfo(path string) (mnt, ino uint64, ok bool) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, 0, false
	}
	var haveMnt, haveIno bool
	for line := range bytes.SplitSeq(b, []byte{'\n'}) {
		k, v, found := bytes.Cut(line, []byte{':'})
		if !found {
			continue
		}
		n, err := strconv.ParseUint(string(bytes.TrimSpace(v)), 10, 64)
		switch {
		case err != nil:
		case string(k) == "mnt_id":
			mnt, haveMnt = n, true
		case string(k) == "ino":
			ino, haveIno = n, true
		}
	}
	return mnt, ino, haveMnt && haveIno
}

// mayReach reports whether holder h, fenced by the owner, is alive and may
// still reach data memory. Where the kernel will not say, it may until it
// dies: the process table's declaration (Unmapped) could have been written
// by any process mapping the segment.
func (m *Memory) mayReach(h shm.Proc) bool {
	if !shm.SameProcess(h.PID, h.Start) {
		return false
	}
	reach, known := m.reaches(h.PID)
	return reach || !known
}

// ForgetHolder ends the fences of process pid if it reaches no data memory
// any more, and reports whether it holds none. The primary calls it when
// pid attaches again: the new attachment maps the data memory only after
// the hello, at the addresses the old one used, so what the process
// reaches before then is the old attachment's. Where the kernel will not
// say (another user's process, or one that made itself undumpable), the
// hello itself is the word: the process, authenticated by its connection,
// attaches again, which the runtime does only once the old attachment has
// let go. Primary only; it takes no lock.
func (m *Memory) ForgetHolder(pid int) bool {
	free := true
	for _, h := range m.seg.Holders() {
		if h.PID != pid {
			continue
		}
		if reach, known := m.reaches(pid); reach && known {
			free = false
			continue
		}
		m.seg.Forget(h)
	}
	return free
}
