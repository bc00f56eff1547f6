package primary_test

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/sys/ofd"
	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/ipc"
)

// kept holds what keepBacking keeps open for the helper's life.
var kept []*os.File

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
