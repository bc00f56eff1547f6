package verbs_test

import (
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/internal/sys/vm"
	"github.com/mpmr/mpmr/verbs"
)

// model is what the soft device must behave like: a set of live MRs by
// key and the keys that have been deregistered.
type model struct {
	maxMRs int
	live   map[uint32]verbs.MR
	dead   map[uint32]bool
	uses   map[uint32]int // registrations per slot
	regs   uint64
	deregs uint64
	pinned uint64
}

func newModel(maxMRs int) *model {
	return &model{maxMRs: maxMRs, live: map[uint32]verbs.MR{}, dead: map[uint32]bool{}, uses: map[uint32]int{}}
}

// reg records a registration; it reports false if the device handed out
// a deregistered key before the slot's variants went round.
func (m *model) reg(mr verbs.MR) bool {
	m.uses[mr.Handle]++
	ok := !m.dead[mr.LKey] || m.uses[mr.Handle] > 255
	m.live[mr.LKey] = mr
	delete(m.dead, mr.LKey) // a variant that came round again
	m.regs++
	m.pinned += uint64(mr.Len)
	return ok
}

func (m *model) dereg(mr verbs.MR) {
	delete(m.live, mr.LKey)
	m.dead[mr.LKey] = true
	m.deregs++
	m.pinned -= uint64(mr.Len)
}

// want is the name of the error Validate must give.
func (m *model) want(sge verbs.SGE, access verbs.Access) string {
	switch {
	case sge.Len == 0:
		return "length"
	case uint64(sge.Addr)+uint64(sge.Len) < uint64(sge.Addr):
		return "wraps"
	}
	mr, ok := m.live[sge.Key]
	switch {
	case !ok && m.dead[sge.Key]:
		return "stale"
	case !ok:
		return "invalid or stale"
	case sge.Addr < mr.Addr || uint64(sge.Addr)+uint64(sge.Len) > uint64(mr.End()):
		return "protection"
	case mr.Access&access&^verbs.AccessRelaxedOrdering != access&^verbs.AccessRelaxedOrdering:
		return "access"
	}
	return "ok"
}

func checkAgainst(t *testing.T, m *model, sge verbs.SGE, access verbs.Access, got error) {
	t.Helper()
	want, name := m.want(sge, access), errName(got)
	if want == "invalid or stale" {
		require.ErrorIs(t, got, verbs.ErrInvalidKey, "sge %v access %v", sge, access)
		return
	}
	require.Equal(t, want, name, "sge %v access %v: %v", sge, access, got)
}

// randomSGE aims at an MR of the model (live or dead) most of the time,
// near its edges, with lengths that sometimes run over.
func randomSGE(rng *rand.Rand, m *model, buf *buffer, keys []uint32) verbs.SGE {
	var sge verbs.SGE
	switch k := rng.IntN(10); {
	case k == 0:
		sge.Key = rng.Uint32()
	case k == 1 || len(keys) == 0:
		sge.Key = uint32(rng.IntN(m.maxMRs+2))<<8 | uint32(rng.IntN(256))
	default:
		sge.Key = keys[rng.IntN(len(keys))]
	}
	base, size := buf.addr, buf.size
	if mr, ok := m.live[sge.Key]; ok {
		base, size = mr.Addr, mr.Len
	}
	sge.Addr = base + uintptr(rng.IntN(int(size)+64)) - 32
	sge.Len = uint32(rng.IntN(int(size) + 64))
	if rng.IntN(50) == 0 {
		sge.Addr = ^uintptr(0) - uintptr(rng.IntN(100))
	}
	return sge
}

func randomAccess(rng *rand.Rand) verbs.Access {
	a := verbs.Access(rng.IntN(16))
	if a&verbs.AccessRemoteWrite != 0 {
		a |= verbs.AccessLocalWrite // what RegMR insists on
	}
	return a
}

func TestRandomOperationsAgainstModel(t *testing.T) {
	const maxMRs = 16
	d, pd, o := newSoft(t, maxMRs)
	view := attachSoft(t, o)
	buf := newBuffer(t, 16*vm.PageSize)
	m := newModel(maxMRs)
	rng := rand.New(rand.NewPCG(4, 2))
	var keys []uint32 // every key ever handed out

	for step := range 5000 {
		switch op := rng.IntN(10); {
		case op < 3:
			off := uintptr(rng.IntN(int(buf.size) - 1))
			length := 1 + uintptr(rng.IntN(int(buf.size-off)))
			access := randomAccess(rng)
			mr, err := pd.RegMR(buf.addr+off, length, access)
			if len(m.live) == maxMRs {
				require.ErrorIs(t, err, verbs.ErrNoResources, "step %d", step)
				continue
			}
			require.NoError(t, err, "step %d", step)
			require.NotContains(t, m.live, mr.LKey, "a live key handed out twice")
			require.Equal(t, verbs.MR{Addr: buf.addr + off, Len: length, LKey: mr.LKey, RKey: mr.LKey,
				Handle: mr.LKey >> 8, Access: access}, mr)
			require.True(t, m.reg(mr), "step %d: deregistered key 0x%x handed out again", step, mr.LKey)
			keys = append(keys, mr.LKey)
		case op < 5 && len(m.live) > 0:
			var victim verbs.MR
			i := rng.IntN(len(m.live))
			for _, mr := range m.live {
				if i == 0 {
					victim = mr
					break
				}
				i--
			}
			require.NoError(t, pd.DeregMR(victim), "step %d", step)
			m.dereg(victim)
		default:
			// Validate from both the owner and another Soft.
			for range 4 {
				sge, access := randomSGE(rng, m, buf, keys), randomAccess(rng)
				checkAgainst(t, m, sge, access, d.Validate(sge, access))
				checkAgainst(t, m, sge, access, view.Validate(sge, access))
			}
		}
		if step%250 == 0 {
			st := view.Stats()
			require.Equal(t, m.regs, st.Registrations)
			require.Equal(t, m.deregs, st.Deregistrations)
			require.Equal(t, uint64(len(m.live)), st.LiveMRs)
			require.Equal(t, m.pinned, st.PinnedBytes)
			live := make([]verbs.MR, 0, len(m.live))
			for _, mr := range m.live {
				live = append(live, mr)
			}
			require.ElementsMatch(t, live, view.MRs())
		}
	}
	require.Greater(t, m.deregs, uint64(500), "the sequence exercised slot reuse")
}

// FuzzValidate checks arbitrary elements against the model of a fixed set
// of MRs, one of them deregistered.
func FuzzValidate(f *testing.F) {
	const maxMRs = 8
	d, pd, _ := newSoft(f, maxMRs)
	buf := newBuffer(f, 4*vm.PageSize)
	m := newModel(maxMRs)
	for i, a := range []verbs.Access{verbs.AccessLocalWrite, 0, verbs.AccessLocalWrite | verbs.AccessRemoteWrite} {
		mr, err := pd.RegMR(buf.page(i)+uintptr(i*100), vm.PageSize, a)
		require.NoError(f, err)
		require.True(f, m.reg(mr))
		if i == 1 {
			require.NoError(f, pd.DeregMR(mr))
			m.dereg(mr)
		}
	}
	f.Add(uint64(buf.addr), uint32(64), uint32(1), uint32(0))
	f.Add(uint64(buf.page(1)+100), uint32(4096), uint32(1<<8|1), uint32(1))
	f.Add(uint64(buf.page(2)+200), uint32(4000), uint32(2<<8|1), uint32(4))
	f.Add(^uint64(0)-5, uint32(10), uint32(1), uint32(0))
	f.Add(uint64(buf.addr), uint32(0), verbs.InvalidKey, uint32(0))
	f.Fuzz(func(t *testing.T, addr uint64, length, key, access uint32) {
		sge := verbs.SGE{Addr: uintptr(addr), Len: length, Key: key}
		checkAgainst(t, m, sge, verbs.Access(access), d.Validate(sge, verbs.Access(access)))
	})
}
