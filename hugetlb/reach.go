package hugetlb

import (
	"bufio"
	"bytes"
	"os"
	"strconv"

	"golang.org/x/sys/unix"

	"github.com/mpmr/mpmr/shm"
)

// Whether a fenced process can still reach data memory is asked of the
// kernel: /proc/PID/maps lists every file a process maps, and
// /proc/PID/fd every file it holds open, by device and inode. The process table's words (Unmapped, State, Epoch) can be
// rewritten by any process mapping the segment, so they decide nothing
// the kernel can answer; its own declaration (Unmapped) counts only for a
// process whose maps this one may not read (another user's, or one that
// made itself undumpable).

type fileID struct {
	major, minor uint32
	ino          uint64
}

// fileIDs returns the device and inode of every backing file. The lists
// are fixed once the Memory is built; no lock is needed.
func (m *Memory) fileIDs() map[fileID]bool {
	ids := make(map[fileID]bool, len(m.lists))
	for _, l := range m.lists {
		var st unix.Stat_t
		if err := unix.Fstat(l.fd(), &st); err == nil {
			ids[fileID{unix.Major(st.Dev), unix.Minor(st.Dev), st.Ino}] = true
		}
	}
	return ids
}

// reaches reports whether process pid can reach this memory's pages: it
// maps a backing file, or holds one open (and could map it again, acting
// on a message it read late, say). known is false when the kernel would
// not say.
func (m *Memory) reaches(pid int) (reach, known bool) {
	ids := m.fileIDs()
	dir := "/proc/" + strconv.Itoa(pid)
	maps, known := mapsAny(dir+"/maps", ids)
	if maps || !known {
		return maps, known
	}
	fds, err := os.ReadDir(dir + "/fd")
	if err != nil {
		return false, os.IsNotExist(err) // gone: it holds nothing
	}
	for _, fd := range fds {
		var st unix.Stat_t
		if unix.Stat(dir+"/fd/"+fd.Name(), &st) == nil && ids[fileID{unix.Major(st.Dev), unix.Minor(st.Dev), st.Ino}] {
			return true, true
		}
	}
	return false, true
}

// mapsAny reports whether the maps file at path lists a mapping of one of
// ids.
func mapsAny(path string, ids map[fileID]bool) (maps, known bool) {
	f, err := os.Open(path)
	if err != nil {
		return false, os.IsNotExist(err) // gone: it maps nothing
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 0, 4096), 1<<20)
	for sc.Scan() {
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
		if err1 == nil && err2 == nil && ids[fileID{uint32(a), uint32(b), ino}] {
			return true, true
		}
	}
	return false, sc.Err() == nil
}

// mayReach reports whether holder h, fenced by the owner, is alive and may
// still map data memory.
func (m *Memory) mayReach(h shm.Proc) bool {
	if !shm.SameProcess(h.PID, h.Start) {
		return false
	}
	if reach, known := m.reaches(h.PID); known {
		return reach
	}
	return !h.Unmapped
}

// MayReach reports whether process pid may still map this memory (maps or
// holds open a backing file), as the kernel says, or — for a process whose maps this one may not read — as
// it declared (unmapped: it said it maps none). Primary only; safe to
// call from a subscriber (it takes no lock).
func (m *Memory) MayReach(pid int, unmapped bool) bool {
	if reach, known := m.reaches(pid); known {
		return reach
	}
	return !unmapped
}
