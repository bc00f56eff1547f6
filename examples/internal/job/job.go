// Package job holds what the two example programs share and nothing more:
// their command-line flags, the summary a secondary reports to the primary
// that launched it, and where the primary publishes the region it churns.
// The library calls themselves are in the programs.
package job

import (
	"encoding/json"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/mpmr/mpmr/shm"
)

// Flags are the options both programs take.
type Flags struct {
	Prefix     string
	RuntimeDir string
	Queues     int
	Duration   time.Duration
	BufSize    int
	Bind       int
	Verbose    bool
}

// Register adds the shared flags to fs.
func (f *Flags) Register(fs *flag.FlagSet) {
	fs.StringVar(&f.Prefix, "prefix", "demo", "instance name")
	fs.StringVar(&f.RuntimeDir, "rundir", "", "runtime directory (default: the standard one for this user)")
	fs.IntVar(&f.Queues, "queues", 1, "queues per secondary, each a goroutine that busy-polls (keep them at or below the CPUs you can spare)")
	fs.DurationVar(&f.Duration, "duration", 3*time.Second, "how long the secondaries work")
	fs.IntVar(&f.BufSize, "bufsize", 2048, "bytes per packet buffer")
	fs.IntVar(&f.Bind, "bind", -1, "bind the queues, in turn, to the CPUs this process may use from the one at this index on, and have the primary answer their misses there (-1: bind none)")
	fs.BoolVar(&f.Verbose, "v", false, "log the library's diagnostics")
}

// Args returns the flags as command-line arguments, for a child process.
func (f *Flags) Args() []string {
	args := []string{"-prefix", f.Prefix, "-rundir", f.RuntimeDir, "-queues", strconv.Itoa(f.Queues),
		"-duration", f.Duration.String(), "-bufsize", strconv.Itoa(f.BufSize), "-bind", strconv.Itoa(f.Bind)}
	if f.Verbose {
		args = append(args, "-v")
	}
	return args
}

// Logger logs the library's warnings to standard error (everything with
// -v).
func (f *Flags) Logger() *slog.Logger {
	level := slog.LevelWarn
	if f.Verbose {
		level = slog.LevelDebug
	}
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
}

// PoolName is the mempool of packet buffers.
const PoolName = "pkts"

// Summary is what a process reports at the end of the job.
type Summary struct {
	Role             string        `json:"role"`
	PID              int           `json:"pid"`
	Seconds          float64       `json:"seconds"`
	Queues           int           `json:"queues"`
	Lookups          uint64        `json:"lookups"`
	TopHits          uint64        `json:"top_hits"`
	BottomHits       uint64        `json:"bottom_hits"`
	GlobalHits       uint64        `json:"global_hits"`
	Created          uint64        `json:"created"`
	Copies           uint64        `json:"copies"`
	ChurnChecks      uint64        `json:"churn_checks"`
	FullFlushes      uint64        `json:"full_flushes"`
	SelectiveFlushes uint64        `json:"selective_flushes"`
	FullDropped      uint64        `json:"full_flush_dropped"`      // entries the full flushes dropped
	SelectiveDropped uint64        `json:"selective_flush_dropped"` // and the selective ones`
	CreateP50        time.Duration `json:"create_p50_ns"`
	CreateP99        time.Duration `json:"create_p99_ns"`
	ValidationErrors uint64        `json:"validation_errors"`
	Errors           []string      `json:"errors,omitempty"`
}

// summaryPrefix starts the line a secondary prints its Summary on.
const summaryPrefix = "SUMMARY "

// Line is the summary as the one line a secondary prints at the end.
func (s Summary) Line() string {
	b, _ := json.Marshal(s)
	return summaryPrefix + string(b)
}

// ParseLine returns the summary on a line Line made, or false.
func ParseLine(line string) (Summary, bool) {
	var s Summary
	js, ok := strings.CutPrefix(line, summaryPrefix)
	return s, ok && json.Unmarshal([]byte(js), &s) == nil
}

// Failed reports whether the process saw a validation failure or an error.
func (s Summary) Failed() bool { return s.ValidationErrors != 0 || len(s.Errors) != 0 }

func (s Summary) String() string {
	rate := 0.0
	if s.Seconds > 0 {
		rate = float64(s.Lookups) / s.Seconds
	}
	return fmt.Sprintf("%-9s pid %-7d %d queues %10.0f lookups/s  hits top %d bottom %d global %d created %d  copies %d  churn checks %d  flushes %d full (%d entries) %d selective (%d entries)  create p50 %v p99 %v  validation failures %d",
		s.Role, s.PID, s.Queues, rate, s.TopHits, s.BottomHits, s.GlobalHits, s.Created, s.Copies, s.ChurnChecks,
		s.FullFlushes, s.FullDropped, s.SelectiveFlushes, s.SelectiveDropped, s.CreateP50.Round(time.Microsecond),
		s.CreateP99.Round(time.Microsecond), s.ValidationErrors)
}

// Scratch says where the region the primary keeps freeing and reallocating
// is, in the control segment under shm.RootUser, so that secondaries can
// look it up while it churns. Seq is odd while the region changes; Addr and
// Len hold while Seq is even and unchanged.
//
//	off size field
//	  0   8  Seq
//	  8   8  Addr
//	 16   8  Len
//	 24  40  reserved
type Scratch struct {
	Seq  uint64
	Addr uint64
	Len  uint64
	_    [40]byte
}

// NewScratch makes the descriptor in seg (the primary's) and publishes it.
func NewScratch(seg *shm.Segment) (*Scratch, error) {
	off, err := seg.Alloc(64, 64)
	if err != nil {
		return nil, err
	}
	if err := seg.SetRoot(shm.RootUser, off); err != nil {
		return nil, err
	}
	return shm.At[Scratch](seg, off), nil
}

// OpenScratch finds the descriptor in seg, or nil if the primary does not
// churn.
func OpenScratch(seg *shm.Segment) (*Scratch, error) {
	off := seg.Root(shm.RootUser)
	if off == 0 {
		return nil, nil
	}
	if err := seg.CheckRange(off, 64); err != nil {
		return nil, err
	}
	return shm.At[Scratch](seg, off), nil
}

// Begin marks the region changing (primary).
func (s *Scratch) Begin() { atomic.AddUint64(&s.Seq, 1) }

// End publishes the region, or none (addr 0), and marks it stable (primary).
func (s *Scratch) End(addr, length uint64) {
	atomic.StoreUint64(&s.Addr, addr)
	atomic.StoreUint64(&s.Len, length)
	atomic.AddUint64(&s.Seq, 1)
}

// Read returns the region and the sequence number it holds under, or false
// while it changes.
func (s *Scratch) Read() (seq, addr, length uint64, ok bool) {
	seq = atomic.LoadUint64(&s.Seq)
	addr, length = atomic.LoadUint64(&s.Addr), atomic.LoadUint64(&s.Len)
	return seq, addr, length, seq&1 == 0 && addr != 0 && atomic.LoadUint64(&s.Seq) == seq
}

// Changed reports whether the region changed since Read returned seq.
func (s *Scratch) Changed(seq uint64) bool { return atomic.LoadUint64(&s.Seq) != seq }
