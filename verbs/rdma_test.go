//go:build rdma

package verbs_test

import (
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/verbs"
)

// rdmaDevice returns the name of the first RDMA device, or skips with the
// reason there is none.
func rdmaDevice(tb testing.TB) string {
	tb.Helper()
	names, err := verbs.RDMADevices()
	if err != nil {
		tb.Skipf("no RDMA device: ibv_get_device_list: %v", err)
	}
	if len(names) == 0 {
		tb.Skip("no RDMA device: ibv_get_device_list returned 0 devices")
	}
	return names[0]
}

func TestRDMAOpenUnknownDevice(t *testing.T) {
	_, err := verbs.Open("mpmr_no_such_device", verbs.OpenOptions{})
	assert.ErrorIs(t, err, verbs.ErrNoDevice)
}

func TestRDMARegDereg(t *testing.T) {
	name := rdmaDevice(t)
	dev, err := verbs.Open(name, verbs.OpenOptions{})
	require.NoError(t, err)
	defer dev.Close()
	assert.Equal(t, name, dev.Name())
	pd, err := dev.AllocPD()
	require.NoError(t, err)
	buf := newBuffer(t, 1<<20)

	mr, err := pd.RegMR(buf.addr, buf.size, verbs.AccessLocalWrite|verbs.AccessRemoteRead)
	require.NoError(t, err)
	assert.Equal(t, buf.addr, mr.Addr)
	assert.Equal(t, buf.size, mr.Len)
	assert.NotEqual(t, verbs.InvalidKey, mr.LKey)
	require.NoError(t, pd.DeregMR(mr))
	assert.ErrorIs(t, pd.DeregMR(mr), verbs.ErrInvalidKey, "twice")

	_, err = pd.RegMR(buf.addr, 0, 0)
	assert.ErrorIs(t, err, verbs.ErrBadRange)
	require.NoError(t, dev.Close())
	require.NoError(t, dev.Close(), "Close is idempotent")
	_, err = pd.RegMR(buf.addr, buf.size, 0)
	assert.ErrorIs(t, err, verbs.ErrClosed)
}

// TestRDMAImport imports the device, PD and an MR through a duplicate of
// the command fd, as a secondary does with the fd it receives.
func TestRDMAImport(t *testing.T) {
	dev, err := verbs.OpenRDMA(rdmaDevice(t))
	require.NoError(t, err)
	defer dev.Close()
	p, err := dev.AllocPD()
	require.NoError(t, err)
	pd := p.(*verbs.RDMAPD)
	buf := newBuffer(t, 1<<20)
	mr, err := pd.RegMR(buf.addr, buf.size, verbs.AccessLocalWrite)
	require.NoError(t, err)

	fd, err := syscall.Dup(dev.CmdFD())
	require.NoError(t, err)
	imp, err := verbs.ImportDevice(fd)
	if err != nil {
		syscall.Close(fd)
	}
	require.NoError(t, err)
	defer imp.Close()
	ipd, err := imp.ImportPD(pd.Handle())
	require.NoError(t, err)
	assert.Equal(t, pd.Handle(), ipd.Handle())
	got, err := verbs.ImportMR(ipd, mr.Handle)
	require.NoError(t, err)
	assert.Equal(t, mr.LKey, got.LKey, "the importer uses the primary's keys")
	assert.Equal(t, mr.RKey, got.RKey)
	assert.Equal(t, mr.Addr, got.Addr)
	assert.Equal(t, mr.Len, got.Len)
	require.NoError(t, ipd.DeregMR(got), "unimport leaves the registration alone")
	require.NoError(t, pd.DeregMR(mr))
}

func BenchmarkRDMARegDereg2MiB(b *testing.B) {
	dev, err := verbs.OpenRDMA(rdmaDevice(b))
	require.NoError(b, err)
	defer dev.Close()
	pd, err := dev.AllocPD()
	require.NoError(b, err)
	buf := newBuffer(b, 2<<20)
	b.ReportAllocs()
	for b.Loop() {
		mr, err := pd.RegMR(buf.addr, buf.size, verbs.AccessLocalWrite)
		if err != nil {
			b.Fatal(err)
		}
		if err := pd.DeregMR(mr); err != nil {
			b.Fatal(err)
		}
	}
}
