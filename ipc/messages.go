package ipc

import (
	"errors"
	"fmt"
	"strconv"
	"time"
)

// ABI is the version of the protocol and messages of this package. Hello
// carries it, so that a primary can refuse a secondary built against
// another.
const ABI uint32 = 8

// Kind names what a frame carries. Requests go from a client to the server,
// pushes from the server to a client; KindReply and KindError answer either.
// A plain value, safe for concurrent use.
type Kind uint16

// Frame kinds. Values are part of the protocol: never renumber one.
const (
	KindReply   Kind = 1 // a successful answer; body is the reply message
	KindError   Kind = 2 // a failed answer; body is ErrorReply
	KindChannel Kind = 3 // server to client, id 0: the call lane (one descriptor); body is Channel
	KindCancel  Kind = 4 // client to server, on the call lane: the call of this id was given up; body is Cancel

	KindHello           Kind = 16 // Hello → HelloReply
	KindCreateMR        Kind = 17 // CreateMR → CreateMRReply
	KindRegisterMempool Kind = 18 // RegisterMempool → RegisterMempoolReply
	KindStats           Kind = 19 // StatsRequest → StatsReply
	KindDetach          Kind = 20 // Detach → DetachReply
	KindMemoryFiles     Kind = 21 // MemoryFiles → MemoryFilesReply, with files

	KindSync Kind = 32 // push: Sync → SyncAck
)

type kindInfo struct {
	name string
	push bool // travels from the server to a client
}

var kinds = map[Kind]kindInfo{
	KindReply:           {name: "reply"},
	KindError:           {name: "error"},
	KindChannel:         {name: "channel"},
	KindCancel:          {name: "cancel"},
	KindHello:           {name: "hello"},
	KindCreateMR:        {name: "create-mr"},
	KindRegisterMempool: {name: "register-mempool"},
	KindStats:           {name: "stats"},
	KindDetach:          {name: "detach"},
	KindMemoryFiles:     {name: "memory-files"},
	KindSync:            {name: "sync", push: true},
}

func (k Kind) String() string {
	if i, ok := kinds[k]; ok {
		return i.name
	}
	return "kind(" + strconv.Itoa(int(k)) + ")"
}

func (k Kind) known() bool { _, ok := kinds[k]; return ok }

// IsRequest reports whether k is a request kind: sent by a client, handled
// by the server's Handler.
func (k Kind) IsRequest() bool {
	i, ok := kinds[k]
	return ok && !i.push && k != KindReply && k != KindError && k != KindChannel && k != KindCancel
}

// IsPush reports whether k is a push kind: sent by the server, handled by
// a client's PushHandler.
func (k Kind) IsPush() bool { return kinds[k].push }

// The messages below are plain values: safe to share between goroutines as
// long as nobody modifies them. Each Validate runs as part of Unmarshal.

// Limits on message fields. Decoding enforces them, so a peer cannot make
// the receiver allocate more than a frame's worth.
const (
	MaxChunks  = MaxItems // chunks in one RegisterMempool
	maxName    = 255      // names and roles
	maxPath    = 4096     // PATH_MAX
	maxPageLog = 40       // page sizes up to 1 TiB
)

var errField = errors.New("field out of range")

func fieldErr(format string, args ...any) error {
	return fmt.Errorf("%w: "+format, append([]any{errField}, args...)...)
}

// Channel is the body of the KindChannel frame by which a server hands an
// admitted client the other end of its call lane (see the package doc).
// A plain value.
type Channel struct{}

// Cancel is the body of a KindCancel frame, by which a client tells the
// server that it gave up the call whose id the frame carries (see the
// package doc). A plain value.
type Cancel struct{}

// Hello is the attach handshake a secondary sends first. The server
// compares ABI with its own; Start is the process start time (see
// shm.ProcessStart), which tells a reused pid from the original; Slot and
// Epoch name the process-table slot the secondary claimed, so that a
// process attached twice is told from itself. Left names earlier claims
// of the same process whose detach had no answer (MaxLeft at most): they
// unmapped their memory and asked to detach, and the server may not have
// heard it. A plain value.
type Hello struct {
	ABI   uint32  `msgpack:"abi"`
	PID   int     `msgpack:"pid"`
	UID   int     `msgpack:"uid"`
	Start uint64  `msgpack:"start"` // process start time, to tell a reused pid
	Role  string  `msgpack:"role"`
	Slot  int     `msgpack:"slot"`
	Epoch uint32  `msgpack:"epoch"`
	Left  []Claim `msgpack:"left,omitempty"`
}

// Claim names a claim of a process-table slot: the slot, and the epoch the
// claim gave it. A plain value.
type Claim struct {
	Slot  int    `msgpack:"slot"`
	Epoch uint32 `msgpack:"epoch"`
}

// MaxLeft is how many earlier claims a Hello may name in Left.
const MaxLeft = 4

// Validate checks the fields a receiver must be able to trust.
func (m *Hello) Validate() error {
	switch {
	case m.PID <= 0:
		return fieldErr("hello pid %d", m.PID)
	case m.UID < 0:
		return fieldErr("hello uid %d", m.UID)
	case m.Role == "" || len(m.Role) > maxName:
		return fieldErr("hello role of %d bytes", len(m.Role))
	case m.Slot < 0:
		return fieldErr("hello slot %d", m.Slot)
	case len(m.Left) > MaxLeft:
		return fieldErr("hello names %d claims left", len(m.Left))
	}
	return nil
}

// HelloReply tells an attaching secondary its process-table slot and how to
// map the instance. With a hardware device, the reply carries the device's
// command file (see WithFiles), and Device and PD say what to import it as.
// A plain value.
type HelloReply struct {
	Slot       int    `msgpack:"slot"`
	Segment    string `msgpack:"segment"`   // control segment file
	LockFile   string `msgpack:"lock_file"` // process-table lock file
	LayoutTag  uint32 `msgpack:"layout_tag"`
	Backend    string `msgpack:"backend"`
	PageSize   uint64 `msgpack:"page_size"`
	PrimaryPID int    `msgpack:"primary_pid"`
	Device     string `msgpack:"device"` // the primary's device name
	PD         uint32 `msgpack:"pd"`     // the handle of the primary's PD, for import
	// Hold is how long, in nanoseconds, a change of the primary's memory
	// may keep a request waiting while a secondary is stalled (the global
	// lock's fence time, twice): a request may wait that long for its
	// answer beyond the requester's own timeout.
	Hold int64 `msgpack:"hold,omitempty"`
}

// MaxHold bounds HelloReply.Hold.
const MaxHold = 10 * time.Minute

// Validate checks the fields a receiver must be able to trust.
func (m *HelloReply) Validate() error {
	switch {
	case m.Slot < 0:
		return fieldErr("hello reply slot %d", m.Slot)
	case len(m.Segment) > maxPath || len(m.LockFile) > maxPath:
		return fieldErr("hello reply path too long")
	case len(m.Backend) > maxName || len(m.Device) > maxName:
		return fieldErr("hello reply backend or device name too long")
	case m.PageSize != 0 && (m.PageSize&(m.PageSize-1) != 0 || m.PageSize > 1<<maxPageLog):
		return fieldErr("hello reply page size %d", m.PageSize)
	case m.PrimaryPID < 0:
		return fieldErr("hello reply primary pid %d", m.PrimaryPID)
	case m.Hold < 0 || m.Hold > int64(MaxHold):
		return fieldErr("hello reply hold %d", m.Hold)
	}
	return nil
}

// CreateMR asks the primary for the memory region covering Addr, creating
// (registering) it if none exists. CPU, if not 0, says that the caller's
// thread is bound to CPU number CPU-1, where the primary may answer it
// (see Peer.Follow). A plain value.
type CreateMR struct {
	Addr uint64 `msgpack:"addr"`
	CPU  uint32 `msgpack:"cpu,omitempty"`
}

// CreateMRReply is the lookup-table entry for the new or existing region:
// [Start, End) and its key. A plain value.
type CreateMRReply struct {
	Start uint64 `msgpack:"start"`
	End   uint64 `msgpack:"end"`
	LKey  uint32 `msgpack:"lkey"`
}

// Validate checks that the range is not empty.
func (m *CreateMRReply) Validate() error {
	if m.Start >= m.End {
		return fieldErr("region [0x%x, 0x%x)", m.Start, m.End)
	}
	return nil
}

// Chunk is one memory chunk of a mempool: [Addr, Addr+Len). A plain value.
type Chunk struct {
	Addr uint64 `msgpack:"addr"`
	Len  uint64 `msgpack:"len"`
}

// RegisterMempool asks the primary to register every chunk of a mempool
// (1 to MaxChunks chunks). A plain value.
type RegisterMempool struct {
	Name   string  `msgpack:"name"`
	Chunks []Chunk `msgpack:"chunks"`
}

// Validate checks the name, the chunk count and every chunk's range.
func (m *RegisterMempool) Validate() error {
	if len(m.Name) > maxName {
		return fieldErr("mempool name of %d bytes", len(m.Name))
	}
	if len(m.Chunks) == 0 || len(m.Chunks) > MaxChunks {
		return fieldErr("mempool %q with %d chunks (1..%d)", m.Name, len(m.Chunks), MaxChunks)
	}
	for i, c := range m.Chunks {
		if c.Len == 0 || c.Addr+c.Len < c.Addr {
			return fieldErr("mempool %q chunk %d: [0x%x, +0x%x)", m.Name, i, c.Addr, c.Len)
		}
	}
	return nil
}

// RegisterMempoolReply gives the key of each chunk, in order. A plain value.
type RegisterMempoolReply struct {
	Keys []uint32 `msgpack:"keys"`
}

// Validate bounds the key count.
func (m *RegisterMempoolReply) Validate() error {
	if len(m.Keys) > MaxChunks {
		return fieldErr("%d keys", len(m.Keys))
	}
	return nil
}

// SyncOp is what a Sync push asks a secondary to do. A plain value.
type SyncOp uint8

// Sync operations.
const (
	SyncMap    SyncOp = 1 // map pages [First, First+Count) of memseg list List
	SyncUnmap  SyncOp = 2 // unmap them back to the reservation
	SyncResync SyncOp = 3 // re-read the whole memory layout
)

func (o SyncOp) String() string {
	switch o {
	case SyncMap:
		return "map"
	case SyncUnmap:
		return "unmap"
	case SyncResync:
		return "resync"
	}
	return "syncop(" + strconv.Itoa(int(o)) + ")"
}

// Sync is the memory synchronisation push: the primary allocated or freed
// pages, and the secondary must map or unmap them before it acknowledges.
// A plain value.
type Sync struct {
	Op    SyncOp `msgpack:"op"`
	List  int    `msgpack:"list"`
	First int    `msgpack:"first"`
	Count int    `msgpack:"count"`
}

// Validate checks the operation and the page range.
func (m *Sync) Validate() error {
	switch m.Op {
	case SyncMap, SyncUnmap:
		if m.List < 0 || m.First < 0 || m.Count <= 0 || m.First+m.Count < m.First {
			return fieldErr("sync %s list %d pages [%d, +%d)", m.Op, m.List, m.First, m.Count)
		}
	case SyncResync:
	default:
		return fieldErr("sync op %d", m.Op)
	}
	return nil
}

// SyncAck acknowledges a Sync: the secondary's mappings now match. A plain
// value.
type SyncAck struct{}

// StatsRequest asks the primary for its counters. A plain value.
type StatsRequest struct{}

// StatsReply carries a process's counters by name (at most MaxItems),
// plus a few fields every caller wants. A plain value.
type StatsReply struct {
	PID         int               `msgpack:"pid"`
	Secondaries int               `msgpack:"secondaries"` // attached now
	MRs         int               `msgpack:"mrs"`         // registered regions
	Counters    map[string]uint64 `msgpack:"counters"`
}

// Validate bounds the counter names.
func (m *StatsReply) Validate() error {
	for name := range m.Counters {
		if name == "" || len(name) > maxName {
			return fieldErr("counter name of %d bytes", len(name))
		}
	}
	return nil
}

// MemoryFiles asks an attached secondary's primary for the backing files
// of its memseg lists, from list First on. A secondary maps its data
// memory from the descriptors the primary hands over, never from a path
// the shared segment names: any process of the primary's user may write
// that path, and a secondary of another user would open it as itself. A
// plain value.
type MemoryFiles struct {
	First int `msgpack:"first"`
}

// Validate checks the list number.
func (m *MemoryFiles) Validate() error {
	if m.First < 0 {
		return fieldErr("memory files from list %d", m.First)
	}
	return nil
}

// MemoryFilesReply comes with the backing files of lists First onwards,
// in list order, as many as one message carries (at most MaxFiles), and
// says how many lists there are. A plain value.
type MemoryFilesReply struct {
	Lists int `msgpack:"lists"`
}

// Validate checks the list count.
func (m *MemoryFilesReply) Validate() error {
	if m.Lists < 0 {
		return fieldErr("%d memory lists", m.Lists)
	}
	return nil
}

// Detach tells the primary that the secondary is leaving. A plain value.
type Detach struct{}

// DetachReply confirms that the secondary's slot is released. A plain
// value.
type DetachReply struct{}
