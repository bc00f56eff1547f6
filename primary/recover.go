package primary

import (
	"errors"
	"os"
	"path/filepath"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/instance"
	"github.com/mpmr/mpmr/ipc"
	"github.com/mpmr/mpmr/shm"
)

// recoverLeftovers removes what a primary that died left behind. It runs
// with the primary lock held, so no live primary owns these files. Nothing
// of the old state is trusted or reused: its segment is marked dead (for
// secondaries of the old instance that still map it) and every file is
// removed; hugepages go back to the kernel once the last old mapping goes.
func (p *Primary) recoverLeftovers() {
	prefix := p.cfg.Prefix
	var dirs []string
	if info, err := instance.ReadInfoIn(p.rundir); err == nil {
		p.log.Warn("previous primary of this instance died; cleaning up after it",
			"pid", info.PID, "segment", info.Segment)
		dirs = append(dirs, info.BackendDir)
	} else if !errors.Is(err, os.ErrNotExist) {
		p.log.Warn("unreadable instance description; cleaning up", "err", err)
	}
	// A primary that died before describing itself may still have left
	// files in the directory this one uses.
	dirs = append(dirs, p.backend.Dir)
	seen := map[string]bool{}
	for _, dir := range dirs {
		if dir == "" || seen[dir] {
			continue
		}
		seen[dir] = true
		seg := instance.SegmentPath(dir, prefix)
		if _, err := os.Stat(seg); err == nil {
			if err := shm.MarkDeadFile(seg); err != nil {
				p.log.Warn("could not mark stale segment dead", "segment", seg, "err", err)
			}
			p.removeFile(seg)
		}
		if err := hugetlb.RemoveFiles(dir, prefix); err != nil {
			p.log.Warn("could not remove stale memory files", "dir", dir, "err", err)
		}
	}
	for _, name := range []string{instance.InfoFile, instance.InfoFile + ".tmp", instance.SlotsLockFile, ipc.SocketName} {
		if err := p.rundir.Remove(name); err == nil {
			p.log.Info("removed stale file", "path", filepath.Join(p.rundir.Path(), name))
		} else if !errors.Is(err, os.ErrNotExist) {
			p.log.Warn("could not remove stale file", "path", filepath.Join(p.rundir.Path(), name), "err", err)
		}
	}
}

func (p *Primary) removeFile(path string) {
	if err := os.Remove(path); err == nil {
		p.log.Info("removed stale file", "path", path)
	} else if !errors.Is(err, os.ErrNotExist) {
		p.log.Warn("could not remove stale file", "path", path, "err", err)
	}
}
