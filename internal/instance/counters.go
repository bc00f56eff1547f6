package instance

import (
	"fmt"
	"math"
	"math/bits"
	"sync/atomic"
	"time"

	"github.com/mpmr/mpmr/cache"
	"github.com/mpmr/mpmr/ipc"
	"github.com/mpmr/mpmr/shm"
)

// Counter indexes in a process's counter line.
const (
	CLookups = iota
	CTopHits
	CBottomHits
	CGlobalHits
	CCreated
	CFailed
	CFlushes
	CQueues
	CRequests       // IPC requests made (secondary) or served (primary)
	CRequestErrors  // of those, failed
	CLatencyP50     // request round trip (secondary) or service time (primary), ns
	CLatencyP99     // ns
	CLatencyMax     // ns
	CSyncs          // memory syncs pushed (primary) or applied (secondary)
	CSyncDrops      // secondaries dropped for not acknowledging a sync
	CSecondaries    // attached secondaries (primary)
	CValidationErrs // failures the application reported (see Counters.Add)
	CSelective      // of the flushes, those that dropped only what an invalidation touched
	CFullDropped    // entries dropped by full flushes
	CSelDropped     // entries dropped by selective flushes
	CFenced         // secondaries fenced for not following memory changes (primary)
	CQuarantined    // freed pages waiting in quarantine (primary)
	CReadFences     // global read holds fenced by a writer that would not wait longer
	// The IPC server's limits (primary), see ipc.ServerStats.
	CIPCConns                // connections open
	CIPCRefusedConns         // refused for the total cap
	CIPCRefusedConnsUID      // refused for the per-user cap
	CIPCHelloTimeouts        // closed for an overdue hello
	CIPCRefusedFiles         // requests refused for their descriptors
	CIPCRefusedFilesInFlight // requests refused for the descriptors their peer held
	CIPCQueueOverflows       // peers dropped for too many queued requests
	CIPCWriteTimeouts        // peers dropped for not reading their replies
	CIPCThrottled            // requests of peers not attached refused for their budget
	CIPCViolations           // connections closed for breaking the protocol
	CIPCStarvedLanes         // lane threads let go from a CPU they could not run on
	CIPCIdleLanes            // lane threads that gave their CPU back while their peer was quiet
	CIPCShedConns            // connections without hello closed to make room for a user with fewer such
	NumCounters
)

// CounterNames names the counters, for tools and the Stats message.
var CounterNames = [NumCounters]string{
	"lookups", "top_hits", "bottom_hits", "global_hits", "created", "failed", "flushes", "queues",
	"requests", "request_errors", "latency_p50_ns", "latency_p99_ns", "latency_max_ns",
	"syncs", "sync_drops", "secondaries", "validation_errors",
	"selective_flushes", "full_flush_dropped", "selective_flush_dropped", "fenced", "quarantined_pages", "read_fences",
	"ipc_conns", "ipc_refused_conns", "ipc_refused_conns_per_uid", "ipc_hello_timeouts",
	"ipc_refused_files", "ipc_refused_files_in_flight", "ipc_queue_overflows", "ipc_write_timeouts",
	"ipc_strangers_throttled", "ipc_violations", "ipc_starved_lanes",
	"ipc_idle_lanes", "ipc_shed_conns",
}

// Map returns the counters by CounterNames.
func (c Counters) Map() map[string]uint64 {
	m := make(map[string]uint64, NumCounters)
	for i, v := range c.vector() {
		m[CounterNames[i]] = v
	}
	return m
}

// CountersFromMap is the inverse of Map; names it does not know are
// ignored.
func CountersFromMap(m map[string]uint64) Counters {
	var v [NumCounters]uint64
	for i, name := range CounterNames {
		v[i] = m[name]
	}
	return fromVector(&v)
}

// counterLine is one process's published counters, in the segment, one per
// process-table slot. Only the process in the slot writes it.
//
//	off size field
//	  0   8  PID      of the writer; 0 if the line was never written
//	  8   8  Role     shm.Role of the writer
//	 16   8  Updated  unix nanoseconds of the last publication
//	 24   8  Epoch    the slot's claim epoch when written
//	 32 384  Values   NumCounters counters, room for 48
type counterLine struct {
	PID     uint64
	Role    uint64
	Updated int64
	Epoch   uint64
	Values  [48]uint64
}

func countersLayout() []string { return []string{shm.Describe(counterLine{})} }

// Counters are what a runtime counts, published for tools.
type Counters struct {
	// Lookups through the process's queues, and which level answered.
	Lookups    uint64 `json:"lookups"`
	TopHits    uint64 `json:"top_hits"`
	BottomHits uint64 `json:"bottom_hits"`
	GlobalHits uint64 `json:"global_hits"`
	Created    uint64 `json:"created"` // answered by creating an MR
	Failed     uint64 `json:"failed"`
	Flushes    uint64 `json:"flushes"` // local caches flushed by an invalidation
	Queues     int    `json:"queues"`
	// Of the flushes, those that dropped only the entries an invalidation
	// touched (the others dropped everything), and the entries each kind
	// dropped.
	SelectiveFlushes uint64 `json:"selective_flushes"`
	FullDropped      uint64 `json:"full_flush_dropped"`
	SelectiveDropped uint64 `json:"selective_flush_dropped"`
	// IPC requests made (secondary) or served (primary), and round-trip
	// (secondary) or service (primary) times.
	Requests      uint64        `json:"requests"`
	RequestErrors uint64        `json:"request_errors"`
	LatencyP50    time.Duration `json:"latency_p50_ns"`
	LatencyP99    time.Duration `json:"latency_p99_ns"`
	LatencyMax    time.Duration `json:"latency_max_ns"`
	// Memory syncs pushed (primary) or applied (secondary), and
	// secondaries dropped for not following one (primary).
	Syncs     uint64 `json:"syncs"`
	SyncDrops uint64 `json:"sync_drops"`
	// Secondaries attached (primary).
	Secondaries int `json:"secondaries"`
	// Validation errors the application reported (ReportValidationErrors).
	ValidationErrors uint64 `json:"validation_errors"`
	// Secondaries fenced for not following memory changes, and the freed
	// pages waiting in quarantine meanwhile (primary); global read holds a
	// writer fenced because they were held too long.
	Fenced      uint64 `json:"fenced"`
	Quarantined uint64 `json:"quarantined_pages"`
	ReadFences  uint64 `json:"read_fences"`
	// What the primary's IPC limits did (see ipc.ServerStats): connections
	// open now; connections refused for the total and the per-user cap, or
	// closed for an overdue hello; requests refused for their descriptors
	// (too many in one, or any before the hello) or for those their peer
	// already held; peers dropped for too many queued requests or for not
	// reading their replies.
	IPCConns                int    `json:"ipc_conns"`
	IPCRefusedConns         uint64 `json:"ipc_refused_conns"`
	IPCRefusedConnsUID      uint64 `json:"ipc_refused_conns_per_uid"`
	IPCHelloTimeouts        uint64 `json:"ipc_hello_timeouts"`
	IPCRefusedFiles         uint64 `json:"ipc_refused_files"`
	IPCRefusedFilesInFlight uint64 `json:"ipc_refused_files_in_flight"`
	IPCQueueOverflows       uint64 `json:"ipc_queue_overflows"`
	IPCWriteTimeouts        uint64 `json:"ipc_write_timeouts"`
	// Stats requests of peers that have not attached, refused because
	// they went over their budget, all together (primary).
	IPCThrottled uint64 `json:"ipc_strangers_throttled"`
	// Connections closed for breaking the protocol: malformed, oversized
	// or unexpected frames (primary).
	IPCViolations uint64 `json:"ipc_violations"`
	// Lane threads bound to the CPU their secondary named that could not
	// run there, let go (primary with FollowCPU; see ipc.Peer.Follow).
	IPCStarvedLanes uint64 `json:"ipc_starved_lanes"`
	// Lane threads that gave their CPU back to a lane waiting for one
	// while their secondary asked nothing (primary with FollowCPU).
	IPCIdleLanes uint64 `json:"ipc_idle_lanes"`
	// Connections that had not said hello, closed over the total cap to
	// make room for a user holding fewer such (primary).
	IPCShedConns uint64 `json:"ipc_shed_conns"`
}

func (c *Counters) vector() *[NumCounters]uint64 {
	return &[NumCounters]uint64{c.Lookups, c.TopHits, c.BottomHits, c.GlobalHits, c.Created, c.Failed,
		c.Flushes, uint64(c.Queues), c.Requests, c.RequestErrors, uint64(c.LatencyP50), uint64(c.LatencyP99),
		uint64(c.LatencyMax), c.Syncs, c.SyncDrops, uint64(c.Secondaries), c.ValidationErrors,
		c.SelectiveFlushes, c.FullDropped, c.SelectiveDropped, c.Fenced, c.Quarantined, c.ReadFences,
		uint64(c.IPCConns), c.IPCRefusedConns, c.IPCRefusedConnsUID, c.IPCHelloTimeouts,
		c.IPCRefusedFiles, c.IPCRefusedFilesInFlight, c.IPCQueueOverflows, c.IPCWriteTimeouts, c.IPCThrottled,
		c.IPCViolations, c.IPCStarvedLanes, c.IPCIdleLanes, c.IPCShedConns}
}

func fromVector(v *[NumCounters]uint64) Counters {
	return Counters{
		Lookups: v[CLookups], TopHits: v[CTopHits], BottomHits: v[CBottomHits], GlobalHits: v[CGlobalHits],
		Created: v[CCreated], Failed: v[CFailed], Flushes: v[CFlushes], Queues: int(v[CQueues]),
		SelectiveFlushes: v[CSelective], FullDropped: v[CFullDropped], SelectiveDropped: v[CSelDropped],
		Requests: v[CRequests], RequestErrors: v[CRequestErrors], LatencyP50: time.Duration(v[CLatencyP50]),
		LatencyP99: time.Duration(v[CLatencyP99]), LatencyMax: time.Duration(v[CLatencyMax]),
		Syncs: v[CSyncs], SyncDrops: v[CSyncDrops], Secondaries: int(v[CSecondaries]),
		ValidationErrors: v[CValidationErrs], Fenced: v[CFenced], Quarantined: v[CQuarantined],
		ReadFences: v[CReadFences],
		IPCConns:   int(v[CIPCConns]), IPCRefusedConns: v[CIPCRefusedConns], IPCRefusedConnsUID: v[CIPCRefusedConnsUID],
		IPCHelloTimeouts: v[CIPCHelloTimeouts], IPCRefusedFiles: v[CIPCRefusedFiles],
		IPCRefusedFilesInFlight: v[CIPCRefusedFilesInFlight], IPCQueueOverflows: v[CIPCQueueOverflows],
		IPCWriteTimeouts: v[CIPCWriteTimeouts], IPCThrottled: v[CIPCThrottled], IPCViolations: v[CIPCViolations],
		IPCStarvedLanes: v[CIPCStarvedLanes], IPCIdleLanes: v[CIPCIdleLanes], IPCShedConns: v[CIPCShedConns],
	}
}

// SetQueues copies queue counters in.
func (c *Counters) SetQueues(s cache.LocalStats, queues int) {
	c.Lookups, c.TopHits, c.BottomHits, c.GlobalHits = s.Lookups, s.TopHits, s.BottomHits, s.GlobalHits
	c.Created, c.Failed, c.Flushes, c.Queues = s.Created, s.Failed, s.Flushes, queues
	c.SelectiveFlushes, c.FullDropped, c.SelectiveDropped = s.SelectiveFlushes, s.FullDropped, s.SelectiveDropped
}

// SetIPC copies the IPC server's limit counters in.
func (c *Counters) SetIPC(st ipc.ServerStats) {
	c.IPCConns, c.IPCRefusedConns, c.IPCRefusedConnsUID = st.Conns, st.RefusedConns, st.RefusedConnsUID
	c.IPCHelloTimeouts, c.IPCRefusedFiles, c.IPCRefusedFilesInFlight = st.HelloTimeouts, st.RefusedFiles, st.RefusedFilesInFlight
	c.IPCQueueOverflows, c.IPCWriteTimeouts, c.IPCViolations = st.QueueOverflows, st.WriteTimeouts, st.Violations
	c.IPCStarvedLanes, c.IPCIdleLanes, c.IPCShedConns = st.StarvedLanes, st.IdleLanes, st.ShedConns
}

// SetLatency copies a histogram's quantiles in.
func (c *Counters) SetLatency(h *Histogram) {
	c.LatencyP50, c.LatencyP99, c.LatencyMax = h.Quantile(0.5), h.Quantile(0.99), h.Max()
}

// CounterTable is the table of every process's counter lines. The primary
// creates it; every process publishes into its own slot's line and may read
// all of them. Safe for concurrent use.
type CounterTable struct {
	seg   *shm.Segment
	lines []counterLine
}

// CreateCounters allocates the table in seg (owner only).
func CreateCounters(seg *shm.Segment) (*CounterTable, error) {
	n := seg.Slots()
	off, err := seg.Alloc(uint64(n)*counterLineSize, 64)
	if err != nil {
		return nil, fmt.Errorf("instance: counters: %w", err)
	}
	if err := seg.SetRoot(shm.RootStats, off); err != nil {
		return nil, err
	}
	return &CounterTable{seg: seg, lines: shm.Slice[counterLine](seg, off, n)}, nil
}

// OpenCounters opens the table the primary created.
func OpenCounters(seg *shm.Segment) (*CounterTable, error) {
	off := seg.Root(shm.RootStats)
	n := seg.Slots()
	if err := seg.CheckRange(off, uint64(n)*counterLineSize); off == 0 || err != nil {
		return nil, fmt.Errorf("instance: the segment has no counter table")
	}
	return &CounterTable{seg: seg, lines: shm.Slice[counterLine](seg, off, n)}, nil
}

// Publish writes this process's counters into its slot's line.
func (c *CounterTable) Publish(role shm.Role, cs Counters) {
	v := cs.vector()
	slot := c.seg.Slot()
	if slot < 0 || slot >= len(c.lines) {
		return
	}
	l := &c.lines[slot]
	for i, x := range v {
		atomic.StoreUint64(&l.Values[i], x)
	}
	atomic.StoreUint64(&l.Role, uint64(role))
	atomic.StoreUint64(&l.Epoch, uint64(c.seg.Proc(slot).Epoch))
	atomic.StoreInt64(&l.Updated, time.Now().UnixNano())
	atomic.StoreUint64(&l.PID, uint64(c.seg.Proc(slot).PID))
}

// ProcCounters is one process's published counters.
type ProcCounters struct {
	shm.Proc
	Updated  time.Time `json:"updated"`
	Counters Counters  `json:"counters"`
}

// Read returns the lines of the processes in the table that are alive and
// have published since they claimed their slot.
func (c *CounterTable) Read() []ProcCounters {
	var out []ProcCounters
	for _, p := range c.seg.Procs() {
		if !p.Alive || p.Slot >= len(c.lines) {
			continue
		}
		l := &c.lines[p.Slot]
		if atomic.LoadUint64(&l.Epoch) != uint64(p.Epoch) || atomic.LoadUint64(&l.PID) != uint64(p.PID) {
			continue
		}
		var v [NumCounters]uint64
		for i := range v {
			v[i] = atomic.LoadUint64(&l.Values[i])
		}
		out = append(out, ProcCounters{Proc: p, Updated: time.Unix(0, atomic.LoadInt64(&l.Updated)), Counters: fromVector(&v)})
	}
	return out
}

// Histogram records durations in log-linear buckets (8 per power of two,
// so a percentile is within 12.5% of the truth). Safe for concurrent use;
// recording allocates nothing.
type Histogram struct {
	buckets [64 * 8]atomic.Uint64
	max     atomic.Int64
	n       atomic.Uint64
}

func bucketOf(ns uint64) int {
	if ns < 8 {
		return int(ns)
	}
	e := bits.Len64(ns) - 1 // ns in [2^e, 2^(e+1)), e >= 3
	return (e-2)*8 + int(ns>>(e-3)&7)
}

// bucketTop returns the largest value bucket b holds.
func bucketTop(b int) uint64 {
	if b < 8 {
		return uint64(b)
	}
	e, m := b/8+2, uint64(b%8)
	return (8+m+1)<<(e-3) - 1
}

// Record adds one duration.
func (h *Histogram) Record(d time.Duration) {
	ns := uint64(max(d, 0))
	h.buckets[bucketOf(ns)].Add(1)
	h.n.Add(1)
	for {
		m := h.max.Load()
		if int64(ns) <= m || h.max.CompareAndSwap(m, int64(ns)) {
			break
		}
	}
}

// Count returns how many durations were recorded.
func (h *Histogram) Count() uint64 { return h.n.Load() }

// Max returns the largest duration recorded.
func (h *Histogram) Max() time.Duration { return time.Duration(h.max.Load()) }

// Quantile returns the duration below which the fraction q of the records
// fall (0 if there are none).
func (h *Histogram) Quantile(q float64) time.Duration {
	n := h.n.Load()
	if n == 0 {
		return 0
	}
	want := uint64(math.Ceil(q * float64(n)))
	var seen uint64
	for b := range h.buckets {
		seen += h.buckets[b].Load()
		if seen >= want {
			return min(time.Duration(bucketTop(b)), h.Max())
		}
	}
	return h.Max()
}
