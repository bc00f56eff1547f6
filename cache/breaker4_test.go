package cache

import (
	"errors"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/shm"
	"github.com/mpmr/mpmr/verbs"
)

var errB4DeregBusy = errors.New("dereg_mr: busy")

// b4PD is the soft device's PD with a deregistration that fails for one
// key while fail is set (a hardware dereg_mr refused while a memory window
// is bound, say). Like rdma-core's, it cannot trim an MR: an MR keeps its
// pages on the device until it is deregistered.
type b4PD struct {
	verbs.PD
	key  atomic.Uint32
	fail atomic.Bool
	// onFail, if set, runs (once) when the deregistration fails.
	onFail func()
	once   sync.Once
}

func (p *b4PD) DeregMR(mr verbs.MR) error {
	if p.fail.Load() && mr.LKey == p.key.Load() {
		if p.onFail != nil {
			p.once.Do(p.onFail)
		}
		return errB4DeregBusy
	}
	return p.PD.DeregMR(mr)
}

// b4Primary is newPrimary with b4PD as the global cache's PD.
func b4Primary(t *testing.T, pages int, lockTimeout time.Duration) (*primary, *b4PD) {
	t.Helper()
	backend := testenv.Tmpfs(t)
	name := testenv.Name(t)
	o := shm.Options{Path: filepath.Join(backend.Dir, "mpmr."+name+".ctl"), LayoutTag: layoutTag,
		Slots: 16, Role: shm.RolePrimary, Logger: quiet}
	seg, err := shm.Create(o)
	require.NoError(t, err)
	p := &primary{seg: seg, opts: o, name: name}
	t.Cleanup(func() { p.close(t) })
	p.mem, err = hugetlb.Create(seg, hugetlb.Config{Prefix: name, Backend: backend,
		Lists: []hugetlb.ListConfig{{Pages: pages}}, Logger: quiet})
	require.NoError(t, err)
	p.dev, err = verbs.CreateSoft(seg, verbs.SoftOptions{Logger: quiet})
	require.NoError(t, err)
	soft, err := p.dev.AllocPD()
	require.NoError(t, err)
	pd := &b4PD{PD: soft}
	t.Cleanup(func() { pd.fail.Store(false) }) // before p.close: the device lets go at the end
	p.g, err = CreateGlobal(seg, GlobalConfig{Memory: p.mem, PD: pd, SinglePage: true,
		LockTimeout: lockTimeout, Logger: quiet})
	require.NoError(t, err)
	require.NoError(t, seg.MarkReady())
	return p, pd
}

// Close "releases every MR (deregistering them)". When the device refuses
// to deregister one, Collect keeps its record (so that frees stay refused
// while the key lives) and reports the failure — but Close sweeps the list
// with GC, which only logs, and returns nil: the caller (Primary.Close
// among them) is told every MR is gone while the device still accepts the
// key. The free guard of the runtime (Collect) keeps refusing the free
// afterwards, which holds.
func TestBreaker4GlobalCloseHidesAnMRTheDeviceKept(t *testing.T) {
	p, pd := b4Primary(t, 8, 0)
	// The primary's second free guard, as the runtime installs it.
	defer p.mem.GuardFree(func(hugetlb.Event) error { _, err := p.g.Collect(); return err })()
	r := p.alloc(t, 1)
	l := NewLocal(p.g, p.g, 0)
	key, err := l.Lookup(r.Addr)
	require.NoError(t, err)
	pd.key.Store(key)
	pd.fail.Store(true)

	// While the Global is open the free is refused, as it should be.
	require.ErrorIs(t, p.mem.Free(r), hugetlb.ErrNotFreed, "the device keeps the key: the free is refused")
	require.NoError(t, p.validates(r.Addr, key), "the page and its key are still there")

	closeErr := p.g.Close()
	assert.ErrorIs(t, closeErr, errB4DeregBusy,
		"Close could not deregister an MR (the device still accepts its key) and must say so")

	freeErr := p.mem.Free(r)
	stillValid := p.validates(r.Addr, key) == nil
	assert.False(t, freeErr == nil && stillValid,
		"after Close the free completed while the device still accepts key 0x%x over the freed page", key)
}

// Collect keeps a record whose deregistration failed by pushing it back on
// the free list — under the write lock, taken a second time after the
// deregistrations. If that lock cannot be had then (a reader holds it
// past the lock timeout), the kept records are dropped on the floor: on
// neither list, never tried again. The free that was refused is asked
// again, finds nothing to invalidate and nothing to collect, and
// completes — with the device still accepting the MR's key over the
// freed page, which is what keeping the records was for.
func TestBreaker4CollectLosesKeptRecordsWhenTheLockIsBusy(t *testing.T) {
	// The lock timeout is below the readers' lease (shm.DefaultFenceAfter),
	// so a live reader makes a writer's lock fail instead of being fenced.
	p, pd := b4Primary(t, 8, 20*time.Millisecond)
	defer p.mem.GuardFree(func(hugetlb.Event) error { _, err := p.g.Collect(); return err })()
	view := p.attachView(t)
	r := p.alloc(t, 1)
	l := NewLocal(p.g, p.g, 0)
	key, err := l.Lookup(r.Addr)
	require.NoError(t, err)

	// While the device refuses the deregistration, another process reads
	// the global cache, holding its read lock for a moment.
	release := make(chan struct{})
	reading := make(chan struct{})
	readDone := make(chan error, 1)
	pd.onFail = func() {
		go func() {
			readDone <- view.Shared(func() {
				close(reading)
				<-release
			})
		}()
		<-reading
	}
	pd.key.Store(key)
	pd.fail.Store(true)

	err = p.mem.Free(r)
	require.ErrorIs(t, err, hugetlb.ErrNotFreed, "the device keeps the key: the free is refused")
	close(release)
	<-readDone // fenced or not, the reader is done
	require.NoError(t, p.validates(r.Addr, key), "the page and its key are still there")

	// The device still refuses. Asked again, the free must be refused
	// again for as long as the device keeps the key.
	err = p.mem.Free(r)
	stillValid := p.validates(r.Addr, key) == nil
	assert.False(t, err == nil && stillValid,
		"the retried free completed while the device still accepts key 0x%x over the freed page", key)
	st := p.g.Stats()
	t.Logf("free list %d, MRs %d", st.FreeMRs, st.MRs)
}
