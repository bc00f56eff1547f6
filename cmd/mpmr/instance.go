package main

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"syscall"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/instance"
	"github.com/mpmr/mpmr/internal/ofd"
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
	// Live: someone holds byte 0 of the primary lock, which only a living
	// primary does.
	Live    bool
	LiveErr error
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
	for _, name := range []string{instance.InfoFile, instance.PrimaryLockFile, instance.SlotsLockFile, ipc.SocketName} {
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
		if dir := filepath.Join(root, ent.Name()); isInstanceDir(dir) {
			out = append(out, look(ent.Name(), dir))
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
	if st, err := os.Stat(dir); err != nil || !st.IsDir() || !isInstanceDir(dir) {
		return nil, fmt.Errorf("no instance %q: %s is not an instance's runtime directory (wrong -rundir?)", prefix, dir)
	}
	return look(prefix, dir), nil
}

func look(prefix, dir string) *target {
	t := &target{Prefix: prefix, Dir: dir, UID: os.Geteuid()}
	if fi, err := os.Lstat(dir); err == nil {
		if st, ok := fi.Sys().(*syscall.Stat_t); ok {
			t.UID = int(st.Uid)
		}
	}
	t.Name = instance.Name(prefix, t.UID, dir)
	if info, err := instance.ReadInfo(dir); err == nil {
		t.Info = &info
	} else if !errors.Is(err, os.ErrNotExist) {
		t.InfoErr = err
	}
	t.Live, t.LiveErr = primaryHeld(dir)
	return t
}

// primaryHeld reports whether a process holds the primary lock of the
// instance in dir. Looking takes no lock and creates nothing.
func primaryHeld(dir string) (bool, error) {
	f, err := os.Open(filepath.Join(dir, instance.PrimaryLockFile))
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
	case t.LiveErr != nil:
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
// be: the directory the primary described, or, without a description,
// every hugetlbfs mount and the tmpfs directory.
func (t *target) backendDirs() []string {
	if t.Info != nil && t.Info.BackendDir != "" {
		return []string{t.Info.BackendDir}
	}
	var dirs []string
	if mounts, err := hugetlb.Mounts(); err == nil {
		for _, m := range mounts {
			dirs = append(dirs, m.Dir)
		}
	}
	return append(dirs, hugetlb.DefaultTmpfsDir)
}

// segmentOptions returns how to open the instance's control segment, and
// false when no segment file is found.
func (t *target) segmentOptions() (shm.Options, bool) {
	o := shm.Options{LayoutTag: instance.LayoutTag, LockPath: filepath.Join(t.Dir, instance.SlotsLockFile)}
	if t.Info != nil && t.Info.LockFile != "" {
		o.LockPath = t.Info.LockFile
	}
	if t.Info != nil && t.Info.Segment != "" {
		o.Path = t.Info.Segment
		_, err := os.Stat(o.Path)
		return o, err == nil
	}
	for _, dir := range t.backendDirs() {
		p := instance.SegmentPath(dir, t.Name)
		if _, err := os.Stat(p); err == nil {
			o.Path = p
			return o, true
		}
	}
	return o, false
}

// open maps the instance's segment read-only, claiming no slot.
func (t *target) open(e *env) (*shm.Segment, shm.Info, error) {
	o, ok := t.segmentOptions()
	if !ok {
		if o.Path == "" {
			return nil, shm.Info{}, fmt.Errorf("no control segment of %q found in %v", t.Prefix, t.backendDirs())
		}
		return nil, shm.Info{Path: o.Path}, fmt.Errorf("control segment %s is gone", o.Path)
	}
	o.Logger = e.log
	return shm.OpenReadOnly(o)
}
