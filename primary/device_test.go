package primary_test

import (
	"log/slog"
	"os"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/primary"
	"github.com/mpmr/mpmr/shm"
	"github.com/mpmr/mpmr/verbs"
)

// handedDevice stands in for a hardware device: it registers through a soft
// device but, like an rdma-core device, has a command file that secondaries
// must receive to import it — here the read end of a pipe.
type handedDevice struct {
	*verbs.Soft
	r, w *os.File
}

func (d *handedDevice) Name() string { return "handed" }
func (d *handedDevice) CmdFD() int   { return int(d.r.Fd()) }
func (d *handedDevice) Close() error {
	d.r.Close()
	d.w.Close()
	return d.Soft.Close()
}

func TestHardwareDeviceFileIsHandedToSecondaries(t *testing.T) {
	var dev *handedDevice
	p, cfg := startPrimary(t, testenv.Tmpfs(t), func(c *primary.Config) {
		primary.WithDeviceOpener(c, func(seg *shm.Segment, log *slog.Logger) (verbs.Device, error) {
			soft, err := verbs.CreateSoft(seg, verbs.SoftOptions{Logger: log})
			if err != nil {
				return nil, err
			}
			r, w, err := os.Pipe()
			if err != nil {
				return nil, err
			}
			dev = &handedDevice{Soft: soft, r: r, w: w}
			return dev, nil
		})
	})
	assert.Nil(t, p.Device(), "not the soft device")
	assert.Equal(t, "handed", p.VerbsDevice().Name())
	r, err := p.Alloc(p.Backend().PageSize)
	require.NoError(t, err)

	h := startSecondary(t, cfg)
	_, err = dev.w.WriteString("through the handed-over file\n")
	require.NoError(t, err)
	assert.Equal(t, `devfile handed pd=0 soft=false read="through the handed-over file" err=<nil>`, ask(t, h, "devfile"),
		"the secondary reads what the primary writes into the device's file")
	parseKey(t, ask(t, h, "lookup %d", r.Addr))
	assert.Equal(t, 1, p.Global().Stats().MRs, "MRs are registered through the configured device")
	assert.Equal(t, "closed", ask(t, h, "close"))
}

func TestSoftDeviceHandsNothingOver(t *testing.T) {
	_, cfg := startPrimary(t, testenv.Tmpfs(t))
	h := startSecondary(t, cfg)
	assert.Equal(t, "err no device file (device soft)", ask(t, h, "devfile"))
}

func TestUnknownDeviceFailsStart(t *testing.T) {
	_, err := primary.Start(primary.Config{Prefix: testenv.Prefix(t), RuntimeDir: testenv.RunDir(t),
		Device: "mlx5_99", Backend: testenv.Tmpfs(t).Kind, Logger: quiet})
	require.ErrorIs(t, err, verbs.ErrNoDevice)
}
