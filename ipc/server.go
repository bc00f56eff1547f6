package ipc

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"strconv"
	"sync"
	"time"
)

// DefaultMaxInflight is how many requests of one connection run at once
// unless ServerConfig says otherwise.
const DefaultMaxInflight = 64

// Requests of one connection beyond those in flight wait in a backlog of
// at most this many requests and bytes. A client that overflows it is not
// waiting for its answers: it is dropped (ErrBacklog).
const (
	maxBacklog      = 4096
	maxBacklogBytes = 4 << 20
)

// ErrBacklog means a client had more requests waiting than the server
// queues per connection; its connection is closed.
var ErrBacklog = errors.New("ipc: too many requests queued on one connection")

// Handler serves the requests of a Server's peers. Its methods are called
// concurrently: Handle from one goroutine per request in flight (several
// per peer), Connected and Disconnected from each peer's own goroutine.
type Handler interface {
	// Connected is called once a peer passed the credentials check,
	// before any of its requests is handled.
	Connected(p *Peer)
	// Handle serves one request. ctx ends when the peer goes. The
	// returned reply (a message, or a WithFiles) or error is sent back;
	// errors travel as a code (RegisterError) and their text. If decoding
	// the body failed, the peer's connection is closed instead.
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
	// WriteTimeout bounds how long a reply waits for room in the peer's
	// receive queue before the peer is dropped. Default
	// DefaultWriteTimeout.
	WriteTimeout time.Duration
	// Spin is how long each connection's reader polls for the next
	// request before it sleeps (see ClientConfig.Spin). 0 never polls.
	Spin time.Duration
}

// Server accepts connections on a Listener, checks each peer's
// credentials, and runs a Handler for every request. Safe for concurrent
// use.
type Server struct {
	cfg         ServerConfig
	log         *slog.Logger
	uid         int
	maxInflight int

	mu       sync.Mutex
	serving  bool
	closed   bool
	peers    map[*Peer]struct{}
	nextPeer uint64
	wg       sync.WaitGroup // connection and handler goroutines

	closing   chan struct{}
	closeOnce sync.Once
	closeErr  error
}

// NewServer returns a server for cfg; Serve starts it.
func NewServer(cfg ServerConfig) (*Server, error) {
	if cfg.Listener == nil || cfg.Handler == nil {
		return nil, errors.New("ipc: NewServer needs a Listener and a Handler")
	}
	s := &Server{
		cfg:         cfg,
		log:         cfg.Logger,
		uid:         os.Geteuid(),
		maxInflight: cfg.MaxInflightPerConn,
		peers:       map[*Peer]struct{}{},
		closing:     make(chan struct{}),
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
		s.mu.Lock()
		if s.closed {
			s.mu.Unlock()
			c.Close()
			continue // Accept fails next
		}
		s.wg.Add(1)
		s.mu.Unlock()
		go s.serveConn(c)
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

func (s *Server) serveConn(c *Conn) {
	defer s.wg.Done()
	cred, err := c.PeerCred()
	if err != nil {
		s.log.Warn("ipc: dropped a connection without credentials", "err", err)
		c.Close()
		return
	}
	if !s.allowed(cred.UID) {
		s.log.Warn("ipc: refused a connection by credentials", "pid", cred.PID, "uid", cred.UID, "gid", cred.GID)
		refuse(c, fmt.Errorf("%w: uid %d may not connect", ErrRefused, cred.UID))
		c.Close()
		return
	}

	p := &Peer{srv: s, cred: cred}
	p.init(c, s.log, s.cfg.WriteTimeout)
	p.spin = s.cfg.Spin
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		c.Close()
		return
	}
	s.nextPeer++
	p.id = s.nextPeer
	s.peers[p] = struct{}{}
	s.mu.Unlock()

	s.log.Debug("ipc: peer connected", "peer", p.id, "pid", cred.PID, "uid", cred.UID)
	s.cfg.Handler.Connected(p)
	p.fail(p.readLoop(p.incoming))
	err = p.Err()
	if isViolation(err) {
		s.log.Warn("ipc: closed the connection of a peer that broke the protocol",
			"peer", p.id, "pid", cred.PID, "uid", cred.UID, "err", err)
	} else {
		s.log.Debug("ipc: peer disconnected", "peer", p.id, "pid", cred.PID, "err", err)
	}
	s.mu.Lock()
	delete(s.peers, p)
	s.mu.Unlock()
	s.cfg.Handler.Disconnected(p, err)
}

// refuse tells a refused client why, as an error frame with id 0, without
// waiting for room in its queue. It then reads and drops what the client
// sent meanwhile, for a moment: closing a socket with unread data resets
// the connection, and the client would lose the reason along with it.
func refuse(c *Conn, err error) {
	deadline := time.Now().Add(100 * time.Millisecond)
	b, _ := AppendFrame(nil, 0, KindError, 0, errorReply(err))
	if c.send(b, nil, deadline) != nil {
		return
	}
	_ = c.c.SetReadDeadline(deadline)
	buf := make([]byte, MaxMessage)
	for {
		_, files, err := c.recv(buf)
		for _, f := range files {
			f.Close()
		}
		if err != nil && !errors.Is(err, ErrTooLarge) && !errors.Is(err, ErrMalformed) {
			return
		}
	}
}

// Peer is one connected client of a Server. Safe for concurrent use.
type Peer struct {
	endpoint
	srv  *Server
	id   uint64
	cred Cred

	qmu          sync.Mutex
	active       int       // requests being handled
	backlog      []message // requests waiting for a free slot, in order
	backlogBytes int
}

// ID returns the peer's number, unique within its server.
func (p *Peer) ID() uint64 { return p.id }

// Cred returns the peer's credentials as the kernel recorded them.
func (p *Peer) Cred() Cred { return p.cred }

// PID returns the peer's process id.
func (p *Peer) PID() int { return p.cred.PID }

// UID returns the peer's user id.
func (p *Peer) UID() int { return p.cred.UID }

// GID returns the peer's group id.
func (p *Peer) GID() int { return p.cred.GID }

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
	if !kind.IsPush() {
		return fmt.Errorf("%w: %s is not a push", ErrUnknownKind, kind)
	}
	return p.call(ctx, kind, body, reply)
}

// incoming starts or queues a request. It runs on the reader goroutine and
// never blocks, so that acknowledgements keep flowing while handlers wait.
func (p *Peer) incoming(f Frame, files []*os.File) error {
	if !f.Kind.IsRequest() {
		closeFiles(files)
		return fmt.Errorf("%w: %s from a client", ErrUnknownKind, f.Kind)
	}
	m := message{id: f.ID, kind: f.Kind, body: bytes.Clone(f.Body), files: files}
	p.qmu.Lock()
	if p.active < p.srv.maxInflight {
		p.active++
		p.qmu.Unlock()
		p.srv.wg.Add(1) // the connection goroutine holds the group open
		go p.work(m)
		return nil
	}
	if len(p.backlog) >= maxBacklog || p.backlogBytes+len(m.body) > maxBacklogBytes {
		p.qmu.Unlock()
		closeFiles(files)
		return fmt.Errorf("%w: %d waiting", ErrBacklog, len(p.backlog))
	}
	p.backlog = append(p.backlog, m)
	p.backlogBytes += len(m.body)
	p.qmu.Unlock()
	return nil
}

// work handles m, then whatever waits in the backlog.
func (p *Peer) work(m message) {
	defer p.srv.wg.Done()
	for {
		p.handle(m)
		p.qmu.Lock()
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
	if p.ctx.Err() != nil { // gone: nobody to answer
		closeFiles(m.files)
		return
	}
	d := &Decoder{body: m.body, files: m.files}
	reply, err := p.srv.cfg.Handler.Handle(p.ctx, p, m.kind, d)
	d.release()
	if d.err != nil {
		p.fail(fmt.Errorf("%s request: %w", m.kind, d.err))
		return
	}
	p.answer(m, reply, err)
}

// answer sends a handler's reply or error. A reply that cannot be sent
// (it does not encode or is too large) becomes an error reply: the
// requester must not wait in vain for a bug of this side.
func (p *Peer) answer(m message, reply any, err error) {
	ctx := context.Background() // the write ends with the connection anyway
	if err != nil {
		err = p.write(ctx, m.id, KindError, errorReply(err))
	} else if err = p.write(ctx, m.id, KindReply, reply); err != nil && p.ctx.Err() == nil {
		p.srv.log.Error("ipc: reply could not be sent", "kind", m.kind, "peer", p.id, "err", err)
		err = p.write(ctx, m.id, KindError, errorReply(fmt.Errorf("ipc: %s reply: %w", m.kind, err)))
	}
	if err != nil && p.ctx.Err() == nil {
		p.srv.log.Error("ipc: error reply could not be sent", "kind", m.kind, "peer", p.id, "err", err)
	}
}
