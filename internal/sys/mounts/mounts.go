// Package mounts reads the mount table and resolves paths without asking
// the file systems that might not answer.
package mounts

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
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

// Resolve returns p with every symbolic link on the way followed, asking
// only file systems that cannot hang (see MayHang): before it looks up a
// name, it finds in t the mount the name is on, and fails with ErrMayHang
// if that one might. The path it returns names no link and lies on no such
// file system, as the table says; what is mounted or linked afterwards,
// it cannot say.
func (t Table) Resolve(p string) (string, error) {
	if !filepath.IsAbs(p) {
		return "", fmt.Errorf("mounts: %s is not an absolute path", p)
	}
	rest := strings.Split(filepath.Clean(p), "/")[1:]
	done := "/"
	for links := 0; len(rest) > 0; {
		name := rest[0]
		rest = rest[1:]
		switch name {
		case "", ".":
			continue
		case "..":
			done = filepath.Dir(done)
			continue
		}
		next := filepath.Join(done, name)
		if m := t.At(next); MayHang(m.Type) {
			return "", fmt.Errorf("%w: %s is on %s, mounted at %s; not looked at", ErrMayHang, next, m.Type, m.Dir)
		}
		fi, err := os.Lstat(next)
		if err != nil {
			return "", err
		}
		if fi.Mode()&os.ModeSymlink == 0 {
			done = next
			continue
		}
		if links++; links > 40 {
			return "", &os.PathError{Op: "resolve", Path: p, Err: syscall.ELOOP}
		}
		target, err := os.Readlink(next)
		if err != nil {
			return "", err
		}
		if filepath.IsAbs(target) {
			done = "/"
		}
		rest = append(strings.Split(target, "/"), rest...)
	}
	return done, nil
}

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
