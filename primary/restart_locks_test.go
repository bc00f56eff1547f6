package primary_test

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/instance"
	"github.com/mpmr/mpmr/internal/sys/ofd"
	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/ipc"
	"github.com/mpmr/mpmr/primary"
)

func init() {
	testproc.Register("user-files", helperUserFiles)
	testproc.Register("stalled-recovery", helperStalledRecovery)
}

// helperUserFiles becomes uid args[0], says "result ERR", then answers
// commands, "> ok" or "> err TEXT":
//
//	link SRC DST -> a hard link
//	lock PATH    -> opens PATH, locks byte 0 and holds it until input ends
func helperUserFiles(args []string) int {
	uid, _ := strconv.Atoi(args[0])
	err := testenv.BecomeUser(uid)
	testproc.Say("result %v", err)
	if err != nil {
		return 0
	}
	in := testproc.Commands()
	for in.Scan() {
		f := strings.Fields(in.Text())
		var err error
		switch {
		case len(f) == 3 && f[0] == "link":
			err = os.Link(f[1], f[2])
		case len(f) == 2 && f[0] == "lock":
			var h *os.File
			if h, err = os.OpenFile(f[1], os.O_RDWR, 0); err == nil {
				if err = ofd.TryLock(h, 0, true); err == nil {
					kept = append(kept, h) // held, and its lock, until the helper ends
				}
			}
		default:
			err = fmt.Errorf("unknown command %q", in.Text())
		}
		if err != nil {
			testproc.Say("> err %v", err)
		} else {
			testproc.Say("> ok")
		}
	}
	return 0
}

// helperStalledRecovery starts a primary of prefix args[0], runtime
// directory args[1], tmpfs backend directory args[2], that stops once it
// has taken the life file there: it says "taken" and waits for a line on
// its input. Then it says "result ERR" and serves until its input ends.
func helperStalledRecovery(args []string) int {
	in := testproc.Commands()
	primary.SetLifeTaken(func(string) {
		testproc.Say("taken")
		in.Scan()
	})
	p, err := primary.Start(primary.Config{Prefix: args[0], RuntimeDir: args[1], Backend: hugetlb.Tmpfs,
		BackendDir: args[2], MemoryPages: 16, Logger: quiet})
	testproc.Say("result %v", err)
	if err != nil {
		return 0
	}
	defer p.Close()
	for in.Scan() {
	}
	return 0
}

// kept holds what a helper keeps open for its life.
var kept []*os.File

// sayCount runs f and says "> WHAT N" with the count it returns, or its
// error.
func sayCount(what string, f func() (int, error)) {
	if n, err := f(); err != nil {
		testproc.Say("> err %v", err)
	} else {
		testproc.Say("> %s %d", what, n)
	}
}

// keepBacking duplicates every descriptor this process holds of an
// instance's segment or backing files; the copies share the open file
// descriptions, whatever the library closes. It returns how many.
func keepBacking() (int, error) {
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		return 0, err
	}
	n := 0
	for _, e := range ents {
		fd, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		target, err := os.Readlink("/proc/self/fd/" + e.Name())
		base := filepath.Base(target)
		if err != nil || !strings.HasPrefix(base, "mpmr.") || !strings.HasSuffix(base, ".ctl") && !strings.Contains(base, ".msl") {
			continue
		}
		dup, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
		if err != nil {
			return n, err
		}
		kept = append(kept, os.NewFile(uintptr(dup), target))
		n++
	}
	return n, nil
}

// emptyKept truncates every backing file keepBacking kept to 0 bytes
// (through the descriptor it was handed, open for writing) and returns
// how many.
func emptyKept() (int, error) {
	n := 0
	for _, f := range kept {
		if strings.Contains(filepath.Base(f.Name()), ".msl") {
			if err := f.Truncate(0); err != nil {
				return n, err
			}
			n++
		}
	}
	return n, nil
}

// lockKept locks byte 0 of every file keepBacking kept, as a primary
// does on its own for its lifetime. It returns how many it locked.
func lockKept() (int, error) {
	for i, f := range kept {
		if err := ofd.TryLock(f, 0, true); err != nil {
			return i, err
		}
	}
	return len(kept), nil
}

// A user the primary lets in holds the instance's segment and the backing
// files it was handed. Once the primary has died, that user keeps a lock
// on byte 0 of each, as a live primary does on its own files; the
// instance's user must still be able to start its primary again, and the
// dead primary's files go.
func TestAnAllowedUsersLocksDoNotKeepADeadPrimaryFromRestarting(t *testing.T) {
	requireRoot(t)
	prefix, shared, _ := twoUserInstance(t, victimUID, -1)
	start := func() *testproc.Proc {
		p, res := userProc(t, "user-primary", nil, strconv.Itoa(victimUID), prefix, shared,
			strconv.Itoa(squatterUID), "open")
		require.Equal(t, "<nil>", res)
		return p
	}
	p := start()
	r := askProc(t, p, "alloc")
	addr, err := strconv.ParseUint(strings.TrimPrefix(r, "region "), 10, 64)
	require.NoError(t, err, r)
	s, res := userProc(t, "user-secondary", nil, strconv.Itoa(squatterUID), prefix, shared, strconv.Itoa(victimUID))
	require.Equal(t, "<nil>", res)
	require.Equal(t, "wrote", askProc(t, s, "write %d 7", addr))
	var held int
	_, err = fmt.Sscanf(askProc(t, s, "keep-backing"), "kept %d", &held)
	require.NoError(t, err)
	require.GreaterOrEqual(t, held, 2, "the segment and the one backing file, at least")
	old, err := filepath.Glob(filepath.Join(hugetlb.DefaultTmpfsDir, "mpmr."+prefix+".*[0-9l]")) // .ctl, .msl0
	require.NoError(t, err)
	require.Len(t, old, 2)
	var before []os.FileInfo
	for _, f := range old {
		fi, err := os.Stat(f)
		require.NoError(t, err)
		before = append(before, fi)
	}

	p.Kill()
	_ = p.Wait(0)
	require.Equal(t, "locked "+strconv.Itoa(held), askProc(t, s, "lock-kept"))
	var again *testproc.Proc
	for range 100 { // its listening socket may linger an instant after SIGKILL
		h, res := userProc(t, "user-primary", nil, strconv.Itoa(victimUID), prefix, shared,
			strconv.Itoa(squatterUID), "open")
		if res == "<nil>" {
			again = h
			break
		}
		require.NoError(t, h.Wait(0))
		require.Contains(t, res, ipc.ErrAddressInUse.Error(), "the dead primary's user starts it again")
	}
	require.NotNil(t, again)
	_, err = strconv.ParseUint(strings.TrimPrefix(askProc(t, again, "alloc"), "region "), 10, 64)
	require.NoError(t, err, "the new primary allocates")
	for i, f := range old {
		fi, err := os.Stat(f)
		require.NoError(t, err, "the new primary's file at %s", f)
		assert.False(t, os.SameFile(before[i], fi), "%s is a new file, not the dead primary's", f)
	}
}

// A user the primary lets in may write the segment, so the kernel lets it
// hard-link the segment under a name of its own while the primary runs;
// once the primary has closed, it links that inode under the life file's
// name and locks it. A file others could hold is no life file: the
// instance's user starts its primary again, with a life file of its own.
func TestALinkToTheSegmentAtTheLifeFilesNameIsNoLifeFile(t *testing.T) {
	requireRoot(t)
	prefix, shared, _ := twoUserInstance(t, victimUID, -1)
	p, res := userProc(t, "user-primary", nil, strconv.Itoa(victimUID), prefix, shared,
		strconv.Itoa(squatterUID), "open")
	require.Equal(t, "<nil>", res)
	name := runtimeName(prefix, victimUID, shared)
	seg := instance.SegmentPath(hugetlb.DefaultTmpfsDir, name)
	life := instance.LifePath(hugetlb.DefaultTmpfsDir, name)
	keep := filepath.Join(hugetlb.DefaultTmpfsDir, "kept-by-"+strconv.Itoa(squatterUID)+"-"+prefix)
	t.Cleanup(func() { os.Remove(keep) })

	a, res := userProc(t, "user-files", nil, strconv.Itoa(squatterUID))
	require.Equal(t, "<nil>", res)
	require.Equal(t, "ok", askProc(t, a, "link %s %s", seg, keep), "the allowed user keeps a link to the segment")
	p.End(0) // a clean stop: the primary removes its segment and life file
	require.NoFileExists(t, life)
	require.NoFileExists(t, seg)
	require.Equal(t, "ok", askProc(t, a, "link %s %s", keep, life))
	require.Equal(t, "ok", askProc(t, a, "lock %s", life))

	again, res := userProc(t, "user-primary", nil, strconv.Itoa(victimUID), prefix, shared, "", "")
	require.Equal(t, "<nil>", res, "the instance's user starts its primary again")
	kept, err := os.Stat(keep)
	require.NoError(t, err)
	now, err := os.Stat(life)
	require.NoError(t, err)
	assert.False(t, os.SameFile(kept, now), "the new primary's life file is its own")
	assert.Equal(t, os.FileMode(ofd.PrivateMode), now.Mode().Perm())
	assert.Equal(t, uint64(1), kept.Sys().(*syscall.Stat_t).Nlink, "the linked name is gone; the user's own link stays")
	again.End(0)
	assert.NoFileExists(t, life, "and is removed when it closes")
}

// A starting primary holds the instance's life file from before it looks
// at what a dead predecessor left until it ends: here one stops right
// after taking it, the runtime directory is replaced, and another primary
// of the instance starts on the same backend directory. The second finds
// the first alive and makes nothing there, so the first, going on, has
// nothing of a live primary's to remove. (The first then fails, its
// runtime directory gone, and removes what it made.)
func TestAPrimaryStoppedInRecoveryKeepsAnotherFromStarting(t *testing.T) {
	dir, err := os.MkdirTemp(hugetlb.DefaultTmpfsDir, "stalled")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(dir) })
	prefix, rundir := testenv.Prefix(t), testenv.RunDir(t)
	name := instance.Name(prefix, os.Geteuid(), filepath.Join(rundir, prefix))

	a := testproc.Start(t, "stalled-recovery", []string{prefix, rundir, dir})
	a.Expect("taken", 0)
	require.NoError(t, os.RemoveAll(filepath.Join(rundir, prefix)), "an operator's rm -rf")
	b, err := primary.Start(primary.Config{Prefix: prefix, RuntimeDir: rundir, Backend: hugetlb.Tmpfs,
		BackendDir: dir, MemoryPages: 16, Logger: quiet})
	if err == nil {
		b.Close()
	}
	require.ErrorIs(t, err, primary.ErrPrimaryRunning, "the stopped primary holds the instance")
	assert.Equal(t, []string{instance.LifePath(dir, name)}, instance.Files(dir, name),
		"the stopped primary's life file, and nothing of the other's")
	a.Send("go on")
	res := a.Expect("result ", 0)
	assert.Contains(t, res, filepath.Join(rundir, prefix)+"/", "its runtime directory is gone")
	assert.Contains(t, res, "no such file or directory", "its runtime directory is gone")
	a.CloseInput()
	require.NoError(t, a.Wait(0))
	assert.Empty(t, instance.Files(dir, name), "it removes what it made")
}

// A backing file the primary handed to a user it lets in, mode 0600 and
// its user's, can be linked by that user where the kernel allows it
// (fs.protected_hardlinks=0, the kernel's own default; here root makes the
// links that user could make): kept under a name of its own while the
// primary runs, then, once the primary has closed, put under the life
// file's name with one link, emptied through the handed descriptor, and
// locked. A file its user could hand on is no life file: the instance's
// user starts its primary again.
func TestAHandedBackingFileAtTheLifeFilesNameIsNoLifeFile(t *testing.T) {
	requireRoot(t)
	prefix, shared, _ := twoUserInstance(t, victimUID, -1)
	p, res := userProc(t, "user-primary", nil, strconv.Itoa(victimUID), prefix, shared,
		strconv.Itoa(squatterUID), "open-handed")
	require.Equal(t, "<nil>", res)
	name := runtimeName(prefix, victimUID, shared)
	life := instance.LifePath(hugetlb.DefaultTmpfsDir, name)
	msl := filepath.Join(hugetlb.DefaultTmpfsDir, hugetlb.FileName(name, 0))
	stash := filepath.Join(hugetlb.DefaultTmpfsDir, "stashed-"+prefix)
	t.Cleanup(func() { os.Remove(stash) })

	s, res := userProc(t, "user-secondary", nil, strconv.Itoa(squatterUID), prefix, shared, strconv.Itoa(victimUID))
	require.Equal(t, "<nil>", res)
	require.NotEqual(t, "kept 0", askProc(t, s, "keep-backing"))
	fi, err := os.Stat(msl)
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o600), fi.Mode().Perm(), "handed, not opened by path")
	require.NoError(t, os.Link(msl, stash))
	p.End(0) // a clean stop: the primary removes its files
	require.NoFileExists(t, life)
	require.NoError(t, os.Link(stash, life))
	require.NoError(t, os.Remove(stash))
	require.Regexp(t, "^emptied [1-9][0-9]*$", askProc(t, s, "empty-kept"))
	require.Regexp(t, "^locked [0-9]+$", askProc(t, s, "lock-kept"))
	fi, err = os.Stat(life)
	require.NoError(t, err)
	require.Zero(t, fi.Size())
	require.Equal(t, uint64(1), fi.Sys().(*syscall.Stat_t).Nlink)

	again, res := userProc(t, "user-primary", nil, strconv.Itoa(victimUID), prefix, shared, "", "")
	require.Equal(t, "<nil>", res, "the instance's user starts its primary again")
	now, err := os.Stat(life)
	require.NoError(t, err)
	assert.False(t, os.SameFile(fi, now), "with a life file of its own")
	again.End(0)
}

// A dead primary's description names a backend directory that is gone
// (removed, unmounted): nothing of the instance is there to remove, and
// nothing keeps its user's primary from starting.
func TestADeadPrimarysVanishedBackendDirectoryIsNoObstacle(t *testing.T) {
	rundir, prefix := testenv.RunDir(t), testenv.Prefix(t)
	dir := filepath.Join(rundir, prefix)
	require.NoError(t, os.MkdirAll(dir, 0o700))
	gone := filepath.Join(t.TempDir(), "was-a-tmpfs")
	startOverDeadPrimary(t, rundir, prefix, gone, instance.SegmentPath(gone, instance.Name(prefix, os.Geteuid(), dir)))
	assert.NoDirExists(t, gone, "and nothing is made there")
}

// startOverDeadPrimary describes, in the runtime directory of instance
// prefix, a dead primary whose backend directory was backendDir and its
// segment seg, then starts and closes a primary of the instance on tmpfs.
func startOverDeadPrimary(t *testing.T, rundir, prefix, backendDir, seg string) {
	t.Helper()
	js, err := json.Marshal(instance.Info{Prefix: prefix, PID: 1, Backend: hugetlb.Tmpfs.String(),
		BackendDir: backendDir, Segment: seg})
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(rundir, prefix, instance.InfoFile), js, 0o600))
	p, err := primary.Start(primary.Config{Prefix: prefix, RuntimeDir: rundir, Backend: hugetlb.Tmpfs,
		MemoryPages: 4, Logger: quiet})
	require.NoError(t, err)
	require.NoError(t, p.Close())
}

// Where the kernel lets anyone link a file (fs.protected_hardlinks=0; root
// stands for that user here), a live instance's segment can be linked
// under the segment name of another instance of the same user that is
// not running. Starting that one removes the name, as a dead
// predecessor's, but must not mark the live one's segment dead.
func TestALiveSegmentLinkedUnderAnotherInstancesNameIsNotMarkedDead(t *testing.T) {
	requireRoot(t)
	b := testenv.Tmpfs(t)
	rundir := testenv.RunDir(t)
	cfgA := primary.Config{Prefix: testenv.Prefix(t), RuntimeDir: rundir, Backend: b.Kind, MemoryPages: 16, Logger: quiet}
	a, err := primary.Start(cfgA)
	require.NoError(t, err)
	defer a.Close()
	cfgB := cfgA
	cfgB.Prefix = testenv.Prefix(t)
	cfgB.MemoryBase = a.Memory().Lists()[0].End + 1<<30 // both in this process
	segB := instance.SegmentPath(b.Dir, instance.Name(cfgB.Prefix, os.Geteuid(), filepath.Join(rundir, cfgB.Prefix)))
	require.NoError(t, os.Link(a.Segment().Path(), segB))
	t.Cleanup(func() { os.Remove(segB) })

	pb, err := primary.Start(cfgB)
	require.NoError(t, err)
	defer pb.Close()
	assert.True(t, a.Segment().Ready(), "the live instance's segment is not marked dead")
	fi, err := os.Stat(a.Segment().Path())
	require.NoError(t, err)
	assert.Equal(t, uint64(1), fi.Sys().(*syscall.Stat_t).Nlink, "the name linked to it went")
	_, err = a.Alloc(b.PageSize)
	assert.NoError(t, err, "and it works on")
}

// A dead primary's description names a backend directory other than the
// new primary's that takes no new file — read-only now, or full — with a
// leftover of the instance in it: it stays, and the new primary starts.
func TestADeadPrimarysOldBackendDirectoryThatTakesNoFileIsNoObstacle(t *testing.T) {
	requireRoot(t)
	for _, how := range []string{"read-only", "full"} {
		t.Run(how, func(t *testing.T) {
			rundir, prefix := testenv.RunDir(t), testenv.Prefix(t)
			dir := filepath.Join(rundir, prefix)
			require.NoError(t, os.MkdirAll(dir, 0o700))
			old := t.TempDir()
			require.NoError(t, unix.Mount("mpmr-test", old, "tmpfs", 0, "size=1m,nr_inodes=2"))
			t.Cleanup(func() { unix.Unmount(old, unix.MNT_DETACH) })
			seg := instance.SegmentPath(old, instance.Name(prefix, os.Geteuid(), dir))
			require.NoError(t, os.WriteFile(seg, []byte("left"), 0o600)) // the last inode
			if how == "read-only" {
				require.NoError(t, unix.Mount("", old, "", unix.MS_REMOUNT|unix.MS_RDONLY, ""))
			}
			startOverDeadPrimary(t, rundir, prefix, old, seg)
			assert.FileExists(t, seg, "out of reach, it stays")
		})
	}
}

// A start refused because a primary lives (one whose primary lock file
// was removed, by a cleaner of temporary files, say) takes nothing of that
// primary's with it: its socket and its description stay, and
// secondaries still attach.
func TestARefusedStartLeavesTheLivePrimarysSocketAndDescription(t *testing.T) {
	p, cfg := startPrimary(t, testenv.Tmpfs(t))
	dir := filepath.Join(cfg.RuntimeDir, cfg.Prefix)
	require.NoError(t, os.Remove(filepath.Join(dir, instance.PrimaryLockFile)))
	again, err := primary.Start(cfg)
	if err == nil {
		again.Close()
	}
	require.ErrorIs(t, err, primary.ErrPrimaryRunning)
	assert.FileExists(t, filepath.Join(dir, ipc.SocketName))
	assert.FileExists(t, filepath.Join(dir, instance.InfoFile))
	r, err := p.Alloc(p.Backend().PageSize)
	require.NoError(t, err)
	sec := startSecondary(t, cfg)
	k := parseKey(t, ask(t, sec, "lookup %d", r.Addr))
	assert.Equal(t, "ok", ask(t, sec, "validate %d %d", r.Addr, k), "a secondary attaches and works")
}
