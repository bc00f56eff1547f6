package primary_test

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/internal/test/testenv"
)

// Breaker 12: fdinfo names an open file by (mnt_id, ino), and mnt_id names
// a mount, not a file system: the same backing file opened through a bind
// mount, or from another mount namespace (a container, a systemd unit with
// PrivateTmp/ProtectSystem), has another mnt_id. The quarantine must
// still see it.

// A secondary holds the backing file open through a bind mount of its
// directory (a raw fd that survives the drop). Stopped through a free and
// fenced, it resumes and is dropped. It still holds a backing file open:
// the fence must hold.
func TestBreaker12BackingFileHeldThroughBindMountKeepsTheFence(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to bind mount")
	}
	p, cfg := startPrimary(t, testenv.Tmpfs(t), shortSync)
	ps := p.Backend().PageSize
	li := p.Memory().Lists()[0]
	bind := t.TempDir()
	require.NoError(t, syscall.Mount(filepath.Dir(li.File), bind, "", syscall.MS_BIND, ""))
	t.Cleanup(func() { _ = syscall.Unmount(bind, syscall.MNT_DETACH) })
	alias := filepath.Join(bind, filepath.Base(li.File))

	r, err := p.Alloc(ps)
	require.NoError(t, err)
	s := b11Start(t, cfg, "")
	b10Attach(t, s)
	require.Contains(t, ask(t, s, "lookup %d", r.Addr), "key")
	require.Contains(t, ask(t, s, "keep %s", alias), "fd")
	s.Stop()
	require.NoError(t, p.Free(r))
	require.Equal(t, 1, p.Memory().Quarantined())
	s.Continue()
	require.Equal(t, "dropped=true", ask(t, s, "wait-dropped"))

	for _, task := range []string{"self", fmt.Sprint(s.PID())} {
		ents, _ := os.ReadDir("/proc/" + task + "/fd")
		for _, e := range ents {
			l, _ := os.Readlink("/proc/" + task + "/fd/" + e.Name())
			if filepath.Base(l) == filepath.Base(li.File) {
				b, _ := os.ReadFile("/proc/" + task + "/fdinfo/" + e.Name())
				t.Logf("%s fd %s -> %s\n%s", task, e.Name(), l, b)
			}
		}
		m, _ := os.ReadFile("/proc/" + task + "/maps")
		t.Logf("%s maps backing: %v", task, strings.Contains(string(m), filepath.Base(li.File)))
	}
	tasks, _ := os.ReadDir(fmt.Sprintf("/proc/%d/task", s.PID()))
	for _, tk := range tasks {
		m, _ := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/maps", s.PID(), tk.Name()))
		for _, ln := range strings.Split(string(m), "\n") {
			if strings.Contains(ln, " 11312 ") || strings.Contains(ln, "msl") {
				t.Logf("task %s: %s", tk.Name(), ln)
			}
		}
	}
	p.Memory().ReleaseQuarantine()
	assert.Equal(t, 1, p.Memory().Quarantined(),
		"the fence ended while the fenced process holds the backing file open through %s", alias)
	fdDir := fmt.Sprintf("/proc/%d/fd", s.PID())
	ents, _ := os.ReadDir(fdDir)
	for _, e := range ents {
		if l, _ := os.Readlink(fdDir + "/" + e.Name()); l == alias {
			t.Logf("after the fence ended, fd %s of the fenced process still names %s", e.Name(), l)
		}
	}
}

// ReleaseQuarantine after Close, with a fence still standing: the queries
// "report nothing" after Close; Holders must not read the unmapped table.
func TestBreaker12ReleaseQuarantineAfterCloseWithFence(t *testing.T) {
	p, cfg := startPrimary(t, testenv.Tmpfs(t), shortSync)
	ps := p.Backend().PageSize
	r, err := p.Alloc(ps)
	require.NoError(t, err)
	s := b11Start(t, cfg, "")
	b10Attach(t, s)
	require.Contains(t, ask(t, s, "lookup %d", r.Addr), "key")
	s.Stop()
	t.Cleanup(s.Continue)
	require.NoError(t, p.Free(r))
	require.Equal(t, 1, p.Memory().Quarantined())
	m := p.Memory()
	require.NoError(t, p.Close())
	m.ReleaseQuarantine() // must not fault
	m.Housekeep(time.Now())
}
