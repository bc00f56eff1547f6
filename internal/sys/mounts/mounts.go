// Package mounts reads the mount table and opens directories without
// asking the file systems that might not answer.
package mounts

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// Entry is one mount: where, and what type of file system.
type Entry struct {
	Dir  string
	Type string
}

// Table is the mount table, in the order the kernel lists it: a later
// mount at a directory hides an earlier one.
type Table []Entry

// Read reads this process's mount table (/proc/self/mounts), which the
// kernel writes without asking any file system.
func Read() (Table, error) {
	f, err := os.Open("/proc/self/mounts")
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var t Table
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) >= 3 {
			t = append(t, Entry{Dir: Unescape(fields[1]), Type: fields[2]})
		}
	}
	return t, sc.Err()
}

// At returns the mount that holds the clean absolute path p: the last one
// listed at the longest directory that is p or a parent of it.
func (t Table) At(p string) Entry {
	var best Entry
	for _, e := range t {
		if (p == e.Dir || e.Dir == "/" || strings.HasPrefix(p, e.Dir+"/")) && len(e.Dir) >= len(best.Dir) {
			best = e
		}
	}
	return best
}

// MayHang reports whether a file system of type typ may leave a process
// that touches it waiting for ever: one served by a process (FUSE, and
// virtiofs, whose daemon is one) or over a network.
func MayHang(typ string) bool {
	base, _, _ := strings.Cut(typ, ".")
	switch base {
	case "fuse", "fuseblk", "virtiofs", "nfs", "nfs4", "cifs", "smb3", "smbfs", "9p", "ceph",
		"glusterfs", "afs", "ncpfs", "coda", "davfs", "lustre", "gfs2", "ocfs2", "orangefs":
		return true
	}
	return false
}

// Under returns the first mount of a file system that might hang (see
// MayHang) at the clean absolute path dir or anywhere below it: one that
// holds dir, or one mounted on a name inside it, which a lookup there
// would enter.
func (t Table) Under(dir string) (Entry, bool) {
	if m := t.At(dir); MayHang(m.Type) {
		return m, true
	}
	for _, e := range t {
		if MayHang(e.Type) && (e.Dir == dir || dir == "/" || strings.HasPrefix(e.Dir, dir+"/")) {
			return e, true
		}
	}
	return Entry{}, false
}

// ErrMayHang means a path leads into a file system that might not answer.
var ErrMayHang = errors.New("on a file system that might not answer")

// Unescape undoes the octal escapes the mount table uses for spaces and
// the like.
func Unescape(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if n, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(n))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// Of returns the type of the file system that holds the open file fd, and
// where it is mounted, as the kernel's tables say (fdinfo's mount id in
// /proc/self/mountinfo): the file system itself is not asked.
func Of(fd int) (Entry, error) {
	mnt, _, ok := FDInfo("/proc/self/fdinfo/" + strconv.Itoa(fd))
	if !ok {
		return Entry{}, fmt.Errorf("mounts: no mount id in the fdinfo of descriptor %d", fd)
	}
	info, err := ReadInfo("/proc/self/mountinfo")
	if err != nil {
		return Entry{}, err
	}
	m, found := info[mnt]
	if !found {
		return Entry{}, fmt.Errorf("mounts: mount %d of descriptor %d not in the table", mnt, fd)
	}
	return m.Entry, nil
}

// Mount is one line of a mountinfo file.
type Mount struct {
	Entry
	Dev [2]uint32 // major and minor of the file system
}

// ReadInfo reads a mountinfo file (/proc/PID/task/TID/mountinfo, say),
// which the kernel writes without asking any file system: each mount by
// its id.
func ReadInfo(path string) (map[uint64]Mount, error) { return ReadInfoUntil(path, nil) }

// ReadInfoUntil is ReadInfo for a caller that cannot wait: a process can
// make its mountinfo as long as it likes (many mounts in a namespace of
// its own), so it asks late (if not nil) every few hundred lines and gives
// up when it says so, with an error matching os.ErrDeadlineExceeded.
func ReadInfoUntil(path string, late func() bool) (map[uint64]Mount, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 0, 4096), 1<<20)
	out := map[uint64]Mount{}
	for i := 0; sc.Scan(); i++ {
		if i%256 == 255 && late != nil && late() {
			return nil, fmt.Errorf("mounts: reading %s: %w", path, os.ErrDeadlineExceeded)
		}
		// id parent major:minor root mount-point options [tags] - type source ...
		f := strings.Fields(sc.Text())
		if len(f) < 5 {
			continue
		}
		id, err := strconv.ParseUint(f[0], 10, 64)
		maj, min, ok := strings.Cut(f[2], ":")
		if err != nil || !ok {
			continue
		}
		a, err1 := strconv.ParseUint(maj, 10, 32)
		b, err2 := strconv.ParseUint(min, 10, 32)
		if err1 != nil || err2 != nil {
			continue
		}
		m := Mount{Entry: Entry{Dir: Unescape(f[4])}, Dev: [2]uint32{uint32(a), uint32(b)}}
		if i := slices.Index(f[5:], "-"); i >= 0 && 5+i+1 < len(f) {
			m.Type = f[5+i+1]
		}
		out[id] = m
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("mounts: reading %s: %w", path, err)
	}
	return out, nil
}

// FDInfo reads the mount id and inode of an open file from its fdinfo
// entry, which the kernel writes without asking the file's file system.
func FDInfo(path string) (mnt, ino uint64, ok bool) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, 0, false
	}
	var haveMnt, haveIno bool
	for line := range strings.SplitSeq(string(b), "\n") {
		k, v, found := strings.Cut(line, ":")
		if !found {
			continue
		}
		n, err := strconv.ParseUint(strings.TrimSpace(v), 10, 64)
		switch {
		case err != nil:
		case k == "mnt_id":
			mnt, haveMnt = n, true
		case k == "ino":
			ino, haveIno = n, true
		}
	}
	return mnt, ino, haveMnt && haveIno
}

// OpenDir opens the directory at the absolute path p (O_PATH), one name
// at a time, following links, and looks each name up only in a directory
// whose file system the kernel's tables show cannot hang (see MayHang):
// what a name leads to is opened without following links or crossing into
// a mount, and a mount is crossed only once its type, read from the
// tables, is one that answers. So nothing that might not answer is ever
// asked, whatever is swapped in along the way meanwhile. It returns the
// directory, the path it was reached by, links followed, and the file
// system holding it.
func OpenDir(p string) (*os.File, string, Entry, error) {
	if !filepath.IsAbs(p) {
		return nil, "", Entry{}, fmt.Errorf("mounts: %s is not an absolute path", p)
	}
	cur, err := unix.Open("/", unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, "", Entry{}, err
	}
	done := "/"
	var at Entry // the file system of cur, once looked at
	known := false
	rest := strings.Split(filepath.Clean(p), "/")[1:]
	fail := func(err error) (*os.File, string, Entry, error) {
		unix.Close(cur)
		return nil, "", Entry{}, err
	}
	for links := 0; len(rest) > 0; {
		name := rest[0]
		rest = rest[1:]
		if name == "" || name == "." {
			continue
		}
		if name == ".." {
			name, done = "..", filepath.Dir(done)
		} else {
			done = filepath.Join(done, name)
		}
		how := &unix.OpenHow{Flags: unix.O_PATH | unix.O_NOFOLLOW | unix.O_CLOEXEC,
			Resolve: unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS | unix.RESOLVE_NO_XDEV}
		next, err := unix.Openat2(cur, name, how)
		if err == unix.EXDEV {
			// A mount point: its type first, from the tables, by the
			// path; then the crossing, and the same question of what was
			// reached.
			if tab, err := Read(); err == nil {
				if m := tab.At(done); MayHang(m.Type) {
					return fail(fmt.Errorf("%w: %s is %s, mounted at %s; not looked at", ErrMayHang, done, m.Type, m.Dir))
				}
			}
			how.Resolve &^= unix.RESOLVE_NO_XDEV
			next, err = unix.Openat2(cur, name, how)
		}
		if err != nil {
			return fail(&os.PathError{Op: "open", Path: done, Err: err})
		}
		m, err := Of(next)
		if err == nil && MayHang(m.Type) {
			err = fmt.Errorf("%w: %s is on %s, mounted at %s; not looked at", ErrMayHang, done, m.Type, m.Dir)
		}
		if err != nil {
			unix.Close(next)
			return fail(err)
		}
		var st unix.Stat_t
		if err := unix.Fstat(next, &st); err != nil {
			unix.Close(next)
			return fail(err)
		}
		if st.Mode&unix.S_IFMT != unix.S_IFLNK {
			unix.Close(cur)
			cur, at, known = next, m, true
			continue
		}
		unix.Close(next)
		if links++; links > 40 {
			return fail(&os.PathError{Op: "open", Path: p, Err: unix.ELOOP})
		}
		buf := make([]byte, 4096)
		n, err := unix.Readlinkat(cur, name, buf)
		if err != nil {
			return fail(&os.PathError{Op: "readlink", Path: done, Err: err})
		}
		target := string(buf[:n])
		done = filepath.Dir(done)
		if filepath.IsAbs(target) {
			unix.Close(cur)
			if cur, err = unix.Open("/", unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0); err != nil {
				return nil, "", Entry{}, err
			}
			done, known = "/", false
		}
		rest = append(strings.Split(target, "/"), rest...)
	}
	var st unix.Stat_t
	if err := unix.Fstat(cur, &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFDIR {
		return fail(&os.PathError{Op: "open", Path: p, Err: unix.ENOTDIR})
	}
	if !known {
		var err error
		if at, err = Of(cur); err != nil {
			return fail(err)
		}
	}
	return os.NewFile(uintptr(cur), done), done, at, nil
}

// StatAt returns what the name name (one name, not a path) in the
// directory dir holds, without following a link there (a link's own
// status is returned) or crossing into what is mounted there, which
// might not answer: anything mounted on the name, whatever its type
// (which is not looked up), fails with ErrMayHang, unasked.
func StatAt(dir *os.File, name string) (unix.Stat_t, error) {
	var st unix.Stat_t
	if name == "" || name == "." || name == ".." || strings.ContainsRune(name, '/') {
		return st, &os.PathError{Op: "open", Path: name, Err: unix.EINVAL}
	}
	how := &unix.OpenHow{Flags: unix.O_PATH | unix.O_NOFOLLOW | unix.O_CLOEXEC,
		Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS | unix.RESOLVE_NO_XDEV}
	fd, err := unix.Openat2(int(dir.Fd()), name, how)
	if errors.Is(err, unix.EXDEV) {
		return st, fmt.Errorf("%w: something is mounted on %s; not looked at", ErrMayHang, name)
	}
	if err != nil {
		return st, &os.PathError{Op: "open", Path: name, Err: err}
	}
	defer unix.Close(fd)
	if err := unix.Fstat(fd, &st); err != nil {
		return st, &os.PathError{Op: "fstat", Path: name, Err: err}
	}
	return st, nil
}

// Lstat is StatAt for the last name of the absolute path p, in its parent
// directory reached as OpenDir reaches one.
func Lstat(p string) (unix.Stat_t, error) {
	dir, _, _, err := OpenDir(filepath.Dir(p))
	if err != nil {
		return unix.Stat_t{}, err
	}
	defer dir.Close()
	return StatAt(dir, filepath.Base(p))
}
