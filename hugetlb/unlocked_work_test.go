package hugetlb_test

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/shm"
)

// pollUntil polls cond, yielding between looks, until it holds or done is
// closed; it reports whether cond held.
func pollUntil(t *testing.T, done <-chan struct{}, cond func() bool) bool {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !cond() {
		select {
		case <-done:
			return cond()
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("timed out")
		}
		runtime.Gosched()
	}
	return true
}

// fenceASleeper fences a live process (sleep) on a slot held by a second
// attachment, as quarantineFor does, and returns a function that kills it
// and waits for it to be gone.
func fenceASleeper(t *testing.T, in *instance) (kill func()) {
	t.Helper()
	cmd := exec.Command("sleep", "1000")
	require.NoError(t, cmd.Start())
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	again, err := shm.Attach(in.opts)
	require.NoError(t, err)
	t.Cleanup(func() { again.Close() })
	require.True(t, in.seg.Fence(again.Slot(), 1000, cmd.Process.Pid, testenv.ProcessStart(t, cmd.Process.Pid)))
	return func() {
		require.NoError(t, cmd.Process.Kill())
		_ = cmd.Wait()
	}
}

// Alloc releases the quarantine itself: once the only fenced process is
// dead, an Alloc gets its quarantined pages back. A release punches the
// pages without the memory lock; an Alloc that comes while another
// release (Housekeep's, every 20 ms in the primary) punches waits for it
// and gets the pages, instead of finding them neither quarantined nor
// free and failing with ErrNoFreeRun.
func TestAnAllocDuringAnotherQuarantineReleaseGetsThePages(t *testing.T) {
	b := testenv.Tmpfs(t)
	const pages = 512 // 1 GiB on tmpfs: a punch of it takes a while
	in := newInstance(t, b, hugetlb.ListConfig{Pages: pages})
	kill := fenceASleeper(t, in)
	r, err := in.mem.Alloc(pages * b.PageSize)
	require.NoError(t, err)
	require.NoError(t, in.mem.Free(r))
	require.Equal(t, pages, in.mem.Quarantined())
	kill() // the only holder is gone: nothing may keep the pages any more

	released := make(chan int, 1)
	done := make(chan struct{})
	go func() { released <- in.mem.ReleaseQuarantine(); close(done) }()
	seen := pollUntil(t, done, func() bool {
		return testenv.GoroutinesIn("releaseQuarantine", "falloc.PunchHole") > 0
	})
	if !seen {
		t.Skip("the release finished before its punch could be seen")
	}
	got, err := in.mem.Alloc(b.PageSize)
	punching := testenv.GoroutinesIn("releaseQuarantine", "falloc.PunchHole") > 0
	t.Logf("alloc while another release punched (still punching after: %v): %v", punching, err)
	assert.NoError(t, err, "the holder is dead: Alloc must get the pages (it releases the quarantine itself)")
	if err == nil {
		require.NoError(t, in.mem.Free(got))
	}
	assert.Equal(t, pages, <-released)
}

// A subscriber that panics in a Free (the caller recovers): the pages
// stay allocated, and a later Free frees them; they are not left marked as
// being freed, which no Free or Alloc would ever take again.
func TestAPanickingFreeSubscriberLeavesThePagesFreeable(t *testing.T) {
	b := testenv.Tmpfs(t)
	in := newInstance(t, b, hugetlb.ListConfig{Pages: 2})
	r, err := in.mem.Alloc(b.PageSize)
	require.NoError(t, err)
	first := true
	cancel := in.mem.Subscribe(func(e hugetlb.Event) {
		if e.Kind == hugetlb.EventFree && first {
			first = false
			panic("subscriber failed")
		}
	})
	func() {
		defer func() { _ = recover() }()
		_ = in.mem.Free(r)
	}()
	cancel()
	err = in.mem.Free(r)
	assert.NoError(t, err, "the free that panicked changed nothing: the memory can be freed again")
	_, err1 := in.mem.Alloc(b.PageSize)
	_, err2 := in.mem.Alloc(b.PageSize)
	assert.NoError(t, errors.Join(err1, err2), "both pages can be allocated again")
	t.Logf("free again: %v; freeing=%v", err, freeing(t, in.mem, r.Addr, r.Len))
}

// The same for an Alloc: the pages are allocated, mapped and counted, and
// a Free takes them (they are not left marked as being allocated).
func TestAPanickingAllocSubscriberLeavesThePagesFreeable(t *testing.T) {
	b := testenv.Tmpfs(t)
	in := newInstance(t, b, hugetlb.ListConfig{Pages: 2})
	first := true
	var got hugetlb.Event
	cancel := in.mem.Subscribe(func(e hugetlb.Event) {
		if e.Kind == hugetlb.EventAlloc && first {
			first, got = false, e
			panic("subscriber failed")
		}
	})
	func() {
		defer func() { _ = recover() }()
		_, _ = in.mem.Alloc(b.PageSize)
	}()
	cancel()
	require.NotZero(t, got.Addr)
	l := in.mem.Lists()[0]
	t.Logf("after the panic: allocated=%d mapped=%d", l.Allocated, l.Mapped)
	err := in.mem.Free(hugetlb.Region{Addr: got.Addr, Len: got.Len})
	assert.NoError(t, err, "pages allocated, mapped and counted must be freeable")
}

// mapsFileAt reports whether process pid maps file at addr.
func mapsFileAt(t *testing.T, pid int, file string, addr uintptr) bool {
	t.Helper()
	f, err := os.Open(fmt.Sprintf("/proc/%d/maps", pid))
	require.NoError(t, err)
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		var lo, hi uint64
		if n, _ := fmt.Sscanf(sc.Text(), "%x-%x", &lo, &hi); n != 2 {
			continue
		}
		if uint64(addr) >= lo && uint64(addr) < hi && strings.HasSuffix(sc.Text(), file) {
			return true
		}
	}
	return false
}

// forkPausing forks this process into a child that only pauses (raw system
// calls, as primary/main_test.go's helper does) and returns its pid.
func forkPausing(t *testing.T) int {
	t.Helper()
	pid, _, errno := syscall.RawSyscall(syscall.SYS_FORK, 0, 0, 0)
	if errno != 0 {
		t.Fatalf("fork: %v", errno)
	}
	if pid == 0 {
		for {
			syscall.RawSyscall(syscall.SYS_PAUSE, 0, 0, 0)
		}
	}
	t.Cleanup(func() {
		_ = syscall.Kill(int(pid), syscall.SIGKILL)
		var ws syscall.WaitStatus
		_, _ = syscall.Wait4(int(pid), &ws, 0, nil)
	})
	return int(pid)
}

// Data memory mappings are not inherited by a fork, not even one that
// comes while an Alloc populates its pages (on tmpfs a second or more for
// gigabytes, without the memory lock): the mapping is marked DONTFORK
// before it is populated, in the same breath as the mapping (see
// vm.mapFile). A child that kept it would keep the pages after Free, which
// hands them out again with nothing in quarantine.
func TestAForkDuringAnAllocsPopulateInheritsNothing(t *testing.T) {
	b := testenv.Tmpfs(t)
	const pages = 512
	in := newInstance(t, b, hugetlb.ListConfig{Pages: pages})
	file := in.mem.Lists()[0].File
	type result struct {
		r   hugetlb.Region
		err error
	}
	res := make(chan result, 1)
	done := make(chan struct{})
	go func() {
		r, err := in.mem.Alloc(pages * b.PageSize)
		res <- result{r, err}
		close(done)
	}()
	base := in.mem.Lists()[0].Base
	// In mapFile with the mapping in place (mostly in the populate, now
	// and then between the mapping and its mark): then fork.
	seen := pollUntil(t, done, func() bool {
		return testenv.GoroutinesIn("vm.mapFile") > 0 && mapsFileAt(t, os.Getpid(), file, base)
	})
	if !seen {
		t.Skip("the populate ended before it could be seen")
	}
	// Every P busy: a goroutine that had to come back to the scheduler
	// between the mapping and the mark would wait for one there (as any
	// thread of a host may be delayed), and the fork would go first.
	var stop atomic.Bool
	for range runtime.GOMAXPROCS(0) {
		go func() {
			for !stop.Load() { // spinning: the Ps stay busy
			}
		}()
	}
	child := forkPausing(t)
	stop.Store(true)
	t.Logf("forked child %d; the Alloc still in mmap: %v", child, testenv.GoroutinesIn("vm.mapFile") > 0)
	got := <-res
	require.NoError(t, got.err)
	r := got.r
	inherited := mapsFileAt(t, child, file, r.Addr)
	t.Logf("the child maps the allocation: %v", inherited)
	require.NoError(t, in.mem.Free(r))
	assert.Zero(t, in.mem.Quarantined(), "nothing waits for the child")
	again, err := in.mem.Alloc(b.PageSize)
	require.NoError(t, err)
	assert.False(t, inherited && mapsFileAt(t, child, file, again.Addr),
		"the primary's child (forked during the Alloc's populate) maps pages that were freed and handed out again")
	// The new owner's bytes, as the child sees them.
	copy(again.Bytes(), "the new owner's secret")
	mem, err := os.Open(fmt.Sprintf("/proc/%d/mem", child))
	require.NoError(t, err)
	defer mem.Close()
	buf := make([]byte, 22)
	_, err = mem.ReadAt(buf, int64(again.Addr))
	t.Logf("the child reads at 0x%x: %q (%v)", again.Addr, buf, err)
	assert.NotEqual(t, "the new owner's secret", string(buf), "the child shares the reused page")
}

// An Alloc that fails for want of hugepages, while others run, leaves
// nothing behind: no page marked as being allocated, nothing counted.
func TestAFailedHugepageAllocLeavesNothingBehind(t *testing.T) {
	b := testenv.Hugetlb(t, 8)
	in := newInstance(t, b, hugetlb.ListConfig{Pages: 1024})
	var regions []hugetlb.Region
	var lastErr error
	for {
		r, err := in.mem.Alloc(4 * b.PageSize)
		if err != nil {
			lastErr = err
			break
		}
		regions = append(regions, r)
	}
	require.ErrorIs(t, lastErr, hugetlb.ErrNoHugepages)
	l := in.mem.Lists()[0]
	assert.Equal(t, 4*len(regions), l.Allocated)
	assert.Equal(t, 4*len(regions), l.Mapped)
	for _, r := range regions {
		require.NoError(t, in.mem.Free(r))
	}
	// Every page free again: the whole run can be had (no page stuck as
	// being allocated by the failed call).
	r, err := in.mem.Alloc(4 * b.PageSize)
	require.NoError(t, err)
	assert.Equal(t, in.region(0, 4), r)
}

// Allocs at once on hugetlbfs until the pool runs dry, with frees mixed
// in: every failure is ErrNoHugepages (or ErrNoFreeRun), and afterwards
// the accounting matches what the callers hold, and every page can be
// had again.
func TestConcurrentHugepageAllocsRunningDryStayConsistent(t *testing.T) {
	b := testenv.Hugetlb(t, 8)
	in := newInstance(t, b, hugetlb.ListConfig{Pages: 1024})
	type out struct {
		rs   []hugetlb.Region
		errs []error
	}
	results := make(chan out, 2)
	for g := range 2 {
		go func() {
			var o out
			for i := 0; i < 200; i++ {
				r, err := in.mem.Alloc(uint64(1+(i+g)%3) * b.PageSize)
				if err != nil {
					o.errs = append(o.errs, err)
					if len(o.rs) > 0 && i%2 == 0 {
						if err := in.mem.Free(o.rs[0]); err != nil {
							o.errs = append(o.errs, fmt.Errorf("free: %w", err))
						}
						o.rs = o.rs[1:]
					}
					continue
				}
				o.rs = append(o.rs, r)
			}
			results <- o
		}()
	}
	held := 0
	var all []hugetlb.Region
	for range 2 {
		o := <-results
		for _, err := range o.errs {
			require.True(t, errors.Is(err, hugetlb.ErrNoHugepages) || errors.Is(err, hugetlb.ErrNoFreeRun), "%v", err)
		}
		for _, r := range o.rs {
			held += int(r.Len / b.PageSize)
		}
		all = append(all, o.rs...)
	}
	l := in.mem.Lists()[0]
	assert.Equal(t, held, l.Allocated)
	assert.Equal(t, held, l.Mapped)
	for _, r := range all {
		require.NoError(t, in.mem.Free(r))
	}
	r, err := in.mem.Alloc(4 * b.PageSize)
	require.NoError(t, err)
	assert.Equal(t, in.region(0, 4), r)
}

// Housekeep runs often, beside the primary's other housekeeping, and must
// not wait: while the memory changes are held back (a hello waiting for a
// free that waits for a stalled secondary), it releases nothing and
// returns; a later round releases the pages.
func TestHousekeepDoesNotWaitBehindHeldChanges(t *testing.T) {
	b := testenv.Tmpfs(t)
	in := newInstance(t, b, hugetlb.ListConfig{Pages: 2})
	kill := fenceASleeper(t, in)
	r, err := in.mem.Alloc(b.PageSize)
	require.NoError(t, err)
	require.NoError(t, in.mem.Free(r))
	require.Equal(t, 1, in.mem.Quarantined())
	kill() // the holder is gone: its page may go back

	var once sync.Once
	held := in.mem.HoldChanges()
	release := func() { once.Do(held) }
	defer release()
	_, err = testenv.Bounded(t, "Housekeep while the changes are held", 20*time.Second, func() error {
		in.mem.Housekeep(time.Now())
		return nil
	})
	require.NoError(t, err)
	assert.Equal(t, 1, in.mem.Quarantined(), "nothing released while the changes are held")
	release()
	assert.Equal(t, 1, in.mem.Housekeep(time.Now()))
	assert.Zero(t, in.mem.Quarantined())
}
