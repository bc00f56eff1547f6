package verbs_test

import (
	"bufio"
	"bytes"
	"fmt"
	"log/slog"
	"os"
	"runtime"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/mpmr/mpmr/internal/sys/vm"
	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/shm"
	"github.com/mpmr/mpmr/verbs"
)

func init() {
	testproc.Register("unpinned", helperUnpinned)
}

// lockedBytes sums the sizes of this process's mlocked mappings inside
// [lo, hi), from /proc/self/smaps.
func lockedBytes(t testing.TB, lo, hi uintptr) uintptr {
	t.Helper()
	raw, err := os.ReadFile("/proc/self/smaps")
	require.NoError(t, err)
	var total, start, end uintptr
	sc := bufio.NewScanner(bytes.NewReader(raw))
	for sc.Scan() {
		line := sc.Text()
		if f := strings.Fields(line); len(f) > 1 && strings.Contains(f[0], "-") && !strings.HasSuffix(f[0], ":") {
			s, e, _ := strings.Cut(f[0], "-")
			a, err1 := strconv.ParseUint(s, 16, 64)
			b, err2 := strconv.ParseUint(e, 16, 64)
			if err1 == nil && err2 == nil {
				start, end = uintptr(a), uintptr(b)
			}
			continue
		}
		if flags, ok := strings.CutPrefix(line, "VmFlags:"); ok && start >= lo && end <= hi {
			if strings.Contains(" "+flags+" ", " lo ") {
				total += end - start
			}
		}
	}
	return total
}

func TestPinsAreCountedPerPage(t *testing.T) {
	d, pd, _ := newSoft(t, 8)
	buf := newBuffer(t, 8*vm.PageSize)
	page := vm.PageSize
	// a covers pages 0-3, b pages 2-5 (b starts mid-page 2): they share
	// pages 2 and 3, which stay pinned until both are gone.
	a, err := pd.RegMR(buf.addr, 4*page, 0)
	require.NoError(t, err)
	b, err := pd.RegMR(buf.page(2)+100, 3*page, 0)
	require.NoError(t, err)
	if st := d.Stats(); st.UnpinnedMRs != 0 {
		t.Skipf("mlock is not permitted here (RLIMIT_MEMLOCK): %d MRs unpinned", st.UnpinnedMRs)
	}
	assert.Equal(t, 6*page, lockedBytes(t, buf.addr, buf.addr+buf.size))
	assert.Equal(t, uint64(a.Len+b.Len), d.Stats().PinnedBytes)

	require.NoError(t, pd.DeregMR(a))
	assert.Equal(t, 4*page, lockedBytes(t, buf.addr, buf.addr+buf.size), "b's pages stay pinned")
	require.NoError(t, pd.DeregMR(b))
	assert.Zero(t, lockedBytes(t, buf.addr, buf.addr+buf.size))
	assert.Zero(t, d.Stats().PinnedBytes)
}

// TestResidentRangesAreNotMlocked declares a range resident, as the
// primary does for its hugetlbfs memory: MRs inside it count as pinned
// without an mlock (on tmpfs pages, which mlock would lock and count, the
// difference shows), MRs reaching past it are mlocked as before, and
// memory inside it that is not mapped is refused as ever.
func TestResidentRangesAreNotMlocked(t *testing.T) {
	d, pd, _ := newSoft(t, 8)
	buf := newBuffer(t, 8*vm.PageSize)
	page := vm.PageSize
	require.NoError(t, d.Resident(buf.addr, 4*page))

	in, err := pd.RegMR(buf.addr+100, 2*page, verbs.AccessLocalWrite)
	require.NoError(t, err)
	assert.Zero(t, lockedBytes(t, buf.addr, buf.addr+buf.size), "a resident range is not mlocked")
	assert.Equal(t, uint64(in.Len), d.Stats().PinnedBytes, "but counts as pinned")
	assert.Zero(t, d.Stats().UnpinnedMRs)
	require.NoError(t, d.Validate(verbs.SGE{Addr: in.Addr, Len: 64, Key: in.LKey}, verbs.AccessLocalWrite))

	across, err := pd.RegMR(buf.page(3), 2*page, 0) // pages 3 and 4: half outside
	require.NoError(t, err)
	if d.Stats().UnpinnedMRs != 0 {
		t.Skip("mlock is not permitted here (RLIMIT_MEMLOCK): the rest needs it")
	}
	assert.Equal(t, 2*page, lockedBytes(t, buf.addr, buf.addr+buf.size), "a range reaching past it is mlocked")
	assert.Equal(t, uint64(in.Len+across.Len), d.Stats().PinnedBytes)

	require.NoError(t, pd.DeregMR(in))
	require.NoError(t, pd.DeregMR(across))
	assert.Zero(t, lockedBytes(t, buf.addr, buf.addr+buf.size))
	assert.Zero(t, d.Stats().PinnedBytes)
	assert.Zero(t, d.Stats().LiveMRs)

	// Resident says nothing of whether memory is mapped: still checked.
	none, err := vm.Reserve(0, 2*page)
	require.NoError(t, err)
	t.Cleanup(func() { vm.Unmap(none, 2*page) })
	require.NoError(t, d.Resident(none, 2*page))
	_, err = pd.RegMR(none, page, 0)
	require.ErrorIs(t, err, verbs.ErrNotMapped)
}

func TestResidentChecksItsArguments(t *testing.T) {
	d, _, o := newSoft(t, 8)
	buf := newBuffer(t, vm.PageSize)
	require.ErrorIs(t, d.Resident(buf.addr, 0), verbs.ErrBadRange)
	require.ErrorIs(t, d.Resident(^uintptr(0)-100, 1000), verbs.ErrBadRange)
	require.ErrorIs(t, attachSoft(t, o).Resident(buf.addr, buf.size), verbs.ErrPermission, "only the owner")
}

// helperUnpinned runs a primary that may not mlock: RLIMIT_MEMLOCK is 0
// and its thread lacks CAP_IPC_LOCK. It registers two MRs and reports the
// counters and how many warnings it logged.
func helperUnpinned(args []string) int {
	fail := func(err error) int {
		fmt.Fprintln(os.Stderr, err)
		return 3
	}
	// Capabilities belong to a thread: keep this goroutine on the one
	// that drops CAP_IPC_LOCK.
	runtime.LockOSThread()
	if err := unix.Setrlimit(unix.RLIMIT_MEMLOCK, &unix.Rlimit{}); err != nil {
		return fail(err)
	}
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var caps [2]unix.CapUserData
	if err := unix.Capget(&hdr, &caps[0]); err != nil {
		return fail(err)
	}
	caps[0].Effective &^= 1 << unix.CAP_IPC_LOCK
	if err := unix.Capset(&hdr, &caps[0]); err != nil {
		return fail(err)
	}

	o := segOptions(args[0])
	o.Role = shm.RolePrimary
	seg, err := shm.Create(o)
	if err != nil {
		return fail(err)
	}
	defer seg.Close()
	var logged bytes.Buffer
	d, err := verbs.CreateSoft(seg, verbs.SoftOptions{MaxMRs: 4, Logger: slog.New(slog.NewTextHandler(&logged, nil))})
	if err != nil {
		return fail(err)
	}
	defer d.Close()
	pd, _ := d.AllocPD()
	size := 4 * vm.PageSize
	addr, err := vm.Reserve(0, size)
	if err != nil {
		return fail(err)
	}
	f, err := os.OpenFile(args[1], os.O_RDWR, 0)
	if err != nil {
		return fail(err)
	}
	if err := vm.MapFile(addr, size, int(f.Fd()), 0); err != nil {
		return fail(err)
	}
	a, errA := pd.RegMR(addr, 2*vm.PageSize, 0)
	b, errB := pd.RegMR(addr+2*vm.PageSize, 2*vm.PageSize, verbs.AccessLocalWrite)
	if errA != nil || errB != nil {
		return fail(fmt.Errorf("%v, %v", errA, errB))
	}
	st := d.Stats()
	testproc.Say("registered unpinned=%d pinned=%d warnings=%d valid=%s",
		st.UnpinnedMRs, st.PinnedBytes, strings.Count(logged.String(), "cannot pin"),
		errName(d.Validate(verbs.SGE{Addr: b.Addr, Len: 8, Key: b.LKey}, verbs.AccessLocalWrite)))
	if err := pd.DeregMR(a); err != nil {
		return fail(err)
	}
	st = d.Stats()
	testproc.Say("deregistered unpinned=%d pinned=%d", st.UnpinnedMRs, st.PinnedBytes)
	return 0
}

func TestRegMRWithoutMlockRegistersUnpinned(t *testing.T) {
	p := testproc.Start(t, "unpinned", []string{newSegmentPath(t), newFile(t, 4*vm.PageSize)})
	assert.Equal(t, "registered unpinned=2 pinned=0 warnings=1 valid=ok", p.Expect("registered ", 0),
		"both MRs work unpinned; the first failure is logged, the second only counted")
	assert.Equal(t, "deregistered unpinned=1 pinned=0", p.Expect("deregistered ", 0))
	require.NoError(t, p.Wait(0))
}

// An MR's pages stay pinned while any other MR covers them, however far
// back that one starts: a long MR under short ones, and short ones under
// a long one, deregistered in either order.
func TestPinsOfALongMRUnderShortOnes(t *testing.T) {
	d, pd, _ := newSoft(t, 8)
	buf := newBuffer(t, 16*vm.PageSize)
	page := vm.PageSize
	long, err := pd.RegMR(buf.addr, 12*page, 0) // pages 0-11
	require.NoError(t, err)
	var short []verbs.MR
	for _, p := range []int{1, 6, 11, 13} { // the last past the long one
		mr, err := pd.RegMR(buf.page(p), page, 0)
		require.NoError(t, err)
		short = append(short, mr)
	}
	if st := d.Stats(); st.UnpinnedMRs != 0 {
		t.Skipf("mlock is not permitted here (RLIMIT_MEMLOCK): %d MRs unpinned", st.UnpinnedMRs)
	}
	assert.Equal(t, 13*page, lockedBytes(t, buf.addr, buf.addr+buf.size))
	require.NoError(t, pd.DeregMR(short[1]))
	assert.Equal(t, 13*page, lockedBytes(t, buf.addr, buf.addr+buf.size), "page 6 stays pinned by the long MR")
	require.NoError(t, pd.DeregMR(long))
	assert.Equal(t, 3*page, lockedBytes(t, buf.addr, buf.addr+buf.size), "pages 1, 11 and 13 stay pinned by their own MRs")
	for _, i := range []int{0, 2, 3} {
		require.NoError(t, pd.DeregMR(short[i]))
	}
	assert.Zero(t, lockedBytes(t, buf.addr, buf.addr+buf.size))
	assert.Zero(t, d.Stats().PinnedBytes)
}

// BenchmarkDeregAmongManyPinned deregisters and registers again one of
// 4,000 pinned single-page MRs: the cost of finding what else pins its
// pages must not grow with the MRs registered.
func BenchmarkDeregAmongManyPinned(b *testing.B) {
	const n = 4000
	_, pd, _ := newSoft(b, n+1)
	buf := newBuffer(b, n*vm.PageSize)
	mrs := make([]verbs.MR, n)
	for i := range mrs {
		mr, err := pd.RegMR(buf.page(i), vm.PageSize, 0)
		require.NoError(b, err)
		mrs[i] = mr
	}
	i := 0
	for b.Loop() {
		j := i % n
		require.NoError(b, pd.DeregMR(mrs[j]))
		mr, err := pd.RegMR(buf.page(j), vm.PageSize, 0)
		require.NoError(b, err)
		mrs[j] = mr
		i += 997
	}
}

// BenchmarkCloseManyPinned closes a protection domain, or the device,
// with 4,000 pinned single-page MRs: the cost of unpinning them all must
// not grow faster than the MRs.
func BenchmarkCloseManyPinned(b *testing.B) {
	for _, what := range []string{"pd", "device"} {
		b.Run(what, func(b *testing.B) {
			const n = 4000
			buf := newBuffer(b, n*vm.PageSize)
			for b.Loop() {
				b.StopTimer()
				d, pd, _ := newSoft(b, n)
				for i := range n {
					_, err := pd.RegMR(buf.page(i), vm.PageSize, 0)
					require.NoError(b, err)
				}
				b.StartTimer()
				if what == "pd" {
					require.NoError(b, pd.Close())
				} else {
					require.NoError(b, d.Close())
				}
				b.StopTimer()
				require.Zero(b, lockedBytes(b, buf.addr, buf.addr+buf.size))
				b.StartTimer()
			}
		})
	}
}

// Closing a protection domain unpins the pages of its MRs that no MR of
// another covers, all at once; closing the device unpins the rest.
func TestClosingAPDKeepsAnothersPins(t *testing.T) {
	d, pd, _ := newSoft(t, 64)
	other, err := d.AllocPD()
	require.NoError(t, err)
	defer other.Close()
	buf := newBuffer(t, 16*vm.PageSize)
	page := vm.PageSize
	for i := range 12 { // pages 0-11, one MR each, and a long one over 2-9
		_, err := pd.RegMR(buf.page(i), page, 0)
		require.NoError(t, err)
	}
	_, err = pd.RegMR(buf.page(2), 8*page, 0)
	require.NoError(t, err)
	for _, p := range []int{3, 10, 14} { // pages 3-4, 10-11 and 14
		n := uintptr(2)
		if p == 14 {
			n = 1
		}
		_, err := other.RegMR(buf.page(p), n*page, 0)
		require.NoError(t, err)
	}
	if st := d.Stats(); st.UnpinnedMRs != 0 {
		t.Skipf("mlock is not permitted here (RLIMIT_MEMLOCK): %d MRs unpinned", st.UnpinnedMRs)
	}
	assert.Equal(t, 13*page, lockedBytes(t, buf.addr, buf.addr+buf.size))
	require.NoError(t, pd.Close())
	assert.Equal(t, 5*page, lockedBytes(t, buf.addr, buf.addr+buf.size), "pages 3-4, 10-11 and 14 stay pinned by the other PD's MRs")
	assert.Equal(t, uint64(5*page), d.Stats().PinnedBytes)
	require.NoError(t, d.Close())
	assert.Zero(t, lockedBytes(t, buf.addr, buf.addr+buf.size))
}
