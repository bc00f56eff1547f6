package vm

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

func TestReserveAtTakenAddressFails(t *testing.T) {
	size := 4 * PageSize
	base, err := Reserve(0, size)
	require.NoError(t, err)
	defer Unmap(base, size)

	_, err = Reserve(base+PageSize, PageSize)
	assert.ErrorIs(t, err, ErrRangeTaken)
}

// fileAndReservation returns a file of two pages and a reservation of
// four, both gone at the end of the test.
func fileAndReservation(t *testing.T) (*os.File, uintptr) {
	t.Helper()
	f, err := os.Create(filepath.Join(t.TempDir(), "data"))
	require.NoError(t, err)
	t.Cleanup(func() { f.Close() })
	require.NoError(t, f.Truncate(int64(2*PageSize)))
	base, err := Reserve(0, 4*PageSize)
	require.NoError(t, err)
	t.Cleanup(func() { Unmap(base, 4*PageSize) })
	return f, base
}

func TestMapFileReleaseAndCheck(t *testing.T) {
	f, base := fileAndReservation(t)

	assert.ErrorIs(t, CheckReadable(base, PageSize), ErrNotMapped, "a bare reservation is not readable")

	require.NoError(t, MapFile(base+PageSize, 2*PageSize, int(f.Fd()), 0))
	assert.NoError(t, CheckReadable(base+PageSize, 2*PageSize))
	assert.ErrorIs(t, CheckReadable(base, 2*PageSize), ErrNotMapped, "the range starts in the reservation")

	b := Bytes(base+PageSize, 2*PageSize)
	b[0], b[len(b)-1] = 0xa5, 0x5a
	got := make([]byte, 1)
	_, err := f.ReadAt(got, int64(2*PageSize-1))
	require.NoError(t, err)
	assert.Equal(t, byte(0x5a), got[0], "writes go to the file")

	require.NoError(t, Release(base+PageSize, PageSize))
	assert.ErrorIs(t, CheckReadable(base+PageSize, PageSize), ErrNotMapped)
	assert.NoError(t, CheckReadable(base+2*PageSize, PageSize))
	_, err = Reserve(base+PageSize, PageSize)
	assert.ErrorIs(t, err, ErrRangeTaken, "a released range stays reserved")
}

func TestMapSharedReadOnly(t *testing.T) {
	f, err := os.Create(filepath.Join(t.TempDir(), "data"))
	require.NoError(t, err)
	defer f.Close()
	require.NoError(t, f.Truncate(int64(PageSize)))

	// The mapping may be longer than the file: only the part the file
	// covers may be touched.
	base, err := MapSharedReadOnly(int(f.Fd()), 4*PageSize)
	require.NoError(t, err)
	defer Unmap(base, 4*PageSize)

	_, err = f.WriteAt([]byte{0x42}, 10)
	require.NoError(t, err)
	assert.Equal(t, byte(0x42), Bytes(base, PageSize)[10], "writes through the file show: the mapping is shared")
	assert.Equal(t, "r--s", mapPerms(t, base), "nothing may be written through the mapping")
}

// mapPerms returns the permissions /proc/self/maps shows for the mapping
// that starts at addr.
func mapPerms(t *testing.T, addr uintptr) string {
	t.Helper()
	b, err := os.ReadFile("/proc/self/maps")
	require.NoError(t, err)
	want := strconv.FormatUint(uint64(addr), 16) + "-"
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) > 1 && strings.HasPrefix(f[0], want) {
			return f[1]
		}
	}
	t.Fatalf("no mapping at 0x%x", addr)
	return ""
}

// vmFlags returns the VmFlags line of this process's mapping holding addr.
func vmFlags(t *testing.T, addr uintptr) []string {
	t.Helper()
	b, err := os.ReadFile("/proc/self/smaps")
	require.NoError(t, err)
	in := false
	for _, l := range strings.Split(string(b), "\n") {
		var lo, hi uint64
		if n, _ := fmt.Sscanf(l, "%x-%x", &lo, &hi); n == 2 && !strings.HasPrefix(l, "VmFlags") {
			in = uint64(addr) >= lo && uint64(addr) < hi
		}
		if in && strings.HasPrefix(l, "VmFlags:") {
			return strings.Fields(strings.TrimPrefix(l, "VmFlags:"))
		}
	}
	t.Fatalf("no mapping holds 0x%x", addr)
	return nil
}

// File mappings are not inherited by a forked child ("dc": do not copy);
// the reservation around them is.
func TestMappedFilesAreNotInheritedByAFork(t *testing.T) {
	f, base := fileAndReservation(t)

	require.NoError(t, MapFile(base, PageSize, int(f.Fd()), 0))
	require.NoError(t, MapFilePopulated(base+PageSize, PageSize, int(f.Fd()), int64(PageSize)))
	assert.Contains(t, vmFlags(t, base), "dc", "MapFile")
	assert.Contains(t, vmFlags(t, base+PageSize), "dc", "MapFilePopulated")
	assert.NotContains(t, vmFlags(t, base+2*PageSize), "dc", "the reservation")
	require.NoError(t, Release(base, PageSize))
	assert.NotContains(t, vmFlags(t, base), "dc", "released")
}

// threadFaults returns the page faults the calling thread has taken.
func threadFaults(t *testing.T) int64 {
	var ru unix.Rusage
	require.NoError(t, unix.Getrusage(unix.RUSAGE_THREAD, &ru))
	return ru.Minflt + ru.Majflt
}

func TestWritesToAPrefaultedSliceDoNotFault(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector's shadow memory faults in as the test writes")
	}
	runtime.LockOSThread() // the fault counts read are this thread's
	defer runtime.UnlockOSThread()
	const size = 16 << 20
	fresh := func() []byte { // private zero pages, none backed yet
		addr, err := Reserve(0, size)
		require.NoError(t, err)
		t.Cleanup(func() { Unmap(addr, size) })
		require.NoError(t, Vacate(addr, size))
		// Small pages, where transparent hugepages are always on: one
		// fault a page.
		require.NoError(t, unix.Madvise(Bytes(addr, size), unix.MADV_NOHUGEPAGE))
		return Bytes(addr, size)
	}
	write := func(s []byte) int64 {
		before := threadFaults(t)
		for i := 0; i < len(s); i += int(PageSize) {
			s[i] = 1
		}
		return threadFaults(t) - before
	}
	pages := int64(size / PageSize)
	require.GreaterOrEqual(t, write(fresh()), pages, "writes to fresh pages fault: the count sees them")
	s := fresh()
	Prefault(s)
	// The thread may take a fault or two of its own meanwhile (a signal's
	// handler on a fresh page of its stack, say): at most 1% of the pages.
	assert.LessOrEqual(t, write(s), pages/100, "page faults writing to a prefaulted mapping")
}

// failRelease has the next Release's mapping fail as a MAP_FIXED may: with
// hole set, having first removed what was mapped (kernels before 6.12 do
// that), from its start for holeLen(length) bytes. With plugFails set,
// the mapping after it fails too, as any does at the limit of the
// process's mappings.
func failRelease(t *testing.T, hole, plugFails bool, holeLen func(uintptr) uintptr) {
	t.Helper()
	calls := 0
	fixedMap = func(addr, length uintptr, prot, flags int, fd int, off int64) (uintptr, error) {
		calls++
		switch {
		case calls == 1 && hole:
			if err := Unmap(addr, holeLen(length)); err != nil {
				return 0, err
			}
			return 0, unix.ENOMEM
		case calls == 1, calls == 2 && plugFails:
			return 0, unix.ENOMEM
		}
		return mmap(addr, length, prot, flags, fd, off)
	}
	t.Cleanup(func() { fixedMap = mmap })
}

func TestAFailedReleaseLeavesNoHole(t *testing.T) {
	whole := func(n uintptr) uintptr { return n }
	for _, c := range []struct {
		name            string
		hole, plugFails bool
		holeLen         func(uintptr) uintptr
	}{
		{"nothing-changed", false, false, whole},
		{"refused-twice", false, true, whole},
		{"hole", true, false, whole},
		{"hole-stays", true, true, whole},
		{"part-hole", true, false, func(n uintptr) uintptr { return n / 2 }},
	} {
		t.Run(c.name, func(t *testing.T) {
			f, base := fileAndReservation(t)
			page := base + PageSize
			require.NoError(t, MapFile(page, 2*PageSize, int(f.Fd()), 0))
			failRelease(t, c.hole, c.plugFails, c.holeLen)

			err := Release(page, 2*PageSize)
			_, taken := Reserve(page, PageSize)
			switch c.name {
			case "nothing-changed", "refused-twice":
				assert.ErrorIs(t, err, unix.ENOMEM)
				assert.NotErrorIs(t, err, ErrHole)
				assert.NoError(t, CheckReadable(page, PageSize), "the mapping is still there")
				assert.ErrorIs(t, taken, ErrRangeTaken)
			case "hole":
				assert.NoError(t, err, "the range ended up released")
				assert.ErrorIs(t, CheckReadable(page, PageSize), ErrNotMapped)
				assert.ErrorIs(t, taken, ErrRangeTaken, "the hole was reserved again")
			case "hole-stays", "part-hole":
				assert.ErrorIs(t, err, ErrHole)
				assert.ErrorIs(t, err, unix.ENOMEM)
				assert.NoError(t, taken, "the hole is still there")
			}
			if c.name == "part-hole" {
				assert.NoError(t, CheckReadable(page+PageSize, PageSize), "what was not removed stays mapped")
			}
		})
	}
}

// A populated mapping whose populate fails is released again; if that
// release leaves a hole, the error says so (ErrHole), so that the caller
// does not map or release over whatever takes the hole.
func TestAFailedPopulateSaysItLeftAHole(t *testing.T) {
	probe, err := unix.Mmap(-1, 0, int(PageSize), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	require.NoError(t, err)
	perr := unix.Madvise(probe, unix.MADV_POPULATE_WRITE)
	require.NoError(t, unix.Munmap(probe))
	if errors.Is(perr, unix.EINVAL) {
		t.Skip("the kernel cannot populate a mapping (MADV_POPULATE_WRITE, Linux 5.14): MapFilePopulated does not")
	}
	f, base := fileAndReservation(t)
	failRelease(t, true, true, func(n uintptr) uintptr { return n })
	err = MapFilePopulated(base, 3*PageSize, int(f.Fd()), 0) // past the file's end: the populate faults
	require.Error(t, err)
	assert.ErrorIs(t, err, ErrHole)
	_, taken := Reserve(base, PageSize)
	assert.NoError(t, taken, "the hole is still there")
}
