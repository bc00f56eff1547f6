package main

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/instance"
	"github.com/mpmr/mpmr/internal/sys/mounts"
	"github.com/mpmr/mpmr/internal/test/fusetest"
	"github.com/mpmr/mpmr/internal/test/testenv"
)

// An instance's user points its description's backend directory at a
// file system that does not answer (here a FUSE mount whose server is
// stopped; it could be a hung network mount), directly or through a link.
// The tool does not look there: ls lists the instance with why and every
// other instance as usual, dump of it fails saying why, stats says why,
// and clean, which cannot tell whether a primary holds files there,
// refuses and changes nothing.
func TestToolDoesNotLookIntoFilesThatMightNotAnswer(t *testing.T) {
	for _, link := range []bool{false, true} {
		t.Run(map[bool]string{false: "mount", true: "link"}[link], func(t *testing.T) {
			toolDoesNotLookIntoFilesThatMightNotAnswer(t, link)
		})
	}
}

func toolDoesNotLookIntoFilesThatMightNotAnswer(t *testing.T, link bool) {
	rundir, dir, prefix, _ := hostileInstance(t)
	fuseDir, fuse := fusetest.Mount(t, "fuse")
	name := instance.Name(prefix, hostileOwnerUID, dir)
	backend := fuseDir
	if link {
		backend = filepath.Join(testenv.Tmpfs(t).Dir, testenv.Prefix(t)+".backend")
		require.NoError(t, os.Symlink(fuseDir, backend))
		t.Cleanup(func() { os.Remove(backend) })
	}
	info := instance.Info{Prefix: prefix, PID: 1, Backend: hugetlb.Tmpfs.String(), BackendDir: backend,
		Segment: instance.SegmentPath(backend, name)}
	js, err := json.Marshal(info)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(dir, instance.InfoFile), js, 0o600))
	require.NoError(t, os.Lchown(rundir, 0, 0)) // root's, so that a primary of root's lives there too
	_, healthy := startPrimary(t, testenv.Tmpfs(t), rundir)
	// And one whose runtime directory is itself such a mount.
	hung := filepath.Join(rundir, "hung")
	require.NoError(t, os.Mkdir(hung, 0o700))
	hungFuse := fusetest.MountAt(t, hung, "fuse")
	hungFuse.Stop()
	fuse.Stop()
	old := fsWait
	fsWait = 300 * time.Millisecond
	t.Cleanup(func() { fsWait = old })

	type result struct {
		out, errOut string
		status      int
	}
	within := func(args ...string) result {
		done := make(chan result, 1)
		go func() {
			out, errOut, status := tool(t, args...)
			done <- result{out, errOut, status}
		}()
		select {
		case r := <-done:
			return r
		case <-time.After(time.Minute):
			t.Fatalf("mpmr %v hangs", args)
			return result{}
		}
	}

	r := within("-json", "-rundir", rundir, "ls")
	require.Equal(t, 0, r.status, r.errOut)
	var entries []lsEntry
	require.NoError(t, json.Unmarshal([]byte(r.out), &entries), r.out)
	byPrefix := map[string]lsEntry{}
	for _, x := range entries {
		byPrefix[x.Prefix] = x
	}
	require.Contains(t, byPrefix, prefix)
	require.Contains(t, byPrefix, healthy.Prefix)
	assert.Equal(t, "dead", byPrefix[prefix].State)
	if assert.Len(t, byPrefix[prefix].Errors, 1) {
		assert.Contains(t, byPrefix[prefix].Errors[0], mounts.ErrMayHang.Error())
	}
	require.Contains(t, byPrefix, "hung")
	assert.Equal(t, "unknown", byPrefix["hung"].State)
	if assert.Len(t, byPrefix["hung"].Errors, 1) {
		assert.Contains(t, byPrefix["hung"].Errors[0], mounts.ErrMayHang.Error())
	}
	assert.Equal(t, "live", byPrefix[healthy.Prefix].State, "the other instance is listed as usual")
	assert.Empty(t, byPrefix[healthy.Prefix].Errors)

	for _, cmd := range []string{"dump", "stats", "clean"} {
		r := within("-rundir", rundir, cmd, "hung")
		assert.NotEqual(t, 0, r.status, cmd)
		assert.Contains(t, r.errOut, mounts.ErrMayHang.Error(), cmd)
	}
	r = within("-rundir", rundir, "dump", prefix)
	assert.NotEqual(t, 0, r.status)
	assert.Contains(t, r.errOut, mounts.ErrMayHang.Error())
	r = within("-rundir", rundir, "stats", prefix)
	assert.Contains(t, r.out, mounts.ErrMayHang.Error())
	r = within("-rundir", rundir, "clean", prefix)
	assert.NotEqual(t, 0, r.status, "clean cannot tell whether a primary holds files it may not look at")
	assert.Contains(t, r.errOut, mounts.ErrMayHang.Error())
	assert.FileExists(t, filepath.Join(dir, instance.InfoFile), "nothing changed")
}

// A file system that might not answer mounted not at the directories the
// tool checks but on a name inside one (the description in a runtime
// directory; the segment's name in the backend directory, which on
// /dev/shm any user can make), or reached through a runtime directory
// that is a link, or holding the -rundir itself: none is looked into.
func TestToolDoesNotLookBelowIntoFilesThatMightNotAnswer(t *testing.T) {
	type setup func(t *testing.T, rundir, dir, prefix, seg string) (args []string, fuseAt string)
	for _, c := range []struct {
		name  string
		setup setup
		want  string
	}{
		{name: "mount on the description", want: mounts.ErrMayHang.Error(), setup: func(t *testing.T, rundir, dir, prefix, seg string) ([]string, string) {
			p := filepath.Join(dir, instance.InfoFile)
			require.NoError(t, os.Remove(p))
			require.NoError(t, os.Mkdir(p, 0o700))
			return []string{"-rundir", rundir, "dump", prefix}, p
		}},
		{name: "mount on the segment's name", want: mounts.ErrMayHang.Error(), setup: func(t *testing.T, rundir, dir, prefix, seg string) ([]string, string) {
			require.NoError(t, os.Remove(seg))
			require.NoError(t, os.Mkdir(seg, 0o700))
			t.Cleanup(func() { os.Remove(seg) })
			return []string{"-rundir", rundir, "clean", prefix}, seg
		}},
		{name: "no description, a mount on the segment's name", want: mounts.ErrMayHang.Error(), setup: func(t *testing.T, rundir, dir, prefix, seg string) ([]string, string) {
			require.NoError(t, os.Remove(filepath.Join(dir, instance.InfoFile)))
			require.NoError(t, os.Remove(seg))
			require.NoError(t, os.Mkdir(seg, 0o700))
			t.Cleanup(func() { os.Remove(seg) })
			return []string{"-rundir", rundir, "dump", prefix}, seg
		}},
		{name: "runtime directory a link", want: "symbolic link; not followed", setup: func(t *testing.T, rundir, dir, prefix, seg string) ([]string, string) {
			to := t.TempDir()
			require.NoError(t, os.Rename(dir, dir+".real"))
			require.NoError(t, os.Symlink(to, dir))
			return []string{"-rundir", rundir, "dump", prefix}, to
		}},
		{name: "-rundir on it", want: mounts.ErrMayHang.Error(), setup: func(t *testing.T, rundir, dir, prefix, seg string) ([]string, string) {
			other := filepath.Join(filepath.Dir(rundir), "other")
			require.NoError(t, os.Mkdir(other, 0o700))
			return []string{"-rundir", other, "ls"}, other
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			rundir, dir, prefix, seg := hostileInstance(t)
			args, at := c.setup(t, rundir, dir, prefix, seg)
			fusetest.MountAt(t, at, "fuse").Stop()
			done := make(chan string, 1)
			go func() {
				out, errOut, _ := tool(t, args...)
				done <- out + errOut
			}()
			select {
			case out := <-done:
				assert.Contains(t, out, c.want, "mpmr %v", args)
			case <-time.After(time.Minute):
				t.Fatalf("mpmr %v hangs", args)
			}
		})
	}
}

// The backend directory is held once looked into: a directory on the way
// to it swapped for a link to a file system that does not answer, after
// the check, leads the tool nowhere new.
func TestBackendDirectoryIsHeld(t *testing.T) {
	fuseDir, fuse := fusetest.Mount(t, "fuse")
	base := filepath.Join(testenv.Tmpfs(t).Dir, testenv.Prefix(t)+".held")
	require.NoError(t, os.MkdirAll(filepath.Join(base, "u", "backend"), 0o700))
	t.Cleanup(func() { os.RemoveAll(base) })
	tg := &target{Prefix: "x", Name: "x", Info: &instance.Info{BackendDir: filepath.Join(base, "u", "backend")}}
	seg := instance.SegmentPath(filepath.Join(base, "u", "backend"), tg.Name)
	require.NoError(t, os.WriteFile(seg, nil, 0o600))
	require.Len(t, tg.backendDirs(), 1)
	defer tg.release()

	require.NoError(t, os.Rename(filepath.Join(base, "u"), filepath.Join(base, "u.old")))
	require.NoError(t, os.Symlink(fuseDir, filepath.Join(base, "u")))
	fuse.Stop()

	done := make(chan string, 1)
	go func() {
		p, ok := tg.segmentPath()
		done <- fmt.Sprint(tg.shown(p), ok)
	}()
	select {
	case got := <-done:
		assert.Equal(t, fmt.Sprint(filepath.Join(base, "u", "backend", filepath.Base(seg)), true), got,
			"the segment in the directory held, named as it was found")
	case <-time.After(time.Minute):
		t.Fatal("the tool followed the link swapped in")
	}
}
