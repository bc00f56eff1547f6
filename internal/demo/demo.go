// Package demo is the workload the example programs run: a primary that
// sets up data memory and a mempool of packet buffers and launches
// secondaries, and secondaries whose queues move payloads between buffers
// through the soft device, looking up the key of every buffer on the way,
// as a NIC driver's datapath would.
package demo

import (
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/mpmr/mpmr/shm"
)

// Options configure a run.
type Options struct {
	Prefix      string
	RuntimeDir  string
	Backend     string        // auto, hugetlbfs, tmpfs
	Device      string        // soft, or an rdma-core device
	Secondaries int           // processes the primary launches
	Queues      int           // per secondary
	Duration    time.Duration // of the secondaries' work
	BufSize     int           // bytes per packet buffer
	Buffers     int           // buffers in the pool
	Churn       bool          // free and reallocate scratch memory meanwhile
	Out         io.Writer     // progress and summaries
	Logger      *slog.Logger

	verbose bool
}

// PoolName is the mempool of packet buffers.
const PoolName = "pkts"

// Summary is what a process reports at the end.
type Summary struct {
	Role             string        `json:"role"`
	PID              int           `json:"pid"`
	Seconds          float64       `json:"seconds"`
	Lookups          uint64        `json:"lookups"`
	TopHits          uint64        `json:"top_hits"`
	BottomHits       uint64        `json:"bottom_hits"`
	GlobalHits       uint64        `json:"global_hits"`
	Created          uint64        `json:"created"`
	Copies           uint64        `json:"copies"`
	ChurnChecks      uint64        `json:"churn_checks"`
	Invalidations    uint64        `json:"invalidations"`
	CreateP50        time.Duration `json:"create_p50"`
	CreateP99        time.Duration `json:"create_p99"`
	ValidationErrors uint64        `json:"validation_errors"`
	Errors           []string      `json:"errors,omitempty"`
}

// summaryPrefix starts the line a secondary prints its Summary on.
const summaryPrefix = "SUMMARY "

func (s Summary) line() string {
	b, _ := json.Marshal(s)
	return summaryPrefix + string(b)
}

// LookupsPerSecond is the lookup rate.
func (s Summary) LookupsPerSecond() float64 {
	if s.Seconds == 0 {
		return 0
	}
	return float64(s.Lookups) / s.Seconds
}

func (s Summary) String() string {
	return fmt.Sprintf("%-9s pid %-7d %10.0f lookups/s  hits top %d bottom %d global %d created %d  copies %d  churn checks %d  invalidations %d  create p50 %v p99 %v  validation failures %d",
		s.Role, s.PID, s.LookupsPerSecond(), s.TopHits, s.BottomHits, s.GlobalHits, s.Created,
		s.Copies, s.ChurnChecks, s.Invalidations, s.CreateP50.Round(time.Microsecond), s.CreateP99.Round(time.Microsecond),
		s.ValidationErrors)
}

// scratch is the churned region, published by the primary in the segment
// under shm.RootUser. Seq is odd while the region changes; Addr and Len are
// valid while it is even and unchanged.
//
//	off size field
//	  0   8  Seq
//	  8   8  Addr
//	 16   8  Len
//	 24  40  reserved
type scratch struct {
	Seq  uint64
	Addr uint64
	Len  uint64
	_    [40]byte
}

// read returns a consistent view and its sequence number, or ok=false while
// the region changes.
func (s *scratch) read() (seq, addr, length uint64, ok bool) {
	seq = atomic.LoadUint64(&s.Seq)
	addr, length = atomic.LoadUint64(&s.Addr), atomic.LoadUint64(&s.Len)
	return seq, addr, length, seq&1 == 0 && addr != 0 && atomic.LoadUint64(&s.Seq) == seq
}

func (s *scratch) changed(seq uint64) bool { return atomic.LoadUint64(&s.Seq) != seq }

func openScratch(seg *shm.Segment) (*scratch, error) {
	off := seg.Root(shm.RootUser)
	if off == 0 {
		return nil, nil
	}
	if err := seg.CheckRange(off, 64); err != nil {
		return nil, err
	}
	return shm.At[scratch](seg, off), nil
}
