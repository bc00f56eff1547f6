package primary

import (
	"log/slog"
	"time"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/ipc"
	"github.com/mpmr/mpmr/shm"
	"github.com/mpmr/mpmr/verbs"
)

// Config configures Start. The zero value works: instance "mpmr" on the
// best backend available, with 1 GiB of address space for data memory.
type Config struct {
	// Prefix names the instance; secondaries attach by it. Default "mpmr".
	Prefix string
	// RuntimeDir overrides where the instance's socket and lock files go
	// (a directory named Prefix is made inside it). Default: see
	// ipc.RuntimeDir.
	RuntimeDir string

	// Backend picks hugetlbfs, tmpfs, or (Auto, the default) the best one
	// available; the environment variable MPMR_BACKEND overrides Auto.
	Backend hugetlb.Kind
	// BackendDir forces the directory of the backend's files: on a
	// hugetlbfs mount of the page size, or on tmpfs for the tmpfs backend
	// (Start refuses another).
	BackendDir string
	// PageSize of data memory. Default: the system's hugepage size.
	PageSize uint64
	// MemoryPages is the capacity of the data memory in pages. Default 512.
	MemoryPages int
	// MemoryBase is where the data memory sits in every process's address
	// space. Change it when a secondary reports that the range is in use.
	// Default hugetlb.DefaultBase.
	MemoryBase uintptr

	// Device names the device MRs are registered with: "soft" (the
	// default) is the software HCA in shared memory; any other name is an
	// rdma-core device (mlx5_0, ...), which needs a build with -tags rdma.
	// A hardware device's command file is handed to every secondary at
	// attach (secondary.DeviceFile) for it to import the device and PD.
	Device string
	// MaxMRs bounds the soft device's MR table. Default 4096.
	MaxMRs int
	// Slots bounds the processes attached at once, primary included.
	// Default 64.
	Slots int
	// SinglePage turns off extended-memseg mode: MRs then cover single
	// pages instead of the whole contiguous run around a missing address.
	SinglePage bool
	// FullFlush makes every free flush every queue's cache entirely, in
	// every process, as DPDK's mlx5 driver does. By default a free drops
	// only the cached entries it touched (see cache.GlobalConfig).
	FullFlush bool

	// SyncTimeout bounds how long Alloc and Free wait for a secondary to map
	// or unmap, counted from when the sync went out to it; one that does not
	// answer in time is dropped. Default 2 s. Sending waits SyncTimeout at
	// most too (and 100 ms more for the connection's turn to write when
	// other sends hold it as the time runs out), so a secondary that takes
	// no message at all (its queue full) holds a change up to twice
	// SyncTimeout, and 100 ms. An answer waiting in the socket when the time
	// is up counts (a primary that did not run meanwhile looks for 100 ms
	// more at most). Whether a dropped secondary is fenced is judged within
	// about 200 ms more: a process whose connection ended has 100 ms to
	// end, and one that has let its slot go is given 100 ms of the
	// kernel's reading (see hugetlb.Memory.ReachesWithin for what that
	// bound leaves out).
	SyncTimeout time.Duration
	// Spin is how long the primary polls each secondary's call lane for
	// its next request before it blocks: requests that follow within it
	// (a queue warming up, many queues missing at once) are served
	// without a wake-up, at the price of a CPU busy meanwhile (yielding
	// between polls), per secondary. 0 (the default) never polls; see the
	// README's performance notes. Without it, a secondary's lane is read
	// by a thread of its own blocked in the kernel, which answers creates
	// itself (see package ipc).
	Spin time.Duration
	// FollowCPU has the thread that answers a secondary's creates bind
	// itself to the CPU the asking queue is bound to (secondary's
	// Queue.BindCPU), so that a miss hands that CPU over and back instead
	// of waking another (see the README's "IPC round trip"). Off by
	// default: a secondary then chooses where that thread runs, and one
	// that names a CPU it keeps busy makes its creates wait there, holding
	// the global lock while they register, which every other secondary's
	// creates wait for. So one thread at a time follows each CPU, at most
	// GOMAXPROCS-1 are bound at once (one that follows a secondary that
	// has asked nothing for a second gives way to one that waits), and the
	// primary lets such a thread go once it has run for less than a
	// quarter of 2 ms or more of one create, runnable, and stops
	// following that secondary (a warning,
	// and the ipc_starved_lanes counter; see ipc.Peer.Follow), and every
	// connection of a secondary process once two of its connections'
	// threads were let go, of a user once eight were: a secondary process
	// can hold the others up twice, for milliseconds (the README's "IPC
	// round trip" has figures). Turn it on when the
	// secondaries are trusted to name their CPUs and keep them free while
	// they wait. A thread so bound does not poll (Spin): it would poll on
	// the very CPU it hands back to the queue with each answer.
	FollowCPU bool
	// AllowUIDs lists users besides the primary's own and root that may
	// attach. (The runtime directory's and socket's permissions must be
	// loosened for them too, and the segment's, which they open by path,
	// and their secondaries must trust this primary's user:
	// secondary.Config.TrustUIDs. Loosen those by name, never the
	// instance's life file, mpmr.NAME.live: its mode, 0200, is what tells
	// it from a file others could have held, so a life file loosened is
	// taken for a planted one, and a second primary then removes it and
	// the live primary's files.)
	AllowUIDs []int
	// Limits bound what any connection to the primary can make it hold;
	// zero fields take the defaults of ipc.Limits: 256 connections, 128
	// per user, 1,024 requests (1 MiB) queued per connection, 5 s to
	// complete the hello. Until its hello succeeds a connection may send
	// only small frames, one request at a time. No connection may send
	// descriptors, whatever the descriptor fields say: no request takes
	// any, and closing one can wait on whoever sent it (a TCP socket set
	// to linger). The kernel refuses them at the sender where it can
	// (Linux 6.16 on, see ipc.ListenNoFiles); elsewhere they are dropped
	// on arrival. The counters of Stats say how often each limit tripped.
	Limits ipc.Limits
	// ReplyTimeout bounds how long a reply or a push waits for room in a
	// secondary's receive queue: one that takes nothing for that long is
	// not reading, and is dropped. Default 2 s.
	ReplyTimeout time.Duration

	// Logger receives diagnostics. Default slog.Default().
	Logger *slog.Logger

	// openDevice replaces verbs.Open for tests of the device handover.
	openDevice func(seg *shm.Segment, log *slog.Logger) (verbs.Device, error)
}

const (
	defaultPrefix       = "mpmr"
	defaultMemoryPages  = 512
	defaultSyncTimeout  = 2 * time.Second
	defaultReplyTimeout = 2 * time.Second
)

func (c *Config) setDefaults() error {
	if c.Prefix == "" {
		c.Prefix = defaultPrefix
	}
	if c.MemoryPages == 0 {
		c.MemoryPages = defaultMemoryPages
	}
	if c.SyncTimeout <= 0 {
		c.SyncTimeout = defaultSyncTimeout
	}
	if c.ReplyTimeout <= 0 {
		c.ReplyTimeout = defaultReplyTimeout
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.Device == "" {
		c.Device = verbs.SoftName
	}
	return nil
}
