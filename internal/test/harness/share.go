package harness

import (
	"os"
	"path/filepath"

	"github.com/mpmr/mpmr/internal/instance"
	"github.com/mpmr/mpmr/ipc"
	"github.com/mpmr/mpmr/primary"
)

// OpenToAll gives every user access to p's instance, as a primary that
// lets other users in must: its runtime directory, socket, description
// and slot lock, and its segment and memory files.
func OpenToAll(p *primary.Primary) error {
	modes := map[string]os.FileMode{
		p.RuntimeDir(): 0o711,
		filepath.Join(p.RuntimeDir(), ipc.SocketName):         0o666,
		filepath.Join(p.RuntimeDir(), instance.InfoFile):      0o644,
		filepath.Join(p.RuntimeDir(), instance.SlotsLockFile): 0o666,
		p.Segment().Path(): 0o666,
	}
	for _, l := range p.Memory().Lists() {
		modes[l.File] = 0o666
	}
	for path, mode := range modes {
		if err := os.Chmod(path, mode); err != nil {
			return err
		}
	}
	return nil
}
