package main

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/instance"
	"github.com/mpmr/mpmr/internal/sys/ofd"
	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/primary"
)

// files lists the instance's files: its runtime directory's and its
// backend files.
func files(t testing.TB, b hugetlb.Backend, rundir, prefix string) []string {
	t.Helper()
	var out []string
	ents, _ := os.ReadDir(filepath.Join(rundir, prefix))
	for _, e := range ents {
		out = append(out, filepath.Join(rundir, prefix, e.Name()))
	}
	m, err := filepath.Glob(filepath.Join(b.Dir, "mpmr."+prefix+".*"))
	require.NoError(t, err)
	return append(out, m...)
}

// freeHugepages is the kernel's count of free hugepages of b's size (0 for
// tmpfs).
func freeHugepages(t testing.TB, b hugetlb.Backend) uint64 {
	t.Helper()
	if b.Kind != hugetlb.Hugetlbfs {
		return 0
	}
	p, err := hugetlb.PoolFor(b.PageSize)
	require.NoError(t, err)
	return p.Free
}

func TestCleanRefusesALiveInstance(t *testing.T) {
	b := testenv.Tmpfs(t)
	rundir := testenv.RunDir(t)
	p, cfg := startPrimary(t, b, rundir)
	_, err := p.Alloc(b.PageSize)
	require.NoError(t, err)
	before := files(t, b, rundir, cfg.Prefix)
	require.Len(t, before, 8, "instance.json, backends, ipc.sock, primary.lock, slots.lock, segment, life file, memory: %v", before)

	out, errOut, status := tool(t, "-rundir", rundir, "clean", cfg.Prefix)
	assert.Equal(t, 1, status)
	assert.Empty(t, out)
	assert.Contains(t, errOut, "its primary is alive")
	assert.Contains(t, errOut, "pid "+strconv.Itoa(os.Getpid()))

	assert.Equal(t, before, files(t, b, rundir, cfg.Prefix), "nothing was removed")
	assert.True(t, p.Segment().Ready(), "nor marked dead")
	_, err = p.Alloc(b.PageSize)
	assert.NoError(t, err, "the primary works on")
	var got []lsEntry
	toolJSON(t, &got, "-rundir", rundir, "ls")
	require.Len(t, got, 1)
	assert.Equal(t, "live", got[0].State, "and still holds its lock")

	// Even with its lock file gone, a primary that runs is recognised by
	// its segment's creator.
	lock := filepath.Join(rundir, cfg.Prefix, instance.PrimaryLockFile)
	require.NoError(t, os.Remove(lock))
	before = files(t, b, rundir, cfg.Prefix)
	_, errOut, status = tool(t, "-rundir", rundir, "clean", cfg.Prefix)
	assert.Equal(t, 1, status)
	assert.Contains(t, errOut, "its primary is alive (pid "+strconv.Itoa(os.Getpid())+")")
	assert.Equal(t, before, files(t, b, rundir, cfg.Prefix), "nothing was removed or created")
}

func TestCleanRemovesADeadInstance(t *testing.T) {
	testenv.ForEachBackend(t, 4, func(t *testing.T, b hugetlb.Backend) {
		rundir := testenv.RunDir(t)
		freeBefore := freeHugepages(t, b)
		h, prefix := startDeadable(t, b, rundir)
		assert.Contains(t, h.ask("alloc 2"), "region")
		h.kill()
		left := files(t, b, rundir, prefix)
		name := instanceName(rundir, prefix)
		seg, mem := instance.SegmentPath(b.Dir, name), filepath.Join(b.Dir, hugetlb.FileName(name, 0))
		require.Subset(t, left, []string{seg, mem}, "the dead primary left its files")
		if b.Kind == hugetlb.Hugetlbfs {
			require.Less(t, freeHugepages(t, b), freeBefore, "and holds hugepages")
		}

		var got cleanOut
		toolJSON(t, &got, "-rundir", rundir, "clean", prefix)
		assert.ElementsMatch(t, append(left, filepath.Join(rundir, prefix)), got.Removed)
		assert.Equal(t, []string{seg}, got.MarkedDead)
		assert.Empty(t, got.StillMapped)
		assert.Empty(t, got.Warnings)
		assert.Empty(t, files(t, b, rundir, prefix), "nothing is left")
		assert.NoDirExists(t, filepath.Join(rundir, prefix))
		if b.Kind == hugetlb.Hugetlbfs {
			require.NotNil(t, got.Hugepages)
			assert.Equal(t, b.PageSize, got.Hugepages.PageSize)
			assert.Less(t, got.Hugepages.FreeBefore, got.Hugepages.FreeAfter)
			assert.Equal(t, freeBefore, freeHugepages(t, b), "every hugepage went back")
		} else {
			assert.Nil(t, got.Hugepages)
		}

		_, errOut, status := tool(t, "-rundir", rundir, "clean", prefix)
		assert.Equal(t, 1, status, "nothing left to clean")
		assert.Contains(t, errOut, "no instance")
	})
}

// deadInOwnDir starts a primary in a helper process with its runtime
// directory in rundir beside another user's file at its life file's name
// in b's directory, has it allocate, and kills it: it returns the
// instance's prefix, the directory of their own its files went in and
// those files, and the other user's file.
func deadInOwnDir(t *testing.T, b hugetlb.Backend, rundir string) (prefix, own string, left []string, squat string) {
	t.Helper()
	prefix = testenv.Prefix(t)
	squat = instance.LifePath(b.Dir, instanceName(rundir, prefix))
	require.NoError(t, os.WriteFile(squat, nil, 0o600))
	require.NoError(t, os.Chown(squat, 42012, 42012))
	t.Cleanup(func() { os.Remove(squat) })
	h := startDeadableAs(t, b, rundir, prefix)
	assert.Contains(t, h.ask("alloc 2"), "region")
	h.kill()
	info, err := instance.ReadInfo(filepath.Join(rundir, prefix))
	require.NoError(t, err)
	own = info.BackendDir
	require.Equal(t, b.Dir, filepath.Dir(own), "the primary's files went in a directory of their own")
	left, err = filepath.Glob(filepath.Join(own, "*"))
	require.NoError(t, err)
	require.NotEmpty(t, left, "the dead primary left its files")
	return prefix, own, left, squat
}

// A primary whose files went in a directory of their own, another user's
// file being at one of their names in the backend directory, and that
// died: clean removes its files and that directory, and leaves the other
// user's file alone.
func TestCleanRemovesADeadPrimarysOwnDirectory(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: to make a file of another user")
	}
	b := testenv.Tmpfs(t)
	rundir := testenv.RunDir(t)
	prefix, own, left, squat := deadInOwnDir(t, b, rundir)

	var got cleanOut
	toolJSON(t, &got, "-rundir", rundir, "clean", prefix)
	assert.Subset(t, got.Removed, append(left, own))
	assert.Empty(t, got.Warnings)
	assert.NoDirExists(t, own)
	assert.FileExists(t, squat, "another user's file is left alone")
	assert.NoDirExists(t, filepath.Join(rundir, prefix))
}

// A primary killed before it described itself, whose files went in a
// directory of their own: clean does not look into that directory (only
// the description's is held; the instance's user could swap another for
// a link), and keeps the record that names it, saying so; a primary
// started there cleans up.
func TestCleanLeavesAnUndescribedDeadPrimarysOwnDirectoryToTheNextPrimary(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: to make a file of another user")
	}
	b := testenv.Tmpfs(t)
	rundir := testenv.RunDir(t)
	prefix, own, left, squat := deadInOwnDir(t, b, rundir)
	require.NoError(t, os.Remove(filepath.Join(rundir, prefix, instance.InfoFile)))

	var got cleanOut
	toolJSON(t, &got, "-rundir", rundir, "clean", prefix)
	for _, f := range left {
		assert.NotContains(t, got.Removed, f)
		assert.FileExists(t, f)
	}
	assert.True(t, slices.ContainsFunc(got.Warnings, func(w string) bool {
		return strings.Contains(w, instance.BackendsFile+" kept") && strings.Contains(w, own)
	}), "warnings: %q", got.Warnings)

	p, err := primary.Start(primary.Config{Prefix: prefix, RuntimeDir: rundir, Backend: b.Kind, MemoryPages: 16,
		Logger: quiet})
	require.NoError(t, err)
	assert.NoDirExists(t, own, "the next primary cleaned up")
	require.NoError(t, p.Close())
	assert.FileExists(t, squat, "another user's file is left alone")
}

// The described directory of a primary's own gone, another user made one
// at its name (which was to be seen), or a link there to a directory of
// theirs; or the runtime directory was moved since, so that the
// directory is named for where it was: it is not the instance's, and
// clean looks into nothing there, refusing, and removes nothing.
func TestCleanLooksIntoNoOtherUsersDirectoryAtAnOwnDirectorysName(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: to make a directory of another user")
	}
	b := testenv.Tmpfs(t)
	for _, how := range []string{"directory", "link", "moved"} {
		t.Run(how, func(t *testing.T) {
			rundir := testenv.RunDir(t)
			prefix, own, _, _ := deadInOwnDir(t, b, rundir)
			theirs := own
			if how == "link" {
				theirs = own + "-theirs"
				t.Cleanup(func() { os.RemoveAll(theirs) })
			}
			seg := instance.SegmentPath(theirs, instanceName(rundir, prefix))
			if how == "moved" {
				moved := rundir + "-moved"
				require.NoError(t, os.Rename(rundir, moved))
				t.Cleanup(func() { os.RemoveAll(moved) })
				rundir = moved
			}
			require.NoError(t, os.RemoveAll(own))
			require.NoError(t, os.Mkdir(theirs, 0o777))
			require.NoError(t, os.Chown(theirs, 42012, 42012))
			if how == "link" {
				require.NoError(t, os.Symlink(theirs, own))
				require.NoError(t, os.Lchown(own, 42012, 42012))
			}
			require.NoError(t, os.WriteFile(seg, nil, 0o600))

			_, errOut, status := tool(t, "-rundir", rundir, "clean", prefix)
			assert.Equal(t, 1, status)
			assert.Contains(t, errOut, "not the instance user's")
			assert.FileExists(t, seg, "nothing in it is removed")
		})
	}
}

// deadInstance starts a primary in a helper process with its runtime
// directory in rundir, has it allocate, and kills it: it returns the
// instance's prefix and the files it left.
func deadInstance(t *testing.T, b hugetlb.Backend, rundir string) (prefix string, left []string) {
	t.Helper()
	h, prefix := startDeadable(t, b, rundir)
	assert.Contains(t, h.ask("alloc 2"), "region")
	h.kill()
	left = files(t, b, rundir, prefix)
	require.NotEmpty(t, left, "the dead primary left its files")
	return prefix, left
}

// The runtime directory given relative to the working directory names
// the same instance as the absolute path its primary was given: clean
// finds the dead primary's files and hugepages, instead of removing the
// runtime directory, the only record of them, and leaving them behind.
func TestCleanFindsADeadInstanceByARelativeRuntimeDir(t *testing.T) {
	testenv.ForEachBackend(t, 4, func(t *testing.T, b hugetlb.Backend) {
		rundir := testenv.RunDir(t)
		freeBefore := freeHugepages(t, b)
		prefix, left := deadInstance(t, b, rundir)

		t.Chdir(filepath.Dir(rundir))
		rel := filepath.Base(rundir)
		var listed []lsEntry
		toolJSON(t, &listed, "-rundir", rel, "ls")
		require.Len(t, listed, 1, "ls -rundir %s", rel)
		assert.Empty(t, listed[0].Errors, "ls -rundir %s", rel)
		assert.Equal(t, "dead", listed[0].State, "ls -rundir %s", rel)
		var got cleanOut
		toolJSON(t, &got, "-rundir", rel, "clean", prefix)
		assert.Subset(t, got.Removed, left, "clean -rundir %s", rel)
		assert.Empty(t, got.Warnings)
		assert.Empty(t, files(t, b, rundir, prefix), "nothing is left")
		if b.Kind == hugetlb.Hugetlbfs {
			assert.Equal(t, freeBefore, freeHugepages(t, b), "every hugepage went back")
		}
	})
}

// A dead instance whose runtime directory moved since its primary ran:
// its files are named for the old place, which clean, run on the new
// one, does not touch. It keeps the description, the only record of
// them, and says why; run from the old place, it removes everything.
func TestCleanKeepsTheDescriptionOfFilesItLeaves(t *testing.T) {
	testenv.ForEachBackend(t, 4, func(t *testing.T, b hugetlb.Backend) {
		rundir := testenv.RunDir(t)
		freeBefore := freeHugepages(t, b)
		prefix, left := deadInstance(t, b, rundir)

		moved, info, got := cleanMoved(t, rundir, prefix)
		assert.NotContains(t, got.Removed, info)
		inBackend := func(l []string) []string {
			return slices.DeleteFunc(slices.Clone(l), func(p string) bool { return filepath.Dir(p) != b.Dir })
		}
		require.NotEmpty(t, inBackend(left))
		assert.ElementsMatch(t, inBackend(left), inBackend(files(t, b, rundir, prefix)), "the files named for the old place are left alone")

		require.NoError(t, os.Rename(moved, rundir))
		got = cleanOut{}
		toolJSON(t, &got, "-rundir", rundir, "clean", prefix)
		assert.Subset(t, got.Removed, append(inBackend(left), filepath.Join(rundir, prefix, instance.InfoFile)))
		assert.Empty(t, got.Warnings)
		assert.Empty(t, files(t, b, rundir, prefix), "nothing is left")
		assert.NoDirExists(t, filepath.Join(rundir, prefix))
		if b.Kind == hugetlb.Hugetlbfs {
			assert.Equal(t, freeBefore, freeHugepages(t, b), "every hugepage went back")
		}
	})
}

// cleanMoved moves the runtime directory rundir of a dead instance and
// cleans it there, which keeps the description of the files left: it
// returns where the directory went, the description's path and what
// clean reported.
func cleanMoved(t *testing.T, rundir, prefix string) (moved, info string, got cleanOut) {
	t.Helper()
	moved = rundir + "-moved"
	require.NoError(t, os.Rename(rundir, moved))
	t.Cleanup(func() { os.RemoveAll(moved) })
	toolJSON(t, &got, "-rundir", moved, "clean", prefix)
	info = filepath.Join(moved, prefix, instance.InfoFile)
	assert.FileExists(t, info, "the description of the files left stays")
	assert.Contains(t, strings.Join(got.Warnings, "\n"), info+" kept")
	return moved, info, got
}

// The same with the segment gone and the memory files left (removed by
// hand, say): the description stays while any file it names is there.
// One that names no segment of the prefix and user (forged, or another
// instance's) keeps nothing there: clean removes it.
func TestCleanKeepsTheDescriptionWhileAnyOfItsFilesIsLeft(t *testing.T) {
	b := testenv.Tmpfs(t)
	rundir := testenv.RunDir(t)
	prefix, _ := deadInstance(t, b, rundir)
	name := instanceName(rundir, prefix)
	seg := instance.SegmentPath(b.Dir, name)
	require.NoError(t, os.Remove(seg))
	require.NotEmpty(t, instance.Files(b.Dir, name), "the memory files are left")

	moved, info, got := cleanMoved(t, rundir, prefix)

	// Forged: it names a file that is no segment of the prefix and user.
	forged := filepath.Join(b.Dir, "mpmr."+testenv.Name(t)+".u0.000000000000.ctl")
	require.NoError(t, os.WriteFile(forged, nil, 0o600))
	t.Cleanup(func() { os.Remove(forged) })
	require.NoError(t, instance.WriteInfo(filepath.Join(moved, prefix), instance.Info{Prefix: prefix,
		BackendDir: b.Dir, Segment: forged}))
	got = cleanOut{}
	toolJSON(t, &got, "-rundir", moved, "clean", prefix)
	assert.NoFileExists(t, info, "a description of nothing of the instance's goes")
	assert.FileExists(t, forged, "and what it names is not touched")

	require.NoError(t, os.Rename(moved, rundir))
	_, errOut, status := tool(t, "-rundir", rundir, "clean", prefix)
	assert.Equal(t, 1, status, "the runtime directory went with the forged description: %s", errOut)
}

// A dead primary that recorded a backend directory clean does not look
// into (a directory of the user's choosing, given to it as
// Config.BackendDir) and died before it described itself: clean cleans
// the shared directories and keeps the record, which a primary started
// there then follows to clean up in that directory too.
func TestCleanKeepsTheRecordOfDirectoriesItDoesNotLookInto(t *testing.T) {
	b := testenv.Tmpfs(t)
	rundir := testenv.RunDir(t)
	prefix, _ := deadInstance(t, b, rundir)
	name := instanceName(rundir, prefix)
	dir := filepath.Join(rundir, prefix)
	require.NoError(t, os.Remove(filepath.Join(dir, instance.InfoFile)))
	// A directory of its own in the tmpfs one, which clean does not look
	// into.
	elsewhere := filepath.Join(b.Dir, testenv.Name(t))
	require.NoError(t, os.Mkdir(elsewhere, 0o700))
	t.Cleanup(func() { os.RemoveAll(elsewhere) })
	left := filepath.Join(elsewhere, hugetlb.FileName(name, 0))
	require.NoError(t, os.WriteFile(left, nil, 0o600))
	record := filepath.Join(dir, instance.BackendsFile)
	require.NoError(t, os.WriteFile(record, []byte(b.Dir+"\n"+elsewhere+"\n"), 0o600))

	var got cleanOut
	toolJSON(t, &got, "-rundir", rundir, "clean", prefix)
	assert.Empty(t, instance.Files(b.Dir, name), "the shared directory is cleaned")
	assert.FileExists(t, record, "the record of the other stays")
	assert.Contains(t, strings.Join(got.Warnings, "\n"), fmt.Sprintf("%s kept: it names %q", record, elsewhere))
	assert.FileExists(t, left)
	var listed []lsEntry
	toolJSON(t, &listed, "-rundir", rundir, "ls")
	require.Len(t, listed, 1, "the runtime directory with the record left is still an instance's")
	assert.Equal(t, prefix, listed[0].Prefix)

	p, err := primary.Start(primary.Config{Prefix: prefix, RuntimeDir: rundir, Backend: b.Kind, MemoryPages: 16, Logger: quiet})
	require.NoError(t, err)
	require.NoError(t, p.Close())
	assert.NoFileExists(t, left, "the primary cleaned up where the record said")
	assert.NoDirExists(t, dir)
}

func TestCleanMarksTheSegmentDeadForSurvivingSecondaries(t *testing.T) {
	testenv.ForEachBackend(t, 4, func(t *testing.T, b hugetlb.Backend) {
		rundir := testenv.RunDir(t)
		freeBefore := freeHugepages(t, b)
		h, prefix := startDeadable(t, b, rundir)
		var addr uint64
		_, err := fmt.Sscanf(h.ask("alloc 2"), "region %d", &addr)
		require.NoError(t, err)
		sec := startSecondary(t, prefix, rundir)
		parseKey(t, sec.ask("lookup %d", addr))
		h.kill()

		out, errOut, status := tool(t, "-rundir", rundir, "clean", prefix)
		require.Equal(t, 0, status, errOut)
		assert.Contains(t, out, "marked dead "+instance.SegmentPath(b.Dir, instanceName(rundir, prefix)))
		assert.Contains(t, out, "still mapped by processes of the dead instance: pids ["+strconv.Itoa(sec.PID())+"]")
		assert.Contains(t, out, "removed "+filepath.Join(rundir, prefix)+"\n")
		assert.Equal(t, "ready false", sec.ask("ready"), "the surviving secondary sees the segment dead")
		assert.Empty(t, files(t, b, rundir, prefix))
		if b.Kind == hugetlb.Hugetlbfs {
			assert.Contains(t, out, "hugepages (2 MiB)")
		}

		// Its mappings kept the memory; its end returns it.
		sec.Kill()
		require.Error(t, sec.Wait(0))
		assert.Equal(t, freeBefore, freeHugepages(t, b))
	})
}

// Whoever holds a dead primary's segment or backing files open (the
// users it let in are handed them) may lock them as the primary did; the
// instance is dead all the same, and clean removes it.
func TestCleanRemovesADeadInstanceWhoseFilesOthersHoldLocked(t *testing.T) {
	b := testenv.Tmpfs(t)
	rundir := testenv.RunDir(t)
	h, prefix := startDeadable(t, b, rundir)
	assert.Contains(t, h.ask("alloc 2"), "region")
	h.kill()
	name := instanceName(rundir, prefix)
	seg, mem := instance.SegmentPath(b.Dir, name), filepath.Join(b.Dir, hugetlb.FileName(name, 0))
	for _, p := range []string{seg, mem} {
		f, err := os.OpenFile(p, os.O_RDWR, 0)
		require.NoError(t, err)
		t.Cleanup(func() { f.Close() })
		require.NoError(t, ofd.TryLock(f, 0, true), "%s, locked by another holder", p)
	}
	left := files(t, b, rundir, prefix)
	require.Subset(t, left, []string{seg, mem, instance.LifePath(b.Dir, name)})

	var got cleanOut
	toolJSON(t, &got, "-rundir", rundir, "clean", prefix)
	assert.ElementsMatch(t, append(left, filepath.Join(rundir, prefix)), got.Removed)
	assert.Equal(t, []string{seg}, got.MarkedDead)
	assert.Empty(t, got.Warnings)
	assert.Empty(t, files(t, b, rundir, prefix), "nothing is left")
}

// A file at the life file's name that others could have held is no life
// file: clean removes it, and says so.
func TestCleanSaysItRemovedAFileThatWasNoLifeFile(t *testing.T) {
	b := testenv.Tmpfs(t)
	rundir := testenv.RunDir(t)
	h, prefix := startDeadable(t, b, rundir)
	h.kill()
	life := instance.LifePath(b.Dir, instanceName(rundir, prefix))
	require.NoError(t, os.Chmod(life, 0o644))

	var got cleanOut
	toolJSON(t, &got, "-rundir", rundir, "clean", prefix)
	assert.Contains(t, got.Removed, life)
	assert.Contains(t, strings.Join(got.Warnings, "\n"), life+" was no life file")
	assert.NoFileExists(t, life)
}
