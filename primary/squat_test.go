package primary_test

import (
	"bytes"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/instance"
	"github.com/mpmr/mpmr/internal/test/fusetest"
	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/primary"
)

// privateDirs lists the directories of their own that primaries of the
// instance called name made in backend directory dir.
func privateDirs(t *testing.T, dir, name string) []string {
	t.Helper()
	ents, err := os.ReadDir(dir)
	require.NoError(t, err)
	var out []string
	for _, e := range ents {
		if instance.IsPrivateDir(e.Name(), name) {
			out = append(out, filepath.Join(dir, e.Name()))
		}
	}
	return out
}

// ownedBy checks that path is uid's: what another user made is left
// alone, what a primary made is its user's.
func ownedBy(t *testing.T, path string, uid int) {
	t.Helper()
	fi, err := os.Lstat(path)
	require.NoError(t, err)
	assert.Equal(t, uint32(uid), fi.Sys().(*syscall.Stat_t).Uid, "owner of %s", path)
}

// squatLife makes a file of squatterUID at the life file's name of the
// instance called name in dir, removed when the test ends.
func squatLife(t *testing.T, dir, name string) string {
	t.Helper()
	path := instance.LifePath(dir, name)
	require.NoError(t, os.WriteFile(path, nil, 0o600))
	require.NoError(t, os.Chown(path, squatterUID, squatterUID))
	t.Cleanup(func() { os.Remove(path) })
	return path
}

// killedInOwnDir runs a primary of cfg in a helper process beside
// squatLife's file, and kills it: it returns the directory of its own
// where it left its files.
func killedInOwnDir(t *testing.T, cfg primary.Config, dir, name string) string {
	t.Helper()
	killedPrimary(t, cfg)
	dead := privateDirs(t, dir, name)
	require.Len(t, dead, 1)
	require.NotEmpty(t, instance.Files(dead[0], name), "the dead primary left its files")
	return dead[0]
}

// Anyone may make a file in /dev/shm, and the names of an instance's
// files there are predictable: another user's file or directory at one
// of them (which the primary may neither use nor remove) no longer keeps
// the primary from starting. It starts with its files in a directory of
// its own made there, under a name nobody can foresee, which secondaries
// reach through its description, and which goes when it closes.
func TestANameTakenByAnotherUserMovesTheFilesToADirectoryOfTheirOwn(t *testing.T) {
	requireRoot(t)
	testenv.ForEachBackend(t, 8, func(t *testing.T, b hugetlb.Backend) {
		for _, which := range []string{"segment", "memseg list", "life file"} {
			for _, kind := range []string{"private", "dir"} {
				t.Run(which+"/"+kind, func(t *testing.T) { nameTaken(t, b, which, kind) })
			}
		}
	})
}

func nameTaken(t *testing.T, b hugetlb.Backend, which, kind string) {
	cfg := primary.Config{Prefix: testenv.Prefix(t), RuntimeDir: testenv.RunDir(t), Backend: b.Kind,
		MemoryPages: 16, Logger: quiet}
	t.Cleanup(func() { removeInstanceFiles(t, cfg.Prefix) })
	name := runtimeName(cfg.Prefix, os.Geteuid(), cfg.RuntimeDir)
	path := b3secBackendPath(b.Dir, name, which)
	b3secSquat(t, path, kind)

	p, err := primary.Start(cfg)
	require.NoError(t, err, "uid %d's %s at %s", squatterUID, kind, path)
	defer p.Close()
	dir := p.Backend().Dir
	assert.Equal(t, b.Dir, filepath.Dir(dir), "a directory made in the backend directory")
	assert.Equal(t, []string{dir}, privateDirs(t, b.Dir, name))
	fi, err := os.Lstat(dir)
	require.NoError(t, err)
	assert.True(t, fi.IsDir())
	assert.Equal(t, os.FileMode(0o755), fi.Mode().Perm(), "secondaries of other users pass through it")
	assert.Equal(t, uint32(os.Geteuid()), fi.Sys().(*syscall.Stat_t).Uid)
	assert.FileExists(t, instance.SegmentPath(dir, name))
	ownedBy(t, path, squatterUID)

	r, err := p.Alloc(p.Backend().PageSize)
	require.NoError(t, err)
	sec := startSecondary(t, cfg)
	k := parseKey(t, ask(t, sec, "lookup %d", r.Addr))
	assert.Equal(t, "ok", ask(t, sec, "validate %d %d", r.Addr, k))
	assert.Equal(t, "closed", ask(t, sec, "close"))
	require.NoError(t, p.Close())
	assert.NoDirExists(t, dir, "it goes with the instance")
	ownedBy(t, path, squatterUID)
}

// The same for a primary that does not run as root, whose runtime
// directory's name anyone can tell from its uid: a file of mode 0600 of
// another user at its segment's, memseg list's or life file's name in
// /dev/shm, which it cannot even open.
func TestAUsersPrimaryStartsBesideASquat(t *testing.T) {
	requireRoot(t)
	b := testenv.Tmpfs(t)
	for _, which := range []string{"segment", "memseg list", "life file"} {
		t.Run(which, func(t *testing.T) {
			tmp := sharedTmp(t)
			prefix := testenv.Prefix(t)
			t.Cleanup(func() { removeInstanceFiles(t, prefix) })
			name := runtimeName(prefix, victimUID, filepath.Join(tmp, "mpmr-"+strconv.Itoa(victimUID)))
			path := b3secBackendPath(b.Dir, name, which)
			b3secSquat(t, path, "private")

			h, res := userProc(t, "user-primary", userEnv(tmp), strconv.Itoa(victimUID), prefix, "", "", "")
			require.Equal(t, "<nil>", res, "uid %d's primary beside uid %d's %s", victimUID, squatterUID, path)
			dirs := privateDirs(t, b.Dir, name)
			require.Len(t, dirs, 1)
			ownedBy(t, dirs[0], victimUID)
			assert.FileExists(t, instance.SegmentPath(dirs[0], name))
			h.CloseInput()
			require.NoError(t, h.Wait(0))
			assert.Empty(t, privateDirs(t, b.Dir, name), "it goes with the instance")
			ownedBy(t, path, squatterUID)
		})
	}
}

// A primary killed while its files were in a directory of their own
// leaves them there, and the record of its runtime directory names that
// directory: the next primary removes them, and the directory, whether
// it goes to a directory of its own again (the name still taken) or to
// the backend directory itself (no longer).
func TestADeadPrimarysOwnDirectoryIsCleanedUpAfter(t *testing.T) {
	requireRoot(t)
	b := testenv.Tmpfs(t)
	cfg := primary.Config{Prefix: testenv.Prefix(t), RuntimeDir: testenv.RunDir(t), Backend: b.Kind,
		MemoryPages: 16, Logger: quiet}
	name := runtimeName(cfg.Prefix, os.Geteuid(), cfg.RuntimeDir)
	path := squatLife(t, b.Dir, name)

	dead := killedInOwnDir(t, cfg, b.Dir, name)
	p, err := startAfterKill(cfg)
	require.NoError(t, err)
	assert.NoDirExists(t, dead, "the dead primary's directory and files are gone")
	assert.Equal(t, []string{p.Backend().Dir}, privateDirs(t, b.Dir, name), "the new one has its own")
	require.NoError(t, p.Close())
	assert.Empty(t, privateDirs(t, b.Dir, name))

	dead = killedInOwnDir(t, cfg, b.Dir, name)
	require.NoError(t, os.Remove(path))
	p, err = startAfterKill(cfg)
	require.NoError(t, err)
	assert.Equal(t, b.Dir, p.Backend().Dir, "the name is free again")
	assert.NoDirExists(t, dead, "the dead primary's directory and files are gone")
	require.NoError(t, p.Close())
	assert.Empty(t, instance.Files(b.Dir, name))
	assert.NoFileExists(t, filepath.Join(cfg.RuntimeDir, cfg.Prefix, instance.BackendsFile), "nothing is left to record")
}

// A primary looks for a dead predecessor's files in every directory its
// runtime directory's record names, which may be /dev/shm though this one
// is given a directory only its user may write: a file of another user at
// one of the instance's names there is left alone, but no longer keeps
// the primary from starting. The directory stays in the record while a
// file of the instance's user is left there (here a segment, beside a
// life file that is not the instance's, which proves nothing of it), and
// not for the other user's file.
func TestANameTakenWhereTheRecordPointsDoesNotStopTheStart(t *testing.T) {
	requireRoot(t)
	b := testenv.Tmpfs(t)
	own := filepath.Join(b.Dir, testenv.Name(t))
	require.NoError(t, os.Mkdir(own, 0o755))
	t.Cleanup(func() { os.RemoveAll(own) })
	for _, left := range []bool{true, false} {
		cfg, record := recordedConfig(t, b, b.Dir+"\n")
		cfg.BackendDir = own
		name := runtimeName(cfg.Prefix, os.Geteuid(), cfg.RuntimeDir)
		path := squatLife(t, b.Dir, name)
		seg := instance.SegmentPath(b.Dir, name)
		if left {
			require.NoError(t, os.WriteFile(seg, nil, 0o600))
			t.Cleanup(func() { os.Remove(seg) })
		}

		p, err := primary.Start(cfg)
		require.NoError(t, err)
		assert.Equal(t, own, p.Backend().Dir)
		ownedBy(t, path, squatterUID)
		data, err := os.ReadFile(record)
		require.NoError(t, err)
		if left {
			assert.Contains(t, string(data), b.Dir+"\n", "the directory stays in the record")
			assert.FileExists(t, seg)
		} else {
			assert.NotContains(t, string(data), b.Dir+"\n", "the record names only the directory in use")
		}
		require.NoError(t, p.Close())
	}
}

// Another user who makes a file at one of the names after the primary
// looked (it watches the directory, and the life file is made first) does
// not stop the start either: the primary starts again, with its files in
// a directory of their own; so too when that user removes the file
// before the primary could look again (when the life file goes, as the
// first try is undone): what the first try met decides.
func TestANameTakenAfterThePrimaryLookedMovesTheFilesToo(t *testing.T) {
	requireRoot(t)
	b := testenv.Tmpfs(t)
	for _, c := range []struct {
		which string
		gone  bool // the squatter removes its file before Start looks again
	}{{"segment", false}, {"memseg list", false}, {"segment", true}, {"memseg list", true}} {
		which, gone := c.which, c.gone
		t.Run(fmt.Sprintf("%s/gone=%v", which, gone), func(t *testing.T) {
			cfg := primary.Config{Prefix: testenv.Prefix(t), RuntimeDir: testenv.RunDir(t), Backend: b.Kind,
				MemoryPages: 16, Logger: quiet}
			t.Cleanup(func() { removeInstanceFiles(t, cfg.Prefix) })
			name := runtimeName(cfg.Prefix, os.Geteuid(), cfg.RuntimeDir)
			path := b3secBackendPath(b.Dir, name, which)
			squatted := false
			defer primary.SetLifeTaken(func(dir string) {
				if dir == b.Dir && !squatted {
					squatted = true
					b3secSquat(t, path, "private")
				}
			})()

			if gone {
				// As one who watches the directory does once it sees the
				// life file go: nothing is at the name when Start looks
				// again.
				defer primary.SetStartFailed(func() { require.NoError(t, os.Remove(path)) })()
			}

			p, err := primary.Start(cfg)
			require.NoError(t, err)
			defer p.Close()
			require.True(t, squatted)
			assert.Equal(t, []string{p.Backend().Dir}, privateDirs(t, b.Dir, name))
			if gone {
				assert.Empty(t, instance.Files(b.Dir, name))
			} else {
				assert.Equal(t, []string{path}, instance.Files(b.Dir, name), "the first try left only the squatter's file")
				ownedBy(t, path, squatterUID)
			}
			require.NoError(t, p.Close())
			assert.Empty(t, privateDirs(t, b.Dir, name))
		})
	}
}

// A dead primary's directory of its own whose runtime directory was moved
// since (its files are named for where that was) goes with those files.
func TestADeadPrimarysOwnDirectoryGoesWhenItsRuntimeDirectoryMoved(t *testing.T) {
	requireRoot(t)
	b := testenv.Tmpfs(t)
	cfg := primary.Config{Prefix: testenv.Prefix(t), RuntimeDir: testenv.RunDir(t), Backend: b.Kind,
		MemoryPages: 16, Logger: quiet}
	old := runtimeName(cfg.Prefix, os.Geteuid(), cfg.RuntimeDir)
	squatLife(t, b.Dir, old)
	dead := killedInOwnDir(t, cfg, b.Dir, old)

	moved := cfg.RuntimeDir + "-moved"
	require.NoError(t, os.Rename(cfg.RuntimeDir, moved))
	t.Cleanup(func() { os.RemoveAll(moved) })
	cfg.RuntimeDir = moved
	p, err := primary.Start(cfg)
	require.NoError(t, err)
	assert.Equal(t, b.Dir, p.Backend().Dir)
	assert.NoDirExists(t, dead, "the dead primary's directory and files are gone")
	require.NoError(t, p.Close())
}

// A live primary whose runtime directory was removed while it ran holds
// its life file in the backend directory, where a new primary of the
// instance finds it and fails Start with ErrPrimaryRunning. Another
// user's file at one of the other names there sends the new primary's
// files to a directory of their own, but not past that check: two
// primaries of one instance would then run at once.
func TestANameTakenBesideALivePrimaryDoesNotStartASecond(t *testing.T) {
	requireRoot(t)
	b := testenv.Tmpfs(t)
	cfg := primary.Config{Prefix: testenv.Prefix(t), RuntimeDir: testenv.RunDir(t), Backend: b.Kind,
		MemoryPages: 16, Logger: quiet}
	name := runtimeName(cfg.Prefix, os.Geteuid(), cfg.RuntimeDir)
	h, _, _ := startPrimaryProcess(t, cfg)
	require.NoError(t, os.RemoveAll(filepath.Join(cfg.RuntimeDir, cfg.Prefix)))
	path := instance.SegmentPath(b.Dir, name) + ".lock"
	b3secSquat(t, path, "private")
	var log bytes.Buffer
	cfg.Logger = slog.New(slog.NewTextHandler(&log, nil))

	p, err := primary.Start(cfg)
	if err == nil {
		p.Close()
	}
	assert.Contains(t, log.String(), "directory of their own", "its files were to go in one")
	require.ErrorIs(t, err, primary.ErrPrimaryRunning)
	assert.Contains(t, err.Error(), fmt.Sprintf("pid %d", h.PID()))
	assert.Empty(t, privateDirs(t, b.Dir, name), "none is left")
}

// A record or a description may name a primary's directory of its own
// that has gone (a clean removed it, say); its name was to be seen in
// /dev/shm, and another user may make a directory of their own there
// under it. It is not the instance's: nothing in it is looked at (no life
// file is taken or made there, a file of the instance's user at one of the
// names stays), and the record names it no more. The description names
// it as the directory of a runtime directory this one was moved from.
func TestAnotherUsersDirectoryAtAnOwnDirectorysNameIsLeft(t *testing.T) {
	requireRoot(t)
	b := testenv.Tmpfs(t)
	for _, how := range []string{"recorded", "described"} {
		t.Run(how, func(t *testing.T) {
			cfg, record := recordedConfig(t, b, "")
			name := runtimeName(cfg.Prefix, os.Geteuid(), cfg.RuntimeDir)
			if how == "described" {
				name = runtimeName(cfg.Prefix, os.Geteuid(), cfg.RuntimeDir+"-before")
			}
			planted := filepath.Join(b.Dir, instance.PrivateDirName(name))
			require.NoError(t, os.Mkdir(planted, 0o777))
			t.Cleanup(func() { os.RemoveAll(planted) })
			require.NoError(t, os.Chown(planted, squatterUID, squatterUID))
			seg := instance.SegmentPath(planted, name)
			require.NoError(t, os.WriteFile(seg, nil, 0o600))
			// And one of that user's at a name of this instance's files
			// (its memory's): the directory then holds something of this
			// instance's by name, which is what a primary looks for.
			mem := filepath.Join(planted, hugetlb.FileName(runtimeName(cfg.Prefix, os.Geteuid(), cfg.RuntimeDir), 0))
			require.NoError(t, os.WriteFile(mem, nil, 0o600))
			require.NoError(t, os.Chown(mem, squatterUID, squatterUID))
			require.NoError(t, os.WriteFile(record, []byte(planted+"\n"), 0o600))
			if how == "described" {
				require.NoError(t, instance.WriteInfo(filepath.Join(cfg.RuntimeDir, cfg.Prefix),
					instance.Info{Prefix: cfg.Prefix, Backend: "tmpfs", BackendDir: planted, Segment: seg}))
			}
			defer primary.SetLifeTaken(func(dir string) {
				assert.NotEqual(t, planted, dir, "a life file taken in another user's directory")
			})()

			p, err := primary.Start(cfg)
			require.NoError(t, err)
			data, err := os.ReadFile(record)
			require.NoError(t, err)
			assert.NotContains(t, string(data), planted, "the record names it no more")
			assert.FileExists(t, seg, "nothing in it is touched")
			assert.NoFileExists(t, instance.LifePath(planted, name))
			require.NoError(t, p.Close())
		})
	}
}

// A primary whose files went in a directory of their own, and whose
// runtime directory was then removed (so that no record or description
// names that directory): a new primary of the instance still finds it,
// by the instance's name, in the backend directory. A live one there
// fails Start with ErrPrimaryRunning, the other user's file gone or not;
// a dead one's files and directory go.
func TestAnOwnDirectoryNothingNamesIsFoundByTheInstancesName(t *testing.T) {
	requireRoot(t)
	b := testenv.Tmpfs(t)
	for _, c := range []struct {
		kill, unsquat bool
	}{{false, false}, {false, true}, {true, false}} {
		t.Run(fmt.Sprintf("killed=%v/squat-removed=%v", c.kill, c.unsquat), func(t *testing.T) {
			cfg := primary.Config{Prefix: testenv.Prefix(t), RuntimeDir: testenv.RunDir(t), Backend: b.Kind,
				MemoryPages: 16, Logger: quiet}
			name := runtimeName(cfg.Prefix, os.Geteuid(), cfg.RuntimeDir)
			path := squatLife(t, b.Dir, name)
			h, _, _ := startPrimaryProcess(t, cfg)
			first := privateDirs(t, b.Dir, name)
			require.Len(t, first, 1)
			if c.kill {
				h.Kill()
				_ = h.Wait(0)
			}
			require.NoError(t, os.RemoveAll(filepath.Join(cfg.RuntimeDir, cfg.Prefix)))
			if c.unsquat {
				require.NoError(t, os.Remove(path))
			}

			p, err := startAfterKill(cfg)
			if !c.kill {
				if err == nil {
					p.Close()
				}
				require.ErrorIs(t, err, primary.ErrPrimaryRunning)
				assert.Contains(t, err.Error(), fmt.Sprintf("pid %d", h.PID()))
				assert.Equal(t, first, privateDirs(t, b.Dir, name), "the live primary's directory is left as it was")
				return
			}
			require.NoError(t, err)
			assert.NoDirExists(t, first[0], "the dead primary's directory and files are gone")
			require.NoError(t, p.Close())
			assert.Empty(t, privateDirs(t, b.Dir, name))
		})
	}
}

// A file system that does not answer (FUSE, which any user may mount on a
// directory of theirs in /dev/shm) where the starting primary lists the
// backend directory for directories of the instance's own: under another
// name, it is not looked at, and the primary starts; at a name of the
// instance's, beside a live primary whose runtime directory was removed,
// Start fails and says why, rather than start a second primary of the
// instance with its files elsewhere. Start never waits on it.
func TestAMountInTheBackendDirectoryNeitherHangsNorHidesAPrimary(t *testing.T) {
	requireRoot(t)
	b := testenv.Tmpfs(t)
	t.Run("another name", func(t *testing.T) {
		own := filepath.Join(b.Dir, testenv.Name(t))
		require.NoError(t, os.Mkdir(own, 0o755))
		t.Cleanup(func() { os.RemoveAll(own) })
		mnt := filepath.Join(own, "junk")
		require.NoError(t, os.Mkdir(mnt, 0o755))
		fuse := fusetest.MountAt(t, mnt, "seg-fuse")
		fuse.Stop() // from now on nothing on the mount answers
		cfg := primary.Config{Prefix: testenv.Prefix(t), RuntimeDir: testenv.RunDir(t), Backend: b.Kind,
			BackendDir: own, MemoryPages: 16, Logger: quiet}
		p, err := startWithin(t, cfg, fuse.Kill)
		require.NoError(t, err)
		require.NoError(t, p.Close())
	})
	t.Run("an instance's name beside a live primary", func(t *testing.T) {
		cfg := primary.Config{Prefix: testenv.Prefix(t), RuntimeDir: testenv.RunDir(t), Backend: b.Kind,
			MemoryPages: 16, Logger: quiet}
		name := runtimeName(cfg.Prefix, os.Geteuid(), cfg.RuntimeDir)
		startPrimaryProcess(t, cfg)
		require.NoError(t, os.RemoveAll(filepath.Join(cfg.RuntimeDir, cfg.Prefix)))
		mnt := filepath.Join(b.Dir, "mpmr."+name+".junk")
		require.NoError(t, os.Mkdir(mnt, 0o755))
		t.Cleanup(func() { os.Remove(mnt) })
		fuse := fusetest.MountAt(t, mnt, "seg-fuse")
		fuse.Stop()
		p, err := startWithin(t, cfg, fuse.Kill)
		if err == nil {
			p.Close()
		}
		require.ErrorIs(t, err, primary.ErrPermission)
		assert.Contains(t, err.Error(), "might not answer")
		assert.Empty(t, privateDirs(t, b.Dir, name), "no directory of its own was made")
	})
	t.Run("a directory's name, mounted once the table was read", func(t *testing.T) {
		cfg := primary.Config{Prefix: testenv.Prefix(t), RuntimeDir: testenv.RunDir(t), Backend: b.Kind,
			MemoryPages: 16, Logger: quiet}
		name := runtimeName(cfg.Prefix, os.Geteuid(), cfg.RuntimeDir)
		// Another user's directory under a name a primary gives its own,
		// on which a file system that does not answer is mounted.
		mnt := filepath.Join(b.Dir, instance.PrivateDirName(name))
		require.NoError(t, os.Mkdir(mnt, 0o755))
		require.NoError(t, os.Chown(mnt, squatterUID, squatterUID))
		t.Cleanup(func() { os.Remove(mnt) })
		// Mounted elsewhere first, then bound there from Start's
		// goroutine (which may not end the test).
		src, fuse := fusetest.Mount(t, "seg-fuse")
		fuse.Stop()
		var bound error
		defer primary.SetMountsRead(func(string) {
			bound = syscall.Mount(src, mnt, "", syscall.MS_BIND, "")
		})()
		t.Cleanup(func() { _ = syscall.Unmount(mnt, syscall.MNT_DETACH) })
		p, err := startWithin(t, cfg, fuse.Kill)
		if err == nil {
			p.Close()
		}
		require.NoError(t, bound)
		require.ErrorIs(t, err, primary.ErrPermission)
		assert.Contains(t, err.Error(), "is mounted on "+mnt)
	})
}
