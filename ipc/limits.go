package ipc

import (
	"errors"
	"fmt"
	"sync"
	"time"
)

// ErrLimit means a peer went beyond one of a server's Limits. A request
// of an admitted peer over a descriptor limit fails with it and the
// connection carries on; a connection over a cap, or one whose hello is
// overdue, is closed and told why: its calls then fail with an error
// matching both ErrLimit and ErrPeerGone.
var ErrLimit = errors.New("ipc: peer exceeded a limit")

// ErrBacklog means a client had more requests waiting than the server
// queues per connection (Limits.MaxQueued, MaxQueuedBytes): it is not
// waiting for its answers, and its connection is closed. It matches
// ErrLimit.
var ErrBacklog error = &limitError{"too many requests queued on one connection"}

// limitError is a sentinel that matches ErrLimit.
type limitError struct{ what string }

func (e *limitError) Error() string { return ErrLimit.Error() + ": " + e.what }
func (e *limitError) Unwrap() error { return ErrLimit }

// errSlowReader marks a connection dropped because its peer took no
// message for the write timeout.
var errSlowReader = errors.New("peer is not reading")

// ErrConnsInUse is the ErrLimit of a connection refused because every
// connection the cap allows belongs to an open peer that said hello:
// unlike a cap filled by connections that never speak (each closed at its
// hello deadline, the oldest first), that were retired (Peer.Retire) or
// that are closing (ended, their end
// still handled, or hung up by their peer and not read yet), it does not
// pass by itself. A connection over its user's cap (MaxConnsPerUID) is refused
// for that cap, whether or not the total is full too: that is the cap
// whose connections are judged.
var ErrConnsInUse = fmt.Errorf("%w: every connection allowed is in use by a peer that said hello", ErrLimit)

func init() {
	RegisterError("ipc.limit", ErrLimit)
	RegisterError("ipc.conns-in-use", ErrConnsInUse)
}

// Limits bound what the peers of a Server can make it hold: connections,
// descriptors, queued requests, and time without a hello. Zero fields
// take the defaults (the Default... constants). A plain value.
//
// A peer is admitted once it has completed the handshake that
// ServerConfig.HelloKind names. Until then it is held to far less than
// these limits, whatever they say: one request handled at a time and
// four more waiting, frames of at most MaxUnadmittedMessage bytes,
// HelloTimeout to complete the handshake, and no descriptors at all:
// those that come are closed on arrival, and the request goes on without
// them (its handler sees none). These checks run as frames arrive, before
// any handler sees them.
type Limits struct {
	// HelloTimeout is how long a connection may stay open without being
	// admitted; then it is closed, with ErrLimit as the reason. It
	// applies only when ServerConfig.HelloKind is set, and to a retired
	// connection, counted from Peer.Retire. A hello still in
	// its handler when the time is up is waited for, and one still
	// queued in the socket is read first (for 100 ms at most: a server
	// that did not run meanwhile finds its time up and the hello there).
	HelloTimeout time.Duration
	// MaxConns bounds the connections open at once, admitted or not.
	// One over it is closed at once, told why — unless its user holds
	// fewer connections not admitted yet than the user holding the most
	// such, less one: then the oldest of that user's is closed, told why,
	// in its place (ServerStats.ShedConns). A retired connection
	// (Peer.Retire) counts as one not admitted. Users that each stay within
	// MaxConnsPerUID and never say hello so lock no other out, whatever
	// that user's admitted connections are (admitted ones are never
	// shed) — unless they are so many that none of them holds two more
	// than that user.
	MaxConns int
	// MaxConnsPerUID bounds the connections of one user (by the
	// kernel's credentials), so that one user cannot take them all.
	MaxConnsPerUID int
	// MaxFilesPerMessage bounds the descriptors one request of an
	// admitted peer may carry (at most MaxFiles). A request with more is
	// refused with ErrLimit and its descriptors closed at once. Negative:
	// none.
	MaxFilesPerMessage int
	// MaxFilesPerPeer bounds the descriptors a peer's requests hold at
	// once: received, and not yet handled. A request that would go over
	// is refused like one over MaxFilesPerMessage. Negative: none.
	MaxFilesPerPeer int
	// MaxQueued bounds the requests of a peer that wait for a free
	// handler slot (ServerConfig.MaxInflightPerConn run at once); and
	// MaxQueuedBytes, their bodies' bytes. A peer that goes over is not
	// waiting for its answers: it is dropped (ErrBacklog).
	MaxQueued      int
	MaxQueuedBytes int
}

// Defaults of Limits. They let a few dozen secondaries of one user each
// have hundreds of requests in flight, and bound what any one user can
// make a server hold to about a hundred goroutines and small buffers
// before its hello, and a few thousand descriptors in all.
const (
	DefaultHelloTimeout       = 5 * time.Second
	DefaultMaxConns           = 256
	DefaultMaxConnsPerUID     = 128
	DefaultMaxFilesPerMessage = 4
	DefaultMaxFilesPerPeer    = 16
	DefaultMaxQueued          = 1024
	DefaultMaxQueuedBytes     = 1 << 20
)

// What a peer may do before it is admitted.
const (
	// MaxUnadmittedMessage is the largest frame a peer may send before
	// it is admitted: a hello or a stats request is far smaller.
	MaxUnadmittedMessage = 4 << 10
	// maxUnadmittedQueued is how many of its requests may wait while
	// one is handled.
	maxUnadmittedQueued = 4
)

func (l Limits) withDefaults() Limits {
	def := func(v *int, d int) {
		if *v == 0 {
			*v = d
		}
	}
	if l.HelloTimeout <= 0 {
		l.HelloTimeout = DefaultHelloTimeout
	}
	def(&l.MaxConns, DefaultMaxConns)
	def(&l.MaxConnsPerUID, DefaultMaxConnsPerUID)
	def(&l.MaxFilesPerMessage, DefaultMaxFilesPerMessage)
	def(&l.MaxFilesPerPeer, DefaultMaxFilesPerPeer)
	def(&l.MaxQueued, DefaultMaxQueued)
	def(&l.MaxQueuedBytes, DefaultMaxQueuedBytes)
	l.MaxFilesPerMessage = min(max(l.MaxFilesPerMessage, 0), MaxFiles)
	l.MaxFilesPerPeer = max(l.MaxFilesPerPeer, 0)
	l.MaxConns = max(l.MaxConns, 1)
	l.MaxConnsPerUID = max(l.MaxConnsPerUID, 1)
	l.MaxQueued = max(l.MaxQueued, 0)
	l.MaxQueuedBytes = max(l.MaxQueuedBytes, 0)
	return l
}

// ServerStats counts what a Server's limits did since it started. A plain
// value.
type ServerStats struct {
	// Conns is how many connections are open now, Unadmitted how many of
	// them have not completed their hello or were retired since
	// (Peer.Retire).
	Conns      int `json:"conns"`
	Unadmitted int `json:"unadmitted"`
	// RefusedConns and RefusedConnsUID count connections closed at once
	// for MaxConns and MaxConnsPerUID.
	RefusedConns    uint64 `json:"refused_conns"`
	RefusedConnsUID uint64 `json:"refused_conns_uid"`
	// ShedConns counts connections not admitted yet that were closed to
	// make room, over MaxConns, for a user holding fewer connections
	// without hello (by two at least; see MaxConns).
	ShedConns uint64 `json:"shed_conns"`
	// HelloTimeouts counts connections closed for an overdue hello, and
	// retired ones (Peer.Retire) closed at their time.
	HelloTimeouts uint64 `json:"hello_timeouts"`
	// RefusedFiles counts requests whose descriptors were refused:
	// closed on arrival before the hello, or refused whole for more than
	// MaxFilesPerMessage; RefusedFilesInFlight those refused for
	// MaxFilesPerPeer.
	RefusedFiles         uint64 `json:"refused_files"`
	RefusedFilesInFlight uint64 `json:"refused_files_in_flight"`
	// QueueOverflows counts peers dropped for too many queued requests
	// (ErrBacklog), WriteTimeouts those dropped for taking no message
	// for the write timeout (they do not read their replies).
	QueueOverflows uint64 `json:"queue_overflows"`
	WriteTimeouts  uint64 `json:"write_timeouts"`
	// Violations counts connections closed for breaking the protocol:
	// a malformed, oversized (MaxMessage, or MaxUnadmittedMessage before
	// the hello) or unexpected frame.
	Violations uint64 `json:"violations"`
	// StarvedLanes counts lanes let go from the CPU their peer named
	// because their thread could not run there (see Peer.Follow).
	StarvedLanes uint64 `json:"starved_lanes"`
	// IdleLanes counts lanes that gave their CPU back, for another lane
	// to follow its peer there, after their own peer asked nothing for a
	// while (see Peer.Follow).
	IdleLanes uint64 `json:"idle_lanes"`
}

// tripEvery is how often each limit may log that it tripped: a flood
// trips one thousands of times a second.
const tripEvery = time.Second

// tripLog rate-limits the log lines of tripped limits. Safe for
// concurrent use.
type tripLog struct {
	mu       sync.Mutex
	last     map[string]time.Time
	unlogged map[string]int
}

// trip logs msg with args for key (a limit, say), unless it logged for
// key less than tripEvery ago; the next line then says how many went
// unlogged.
func (s *Server) trip(limit, msg string, args ...any) {
	t := &s.trips
	now := time.Now()
	t.mu.Lock()
	if t.last == nil {
		t.last, t.unlogged = map[string]time.Time{}, map[string]int{}
	}
	if last, ok := t.last[limit]; ok && now.Sub(last) < tripEvery {
		t.unlogged[limit]++
		t.mu.Unlock()
		return
	}
	n := t.unlogged[limit]
	t.last[limit], t.unlogged[limit] = now, 0
	t.mu.Unlock()
	if n > 0 {
		args = append(args, "unlogged_since_last", n)
	}
	s.log.Warn(msg, args...)
}

// Stats returns what the server's limits did so far.
func (s *Server) Stats() ServerStats {
	s.mu.Lock()
	st := ServerStats{Conns: s.conns, Unadmitted: s.unadmitted}
	s.mu.Unlock()
	st.RefusedConns = s.refusedConns.Load()
	st.RefusedConnsUID = s.refusedConnsUID.Load()
	st.ShedConns = s.shedConns.Load()
	st.HelloTimeouts = s.helloTimeouts.Load()
	st.RefusedFiles = s.refusedFiles.Load()
	st.RefusedFilesInFlight = s.refusedFilesHeld.Load()
	st.QueueOverflows = s.queueOverflows.Load()
	st.WriteTimeouts = s.writeTimeouts.Load()
	st.Violations = s.violations.Load()
	st.StarvedLanes = s.starvedLanes.Load()
	st.IdleLanes = s.idleLanes.Load()
	return st
}
