package verbs_test

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/internal/sys/vm"
	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/shm"
	"github.com/mpmr/mpmr/verbs"
)

func init() {
	testproc.Register("secondary", helperSecondary)
}

// newSharedBuffer is a buffer at a fixed address in the hole between the
// heap and the mmap area, far from where either process maps anything of
// its own, so that a helper can map it at the same address.
func newSharedBuffer(t *testing.T, size uintptr) *buffer {
	t.Helper()
	path := newFile(t, size)
	base := uintptr(0x2000_0000_0000) + uintptr(os.Getpid()%4096)<<30
	for try := uintptr(0); try < 64; try++ {
		addr := base + try<<30
		if err := mapAt(path, addr, size); err == nil {
			t.Cleanup(func() { vm.Unmap(addr, size) })
			return &buffer{addr: addr, size: size, path: path}
		} else if !errors.Is(err, vm.ErrRangeTaken) {
			require.NoError(t, err)
		}
	}
	t.Fatalf("no free address range for a %d-byte shared buffer near 0x%x", size, base)
	return nil
}

// helperSecondary attaches to the segment and maps the data file at the
// primary's address, then answers commands:
//
//	validate ADDR LEN KEY ACCESS          -> result NAME
//	copy DADDR DLEN DKEY SADDR SLEN SKEY  -> result NAME
//	stats                                 -> stats REG DEREG LIVE PINNED UNPINNED
//	mrs                                   -> mrs COUNT
func helperSecondary(args []string) int {
	fail := func(err error) int {
		fmt.Fprintln(os.Stderr, err)
		return 3
	}
	seg, err := shm.Attach(segOptions(args[0]))
	if err != nil {
		return fail(err)
	}
	defer seg.Close()
	d, err := verbs.AttachSoft(seg)
	if err != nil {
		return fail(err)
	}
	defer d.Close()
	addr, _ := strconv.ParseUint(args[2], 0, 64)
	size, _ := strconv.ParseUint(args[3], 0, 64)
	if err := mapAt(args[1], uintptr(addr), uintptr(size)); err != nil {
		return fail(err)
	}
	testproc.Say("ready")
	in := testproc.Commands()
	for in.Scan() {
		f := strings.Fields(in.Text())
		n := make([]uint64, len(f))
		for i := 1; i < len(f); i++ {
			n[i], _ = strconv.ParseUint(f[i], 0, 64)
		}
		switch f[0] {
		case "validate":
			err := d.Validate(verbs.SGE{Addr: uintptr(n[1]), Len: uint32(n[2]), Key: uint32(n[3])}, verbs.Access(n[4]))
			testproc.Say("result %s", errName(err))
		case "copy":
			err := d.Copy(verbs.SGE{Addr: uintptr(n[1]), Len: uint32(n[2]), Key: uint32(n[3])},
				verbs.SGE{Addr: uintptr(n[4]), Len: uint32(n[5]), Key: uint32(n[6])})
			testproc.Say("result %s", errName(err))
		case "stats":
			st := d.Stats()
			testproc.Say("stats %d %d %d %d %d", st.Registrations, st.Deregistrations, st.LiveMRs, st.PinnedBytes, st.UnpinnedMRs)
		case "mrs":
			testproc.Say("mrs %d", len(d.MRs()))
		}
	}
	return 0
}

func startSecondary(t *testing.T, o shm.Options, buf *buffer) *testproc.Proc {
	t.Helper()
	p := testproc.Start(t, "secondary", []string{o.Path, buf.path,
		fmt.Sprintf("0x%x", buf.addr), fmt.Sprintf("0x%x", buf.size)})
	p.Expect("ready", 0)
	return p
}

func validateIn(p *testproc.Proc, sge verbs.SGE, access verbs.Access) string {
	p.Send("validate 0x%x %d 0x%x %d", sge.Addr, sge.Len, sge.Key, access)
	return strings.TrimPrefix(p.Expect("result ", 0), "result ")
}

func TestSecondaryValidatesPrimaryKeys(t *testing.T) {
	// One slot, so the next registration reuses the deregistered MR's slot.
	d, pd, o := newSoft(t, 1)
	buf := newSharedBuffer(t, 4*vm.PageSize)
	mr, err := pd.RegMR(buf.addr, buf.size, verbs.AccessLocalWrite)
	require.NoError(t, err)
	p := startSecondary(t, o, buf)

	whole := verbs.SGE{Addr: mr.Addr, Len: uint32(mr.Len), Key: mr.LKey}
	assert.Equal(t, "ok", validateIn(p, whole, verbs.AccessLocalWrite))
	assert.Equal(t, "protection", validateIn(p, verbs.SGE{Addr: mr.Addr + 8, Len: uint32(mr.Len), Key: mr.LKey}, 0))
	assert.Equal(t, "access", validateIn(p, whole, verbs.AccessRemoteRead))

	// A loopback DMA in the secondary lands in memory the primary sees.
	data := buf.bytes()
	copy(data, "written by the primary")
	p.Send("copy 0x%x 64 0x%x 0x%x 22 0x%x", buf.page(2), mr.LKey, buf.addr, mr.LKey)
	require.Equal(t, "result ok", p.Expect("result ", 0))
	assert.Equal(t, "written by the primary", string(data[2*vm.PageSize:2*vm.PageSize+22]))

	// Deregistration is seen by the secondary's very next validation.
	require.NoError(t, pd.DeregMR(mr))
	assert.Equal(t, "stale", validateIn(p, whole, 0))
	next, err := pd.RegMR(buf.addr, buf.size, verbs.AccessLocalWrite)
	require.NoError(t, err)
	require.Equal(t, mr.Handle, next.Handle, "the slot is reused")
	assert.Equal(t, "stale", validateIn(p, whole, 0), "the old key stays dead in its reused slot")
	assert.Equal(t, "ok", validateIn(p, verbs.SGE{Addr: buf.addr, Len: 8, Key: next.LKey}, verbs.AccessLocalWrite))
	require.NoError(t, d.Close())
	assert.Equal(t, "stale", validateIn(p, verbs.SGE{Addr: buf.addr, Len: 8, Key: next.LKey}, 0), "closing deregisters")
}

func TestStatsAreShared(t *testing.T) {
	d, pd, o := newSoft(t, 16)
	buf := newSharedBuffer(t, 8*vm.PageSize)
	view := attachSoft(t, o)
	p := startSecondary(t, o, buf)

	stats := func() string {
		st := d.Stats()
		return fmt.Sprintf("stats %d %d %d %d %d", st.Registrations, st.Deregistrations, st.LiveMRs, st.PinnedBytes, st.UnpinnedMRs)
	}
	p.Send("stats")
	assert.Equal(t, "stats 0 0 0 0 0", p.Expect("stats ", 0))

	var mrs []verbs.MR
	for i := range 5 {
		mr, err := pd.RegMR(buf.page(i), vm.PageSize+uintptr(i), 0)
		require.NoError(t, err)
		mrs = append(mrs, mr)
	}
	require.NoError(t, pd.DeregMR(mrs[1]))
	require.NoError(t, pd.DeregMR(mrs[3]))

	st := d.Stats()
	assert.Equal(t, uint64(5), st.Registrations)
	assert.Equal(t, uint64(2), st.Deregistrations)
	assert.Equal(t, uint64(3), st.LiveMRs)
	assert.Equal(t, 16, st.MaxMRs)
	// Five pages are within even a small RLIMIT_MEMLOCK.
	assert.Equal(t, uint64(mrs[0].Len+mrs[2].Len+mrs[4].Len), st.PinnedBytes, "pinned bytes: the live MRs' lengths")
	assert.Zero(t, st.UnpinnedMRs)
	assert.Equal(t, st, view.Stats(), "another Soft of this process reads the same counters")
	p.Send("stats")
	assert.Equal(t, stats(), p.Expect("stats ", 0), "so does another process")
	p.Send("mrs")
	assert.Equal(t, "mrs 3", p.Expect("mrs ", 0))
	assert.ElementsMatch(t, []verbs.MR{mrs[0], mrs[2], mrs[4]}, view.MRs())
}
