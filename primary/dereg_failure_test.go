package primary_test

import (
	"errors"
	"log/slog"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/cache"
	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/primary"
	"github.com/mpmr/mpmr/shm"
	"github.com/mpmr/mpmr/verbs"
)

// failingDeregDevice is the soft device with a deregistration that fails
// for one key while fail is set (a hardware dereg_mr refused while a
// memory window is bound, say).
type failingDeregDevice struct {
	*verbs.Soft
	key  atomic.Uint32
	fail atomic.Bool
}

type failingDeregPD struct {
	verbs.PD
	d *failingDeregDevice
}

func (d *failingDeregDevice) AllocPD() (verbs.PD, error) {
	pd, err := d.Soft.AllocPD()
	if err != nil {
		return nil, err
	}
	return failingDeregPD{PD: pd, d: d}, nil
}

var errDeregBusy = errors.New("dereg_mr: busy")

func (p failingDeregPD) DeregMR(mr verbs.MR) error {
	if p.d.fail.Load() && mr.LKey == p.d.key.Load() {
		return errDeregBusy
	}
	return p.PD.DeregMR(mr)
}

// startFailingDeregPrimary starts a single-page primary whose device is a
// failingDeregDevice.
func startFailingDeregPrimary(t *testing.T) (*primary.Primary, *failingDeregDevice) {
	t.Helper()
	var dev *failingDeregDevice
	p, _ := startPrimary(t, testenv.Tmpfs(t), func(c *primary.Config) {
		c.SinglePage = true
		primary.WithDeviceOpener(c, func(seg *shm.Segment, log *slog.Logger) (verbs.Device, error) {
			soft, err := verbs.CreateSoft(seg, verbs.SoftOptions{Logger: log})
			dev = &failingDeregDevice{Soft: soft}
			return dev, err
		})
	})
	return p, dev
}

// A free whose MR the device will not deregister is refused, and asked
// again it is refused again for as long as the device refuses: the MR's
// record is kept until its key is gone, so no retry can complete while
// the device still accepts the key for the pages. Once the device lets
// go, the retry completes.
func TestFreeRefusedWhileTheDeviceKeepsTheKey(t *testing.T) {
	p, dev := startFailingDeregPrimary(t)
	r, err := p.Alloc(p.Backend().PageSize)
	require.NoError(t, err)
	q := p.NewQueue()
	key, err := q.Lookup(r.Addr)
	require.NoError(t, err)
	dev.key.Store(key)
	dev.fail.Store(true)
	valid := func() error {
		return dev.Soft.Validate(verbs.SGE{Addr: r.Addr, Len: 1, Key: key}, verbs.AccessLocalWrite)
	}

	for try := range 3 {
		err := p.Free(r)
		require.ErrorIs(t, err, hugetlb.ErrNotFreed, "try %d: the device keeps the key: the free is refused", try)
		assert.ErrorIs(t, err, errDeregBusy, "try %d: and says why", try)
		require.NoError(t, valid(), "try %d: the memory is still there, and so is its key", try)
	}

	dev.fail.Store(false)
	require.NoError(t, p.Free(r), "the device lets go: the free completes")
	assert.Error(t, valid(), "the key is gone with the memory")
	_, err = q.Lookup(r.Addr)
	assert.ErrorIs(t, err, cache.ErrNoMemory, "and nothing serves a key for it")
}

// An MR the device keeps refuses the free of its own memory, and only
// that one: other memory is freed meanwhile, and so is it once the device
// lets go.
func TestAnMRTheDeviceKeepsRefusesOnlyItsOwnFree(t *testing.T) {
	p, dev := startFailingDeregPrimary(t)
	ps := p.Backend().PageSize
	stuck, err := p.Alloc(ps)
	require.NoError(t, err)
	other, err := p.Alloc(ps)
	require.NoError(t, err)
	q := p.NewQueue()
	key, err := q.Lookup(stuck.Addr)
	require.NoError(t, err)
	otherKey, err := q.Lookup(other.Addr)
	require.NoError(t, err)
	dev.key.Store(key)
	dev.fail.Store(true)

	require.ErrorIs(t, p.Free(stuck), hugetlb.ErrNotFreed, "the device keeps the key: its free is refused")
	require.NoError(t, p.Free(other), "a free of other memory is not refused for it")
	assert.Error(t, dev.Soft.Validate(verbs.SGE{Addr: other.Addr, Len: 1, Key: otherKey}, verbs.AccessLocalWrite),
		"the other memory's key is gone with it")
	require.NoError(t, dev.Soft.Validate(verbs.SGE{Addr: stuck.Addr, Len: 1, Key: key}, verbs.AccessLocalWrite),
		"the kept memory is still there, and so is its key")
	again, err := p.Alloc(ps)
	require.NoError(t, err)
	_, err = q.Lookup(again.Addr)
	require.NoError(t, err, "memory allocated meanwhile is registered")
	require.NoError(t, p.Free(again), "and freed")

	dev.fail.Store(false)
	require.NoError(t, p.Free(stuck), "the device lets go: the free completes")
}
