package primary

import (
	"github.com/mpmr/mpmr/cache"
	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/instance"
	"github.com/mpmr/mpmr/shm"
	"github.com/mpmr/mpmr/verbs"
)

// Counters are a process's counters: its queues' lookups by level,
// requests (served, for the primary) with their latency, memory syncs,
// attached secondaries, and what the primary's IPC limits did.
type Counters = instance.Counters

// ProcCounters are one process's counters as it last published them.
type ProcCounters = instance.ProcCounters

// Stats is a snapshot of the instance as the primary sees it.
type Stats struct {
	// Counters of this process.
	Counters Counters
	Global   cache.GlobalStats
	Device   verbs.SoftStats // zero unless the device is the soft device
	Memory   []hugetlb.ListInfo
	// Processes holds every live process's last published counters,
	// this one included.
	Processes []ProcCounters
}

// Stats publishes this process's counters and returns a snapshot. After
// Close (and while it runs) the snapshot is empty: the segment that held
// the instance is gone.
func (p *Primary) Stats() Stats {
	p.useMu.RLock()
	defer p.useMu.RUnlock()
	if p.closed.Load() {
		return Stats{}
	}
	st := Stats{Counters: p.counters()}
	p.ctrs.Publish(shm.RolePrimary, st.Counters)
	st.Global = p.global.Stats()
	if p.dev != nil {
		st.Device = p.dev.Stats()
	}
	st.Memory = p.mem.Lists()
	st.Processes = p.ctrs.Read()
	return st
}

func (p *Primary) counters() Counters {
	var c Counters
	c.SetQueues(p.queues.Sum())
	c.Requests = p.requests.Load()
	c.RequestErrors = p.reqErrors.Load()
	c.SetLatency(&p.served)
	c.Syncs = p.syncs.Load()
	c.SyncDrops = p.drops.Load()
	c.Fenced = p.fenced.Load()
	c.IPCThrottled = p.throttled.Load()
	c.Quarantined = uint64(p.mem.Quarantined())
	c.ReadFences = p.global.LockState().Fences
	if p.server != nil {
		c.SetIPC(p.server.Stats())
	}
	p.syncMu.Lock()
	c.Secondaries = len(p.peers)
	p.syncMu.Unlock()
	return c
}

// Dump is the instance's state for operators.
type Dump struct {
	Processes []shm.Proc         `json:"processes"`
	Lock      shm.LockState      `json:"lock"`
	Memory    []hugetlb.ListInfo `json:"memory"`
	Cache     cache.Dump         `json:"cache"`
	Device    []verbs.MR         `json:"device_mrs"`
	Pools     []cache.PoolInfo   `json:"pools"`
}

// Dump returns the process table, the global lock's state, the memseg
// lists, the MR list with its chunks and keys, the global table, the
// device's MRs and the mempools. After Close it fails with ErrClosed.
func (p *Primary) Dump() (Dump, error) {
	p.useMu.RLock()
	defer p.useMu.RUnlock()
	if p.closed.Load() {
		return Dump{}, ErrClosed
	}
	d := Dump{Processes: p.seg.Procs(), Lock: p.global.LockState(), Memory: p.mem.Lists(),
		Pools: cache.Pools(p.seg)}
	if p.dev != nil {
		d.Device = p.dev.MRs()
	}
	if d.Device == nil {
		d.Device = []verbs.MR{} // empty, not null, in JSON
	}
	if d.Pools == nil {
		d.Pools = []cache.PoolInfo{}
	}
	var err error
	d.Cache, err = p.global.Dump()
	return d, err
}
