package harness

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/instance"
	"github.com/mpmr/mpmr/shm"
)

// hugePatience bounds the wait for hugepages to come back: the kernel
// frees a hugetlbfs file's pages when its last mapping and descriptor go,
// which may trail a process's exit by an instant.
const hugePatience = 10 * time.Second

// Leftovers lists what the scenario has left behind: processes it started
// that still run (found by the tag in their environment, so their children
// count too), files of the instance in the runtime or backend directory,
// mappings or descriptors of them in this process, and on hugetlbfs
// hugepages missing from the pool. The pool check waits up to hugePatience
// and discounts other users it can see (files on hugetlbfs mounts); if the
// pool still differs while others used it, the difference is logged, not
// reported, since it cannot be attributed.
func (s *Scenario) Leftovers() []string {
	var out []string
	out = append(out, taggedProcesses(envScenario+"="+s.id)...)
	out = append(out, s.files()...)
	out = append(out, s.ownMappings()...)
	if s.huge != nil {
		if p := s.hugepages(); p != "" {
			out = append(out, p)
		}
	}
	return out
}

// taggedProcesses finds processes whose environment holds tag.
func taggedProcesses(tag string) []string {
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return []string{"cannot list /proc: " + err.Error()}
	}
	self := os.Getpid()
	want := []byte("\x00" + tag + "\x00")
	var out []string
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == self {
			continue
		}
		env, err := os.ReadFile("/proc/" + e.Name() + "/environ")
		if err != nil || !bytes.Contains(append([]byte{0}, env...), want) {
			continue
		}
		cmd, _ := os.ReadFile("/proc/" + e.Name() + "/cmdline")
		state := "running"
		if !running(pid) {
			state = "a zombie nobody reaped"
		}
		out = append(out, fmt.Sprintf("process %d (%s) is %s", pid, strings.ReplaceAll(string(bytes.TrimRight(cmd, "\x00")), "\x00", " "), state))
	}
	return out
}

// instanceDir is the instance's runtime directory.
func (s *Scenario) instanceDir() string { return filepath.Join(s.RunDir, s.Prefix) }

// Name returns the name of the scenario's instance in backend directories
// (instance.Name): its files there are mpmr.NAME.ctl, mpmr.NAME.msl0...
func (s *Scenario) Name() string { return instance.Name(s.Prefix, os.Geteuid(), s.instanceDir()) }

// SegmentPath returns the path of the instance's control segment.
func (s *Scenario) SegmentPath() string { return instance.SegmentPath(s.Backend.Dir, s.Name()) }

// backendFiles lists every file of the instance in the backend directory:
// the segment, its lock, the memseg list files, the primary's life file.
func (s *Scenario) backendFiles() []string { return instance.Files(s.Backend.Dir, s.Name()) }

func (s *Scenario) files() []string {
	var out []string
	if ents, err := os.ReadDir(s.instanceDir()); err == nil {
		names := make([]string, 0, len(ents))
		for _, e := range ents {
			names = append(names, e.Name())
		}
		out = append(out, fmt.Sprintf("runtime directory %s with %v", s.instanceDir(), names))
	} else if !os.IsNotExist(err) {
		out = append(out, fmt.Sprintf("runtime directory %s: %v", s.instanceDir(), err))
	}
	for _, m := range s.backendFiles() {
		out = append(out, "file "+m)
	}
	return out
}

// ownMappings finds mappings and descriptors of the instance's files in
// this process (the in-process primary or secondary did not let go).
func (s *Scenario) ownMappings() []string {
	mark := "mpmr." + s.Name() + "."
	var out []string
	if b, err := os.ReadFile("/proc/self/maps"); err == nil {
		sc := bufio.NewScanner(bytes.NewReader(b))
		for sc.Scan() {
			if strings.Contains(sc.Text(), mark) {
				out = append(out, "mapping in the test process: "+sc.Text())
			}
		}
	}
	if ents, err := os.ReadDir("/proc/self/fd"); err == nil {
		for _, e := range ents {
			target, err := os.Readlink("/proc/self/fd/" + e.Name())
			if err == nil && (strings.Contains(target, mark) || strings.HasPrefix(target, s.instanceDir()+"/")) {
				out = append(out, fmt.Sprintf("descriptor %s in the test process: %s", e.Name(), target))
			}
		}
	}
	return out
}

// hugeSample is the pool's state, with the part of it held by files on
// hugetlbfs mounts that are not the scenario's.
type hugeSample struct {
	name     string // the instance's name in backend directories
	pageSize uint64
	used     uint64 // Total - Free
	others   uint64 // pages in other files
	err      error
}

func takeHugeSample(name string, pageSize uint64) hugeSample {
	h := hugeSample{name: name, pageSize: pageSize}
	pool, err := hugetlb.PoolFor(pageSize)
	if err != nil {
		h.err = err
		return h
	}
	h.used = pool.Total - pool.Free
	h.others, h.err = otherHugepages("mpmr."+name+".", pageSize)
	return h
}

// otherHugepages counts the pages held by files on hugetlbfs mounts of
// pageSize whose names do not contain mark.
func otherHugepages(mark string, pageSize uint64) (uint64, error) {
	mounts, err := os.ReadFile("/proc/mounts")
	if err != nil {
		return 0, err
	}
	var bytes uint64
	sc := bufio.NewScanner(strings.NewReader(string(mounts)))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) < 4 || f[2] != "hugetlbfs" {
			continue
		}
		if ps := mountPageSize(f[3]); ps != 0 && ps != pageSize {
			continue
		}
		_ = filepath.WalkDir(f[1], func(path string, d os.DirEntry, err error) error {
			if err != nil || d.IsDir() || strings.Contains(d.Name(), mark) {
				return nil
			}
			var st syscall.Stat_t
			if syscall.Lstat(path, &st) == nil && st.Mode&syscall.S_IFMT == syscall.S_IFREG {
				bytes += uint64(st.Blocks) * 512
			}
			return nil
		})
	}
	return bytes / pageSize, nil
}

// mountPageSize reads pagesize= from hugetlbfs mount options (0 if absent:
// the default size).
func mountPageSize(opts string) uint64 {
	for _, o := range strings.Split(opts, ",") {
		if v, ok := strings.CutPrefix(o, "pagesize="); ok {
			if n, err := hugetlb.ParseSize(v); err == nil {
				return n
			}
		}
	}
	return 0
}

// hugepages waits for the pool to be back where it was, other users'
// files discounted, and describes the difference if it is not.
func (s *Scenario) hugepages() string {
	before := *s.huge
	if before.err != nil {
		return "hugepage pool unreadable before the scenario: " + before.err.Error()
	}
	deadline := time.Now().Add(hugePatience)
	var now hugeSample
	othersSeen := before.others != 0
	for {
		now = takeHugeSample(before.name, before.pageSize)
		if now.err != nil {
			return "hugepage pool unreadable: " + now.err.Error()
		}
		othersSeen = othersSeen || now.others != 0
		// Pages others took (or gave back) since explain that much.
		if now.used+before.others == before.used+now.others {
			return ""
		}
		if time.Now().After(deadline) {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	diff := fmt.Sprintf("%d hugepages in use before the scenario, %d after; other files hold %d before, %d after",
		before.used, now.used, before.others, now.others)
	if othersSeen {
		s.tb.Logf("hugepage pool not compared: other users were active (%s)", diff)
		return ""
	}
	return diff
}

// forceClean removes what the scenario left: a primary started on the
// prefix cleans up after a dead one; files it cannot reach are removed
// directly. Processes are not touched (they were killed at cleanup).
func (s *Scenario) forceClean() {
	if err := s.Recover(); err != nil {
		s.tb.Logf("harness: clean-up primary: %v", err)
	}
	seg := s.SegmentPath()
	if _, err := os.Stat(seg); err == nil {
		_ = shm.MarkDeadFile(seg)
	}
	for _, m := range s.backendFiles() {
		os.Remove(m)
	}
	os.RemoveAll(s.instanceDir())
}
