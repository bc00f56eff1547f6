package ipc

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
)

// maxLinks bounds the symbolic links followed while checking one path, as
// the kernel's own bound (40) does.
const maxLinks = 40

// RunDirOptions say how OpenRunDir treats the directory.
type RunDirOptions struct {
	// Create makes missing directories, mode 0700, and requires the
	// instance directory itself to belong to this process's user: the
	// primary's side. Without it nothing is created, and the instance
	// directory may belong to this user, root or one of TrustUIDs: a
	// secondary's side.
	Create bool
	// TrustUIDs are users besides this process's own and root that may
	// own the directories on the way and the instance directory (Create
	// unset only).
	TrustUIDs []int
}

// RunDir is an instance's runtime directory, opened after every component
// of its path was checked: each directory on the way is owned by this
// user, root or a trusted user and writable by nobody else (a sticky
// directory such as /tmp excepted), each symbolic link on the way is owned
// the same way, and the directory itself is a real directory, owned as
// RunDirOptions say, writable by nobody else. Files are opened in it
// through its descriptor, never by a path another user could redirect.
//
// This is what ssh-agent, tmux and systemd check of the directories of
// their sockets: with it, no other local user can squat the directory,
// swap it or plant files in it. A RunDir is safe for concurrent use.
type RunDir struct {
	f      *os.File
	path   string // the directory's real path
	uid    int    // this process's effective uid
	trust  []int  // owners accepted besides uid and root
	mine   bool   // it must belong to uid
	sticky bool   // others may write to it if it is sticky
	owner  int    // its owner when opened; -1 while opening
}

// OpenRunDir checks the path of the runtime directory dir as RunDir says
// and opens it, creating what is missing with o.Create. A directory that
// another user could change fails with ErrPermission, whose message names
// the path, its owner and mode, this process's uid and the fix; a
// directory that is missing or that this user may not reach fails with
// the system's error (fs.ErrNotExist, fs.ErrPermission).
func OpenRunDir(dir string, o RunDirOptions) (*RunDir, error) {
	c := checker{uid: os.Geteuid(), create: o.Create}
	if !o.Create {
		c.trust = o.TrustUIDs
	}
	d, err := c.open(dir, o.Create, false)
	if err != nil {
		return nil, fmt.Errorf("ipc: runtime directory: %w", err)
	}
	return d, nil
}

// checker checks paths component by component.
type checker struct {
	uid    int
	trust  []int
	create bool
	links  int
}

func (c *checker) trusted(uid uint32) bool {
	return int(uid) == c.uid || uid == 0 || slices.Contains(c.trust, int(uid))
}

// open checks dir's path and opens dir. mine requires dir to belong to
// this process's user (else this user, root or a trusted one); sticky
// accepts a dir others may write to if it is sticky (the directory of a
// bare socket, as Listen allows; never an instance directory).
func (c *checker) open(dir string, mine, sticky bool) (*RunDir, error) {
	abs, err := filepath.Abs(dir)
	if err != nil {
		return nil, err
	}
	parent, name := filepath.Split(abs)
	if name == "" {
		return nil, fmt.Errorf("%s: not a directory below /", abs)
	}
	real, err := c.resolve(parent)
	if err != nil {
		return nil, err
	}
	path := filepath.Join(real, name)
	if c.create {
		if err := os.Mkdir(path, 0o700); err != nil && !errors.Is(err, fs.ErrExist) {
			return nil, err
		}
	}
	// O_PATH: a secondary of another user may only be allowed to search
	// the directory (mode 0711), not to read it.
	fd, err := unix.Open(path, unix.O_PATH|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		if errors.Is(err, unix.ELOOP) || errors.Is(err, unix.ENOTDIR) {
			var st unix.Stat_t
			if unix.Lstat(path, &st) == nil {
				return nil, unsafeErr(path, &st, c.uid, "not a directory but "+kindOf(st.Mode)+
					" (the runtime directory must be a real directory)", "remove it, or choose another runtime directory")
			}
		}
		return nil, &fs.PathError{Op: "open", Path: path, Err: err}
	}
	d := &RunDir{f: os.NewFile(uintptr(fd), path), path: path, uid: c.uid, trust: c.trust, mine: mine, sticky: sticky,
		owner: -1}
	if err := d.check(); err != nil {
		d.f.Close()
		return nil, err
	}
	if mine && c.create {
		if err := d.private(); err != nil {
			d.f.Close()
			return nil, err
		}
	}
	return d, nil
}

// private makes this user's own instance directory mode 0700 if it was
// found (not made) more open, through its descriptor: nobody else needs to
// list it, and users let in by name are given search rights (0711) by the
// runtime that lets them in, after this.
func (d *RunDir) private() error {
	var st unix.Stat_t
	if err := unix.Fstat(int(d.f.Fd()), &st); err != nil {
		return &fs.PathError{Op: "fstat", Path: d.path, Err: err}
	}
	if st.Mode&0o077 == 0 {
		return nil
	}
	// An O_PATH descriptor cannot fchmod; its /proc link names the inode.
	if err := os.Chmod(fmt.Sprintf("/proc/self/fd/%d", d.f.Fd()), 0o700); err != nil {
		return fmt.Errorf("make %s private: %w", d.path, err)
	}
	return nil
}

// resolve checks every component of the absolute path p, following
// symbolic links, and returns its real path. With c.create it makes
// missing directories, mode 0700.
func (c *checker) resolve(p string) (string, error) {
	var st unix.Stat_t
	if err := unix.Lstat("/", &st); err != nil {
		return "", &fs.PathError{Op: "lstat", Path: "/", Err: err}
	}
	if err := c.checkDir("/", &st, true); err != nil {
		return "", err
	}
	cur := "/"
	for _, name := range strings.Split(filepath.Clean(p), "/") {
		if name == "" {
			continue
		}
		next := filepath.Join(cur, name)
		err := unix.Lstat(next, &st)
		if errors.Is(err, unix.ENOENT) && c.create {
			if err = unix.Mkdir(next, 0o700); err == nil || errors.Is(err, unix.EEXIST) {
				err = unix.Lstat(next, &st)
			}
		}
		if err != nil {
			return "", &fs.PathError{Op: "lstat", Path: next, Err: err}
		}
		switch st.Mode & unix.S_IFMT {
		case unix.S_IFLNK:
			if !c.trusted(st.Uid) {
				return "", unsafeErr(next, &st, c.uid, "a symbolic link owned by another user, who could point it anywhere",
					c.fixOwner(next, st.Uid))
			}
			if c.links++; c.links > maxLinks {
				return "", &fs.PathError{Op: "resolve", Path: p, Err: unix.ELOOP}
			}
			target, err := os.Readlink(next)
			if err != nil {
				return "", err
			}
			if !filepath.IsAbs(target) {
				target = filepath.Join(cur, target)
			}
			if cur, err = c.resolve(target); err != nil {
				return "", err
			}
		case unix.S_IFDIR:
			if err := c.checkDir(next, &st, true); err != nil {
				return "", err
			}
			cur = next
		default:
			return "", &fs.PathError{Op: "resolve", Path: next, Err: unix.ENOTDIR}
		}
	}
	return cur, nil
}

// checkDir checks one directory: owned by a trusted user, and writable by
// nobody else unless it may be sticky and is.
func (c *checker) checkDir(path string, st *unix.Stat_t, sticky bool) error {
	switch {
	case !c.trusted(st.Uid):
		return unsafeErr(path, st, c.uid, "owned by another user, who could replace what is inside it",
			c.fixOwner(path, st.Uid))
	case st.Mode&0o022 != 0 && !(sticky && st.Mode&unix.S_ISVTX != 0):
		return unsafeErr(path, st, c.uid, "writable by other users, who could replace what is inside it",
			fmt.Sprintf("chmod go-w %s, or choose another runtime directory", path))
	}
	return nil
}

func (c *checker) fixOwner(path string, owner uint32) string {
	fix := fmt.Sprintf("remove it (as root or uid %d) or choose another runtime directory "+
		"(XDG_RUNTIME_DIR, or the runtime's RuntimeDir setting)", owner)
	if !c.create {
		fix += fmt.Sprintf("; if uid %d is to be trusted, list it in the secondary's TrustUIDs", owner)
	}
	return fix
}

// check checks the opened directory itself, through its descriptor.
func (d *RunDir) check() error {
	var st unix.Stat_t
	if err := unix.Fstat(int(d.f.Fd()), &st); err != nil {
		return &fs.PathError{Op: "fstat", Path: d.path, Err: err}
	}
	c := checker{uid: d.uid, trust: d.trust, create: d.mine}
	if d.mine && int(st.Uid) != d.uid {
		return unsafeErr(d.path, &st, d.uid, "owned by another user, not by this process's",
			c.fixOwner(d.path, st.Uid))
	}
	if d.owner >= 0 && d.owner != int(st.Uid) {
		return unsafeErr(d.path, &st, d.uid, fmt.Sprintf("no longer owned by uid %d", d.owner), c.fixOwner(d.path, st.Uid))
	}
	if err := c.checkDir(d.path, &st, d.sticky); err != nil {
		return err
	}
	if d.owner < 0 {
		d.owner = int(st.Uid) // while opening, before anyone else sees d
	}
	return nil
}

// Check makes sure the directory is still what was opened: the path still
// names it, and it is still owned and protected as then.
func (d *RunDir) Check() error {
	var now, held unix.Stat_t
	if err := unix.Fstat(int(d.f.Fd()), &held); err != nil {
		return fmt.Errorf("ipc: runtime directory %s: %w", d.path, err)
	}
	if err := unix.Lstat(d.path, &now); err != nil || now.Dev != held.Dev || now.Ino != held.Ino {
		return fmt.Errorf("%w: runtime directory %s was removed or replaced since it was opened", ErrPermission, d.path)
	}
	return d.check()
}

// Path returns the directory's real path.
func (d *RunDir) Path() string { return d.path }

// Owner returns the uid that owns the directory.
func (d *RunDir) Owner() int { return d.owner }

// OpenFile opens the file name in the directory, never following a
// symbolic link, like os.OpenFile. The file must be a regular file owned
// by the directory's owner or root, else ErrPermission (and, if this call
// created it, it is removed again).
func (d *RunDir) OpenFile(name string, flag int, perm os.FileMode) (*os.File, error) {
	if strings.ContainsRune(name, '/') {
		return nil, fmt.Errorf("ipc: %q is not a file name", name)
	}
	path := filepath.Join(d.path, name)
	fd, err := unix.Openat(int(d.f.Fd()), name, flag|unix.O_NOFOLLOW|unix.O_CLOEXEC|unix.O_NONBLOCK, uint32(perm.Perm()))
	if err != nil {
		if errors.Is(err, unix.ELOOP) {
			return nil, fmt.Errorf("%w: %s is a symbolic link", ErrPermission, path)
		}
		return nil, &fs.PathError{Op: "open", Path: path, Err: err}
	}
	// Blocking again: O_NONBLOCK only kept a FIFO from hanging the open.
	if err := unix.SetNonblock(fd, false); err != nil {
		unix.Close(fd)
		return nil, &fs.PathError{Op: "open", Path: path, Err: err}
	}
	f := os.NewFile(uintptr(fd), path)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		f.Close()
		return nil, &fs.PathError{Op: "fstat", Path: path, Err: err}
	}
	var why string
	switch {
	case st.Mode&unix.S_IFMT != unix.S_IFREG:
		why = "not a regular file but " + kindOf(st.Mode)
	case int(st.Uid) != d.owner && st.Uid != 0:
		why = fmt.Sprintf("owned by another user than the directory's (uid %d)", d.owner)
	}
	if why != "" {
		f.Close()
		return nil, unsafeErr(path, &st, d.uid, why, "remove it")
	}
	return f, nil
}

// OpenSocket opens the socket name in the directory as a path only
// (O_PATH), never following a symbolic link, and returns it with a name
// for connect that reaches exactly that socket (its /proc/self/fd link),
// so that a link put at name after the check cannot redirect the dial.
// The socket must belong to the directory's owner, whose process listens
// there, else ErrPermission: unlike a file, no socket of root's is taken
// (a link to one, where the system lets users link what they do not own,
// would have root's process dialled). Close the file once dialled.
func (d *RunDir) OpenSocket(name string) (*os.File, string, error) {
	if strings.ContainsRune(name, '/') {
		return nil, "", fmt.Errorf("ipc: %q is not a file name", name)
	}
	path := filepath.Join(d.path, name)
	fd, err := unix.Openat(int(d.f.Fd()), name, unix.O_PATH|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, "", &fs.PathError{Op: "open", Path: path, Err: err}
	}
	f := os.NewFile(uintptr(fd), path)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		f.Close()
		return nil, "", &fs.PathError{Op: "fstat", Path: path, Err: err}
	}
	if st.Mode&unix.S_IFMT != unix.S_IFSOCK || int(st.Uid) != d.owner {
		f.Close()
		return nil, "", fmt.Errorf("%w: %s is not a socket of the directory's owner (uid %d): %s, owner uid %d, mode %04o",
			ErrPermission, path, d.owner, kindOf(st.Mode), st.Uid, st.Mode&0o7777)
	}
	return f, fmt.Sprintf("/proc/self/fd/%d", fd), nil
}

// Stat describes the file name in the directory without following a
// symbolic link.
func (d *RunDir) Stat(name string) (*unix.Stat_t, error) {
	var st unix.Stat_t
	if err := unix.Fstatat(int(d.f.Fd()), name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return nil, &fs.PathError{Op: "stat", Path: filepath.Join(d.path, name), Err: err}
	}
	return &st, nil
}

// Remove removes the file name from the directory.
func (d *RunDir) Remove(name string) error {
	if err := unix.Unlinkat(int(d.f.Fd()), name, 0); err != nil {
		return &fs.PathError{Op: "remove", Path: filepath.Join(d.path, name), Err: err}
	}
	return nil
}

// afterCheckHook, when set (by tests), runs in RemoveDir between the check
// of the path and the removal: where a racing swap of the path would act.
var afterCheckHook func()

// RemoveDir removes the directory itself if it is empty and its path
// still names it. The removal goes through the parent the directory has
// now (its "..") and only if the parent's entry is still this directory:
// a component of the path swapped after the check (for a link into some
// other tree, by whoever owns a parent) makes it remove nothing else.
func (d *RunDir) RemoveDir() error {
	if err := d.Check(); err != nil {
		return err
	}
	if afterCheckHook != nil {
		afterCheckHook()
	}
	parent, err := unix.Openat(int(d.f.Fd()), "..", unix.O_PATH|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return &fs.PathError{Op: "open", Path: filepath.Join(d.path, ".."), Err: err}
	}
	defer unix.Close(parent)
	name := filepath.Base(d.path)
	var held, entry unix.Stat_t
	if err := unix.Fstat(int(d.f.Fd()), &held); err != nil {
		return &fs.PathError{Op: "stat", Path: d.path, Err: err}
	}
	if err := unix.Fstatat(parent, name, &entry, unix.AT_SYMLINK_NOFOLLOW); err != nil || entry.Dev != held.Dev || entry.Ino != held.Ino {
		return fmt.Errorf("%w: runtime directory %s was moved or replaced since it was opened", ErrPermission, d.path)
	}
	if err := unix.Unlinkat(parent, name, unix.AT_REMOVEDIR); err != nil {
		return &fs.PathError{Op: "remove", Path: d.path, Err: err}
	}
	return nil
}

// Rename renames the file from to to inside the directory, replacing to.
func (d *RunDir) Rename(from, to string) error {
	if err := unix.Renameat(int(d.f.Fd()), from, int(d.f.Fd()), to); err != nil {
		return &os.LinkError{Op: "rename", Old: filepath.Join(d.path, from), New: filepath.Join(d.path, to), Err: err}
	}
	return nil
}

// Close closes the directory. Idempotent.
func (d *RunDir) Close() error {
	if err := d.f.Close(); err != nil && !errors.Is(err, os.ErrClosed) {
		return err
	}
	return nil
}

// unsafeErr is the ErrPermission refusal of path.
func unsafeErr(path string, st *unix.Stat_t, uid int, why, fix string) error {
	return fmt.Errorf("%w: %s is %s (owner uid %d, mode %04o); this process runs as uid %d: %s",
		ErrPermission, path, why, st.Uid, st.Mode&0o7777, uid, fix)
}

func kindOf(mode uint32) string {
	switch mode & syscall.S_IFMT {
	case syscall.S_IFLNK:
		return "a symbolic link"
	case syscall.S_IFDIR:
		return "a directory"
	case syscall.S_IFSOCK:
		return "a socket"
	case syscall.S_IFIFO:
		return "a FIFO"
	case syscall.S_IFREG:
		return "a regular file"
	}
	return fmt.Sprintf("a special file (mode %o)", mode&syscall.S_IFMT)
}
