package main

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/instance"
	"github.com/mpmr/mpmr/internal/sys/falloc"
	"github.com/mpmr/mpmr/internal/sys/mounts"
	"github.com/mpmr/mpmr/internal/sys/ofd"
	"github.com/mpmr/mpmr/ipc"
	"github.com/mpmr/mpmr/shm"
)

var cmdClean = &command{
	name:    "clean",
	args:    "PREFIX",
	nargs:   1,
	summary: "remove a dead instance's files and return its hugepages",
	help: `
Removes what instance PREFIX left behind when its primary died: the control
segment and its lock file, the memseg lists' backing files in the backend
directory (so that their hugepages go back to the kernel), the primary's
life file, and the runtime directory's files (instance.json, the record of
the backend directories, the socket, slots.lock, primary.lock, then the
directory itself if it is empty).

It refuses, changing nothing, while the instance's primary lives (holds
the primary lock, or the lock on its life file); stop the primary
instead, which cleans up after itself. While it works it holds the primary
lock itself, so no new primary of PREFIX starts in the middle. Before
removing the segment it marks it dead, for secondaries of the dead
instance that still map it, unless the segment has other names or the
creator its header names still runs (it may be a live instance's, linked
here); their mappings keep the memory (and its hugepages) until they
exit, and clean names them.

Backend files are named after the instance (prefix, user and runtime
directory: mpmr.PREFIX.uUID.HASH.ctl, .msl0, ..., .live; in a directory
mpmr.PREFIX.uUID.HASH.p... of their own where another user held one of
those names, which clean removes with them when the description names it
and it is the instance user's), and clean removes
one only if it is a regular file of the instance's user, while it holds
the life file or where there is none (a live primary of a build from
before the life file has none: stop it first), whoever else holds the
segment or a backing file open or locked (the users the primary let in
may); anything else is left alone, with a warning. The runtime directory
keeps the instance's description (instance.json), with a warning, while
files of the instance it describes (by its segment's name) are still
there, the instance user's: left alone, or named for another runtime
directory (one moved since its primary ran: clean it from there).
The record of the backend directories (backends) stays too, with a
warning, while it names a directory clean did not look into: clean looks
only into the described directory, or without a description into the
hugetlbfs mounts and the tmpfs directory; a primary of the instance started
there cleans up in the others.

It reports what it removed and, on hugetlbfs, the free hugepages of the
instance's page size before and after.`,
	run: runClean,
}

// cleanOut is what clean reports.
type cleanOut struct {
	Prefix     string   `json:"prefix"`
	RuntimeDir string   `json:"runtime_dir"`
	Removed    []string `json:"removed"`
	MarkedDead []string `json:"marked_dead,omitempty"`
	// StillMapped are processes of the dead instance still alive: its
	// memory goes back to the kernel only when they exit.
	StillMapped []int          `json:"still_mapped_by,omitempty"`
	Hugepages   *hugepagesDiff `json:"hugepages,omitempty"`
	Warnings    []string       `json:"warnings,omitempty"`
}

type hugepagesDiff struct {
	PageSize   uint64 `json:"page_size"`
	FreeBefore uint64 `json:"free_before"`
	FreeAfter  uint64 `json:"free_after"`
	Total      uint64 `json:"total"`
}

// errPrimaryLives is clean's refusal.
var errPrimaryLives = errors.New("its primary is alive")

func runClean(e *env, args []string) error {
	out, err := answered(args[0], 0, func() (*cleanOut, error) {
		t, err := e.target(args[0])
		if err != nil {
			return nil, err
		}
		return clean(e, t)
	})
	if err != nil {
		return err
	}
	if e.json {
		return e.printJSON(out)
	}
	return out.print(e)
}

func clean(e *env, t *target) (*cleanOut, error) {
	// Everything in the runtime directory is reached through it, checked
	// (no link followed, no file of another user trusted): the directory
	// may belong to a user other than the one running the tool.
	rd, err := t.openDir()
	if err != nil {
		return nil, err
	}
	defer rd.Close()
	// Hold the primary lock while cleaning: a live primary makes this fail,
	// and no new primary can start halfway through.
	_, err = rd.Stat(instance.PrimaryLockFile)
	created := errors.Is(err, os.ErrNotExist)
	lockf, err := rd.OpenFile(instance.PrimaryLockFile, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, err
	}
	defer lockf.Close()
	lockPath := lockf.Name()
	if err := ofd.TryLock(lockf, 0, true); err != nil {
		if errors.Is(err, ofd.ErrLocked) {
			who := ""
			if pid := t.primaryPID(); pid != 0 {
				who = fmt.Sprintf(" (pid %d)", pid)
			}
			return nil, fmt.Errorf("refusing to clean %q: %w%s; stop the primary instead: it removes its files when it closes",
				t.Prefix, errPrimaryLives, who)
		}
		return nil, err
	}
	t = look(t.Prefix, t.Dir) // described again, now that nobody can change it
	defer t.release()
	// Where the tool may not look, it cannot tell whether a primary still
	// holds the instance's segment there: change nothing.
	if err := t.backendErr(); err != nil {
		if created {
			_ = rd.Remove(instance.PrimaryLockFile)
		}
		return nil, fmt.Errorf("refusing to clean %q: %w", t.Prefix, err)
	}
	// A primary whose lock file was removed under it still runs: it holds
	// the lock on its life file, and its segment's creator is alive. Touch
	// nothing of it. (A lock on its segment proves nothing: the users it
	// lets in hold that open, and may lock it.)
	for _, dir := range t.backendDirs() {
		segPath, lifePath := instance.SegmentPath(dir, t.Name), instance.LifePath(dir, t.Name)
		info, _ := shm.Probe(segPath, instance.LayoutTag)
		held, err := lifeHeld(lifePath, t.UID)
		if err != nil {
			if created {
				_ = rd.Remove(instance.PrimaryLockFile)
			}
			return nil, fmt.Errorf("refusing to clean %q: cannot tell whether a primary holds %s: %w", t.Prefix, lifePath, err)
		}
		if held || t.Info != nil && info.CreatorPID == t.Info.PID && shm.Running(info.CreatorPID, info.CreatorStart) {
			if created {
				_ = rd.Remove(instance.PrimaryLockFile)
			}
			return nil, fmt.Errorf("refusing to clean %q: %w (pid %d), though its lock file %s was replaced",
				t.Prefix, errPrimaryLives, info.CreatorPID, lockPath)
		}
	}
	out := &cleanOut{Prefix: t.Prefix, RuntimeDir: t.Dir}
	removeIn := func(name string) {
		switch err := rd.Remove(name); {
		case err == nil:
			out.Removed = append(out.Removed, filepath.Join(rd.Path(), name))
		case !errors.Is(err, os.ErrNotExist):
			out.Warnings = append(out.Warnings, err.Error())
		}
	}

	// On hugetlbfs, the pool of the mount's page size gets the pages back.
	var pageSize uint64
	for _, dir := range t.backendDirs() {
		if page, huge, err := falloc.DirBlockSize(dir); err == nil && huge && t.hasFiles(dir) {
			pageSize = page
		}
	}
	var before hugetlb.Pool
	if pageSize != 0 {
		before, _ = hugetlb.PoolFor(pageSize)
	}

	for _, dir := range t.backendDirs() {
		t.cleanBackend(e, rd, dir, out)
	}
	t.removeOwnDir(out)
	// The description is the only record of where the instance's files
	// are: it stays while files of the instance it describes are still
	// there, left alone above or named for another runtime directory.
	keepInfo := false
	if left, ours := t.describedLeft(); left {
		keepInfo = true
		why := "which clean left alone (see above)"
		if !ours {
			why = fmt.Sprintf("named for another runtime directory than %s, which clean does not touch "+
				"(was the directory moved or copied since its primary ran? clean it from where it was, "+
				"or start a primary here, which cleans up after a dead one)", t.Dir)
		}
		out.Warnings = append(out.Warnings, fmt.Sprintf("%s kept: files of the instance it describes (segment %q) "+
			"are still there, %s", filepath.Join(rd.Path(), instance.InfoFile), t.Info.Segment, why))
	}
	// The record of where the instance's primaries made files stays while
	// it names a directory clean did not look into: a primary of the
	// instance, started here, cleans up there (clean does not look into
	// directories the instance's user names, but for the described one).
	keepRecord := false
	looked := t.backendDirs()
	if t.Info != nil {
		looked = []string{filepath.Clean(t.Info.BackendDir)}
		if bk := t.backend(); bk.err == nil {
			looked = append(looked, bk.dir)
		}
	}
	if t.RecordErr != nil {
		keepRecord = true
		out.Warnings = append(out.Warnings, fmt.Sprintf("%s kept: it cannot be read: %v",
			filepath.Join(rd.Path(), instance.BackendsFile), t.RecordErr))
	}
	for _, dir := range t.Recorded {
		if !slices.Contains(looked, filepath.Clean(dir)) {
			keepRecord = true
			out.Warnings = append(out.Warnings, fmt.Sprintf("%s kept: it names %q, where a primary of the instance "+
				"may have left files and clean does not look; a primary of the instance started here cleans up there",
				filepath.Join(rd.Path(), instance.BackendsFile), dir))
		}
	}
	for _, name := range []string{instance.InfoFile, instance.InfoFile + ".tmp", instance.BackendsFile,
		instance.BackendsFile + ".tmp", ipc.SocketName, instance.SlotsLockFile} {
		if name == instance.InfoFile && keepInfo || name == instance.BackendsFile && keepRecord {
			continue
		}
		removeIn(name)
	}
	// The primary lock goes last, as a closing primary does it: a primary
	// starting now retries on the new file.
	removeIn(instance.PrimaryLockFile)
	// The directory goes only if its path still names the one checked.
	if err := rd.RemoveDir(); err == nil {
		out.Removed = append(out.Removed, rd.Path())
	} else {
		out.Warnings = append(out.Warnings, fmt.Sprintf("runtime directory %s kept: %v", t.Dir, err))
	}
	if pageSize != 0 {
		after, _ := hugetlb.PoolFor(pageSize)
		out.Hugepages = &hugepagesDiff{PageSize: pageSize, FreeBefore: before.Free, FreeAfter: after.Free, Total: after.Total}
	}
	for _, l := range [][]string{out.Removed, out.MarkedDead, out.Warnings} {
		for i := range l {
			l[i] = t.shown(l[i])
		}
	}
	return out, nil
}

// removeOwnDir removes the described backend directory, emptied, if it is
// one a primary of the instance made for its files (see
// instance.PrivateDirName) and still the directory looked into. (Without
// a description, clean does not look into such a directory, which the
// instance's user could swap for a link: the record, which names it,
// stays, and a primary started there cleans up.)
func (t *target) removeOwnDir(out *cleanOut) {
	if t.Info == nil || !instance.IsPrivateDir(filepath.Base(t.Info.BackendDir), t.Name) {
		return
	}
	bk := t.backend()
	if bk.err != nil || t.hasFiles(bk.path) {
		return
	}
	if held, err := bk.f.Stat(); err == nil {
		t.removeDir(t.Info.BackendDir, held, out)
	}
}

// removeDir removes the directory at path if it is still the one looked
// into (looked) and the instance user's. It is removed through its parent,
// reached as a backend directory is, by its name there: the description
// is the instance user's word, and run by root the tool must not follow
// that user's links.
func (t *target) removeDir(path string, looked os.FileInfo, out *cleanOut) {
	parent, _, _, err := mounts.OpenDir(filepath.Dir(path))
	if err != nil {
		out.Warnings = append(out.Warnings, fmt.Sprintf("%s kept: %v", path, err))
		return
	}
	defer parent.Close()
	base := filepath.Base(path)
	st, err := mounts.StatAt(parent, base)
	if err != nil {
		out.Warnings = append(out.Warnings, fmt.Sprintf("%s kept: %v", path, err))
		return
	}
	h, ok := looked.Sys().(*syscall.Stat_t)
	if !ok || st.Mode&unix.S_IFMT != unix.S_IFDIR || st.Dev != h.Dev || st.Ino != h.Ino || int(st.Uid) != t.UID {
		out.Warnings = append(out.Warnings, fmt.Sprintf("%s kept: no longer the directory looked into", path))
		return
	}
	if err := unix.Unlinkat(int(parent.Fd()), base, unix.AT_REMOVEDIR); err != nil {
		out.Warnings = append(out.Warnings, fmt.Sprintf("%s kept: %v", path, err))
		return
	}
	out.Removed = append(out.Removed, path)
}

// describedLeft reports whether a file of the instance files the
// description names (by its segment, a segment name of this prefix and
// user) is still in the backend directory the description names, and
// whether those are named as the instance's runtime directory names them
// (see instance.Name). The directory is listed, and only its regular files
// at those names are looked at (a mount point lists as a directory): the
// description is the instance user's word.
func (t *target) describedLeft() (left, ours bool) {
	if t.Info == nil || t.Info.BackendDir == "" || filepath.Dir(t.Info.Segment) != filepath.Clean(t.Info.BackendDir) {
		return false, false
	}
	name, ok := instance.SegmentName(t.Info.Segment, t.Prefix, t.UID)
	if !ok {
		return false, false
	}
	bk := t.backend()
	if bk.err != nil {
		return false, false
	}
	ents, err := os.ReadDir(bk.path)
	if err != nil {
		return false, false
	}
	files := instance.Files(bk.path, name)
	for _, e := range ents {
		if !e.Type().IsRegular() || !slices.Contains(files, filepath.Join(bk.path, e.Name())) {
			continue
		}
		// A file of the instance's user only: anyone may make one at the
		// name in a tmpfs directory.
		if fi, err := e.Info(); err == nil {
			if st, ok := fi.Sys().(*syscall.Stat_t); ok && int(st.Uid) == t.UID {
				return true, name == t.Name
			}
		}
	}
	return false, false
}

// hasFiles reports whether dir holds any of the instance's backend files.
func (t *target) hasFiles(dir string) bool {
	return len(instance.Files(dir, t.Name)) > 0
}

// memoryFiles lists the memseg lists' backing files of the instance called
// name in dir.
func memoryFiles(dir, name string) []string {
	var out []string
	for _, p := range instance.Files(dir, name) {
		if strings.HasPrefix(filepath.Base(p), "mpmr."+name+".msl") {
			out = append(out, p)
		}
	}
	return out
}

// lifeHeld reports whether a live process holds the lock a primary holds
// on its life file (instance.LifePath) for its lifetime. A path that
// names nothing, a link, or no private regular file of uid is no
// primary's life file (see ofd.ClaimPrivate); any other failure to look
// is an error, so that the caller refuses rather than guesses.
func lifeHeld(path string, uid int) (bool, error) {
	private := func(fi os.FileInfo) bool {
		st, ok := fi.Sys().(*syscall.Stat_t)
		return ok && fi.Mode().IsRegular() && int(st.Uid) == uid && st.Mode&0o7777 == ofd.PrivateMode && fi.Size() == 0
	}
	// Looked at before it is opened: what is no life file (a FIFO among
	// others) is not opened at all.
	fi, err := os.Lstat(path)
	if errors.Is(err, os.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	if !private(fi) {
		return false, nil
	}
	// Opened for writing, all its mode lets its owner do.
	f, err := os.OpenFile(path, os.O_WRONLY|syscall.O_NOFOLLOW|syscall.O_NONBLOCK, 0)
	if err != nil {
		return false, err
	}
	defer f.Close()
	if fi, err = f.Stat(); err != nil {
		return false, err
	}
	if !private(fi) {
		return false, nil
	}
	return ofd.Held(f, 0)
}

// cleanBackend removes the instance's segment and memory files in dir:
// only the instance user's, whatever their names say, and only while it
// holds the instance's life file there (instance.ClaimLife), which proves
// that no primary of the instance lives or starts there, or when there is
// none, which proves only that none lives (it makes none: run as root, it
// would make a file for that user where the user may not; a primary of
// the instance starting meanwhile would have to come from a runtime
// directory replaced under clean, which holds the primary lock of the
// one it found); it removes the life file last.
func (t *target) cleanBackend(e *env, rd *ipc.RunDir, dir string, out *cleanOut) {
	if !t.hasFiles(dir) {
		return
	}
	lifePath := instance.LifePath(dir, t.Name)
	life, err := instance.ClaimLife(dir, t.Name, t.UID, func(path string) {
		out.Removed = append(out.Removed, path)
		out.Warnings = append(out.Warnings, fmt.Sprintf("%s was no life file (others could have held it)", path))
	})
	switch {
	case errors.Is(err, ofd.ErrNotOwned):
		// Made by someone else before any primary could make it: no
		// primary of the instance got past that here.
		out.Warnings = append(out.Warnings, fmt.Sprintf("%s left alone: %v", lifePath, err))
	case errors.Is(err, ofd.ErrLocked):
		out.Warnings = append(out.Warnings, fmt.Sprintf("%s left alone, and the instance's files beside it: "+
			"a live process holds it (a primary started meanwhile?)", lifePath))
		return
	case err != nil:
		out.Warnings = append(out.Warnings, fmt.Sprintf("%s left alone, and the instance's files beside it: %v", lifePath, err))
		return
	}
	claimWith := func(how func(string, int) (*ofd.Claim, error), path string) *ofd.Claim {
		c, err := how(path, t.UID)
		switch {
		case errors.Is(err, os.ErrNotExist):
		case errors.Is(err, ofd.ErrLocked):
			out.Warnings = append(out.Warnings, fmt.Sprintf("%s left alone: a live process holds it", path))
		case err != nil:
			out.Warnings = append(out.Warnings, fmt.Sprintf("%s left alone: %v", path, err))
		}
		return c
	}
	removeClaimed := func(path string, c *ofd.Claim) {
		if err := c.Remove(); err != nil {
			out.Warnings = append(out.Warnings, err.Error())
		} else {
			out.Removed = append(out.Removed, path)
		}
	}
	segPath := instance.SegmentPath(dir, t.Name)
	// The segment and the backing files go whoever holds them locked; the
	// slots' lock file beside a segment made without a runtime directory
	// stays while a live process holds its byte 0, the first slot's (it
	// blocks nothing).
	claim := func(path string) *ofd.Claim { return claimWith(ofd.ClaimEnded, path) }
	if c := claim(segPath); c != nil {
		// The claimed file, not its name: the instance's user could swap
		// a link in under the name meanwhile.
		held := fmt.Sprintf("/proc/self/fd/%d", c.File().Fd())
		_, perr := shm.ProbeFile(c.File(), instance.LayoutTag)
		o := shm.Options{LayoutTag: instance.LayoutTag, Path: held, Logger: e.log}
		var lerr error
		if o.LockFile, o.NoLockFile, lerr = openSlotsLock(rd); lerr != nil {
			out.Warnings = append(out.Warnings, fmt.Sprintf("which processes still map the segment is not known: %v", lerr))
		} else if seg, _, err := shm.OpenReadOnly(o); err == nil {
			for _, p := range seg.Procs() {
				if p.Alive {
					out.StillMapped = append(out.StillMapped, p.PID)
				}
			}
			seg.Close()
		}
		if perr == nil || errors.Is(perr, shm.ErrNotReady) {
			switch marked, err := shm.MarkEnded(c.File(), instance.LayoutTag); {
			case err != nil:
				out.Warnings = append(out.Warnings, err.Error())
			case marked:
				out.MarkedDead = append(out.MarkedDead, segPath)
			default:
				out.Warnings = append(out.Warnings, fmt.Sprintf("%s not marked dead: it has other names, "+
					"or its creator runs (another instance's, linked here?)", segPath))
			}
		}
		removeClaimed(segPath, c)
		// A segment made without a lock file in a runtime directory has
		// it beside: claimed (ClaimFile: only if byte 0 is free), whatever
		// is at its name.
		if c := claimWith(ofd.ClaimFile, segPath+".lock"); c != nil {
			removeClaimed(segPath+".lock", c)
		}
	}
	for _, p := range memoryFiles(dir, t.Name) {
		if c := claim(p); c != nil {
			removeClaimed(p, c)
		}
	}
	if life != nil {
		removeClaimed(lifePath, life)
	}
}

func (o *cleanOut) print(e *env) error {
	w := e.stdout
	for _, p := range o.MarkedDead {
		fmt.Fprintf(w, "marked dead %s\n", p)
	}
	for _, p := range o.Removed {
		fmt.Fprintf(w, "removed %s\n", p)
	}
	if len(o.Removed) == 0 {
		fmt.Fprintf(w, "nothing to remove for %s\n", o.Prefix)
	}
	for _, msg := range o.Warnings {
		fmt.Fprintf(w, "warning: %s\n", msg)
	}
	if len(o.StillMapped) > 0 {
		fmt.Fprintf(w, "still mapped by processes of the dead instance: pids %v; their memory returns when they exit\n", o.StillMapped)
	}
	if h := o.Hugepages; h != nil {
		fmt.Fprintf(w, "hugepages (%s): %d free before, %d free after, of %d\n",
			size(h.PageSize), h.FreeBefore, h.FreeAfter, h.Total)
	}
	return nil
}
