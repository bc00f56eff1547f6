package main

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/instance"
	"github.com/mpmr/mpmr/internal/sys/mounts"
	"github.com/mpmr/mpmr/internal/sys/ofd"
	"github.com/mpmr/mpmr/ipc"
	"github.com/mpmr/mpmr/shm"
)

// target is one instance as found under the runtime directory.
type target struct {
	Prefix string
	Dir    string // runtime directory
	// UID is the instance's user: the runtime directory's owner.
	UID int
	// Name is the instance's name in backend directories (instance.Name).
	Name string
	// Info is the primary's description, nil when the primary died before
	// writing it (or it is unreadable: InfoErr).
	Info    *instance.Info
	InfoErr error
	// Recorded are the backend directories where the instance's primaries
	// may have made files (instance.BackendsFile), as the runtime
	// directory records them.
	Recorded  []string
	RecordErr error // why the record could not be read, if it is there
	// Live: someone holds byte 0 of the primary lock, which only a living
	// primary does.
	Live    bool
	LiveErr error
	// Unreachable says why the instance's runtime directory was not
	// looked into (it might never answer), if it was not.
	Unreachable error
	bk          *backendHandle // see backend
}

// root returns the directory the instances' runtime directories are in:
// the parent of instance.Dir, so -rundir means what RuntimeDir means to
// the runtimes.
func (e *env) root() (string, error) {
	d, err := instance.Dir("mpmr", e.rundir)
	if err != nil {
		return "", err
	}
	return filepath.Dir(d), nil
}

// isInstanceDir reports whether dir looks like an instance's runtime
// directory.
func isInstanceDir(dir string) bool {
	for _, name := range []string{instance.InfoFile, instance.BackendsFile, instance.PrimaryLockFile, instance.SlotsLockFile, ipc.SocketName} {
		if _, err := os.Lstat(filepath.Join(dir, name)); err == nil {
			return true
		}
	}
	return false
}

// targets returns every instance under the runtime directory, by prefix.
func (e *env) targets() (string, []*target, error) {
	root, err := e.root()
	if err != nil {
		return "", nil, err
	}
	// Listing the directory reads only the file system that holds it
	// (what is mounted on a name in it, each instance's check below).
	tab, err := mounts.Read()
	if err != nil {
		return root, nil, err
	}
	if m := tab.At(filepath.Clean(root)); mounts.MayHang(m.Type) {
		return root, nil, fmt.Errorf("%s: %w: %s is mounted at %s; not looked into", root, mounts.ErrMayHang, m.Type, m.Dir)
	}
	ents, err := os.ReadDir(root)
	if errors.Is(err, os.ErrNotExist) {
		return root, nil, nil
	}
	if err != nil {
		return root, nil, err
	}
	var out []*target
	for _, ent := range ents {
		if !ent.IsDir() || ipc.ValidatePrefix(ent.Name()) != nil {
			continue
		}
		// One this user may not look into is listed too, with why, and
		// so is one whose files might not answer, or do not.
		name, dir := ent.Name(), filepath.Join(root, ent.Name())
		if err := mayHang(dir); err != nil {
			out = append(out, &target{Prefix: name, Dir: dir, UID: -1, Unreachable: err})
			continue
		}
		t, err := answered(dir, 0, func() (*target, error) {
			if isInstanceDir(dir) || noAccess(dir) != nil {
				return look(name, dir), nil
			}
			return nil, nil
		})
		switch {
		case err != nil:
			out = append(out, &target{Prefix: name, Dir: dir, UID: -1, Unreachable: err})
		case t != nil:
			out = append(out, t)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Prefix < out[j].Prefix })
	return root, out, nil
}

// target finds instance prefix, failing if it has no runtime directory.
func (e *env) target(prefix string) (*target, error) {
	dir, err := instance.Dir(prefix, e.rundir)
	if err != nil {
		return nil, err
	}
	if err := mayHang(dir); err != nil {
		return nil, err
	}
	// Not followed: a link could lead anywhere, onto a file system that
	// might not answer too (the runtimes make none, and refuse one).
	if fi, err := os.Lstat(dir); err == nil && fi.Mode()&os.ModeSymlink != 0 {
		return nil, fmt.Errorf("%w: %s is a symbolic link; not followed", ipc.ErrPermission, dir)
	}
	st, err := os.Stat(dir)
	if errors.Is(err, fs.ErrPermission) {
		if err := noAccess(filepath.Dir(dir)); err != nil {
			return nil, err
		}
		// The parent is searchable, so what is not lies further on: a
		// link to a directory this user may not search, say.
		return nil, fmt.Errorf("%w: %s is not accessible to uid %d: %v", ipc.ErrPermission, dir, os.Geteuid(), err)
	}
	if err == nil && st.IsDir() && !isInstanceDir(dir) {
		if err := noAccess(dir); err != nil {
			return nil, err
		}
	}
	if err != nil || !st.IsDir() || !isInstanceDir(dir) {
		return nil, fmt.Errorf("no instance %q: %s is not an instance's runtime directory (wrong -rundir?)", prefix, dir)
	}
	return look(prefix, dir), nil
}

// noAccess says, as an ipc.ErrPermission, why this user may not look
// into dir (its owner and mode, and who we are), or returns nil if it may.
func noAccess(dir string) error {
	err := syscall.Access(dir, 0o1) // search permission
	if !errors.Is(err, syscall.EACCES) && !errors.Is(err, syscall.EPERM) {
		return nil
	}
	var st syscall.Stat_t
	if syscall.Stat(dir, &st) != nil {
		return fmt.Errorf("%w: %s is not accessible to uid %d", ipc.ErrPermission, dir, os.Geteuid())
	}
	return fmt.Errorf("%w: %s is not accessible to uid %d: owner uid %d, mode %04o (run as its owner or root)",
		ipc.ErrPermission, dir, os.Geteuid(), st.Uid, st.Mode&0o7777)
}

func look(prefix, dir string) *target {
	t := &target{Prefix: prefix, Dir: dir, UID: os.Geteuid()}
	rd, err := t.openDir()
	if err != nil {
		t.InfoErr, t.LiveErr = err, err
		t.Name = instance.Name(prefix, t.UID, dir)
		return t
	}
	defer rd.Close()
	t.Name = instance.Name(prefix, t.UID, dir)
	if info, err := instance.ReadInfoIn(rd); err == nil {
		t.Info = &info
	} else if !errors.Is(err, os.ErrNotExist) {
		t.InfoErr = err
	}
	if t.Recorded, err = instance.ReadBackendsIn(rd); errors.Is(err, os.ErrNotExist) {
		err = nil
	}
	t.RecordErr = err
	t.Live, t.LiveErr = primaryHeld(rd)
	return t
}

// openDir opens the instance's runtime directory the way a secondary does
// (every component checked, nothing followed), trusting its owner — the
// instance's user — besides this user and root, and records that owner.
// Everything the tool reads or changes in the directory goes through it:
// run by root on another user's instance, the tool must not follow that
// user's links or trust files somebody else planted.
func (t *target) openDir() (*ipc.RunDir, error) {
	var trust []int
	if fi, err := os.Lstat(t.Dir); err == nil {
		if st, ok := fi.Sys().(*syscall.Stat_t); ok {
			trust = []int{int(st.Uid)}
		}
	}
	rd, err := ipc.OpenRunDir(t.Dir, ipc.RunDirOptions{TrustUIDs: trust})
	if err != nil {
		return nil, err
	}
	t.UID = rd.Owner()
	return rd, nil
}

// openSlotsLock opens the slots' lock file in rd, for shm.OpenReadOnly to
// take over, or reports that there is none (then no slot is held). It is
// opened through the checked directory only: the instance's user could
// have put a link at its name, to anything root may open.
func openSlotsLock(rd *ipc.RunDir) (f *os.File, none bool, err error) {
	f, err = rd.OpenFile(instance.SlotsLockFile, os.O_RDONLY, 0)
	if errors.Is(err, os.ErrNotExist) {
		return nil, true, nil
	}
	return f, false, err
}

// primaryHeld reports whether a process holds the primary lock of the
// instance in rd. Looking takes no lock and creates nothing.
func primaryHeld(rd *ipc.RunDir) (bool, error) {
	f, err := rd.OpenFile(instance.PrimaryLockFile, os.O_RDONLY, 0)
	if errors.Is(err, os.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	defer f.Close()
	return ofd.Held(f, 0)
}

func (t *target) state() string {
	switch {
	case t.LiveErr != nil, t.Unreachable != nil:
		return "unknown"
	case t.Live:
		return "live"
	}
	return "dead"
}

func (t *target) primaryPID() int {
	if t.Info != nil {
		return t.Info.PID
	}
	return 0
}

// backendDirs returns where the instance's segment and memory files may
// be: the directory the primary described, as held open (see backend),
// if it is one the tool looks into, or, without a description, every
// hugetlbfs mount and the tmpfs directory.
func (t *target) backendDirs() []string {
	if t.Info != nil && t.Info.BackendDir != "" {
		if bk := t.backend(); bk.err == nil {
			return []string{bk.path}
		}
		return nil
	}
	dirs := append(hugetlbDirs(), hugetlb.DefaultTmpfsDir)
	// These are root's, and shared: anyone may have mounted something on
	// a name of the instance's in them (with a file system that might not
	// answer). Such a directory is not looked into.
	tab, err := mounts.Read()
	if err != nil {
		return nil
	}
	return slices.DeleteFunc(dirs, func(dir string) bool { return t.mountedOnName(tab, dir) != nil })
}

// mountedOnName returns a mount of a file system that might not answer on
// one of the instance's names in dir, if there is one.
func (t *target) mountedOnName(tab mounts.Table, dir string) *mounts.Entry {
	return instance.HangingMount(tab, dir, t.Name)
}

// mayHang says why the directory dir is not looked into, if it, or a name
// in it or further down, is on a file system that might not answer (see
// backend).
func mayHang(dir string) error {
	tab, err := mounts.Read()
	if err != nil {
		return err
	}
	if m, found := tab.Under(filepath.Clean(dir)); found {
		return fmt.Errorf("%s: %w: %s is mounted at %s; not looked into", dir, mounts.ErrMayHang, m.Type, m.Dir)
	}
	return nil
}

// backendHandle is the backend directory an instance's description names,
// opened once: path reaches the directory held (/proc/self/fd/N),
// whatever is swapped in on the way to dir, its name, meanwhile.
type backendHandle struct {
	dir, path string
	f         *os.File
	err       error // why the directory is not looked into
}

// backend opens the described backend directory, the first time. The
// instance's user chooses it, so it must be what a primary's backends
// use, a directory on tmpfs or hugetlbfs, reached without asking a file
// system that might not answer (FUSE, a network mount: a thread waiting
// on one can wait for ever, past any deadline, and past SIGKILL), with
// no such file system mounted below it.
func (t *target) backend() *backendHandle {
	if t.bk != nil {
		return t.bk
	}
	dir := t.Info.BackendDir
	t.bk = &backendHandle{}
	f, resolved, m, err := mounts.OpenDir(dir)
	if err != nil {
		t.bk.err = fmt.Errorf("backend directory %s: %w", dir, err)
		return t.bk
	}
	held := fmt.Sprintf("/proc/self/fd/%d", f.Fd())
	if m.Type != "tmpfs" && m.Type != "hugetlbfs" {
		t.bk.err = fmt.Errorf("backend directory %s is on %s (%s), not tmpfs or hugetlbfs: not looked into", dir, m.Dir, m.Type)
	} else if err := t.noMountOnNames(f); err != nil {
		t.bk.err = fmt.Errorf("backend directory %s: %w", dir, err)
	} else if (instance.IsPrivateDirOf(filepath.Base(filepath.Clean(dir)), t.Prefix, t.UID) ||
		instance.IsPrivateDirOf(filepath.Base(resolved), t.Prefix, t.UID)) && !t.ownDir(filepath.Clean(dir), f) {
		// A primary's directory of its own (instance.PrivateDirName), of
		// this runtime directory or one it was moved from, is its user's,
		// itself; another user may have made one at the name, which was
		// to be seen, or a link there, once it went.
		t.bk.err = fmt.Errorf("%w: backend directory %s is not the instance user's (uid %d) itself: not looked into",
			ipc.ErrPermission, dir, t.UID)
	}
	if t.bk.err != nil {
		f.Close()
		return t.bk
	}
	t.bk.dir, t.bk.path, t.bk.f = resolved, held, f
	return t.bk
}

// ownDir reports whether the name dir, looked at through its parent
// without following a link there or crossing a mount, is a directory of
// the instance's user, and the very directory open as held.
func (t *target) ownDir(dir string, held *os.File) bool {
	st, err := mounts.Lstat(dir)
	if err != nil || st.Mode&syscall.S_IFMT != syscall.S_IFDIR || int(st.Uid) != t.UID {
		return false
	}
	var h syscall.Stat_t
	if err := syscall.Fstat(int(held.Fd()), &h); err != nil {
		return false
	}
	return st.Dev == h.Dev && st.Ino == h.Ino
}

// noMountOnNames says so if anything is mounted on one of the instance's
// names in the directory held by dir (the only names the tool looks up
// there): each is looked up in it without crossing into a mount. Listing
// the directory, and this lookup, ask only the directory's own file
// system; a rename cannot bring a mount point in, only a mount can.
func (t *target) noMountOnNames(dir *os.File) error {
	names := []string{filepath.Base(instance.SegmentPath("", t.Name))}
	ents, err := os.ReadDir(fmt.Sprintf("/proc/self/fd/%d", dir.Fd()))
	if err != nil {
		return err
	}
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), "mpmr."+t.Name+".") {
			names = append(names, e.Name())
		}
	}
	for _, name := range names {
		how := &unix.OpenHow{Flags: unix.O_PATH | unix.O_NOFOLLOW | unix.O_CLOEXEC,
			Resolve: unix.RESOLVE_NO_XDEV | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_BENEATH}
		fd, err := unix.Openat2(int(dir.Fd()), name, how)
		switch {
		case err == nil:
			unix.Close(fd)
		case errors.Is(err, unix.EXDEV):
			return fmt.Errorf("%w: something is mounted on %s there; not looked into", mounts.ErrMayHang, name)
		case !errors.Is(err, unix.ENOENT) && !errors.Is(err, unix.ELOOP):
			return &os.PathError{Op: "open", Path: name, Err: err}
		}
	}
	return nil
}

// release closes the backend directory, if it was opened.
func (t *target) release() {
	if t.bk != nil && t.bk.f != nil {
		t.bk.f.Close()
	}
	t.bk = nil
}

// shown is s with the backend directory held named by its path.
func (t *target) shown(s string) string {
	if t.bk == nil || t.bk.path == "" {
		return s
	}
	if s == t.bk.path {
		return t.bk.dir
	}
	return strings.ReplaceAll(s, t.bk.path+"/", t.bk.dir+"/")
}

// shownError is an error whose message names the backend directory by its
// path (see shown).
type shownError struct {
	msg string
	err error
}

func (e *shownError) Error() string { return e.msg }
func (e *shownError) Unwrap() error { return e.err }

func (t *target) shownErr(err error) error {
	if err == nil || t.shown(err.Error()) == err.Error() {
		return err
	}
	return &shownError{t.shown(err.Error()), err}
}

// backendErr says why the described backend directory, or one of those
// searched without a description, is not looked into, if one is not.
func (t *target) backendErr() error {
	if t.Info != nil && t.Info.BackendDir != "" {
		return t.backend().err
	}
	tab, err := mounts.Read()
	if err != nil {
		return err
	}
	for _, dir := range append(hugetlbDirs(), hugetlb.DefaultTmpfsDir) {
		if m := t.mountedOnName(tab, dir); m != nil {
			return fmt.Errorf("%s: %w: %s is mounted at %s; not looked into", dir, mounts.ErrMayHang, m.Type, m.Dir)
		}
	}
	return nil
}

// hugetlbDirs lists the hugetlbfs mounts.
func hugetlbDirs() []string {
	var dirs []string
	if ms, err := hugetlb.Mounts(); err == nil {
		for _, m := range ms {
			dirs = append(dirs, m.Dir)
		}
	}
	return dirs
}

// described reports whether path, the segment's name in a directory
// backendDirs returned, is the segment the description names: that name,
// or the name in the backend directory as described, before backendDirs
// followed its links.
func (t *target) described(path string) bool {
	return t.Info.Segment == path ||
		t.Info.BackendDir != "" && t.Info.Segment == instance.SegmentPath(t.Info.BackendDir, t.Name)
}

// segmentPath returns the instance's control segment file, and false when
// none is found. The primary's description is believed only where it names
// the file the instance's name gives, in a backend directory.
func (t *target) segmentPath() (string, bool) {
	for _, dir := range t.backendDirs() {
		p := instance.SegmentPath(dir, t.Name)
		if t.Info != nil && t.Info.Segment != "" && !t.described(p) {
			continue
		}
		if _, err := os.Lstat(p); err == nil {
			return p, true
		}
	}
	if t.Info != nil && t.Info.Segment != "" {
		return t.Info.Segment, false
	}
	return "", false
}

// expectedSegment reports whether path is where the instance's segment
// belongs: its name in one of the backend directories.
func (t *target) expectedSegment(path string) bool {
	for _, dir := range t.backendDirs() {
		if path == instance.SegmentPath(dir, t.Name) ||
			t.Info != nil && t.Info.BackendDir != "" && path == instance.SegmentPath(t.Info.BackendDir, t.Name) {
			return true
		}
	}
	return false
}

// open maps the instance's segment read-only, claiming no slot. The file
// must be a regular file of the instance's user (or root): a file of
// anyone else's at that name is not this instance's, whatever it holds.
func (t *target) open(e *env) (*shm.Segment, shm.Info, error) {
	seg, info, err := t.openHeld(e)
	info.Path = t.shown(info.Path)
	return seg, info, t.shownErr(err)
}

func (t *target) openHeld(e *env) (*shm.Segment, shm.Info, error) {
	if err := t.backendErr(); err != nil {
		return nil, shm.Info{}, err
	}
	path, ok := t.segmentPath()
	if !ok && t.Info != nil && path == t.Info.Segment && path != "" && !t.expectedSegment(path) {
		return nil, shm.Info{}, fmt.Errorf("%w: the instance's description names the segment %s, which is not the instance's "+
			"(want %s in a backend directory); not opened", ipc.ErrPermission, path, filepath.Base(instance.SegmentPath("", t.Name)))
	}
	if !ok {
		if path == "" {
			return nil, shm.Info{}, fmt.Errorf("no control segment of %q found in %v", t.Prefix, t.backendDirs())
		}
		return nil, shm.Info{Path: path}, fmt.Errorf("control segment %s is gone", path)
	}
	// Never waiting: a FIFO planted at the name must not hang the tool.
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NOFOLLOW|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, shm.Info{Path: path}, err
	}
	defer f.Close()
	var st syscall.Stat_t
	if err := syscall.Fstat(int(f.Fd()), &st); err != nil {
		return nil, shm.Info{Path: path}, err
	}
	if st.Mode&syscall.S_IFMT != syscall.S_IFREG || (int(st.Uid) != t.UID && st.Uid != 0) {
		return nil, shm.Info{Path: path}, fmt.Errorf("%w: %s is not a regular file of the instance's user (uid %d): owner uid %d, mode %04o",
			ipc.ErrPermission, path, t.UID, st.Uid, st.Mode&0o7777)
	}
	rd, err := t.openDir()
	if err != nil {
		return nil, shm.Info{Path: path}, err
	}
	defer rd.Close()
	// The files just checked, by descriptor: not paths that could be
	// swapped meanwhile.
	o := shm.Options{LayoutTag: instance.LayoutTag, Path: fmt.Sprintf("/proc/self/fd/%d", f.Fd()), Logger: e.log}
	if o.LockFile, o.NoLockFile, err = openSlotsLock(rd); err != nil {
		return nil, shm.Info{Path: path}, err
	}
	seg, info, err := shm.OpenReadOnly(o)
	info.Path = path
	return seg, info, err
}
