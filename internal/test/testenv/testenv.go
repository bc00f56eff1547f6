// Package testenv gives tests the backends and names they need, and skips
// (or, in CI, fails) with the exact reason when the machine lacks one.
package testenv

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"

	"github.com/mpmr/mpmr/hugetlb"
)

// RequireHugetlbEnv, set to 1, turns a missing hugetlbfs from a skip into a
// failure. CI sets it after making hugepages available.
const RequireHugetlbEnv = "MPMR_REQUIRE_HUGETLB"

// HugetlbRequired reports whether RequireHugetlbEnv is set.
func HugetlbRequired() bool { return os.Getenv(RequireHugetlbEnv) == "1" }

// Hugetlb returns a hugetlbfs backend with at least pages free default-size
// hugepages. Without one, the test is skipped with the reason, or fails when
// HugetlbRequired.
func Hugetlb(tb testing.TB, pages uint64) hugetlb.Backend {
	tb.Helper()
	b, err := hugetlb.Choose(hugetlb.Want{Kind: hugetlb.Hugetlbfs, Pages: pages})
	if err != nil {
		if HugetlbRequired() {
			tb.Fatalf("%s=1 but hugetlbfs is unusable: %v", RequireHugetlbEnv, err)
		}
		tb.Skipf("hugetlbfs unusable: %v", err)
	}
	return b
}

// Tmpfs returns the tmpfs backend.
func Tmpfs(tb testing.TB) hugetlb.Backend {
	tb.Helper()
	b, err := hugetlb.Choose(hugetlb.Want{Kind: hugetlb.Tmpfs})
	if err != nil {
		tb.Skipf("tmpfs unusable: %v", err)
	}
	return b
}

// ForEachBackend runs fn as a subtest on tmpfs and on hugetlbfs (the latter
// skipped or failed as Hugetlb says).
func ForEachBackend(t *testing.T, pages uint64, fn func(t *testing.T, b hugetlb.Backend)) {
	t.Helper()
	t.Run("tmpfs", func(t *testing.T) { fn(t, Tmpfs(t)) })
	t.Run("hugetlbfs", func(t *testing.T) { fn(t, Hugetlb(t, pages)) })
}

var seq atomic.Int64

// Name returns a name unique to this test and process, usable as an
// instance prefix or file name.
func Name(tb testing.TB) string {
	n := strings.NewReplacer("/", "-", " ", "_", "#", "").Replace(tb.Name())
	if len(n) > 40 {
		n = n[len(n)-40:]
	}
	return fmt.Sprintf("t%d-%d-%s", os.Getpid(), seq.Add(1), n)
}

// File returns a path in dir unique to the test, removed (with a ".lock"
// sibling) when the test ends.
func File(tb testing.TB, dir string) string {
	p := filepath.Join(dir, Name(tb))
	tb.Cleanup(func() {
		os.Remove(p)
		os.Remove(p + ".lock")
	})
	return p
}

// Prefix returns a short instance prefix unique to this process and call.
// Unix socket paths are limited to 108 bytes, so prefixes and runtime
// directories in tests stay short.
func Prefix(tb testing.TB) string {
	return fmt.Sprintf("p%d-%d", os.Getpid(), seq.Add(1))
}

// RunDir returns a short temporary directory for an instance's runtime
// files, removed when the test ends.
func RunDir(tb testing.TB) string {
	tb.Helper()
	dir, err := os.MkdirTemp("", "mpmr")
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// BecomeUser turns the calling helper process into user uid (group uid,
// no supplementary groups): how tests, run as root, get a process of
// another user. Call it in a re-executed helper, before anything else.
func BecomeUser(uid int) error {
	if err := syscall.Setgroups(nil); err != nil {
		return fmt.Errorf("setgroups: %w", err)
	}
	if err := syscall.Setgid(uid); err != nil {
		return fmt.Errorf("setgid: %w", err)
	}
	if err := syscall.Setuid(uid); err != nil {
		return fmt.Errorf("setuid: %w", err)
	}
	return nil
}
