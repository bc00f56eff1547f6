package primary_test

import (
	"fmt"
	"os"
	"runtime"
	"testing"

	"github.com/stretchr/testify/assert"
	"golang.org/x/sys/unix"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/primary"
)

func init() { testproc.Register("create-without-mlock", helperCreateWithoutMlock) }

// helperCreateWithoutMlock starts a primary on args[2], then, on a thread
// that may not mlock (RLIMIT_MEMLOCK 0, CAP_IPC_LOCK dropped), registers
// a page of its memory and prints "stats PINNED_BYTES UNPINNED_MRS" of the
// soft device.
func helperCreateWithoutMlock(args []string) int {
	fail := func(err error) int {
		fmt.Fprintln(os.Stderr, err)
		return 3
	}
	p, err := primary.Start(primary.Config{Prefix: args[0], RuntimeDir: args[1], Backend: backendOf(args[2]),
		MemoryPages: 4, SinglePage: true, Logger: quiet})
	if err != nil {
		return fail(err)
	}
	defer p.Close()
	r, err := p.Alloc(p.Backend().PageSize)
	if err != nil {
		return fail(err)
	}
	done := make(chan error, 1)
	go func() {
		// Capabilities belong to a thread: this one keeps its dropped
		// capability until it ends with the goroutine (never unlocked).
		runtime.LockOSThread()
		if err := unix.Setrlimit(unix.RLIMIT_MEMLOCK, &unix.Rlimit{}); err != nil {
			done <- err
			return
		}
		hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
		var caps [2]unix.CapUserData
		if err := unix.Capget(&hdr, &caps[0]); err != nil {
			done <- err
			return
		}
		caps[0].Effective &^= 1 << unix.CAP_IPC_LOCK
		if err := unix.Capset(&hdr, &caps[0]); err != nil {
			done <- err
			return
		}
		_, err := p.Global().Create(uint64(r.Addr))
		done <- err
	}()
	if err := <-done; err != nil {
		return fail(err)
	}
	st := p.Device().Stats()
	testproc.Say("stats %d %d", st.PinnedBytes, st.UnpinnedMRs)
	return 0
}

// TestHugetlbfsMemoryIsNotMlocked: the primary declares its hugetlbfs
// memory resident to the soft device, so a registration there makes no
// mlock, and counts as pinned even where mlock is not allowed (on
// hugetlbfs mlock would only have faulted the pages in). On tmpfs the same
// registration needs mlock, and without it is counted unpinned.
func TestHugetlbfsMemoryIsNotMlocked(t *testing.T) {
	for _, bk := range []hugetlb.Backend{testenv.Hugetlb(t, 4), testenv.Tmpfs(t)} {
		t.Run(bk.Kind.String(), func(t *testing.T) {
			h := testproc.Start(t, "create-without-mlock", []string{testenv.Prefix(t), testenv.RunDir(t), bk.Kind.String()})
			var pinned, unpinned uint64
			_, err := fmt.Sscanf(h.Expect("stats", 0), "stats %d %d", &pinned, &unpinned)
			if err != nil {
				t.Fatal(err)
			}
			if bk.Kind == hugetlb.Hugetlbfs {
				assert.Equal(t, bk.PageSize, pinned, "registered without mlock, counted pinned")
				assert.Zero(t, unpinned)
			} else {
				assert.Zero(t, pinned, "tmpfs memory needs mlock, which this thread may not use")
				assert.Equal(t, uint64(1), unpinned)
			}
			h.CloseInput()
			assert.NoError(t, h.Wait(0))
		})
	}
}
