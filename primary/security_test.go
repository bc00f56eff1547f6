package primary_test

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/instance"
	"github.com/mpmr/mpmr/internal/test/harness"
	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/ipc"
	"github.com/mpmr/mpmr/primary"
	"github.com/mpmr/mpmr/secondary"
)

// Users the tests act as, besides root. No account needs to exist: the
// kernel checks numeric uids.
const (
	victimUID   = 42011
	squatterUID = 42012
)

func init() {
	testproc.Register("user-mkdir", helperUserMkdir)
	testproc.Register("user-primary", helperUserPrimary)
	testproc.Register("user-secondary", helperUserSecondary)
	testproc.Register("listen-as", helperListenAs)
}

func requireRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: to run helpers as other users (setuid)")
	}
}

// userEnv is the environment of a user without XDG_RUNTIME_DIR whose
// temporary directory is tmp: the runtimes' default runtime directory is
// then tmp/mpmr-UID.
func userEnv(tmp string) []string { return []string{"TMPDIR=" + tmp, "XDG_RUNTIME_DIR="} }

// sharedTmp returns a fresh directory like /tmp: root's, mode 1777.
func sharedTmp(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	// The test's own temporary directory is private: let others through.
	require.NoError(t, os.Chmod(filepath.Dir(dir), 0o755))
	require.NoError(t, os.Chmod(dir, os.ModeSticky|0o777))
	return dir
}

// helperUserMkdir becomes uid args[0] and makes directory args[1] with
// mode args[2] (octal, sticky bit included): "result ERR".
func helperUserMkdir(args []string) int {
	uid, _ := strconv.Atoi(args[0])
	mode, _ := strconv.ParseUint(args[2], 8, 32)
	err := testenv.BecomeUser(uid)
	if err == nil {
		err = os.Mkdir(args[1], 0o700)
	}
	if err == nil {
		fm := os.FileMode(mode & 0o777)
		if mode&0o1000 != 0 {
			fm |= os.ModeSticky
		}
		err = os.Chmod(args[1], fm)
	}
	testproc.Say("result %v", err)
	return 0
}

// helperUserPrimary becomes uid args[0] and starts a primary of prefix
// args[1] on tmpfs, with RuntimeDir args[2] ("" for the default) and
// AllowUIDs args[3] (comma-separated, may be empty). With args[4] "open"
// it loosens its directory and socket to everyone, as a primary that
// lets other users in must ("open-handed": all but the backing files,
// which secondaries are handed). It says "result ERR"; if it started, it
// serves until its input ends, answering commands:
//
//	secondaries -> "> secondaries N"
//	read ADDR   -> "> byte B" (of data memory)
//	alloc       -> "> region ADDR" (one page)
func helperUserPrimary(args []string) int {
	uid, _ := strconv.Atoi(args[0])
	if err := testenv.BecomeUser(uid); err != nil {
		testproc.Say("result %v", err)
		return 3
	}
	var allow []int
	for _, f := range strings.Split(args[3], ",") {
		if n, err := strconv.Atoi(f); err == nil {
			allow = append(allow, n)
		}
	}
	p, err := primary.Start(primary.Config{Prefix: args[1], RuntimeDir: args[2], Backend: hugetlb.Tmpfs,
		MemoryPages: 16, AllowUIDs: allow, Logger: quiet})
	if err == nil && strings.HasPrefix(args[4], "open") {
		err = harness.OpenToAll(p)
	}
	if err == nil && args[4] == "open-handed" {
		for _, l := range p.Memory().Lists() {
			if err == nil {
				err = os.Chmod(l.File, 0o600)
			}
		}
	}
	testproc.Say("result %v", err)
	if err != nil {
		return 0
	}
	defer p.Close()
	in := testproc.Commands()
	for in.Scan() {
		f := strings.Fields(in.Text())
		switch {
		case len(f) == 1 && f[0] == "secondaries":
			testproc.Say("> secondaries %d", p.Stats().Counters.Secondaries)
		case len(f) == 1 && f[0] == "alloc":
			r, err := p.Alloc(p.Backend().PageSize)
			if err != nil {
				testproc.Say("> err %v", err)
			} else {
				testproc.Say("> region %d", r.Addr)
			}
		case len(f) == 2 && f[0] == "read":
			a, _ := strconv.ParseUint(f[1], 0, 64)
			testproc.Say("> byte %d", *(*byte)(pointer(uintptr(a))))
		default:
			testproc.Say("> err unknown command %q", in.Text())
		}
	}
	return 0
}

// helperUserSecondary becomes uid args[0] and attaches to prefix args[1]
// with RuntimeDir args[2] ("" for the default) and TrustUIDs args[3]
// (comma-separated; none if absent). It says "result ERR"; attached, it
// answers:
//
//	write ADDR B -> "> wrote" (a byte of data memory)
//	lookup ADDR  -> "> key K" or "> err TEXT"
//	keep-backing -> "> kept N": what a hostile user may do with the
//	                instance's files it holds open (its segment, the
//	                backing files it was handed): keep a description of
//	                each past the library's own close
//	lock-kept    -> "> locked N": and lock byte 0 of each
//	empty-kept   -> "> emptied N": truncate the kept backing files to 0
func helperUserSecondary(args []string) int {
	uid, _ := strconv.Atoi(args[0])
	if err := testenv.BecomeUser(uid); err != nil {
		testproc.Say("result %v", err)
		return 3
	}
	var trust []int
	if len(args) > 3 {
		for _, f := range strings.Split(args[3], ",") {
			if n, err := strconv.Atoi(f); err == nil {
				trust = append(trust, n)
			}
		}
	}
	s, err := secondary.Attach(secondary.Config{Prefix: args[1], RuntimeDir: args[2], Logger: quiet,
		AttachTimeout: 5 * time.Second, TrustUIDs: trust})
	testproc.Say("result %v", err)
	if err != nil {
		return 0
	}
	defer s.Close()
	q := s.NewQueue()
	in := testproc.Commands()
	for in.Scan() {
		f := strings.Fields(in.Text())
		switch {
		case len(f) == 3 && f[0] == "write":
			a, _ := strconv.ParseUint(f[1], 0, 64)
			b, _ := strconv.ParseUint(f[2], 0, 8)
			*(*byte)(pointer(uintptr(a))) = byte(b)
			testproc.Say("> wrote")
		case len(f) == 2 && f[0] == "lookup":
			a, _ := strconv.ParseUint(f[1], 0, 64)
			testproc.SayKey(q.Lookup(uintptr(a)))
		case len(f) == 1 && f[0] == "keep-backing":
			sayCount("kept", keepBacking)
		case len(f) == 1 && f[0] == "empty-kept":
			sayCount("emptied", emptyKept)
		case len(f) == 1 && f[0] == "lock-kept":
			sayCount("locked", lockKept)
		default:
			testproc.Say("> err unknown command %q", in.Text())
		}
	}
	return 0
}

// helperListenAs binds a unix socket at args[0] as root, then becomes uid
// args[1] and only then listens: the kernel records the listener's
// credentials at listen, so connecting processes see uid args[1] even
// though the socket file is root's. It says "ready" and keeps listening
// (accepting nothing) until its input ends.
func helperListenAs(args []string) int {
	uid, _ := strconv.Atoi(args[1])
	fd, err := syscall.Socket(syscall.AF_UNIX, syscall.SOCK_SEQPACKET|syscall.SOCK_CLOEXEC, 0)
	if err == nil {
		err = syscall.Bind(fd, &syscall.SockaddrUnix{Name: args[0]})
	}
	if err == nil {
		err = os.Chmod(args[0], 0o666)
	}
	if err == nil {
		err = testenv.BecomeUser(uid)
	}
	if err == nil {
		err = syscall.Listen(fd, 8)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 3
	}
	testproc.Say("ready")
	in := testproc.Commands()
	for in.Scan() {
	}
	return 0
}

// userProc starts a helper that acts as another user and waits for its
// result line, returned without "result ".
func userProc(t *testing.T, helper string, env []string, args ...string) (*testproc.Proc, string) {
	t.Helper()
	h := testproc.Start(t, helper, args, env...)
	return h, strings.TrimPrefix(h.Expect("result ", 0), "result ")
}

func askProc(t *testing.T, h *testproc.Proc, format string, args ...any) string {
	t.Helper()
	h.Send(format, args...)
	return strings.TrimPrefix(h.Expect("> ", 0), "> ")
}

// A user without XDG_RUNTIME_DIR keeps instances in $TMPDIR/mpmr-UID.
// Another user who pre-creates that directory, open to all, must not get
// the victim's primary to start in it; once it is gone, the victim's
// primary and secondary work there as usual.
func TestPrimaryRefusesASquattedRuntimeDirectory(t *testing.T) {
	requireRoot(t)
	tmp := sharedTmp(t)
	env := userEnv(tmp)
	squat := filepath.Join(tmp, "mpmr-"+strconv.Itoa(victimUID))
	prefix := testenv.Prefix(t)
	t.Cleanup(func() { removeInstanceFiles(t, prefix) })
	_, res := userProc(t, "user-mkdir", nil, strconv.Itoa(squatterUID), squat, "1777")
	require.Equal(t, "<nil>", res)

	h, res := userProc(t, "user-primary", env, strconv.Itoa(victimUID), prefix, "", "", "")
	assert.Contains(t, res, primary.ErrPermission.Error())
	for _, want := range []string{squat + " is owned by another user", "owner uid " + strconv.Itoa(squatterUID),
		"mode 1777", "runs as uid " + strconv.Itoa(victimUID), "remove it"} {
		assert.Contains(t, res, want)
	}
	require.NoError(t, h.Wait(0))
	ents, err := os.ReadDir(squat)
	require.NoError(t, err)
	assert.Empty(t, ents, "nothing was created in the squatted directory")

	// Without the squatter, the victim's own directory is made and used.
	require.NoError(t, os.RemoveAll(squat))
	p, res := userProc(t, "user-primary", env, strconv.Itoa(victimUID), prefix, "", "", "")
	require.Equal(t, "<nil>", res)
	fi, err := os.Stat(filepath.Join(squat, prefix))
	require.NoError(t, err)
	assert.Equal(t, os.FileMode(0o700), fi.Mode().Perm())
	assert.Equal(t, uint32(victimUID), fi.Sys().(*syscall.Stat_t).Uid)
	s, res := userProc(t, "user-secondary", env, strconv.Itoa(victimUID), prefix, "")
	require.Equal(t, "<nil>", res)
	r := askProc(t, p, "alloc")
	var addr uintptr
	_, err = fmt.Sscanf(r, "region %d", &addr)
	require.NoError(t, err, r)
	assert.Equal(t, "wrote", askProc(t, s, "write %d 42", addr))
	assert.Equal(t, "byte 42", askProc(t, p, "read %d", addr))
	assert.Contains(t, askProc(t, s, "lookup %d", addr), "key ")
}

// The squatter goes further: in the directory they pre-created where the
// victim's secondaries look, they run a primary of their own that lets
// the victim in. The victim's secondary must refuse it, map nothing of it
// and write nothing into it.
func TestSecondaryRefusesASquattersPrimary(t *testing.T) {
	requireRoot(t)
	tmp := sharedTmp(t)
	env := userEnv(tmp)
	squat := filepath.Join(tmp, "mpmr-"+strconv.Itoa(victimUID))
	prefix := testenv.Prefix(t)
	t.Cleanup(func() { removeInstanceFiles(t, prefix) })
	_, res := userProc(t, "user-mkdir", nil, strconv.Itoa(squatterUID), squat, "1777")
	require.Equal(t, "<nil>", res)
	trap, res := userProc(t, "user-primary", env, strconv.Itoa(squatterUID), prefix, squat,
		strconv.Itoa(victimUID), "open")
	require.Equal(t, "<nil>", res, "the squatter's primary starts in the squatter's own directory")

	h, res := userProc(t, "user-secondary", env, strconv.Itoa(victimUID), prefix, "")
	assert.Contains(t, res, secondary.ErrPermission.Error())
	for _, want := range []string{squat + " is owned by another user", "owner uid " + strconv.Itoa(squatterUID),
		"mode 1777", "runs as uid " + strconv.Itoa(victimUID), "TrustUIDs"} {
		assert.Contains(t, res, want)
	}
	require.NoError(t, h.Wait(0))
	assert.Equal(t, "secondaries 0", askProc(t, trap, "secondaries"), "the victim never attached")
	r := askProc(t, trap, "alloc")
	var addr uintptr
	_, err := fmt.Sscanf(r, "region %d", &addr)
	require.NoError(t, err, r)
	assert.Equal(t, "byte 0", askProc(t, trap, "read %d", addr), "nothing of the victim's reached the squatter")
}

// With its directory safe, a secondary still asks the kernel who listens
// on the socket: a server of a user it does not trust is refused, however
// right the description file looks.
func TestSecondaryChecksThePrimarysCredentials(t *testing.T) {
	requireRoot(t)
	rundir := testenv.RunDir(t)
	prefix := testenv.Prefix(t)
	dir := filepath.Join(rundir, prefix)
	require.NoError(t, os.Mkdir(dir, 0o755))
	h := testproc.Start(t, "listen-as", []string{filepath.Join(dir, ipc.SocketName), strconv.Itoa(squatterUID)})
	h.Expect("ready", 0)
	seg := filepath.Join(testenv.Tmpfs(t).Dir, testenv.Name(t))
	require.NoError(t, os.WriteFile(seg, make([]byte, 4096), 0o600))
	t.Cleanup(func() { os.Remove(seg) })
	require.NoError(t, instance.WriteInfo(dir, instance.Info{Prefix: prefix, PID: h.PID(), Segment: seg,
		Socket: filepath.Join(dir, ipc.SocketName)}))

	_, err := secondary.Attach(secondary.Config{Prefix: prefix, RuntimeDir: rundir, Logger: quiet})
	require.ErrorIs(t, err, secondary.ErrPermission)
	for _, want := range []string{fmt.Sprintf("runs as uid %d (pid %d)", squatterUID, h.PID()),
		"this process runs as uid 0", "TrustUIDs"} {
		assert.Contains(t, err.Error(), want)
	}

	// Trusted, the same server gets further: to its segment, which must be
	// its user's.
	trust := secondary.Config{Prefix: prefix, RuntimeDir: rundir, Logger: quiet, TrustUIDs: []int{squatterUID}}
	require.NoError(t, os.Chown(seg, victimUID, victimUID))
	_, err = secondary.Attach(trust)
	require.ErrorIs(t, err, secondary.ErrPermission)
	assert.Contains(t, err.Error(), seg+" is not a regular file of the primary's uid "+strconv.Itoa(squatterUID))
	require.NoError(t, os.Chown(seg, squatterUID, squatterUID))
	_, err = secondary.Attach(trust)
	require.Error(t, err, "the segment is no segment")
	assert.NotErrorIs(t, err, secondary.ErrPermission, "every check of ownership passed")
}

// runtimeName is the name instance prefix of uid under rundir carries in
// backend directories.
func runtimeName(prefix string, uid int, rundir string) string {
	return instance.Name(prefix, uid, filepath.Join(rundir, prefix))
}

// startUserPrimary starts a primary of prefix as uid in a helper with
// runtime directory rundir ("" for the user's default under tmp), and
// returns it and the address of a page it allocated.
func startUserPrimary(t *testing.T, uid int, tmp, prefix, rundir string) (*testproc.Proc, uintptr) {
	t.Helper()
	h, res := userProc(t, "user-primary", userEnv(tmp), strconv.Itoa(uid), prefix, rundir, "", "")
	require.Equal(t, "<nil>", res, "primary of uid %d", uid)
	var addr uintptr
	r := askProc(t, h, "alloc")
	_, err := fmt.Sscanf(r, "region %d", &addr)
	require.NoError(t, err, r)
	return h, addr
}

// Instances of one prefix in two runtime directories of one user are two
// instances: neither takes the other's backend files for a dead
// predecessor's, and each one's secondaries map its own memory.
func TestOnePrefixInTwoRuntimeDirectories(t *testing.T) {
	requireRoot(t)
	tmp := sharedTmp(t)
	prefix := testenv.Prefix(t)
	t.Cleanup(func() { removeInstanceFiles(t, prefix) })
	dirA, dirB := testenv.RunDir(t), testenv.RunDir(t)
	a, addrA := startUserPrimary(t, 0, tmp, prefix, dirA)
	segA := instance.SegmentPath(hugetlb.DefaultTmpfsDir, runtimeName(prefix, 0, dirA))
	before, statErr := os.Stat(segA)
	b, addrB := startUserPrimary(t, 0, tmp, prefix, dirB)

	for _, c := range []struct {
		p      *testproc.Proc
		rundir string
		addr   uintptr
		b      byte
	}{{a, dirA, addrA, 0xa}, {b, dirB, addrB, 0xb}} {
		s, res := userProc(t, "user-secondary", nil, "0", prefix, c.rundir)
		require.Equal(t, "<nil>", res, "a secondary of the primary in %s", c.rundir)
		assert.Equal(t, "wrote", askProc(t, s, "write %d %d", c.addr, c.b))
		assert.Contains(t, askProc(t, s, "lookup %d", c.addr), "key ")
		assert.Equal(t, fmt.Sprintf("byte %d", c.b), askProc(t, c.p, "read %d", c.addr), "its own primary sees it")
	}

	require.NoError(t, statErr, "the first primary's segment")
	after, err := os.Stat(segA)
	require.NoError(t, err, "the second primary left the first's segment alone")
	assert.True(t, os.SameFile(before, after))
	assert.NotEqual(t, segA, instance.SegmentPath(hugetlb.DefaultTmpfsDir, runtimeName(prefix, 0, dirB)))
}

// Two users who pick the same prefix (the default one, typically) each get
// an instance.
func TestOnePrefixForTwoUsers(t *testing.T) {
	requireRoot(t)
	tmp := sharedTmp(t)
	prefix := testenv.Prefix(t)
	t.Cleanup(func() { removeInstanceFiles(t, prefix) })
	var procs []*testproc.Proc
	var addrs []uintptr
	for _, uid := range []int{victimUID, squatterUID} {
		p, addr := startUserPrimary(t, uid, tmp, prefix, "")
		procs, addrs = append(procs, p), append(addrs, addr)
	}
	for i, uid := range []int{victimUID, squatterUID} {
		s, res := userProc(t, "user-secondary", userEnv(tmp), strconv.Itoa(uid), prefix, "")
		require.Equal(t, "<nil>", res, "a secondary of uid %d", uid)
		assert.Equal(t, "wrote", askProc(t, s, "write %d %d", addrs[i], i+1))
		assert.Equal(t, fmt.Sprintf("byte %d", i+1), askProc(t, procs[i], "read %d", addrs[i]))
		seg := instance.SegmentPath(hugetlb.DefaultTmpfsDir,
			runtimeName(prefix, uid, filepath.Join(tmp, "mpmr-"+strconv.Itoa(uid))))
		fi, err := os.Stat(seg)
		require.NoError(t, err)
		assert.Equal(t, uint32(uid), fi.Sys().(*syscall.Stat_t).Uid, "uid %d's segment is its own", uid)
	}
}

// A primary whose runtime directory was removed while it ran still owns
// its backend files: a new primary on the recreated directory must not
// take them for a dead predecessor's.
func TestRestartLeavesALivePrimarysFilesAlone(t *testing.T) {
	requireRoot(t)
	tmp := sharedTmp(t)
	prefix := testenv.Prefix(t)
	t.Cleanup(func() { removeInstanceFiles(t, prefix) })
	rundir := testenv.RunDir(t)
	old, addr := startUserPrimary(t, 0, tmp, prefix, rundir)
	name := runtimeName(prefix, 0, rundir)
	seg := instance.SegmentPath(hugetlb.DefaultTmpfsDir, name)
	before, statErr := os.Stat(seg)
	require.NoError(t, os.RemoveAll(filepath.Join(rundir, prefix)), "an operator's rm -rf")

	p, err := primary.Start(primary.Config{Prefix: prefix, RuntimeDir: rundir, Backend: hugetlb.Tmpfs,
		MemoryPages: 16, Logger: quiet})
	if err == nil {
		p.Close()
	}
	require.ErrorIs(t, err, primary.ErrPrimaryRunning)
	assert.Contains(t, err.Error(), seg)
	require.NoError(t, statErr)
	after, err := os.Stat(seg)
	require.NoError(t, err)
	assert.True(t, os.SameFile(before, after), "the live primary's segment is untouched")
	assert.FileExists(t, filepath.Join(hugetlb.DefaultTmpfsDir, hugetlb.FileName(name, 0)))
	assert.Equal(t, "byte 0", askProc(t, old, "read %d", addr), "and it works on")
	assert.Equal(t, "secondaries 0", askProc(t, old, "secondaries"))
}

// A primary that lets another user in, and that user's secondary that
// trusts it, work together; without the trust, the secondary refuses.
func TestTrustedUserAttaches(t *testing.T) {
	requireRoot(t)
	prefix, shared, _ := twoUserInstance(t, victimUID, -1)
	p, res := userProc(t, "user-primary", nil, strconv.Itoa(victimUID), prefix, shared,
		strconv.Itoa(squatterUID), "open")
	require.Equal(t, "<nil>", res)
	r := askProc(t, p, "alloc")
	var addr uintptr
	_, err := fmt.Sscanf(r, "region %d", &addr)
	require.NoError(t, err, r)

	h, res := userProc(t, "user-secondary", nil, strconv.Itoa(squatterUID), prefix, shared)
	assert.Contains(t, res, secondary.ErrPermission.Error(), "not trusted by default")
	assert.Contains(t, res, "owner uid "+strconv.Itoa(victimUID))
	require.NoError(t, h.Wait(0))

	s, res := userProc(t, "user-secondary", nil, strconv.Itoa(squatterUID), prefix, shared, strconv.Itoa(victimUID))
	require.Equal(t, "<nil>", res, "trusted")
	assert.Equal(t, "wrote", askProc(t, s, "write %d 9", addr))
	assert.Contains(t, askProc(t, s, "lookup %d", addr), "key ")
	assert.Equal(t, "byte 9", askProc(t, p, "read %d", addr))
	assert.Equal(t, "secondaries 1", askProc(t, p, "secondaries"))
}

// twoUserInstance prepares an instance named prefix shared between users:
// a directory shared, of primaryUID, that others may enter, and, when
// homeUID is not -1, a private directory home of homeUID beside it. The
// instance's files are removed at cleanup.
func twoUserInstance(t *testing.T, primaryUID, homeUID int) (prefix, shared, home string) {
	t.Helper()
	tmp := sharedTmp(t)
	prefix = testenv.Prefix(t)
	t.Cleanup(func() { removeInstanceFiles(t, prefix) })
	shared = filepath.Join(tmp, "shared")
	_, res := userProc(t, "user-mkdir", nil, strconv.Itoa(primaryUID), shared, "711")
	require.Equal(t, "<nil>", res)
	if homeUID != -1 {
		home = filepath.Join(tmp, "home-of-"+strconv.Itoa(homeUID))
		_, res = userProc(t, "user-mkdir", nil, strconv.Itoa(homeUID), home, "700")
		require.Equal(t, "<nil>", res)
	}
	return prefix, shared, home
}
