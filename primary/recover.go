package primary

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/instance"
	"github.com/mpmr/mpmr/internal/sys/mounts"
	"github.com/mpmr/mpmr/internal/sys/ofd"
	"github.com/mpmr/mpmr/ipc"
	"github.com/mpmr/mpmr/shm"
)

// recoverLeftovers removes what a primary of this instance that died left
// behind, and takes the instance's life file in its own backend directory
// (instance.TakeLife), which it holds from then on. It runs with the
// primary lock held. Backend directories are shared by every user and
// instance, so a file there is removed only when it is proven to be a
// dead instance's of this user: it has this instance's name (prefix, user
// and runtime directory), it is a regular file of this user, and this
// primary holds the instance's life file there, which its primaries hold
// for their lifetimes and nobody else may open. A live primary (one whose
// runtime directory was removed while it ran) fails Start with
// ErrPrimaryRunning; a file of another user, or one that is not a regular
// file, at one of the names in this primary's own directory fails it with
// ErrPermission (Start then tries once more in a directory of its own;
// see start), elsewhere it is left alone with a warning (the directory
// stays in the record while a regular file of this user is left there):
// neither is touched. A primary whose files go
// in a directory of their own makes it here, once the record names it
// (see instance.PrivateDirName); one that a dead primary made goes once
// emptied. The directories looked into are the one the dead primary
// described, those recorded in the runtime directory
// (instance.BackendsFile: a primary records where it makes files before
// it makes any, so that one that died before describing itself is found
// whichever backend this one chooses) and this primary's own, last. A
// runtime directory moved or copied since the primary that described it
// ran names that primary's files otherwise: they are found by the name of
// the segment the description gives (if it is one of this prefix and
// user) and removed if their life file, there and held by nobody, proves
// them a dead primary's; else, or if they are not this user's, they are
// left alone with a warning. Each directory is reached one name at a
// time, links followed, without asking a file system that might not
// answer (mounts.OpenDir), and none is looked into where one is mounted
// on the instance's names (instance.MountOnNames), nor one that is not on
// tmpfs or hugetlbfs: it is left with a warning, and stays in the record,
// or, this primary's own, fails Start. A description whose primary, of
// this name, still runs (its life file and primary lock removed by hand)
// fails Start with ErrPrimaryRunning. A failed start leaves the record as
// it was written. Locks on the segment or the backing files count for
// nothing: the users the primary let in hold those, and may lock them, as
// long as they like.
//
// Nothing of the old state is trusted or reused: its segment is marked
// dead (for secondaries of the old instance that still map it; unless it
// has other names or the creator its header names runs, see
// shm.MarkEnded, which whoever may write it can arrange: those
// secondaries also see the primary's socket end and its slot die) and
// every file is removed; hugepages go back to the kernel once the last
// old mapping goes.
func (p *Primary) recoverLeftovers() error {
	var dirs []string
	var moved string // the name the dead primary's files have, if another
	if info, err := instance.ReadInfoIn(p.rundir); err == nil {
		old, named := p.describedName(info)
		// The primary that described this instance, under this name, still
		// runs (its life file and primary lock removed by hand): nothing
		// of it may go. The description is the instance user's own word,
		// unlike the segment's header, which the users it lets in may
		// write.
		if named && old == p.name && info.PID != os.Getpid() && shm.Running(info.PID, info.Start) {
			return fmt.Errorf("%w: the primary that described this instance in %s, pid %d, runs (its life file "+
				"and primary lock were removed?); stop it first", ErrPrimaryRunning,
				filepath.Join(p.dir, instance.InfoFile), info.PID)
		}
		p.log.Warn("previous primary of this instance died; cleaning up after it",
			"pid", info.PID, "segment", info.Segment)
		dirs = append(dirs, info.BackendDir)
		if named && old != p.name {
			moved = old
		}
	} else if !errors.Is(err, os.ErrNotExist) {
		p.log.Warn("unreadable instance description; cleaning up", "err", err)
	}
	// A primary that died before describing itself recorded where it was
	// to make its files (and it may have chosen another backend than
	// this one); it may also have left files in the directory this one
	// uses.
	if rec, err := instance.ReadBackendsIn(p.rundir); err == nil {
		dirs = append(dirs, rec...)
	} else if !errors.Is(err, os.ErrNotExist) {
		p.log.Warn("unreadable record of the instance's backend directories; cleaning up", "err", err)
	}
	// Where the files would have gone but for another user's file at a
	// name: a live primary of the instance (its runtime directory removed
	// while it ran) may hold its life file there, and a dead one may have
	// left files.
	if p.shared != "" {
		dirs = append(dirs, p.shared)
	}
	// A primary whose files went in a directory of its own made it there:
	// found by the instance's name, for its runtime directory may have
	// been removed while it ran (no record, no description names it then),
	// and it may still run.
	shared := p.backend.Dir
	if p.shared != "" {
		shared = p.shared
	}
	found, err := p.ownDirsIn(shared)
	if err != nil {
		return err
	}
	dirs = append(dirs, found...)
	// Recorded before this primary makes any file (its life file, below):
	// those directories, until they are cleaned, and its own, each once
	// (a primary killed here again and again must not grow the record).
	record := recordOf(append(slices.Clone(dirs), p.backend.Dir))
	if err := instance.WriteBackendsIn(p.rundir, record); err != nil {
		return err
	}
	p.recorded = true
	if p.private {
		// Made with the mode of the backend directories it stands for
		// (others reach the files in it by their names), whatever the
		// umask.
		if err := os.Mkdir(p.backend.Dir, 0o700); err != nil {
			return err
		}
		p.madeDir = true
		if err := os.Chmod(p.backend.Dir, 0o755); err != nil {
			return err
		}
	}
	// Nothing is looked up where a file system that might not answer is
	// mounted (anyone may mount one in a directory of theirs in a tmpfs
	// directory, at one of the instance's names): each directory is
	// reached one name at a time, links followed, without asking such a
	// file system (mounts.OpenDir), and none is mounted on the instance's
	// names where it leads. The primary's own directory then fails Start,
	// the others are left alone.
	tab, err := mounts.Read()
	if err != nil {
		return fmt.Errorf("reading the mount table: %w", err)
	}
	reach := func(dir, name string) (string, error) {
		f, resolved, m, err := mounts.OpenDir(dir)
		if err != nil {
			return "", err
		}
		f.Close()
		if dir != p.backend.Dir && m.Type != "tmpfs" && m.Type != "hugetlbfs" {
			return "", fmt.Errorf("%s is on %s (%s), where no primary makes its files", resolved, m.Dir, m.Type)
		}
		if m := instance.MountOnNames(tab, resolved, name); m != nil {
			return "", fmt.Errorf("%w: %s is mounted at %s", mounts.ErrMayHang, m.Type, m.Dir)
		}
		return resolved, nil
	}
	if _, err := reach(p.backend.Dir, p.name); errors.Is(err, mounts.ErrMayHang) {
		return fmt.Errorf("%w: where this instance's files go, %s: %w; unmount it, or use another prefix or "+
			"runtime directory", ErrPermission, p.backend.Dir, err)
	} else if err != nil {
		return err
	}
	reachable := func(dir, name string) (resolved string, ok, gone bool) {
		resolved, err := reach(dir, name)
		switch {
		case errors.Is(err, os.ErrNotExist):
			return "", false, true
		case err != nil:
			p.log.Warn("left alone a backend directory that cannot be looked into", "dir", dir, "err", err)
		}
		return resolved, err == nil, false
	}
	// The others first, each once, told from this primary's own by what
	// they are rather than how they are spelled: there, its own life file,
	// once taken, would be met as a live primary's.
	own, _ := os.Stat(p.backend.Dir)
	var seen []os.FileInfo
	// Directories that may still hold files of the instance stay in the
	// record: those that cannot be looked into, and those where files
	// were left alone.
	kept := []string{p.backend.Dir}
	for _, dir := range dirs {
		if dir == "" {
			continue
		}
		if p.privateShaped(dir) {
			switch mine, err := ownDir(dir); {
			case errors.Is(err, os.ErrNotExist):
				continue // gone
			case err != nil:
				p.log.Warn("left alone a backend directory that cannot be looked into", "dir", dir, "err", err)
				kept = append(kept, dir)
				continue
			case !mine:
				// Gone, and its name, which anyone could see, taken by
				// another user: not the instance's.
				p.log.Warn("left alone, and dropped from the record, what another user made at the name of a "+
					"directory a primary of the instance made for its files", "dir", dir)
				continue
			}
		}
		resolved, ok, gone := reachable(dir, p.name)
		if !ok {
			if !gone {
				kept = append(kept, dir)
			}
			continue
		}
		if fi, err := os.Stat(resolved); err == nil {
			if own != nil && os.SameFile(fi, own) || slices.ContainsFunc(seen, func(s os.FileInfo) bool { return os.SameFile(s, fi) }) {
				continue
			}
			seen = append(seen, fi)
		}
		if err := p.removeDeadFiles(resolved, p.name, false); err != nil {
			return err
		}
		if ownFiles(resolved, p.name) {
			kept = append(kept, dir)
		} else if p.removePrivateDir(resolved, p.name) != nil {
			kept = append(kept, dir)
		}
	}
	if moved != "" {
		// The runtime directory was moved (or copied) since the primary
		// that described it ran: its files are named for where it was.
		// They are a dead primary's of this user and prefix unless one
		// holds their life file (a copy's original, alive), and go as
		// this instance's would.
		foreign := false
		if p.privateShaped(dirs[0]) {
			mine, err := ownDir(dirs[0])
			if foreign = !mine; foreign && !errors.Is(err, os.ErrNotExist) {
				p.log.Warn("left alone what is at the name of the directory the description names",
					"dir", dirs[0], "err", err)
			}
		}
		if resolved, ok, _ := reachable(dirs[0], moved); ok && !foreign {
			if err := p.removeDeadFiles(resolved, moved, true); err != nil {
				return err
			}
			if left := instance.Files(resolved, moved); len(left) > 0 {
				p.log.Warn("files of the runtime directory this one was moved or copied from stay; their only "+
					"record, the description, goes", "files", left)
			} else {
				_ = p.removePrivateDir(resolved, moved) // else left with a warning
			}
		}
	}
	if err := p.removeDeadFiles(p.backend.Dir, p.name, false); err != nil {
		return err
	}
	record = recordOf(kept)
	if err := instance.WriteBackendsIn(p.rundir, record); err != nil {
		return err
	}
	p.ownOnly = len(record) == 1
	for _, name := range []string{instance.InfoFile, instance.InfoFile + ".tmp", instance.BackendsFile + ".tmp",
		instance.SlotsLockFile, ipc.SocketName} {
		if err := p.rundir.Remove(name); err == nil {
			p.log.Info("removed stale file", "path", filepath.Join(p.rundir.Path(), name))
		} else if !errors.Is(err, os.ErrNotExist) {
			p.log.Warn("could not remove stale file", "path", filepath.Join(p.rundir.Path(), name), "err", err)
		}
	}
	return nil
}

// recordOf returns dirs as the backends record holds them: each once,
// cleaned, and none that it cannot hold (a name with a newline, which a
// description could give).
func recordOf(dirs []string) []string {
	var record []string
	for _, dir := range dirs {
		if dir != "" && !strings.ContainsRune(dir, '\n') && !slices.Contains(record, filepath.Clean(dir)) {
			record = append(record, filepath.Clean(dir))
		}
	}
	return record
}

// removePrivateDir removes dir if it is a directory of this user that a
// primary made for the files of the instance called name (see Start),
// emptied.
func (p *Primary) removePrivateDir(dir, name string) error {
	if mine, _ := ownDir(dir); !instance.IsPrivateDir(filepath.Base(dir), name) || !mine {
		return nil
	}
	if err := os.Remove(dir); err != nil {
		p.log.Warn("could not remove a dead primary's directory", "dir", dir, "err", err)
		return err
	}
	p.log.Info("removed stale directory", "path", dir)
	return nil
}

// ownDirsIn lists the directories of this user in dir under a name a
// primary gives a directory of its own for the instance's files (see
// Start). Nothing else there is looked at, and nothing at all where a file
// system that might not answer is mounted on one of the instance's names
// (or below one): that fails with ErrPermission, as it fails the
// primary's own directory, since a primary of the instance may live
// there, unseen.
func (p *Primary) ownDirsIn(dir string) ([]string, error) {
	tab, err := mounts.Read()
	if err != nil {
		return nil, fmt.Errorf("reading the mount table: %w", err)
	}
	f, resolved, _, err := mounts.OpenDir(dir)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	mounted := func(m string) error {
		return fmt.Errorf("%w: where this instance's files go, %s: %w: %s; unmount it, or use another prefix "+
			"or runtime directory", ErrPermission, dir, mounts.ErrMayHang, m)
	}
	if m := instance.MountOnNames(tab, resolved, p.name); m != nil {
		return nil, mounted(fmt.Sprintf("%s is mounted at %s", m.Type, m.Dir))
	}
	if testHookMountsRead != nil {
		testHookMountsRead(dir)
	}
	ents, err := os.ReadDir(fmt.Sprintf("/proc/self/fd/%d", f.Fd())) // the directory held
	if err != nil {
		return nil, err
	}
	var out []string
	for _, e := range ents {
		if !e.IsDir() || !instance.IsPrivateDir(e.Name(), p.name) {
			continue
		}
		// Looked at through the directory held, crossing into no mount:
		// one may have been made since the table was read.
		st, err := mounts.StatAt(f, e.Name())
		switch {
		case errors.Is(err, mounts.ErrMayHang):
			return nil, mounted("something is mounted on " + filepath.Join(dir, e.Name()))
		case err == nil && st.Mode&syscall.S_IFMT == syscall.S_IFDIR && int(st.Uid) == os.Geteuid():
			out = append(out, filepath.Join(dir, e.Name()))
		}
	}
	return out, nil
}

// ownFiles reports whether any of the files of the instance called name
// in dir is a regular file of this user: one a primary of the instance
// may have made. What others made at the names is not the instance's to
// clean up after.
// (A name that cannot be looked at, something mounted on it, say, counts
// as one.)
func ownFiles(dir, name string) bool {
	f, _, _, err := mounts.OpenDir(dir)
	if err != nil {
		return !errors.Is(err, os.ErrNotExist)
	}
	defer f.Close()
	for _, path := range instance.Files(dir, name) {
		st, err := mounts.StatAt(f, filepath.Base(path))
		if err != nil && !errors.Is(err, os.ErrNotExist) ||
			err == nil && st.Mode&syscall.S_IFMT == syscall.S_IFREG && int(st.Uid) == os.Geteuid() {
			return true
		}
	}
	return false
}

// ownDir reports whether dir is a directory of this user, itself (not a
// link to one), looked at through its parent without crossing into a
// mount; or why it cannot tell (os.ErrNotExist if nothing is there).
func ownDir(dir string) (bool, error) {
	st, err := mounts.Lstat(dir)
	if err != nil {
		return false, err
	}
	return st.Mode&syscall.S_IFMT == syscall.S_IFDIR && int(st.Uid) == os.Geteuid(), nil
}

// privateShaped reports whether dir's name is one a primary gives a
// directory of its own for the files of an instance of this prefix and
// user, of any runtime directory (see Start).
func (p *Primary) privateShaped(dir string) bool {
	return instance.IsPrivateDirOf(filepath.Base(dir), p.cfg.Prefix, os.Geteuid())
}

// describedName returns the name (see instance.Name) the files of the
// primary that wrote info have, read from its segment's name, if that is
// a name of this prefix and user in the backend directory info names.
func (p *Primary) describedName(info instance.Info) (string, bool) {
	if info.BackendDir == "" || filepath.Dir(info.Segment) != filepath.Clean(info.BackendDir) {
		return "", false
	}
	return instance.SegmentName(info.Segment, p.cfg.Prefix, os.Geteuid())
}

// removeDeadFiles takes the life file of the instance files called name
// in backend directory dir and removes their other files there (see
// recoverLeftovers). In the primary's own backend directory it keeps its
// life file, held; elsewhere it removes it last. Files of another name
// (moved: see recoverLeftovers) that a live primary holds, or that are
// not this user's, are left alone with a warning.
func (p *Primary) removeDeadFiles(dir, name string, moved bool) error {
	own := dir == p.backend.Dir && !moved
	leave := func(err error) error {
		switch {
		case own:
			return err
		case moved:
			p.log.Warn("left alone the files of a runtime directory this one was moved or copied from",
				"dir", dir, "name", name, "err", err)
		default:
			// Anyone may make a file at one of the names where anyone may
			// make files: it does not keep the primary from starting
			// elsewhere.
			p.log.Warn("left alone what is at the instance's names in a backend directory a primary of it "+
				"used", "dir", dir, "err", err)
		}
		return nil
	}
	if !own && len(instance.Files(dir, name)) == 0 {
		return nil // nothing of the instance there (or no directory to look in)
	}
	segPath := instance.SegmentPath(dir, name)
	lifePath := instance.LifePath(dir, name)
	removed := func(path string) {
		p.log.Warn("removed a file at the life file's name that others could have held", "path", path)
	}
	var life *ofd.Claim
	var err error
	if moved {
		// Files named for another runtime directory are proven a dead
		// primary's only by their life file, there and held by nobody:
		// without one (removed, or never made), they may be a live one's.
		if life, err = instance.ClaimLife(dir, name, os.Geteuid(), removed); err == nil && life == nil {
			return leave(errors.New("no life file beside them proves their primary dead"))
		}
	} else {
		life, err = instance.TakeLife(dir, name, os.Geteuid(), removed)
	}
	switch {
	case !own && err != nil && !errors.Is(err, ofd.ErrLocked) && !errors.Is(err, ofd.ErrNotOwned):
		// The dead primary's backend directory takes no new file (read
		// only, full, no longer this user's to write): no primary of the
		// instance makes any there now, and what is left there stays.
		p.log.Warn("the previous primary's backend directory is out of reach; its files there stay",
			"dir", dir, "err", err)
		return nil
	case errors.Is(err, ofd.ErrLocked) && moved:
		return leave(fmt.Errorf("a live primary holds %s", lifePath))
	case errors.Is(err, ofd.ErrLocked):
		who := ""
		if info, err := shm.Probe(segPath, instance.LayoutTag); err == nil && info.CreatorPID != 0 {
			who = fmt.Sprintf(" (pid %d, says its segment)", info.CreatorPID)
		}
		if fi, err := os.Stat(lifePath); err == nil {
			if st, ok := fi.Sys().(*syscall.Stat_t); ok && st.Nlink > 1 {
				// Only the user's own process, or anyone where the kernel
				// lets a file be linked without access to it, links one.
				return fmt.Errorf("%w: %s is held, and has %d names: the life file of a live primary, this "+
					"instance's (its runtime directory %s removed or replaced while it ran) or another of this "+
					"user's, linked here; find that primary (its descriptors name the file) and stop it, or remove "+
					"the name if it is another instance's", ErrPrimaryRunning, lifePath, st.Nlink, p.dir)
			}
		}
		return fmt.Errorf("%w: a live primary%s of this instance holds %s, beside its segment %s: its runtime "+
			"directory %s was removed or replaced while it ran (stop it first), or a primary started in a copy "+
			"of that directory is cleaning up after the one that ran there (try again)",
			ErrPrimaryRunning, who, lifePath, segPath, p.dir)
	case errors.Is(err, ofd.ErrNotOwned):
		return leave(fmt.Errorf("%w: %w: a file this instance did not make is where its life file goes; "+
			"remove it (as root or its owner), or use another prefix or runtime directory", ErrPermission, err))
	case err != nil:
		return err
	}
	if testHookLifeTaken != nil {
		testHookLifeTaken(dir)
	}
	if own {
		p.life = life // teardown removes it, whatever happens next
	} else {
		defer func() {
			if err := life.Remove(); err != nil {
				p.log.Warn("could not remove stale life file", "path", lifePath, "err", err)
			}
		}()
	}
	// No primary of the instance lives or starts here while the life file
	// is held: what is left is a dead one's, whoever holds it open or
	// locked.
	if err := p.removeDeadSegment(segPath); err != nil {
		return leave(err)
	}
	err = hugetlb.RemoveEndedFiles(dir, name)
	switch {
	case errors.Is(err, hugetlb.ErrNotOwned):
		return leave(fmt.Errorf("%w: %w: a file this instance did not make is where its memory goes; "+
			"remove it (as root or its owner), or use another prefix or runtime directory", ErrPermission, err))
	case err != nil:
		p.log.Warn("could not remove stale memory files", "dir", dir, "err", err)
	}
	return nil
}

// removeDeadSegment marks dead and removes the segment at path, which
// removeDeadFiles proved a dead instance's if it is this user's.
func (p *Primary) removeDeadSegment(path string) error {
	c, err := ofd.ClaimEnded(path, os.Geteuid())
	switch {
	case errors.Is(err, os.ErrNotExist):
		return nil
	case errors.Is(err, ofd.ErrNotOwned):
		return fmt.Errorf("%w: %w: a file this instance did not make is where its segment goes; "+
			"remove it (as root or its owner), or use another prefix or runtime directory", ErrPermission, err)
	case err != nil:
		return err
	}
	if marked, err := shm.MarkEnded(c.File(), instance.LayoutTag); err != nil {
		p.log.Warn("could not mark stale segment dead", "segment", path, "err", err)
	} else if !marked {
		p.log.Warn("stale segment left unmarked: it has other names, or its creator runs", "segment", path)
	}
	if err := c.Remove(); err != nil {
		p.log.Warn("could not remove stale segment", "segment", path, "err", err)
		return nil
	}
	p.log.Info("removed stale file", "path", path)
	return nil
}

// testHookMountsRead, if set, runs in ownDirsIn once the mount table is
// read, before the backend directory dir is listed.
var testHookMountsRead func(dir string)

// testHookLifeTaken, if set, runs in removeDeadFiles once the life file of
// the backend directory dir is taken, before anything there is removed.
var testHookLifeTaken func(dir string)
