package verbs_test

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/mpmr/mpmr/internal/sys/vm"
	"github.com/mpmr/mpmr/internal/test/harness"
	"github.com/mpmr/mpmr/shm"
	"github.com/mpmr/mpmr/verbs"
)

func TestSlotReuseChangesKey(t *testing.T) {
	d, pd, _ := newSoft(t, 1)
	buf := newBuffer(t, vm.PageSize)

	first, err := pd.RegMR(buf.addr, buf.size, verbs.AccessLocalWrite)
	require.NoError(t, err)
	require.NoError(t, pd.DeregMR(first))
	prev := first
	seen := map[uint32]bool{first.LKey: true}
	// Go round the variants more than once: every reuse of the one slot
	// changes the key, and the previous key never validates again.
	for i := range 600 {
		mr, err := pd.RegMR(buf.addr, buf.size, verbs.AccessLocalWrite)
		require.NoError(t, err)
		require.Equal(t, first.Handle, mr.Handle, "one slot, reused")
		require.Equal(t, first.LKey>>8, mr.LKey>>8, "same index")
		require.NotEqual(t, prev.LKey, mr.LKey, "reuse %d kept the key", i)
		require.NotZero(t, mr.LKey)
		require.NotEqual(t, verbs.InvalidKey, mr.LKey)
		require.Equal(t, mr.LKey, mr.RKey)
		if i < 254 {
			require.False(t, seen[mr.LKey], "variant repeated before the 255th reuse")
		}
		seen[mr.LKey] = true
		sge := verbs.SGE{Addr: buf.addr, Len: 8, Key: prev.LKey}
		require.ErrorIs(t, d.Validate(sge, 0), verbs.ErrStaleKey, "old key 0x%x", prev.LKey)
		sge.Key = mr.LKey
		require.NoError(t, d.Validate(sge, verbs.AccessLocalWrite))
		require.NoError(t, pd.DeregMR(mr))
		prev = mr
	}
	assert.Len(t, seen, 255, "variants 1..255")
}

// TestValidateDuringChurn validates while the owner keeps re-registering
// one slot over three pages: a validation must never pair a key with
// another registration's range (a torn read of the slot). The u-th
// registration covers page u%3; as 3 divides the 255 variants, a key
// covers the same page every time it comes round. The validators also
// guess the key of the registration to come, so that they read the slot
// while it is being written.
func TestValidateDuringChurn(t *testing.T) {
	d, pd, o := newSoft(t, 1)
	view := attachSoft(t, o)
	buf := newBuffer(t, 3*vm.PageSize)
	pageOf := func(key uint32) uintptr { return buf.page(int(key&0xff) % 3) }
	mr, err := pd.RegMR(buf.page(1), vm.PageSize, 0)
	require.NoError(t, err)
	require.Equal(t, pageOf(mr.LKey), mr.Addr)
	var current atomic.Uint32
	current.Store(mr.LKey)

	var done atomic.Bool
	var wg sync.WaitGroup
	var valid, stale atomic.Int64
	for _, v := range []*verbs.Soft{d, view} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for !done.Load() {
				key := current.Load()
				next := key&^0xff | (key&0xff)%255 + 1
				for _, k := range []uint32{key, next} {
					page := pageOf(k)
					switch err := v.Validate(verbs.SGE{Addr: page + 8, Len: 64, Key: k}, 0); {
					case err == nil:
						valid.Add(1)
					case errors.Is(err, verbs.ErrStaleKey) || k == next && errors.Is(err, verbs.ErrInvalidKey):
						stale.Add(1)
					default:
						t.Errorf("key 0x%x inside its own MR: %v", k, err)
						return
					}
					other := buf.addr + (page-buf.addr+vm.PageSize)%(3*vm.PageSize)
					if err := v.Validate(verbs.SGE{Addr: other + 8, Len: 64, Key: k}, 0); err == nil {
						t.Errorf("key 0x%x validated for another registration's page", k)
						return
					}
				}
			}
		}()
	}
	for u := 2; u < 6000; u++ {
		require.NoError(t, pd.DeregMR(mr))
		mr, err = pd.RegMR(buf.page(u%3), vm.PageSize, 0)
		require.NoError(t, err)
		require.Equal(t, pageOf(mr.LKey), mr.Addr)
		current.Store(mr.LKey)
	}
	done.Store(true)
	wg.Wait()
	assert.NotZero(t, valid.Load())
	t.Logf("%d validations succeeded, %d saw a stale key", valid.Load(), stale.Load())
}

func TestFreeSlotsAreReusedOldestFirst(t *testing.T) {
	_, pd, _ := newSoft(t, 3)
	buf := newBuffer(t, vm.PageSize)
	var mrs []verbs.MR
	for range 3 {
		mr, err := pd.RegMR(buf.addr, buf.size, 0)
		require.NoError(t, err)
		mrs = append(mrs, mr)
	}
	require.NoError(t, pd.DeregMR(mrs[1]))
	require.NoError(t, pd.DeregMR(mrs[0]))
	next, err := pd.RegMR(buf.addr, buf.size, 0)
	require.NoError(t, err)
	assert.Equal(t, mrs[1].Handle, next.Handle, "the slot freed first is reused first")
}

func TestKeyByteOrder(t *testing.T) {
	for _, k := range []uint32{0x12345678, 0x100, 1, verbs.InvalidKey} {
		var b [4]byte
		binary.NativeEndian.PutUint32(b[:], verbs.KeyToBE(k))
		assert.Equal(t, k, binary.BigEndian.Uint32(b[:]), "KeyToBE(0x%x) lays the key out big-endian", k)
		assert.Equal(t, k, verbs.KeyFromBE(verbs.KeyToBE(k)))
	}
	assert.Equal(t, verbs.InvalidKey, verbs.KeyToBE(verbs.InvalidKey))
}

func TestValidate(t *testing.T) {
	d, pd, _ := newSoft(t, 8)
	buf := newBuffer(t, 4*vm.PageSize)
	rw, err := pd.RegMR(buf.addr+100, 1000, verbs.AccessLocalWrite|verbs.AccessRemoteRead)
	require.NoError(t, err)
	ro, err := pd.RegMR(buf.page(1), vm.PageSize, 0)
	require.NoError(t, err)
	gone, err := pd.RegMR(buf.page(2), vm.PageSize, verbs.AccessLocalWrite)
	require.NoError(t, err)
	require.NoError(t, pd.DeregMR(gone))
	neverUsed := uint32(7)<<8 | 5 // slot 7 handed out nothing yet

	tests := []struct {
		name   string
		sge    verbs.SGE
		access verbs.Access
		want   string
	}{
		{"inside", verbs.SGE{Addr: rw.Addr + 10, Len: 100, Key: rw.LKey}, 0, "ok"},
		{"whole MR for writing", verbs.SGE{Addr: rw.Addr, Len: 1000, Key: rw.LKey}, verbs.AccessLocalWrite, "ok"},
		{"relaxed ordering is no right", verbs.SGE{Addr: ro.Addr, Len: 1, Key: ro.LKey}, verbs.AccessRelaxedOrdering, "ok"},
		{"granted remote read", verbs.SGE{Addr: rw.Addr, Len: 8, Key: rw.LKey}, verbs.AccessRemoteRead, "ok"},
		{"past the end", verbs.SGE{Addr: rw.Addr + 990, Len: 11, Key: rw.LKey}, 0, "protection"},
		{"before the start", verbs.SGE{Addr: rw.Addr - 1, Len: 8, Key: rw.LKey}, 0, "protection"},
		{"another MR's memory", verbs.SGE{Addr: ro.Addr, Len: 8, Key: rw.LKey}, 0, "protection"},
		{"write to read-only", verbs.SGE{Addr: ro.Addr, Len: 8, Key: ro.LKey}, verbs.AccessLocalWrite, "access"},
		{"remote write not granted", verbs.SGE{Addr: rw.Addr, Len: 8, Key: rw.LKey}, verbs.AccessRemoteWrite, "access"},
		{"zero length", verbs.SGE{Addr: rw.Addr, Len: 0, Key: rw.LKey}, 0, "length"},
		{"addr+len wraps", verbs.SGE{Addr: ^uintptr(0) - 10, Len: 100, Key: rw.LKey}, 0, "wraps"},
		{"invalid key", verbs.SGE{Addr: rw.Addr, Len: 8, Key: verbs.InvalidKey}, 0, "invalid"},
		{"key 0", verbs.SGE{Addr: rw.Addr, Len: 8, Key: 0}, 0, "invalid"},
		{"index past the table", verbs.SGE{Addr: rw.Addr, Len: 8, Key: 8<<8 | 1}, 0, "invalid"},
		{"variant never handed out", verbs.SGE{Addr: rw.Addr, Len: 8, Key: neverUsed}, 0, "invalid"},
		{"deregistered key", verbs.SGE{Addr: gone.Addr, Len: 8, Key: gone.LKey}, 0, "stale"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err := d.Validate(tc.sge, tc.access)
			assert.Equal(t, tc.want, errName(err), "%v", err)
		})
	}
	// Only the deregistered key is stale; every key error is ErrInvalidKey.
	assert.NotErrorIs(t, d.Validate(verbs.SGE{Addr: rw.Addr, Len: 8, Key: neverUsed}, 0), verbs.ErrStaleKey)
	assert.ErrorIs(t, d.Validate(verbs.SGE{Addr: gone.Addr, Len: 8, Key: gone.LKey}, 0), verbs.ErrInvalidKey)
	// Zero length is a length error but no bad range; a wrap is both.
	assert.NotErrorIs(t, d.Validate(verbs.SGE{Addr: rw.Addr, Key: rw.LKey}, 0), verbs.ErrBadRange)
	assert.ErrorIs(t, d.Validate(verbs.SGE{Addr: ^uintptr(0), Len: 2, Key: rw.LKey}, 0), verbs.ErrLength)
}

func TestValidateAllocatesNothing(t *testing.T) {
	d, pd, _ := newSoft(t, 8)
	buf := newBuffer(t, vm.PageSize)
	mr, err := pd.RegMR(buf.addr, buf.size, verbs.AccessLocalWrite)
	require.NoError(t, err)
	ok := verbs.SGE{Addr: buf.addr, Len: 64, Key: mr.LKey}
	bad := verbs.SGE{Addr: buf.addr, Len: 64, Key: mr.LKey + 1}
	var sink error
	assert.Zero(t, testing.AllocsPerRun(1000, func() { sink = d.Validate(ok, verbs.AccessLocalWrite) }))
	assert.Zero(t, testing.AllocsPerRun(1000, func() { sink = d.Validate(bad, 0) }), "failures are pre-allocated")
	_ = sink
}

func TestRegMRRejectsBadMemory(t *testing.T) {
	_, pd, _ := newSoft(t, 8)
	buf := newBuffer(t, 4*vm.PageSize)

	// PROT_NONE: a bare reservation.
	none, err := vm.Reserve(0, 2*vm.PageSize)
	require.NoError(t, err)
	t.Cleanup(func() { vm.Unmap(none, 2*vm.PageSize) })
	// Unmapped: a range that was mapped and is gone.
	gone, err := vm.Reserve(0, vm.PageSize)
	require.NoError(t, err)
	require.NoError(t, vm.Unmap(gone, vm.PageSize))
	// Half: one mapped page, then a reserved one.
	half, err := vm.Reserve(0, 2*vm.PageSize)
	require.NoError(t, err)
	t.Cleanup(func() { vm.Unmap(half, 2*vm.PageSize) })
	f, err := os.OpenFile(newFile(t, vm.PageSize), os.O_RDWR, 0)
	require.NoError(t, err)
	defer f.Close()
	require.NoError(t, vm.MapFile(half, vm.PageSize, int(f.Fd()), 0))

	tests := []struct {
		name         string
		addr, length uintptr
		access       verbs.Access
		want         error
	}{
		{"PROT_NONE range", none, vm.PageSize, 0, verbs.ErrNotMapped},
		{"unmapped range", gone, vm.PageSize, 0, verbs.ErrNotMapped},
		{"runs past the mapping", half + 100, vm.PageSize, 0, verbs.ErrNotMapped},
		{"zero length", buf.addr, 0, 0, verbs.ErrBadRange},
		{"wraps around", ^uintptr(0) - 100, 1000, 0, verbs.ErrBadRange},
		{"remote write without local write", buf.addr, 100, verbs.AccessRemoteWrite, verbs.ErrBadAccess},
		{"unknown access bits", buf.addr, 100, 1 << 9, verbs.ErrBadAccess},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := pd.RegMR(tc.addr, tc.length, tc.access)
			require.ErrorIs(t, err, tc.want)
			if tc.want == verbs.ErrNotMapped {
				assert.ErrorIs(t, err, vm.ErrNotMapped)
				assert.Contains(t, err.Error(), fmt.Sprintf("0x%x", tc.addr), "the error names the range")
			}
		})
	}
}

func TestTableFull(t *testing.T) {
	d, pd, _ := newSoft(t, 2)
	buf := newBuffer(t, vm.PageSize)
	a, err := pd.RegMR(buf.addr, 100, 0)
	require.NoError(t, err)
	_, err = pd.RegMR(buf.addr, 100, 0)
	require.NoError(t, err)
	_, err = pd.RegMR(buf.addr, 100, 0)
	require.ErrorIs(t, err, verbs.ErrNoResources)
	assert.Equal(t, uint64(2), d.Stats().LiveMRs, "a refused registration changes nothing")
	require.NoError(t, pd.DeregMR(a))
	_, err = pd.RegMR(buf.addr, 100, 0)
	assert.NoError(t, err, "a freed slot is usable again")
}

func TestDeregMRChecksItsArgument(t *testing.T) {
	d, pd, _ := newSoft(t, 8)
	other, err := d.AllocPD()
	require.NoError(t, err)
	buf := newBuffer(t, vm.PageSize)
	mr, err := pd.RegMR(buf.addr, 100, 0)
	require.NoError(t, err)

	assert.ErrorIs(t, other.DeregMR(mr), verbs.ErrInvalidKey, "another PD's MR")
	short := mr
	short.Len--
	assert.ErrorIs(t, pd.DeregMR(short), verbs.ErrBadRange, "not the registered range")
	bogus := mr
	bogus.LKey = verbs.InvalidKey
	assert.ErrorIs(t, pd.DeregMR(bogus), verbs.ErrInvalidKey)
	require.NoError(t, pd.DeregMR(mr))
	assert.ErrorIs(t, pd.DeregMR(mr), verbs.ErrStaleKey, "twice")
	assert.Zero(t, d.Stats().LiveMRs)
}

func TestOnlyTheCreatorRegisters(t *testing.T) {
	d, pd, o := newSoft(t, 8)
	buf := newBuffer(t, vm.PageSize)
	mr, err := pd.RegMR(buf.addr, buf.size, verbs.AccessLocalWrite)
	require.NoError(t, err)

	view := attachSoft(t, o)
	assert.False(t, view.Owner())
	vpd, err := view.AllocPD()
	require.NoError(t, err)
	_, err = vpd.RegMR(buf.addr, buf.size, 0)
	assert.ErrorIs(t, err, verbs.ErrPermission)
	assert.ErrorIs(t, vpd.DeregMR(mr), verbs.ErrPermission)
	assert.NoError(t, vpd.Close())
	assert.NoError(t, view.Validate(verbs.SGE{Addr: buf.addr, Len: 8, Key: mr.LKey}, verbs.AccessLocalWrite),
		"the view sees the owner's key")
	assert.NoError(t, d.Validate(verbs.SGE{Addr: buf.addr, Len: 8, Key: mr.LKey}, 0),
		"closing a view's PD touches nothing shared")

	seg, err := shm.Attach(o)
	require.NoError(t, err)
	defer seg.Close()
	_, err = verbs.CreateSoft(seg, verbs.SoftOptions{})
	assert.ErrorIs(t, err, verbs.ErrPermission, "a non-owner cannot create")
}

func TestCreateAndAttachErrors(t *testing.T) {
	seg, o := newSegment(t)
	require.NoError(t, seg.MarkReady())
	other, err := shm.Attach(o)
	require.NoError(t, err)
	defer other.Close()

	_, err = verbs.AttachSoft(other)
	assert.ErrorIs(t, err, verbs.ErrNoDevice, "before the primary creates it")
	_, err = verbs.CreateSoft(seg, verbs.SoftOptions{MaxMRs: verbs.MaxMRsLimit + 1})
	assert.Error(t, err)

	d, err := verbs.CreateSoft(seg, verbs.SoftOptions{MaxMRs: 4, Logger: quiet})
	require.NoError(t, err)
	_, err = verbs.CreateSoft(seg, verbs.SoftOptions{})
	assert.ErrorIs(t, err, verbs.ErrExists)
	view, err := verbs.AttachSoft(other)
	require.NoError(t, err)
	assert.Equal(t, 4, view.MaxMRs())

	require.NoError(t, d.Close())
	require.NoError(t, d.Close(), "Close is idempotent")
	_, err = verbs.AttachSoft(other)
	assert.ErrorIs(t, err, verbs.ErrClosed, "the owner closed it")
}

func TestOpen(t *testing.T) {
	seg, o := newSegment(t)
	dev, err := verbs.Open(verbs.SoftName, verbs.OpenOptions{Segment: seg, Soft: verbs.SoftOptions{MaxMRs: 4}, Logger: quiet})
	require.NoError(t, err)
	t.Cleanup(func() { dev.Close() })
	require.NoError(t, seg.MarkReady())
	assert.Equal(t, "soft", dev.Name())
	assert.True(t, dev.(*verbs.Soft).Owner(), "the segment owner creates the device")

	other, err := shm.Attach(o)
	require.NoError(t, err)
	defer other.Close()
	view, err := verbs.Open(verbs.SoftName, verbs.OpenOptions{Segment: other})
	require.NoError(t, err)
	assert.False(t, view.(*verbs.Soft).Owner(), "any other process attaches")
	assert.Equal(t, 4, view.(*verbs.Soft).MaxMRs())

	_, err = verbs.Open(verbs.SoftName, verbs.OpenOptions{})
	assert.ErrorIs(t, err, verbs.ErrNoDevice, "soft needs a segment")
	_, err = verbs.Open("mpmr_no_such_device", verbs.OpenOptions{})
	assert.ErrorIs(t, err, verbs.ErrNoDevice)
}

func TestCloseInvalidatesEverything(t *testing.T) {
	d, pd, o := newSoft(t, 8)
	view := attachSoft(t, o)
	buf := newBuffer(t, 2*vm.PageSize)
	pd2, err := d.AllocPD()
	require.NoError(t, err)
	a, err := pd.RegMR(buf.addr, vm.PageSize, 0)
	require.NoError(t, err)
	b, err := pd2.RegMR(buf.page(1), vm.PageSize, 0)
	require.NoError(t, err)

	require.NoError(t, pd2.Close())
	require.NoError(t, pd2.Close(), "PD Close is idempotent")
	assert.ErrorIs(t, view.Validate(verbs.SGE{Addr: b.Addr, Len: 8, Key: b.LKey}, 0), verbs.ErrStaleKey,
		"closing a PD deregisters its MRs")
	assert.NoError(t, view.Validate(verbs.SGE{Addr: a.Addr, Len: 8, Key: a.LKey}, 0), "and only its MRs")
	_, err = pd2.RegMR(buf.addr, 8, 0)
	assert.ErrorIs(t, err, verbs.ErrClosed)

	require.NoError(t, d.Close())
	assert.ErrorIs(t, view.Validate(verbs.SGE{Addr: a.Addr, Len: 8, Key: a.LKey}, 0), verbs.ErrStaleKey,
		"closing the device deregisters every MR for every process")
	assert.ErrorIs(t, d.Validate(verbs.SGE{Addr: a.Addr, Len: 8, Key: a.LKey}, 0), verbs.ErrClosed)
	_, err = pd.RegMR(buf.addr, 8, 0)
	assert.ErrorIs(t, err, verbs.ErrClosed)
	_, err = d.AllocPD()
	assert.ErrorIs(t, err, verbs.ErrClosed)
	st := view.Stats()
	assert.Equal(t, uint64(2), st.Deregistrations)
	assert.Zero(t, st.LiveMRs)
	assert.Zero(t, st.PinnedBytes)
	assert.Empty(t, view.MRs())
}

func TestCopy(t *testing.T) {
	d, pd, _ := newSoft(t, 8)
	buf := newBuffer(t, 4*vm.PageSize)
	src, err := pd.RegMR(buf.addr, vm.PageSize, 0)
	require.NoError(t, err)
	dst, err := pd.RegMR(buf.page(1), 2*vm.PageSize, verbs.AccessLocalWrite)
	require.NoError(t, err)
	data := buf.bytes()
	for i := range vm.PageSize {
		data[i] = byte(i * 7)
	}

	require.NoError(t, d.Copy(verbs.SGE{Addr: dst.Addr + 10, Len: 200, Key: dst.LKey},
		verbs.SGE{Addr: src.Addr + 5, Len: 100, Key: src.LKey}))
	off := vm.PageSize + 10
	assert.Equal(t, data[5:105], data[off:off+100])
	assert.Zero(t, data[off+100], "only src.Len bytes are copied")

	err = d.Copy(verbs.SGE{Addr: dst.Addr, Len: 50, Key: dst.LKey}, verbs.SGE{Addr: src.Addr, Len: 100, Key: src.LKey})
	assert.ErrorIs(t, err, verbs.ErrLength, "destination shorter than source")
	err = d.Copy(verbs.SGE{Addr: src.Addr, Len: 100, Key: src.LKey}, verbs.SGE{Addr: dst.Addr, Len: 100, Key: dst.LKey})
	assert.ErrorIs(t, err, verbs.ErrLocalAccess, "writing a read-only MR")
	err = d.Copy(verbs.SGE{Addr: dst.Addr, Len: 100, Key: dst.LKey}, verbs.SGE{Addr: src.Addr + 4000, Len: 200, Key: src.LKey})
	assert.ErrorIs(t, err, verbs.ErrLocalProtection, "source outside its MR")
}

func TestCopyIntoUnmappedMemoryFails(t *testing.T) {
	d, pd, _ := newSoft(t, 8)
	buf := newBuffer(t, 2*vm.PageSize)
	src, err := pd.RegMR(buf.addr, vm.PageSize, 0)
	require.NoError(t, err)
	dst, err := pd.RegMR(buf.page(1), vm.PageSize, verbs.AccessLocalWrite)
	require.NoError(t, err)

	// The destination's memory goes away while its MR stays registered,
	// as when memory is freed before the cache deregisters it.
	require.NoError(t, vm.Release(dst.Addr, vm.PageSize))
	err = d.Copy(verbs.SGE{Addr: dst.Addr, Len: 64, Key: dst.LKey}, verbs.SGE{Addr: src.Addr, Len: 64, Key: src.LKey})
	require.ErrorIs(t, err, verbs.ErrFault)
	assert.Contains(t, err.Error(), fmt.Sprintf("0x%x", dst.Addr), "the error names the faulting address")

	err = d.Copy(verbs.SGE{Addr: src.Addr, Len: 64, Key: src.LKey}, verbs.SGE{Addr: dst.Addr, Len: 64, Key: dst.LKey})
	assert.ErrorIs(t, err, verbs.ErrLocalAccess, "validation still comes first")
	require.NoError(t, pd.DeregMR(dst), "deregistering memory that is gone works")
	require.NoError(t, pd.DeregMR(src))
}

func TestRegMROnHugetlbfs(t *testing.T) {
	d, pd, _ := newSoft(t, 8)
	buf := newHugeBuffer(t)
	mr, err := pd.RegMR(buf.addr, buf.size, verbs.AccessLocalWrite)
	require.NoError(t, err, "mlock is a no-op on hugetlbfs, and no error")
	st := d.Stats()
	assert.Equal(t, uint64(buf.size), st.PinnedBytes, "hugepages are resident: counted as pinned")
	assert.Zero(t, st.UnpinnedMRs)
	src := verbs.SGE{Addr: buf.addr, Len: 16, Key: mr.LKey}
	dst := verbs.SGE{Addr: buf.addr + buf.size - 16, Len: 16, Key: mr.LKey}
	copy(buf.bytes(), "hugepage memory!")
	require.NoError(t, d.Copy(dst, src))
	assert.Equal(t, "hugepage memory!", string(buf.bytes()[buf.size-16:]))
	require.NoError(t, pd.DeregMR(mr))
	assert.Zero(t, d.Stats().PinnedBytes)
}

// A registration writes the owner's record of the slot it takes, and the
// slots are taken in turn around the ring: unless those records were
// backed when the device was made, each first use of one of their pages
// faults. On a virtual machine a fault on a page its host has not backed
// yet costs tens of microseconds, as much as the round trip that asked
// for the registration.
func TestRegistrationsTakeNoPageFaults(t *testing.T) {
	if harness.RaceEnabled {
		t.Skip("the race detector's shadow memory faults in as registrations write")
	}
	_, pd, _ := newSoft(t, 4096)
	buf := newBuffer(t, vm.PageSize)
	runtime.LockOSThread() // the fault counts read are this thread's
	defer runtime.UnlockOSThread()
	faults := func() int64 {
		var ru unix.Rusage
		require.NoError(t, unix.Getrusage(unix.RUSAGE_THREAD, &ru))
		return ru.Minflt + ru.Majflt
	}
	// The first registration faults the buffer in (the check that it is
	// mapped) and may grow this goroutine's stack.
	mr, err := pd.RegMR(buf.addr, buf.size, 0)
	require.NoError(t, err)
	require.NoError(t, pd.DeregMR(mr))
	faulted := 0     // registrations that took a page fault
	for range 4000 { // each in a slot not used before: the ring's head moves on
		before := faults()
		mr, err := pd.RegMR(buf.addr, buf.size, 0)
		if faults() != before {
			faulted++
		}
		require.NoError(t, err)
		require.NoError(t, pd.DeregMR(mr))
	}
	// The owner's records of 4,000 slots span 55 pages, and the pin set's
	// (the buffer is pinned with mlock) 16 more: 63 registrations faulted
	// when they were not backed, some on both. The thread may take a
	// fault of its own meanwhile in one or two of them.
	assert.LessOrEqual(t, faulted, 3, "registrations that faulted, of 4,000, each in a fresh slot")
}
