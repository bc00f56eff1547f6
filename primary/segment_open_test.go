package primary_test

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/instance"
	"github.com/mpmr/mpmr/internal/test/fusetest"
	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/primary"
	"github.com/mpmr/mpmr/secondary"
)

// The control segment is the one file a secondary opens by the path the
// primary's description (instance.json) names, and the primary's user
// may write that description. README, "Nobody else gets in": that user
// is trusted to serve, not to have a secondary open files as itself.

func init() {
	testproc.Register("attach-loop", helperAttachLoop)
	testproc.Register("seg-fuse", fusetest.Helper)
	testproc.Register("lease-as", helperLeaseAs)
}

// helperLeaseAs becomes uid args[0], takes a read lease on file args[1]
// (its owner may), says "leased ERR" and keeps it, never letting go when
// asked, until its input ends.
func helperLeaseAs(args []string) int {
	uid, _ := strconv.Atoi(args[0])
	err := testenv.BecomeUser(uid)
	var fd int
	if err == nil {
		fd, err = unix.Open(args[1], unix.O_RDONLY|unix.O_CLOEXEC, 0)
	}
	if err == nil {
		_, err = unix.FcntlInt(uintptr(fd), unix.F_SETLEASE, unix.F_RDLCK)
	}
	testproc.Say("leased %v", err)
	testproc.EachCommand(func(testproc.Line) {})
	return 0
}

// helperAttachLoop becomes uid args[0] and attaches to prefix args[1] in
// runtime directory args[2], trusting uid args[3], args[4] times; it says
// "result " and how often each error came (digits left out).
func helperAttachLoop(args []string) int {
	uid, _ := strconv.Atoi(args[0])
	trust, _ := strconv.Atoi(args[3])
	n, _ := strconv.Atoi(args[4])
	if err := testenv.BecomeUser(uid); err != nil {
		testproc.Say("result %v", err)
		return 3
	}
	digits := regexp.MustCompile(`[0-9]+`)
	seen := map[string]int{}
	for range n {
		s, err := secondary.Attach(secondary.Config{Prefix: args[1], RuntimeDir: args[2], Logger: quiet,
			AttachTimeout: 2 * time.Second, TrustUIDs: []int{trust}})
		if err == nil {
			s.Close()
			seen["attached"]++
			continue
		}
		seen[digits.ReplaceAllString(err.Error(), "N")]++
	}
	b, _ := json.Marshal(seen)
	testproc.Say("result %s", b)
	return 0
}

// trustedInstance starts a primary of victimUID that lets allowUID in, on
// an instance shared between users (see twoUserInstance), and returns the
// instance's prefix, the shared directory, the home of homeUID (if not
// -1) and the runtime directory. The primary ends with the test.
func trustedInstance(t *testing.T, allowUID, homeUID int) (prefix, shared, home, rundir string) {
	t.Helper()
	prefix, shared, home = twoUserInstance(t, victimUID, homeUID)
	p, res := userProc(t, "user-primary", nil, strconv.Itoa(victimUID), prefix, shared,
		strconv.Itoa(allowUID), "open")
	require.Equal(t, "<nil>", res)
	t.Cleanup(p.CloseInput)
	return prefix, shared, home, filepath.Join(shared, prefix)
}

// tmpfsDir makes a directory of uid with mode in /dev/shm, where a
// primary's segment may be, removed when the test ends.
func tmpfsDir(t *testing.T, uid int, mode os.FileMode) string {
	t.Helper()
	dir := filepath.Join(hugetlb.DefaultTmpfsDir, testenv.Name(t))
	require.NoError(t, os.Mkdir(dir, mode))
	t.Cleanup(func() { os.RemoveAll(dir) })
	require.NoError(t, os.Chmod(dir, mode))
	require.NoError(t, os.Chown(dir, uid, uid))
	return dir
}

// describeSegment rewrites the description of the instance in rundir so
// that it names path as the segment, as the primary's user (uid) may.
func describeSegment(t *testing.T, rundir string, uid int, path string) {
	t.Helper()
	file := filepath.Join(rundir, instance.InfoFile)
	raw, err := os.ReadFile(file)
	require.NoError(t, err)
	var info instance.Info
	require.NoError(t, json.Unmarshal(raw, &info))
	info.Segment = path
	b, err := json.Marshal(info)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(file+".new", b, 0o644))
	require.NoError(t, os.Chown(file+".new", uid, uid))
	require.NoError(t, os.Rename(file+".new", file))
}

// segmentImage returns the bytes of the segment of the instance in rundir.
func segmentImage(t *testing.T, rundir string) []byte {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join(rundir, instance.InfoFile))
	require.NoError(t, err)
	var info instance.Info
	require.NoError(t, json.Unmarshal(raw, &info))
	b, err := os.ReadFile(info.Segment)
	require.NoError(t, err)
	return b
}

// watchOpens returns a function that reports whether file was opened
// since.
func watchOpens(t *testing.T, file string) func() bool {
	t.Helper()
	fd, err := unix.InotifyInit1(unix.IN_NONBLOCK | unix.IN_CLOEXEC)
	require.NoError(t, err)
	t.Cleanup(func() { unix.Close(fd) })
	_, err = unix.InotifyAddWatch(fd, file, unix.IN_OPEN)
	require.NoError(t, err)
	return func() bool {
		buf := make([]byte, 64<<10)
		opened := false
		for {
			n, err := unix.Read(fd, buf)
			if n <= 0 || err != nil {
				return opened
			}
			for off := 0; off+unix.SizeofInotifyEvent <= n; {
				ev := (*unix.InotifyEvent)(unsafe.Pointer(&buf[off]))
				opened = opened || ev.Mask&unix.IN_OPEN != 0
				off += unix.SizeofInotifyEvent + int(ev.Len)
			}
		}
	}
}

// The primary's user names a path in a directory of its own, where it
// swaps a regular file of its own with a link to a private file of the
// secondary's user, over and over: between a look at the path and its
// open, the secondary would open its own file read-write, map it, and
// claim a slot in it if it holds a segment.
func TestASecondaryOpensNoLinkSwappedInForTheSegment(t *testing.T) {
	requireRoot(t)
	prefix, shared, home, rundir := trustedInstance(t, squatterUID, squatterUID)

	image := segmentImage(t, rundir)
	secret := filepath.Join(home, "private-segment")
	require.NoError(t, os.WriteFile(secret, image, 0o600))
	require.NoError(t, os.Chown(secret, squatterUID, squatterUID))

	evil := tmpfsDir(t, victimUID, 0o755)
	require.NoError(t, os.WriteFile(filepath.Join(evil, "seg"), make([]byte, 8192), 0o644))
	require.NoError(t, os.Chown(filepath.Join(evil, "seg"), victimUID, victimUID))
	require.NoError(t, os.Symlink(secret, filepath.Join(evil, "alt")))
	require.NoError(t, os.Lchown(filepath.Join(evil, "alt"), victimUID, victimUID))
	describeSegment(t, rundir, victimUID, filepath.Join(evil, "seg"))
	opened := watchOpens(t, secret)

	dir, err := unix.Open(evil, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	require.NoError(t, err)
	defer unix.Close(dir)
	var stop atomic.Bool
	swapped := make(chan struct{})
	go func() {
		defer close(swapped)
		for !stop.Load() {
			_ = unix.Renameat2(dir, "seg", dir, "alt", unix.RENAME_EXCHANGE)
		}
	}()
	h, res := userProc(t, "attach-loop", nil, strconv.Itoa(squatterUID), prefix, shared,
		strconv.Itoa(victimUID), "300")
	stop.Store(true)
	<-swapped
	require.NoError(t, h.Wait(0))
	t.Logf("the secondary's attaches: %s", res)

	assert.False(t, opened(), "uid %d's secondary opened its own private file %s by the path uid %d names",
		squatterUID, secret, victimUID)
	after, err := os.ReadFile(secret)
	require.NoError(t, err)
	assert.True(t, bytes.Equal(after, image), "uid %d's secondary wrote its own private file %s", squatterUID, secret)
	var seen map[string]int
	require.NoError(t, json.Unmarshal([]byte(res), &seen))
	assert.Zero(t, seen["attached"], "attached to a file swapped in for the segment")
}

// A secondary running as root, trusting the primary's user: a root file
// that holds a segment (another instance's, say) is no file of that user,
// and must not be opened, let alone have a slot claimed in it.
func TestARootSecondaryOpensNoRootFileForTheSegment(t *testing.T) {
	requireRoot(t)
	prefix, shared, _, rundir := trustedInstance(t, 0, -1)

	image := segmentImage(t, rundir)
	secret := filepath.Join(tmpfsDir(t, 0, 0o700), "segment")
	require.NoError(t, os.WriteFile(secret, image, 0o600))
	describeSegment(t, rundir, victimUID, secret)
	opened := watchOpens(t, secret)

	s, res := userProc(t, "user-secondary", nil, "0", prefix, shared, strconv.Itoa(victimUID))
	s.CloseInput()
	require.NoError(t, s.Wait(0))
	assert.False(t, opened(), "the root secondary opened root's %s, named by uid %d", secret, victimUID)
	after, err := os.ReadFile(secret)
	require.NoError(t, err)
	assert.True(t, bytes.Equal(after, image), "the root secondary wrote root's %s", secret)
	assert.Contains(t, res, primary.ErrPermission.Error())
}

// The primary's user names a path through a file system that does not
// answer (a FUSE mount, which any user may make with fusermount): the
// secondary's attach must end, refused, not wait for ever in a lookup.
func TestASecondaryDoesNotHangOnASegmentPathThatDoesNotAnswer(t *testing.T) {
	requireRoot(t)
	prefix, shared, _, rundir := trustedInstance(t, squatterUID, -1)

	mnt := filepath.Join(shared, "mnt")
	require.NoError(t, os.Mkdir(mnt, 0o755))
	require.NoError(t, os.Chown(mnt, victimUID, victimUID))
	fuse := fusetest.MountAt(t, mnt, "seg-fuse")
	fuse.Stop() // from now on nothing on the mount answers
	describeSegment(t, rundir, victimUID, filepath.Join(mnt, "seg"))

	h := testproc.Start(t, "user-secondary", []string{strconv.Itoa(squatterUID), prefix, shared, strconv.Itoa(victimUID)})
	line, err := h.Next("result ", 0)
	if err != nil {
		fuse.Kill() // the mount's requests fail; the attach ends
	}
	require.NoError(t, err, "the secondary's attach waits for a file system that does not answer")
	assert.Contains(t, line, primary.ErrPermission.Error())
	assert.True(t, strings.Contains(line, "might not answer"), "%s", line)
	h.CloseInput()
	require.NoError(t, h.Wait(0))
}

// The primary's user names a regular file of its own as the segment and
// holds a lease on it: an open for writing would wait for the lease to
// be broken (lease-break-time, 45 s by default), whatever the attach's
// time. The attach must end, refused, instead.
func TestASecondaryDoesNotWaitOnALeasedSegment(t *testing.T) {
	requireRoot(t)
	prefix, shared, _, rundir := trustedInstance(t, squatterUID, -1)

	seg := filepath.Join(tmpfsDir(t, victimUID, 0o755), "seg")
	require.NoError(t, os.WriteFile(seg, segmentImage(t, rundir), 0o666))
	require.NoError(t, os.Chmod(seg, 0o666))
	require.NoError(t, os.Chown(seg, victimUID, victimUID))
	l := testproc.Start(t, "lease-as", []string{strconv.Itoa(victimUID), seg})
	require.Equal(t, "leased <nil>", l.Expect("leased ", 0))
	defer l.CloseInput()
	describeSegment(t, rundir, victimUID, seg)

	h := testproc.Start(t, "user-secondary", []string{strconv.Itoa(squatterUID), prefix, shared, strconv.Itoa(victimUID)})
	line, err := h.Next("result ", 0)
	require.NoError(t, err, "the attach waits for a lease on the segment to be broken")
	assert.Contains(t, line, primary.ErrPermission.Error())
	assert.Contains(t, line, "lease")
	h.CloseInput()
	require.NoError(t, h.Wait(0))
}

// The primary's user names, as the segment, a file of its own that holds
// a segment but lies on neither tmpfs nor hugetlbfs (here the test's
// temporary directory; under /proc a file's open can wait on another
// process's exec for ever). The secondary must refuse it unopened.
func TestASecondaryOpensNoSegmentOffTmpfsAndHugetlbfs(t *testing.T) {
	requireRoot(t)
	prefix, shared, _, rundir := trustedInstance(t, squatterUID, -1)
	var st unix.Statfs_t
	require.NoError(t, unix.Statfs(shared, &st))
	if st.Type == unix.TMPFS_MAGIC || st.Type == unix.HUGETLBFS_MAGIC {
		t.Skipf("the temporary directory %s is on tmpfs or hugetlbfs here", shared)
	}
	dir := filepath.Join(shared, "elsewhere")
	require.NoError(t, os.Mkdir(dir, 0o755))
	require.NoError(t, os.Chown(dir, victimUID, victimUID))
	seg := filepath.Join(dir, "seg")
	image := segmentImage(t, rundir)
	require.NoError(t, os.WriteFile(seg, image, 0o666))
	require.NoError(t, os.Chmod(seg, 0o666))
	require.NoError(t, os.Chown(seg, victimUID, victimUID))
	describeSegment(t, rundir, victimUID, seg)
	opened := watchOpens(t, seg)

	s, res := userProc(t, "user-secondary", nil, strconv.Itoa(squatterUID), prefix, shared, strconv.Itoa(victimUID))
	s.CloseInput()
	require.NoError(t, s.Wait(0))
	assert.False(t, opened(), "the secondary opened %s, on neither tmpfs nor hugetlbfs", seg)
	after, err := os.ReadFile(seg)
	require.NoError(t, err)
	assert.True(t, bytes.Equal(after, image), "the secondary wrote %s", seg)
	assert.Contains(t, res, primary.ErrPermission.Error())
	assert.Contains(t, res, "neither tmpfs nor hugetlbfs")
}

// startWithin starts a primary on its own goroutine and reports whether
// Start returned within a bound far past any start (a thread that waits
// on a file system that does not answer waits for ever); if it did not,
// stop lets the file system answer so that the goroutine ends.
func startWithin(t *testing.T, cfg primary.Config, stop func()) (*primary.Primary, error) {
	t.Helper()
	type started struct {
		p   *primary.Primary
		err error
	}
	done := make(chan started, 1)
	go func() {
		p, err := primary.Start(cfg)
		done <- started{p, err}
	}()
	select {
	case s := <-done:
		return s.p, s.err
	case <-time.After(30 * time.Second):
		stop()
		s := <-done
		if s.err == nil {
			s.p.Close()
		}
		require.FailNow(t, "Start waits on a file system that does not answer")
		return nil, nil
	}
}

// A file system that does not answer (FUSE, which any user may mount on
// a directory of theirs in a tmpfs directory, at a name of the instance's)
// where a starting primary would look for a dead predecessor's files: in
// a directory its record names, it is left alone and the primary starts;
// in its own backend directory, Start fails and says why (a directory of
// its own there would not help: a live primary of the instance may have
// its files under that name); the same when the directory is named
// through a link, which the mount table does not show. Start never waits
// on it.
func TestStartDoesNotLookWhereAFileSystemThatMightNotAnswerIsMounted(t *testing.T) {
	requireRoot(t)
	tb := testenv.Tmpfs(t)
	for _, c := range []struct {
		name   string
		own    bool   // the directory is the primary's own backend directory
		onDir  bool   // the directory is itself the mount (else the mount is at a name in it)
		suffix string // the instance's name the mount is at
		below  bool   // the directory named is one below the mount
		linked bool   // the directory is named through a link
	}{
		{name: "recorded directory", onDir: true},
		{name: "below a recorded directory, through a link", onDir: true, below: true, linked: true},
		{name: "recorded directory, through a link", onDir: true, linked: true},
		{name: "memory file in a recorded directory", suffix: "msl7"},
		{name: "segment in a recorded directory", suffix: "ctl"},
		{name: "memory file in a recorded directory, through a link", suffix: "msl7", linked: true},
		{name: "memory file in its own directory", own: true, suffix: "msl7"},
		{name: "memory file in its own directory, through a link", own: true, suffix: "msl7", linked: true},
	} {
		t.Run(c.name, func(t *testing.T) {
			backend := testenv.Hugetlb(t, 8).Kind
			if c.own {
				backend = tb.Kind
			}
			cfg := primary.Config{Prefix: testenv.Prefix(t), RuntimeDir: testenv.RunDir(t), Backend: backend,
				MemoryPages: 16, Logger: quiet}
			name := runtimeName(cfg.Prefix, os.Geteuid(), cfg.RuntimeDir)
			var dir string
			var fuse *testproc.Proc
			if c.onDir {
				dir, fuse = fusetest.Mount(t, "seg-fuse")
			} else {
				dir = tb.Dir
				if c.linked || c.own {
					// A directory of its own in the tmpfs one, which the
					// primary may have been given.
					own := filepath.Join(tb.Dir, "backend-"+cfg.Prefix)
					require.NoError(t, os.Mkdir(own, 0o755))
					t.Cleanup(func() { os.RemoveAll(own) })
					dir = own
				}
				mnt := filepath.Join(dir, "mpmr."+name+"."+c.suffix)
				require.NoError(t, os.Mkdir(mnt, 0o755))
				t.Cleanup(func() { os.Remove(mnt) })
				fuse = fusetest.MountAt(t, mnt, "seg-fuse")
			}
			if c.linked {
				link := filepath.Join(t.TempDir(), "link")
				require.NoError(t, os.Symlink(dir, link))
				dir = link
			}
			if c.below {
				dir = filepath.Join(dir, "below")
			}
			if c.own {
				cfg.BackendDir = dir
			} else {
				rundir := filepath.Join(cfg.RuntimeDir, cfg.Prefix)
				require.NoError(t, os.Mkdir(rundir, 0o700))
				require.NoError(t, os.WriteFile(filepath.Join(rundir, instance.BackendsFile), []byte(dir+"\n"), 0o600))
			}
			fuse.Stop() // from now on nothing on the mount answers
			p, err := startWithin(t, cfg, fuse.Kill)
			if c.own {
				require.ErrorIs(t, err, primary.ErrPermission)
				assert.Contains(t, err.Error(), "might not answer")
				return
			}
			require.NoError(t, err)
			require.NoError(t, p.Close())
		})
	}
}
