package ipc

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"runtime"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/mpmr/mpmr/internal/sys/sock"
)

// DefaultMaxInflight is how many requests of one connection run at once
// unless ServerConfig says otherwise.
const DefaultMaxInflight = 64

// Refusals of connections over a cap that may be draining at once (see
// refuse); beyond, a connection is told why and closed without draining.
const maxRefusing = 64

// Handler serves the requests of a Server's peers. Its methods are called
// concurrently: Handle from one goroutine per request in flight (several
// per peer) or, for the kinds of ServerConfig.Inline, from the reader of
// the peer's call lane; Connected and Disconnected from each peer's own
// goroutine.
type Handler interface {
	// Connected is called once a peer passed the credentials check and
	// the connection caps, before any of its requests is handled (with
	// ServerConfig.HelloKind set, before it is admitted).
	Connected(p *Peer)
	// Handle serves one request. ctx ends when the peer goes and, for a
	// request not handled inline (see ServerConfig.Inline), when the
	// client gives the call up (its context ended: see KindCancel), and
	// once Handle has returned: work it starts must not outlive it on
	// ctx. The returned reply (a message, or a WithFiles) or error is
	// sent back; errors travel as a code (RegisterError) and their text.
	// If decoding the body failed, the peer's connection is closed
	// instead.
	Handle(ctx context.Context, p *Peer, kind Kind, body *Decoder) (reply any, err error)
	// Disconnected is called once the connection has ended, with why
	// (matching ErrPeerGone when the peer went, ErrClosed when this side
	// closed it). It runs as soon as the end is seen: handlers of the
	// peer may still be running, with their context cancelled.
	Disconnected(p *Peer, err error)
}

// ServerConfig configures a Server. NewServer copies it; do not change
// the AllowUIDs slice afterwards.
type ServerConfig struct {
	// Listener to accept connections on. The server owns it from now on
	// and closes it (removing the socket file) when it stops.
	Listener *Listener
	// Handler serves every peer.
	Handler Handler
	// Logger receives connection events and protocol violations.
	// Default slog.Default().
	Logger *slog.Logger
	// AllowUIDs lists users besides the server's own and root that may
	// connect. Listen makes the socket and its directory private to their
	// owner, so such users also need the file permissions loosened.
	AllowUIDs []int
	// MaxInflightPerConn bounds the requests of one connection handled
	// at once; later ones wait in a bounded backlog. Default
	// DefaultMaxInflight.
	MaxInflightPerConn int
	// WriteTimeout bounds how long replies wait for room in the peer's
	// receive queue: a peer that takes no message for that long is not
	// reading its replies, and is dropped, which frees the handlers
	// waiting to answer it. It counts from the last reply the peer took,
	// so a peer that reads is not dropped for the many replies queued
	// behind one another. Default DefaultWriteTimeout.
	WriteTimeout time.Duration
	// Spin is how long each connection's readers poll for the next
	// request before they block (see ClientConfig.Spin). 0 never polls.
	// A call lane bound to its caller's CPU (Peer.Follow) does not.
	Spin time.Duration
	// Inline lists the request kinds that an admitted peer's call lane
	// reader handles itself, one at a time and in arrival order, before
	// it reads the next request: the answer goes out from the thread the
	// request woke, with no goroutine in between. Meant for short
	// requests: while one is handled, the peer's later requests wait (its
	// pushes and their acknowledgements do not, so a handler may push to
	// its own peer). Inline requests do not count against
	// MaxInflightPerConn. Other kinds, and requests that come before the
	// peer is admitted, run on goroutines of their own.
	Inline []Kind
	// HelloKind names the handshake request. When set, a connection
	// starts unadmitted, held to the limits of a stranger (see Limits),
	// and is admitted once the Handler answers a request of this kind
	// without error; one that is not admitted within
	// Limits.HelloTimeout is closed. When 0, every connection that passes
	// the credentials check is admitted at once.
	HelloKind Kind
	// Limits bound what peers can make the server hold; zero fields take
	// the defaults.
	Limits Limits
}

// Server accepts connections on a Listener, checks each peer's
// credentials, and runs a Handler for every request. Safe for concurrent
// use.
type Server struct {
	cfg         ServerConfig
	log         *slog.Logger
	uid         int
	maxInflight int
	lim         Limits // with defaults

	mu       sync.Mutex
	serving  bool
	closed   bool
	peers    map[*Peer]struct{}
	nextPeer uint64
	// conns counts the connections from their accept to the end of
	// serveConn, but for those shed, uncounted at once (they may stay open
	// a moment, up to farewellWait); connsByUID, the same by user.
	conns      int
	connsByUID map[int]int
	// unadmitted counts the connections that need a hello and have not
	// said it, from their accept until they are admitted, shed, or leave
	// the peers; unadmittedByUID, the same by user, which shedFor weighs.
	unadmitted      int
	unadmittedByUID map[int]int
	wg              sync.WaitGroup // connection and handler goroutines
	refusing        chan struct{}  // refusals draining (maxRefusing)
	// starved and starvedUsers count, by process and by user, the lanes
	// let go for their CPU's load (see starveCountsOf); starved, when
	// full, is not searched for exited processes before starvedSearch;
	// starvedFull is set once it had no room for a process. Guarded by
	// mu.
	starved       map[procKey]*procStarves
	starvedUsers  map[int]*atomic.Int32
	starvedSearch time.Time
	starvedFull   bool

	refusedConns     atomic.Uint64
	refusedConnsUID  atomic.Uint64
	shedConns        atomic.Uint64
	helloTimeouts    atomic.Uint64
	refusedFiles     atomic.Uint64
	refusedFilesHeld atomic.Uint64
	queueOverflows   atomic.Uint64
	writeTimeouts    atomic.Uint64
	violations       atomic.Uint64
	starvedLanes     atomic.Uint64
	idleLanes        atomic.Uint64
	laneChecks       atomic.Uint64 // looks at the bound lanes, for tests
	laneTakes        atomic.Uint64 // lanes' asks for a CPU, for tests
	trips            tripLog

	lanesMu  sync.Mutex                  // changes lanes; taken by no lane while bound
	lanes    atomic.Pointer[[]boundLane] // the lanes bound (see Follow)
	lanesGen atomic.Uint64               // counts changes to lanes
	checking bool                        // checkLanes runs; guarded by lanesMu
	waiting  map[*Peer]int               // lanes refused a CPU, and which; guarded by lanesMu

	closing   chan struct{}
	closeOnce sync.Once
	closeErr  error
}

// NewServer returns a server for cfg; Serve starts it.
func NewServer(cfg ServerConfig) (*Server, error) {
	if cfg.Listener == nil || cfg.Handler == nil {
		return nil, errors.New("ipc: NewServer needs a Listener and a Handler")
	}
	if cfg.HelloKind != 0 && !cfg.HelloKind.IsRequest() {
		return nil, fmt.Errorf("ipc: NewServer: hello kind %s is not a request", cfg.HelloKind)
	}
	s := &Server{
		cfg:             cfg,
		log:             cfg.Logger,
		uid:             os.Geteuid(),
		maxInflight:     cfg.MaxInflightPerConn,
		lim:             cfg.Limits.withDefaults(),
		peers:           map[*Peer]struct{}{},
		connsByUID:      map[int]int{},
		unadmittedByUID: map[int]int{},
		refusing:        make(chan struct{}, maxRefusing),
		closing:         make(chan struct{}),
	}
	if s.log == nil {
		s.log = slog.Default()
	}
	if s.maxInflight <= 0 {
		s.maxInflight = DefaultMaxInflight
	}
	return s, nil
}

// Serve accepts connections until ctx ends or Close is called, then closes
// the listener and every connection, waits for their goroutines and
// handlers, and returns nil. It returns an error only if called twice.
func (s *Server) Serve(ctx context.Context) error {
	s.mu.Lock()
	if s.serving {
		s.mu.Unlock()
		return errors.New("ipc: Serve called twice")
	}
	s.serving = true
	s.mu.Unlock()
	stop := context.AfterFunc(ctx, s.shutdown)
	defer stop()

	var backoff time.Duration
	for {
		c, err := s.cfg.Listener.Accept()
		if err != nil {
			if errors.Is(err, ErrClosed) {
				s.shutdown()
				s.wg.Wait()
				return nil
			}
			// Out of descriptors or memory: wait and try again, as
			// net/http does.
			backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
			s.log.Warn("ipc: accept failed; retrying", "err", err, "in", backoff)
			select {
			case <-time.After(backoff):
			case <-s.closing:
			}
			continue
		}
		backoff = 0
		cred, err := c.PeerCred()
		if err != nil {
			s.log.Warn("ipc: dropped a connection without credentials", "err", err)
			c.Close()
			continue
		}
		if !s.allowed(cred.UID) {
			// Before any cap counts it: users that may not connect must not
			// fill the caps of those who may. The refusals draining at
			// once are bounded (turnAway).
			s.trip("credentials", "ipc: refused a connection by credentials", "pid", cred.PID, "uid", cred.UID, "gid", cred.GID)
			s.turnAway(c, fmt.Errorf("%w: uid %d may not connect", ErrRefused, cred.UID))
			continue
		}
		s.mu.Lock()
		if s.closed {
			s.mu.Unlock()
			c.Close()
			continue // Accept fails next
		}
		shed, refused := s.takeConn(cred)
		if refused != nil {
			s.mu.Unlock()
			s.turnAway(c, refused.err())
			continue
		}
		s.wg.Add(1)
		var why error
		if shed != nil {
			why = shed.shedReason()
			s.wg.Add(1)
		}
		s.mu.Unlock()
		if shed != nil {
			// Not here: its farewell may wait for room in its queue.
			go func() {
				defer s.wg.Done()
				if h := shedDropping.Load(); h != nil {
					(*h)()
				}
				shed.drop(why)
			}()
		}
		go s.serveConn(c, cred)
	}
}

// takeConn counts a new connection of cred's user, or says which cap it
// is over. At the total cap, a user under its own takes the place of a
// connection not admitted yet of a user holding more than one more (see
// shedFor): it returns that peer, uncounted already, for the caller to
// close. Call it with s.mu held; the caller asks a refusal its error
// without it.
func (s *Server) takeConn(cred Cred) (shed *Peer, refused *refusal) {
	total, mine := s.conns >= s.lim.MaxConns, s.connsByUID[cred.UID] >= s.lim.MaxConnsPerUID
	if total && !mine {
		if shed = s.shedFor(cred.UID); shed != nil {
			shed.shed, shed.shedFrom = true, s.unadmittedByUID[shed.cred.UID]
			shed.counted = false
			s.countUnadmitted(shed.cred.UID, -1)
			s.uncountConn(shed.cred.UID)
			s.shedConns.Add(1)
			s.trip("shed", "ipc: closed a connection without hello to make room for a user with fewer",
				"limit", "conns", "pid", shed.cred.PID, "uid", shed.cred.UID, "for_pid", cred.PID, "for_uid", cred.UID)
			total = false
		}
	}
	// Refused, for the user's own cap first (binding whatever the total):
	// say whether the cap is held by peers that said hello (then only
	// their leaving makes room) or also by connections that have not said
	// hello — which go by themselves, at their hello deadline if not
	// before: a client may try again (Attach does).
	switch {
	case mine:
		s.refusedConnsUID.Add(1)
		s.trip("conns-per-uid", "ipc: refused a connection: too many connections per user",
			"limit", "conns-per-uid", "pid", cred.PID, "uid", cred.UID, "max", s.lim.MaxConnsPerUID)
		return nil, &refusal{inUse: s.inUse(cred.UID, false),
			why: fmt.Sprintf("uid %d has %d connections open, at most %d per user",
				cred.UID, s.connsByUID[cred.UID], s.lim.MaxConnsPerUID)}
	case total:
		s.refusedConns.Add(1)
		s.trip("conns", "ipc: refused a connection: too many connections",
			"limit", "conns", "pid", cred.PID, "uid", cred.UID, "max", s.lim.MaxConns)
		return nil, &refusal{inUse: s.inUse(0, true),
			why: fmt.Sprintf("%d connections open, at most %d", s.conns, s.lim.MaxConns)}
	}
	s.conns++
	s.connsByUID[cred.UID]++
	if s.cfg.HelloKind != 0 {
		// Counted without hello from now: a burst of the user's is
		// weighed whole by shedFor, before its goroutines make peers.
		s.countUnadmitted(cred.UID, 1)
	}
	return shed, nil
}

// shedFor chooses the connection that a new one of uid, over the total
// cap, takes the place of: one not admitted yet (its hello may be under
// way, and is then lost) of the user holding the most such connections,
// if that is more than uid holds plus one, the oldest of them; or nil.
// Only connections without hello weigh, since only they can be shed. So
// users that fill the total with connections that never say hello, each
// within its own cap, keep no other user out, whatever that user's
// secondaries hold, and no user is made to give way to one that holds as
// many. Call it with s.mu held.
func (s *Server) shedFor(uid int) *Peer {
	most := s.unadmittedByUID[uid] + 1 // what a candidate's user must hold more than
	heavier := false
	for _, n := range s.unadmittedByUID {
		heavier = heavier || n > most
	}
	if !heavier {
		return nil // no walk over the peers
	}
	var best *Peer
	for p := range s.peers {
		if !p.counted || p.hasEnded() {
			continue // an ended one goes by itself
		}
		if n := s.unadmittedByUID[p.cred.UID]; n > most || best != nil && n == most && p.id < best.id {
			best, most = p, n
		}
	}
	return best
}

// refusal is a connection refused over a cap: why, and, if every
// connection the cap counts was an open peer that said hello, those
// peers.
type refusal struct {
	why   string
	inUse []*Peer
}

// err is the refusal's error: ErrConnsInUse if the cap is in use by peers
// that said hello, none of whose peers has hung up since (a cap they fill
// does not pass by itself), plain ErrLimit if not. It looks at each of
// those peers' sockets (a system call each): call it without s.mu.
func (r *refusal) err() error {
	limit := ErrConnsInUse
	if r.inUse == nil {
		limit = ErrLimit
	}
	for _, p := range r.inUse {
		if p.conn.hungUp() {
			limit = ErrLimit // closing: its end is not read yet
			break
		}
	}
	return fmt.Errorf("%w: %s", limit, r.why)
}

// inUse returns the peers that hold the connections counted, of uid or
// with all set of every user, if every one of those is a peer that said
// hello and is open (not ended, not being closed); nil otherwise. Call it
// with s.mu held.
func (s *Server) inUse(uid int, all bool) []*Peer {
	want := s.conns
	if !all {
		if s.unadmittedByUID[uid] > 0 {
			return nil
		}
		want = s.connsByUID[uid]
	} else if s.unadmitted > 0 {
		return nil
	}
	var ps []*Peer
	for p := range s.peers {
		if p.shed || !all && p.cred.UID != uid {
			continue // a shed one is counted no more
		}
		if !p.admitted.Load() || p.hasEnded() {
			return nil
		}
		ps = append(ps, p)
	}
	if len(ps) != want {
		return nil // some are not peers yet, or ending
	}
	return ps
}

// connServing, when set (by tests), runs as an accepted connection's
// goroutine starts, before the connection is a peer.
var connServing atomic.Pointer[func()]

// countUnadmitted counts a connection of uid in those without hello (by
// n, 1 or -1). Call it with s.mu held.
func (s *Server) countUnadmitted(uid, n int) {
	s.unadmitted += n
	if s.unadmittedByUID[uid] += n; s.unadmittedByUID[uid] <= 0 {
		delete(s.unadmittedByUID, uid)
	}
}

// releaseConn uncounts p's connection as it ends, unless it was shed and
// uncounted then.
func (s *Server) releaseConn(p *Peer) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if p.counted {
		p.counted = false
		s.countUnadmitted(p.cred.UID, -1)
	}
	if !p.shed {
		s.uncountConn(p.cred.UID)
	}
}

// uncountConn uncounts a connection of uid from conns and connsByUID.
// Call it with s.mu held.
func (s *Server) uncountConn(uid int) {
	s.conns--
	if s.connsByUID[uid]--; s.connsByUID[uid] <= 0 {
		delete(s.connsByUID, uid)
	}
}

// turnAway closes a connection over a cap, telling it why. The drain that
// keeps the reason from being lost (see refuse) runs in a goroutine of
// its own, up to maxRefusing at once; beyond, the reason is sent and the
// connection closed at once, which a client that has not spoken yet
// still reads.
func (s *Server) turnAway(c *Conn, why error) {
	select {
	case s.refusing <- struct{}{}:
		// Counted under mu, unless closed: Close waits for what is
		// counted, and counts nothing once it has begun to wait.
		s.mu.Lock()
		if s.closed {
			s.mu.Unlock()
			<-s.refusing
			c.Close()
			return
		}
		s.wg.Add(1)
		s.mu.Unlock()
		go func() {
			defer s.wg.Done()
			refuse(c, why)
			c.Close()
			<-s.refusing
		}()
	default:
		tell(c, why, time.Now().Add(farewellWait))
		c.Close()
	}
}

// Close stops the server: the listener and every connection close, and
// Close waits for connection goroutines and running handlers to return.
// It must not be called from a Handler method. Idempotent.
func (s *Server) Close() error {
	s.shutdown()
	s.wg.Wait()
	return s.closeErr
}

func (s *Server) shutdown() {
	s.closeOnce.Do(func() {
		s.mu.Lock()
		s.closed = true
		close(s.closing)
		peers := make([]*Peer, 0, len(s.peers))
		for p := range s.peers {
			peers = append(peers, p)
		}
		s.mu.Unlock()
		s.closeErr = s.cfg.Listener.Close()
		for _, p := range peers {
			p.fail(ErrClosed)
		}
	})
}

// Peers returns the peers connected now.
func (s *Server) Peers() []*Peer {
	s.mu.Lock()
	defer s.mu.Unlock()
	ps := make([]*Peer, 0, len(s.peers))
	for p := range s.peers {
		ps = append(ps, p)
	}
	slices.SortFunc(ps, func(a, b *Peer) int { return cmp.Compare(a.id, b.id) })
	return ps
}

func (s *Server) allowed(uid int) bool {
	return uid == s.uid || uid == 0 || slices.Contains(s.cfg.AllowUIDs, uid)
}

func (s *Server) serveConn(c *Conn, cred Cred) {
	defer s.wg.Done()
	if h := connServing.Load(); h != nil {
		(*h)()
	}
	// Counted without hello since takeConn, if a hello is needed.
	p := &Peer{srv: s, cred: cred, ident: pin(c, cred.PID), counted: s.cfg.HelloKind != 0}
	defer s.releaseConn(p)
	defer p.ident.close()
	p.init(c, s.log, s.cfg.WriteTimeout)
	p.spin = s.cfg.Spin
	p.frameLimit, p.rearm, p.ending, p.server = p.maxFrame, p.rearmReader, p.ended, true
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		c.Close()
		return
	}
	s.nextPeer++
	p.id = s.nextPeer
	s.peers[p] = struct{}{}
	if s.cfg.HelloKind == 0 {
		p.admitted.Store(true)
		p.watchProcess()
	} else {
		p.helloTimer = time.AfterFunc(s.lim.HelloTimeout, p.helloDue)
	}
	s.mu.Unlock()

	s.log.Debug("ipc: peer connected", "peer", p.id, "pid", cred.PID, "uid", cred.UID)
	s.cfg.Handler.Connected(p)
	p.fail(p.readLoop(p.incoming))
	if p.helloTimer != nil {
		p.helloTimer.Stop()
	}
	err := p.Err()
	switch {
	case errors.Is(err, ErrLimit), errors.Is(err, errSlowReader): // counted and logged by ending
	case isViolation(err):
		// Counted, and logged at most once a second: a flood of bad
		// frames must not become a flood of log lines.
		s.violations.Add(1)
		s.trip("protocol", "ipc: closed the connection of a peer that broke the protocol",
			"peer", p.id, "pid", cred.PID, "uid", cred.UID, "err", err)
	default:
		s.log.Debug("ipc: peer disconnected", "peer", p.id, "pid", cred.PID, "err", err)
	}
	s.mu.Lock()
	delete(s.peers, p)
	if p.counted {
		// Ended: it weighs no more in the shedding, while Disconnected
		// runs (the connection still counts against the caps until it
		// returns).
		p.counted = false
		s.countUnadmitted(p.cred.UID, -1)
	}
	s.mu.Unlock()
	s.cfg.Handler.Disconnected(p, err)
}

// farewellWait bounds how long the reason for closing a connection may
// wait for room in the peer's queue: a peer whose queue is full is not
// reading, and would not learn it anyway.
const farewellWait = 100 * time.Millisecond

// tell sends the reason why the connection ends, as an error frame with
// id 0, waiting until deadline at most for room. A queue with room takes
// it whatever the deadline: this process may have been held up (load, a
// debugger) between setting the deadline and sending, as write allows.
func tell(c *Conn, why error, deadline time.Time) error {
	b, _ := AppendFrame(nil, 0, KindError, 0, errorReply(why))
	err := c.send(b, nil, deadline)
	if errors.Is(err, os.ErrDeadlineExceeded) {
		if terr := c.trySend(b, nil); !errors.Is(terr, sock.ErrWouldBlock) {
			err = terr
		}
	}
	return err
}

// refuse tells a refused client why without waiting for room in its
// queue. It then reads and drops what the client sent meanwhile, for a
// moment: closing a socket with unread data resets the connection, and
// the client would lose the reason along with it. What it reads is cut
// to a small buffer: only the datagrams count, not their bytes.
func refuse(c *Conn, err error) {
	deadline := time.Now().Add(100 * time.Millisecond)
	if tell(c, err, deadline) != nil {
		return
	}
	_ = c.c.SetReadDeadline(deadline)
	buf := make([]byte, 512)
	for {
		_, files, err := c.recv(buf)
		dropFiles(files)
		if err != nil && !errors.Is(err, ErrTooLarge) && !errors.Is(err, ErrMalformed) {
			return
		}
	}
}

// Peer is one connected client of a Server. Once admitted, it has two
// sockets: its connection, which carries pushes, their acknowledgements
// and what came before the admission, and its call lane, on which its
// requests and their answers travel (see the package doc). Safe for
// concurrent use.
type Peer struct {
	ident identity // the process that made the connection
	endpoint
	srv  *Server
	id   uint64
	cred Cred

	admitted   atomic.Bool
	laneOnce   sync.Once   // opens the call lane, before the first answer once admitted
	counted    bool        // counted in srv.unadmitted; guarded by srv.mu
	shed       bool        // closed, and uncounted, to make room (see Server.shedFor); guarded by srv.mu
	shedFrom   int         // its user's connections without hello then; guarded by srv.mu
	retired    atomic.Bool // left what its hello admitted it to (see Retire); set under srv.mu
	helloTimer *time.Timer // closes the connection when the hello is overdue
	helloLook  time.Time   // until when the hello's time may be looked at again (see helloDue); guarded by qmu

	qmu          sync.Mutex
	active       int       // requests being handled
	backlog      []message // requests waiting for a free slot, in order
	backlogBytes int
	filesHeld    int                // descriptors of requests received and not yet handled
	hellos       int                // hello requests arrived and not yet done with
	overdue      bool               // the time to say hello ran out: no request starts
	helloLate    bool               // the hello timer fired while a hello was handled
	tripped      int                // limits that tripped (tripFiles...), logged once per peer
	calls        map[uint64]callCtx // requests queued or running, not inline, by id

	follow atomic.Int32 // the CPU + 1 its lane should wait on, 0 any (see Follow)
	watch  laneWatch    // the lane's thread while bound (see Follow)
	// starves are the counts of lanes let go for their CPU's load that
	// the peer shares with its process and its user; set before its
	// lane first binds (see Server.starveCountsOf).
	starves atomic.Pointer[starveCounts]
}

// callCtx is a request's handler context, with the means to end it.
type callCtx struct {
	ctx    context.Context
	cancel context.CancelFunc
}

// Limits a peer tripped, for Peer.tripped.
const (
	tripFilesBeforeHello = 1 << iota
	tripFilesPerMessage
	tripFilesHeld
)

// ID returns the peer's number, unique within its server.
func (p *Peer) ID() uint64 { return p.id }

// Cred returns the peer's credentials as the kernel recorded them.
func (p *Peer) Cred() Cred { return p.cred }

// ProcessAlive reports whether the process that made the connection still
// runs — that process, not merely one with its pid (see PID): a pid can be
// handed to another process once the first exits, and whoever kept the
// connection open could then speak in the newcomer's name.
func (p *Peer) ProcessAlive() bool { return p.ident.alive() }

// PID returns the peer's process id.
func (p *Peer) PID() int { return p.cred.PID }

// UID returns the peer's user id.
func (p *Peer) UID() int { return p.cred.UID }

// GID returns the peer's group id.
func (p *Peer) GID() int { return p.cred.GID }

// Admitted reports whether the peer has completed the handshake that
// ServerConfig.HelloKind names (always true without one).
func (p *Peer) Admitted() bool { return p.admitted.Load() }

// Context returns a context that ends when the connection does.
func (p *Peer) Context() context.Context { return p.ctx }

// Done returns a channel closed when the connection has ended.
func (p *Peer) Done() <-chan struct{} { return p.done }

// Err returns why the connection ended, or nil while it is open.
func (p *Peer) Err() error { return p.endpoint.Err() }

// Close drops the peer: its connection closes and its pending pushes fail
// with ErrClosed. Idempotent.
func (p *Peer) Close() error {
	p.fail(ErrClosed)
	return nil
}

func (p *Peer) String() string {
	return "peer " + strconv.FormatUint(p.id, 10) + " (pid " + strconv.Itoa(p.cred.PID) + ")"
}

// Push sends a push of kind to the peer and waits for its acknowledgement,
// decoded into reply (nil to ignore it, or a *WithFiles), until ctx ends.
// It fails with an error matching ErrPeerGone as soon as the connection
// ends, and with the client's error (a *RemoteError) when its handler
// failed. Pushes to one peer are handled there one at a time, in the order
// they were sent.
func (p *Peer) Push(ctx context.Context, kind Kind, body, reply any) error {
	return p.PushWithin(ctx, 0, kind, body, reply)
}

// PushWithin is Push with the peer given d (zero: no limit) to answer,
// counted from when the push went out, rather than from the call: a
// stall of this process before it went (stopped, traced, starved of CPU)
// does not eat into the peer's time. Sending it waits d at most too, and,
// when d runs out while other sends hold the connection's turn to write
// (all of them resuming together after this process's stop, say), 100 ms
// more for that turn, within ctx's deadline and until ctx is cancelled.
func (p *Peer) PushWithin(ctx context.Context, d time.Duration, kind Kind, body, reply any) error {
	if !kind.IsPush() {
		return fmt.Errorf("%w: %s is not a push", ErrUnknownKind, kind)
	}
	return p.callWithin(ctx, d, kind, body, reply)
}

// ended counts and logs a connection that ends over a limit, before its
// socket closes (so that whoever sees the end finds it counted).
func (p *Peer) ended(err error) {
	s := p.srv
	switch {
	case errors.Is(err, errSlowReader):
		s.writeTimeouts.Add(1)
		s.trip("write-timeout", "ipc: dropped a peer that is not reading its replies",
			"limit", "write-timeout", "peer", p.id, "pid", p.cred.PID, "uid", p.cred.UID, "err", err)
	case errors.Is(err, ErrBacklog):
		s.queueOverflows.Add(1)
		s.trip("queue", "ipc: dropped a peer with too many requests queued",
			"limit", "queue", "peer", p.id, "pid", p.cred.PID, "uid", p.cred.UID, "err", err)
	}
}

// maxFrame is the largest frame the peer may send now.
func (p *Peer) maxFrame() int {
	if p.admitted.Load() {
		return MaxMessage
	}
	return MaxUnadmittedMessage
}

// rearmReader lets the reader go on after its read deadline fired, which
// admit uses to wake it: it then takes a receive buffer of full size.
func (p *Peer) rearmReader() bool {
	if !p.admitted.Load() {
		return false
	}
	return p.conn.c.SetReadDeadline(time.Time{}) == nil
}

// admit marks the peer as having completed its hello: from now on the
// limits of Limits apply instead of those of a stranger. A peer shed
// meanwhile (closing, its connection counted no more) is not admitted:
// admit returns why, for the hello's answer.
func (p *Peer) admit() error {
	s := p.srv
	s.mu.Lock()
	if p.shed {
		why := p.shedReason()
		s.mu.Unlock()
		return why
	}
	if p.retired.Load() {
		s.mu.Unlock()
		return errRetired
	}
	if p.admitted.Load() {
		s.mu.Unlock()
		return nil
	}
	p.admitted.Store(true)
	if p.counted {
		p.counted = false
		s.countUnadmitted(p.cred.UID, -1)
	}
	s.mu.Unlock()
	p.helloTimer.Stop()
	p.watchProcess()
	// The reader waits with a buffer sized for a stranger's frames, and
	// the peer may send a larger one as soon as it has the hello's reply,
	// which goes out after this: wake the reader so it takes a full one.
	_ = p.conn.c.SetReadDeadline(time.Unix(1, 0))
	return nil
}

// Retire says that the peer has left what its hello admitted it to (a
// secondary detached, say) while its connection may stay open. From then
// on the connection counts, for the caps, as one without hello again: it
// holds no cap in use (see ErrConnsInUse), shedFor may close it to make
// room for a lighter user, and it closes, telling the peer why, when
// HelloTimeout has passed since Retire, unless it ends before. So a peer
// that leaves and keeps its connections holds no more of them, and no
// longer, than one that never says hello — though each still costs what
// an admitted peer's does till it closes (its call lane's thread, its
// queue and frame limits). A hello that comes after Retire is refused
// before its handler; one already under way is the handler's to judge
// (and, on a peer not admitted yet, refused after it all the same).
// Other requests are still served until it closes: a handler that must
// serve it nothing more refuses them itself. On a server without
// HelloKind, which counts no connection as one without hello, Retire only
// closes the connection after HelloTimeout. Idempotent; the first why
// stands (nil: a plain ErrLimit that says the connection was retired).
func (p *Peer) Retire(why error) {
	s := p.srv
	s.mu.Lock()
	if _, ok := s.peers[p]; !ok || p.retired.Load() || p.shed {
		s.mu.Unlock()
		return // ending (uncounted then, or about to be), or done already
	}
	p.retired.Store(true)
	if !p.counted && s.cfg.HelloKind != 0 {
		p.counted = true
		s.countUnadmitted(p.cred.UID, 1)
	}
	s.mu.Unlock()
	if why == nil {
		why = fmt.Errorf("%w: the connection was retired %v ago", ErrLimit, s.lim.HelloTimeout)
	}
	t := time.AfterFunc(s.lim.HelloTimeout, func() {
		p.dropOverdue("retired", "ipc: closed a retired connection its peer kept open", why)
	})
	context.AfterFunc(p.ctx, func() { t.Stop() })
}

// AndRetire is a handler's reply that retires the peer (see Peer.Retire)
// with Why once Reply is sent: a peer that leaves with this request (a
// secondary's detach) is answered as admitted, and counts as a connection
// without hello only from then on, so that no cap's shedding can close
// its connection before the answer. Retire the peer itself to do so at
// once.
type AndRetire struct {
	Reply any
	Why   error
}

// errRetired answers a hello on a retired connection.
var errRetired = fmt.Errorf("%w: the connection was retired: no hello admits it again", ErrLimit)

// shedReason says why p was shed. Call it with srv.mu held, once p.shed
// is set.
func (p *Peer) shedReason() error {
	return fmt.Errorf("%w: closed to make room for a user with fewer connections without hello: %d open at most, uid %d held %d without hello",
		ErrLimit, p.srv.lim.MaxConns, p.cred.UID, p.shedFrom)
}

// shedDropping, when set (by tests), runs before a shed peer's connection
// is closed.
var shedDropping atomic.Pointer[func()]

// watchProcess ends the connection when the process that made it exits,
// should a child it forked hold the connection (and the call lane) open
// after it. Only an admitted peer is watched, at the cost of a goroutine
// parked in the network poller: a stranger's connection ends with its
// time to say hello anyway.
func (p *Peer) watchProcess() {
	p.ident.watch(func() {
		p.fail(fmt.Errorf("%w: the process that made the connection (pid %d) has exited", ErrPeerGone, p.cred.PID))
	})
}

// helloDue runs when the peer's time to say hello is up.
func (p *Peer) helloDue() {
	p.qmu.Lock()
	if p.hellos > 0 && !p.admitted.Load() {
		p.helloLate = true // the hello's handler decides
		p.qmu.Unlock()
		return
	}
	// A hello that came in time may still wait in the socket, unread, if
	// this process did not run when it came (stopped, traced, starved of
	// CPU): look again shortly, until the reader has taken what was
	// queued, for catchUpWait at most (as a call's answer, cameInTime).
	if !p.admitted.Load() && p.Err() == nil && !p.conn.caughtUp() {
		now := time.Now()
		if p.helloLook.IsZero() {
			p.helloLook = now.Add(catchUpWait)
		}
		if now.Before(p.helloLook) {
			p.qmu.Unlock()
			time.AfterFunc(catchUpLook, p.helloDue)
			return
		}
	}
	// Decided under qmu, where a hello that arrives now is counted: from
	// here on none starts, so none is accepted on a connection about to
	// close for want of one.
	overdue := !p.admitted.Load()
	p.overdue = overdue
	p.qmu.Unlock()
	if overdue {
		p.helloOverdue()
	}
}

func (p *Peer) helloOverdue() {
	p.dropOverdue("hello", "ipc: closed a connection that sent no hello in time",
		fmt.Errorf("%w: no hello within %v", ErrLimit, p.srv.lim.HelloTimeout))
}

// dropOverdue closes a connection that outstayed HelloTimeout without a
// hello that holds (none came, or it was retired), for why, counting it
// with HelloTimeouts and logging msg (rate-limited by key) — unless it
// ended meanwhile, for another reason.
func (p *Peer) dropOverdue(key, msg string, why error) {
	if p.Err() != nil {
		return
	}
	s := p.srv
	s.helloTimeouts.Add(1)
	s.trip(key, msg, "limit", "hello", "peer", p.id, "pid", p.cred.PID, "uid", p.cred.UID, "timeout", s.lim.HelloTimeout)
	p.drop(why)
}

// drop ends the connection for why, telling the peer if that can be done
// at once.
func (p *Peer) drop(why error) {
	p.farewell(why)
	p.fail(why)
}

// checkFiles says whether a request of kind may bring n descriptors now,
// and counts and logs a refusal. Before its hello a peer may bring none:
// the request then goes on without them (strip). After it, a request over
// a limit is refused whole, since its handler would expect them. Call it
// with p.qmu held.
func (p *Peer) checkFiles(kind Kind, n int) (strip bool, err error) {
	s := p.srv
	var trip int
	switch {
	case !p.admitted.Load():
		s.refusedFiles.Add(1)
		trip, strip = tripFilesBeforeHello, true
		err = fmt.Errorf("%w: %s request with %d descriptors before the %s: closed them", ErrLimit, kind, n, s.cfg.HelloKind)
	case n > s.lim.MaxFilesPerMessage:
		s.refusedFiles.Add(1)
		trip = tripFilesPerMessage
		err = fmt.Errorf("%w: %s request with %d descriptors, at most %d", ErrLimit, kind, n, s.lim.MaxFilesPerMessage)
	case p.filesHeld+n > s.lim.MaxFilesPerPeer:
		s.refusedFilesHeld.Add(1)
		trip = tripFilesHeld
		err = fmt.Errorf("%w: %s request with %d descriptors while %d are held, at most %d",
			ErrLimit, kind, n, p.filesHeld, s.lim.MaxFilesPerPeer)
	default:
		return false, nil
	}
	if p.tripped&trip == 0 {
		p.tripped |= trip
		s.trip("files", "ipc: refused a request's descriptors",
			"limit", "files", "peer", p.id, "pid", p.cred.PID, "uid", p.cred.UID, "err", err)
	}
	if strip {
		err = nil
	}
	return strip, err
}

// incoming starts or queues a request that came on the connection. It
// runs on the connection's reader and never blocks, so that
// acknowledgements keep flowing while handlers wait.
func (p *Peer) incoming(f Frame, files []*os.File) error {
	_, err := p.request(f, files, nil)
	return err
}

// request starts or queues a request that came on lane (nil: on the
// connection), or handles it at once (inline) if it came on the lane and
// is of an inline kind. The limits on descriptors and queued requests are
// checked here, before any handler sees the request.
func (p *Peer) request(f Frame, files []*os.File, lane *sock.Blocking) (inline bool, err error) {
	if !f.Kind.IsRequest() {
		dropFiles(files)
		return false, fmt.Errorf("%w: %s from a client", ErrUnknownKind, f.Kind)
	}
	m := message{id: f.ID, kind: f.Kind, lane: lane}
	inflight, queued, queuedBytes := p.srv.maxInflight, p.srv.lim.MaxQueued, p.srv.lim.MaxQueuedBytes
	if !p.admitted.Load() {
		inflight, queued = 1, min(queued, maxUnadmittedQueued)
	}
	p.qmu.Lock()
	if p.overdue {
		p.qmu.Unlock()
		dropFiles(files)
		return false, nil // the connection is closing for an overdue hello
	}
	if f.Kind == p.srv.cfg.HelloKind && !p.admitted.Load() {
		// From its arrival on, not from its handler's start: the hello
		// timer, firing while the hello waits for a handler, must wait
		// for it too.
		m.hello = true
		p.hellos++
	}
	if f.Kind == p.srv.cfg.HelloKind && p.retired.Load() {
		m.refused = errRetired // before its handler, which may take it for a hello again
	}
	switch {
	case len(files) == 0:
	case m.refused != nil:
		dropFiles(files) // refused whole already
	default:
		strip, err := p.checkFiles(f.Kind, len(files))
		if strip || err != nil {
			dropFiles(files) // at once: they must not pile up
			m.refused = err
		} else {
			m.files = files
			p.filesHeld += len(files)
		}
	}
	if lane != nil && slices.Contains(p.srv.cfg.Inline, f.Kind) {
		p.qmu.Unlock()
		if m.refused == nil {
			m.body = f.Body // handled before the lane's buffer is read into again
		}
		p.handle(m)
		return true, nil
	}
	if m.refused == nil {
		m.body = bytes.Clone(f.Body)
	}
	// Made on arrival, so that the client can give the call up while it
	// waits for a slot, too.
	m.ctx, m.cancel = context.WithCancel(p.ctx)
	if p.calls == nil {
		p.calls = make(map[uint64]callCtx)
	}
	p.calls[m.id] = callCtx{m.ctx, m.cancel}
	if p.active < inflight {
		p.active++
		p.qmu.Unlock()
		p.srv.wg.Add(1) // the connection goroutine holds the group open
		go p.work(m)
		return false, nil
	}
	if len(p.backlog) >= queued || p.backlogBytes+len(m.body) > queuedBytes {
		waiting := len(p.backlog)
		p.doneWith(m)
		p.filesHeld -= len(m.files)
		if m.hello {
			p.hellos--
		}
		p.qmu.Unlock()
		dropFiles(m.files)
		return false, fmt.Errorf("%w: %d waiting", ErrBacklog, waiting)
	}
	p.backlog = append(p.backlog, m)
	p.backlogBytes += len(m.body)
	p.qmu.Unlock()
	return false, nil
}

// releaseFiles uncounts n descriptors of a request that is done with, and
// a hello that was in its handler; it reports whether the peer's time to
// say hello ran out meanwhile. The hello that ran then decides: if it did
// not admit the peer, those it queued behind it are not waited for.
func (p *Peer) releaseFiles(n int, hello bool) (late bool) {
	p.qmu.Lock()
	defer p.qmu.Unlock()
	p.filesHeld -= n
	if hello {
		p.hellos--
		late = p.helloLate
	}
	return late
}

// doneWith ends the context of m, a request not handled inline, and
// forgets it. Call it with p.qmu held.
func (p *Peer) doneWith(m message) {
	m.cancel()
	if c, ok := p.calls[m.id]; ok && c.ctx == m.ctx {
		delete(p.calls, m.id) // a peer that reuses an id while it runs only confuses itself
	}
}

// cancelCall ends the context of the peer's call that the KindCancel
// frame f names, if it is queued or running; a call the peer does not
// have there (answered already, handled inline, never made) is no matter.
// A cancellation is an empty Cancel and brings no descriptors.
func (p *Peer) cancelCall(f Frame, files []*os.File) error {
	if len(files) > 0 {
		dropFiles(files)
		return fmt.Errorf("%w: %s frame with %d descriptors", ErrMalformed, f.Kind, len(files))
	}
	if err := Unmarshal(f.Body, &Cancel{}); err != nil {
		return fmt.Errorf("%s: %w", f.Kind, err)
	}
	p.qmu.Lock()
	c := p.calls[f.ID]
	p.qmu.Unlock()
	if c.cancel != nil {
		c.cancel()
	}
	return nil
}

// work handles m, then whatever waits in the backlog.
func (p *Peer) work(m message) {
	defer p.srv.wg.Done()
	for {
		p.handle(m)
		p.qmu.Lock()
		p.doneWith(m)
		if len(p.backlog) == 0 {
			p.active--
			p.qmu.Unlock()
			return
		}
		m = p.backlog[0]
		p.backlog[0] = message{}
		p.backlog = p.backlog[1:]
		p.backlogBytes -= len(m.body)
		p.qmu.Unlock()
	}
}

func (p *Peer) handle(m message) {
	// Gone, or going (its error is set a moment before its context
	// ends): nobody to answer, and a hello must not admit it.
	if p.Err() != nil {
		dropFiles(m.files)
		p.releaseFiles(len(m.files), m.hello)
		return
	}
	if m.refused != nil {
		late := p.releaseFiles(0, m.hello)
		p.answer(m, nil, m.refused)
		if late && !p.admitted.Load() {
			p.helloOverdue()
		}
		return
	}
	ctx := p.ctx
	if m.ctx != nil {
		ctx = m.ctx // ended already if the client gave the call up while it waited for a slot
	}
	hello := m.hello
	d := &Decoder{body: m.body, files: m.files}
	reply, err := p.srv.cfg.Handler.Handle(ctx, p, m.kind, d)
	d.release()
	var retire *AndRetire
	if r, ok := reply.(AndRetire); ok {
		reply, retire = r.Reply, &r // once answered
	}
	if hello && err == nil && d.err == nil {
		// Before the reply, the peer's next request is an admitted one's;
		// and before the hello stops counting as running, so that the
		// hello timer, firing in between, finds the peer admitted rather
		// than finding no hello.
		if why := p.admit(); why != nil {
			reply, err = nil, why // shed meanwhile: no success to answer
		}
	}
	// The request holds its descriptors no more (the handler took them or
	// they are closed): make room before the peer learns the answer.
	late := p.releaseFiles(len(m.files), hello)
	if d.err != nil {
		p.fail(fmt.Errorf("%s request: %w", m.kind, d.err))
		return
	}
	p.answer(m, reply, err)
	if retire != nil && err == nil {
		p.Retire(retire.Why)
	}
	if late && !p.admitted.Load() {
		p.helloOverdue()
	}
}

// answer sends a handler's reply or error. A reply that cannot be sent
// (it does not encode or is too large) becomes an error reply: the
// requester must not wait in vain for a bug of this side.
func (p *Peer) answer(m message, reply any, err error) {
	if p.admitted.Load() {
		// An admitted peer's first answer brings its lane, so that it has
		// the lane when its hello returns.
		p.laneOnce.Do(p.openLane)
	}
	ctx := context.Background() // the write ends with the connection anyway
	write := func(kind Kind, body any) error {
		if m.lane != nil {
			return p.writeLane(ctx, time.Time{}, m.lane, m.id, kind, body)
		}
		return p.write(ctx, m.id, kind, body)
	}
	if err != nil {
		err = write(KindError, errorReply(err))
	} else if err = write(KindReply, reply); err != nil && p.ctx.Err() == nil {
		p.srv.log.Error("ipc: reply could not be sent", "kind", m.kind, "peer", p.id, "err", err)
		err = write(KindError, errorReply(fmt.Errorf("ipc: %s reply: %w", m.kind, err)))
	}
	if err != nil && p.ctx.Err() == nil {
		p.srv.log.Error("ipc: error reply could not be sent", "kind", m.kind, "peer", p.id, "err", err)
	}
}

// openLane makes the peer's call lane, a socket pair, starts its reader
// and hands the other end to the client. Without a lane (the pair could
// not be made), the peer is served on its connection.
func (p *Peer) openLane() {
	l, f, err := sock.BlockingPair()
	if err != nil {
		p.srv.log.Warn("ipc: no call lane for a peer; it is served on its connection", "peer", p.id, "err", err)
		return
	}
	// A descriptor sent on the lane without its notice would be closed
	// by the kernel inside the lane's receive, on its thread: refused as
	// by the listener (ListenNoFiles) where the kernel can, else taken in
	// by every receive and dropped like any other that comes unasked.
	noFiles := p.srv.lim.MaxFilesPerMessage == 0 || p.srv.cfg.Listener.RefusesFiles()
	if refused := noFiles && l.RefuseRights(); !refused {
		l.ReceiveAllRights()
	}
	if err := p.installLane(l); err != nil || p.lane.Load() != l {
		f.Close() // the connection has ended
		return
	}
	p.srv.wg.Add(1) // the caller holds the group open
	go p.serveLane(l)
	// If the frame cannot go, the connection has ended.
	_ = p.write(context.Background(), 0, KindChannel, WithFiles{Body: &Channel{}, Files: []*os.File{f}, CloseAfterSend: true})
}

// serveLane reads the peer's requests on its call lane until it ends,
// blocking in the kernel between them (see sock.Blocking): a request
// wakes this goroutine's thread, and an inline one is answered from it.
// Between requests the thread is bound where Follow asked.
func (p *Peer) serveLane(l *sock.Blocking) {
	defer p.srv.wg.Done()
	buf := make([]byte, MaxMessage)
	var cpu laneCPU
	defer cpu.end(p)
	for {
		cpu.apply(p)
		if p.spin > 0 && cpu.bound == 0 {
			// Not while bound: it would poll on the CPU each answer
			// hands back to the caller.
			l.SpinReadable(p.spin)
		}
		n, files, err := l.Recv(buf, time.Time{})
		if err != nil {
			p.fail(connErr(err))
			return
		}
		f, err := ParseFrame(buf[:n])
		if err == nil && f.Files != len(files) {
			err = fmt.Errorf("%w: %s frame declares %d files, %d came", ErrMalformed, f.Kind, f.Files, len(files))
		}
		inline := false
		watched := cpu.bound != 0
		if watched {
			p.watch.busy.Add(1)
		}
		switch {
		case err != nil:
			dropFiles(files)
		case f.Kind == KindCancel:
			err = p.cancelCall(f, files)
		default:
			inline, err = p.request(f, files, l)
		}
		if watched {
			p.watch.busy.Add(1)
		}
		if err != nil {
			p.fail(err)
			return
		}
		if !inline {
			// The handler's goroutine waits on this thread's P, which the
			// runtime does not hand over when Recv blocks: let it run
			// first instead of waiting for the runtime to notice.
			runtime.Gosched()
		}
	}
}
