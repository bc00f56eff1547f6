package verbs_test

import (
	"errors"
	"log/slog"
	"os"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/internal/sys/vm"
	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/shm"
	"github.com/mpmr/mpmr/verbs"
)

func TestMain(m *testing.M) { testproc.Main(m) }

// quiet drops diagnostics the tests provoke on purpose (munlock of memory
// that was unmapped before its MR was deregistered, and the like).
var quiet = slog.New(slog.DiscardHandler)

// layoutTag is what a runtime built on this package passes to shm.
var layoutTag = shm.LayoutHash(verbs.Layout()...)

func segOptions(path string) shm.Options {
	return shm.Options{Path: path, LayoutTag: layoutTag, Slots: 8, Role: shm.RoleSecondary, Logger: quiet}
}

// newSegmentPath returns a unique path for a segment on tmpfs; the files
// are removed at cleanup.
func newSegmentPath(t testing.TB) string {
	t.Helper()
	return testenv.File(t, testenv.Tmpfs(t).Dir)
}

// newSegment creates a control segment on tmpfs, closed and removed at
// cleanup. The caller marks it ready once the device exists.
func newSegment(t testing.TB) (*shm.Segment, shm.Options) {
	t.Helper()
	o := segOptions(newSegmentPath(t))
	o.Role = shm.RolePrimary
	s, err := shm.Create(o)
	require.NoError(t, err)
	t.Cleanup(func() { s.Close() })
	o.Role = shm.RoleSecondary
	return s, o
}

// newSoft creates a ready segment holding a soft device with maxMRs slots,
// and a PD of it. Everything is released at cleanup.
func newSoft(t testing.TB, maxMRs int) (*verbs.Soft, verbs.PD, shm.Options) {
	t.Helper()
	seg, o := newSegment(t)
	d, err := verbs.CreateSoft(seg, verbs.SoftOptions{MaxMRs: maxMRs, Logger: quiet})
	require.NoError(t, err)
	t.Cleanup(func() { d.Close() })
	require.NoError(t, seg.MarkReady())
	pd, err := d.AllocPD()
	require.NoError(t, err)
	t.Cleanup(func() { pd.Close() })
	return d, pd, o
}

// attachSoft attaches to the segment o names from this process, as a
// secondary would: the returned Soft validates but cannot register.
func attachSoft(t testing.TB, o shm.Options) *verbs.Soft {
	t.Helper()
	seg, err := shm.Attach(o)
	require.NoError(t, err)
	t.Cleanup(func() { seg.Close() })
	d, err := verbs.AttachSoft(seg)
	require.NoError(t, err)
	t.Cleanup(func() { d.Close() })
	return d
}

// buffer is data memory for MRs: a tmpfs file mapped shared into a
// reservation, so that another process can map the same file at the same
// address.
type buffer struct {
	addr, size uintptr
	path       string
}

// newFile makes a tmpfs file of size bytes for data memory, removed at
// cleanup.
func newFile(t testing.TB, size uintptr) string {
	t.Helper()
	path := testenv.File(t, testenv.Tmpfs(t).Dir)
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	require.NoError(t, err)
	defer f.Close() // a mapping keeps the file
	require.NoError(t, f.Truncate(int64(size)))
	return path
}

func newBuffer(t testing.TB, size uintptr) *buffer {
	t.Helper()
	path := newFile(t, size)
	addr, err := vm.Reserve(0, size)
	require.NoError(t, err)
	t.Cleanup(func() { vm.Unmap(addr, size) })
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	require.NoError(t, err)
	defer f.Close()
	require.NoError(t, vm.MapFile(addr, size, int(f.Fd()), 0))
	return &buffer{addr: addr, size: size, path: path}
}

// newHugeBuffer maps one hugepage of a hugetlbfs file, or skips (fails in
// CI) with the reason when hugetlbfs is unusable.
func newHugeBuffer(t testing.TB) *buffer {
	t.Helper()
	b := testenv.Hugetlb(t, 1)
	page := uintptr(b.PageSize)
	path := testenv.File(t, b.Dir)
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	require.NoError(t, err)
	defer f.Close()
	require.NoError(t, f.Truncate(int64(page)))
	// A hugetlbfs mapping must be aligned to its page size: reserve twice
	// as much and map at the aligned address inside.
	res, err := vm.Reserve(0, 2*page)
	require.NoError(t, err)
	t.Cleanup(func() { vm.Unmap(res, 2*page) })
	addr := (res + page - 1) &^ (page - 1)
	require.NoError(t, vm.MapFile(addr, page, int(f.Fd()), 0))
	return &buffer{addr: addr, size: page, path: path}
}

// mapAt maps the file at path at exactly addr, as a secondary maps the
// primary's data memory.
func mapAt(path string, addr, size uintptr) error {
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	if _, err := vm.Reserve(addr, size); err != nil {
		return err
	}
	if err := vm.MapFile(addr, size, int(f.Fd()), 0); err != nil {
		vm.Unmap(addr, size)
		return err
	}
	return nil
}

func (b *buffer) bytes() []byte { return vm.Bytes(b.addr, b.size) }

func (b *buffer) page(i int) uintptr { return b.addr + uintptr(i)*vm.PageSize }

// errName names the completion error err is, for tables and for helper
// processes to report.
func errName(err error) string {
	switch {
	case err == nil:
		return "ok"
	case errors.Is(err, verbs.ErrStaleKey):
		return "stale"
	case errors.Is(err, verbs.ErrInvalidKey):
		return "invalid"
	case errors.Is(err, verbs.ErrLocalProtection):
		return "protection"
	case errors.Is(err, verbs.ErrLocalAccess):
		return "access"
	case errors.Is(err, verbs.ErrBadRange):
		return "wraps"
	case errors.Is(err, verbs.ErrLength):
		return "length"
	case errors.Is(err, verbs.ErrFault):
		return "fault"
	case errors.Is(err, verbs.ErrClosed):
		return "closed"
	}
	return "other: " + err.Error()
}
