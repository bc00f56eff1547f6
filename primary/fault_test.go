package primary_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/cache"
	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/instance"
	"github.com/mpmr/mpmr/internal/sys/mounts"
	"github.com/mpmr/mpmr/internal/sys/ofd"
	"github.com/mpmr/mpmr/internal/sys/sock"
	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/ipc"
	"github.com/mpmr/mpmr/primary"
	"github.com/mpmr/mpmr/secondary"
	"github.com/mpmr/mpmr/shm"
)

func init() {
	testproc.Register("primary", helperPrimary)
}

// helperPrimary runs a primary with 4 pages allocated and prints "ready
// ADDR LEN"; "hold" makes it take the global write lock and print
// "holding" without ever letting go; "fork" makes a child that shares its
// descriptors and waits for ever, and prints "child PID ERRNO".
func helperPrimary(args []string) int {
	p, err := primary.Start(primary.Config{Prefix: args[0], RuntimeDir: args[1], Backend: backendOf(args[2]),
		MemoryPages: 16, Logger: quiet})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 3
	}
	r, err := p.Alloc(4 * p.Backend().PageSize)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 3
	}
	testproc.Say("ready %d %d", r.Addr, r.Len)
	in := testproc.Commands()
	for in.Scan() {
		switch in.Text() {
		case "hold":
			p.Global().Exclusive(func() {
				testproc.Say("holding")
				select {}
			})
		case "fork": // a raw fork, as a C library might make: every descriptor shared
			pid, _, errno := syscall.RawSyscall(syscall.SYS_FORK, 0, 0, 0)
			if pid == 0 && errno == 0 {
				for {
					syscall.RawSyscall(syscall.SYS_PAUSE, 0, 0, 0)
				}
			}
			testproc.Say("child %d %d", pid, errno)
		}
	}
	p.Close()
	return 0
}

// recordedConfig returns the configuration of a primary on backend b
// whose runtime directory, made here, records content as the backend
// directories where a primary of the instance may have made files, and
// the record's path.
func recordedConfig(t *testing.T, b hugetlb.Backend, content string) (primary.Config, string) {
	t.Helper()
	cfg := primary.Config{Prefix: testenv.Prefix(t), RuntimeDir: testenv.RunDir(t), Backend: b.Kind,
		MemoryPages: 16, Logger: quiet}
	dir := filepath.Join(cfg.RuntimeDir, cfg.Prefix)
	require.NoError(t, os.Mkdir(dir, 0o700))
	record := filepath.Join(dir, instance.BackendsFile)
	require.NoError(t, os.WriteFile(record, []byte(content), 0o600))
	return cfg, record
}

// killedPrimary runs a primary in a helper process and kills it: its
// files stay behind, as a crash's.
func killedPrimary(t *testing.T, cfg primary.Config) {
	t.Helper()
	h, _, _ := startPrimaryProcess(t, cfg)
	h.Kill()
	_ = h.Wait(0)
}

// startAfterKill starts a primary where one was just killed, whose
// listening socket may linger an instant after SIGKILL.
func startAfterKill(cfg primary.Config) (*primary.Primary, error) {
	for range 100 {
		p, err := primary.Start(cfg)
		if !errors.Is(err, ipc.ErrAddressInUse) {
			return p, err
		}
		time.Sleep(10 * time.Millisecond) // the kernel's, not a synchronisation
	}
	return primary.Start(cfg)
}

// startPrimaryProcess runs a primary in a helper process. A test that kills
// it leaves its files behind, as a crash would; they are removed at the end
// (by a new primary when the test starts one, else here).
func startPrimaryProcess(t *testing.T, cfg primary.Config) (*testproc.Proc, uintptr, uint64) {
	t.Helper()
	t.Cleanup(func() { removeInstanceFiles(t, cfg.Prefix) })
	h := testproc.Start(t, "primary", []string{cfg.Prefix, cfg.RuntimeDir, cfg.Backend.String()})
	var addr uintptr
	var length uint64
	_, err := fmt.Sscanf(h.Expect("ready", 0), "ready %d %d", &addr, &length)
	require.NoError(t, err)
	return h, addr, length
}

func attachHere(t *testing.T, cfg primary.Config, tweak ...func(*secondary.Config)) *secondary.Secondary {
	t.Helper()
	scfg := secondary.Config{Prefix: cfg.Prefix, RuntimeDir: cfg.RuntimeDir, Logger: quiet}
	for _, f := range tweak {
		f(&scfg)
	}
	s, err := secondary.Attach(scfg)
	require.NoError(t, err)
	t.Cleanup(func() { s.Close() })
	return s
}

func TestPrimaryDeathIsSeenFast(t *testing.T) {
	cfg := primary.Config{Prefix: testenv.Prefix(t), RuntimeDir: testenv.RunDir(t), Backend: testenv.Tmpfs(t).Kind}
	h, addr, length := startPrimaryProcess(t, cfg)
	// A request's own timeout, far off: a request that fails by it
	// cannot pass for one that failed at once.
	s := attachHere(t, cfg, func(c *secondary.Config) { c.RequestTimeout = 30 * time.Second })
	q := s.NewQueue()
	key, err := q.Lookup(addr)
	require.NoError(t, err)

	h.Kill()
	died := time.Now()
	select {
	case <-s.PrimaryGone():
		t.Logf("primary's death noticed after %v", time.Since(died))
	case <-time.After(5 * time.Second):
		t.Fatal("the primary's death went unnoticed")
	}
	_ = h.Wait(0)

	start := time.Now()
	_, err = q.Lookup(addr + uintptr(length) + 1) // outside the MR: must ask the primary
	assert.ErrorIs(t, err, secondary.ErrPrimaryGone)
	assert.Less(t, time.Since(start), 10*time.Second, "no timeout involved")
	start = time.Now()
	_, err = s.CreateMR(uint64(addr) + 4096)
	assert.ErrorIs(t, err, secondary.ErrPrimaryGone)
	assert.Less(t, time.Since(start), 10*time.Second, "no timeout involved")

	k, err := q.Lookup(addr + 64)
	require.NoError(t, err, "keys already cached keep resolving")
	assert.Equal(t, key, k)
	e, found, err := s.Global().Lookup(uint64(addr))
	require.NoError(t, err, "the global table was left consistent")
	assert.True(t, found)
	assert.Equal(t, key, e.LKey)
}

// The primary forked a child (a raw fork: it shares the listening
// socket, every connection and call lane, and the slot's lock) and then
// died: no socket ends and the slot's lock stays held, yet its death must
// be seen all the same.
func TestPrimaryDeathIsSeenWhileItsChildHoldsItsSockets(t *testing.T) {
	cfg := primary.Config{Prefix: testenv.Prefix(t), RuntimeDir: testenv.RunDir(t), Backend: testenv.Tmpfs(t).Kind}
	h, addr, length := startPrimaryProcess(t, cfg)
	s := attachHere(t, cfg)
	h.Send("fork")
	var child int
	var errno int
	_, err := fmt.Sscanf(h.Expect("child ", 0), "child %d %d", &child, &errno)
	require.NoError(t, err)
	require.Zero(t, errno)
	killAtEnd(t, child)

	h.Kill() // its standard output stays open in the child: not waited for
	select {
	case <-s.PrimaryGone():
	case <-time.After(testproc.DefaultTimeout):
		t.Fatal("the primary's death went unnoticed while its child holds its sockets")
	}
	_, err = s.NewQueue().Lookup(addr + uintptr(length) + 1)
	assert.ErrorIs(t, err, secondary.ErrPrimaryGone)
}

func TestPrimaryDiedMidUpdate(t *testing.T) {
	cfg := primary.Config{Prefix: testenv.Prefix(t), RuntimeDir: testenv.RunDir(t), Backend: testenv.Tmpfs(t).Kind}
	h, addr, _ := startPrimaryProcess(t, cfg)
	s := attachHere(t, cfg)
	h.Send("hold")
	h.Expect("holding", 0)
	h.Kill()
	_ = h.Wait(0)

	start := time.Now()
	_, _, err := s.Global().Lookup(uint64(addr))
	require.Error(t, err, "a half-written table is not read")
	assert.Less(t, time.Since(start), time.Second, "and the lookup does not hang")
	q := s.NewQueue()
	_, err = q.Lookup(addr)
	assert.ErrorIs(t, err, secondary.ErrPrimaryGone)
	err = q.RegisterMempool(chunkPool{cache.Chunk{Addr: addr, Len: 4096}})
	assert.ErrorIs(t, err, secondary.ErrPrimaryGone, "warming a queue up reports it the same way")
}

// chunkPool is a mempool of given chunks.
type chunkPool []cache.Chunk

func (chunkPool) Name() string            { return "chunks" }
func (c chunkPool) Chunks() []cache.Chunk { return c }

func TestRestartOverDeadInstance(t *testing.T) {
	for _, b := range []string{"tmpfs", "hugetlbfs"} {
		t.Run(b, func(t *testing.T) {
			bk := testenv.Tmpfs(t)
			if b == "hugetlbfs" {
				bk = testenv.Hugetlb(t, 8)
			}
			cfg := primary.Config{Prefix: testenv.Prefix(t), RuntimeDir: testenv.RunDir(t), Backend: bk.Kind,
				MemoryPages: 16, Logger: quiet}
			before := freeHugepages(t)
			h, _, _ := startPrimaryProcess(t, cfg)
			h.Kill()
			_ = h.Wait(0)
			// As a secondary of the dead instance holds it: the segment
			// must read as dead once the new primary has started.
			old, err := os.Open(instance.SegmentPath(bk.Dir,
				instance.Name(cfg.Prefix, os.Geteuid(), filepath.Join(cfg.RuntimeDir, cfg.Prefix))))
			require.NoError(t, err)

			// The dead primary's files and hugepages are still there; a
			// new primary cleans them up and starts.
			p, err := startAfterKill(cfg)
			require.NoError(t, err)
			defer p.Close()
			_, err = shm.ProbeFile(old, instance.LayoutTag)
			assert.ErrorIs(t, err, shm.ErrDead, "the dead instance's segment is marked dead")
			require.NoError(t, old.Close())
			r, err := p.Alloc(p.Backend().PageSize)
			require.NoError(t, err)
			sec := startSecondary(t, cfg)
			k := parseKey(t, ask(t, sec, "lookup %d", r.Addr))
			assert.Equal(t, "ok", ask(t, sec, "validate %d %d", r.Addr, k))
			require.NoError(t, p.Free(r))
			assert.Equal(t, "closed", ask(t, sec, "close"))
			require.NoError(t, p.Close())
			if b == "hugetlbfs" {
				assert.Equal(t, before, freeHugepages(t), "the dead instance's hugepages came back")
			}
		})
	}
}

// A primary on hugetlbfs killed before it described itself (its
// description removed here, as if it died between making its files and
// writing it), then a primary of the same instance on tmpfs: the new one
// finds the dead one's files in the backend directory it does not use,
// and returns their hugepages. Nothing else would: once it closes, its
// runtime directory goes, and with it what a tool could find them by.
func TestRestartOnAnotherBackendCleansUpAfterAnUndescribedDeadPrimary(t *testing.T) {
	hb, tb := testenv.Hugetlb(t, 8), testenv.Tmpfs(t)
	cfg := primary.Config{Prefix: testenv.Prefix(t), RuntimeDir: testenv.RunDir(t), Backend: hb.Kind,
		MemoryPages: 16, Logger: quiet}
	name := instance.Name(cfg.Prefix, os.Geteuid(), filepath.Join(cfg.RuntimeDir, cfg.Prefix))
	before := freeHugepages(t)
	killedPrimary(t, cfg)
	require.NoError(t, os.Remove(filepath.Join(cfg.RuntimeDir, cfg.Prefix, instance.InfoFile)))
	require.NotEmpty(t, instance.Files(hb.Dir, name), "the dead primary left its files")
	require.Less(t, freeHugepages(t), before, "and holds hugepages")

	cfg.Backend = tb.Kind
	p, err := startAfterKill(cfg)
	require.NoError(t, err)
	defer p.Close()
	assert.Equal(t, tb.Dir, p.Backend().Dir)
	assert.Empty(t, instance.Files(hb.Dir, name), "the dead primary's files on hugetlbfs are gone")
	assert.Equal(t, before, freeHugepages(t), "and its hugepages came back")
	require.NoError(t, p.Close())
}

// Where a primary makes its files is recorded in its runtime directory
// before it makes any (the first is its life file): one killed at any
// point leaves the next primary, whichever backend it chooses, the
// directory to clean up. The record names only its own directory once it
// has started, and goes when it closes.
func TestTheBackendDirectoryIsRecordedBeforeAnyFileIsMadeThere(t *testing.T) {
	b := testenv.Tmpfs(t)
	cfg := primary.Config{Prefix: testenv.Prefix(t), RuntimeDir: testenv.RunDir(t), Backend: b.Kind,
		MemoryPages: 16, Logger: quiet}
	record := filepath.Join(cfg.RuntimeDir, cfg.Prefix, instance.BackendsFile)
	recorded := func() []string {
		data, err := os.ReadFile(record)
		if errors.Is(err, os.ErrNotExist) {
			return nil
		}
		require.NoError(t, err)
		return strings.Fields(string(data))
	}
	var taken []string
	defer primary.SetLifeTaken(func(dir string) {
		taken = append(taken, dir)
		assert.Contains(t, recorded(), dir, "recorded before the life file of %s was made", dir)
	})()
	p, err := primary.Start(cfg)
	require.NoError(t, err)
	assert.Equal(t, []string{b.Dir}, taken)
	assert.Equal(t, []string{b.Dir}, recorded())
	require.NoError(t, p.Close())
	assert.NoFileExists(t, record)
}

// A record of backend directories that repeats one (with and without a
// trailing slash), as a primary killed again and again between its writes
// could leave: the next records each directory once.
func TestTheBackendsRecordNamesEachDirectoryOnce(t *testing.T) {
	b := testenv.Tmpfs(t)
	cfg, record := recordedConfig(t, b, b.Dir+"\n"+b.Dir+"/\n"+b.Dir+"\n")
	var recorded [][]string
	defer primary.SetLifeTaken(func(string) {
		data, err := os.ReadFile(record)
		require.NoError(t, err)
		recorded = append(recorded, strings.Fields(string(data)))
	})()
	p, err := primary.Start(cfg)
	require.NoError(t, err)
	require.NoError(t, p.Close())
	assert.Equal(t, [][]string{{b.Dir}}, recorded)
}

// The backend directory given with another spelling than the one it was
// recorded and described with (a trailing slash, a link to it) is one
// directory: a primary does not meet its own life file there as a live
// primary's.
func TestABackendDirectorySpelledOtherwiseIsOneDirectory(t *testing.T) {
	b := testenv.Tmpfs(t)
	link := filepath.Join(t.TempDir(), "shm")
	require.NoError(t, os.Symlink(b.Dir, link))
	cfg := primary.Config{Prefix: testenv.Prefix(t), RuntimeDir: testenv.RunDir(t), Backend: b.Kind,
		MemoryPages: 16, Logger: quiet}
	name := runtimeName(cfg.Prefix, os.Geteuid(), cfg.RuntimeDir)
	for _, c := range []struct{ name, dir string }{{"trailing slash", b.Dir + "/"}, {"link", link}} {
		t.Run(c.name, func(t *testing.T) {
			// A primary on the directory as the backend names it, killed:
			// its description and record name it so.
			killedPrimary(t, cfg)
			cfg := cfg
			cfg.BackendDir = c.dir
			p, err := startAfterKill(cfg)
			require.NoError(t, err, "backend directory %s", c.dir)
			require.NoError(t, p.Close())
			assert.Empty(t, instance.Files(b.Dir, name), "backend directory %s: nothing is left", c.dir)
		})
	}
}

// A dead primary's runtime directory moved (mv) before the next primary
// starts there: the dead one's files are named for where the directory
// was; the new primary finds them by the description it left, removes
// them and returns their hugepages.
func TestAPrimaryInAMovedRuntimeDirectoryCleansUpAfterTheOneThatRanThere(t *testing.T) {
	testenv.ForEachBackend(t, 8, func(t *testing.T, bk hugetlb.Backend) {
		cfg := primary.Config{Prefix: testenv.Prefix(t), RuntimeDir: testenv.RunDir(t), Backend: bk.Kind,
			MemoryPages: 16, Logger: quiet}
		old := runtimeName(cfg.Prefix, os.Geteuid(), cfg.RuntimeDir)
		before := freeHugepages(t)
		killedPrimary(t, cfg)
		require.NotEmpty(t, instance.Files(bk.Dir, old), "the dead primary left its files")

		moved := cfg.RuntimeDir + "-moved"
		require.NoError(t, os.Rename(cfg.RuntimeDir, moved))
		t.Cleanup(func() { os.RemoveAll(moved) })
		cfg.RuntimeDir = moved
		require.NotEqual(t, old, runtimeName(cfg.Prefix, os.Geteuid(), moved))
		p, err := primary.Start(cfg)
		require.NoError(t, err)
		assert.Empty(t, instance.Files(bk.Dir, old), "the files named for where the directory was are gone")
		require.NoError(t, p.Close())
		if bk.Kind == hugetlb.Hugetlbfs {
			assert.Equal(t, before, freeHugepages(t), "and their hugepages came back")
		}
	})
}

// The description of a live primary copied into another runtime
// directory of the prefix: the primary started there leaves the live
// one's files alone, which goes on serving.
func TestAPrimaryInACopiedRuntimeDirectoryLeavesTheOriginalAlone(t *testing.T) {
	b := testenv.Tmpfs(t)
	live, cfg := startPrimary(t, b)
	name := runtimeName(cfg.Prefix, os.Geteuid(), cfg.RuntimeDir)
	files := instance.Files(b.Dir, name)
	require.NotEmpty(t, files)
	data, err := os.ReadFile(filepath.Join(cfg.RuntimeDir, cfg.Prefix, instance.InfoFile))
	require.NoError(t, err)
	copied := cfg
	copied.RuntimeDir = testenv.RunDir(t)
	copied.MemoryBase = 0x200_0000_0000 // the live one's range is taken in this process
	require.NoError(t, os.Mkdir(filepath.Join(copied.RuntimeDir, copied.Prefix), 0o700))
	require.NoError(t, os.WriteFile(filepath.Join(copied.RuntimeDir, copied.Prefix, instance.InfoFile), data, 0o600))
	for _, lifeFile := range []bool{true, false} {
		if !lifeFile {
			// Removed by hand (or a primary of a build without one): no
			// life file proves the files a dead primary's.
			life := instance.LifePath(b.Dir, name)
			require.NoError(t, os.Remove(life))
			files = slices.DeleteFunc(files, func(f string) bool { return f == life })
		}
		p, err := primary.Start(copied)
		require.NoError(t, err, "the original with a life file: %v", lifeFile)
		require.NoError(t, p.Close())
		assert.Equal(t, files, instance.Files(b.Dir, name), "the live primary's files are left alone (life file: %v)", lifeFile)
		r, err := live.Alloc(b.PageSize)
		require.NoError(t, err)
		require.NoError(t, live.Free(r))
		require.NoError(t, os.Mkdir(filepath.Join(copied.RuntimeDir, copied.Prefix), 0o700))
		require.NoError(t, os.WriteFile(filepath.Join(copied.RuntimeDir, copied.Prefix, instance.InfoFile), data, 0o600))
	}
}

// A backend directory given relative to the working directory: the
// primary's description and its hello name the segment by an absolute
// path, which a secondary with another working directory opens.
func TestARelativeBackendDirectoryIsDescribedAbsolute(t *testing.T) {
	b := testenv.Tmpfs(t)
	t.Chdir(filepath.Dir(b.Dir))
	cfg := primary.Config{Prefix: testenv.Prefix(t), RuntimeDir: testenv.RunDir(t), Backend: b.Kind,
		BackendDir: filepath.Base(b.Dir), MemoryPages: 16, Logger: quiet}
	p, err := primary.Start(cfg)
	require.NoError(t, err)
	defer p.Close()
	assert.Equal(t, b.Dir, p.Backend().Dir)
	data, err := os.ReadFile(filepath.Join(cfg.RuntimeDir, cfg.Prefix, instance.InfoFile))
	require.NoError(t, err)
	var info instance.Info
	require.NoError(t, json.Unmarshal(data, &info))
	assert.Equal(t, b.Dir, info.BackendDir)
	assert.Equal(t, instance.SegmentPath(b.Dir, runtimeName(cfg.Prefix, os.Geteuid(), cfg.RuntimeDir)), info.Segment)
	t.Chdir("/")
	r, err := p.Alloc(p.Backend().PageSize)
	require.NoError(t, err)
	sec := startSecondary(t, cfg)
	k := parseKey(t, ask(t, sec, "lookup %d", r.Addr))
	assert.Equal(t, "ok", ask(t, sec, "validate %d %d", r.Addr, k))
	assert.Equal(t, "closed", ask(t, sec, "close"))
}

// A runtime directory given relative to the working directory, which the
// process then leaves: the primary still closes cleanly, leaving nothing
// in the runtime or the backend directory.
func TestARelativeRuntimeDirectoryOutlivesAChangeOfDirectory(t *testing.T) {
	b := testenv.Tmpfs(t)
	rundir := testenv.RunDir(t)
	t.Chdir(filepath.Dir(rundir))
	cfg := primary.Config{Prefix: testenv.Prefix(t), RuntimeDir: filepath.Base(rundir), Backend: b.Kind,
		MemoryPages: 16, Logger: quiet}
	p, err := primary.Start(cfg)
	require.NoError(t, err)
	name := runtimeName(cfg.Prefix, os.Geteuid(), rundir)
	require.NotEmpty(t, instance.Files(b.Dir, name))
	t.Chdir("/")
	require.NoError(t, p.Close())
	assert.Empty(t, instance.Files(b.Dir, name), "nothing is left in the backend directory")
	assert.NoDirExists(t, filepath.Join(rundir, cfg.Prefix), "nor in the runtime directory")
}

// A live primary whose life file and primary lock were removed by hand:
// another primary started in its runtime directory takes a new life file,
// but the segment names its creator, who runs. Start fails, and the live
// primary's files are left as they were.
func TestALivePrimaryWithoutItsLifeFileKeepsItsFiles(t *testing.T) {
	b := testenv.Tmpfs(t)
	cfg := primary.Config{Prefix: testenv.Prefix(t), RuntimeDir: testenv.RunDir(t), Backend: b.Kind,
		MemoryPages: 16, Logger: quiet}
	name := runtimeName(cfg.Prefix, os.Geteuid(), cfg.RuntimeDir)
	h, _, _ := startPrimaryProcess(t, cfg)
	require.NoError(t, os.Remove(instance.LifePath(b.Dir, name)))
	require.NoError(t, os.Remove(filepath.Join(cfg.RuntimeDir, cfg.Prefix, instance.PrimaryLockFile)))
	files := instance.Files(b.Dir, name)
	require.NotEmpty(t, files)

	p, err := primary.Start(cfg)
	if err == nil {
		p.Close()
	}
	require.ErrorIs(t, err, primary.ErrPrimaryRunning)
	assert.Contains(t, err.Error(), fmt.Sprintf("pid %d", h.PID()))
	assert.Equal(t, files, instance.Files(b.Dir, name), "the live primary's files are left as they were")
}

// A start that fails in recovery (here, on a live primary's life file in
// a recorded directory) keeps the record of where a dead primary's files
// may be: the next start, once the way is clear, cleans up in every
// directory it names.
func TestAFailedStartKeepsTheRecordOfWhereFilesMayBe(t *testing.T) {
	b := testenv.Tmpfs(t)
	var dirs []string
	for _, d := range []string{"a", "b"} {
		dir := filepath.Join(b.Dir, testenv.Name(t)+"-"+d)
		require.NoError(t, os.Mkdir(dir, 0o755))
		t.Cleanup(func() { os.RemoveAll(dir) })
		dirs = append(dirs, dir)
	}
	cfg, record := recordedConfig(t, b, dirs[0]+"\n"+dirs[1]+"\n")
	name := runtimeName(cfg.Prefix, os.Geteuid(), cfg.RuntimeDir)
	// A live primary's life file (as if its runtime directory had been
	// removed under it), held here.
	live, err := instance.TakeLife(dirs[0], name, os.Geteuid(), nil)
	require.NoError(t, err)
	dead := filepath.Join(dirs[1], hugetlb.FileName(name, 0))
	require.NoError(t, os.WriteFile(dead, nil, 0o600))

	_, err = primary.Start(cfg)
	require.ErrorIs(t, err, primary.ErrPrimaryRunning)
	data, err := os.ReadFile(record)
	require.NoError(t, err, "the record stays")
	assert.Subset(t, strings.Fields(string(data)), dirs)
	assert.FileExists(t, dead)

	require.NoError(t, live.Remove())
	p, err := primary.Start(cfg)
	require.NoError(t, err)
	assert.NoFileExists(t, dead, "the next start cleans up where the record said")
	require.NoError(t, p.Close())
	assert.NoFileExists(t, record)
}

// A start that fails after recovery, with nothing left anywhere but in
// its own directory, which its teardown empties (here, its memory's
// address range is another primary's in this process): it leaves
// nothing, its record of backend directories included.
func TestAStartFailedAfterRecoveryLeavesNothing(t *testing.T) {
	b := testenv.Tmpfs(t)
	startPrimary(t, b)
	cfg := primary.Config{Prefix: testenv.Prefix(t), RuntimeDir: testenv.RunDir(t), Backend: b.Kind,
		MemoryPages: 64, Logger: quiet}
	_, err := primary.Start(cfg)
	require.ErrorIs(t, err, hugetlb.ErrAddressInUse)
	assert.Empty(t, instance.Files(b.Dir, runtimeName(cfg.Prefix, os.Geteuid(), cfg.RuntimeDir)))
	assert.NoDirExists(t, filepath.Join(cfg.RuntimeDir, cfg.Prefix), "the runtime directory, record and all")
}

// A recorded directory the primary does not look into (here, one on a
// file system no primary makes its files on) stays in the record once the
// primary has started, beside its own: what may be left there is not
// forgotten.
func TestTheRecordKeepsTheDirectoriesNotLookedInto(t *testing.T) {
	b := testenv.Tmpfs(t)
	other := t.TempDir()
	tab, err := mounts.Read()
	require.NoError(t, err)
	if fs := tab.At(other).Type; fs == "tmpfs" || fs == "hugetlbfs" {
		t.Skipf("the temporary directory %s is on %s, a file system primaries make their files on", other, fs)
	}
	cfg, record := recordedConfig(t, b, other+"\n")
	p, err := primary.Start(cfg)
	require.NoError(t, err)
	data, err := os.ReadFile(record)
	require.NoError(t, err)
	assert.ElementsMatch(t, []string{b.Dir, other}, strings.Fields(string(data)))
	require.NoError(t, p.Close())
}

func TestSecondaryKilledMidRequest(t *testing.T) {
	p, cfg := startPrimary(t, testenv.Tmpfs(t), func(c *primary.Config) { c.SinglePage = true })
	r, err := p.Alloc(32 * p.Backend().PageSize)
	require.NoError(t, err)
	survivor := startSecondary(t, cfg)
	for trial := range 10 {
		victim := startSecondary(t, cfg)
		victim.Send("hammer 4 100000 %d %d", r.Addr, r.Len)
		// Kill it while its requests are in flight.
		for p.Stats().Counters.Requests < uint64(trial*4+2) {
			runtime.Gosched()
		}
		victim.Kill()
		_ = victim.Wait(0)
		// The primary keeps serving, and memory changes do not wait for
		// the dead secondary.
		k := parseKey(t, ask(t, survivor, "lookup %d", r.Addr+uintptr(trial)))
		assert.Equal(t, "ok", ask(t, survivor, "validate %d %d", r.Addr, k))
		extra, err := p.Alloc(p.Backend().PageSize)
		require.NoError(t, err)
		require.NoError(t, p.Free(extra))
	}
	// Every dead secondary's slot was reclaimed: only the primary and the
	// survivor hold one.
	require.Eventually(t, func() bool {
		live := 0
		for _, proc := range p.Segment().Procs() {
			if proc.Live {
				live++
			}
		}
		return live == 2
	}, 5*time.Second, time.Millisecond)
}

func TestStuckSecondaryIsDropped(t *testing.T) {
	p, cfg := startPrimary(t, testenv.Tmpfs(t), steadySync) // fine must not be dropped too
	stuck := startSecondary(t, cfg)
	fine := startSecondary(t, cfg)
	stuck.Stop()

	start := time.Now()
	r, err := p.Alloc(p.Backend().PageSize)
	require.NoError(t, err, "an allocation completes despite a stuck secondary")
	t.Logf("allocation took %v with a stuck secondary", time.Since(start))
	assert.Equal(t, uint64(1), p.Stats().Counters.SyncDrops)
	k := parseKey(t, ask(t, fine, "lookup %d", r.Addr))
	assert.Equal(t, "ok", ask(t, fine, "validate %d %d", r.Addr, k))

	require.NoError(t, syscall.Kill(stuck.PID(), syscall.SIGCONT))
	assert.Contains(t, ask(t, stuck, "create %d", r.Addr+100), "dropped this secondary", "a dropped secondary is told")
}

func TestBadClientsDoNotDisturbOthers(t *testing.T) {
	p, cfg := startPrimary(t, testenv.Tmpfs(t))
	r, err := p.Alloc(p.Backend().PageSize)
	require.NoError(t, err)
	good := startSecondary(t, cfg)
	sockPath := p.RuntimeDir() + "/" + ipc.SocketName
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
	defer cancel()

	// A client that asks for MRs without attaching is refused.
	c, err := ipc.DialClient(ctx, sockPath, ipc.ClientConfig{Logger: quiet})
	require.NoError(t, err)
	err = c.Call(ctx, ipc.KindCreateMR, &ipc.CreateMR{Addr: uint64(r.Addr)}, &ipc.CreateMRReply{})
	assert.ErrorContains(t, err, "has not attached")
	// A hello from a process that holds no slot is refused.
	err = c.Call(ctx, ipc.KindHello, &ipc.Hello{ABI: ipc.ABI, PID: os.Getpid(), UID: os.Getuid(), Role: "secondary"}, &ipc.HelloReply{})
	assert.ErrorContains(t, err, "holds no slot")
	// So is one from another ABI.
	err = c.Call(ctx, ipc.KindHello, &ipc.Hello{ABI: ipc.ABI + 1, PID: os.Getpid(), UID: os.Getuid(), Role: "secondary"}, &ipc.HelloReply{})
	assert.ErrorContains(t, err, "incompatible")
	c.Close()

	// Raw garbage, an oversized frame and an unknown kind close only the
	// connection that sent them.
	for _, frame := range [][]byte{
		[]byte("\xff\x00garbage"),
		make([]byte, 100<<10),
		mustFrame(t, 7, ipc.Kind(999), &ipc.Detach{}),
	} {
		conn, err := sock.Dial(ctx, sockPath)
		require.NoError(t, err)
		_ = conn.Send(frame, nil)
		_, _, rerr := conn.Recv(make([]byte, 1<<16))
		assert.ErrorIs(t, rerr, io.EOF, "the primary hangs up")
		conn.Close()
	}
	k := parseKey(t, ask(t, good, "lookup %d", r.Addr))
	assert.Equal(t, "ok", ask(t, good, "validate %d %d", r.Addr, k), "the attached secondary is unaffected")
}

func mustFrame(t *testing.T, id uint64, kind ipc.Kind, body any) []byte {
	b, err := ipc.AppendFrame(nil, id, kind, 0, body)
	require.NoError(t, err)
	return b
}

func backendOf(s string) hugetlb.Kind {
	k, _ := hugetlb.ParseKind(s)
	return k
}

func init() {
	testproc.Register("attach-as-nobody", func(args []string) int {
		if err := testenv.BecomeUser(65534); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 3
		}
		_, err := secondary.Attach(secondary.Config{Prefix: args[0], RuntimeDir: args[1], Logger: quiet})
		testproc.Say("attach: %v", err)
		return 0
	})
}

func TestOtherUserIsRefused(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("needs root to run a helper as another user")
	}
	p, cfg := startPrimary(t, testenv.Tmpfs(t))
	r, err := p.Alloc(p.Backend().PageSize)
	require.NoError(t, err)
	good := startSecondary(t, cfg)
	h := testproc.Start(t, "attach-as-nobody", []string{cfg.Prefix, cfg.RuntimeDir})
	line := h.Expect("attach: ", 0)
	assert.NotEqual(t, "attach: <nil>", line, "uid 65534 must not attach to root's instance")
	// Not "no primary is running": one is; this user may not reach it.
	assert.Contains(t, line, "permission problem")
	assert.Contains(t, line, "this process runs as uid 65534")
	require.NoError(t, h.Wait(0))
	k := parseKey(t, ask(t, good, "lookup %d", r.Addr))
	assert.Equal(t, "ok", ask(t, good, "validate %d %d", r.Addr, k))
	assert.Zero(t, p.Stats().Counters.RequestErrors, "nothing reached the primary's handlers")
}

// removeInstanceFiles removes what an instance keeps in the backend
// directories: its segment and memseg files.
func removeInstanceFiles(t *testing.T, prefix string) {
	dirs := []string{hugetlb.DefaultTmpfsDir}
	mounts, _ := hugetlb.Mounts()
	for _, m := range mounts {
		dirs = append(dirs, m.Dir)
	}
	for _, dir := range dirs {
		files, _ := filepath.Glob(filepath.Join(dir, "mpmr."+prefix+".*"))
		for _, f := range files {
			if fi, err := os.Lstat(f); err == nil && fi.IsDir() {
				_ = os.RemoveAll(f) // a primary's directory of its own (see instance.PrivateDirName), or a squatter's
				continue
			}
			if err := os.Remove(f); err != nil {
				t.Logf("leftover %s: %v", f, err)
			}
		}
	}
}

// A dead primary's lock held by someone else (an `mpmr clean` at work, or
// stopped) makes Start fail, but not by naming the dead primary as the
// one running.
func TestStartNamesNoDeadPrimaryAsRunning(t *testing.T) {
	cfg := primary.Config{Prefix: testenv.Prefix(t), RuntimeDir: testenv.RunDir(t), Backend: testenv.Tmpfs(t).Kind,
		MemoryPages: 16, Logger: quiet}
	h, _, _ := startPrimaryProcess(t, cfg)
	dead := h.PID()
	h.Kill()
	_ = h.Wait(0)

	dir, err := instance.Dir(cfg.Prefix, cfg.RuntimeDir)
	require.NoError(t, err)
	f, err := os.OpenFile(filepath.Join(dir, instance.PrimaryLockFile), os.O_RDWR, 0)
	require.NoError(t, err)
	defer f.Close()
	require.NoError(t, ofd.TryLock(f, 0, true), "the lock, as mpmr clean takes it")

	p, err := primary.Start(cfg)
	if err == nil {
		p.Close()
	}
	require.ErrorIs(t, err, primary.ErrPrimaryRunning)
	assert.NotContains(t, err.Error(), fmt.Sprintf("(pid %d)", dead), "the dead primary is not running")
	assert.Contains(t, err.Error(), fmt.Sprintf("pid %d", dead), "it says whose lock it was")
	assert.Contains(t, err.Error(), "exited")

	require.NoError(t, ofd.Unlock(f, 0))
	p, err = primary.Start(cfg)
	require.NoError(t, err, "once the lock is let go, a new primary recovers the instance")
	p.Close()
}
