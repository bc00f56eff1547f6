package ipc

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/mpmr/mpmr/internal/sys/sock"
)

// maxPushQueue bounds the pushes a client holds while its handler is busy.
// The server waits for each acknowledgement, so a well-behaved one never
// has more than a few outstanding.
const maxPushQueue = 1024

// PushHandler handles the pushes a server sends to a Client. A client calls
// it from one goroutine, one push at a time, in arrival order, so an
// implementation needs no locking against itself; what it returns is sent
// back as the acknowledgement (a reply, or an error). ctx ends with the
// connection. If decoding the body fails, the client drops the connection
// instead of acknowledging.
type PushHandler interface {
	HandlePush(ctx context.Context, kind Kind, body *Decoder) (reply any, err error)
}

// PushHandlerFunc adapts a function to PushHandler. Called as PushHandler
// says: one push at a time.
type PushHandlerFunc func(ctx context.Context, kind Kind, body *Decoder) (any, error)

// HandlePush calls f.
func (f PushHandlerFunc) HandlePush(ctx context.Context, kind Kind, body *Decoder) (any, error) {
	return f(ctx, kind, body)
}

// ClientConfig configures a Client. NewClient copies it.
type ClientConfig struct {
	// PushHandler handles the server's pushes. Without one, each push is
	// answered with ErrNoHandler.
	PushHandler PushHandler
	// Logger receives protocol violations of the server. Default
	// slog.Default().
	Logger *slog.Logger
	// WriteTimeout bounds how long a frame waits for room in the server's
	// receive queue when the call's context has no earlier deadline.
	// Default DefaultWriteTimeout.
	WriteTimeout time.Duration
	// Spin is how long a caller waiting for its answer polls for it
	// before it blocks (see sock.Blocking.SpinReadable): an answer that
	// comes within it reaches its caller without a wake-up, at the price
	// of a CPU busy meanwhile. 0 never polls. A call polls no longer than
	// its deadline, nor once its context has ended.
	Spin time.Duration
}

// Client is the calling end of a connection: any number of goroutines may
// Call at once, each answer finds its caller by request id, and pushes
// from the server go to the PushHandler. Safe for concurrent use.
//
// Once the server has handed over the call lane, a call's answer is
// received by a calling goroutine itself: the first caller to wait
// reads the lane, blocking in the kernel, and hands whatever answers of
// other callers it receives to them; when its own comes, it hands the
// reading to the next caller waiting and returns. A lone caller thus
// sends its request and receives its answer with nothing in between.
type Client struct {
	endpoint
	push    PushHandler
	cred    Cred // the server's, read at the start
	credErr error
	ident   identity    // the server's process, watched for its exit
	exited  atomic.Bool // the watch saw it exit

	reader  sync.WaitGroup // the connection's reader, and the lane's drainer while it runs
	laneBuf []byte         // the lane's receive buffer, used by the leader (see endpoint)
	// The lane's answers still owed to calls that gave up after their
	// request went, and the drainer: the reader of the lane while no
	// caller is, until those answers are in (see drain). Under mu.
	owed     int
	draining *call

	pmu        sync.Mutex
	pushes     []message // received, not yet handled, in arrival order
	pushesDone bool      // the push loop has ended: later pushes are dropped
	pushReady  chan struct{}
}

// NewClient takes over conn and starts reading from it.
func NewClient(conn *Conn, cfg ClientConfig) (*Client, error) {
	if conn == nil {
		return nil, errors.New("ipc: NewClient needs a connection")
	}
	c := &Client{push: cfg.PushHandler, pushReady: make(chan struct{}, 1)}
	c.cred, c.credErr = conn.PeerCred()
	c.init(conn, cfg.Logger, cfg.WriteTimeout)
	c.spin = cfg.Spin
	if c.credErr == nil {
		// A child the server forked may hold the connection open after
		// the server died: its exit ends the connection all the same.
		pid := c.cred.PID
		c.ident = pin(conn, pid)
		c.ident.watch(func() {
			c.exited.Store(true)
			c.fail(fmt.Errorf("%w: the server process (pid %d) has exited", ErrPeerGone, pid))
		})
	}
	c.reader.Add(1)
	go c.read()
	go c.pushLoop()
	return c, nil
}

// DialClient dials path and returns a Client on the connection.
func DialClient(ctx context.Context, path string, cfg ClientConfig) (*Client, error) {
	conn, err := Dial(ctx, path)
	if err != nil {
		return nil, err
	}
	return NewClient(conn, cfg)
}

// Call sends a request of kind and waits for the answer, decoded into reply
// (nil to ignore it, or a *WithFiles to receive files too), until ctx
// ends. The server's error comes back as a *RemoteError that matches its
// registered sentinel. When the connection ends, every pending and later
// Call fails at once with an error matching ErrPeerGone (ErrClosed after
// Close). An answer that arrives after ctx ended is dropped, unless it
// comes while the call still reads what was queued when its deadline
// passed: one already queued then is taken (a process that did not run
// meanwhile, stopped or traced, finds its deadline passed and the answer
// there): the call reads, or waits for the reader to take and hand
// over, what is queued, until nothing is or up to 100 ms more
// (catchUpWait), and takes what it finds meanwhile. The server is told
// the call was given up (see the package doc).
func (c *Client) Call(ctx context.Context, kind Kind, req, reply any) error {
	if !kind.IsRequest() {
		return fmt.Errorf("%w: %s is not a request", ErrUnknownKind, kind)
	}
	if l := c.lane.Load(); l != nil {
		deadline, _ := ctx.Deadline()
		return c.laneCall(ctx, deadline, l, kind, req, reply)
	}
	return c.call(ctx, kind, req, reply)
}

// CallTimeout is Call bounded by timeout instead of a context, for a hot
// path that needs no cancellation: it spares making a context with a
// timer and registering for its end, about a microsecond and nine
// allocations a call on this project's machine, a twentieth of a round
// trip. Past the timeout it fails with context.DeadlineExceeded, once it
// has found its answer not among those already queued (up to catchUpWait
// more: see Call).
func (c *Client) CallTimeout(timeout time.Duration, kind Kind, req, reply any) error {
	if !kind.IsRequest() {
		return fmt.Errorf("%w: %s is not a request", ErrUnknownKind, kind)
	}
	deadline := time.Now().Add(timeout)
	if l := c.lane.Load(); l != nil {
		return c.laneCall(context.Background(), deadline, l, kind, req, reply)
	}
	ctx, cancel := context.WithDeadline(context.Background(), deadline)
	defer cancel()
	return c.call(ctx, kind, req, reply)
}

// Done returns a channel closed when the connection has ended.
func (c *Client) Done() <-chan struct{} { return c.done }

// Err returns why the connection ended, or nil while it is open.
func (c *Client) Err() error { return c.endpoint.Err() }

// ServerExited reports whether the server's process was seen to exit
// while the connection was open. Where the kernel names the server by a
// pidfd (Linux 6.5 on), its exit ends the connection even when a child it
// forked holds the connection open; otherwise, and when the connection's
// own end came first, it says false, and the end is all there is to go by.
func (c *Client) ServerExited() bool { return c.exited.Load() }

// ServerCred returns the credentials of the server process, as the kernel
// recorded them when it started listening. They are read when the client
// is made, so they are there even after the connection has ended (a
// server that refused it, say).
func (c *Client) ServerCred() (Cred, error) { return c.cred, c.credErr }

// Close closes the connection; pending calls fail with ErrClosed. It waits
// for the reading goroutine, not for a push handler that is running (its
// context is cancelled). Idempotent.
func (c *Client) Close() error {
	c.fail(ErrClosed)
	c.reader.Wait()
	return nil
}

func (c *Client) read() {
	defer c.reader.Done()
	err := c.readLoop(c.incoming)
	c.fail(err)
	c.ident.close()
	if err = c.Err(); isViolation(err) {
		c.log.Warn("ipc: closed the connection of a server that broke the protocol", "err", err)
	}
}

// incoming queues a push for the push loop, or installs the call lane;
// it never blocks.
func (c *Client) incoming(f Frame, files []*os.File) error {
	if f.Kind == KindChannel {
		return c.takeLane(f, files)
	}
	if !f.Kind.IsPush() {
		dropFiles(files)
		return fmt.Errorf("%w: %s from the server", ErrUnknownKind, f.Kind)
	}
	c.pmu.Lock()
	if c.pushesDone {
		c.pmu.Unlock()
		dropFiles(files)
		return nil // the connection has ended: nobody handles it
	}
	if len(c.pushes) >= maxPushQueue {
		c.pmu.Unlock()
		dropFiles(files)
		return fmt.Errorf("%w: %d pushes waiting", ErrBacklog, len(c.pushes))
	}
	c.pushes = append(c.pushes, message{id: f.ID, kind: f.Kind, body: bytes.Clone(f.Body), files: files})
	c.pmu.Unlock()
	select {
	case c.pushReady <- struct{}{}:
	default:
	}
	return nil
}

// pushLoop handles pushes one at a time, in arrival order, until the
// connection ends. It watches done, which is closed as soon as the end is
// decided, whoever decides it: the reader, a writer, or Close.
func (c *Client) pushLoop() {
	for {
		select {
		case <-c.pushReady:
		case <-c.done:
		}
		for {
			m, ok := c.nextPush()
			if !ok {
				break
			}
			c.handlePush(m)
		}
		select {
		case <-c.done:
			c.pmu.Lock()
			for _, m := range c.pushes {
				dropFiles(m.files)
			}
			c.pushes, c.pushesDone = nil, true
			c.pmu.Unlock()
			return
		default:
		}
	}
}

// nextPush takes the oldest push waiting, if any.
func (c *Client) nextPush() (message, bool) {
	c.pmu.Lock()
	defer c.pmu.Unlock()
	if len(c.pushes) == 0 {
		return message{}, false
	}
	m := c.pushes[0]
	c.pushes[0] = message{}
	c.pushes = c.pushes[1:]
	return m, true
}

func (c *Client) handlePush(m message) {
	select {
	case <-c.done: // ended: nobody to acknowledge
		dropFiles(m.files)
		return
	default:
	}
	d := &Decoder{body: m.body, files: m.files}
	var reply any
	var err error
	if c.push == nil {
		err = fmt.Errorf("%w: %s push", ErrNoHandler, m.kind)
	} else {
		reply, err = c.push.HandlePush(c.ctx, m.kind, d)
	}
	d.release()
	if d.err != nil {
		c.log.Warn("ipc: closed the connection of a server that sent a malformed push", "kind", m.kind, "err", d.err)
		c.fail(fmt.Errorf("%s push: %w", m.kind, d.err))
		return
	}
	ctx := context.Background()
	if err != nil {
		err = c.write(ctx, m.id, KindError, errorReply(err))
	} else if err = c.write(ctx, m.id, KindReply, reply); err != nil && c.ctx.Err() == nil {
		err = c.write(ctx, m.id, KindError, errorReply(fmt.Errorf("ipc: %s acknowledgement: %w", m.kind, err)))
	}
	if err != nil && c.ctx.Err() == nil {
		c.log.Error("ipc: acknowledgement could not be sent", "kind", m.kind, "err", err)
	}
}

// takeLane installs the call lane the server handed over: one frame with
// id 0 and one descriptor, a seqpacket socket made by the server process
// itself (a socket pair records its maker). Anything else breaks the
// protocol.
func (c *Client) takeLane(f Frame, files []*os.File) error {
	if f.ID != 0 || len(files) != 1 {
		dropFiles(files)
		return fmt.Errorf("%w: channel frame with id %d and %d descriptors", ErrMalformed, f.ID, len(files))
	}
	if err := Unmarshal(f.Body, &Channel{}); err != nil {
		dropFiles(files)
		return fmt.Errorf("channel: %w", err)
	}
	l, err := sock.NewBlocking(files[0], true)
	if err != nil {
		return fmt.Errorf("%w: channel: %w", ErrMalformed, err)
	}
	cred, err := l.PeerCred()
	switch {
	case err != nil:
	case c.credErr != nil:
		err = fmt.Errorf("the server's credentials are unknown: %w", c.credErr)
	case cred.PID != c.cred.PID:
		err = fmt.Errorf("made by pid %d, the server is pid %d", cred.PID, c.cred.PID)
	}
	if err != nil {
		l.Close()
		return fmt.Errorf("%w: channel: %w", ErrMalformed, err)
	}
	c.mu.Lock()
	if c.laneBuf == nil {
		c.laneBuf = make([]byte, MaxMessage)
	}
	c.mu.Unlock()
	if err := c.installLane(l); err != nil {
		return fmt.Errorf("%w: %w", ErrMalformed, err)
	}
	return nil
}

// laneCall makes a call on the lane, until ctx ends or the deadline (zero:
// none) passes: it sends the request, then either reads the lane itself
// until its answer comes (lead) or waits for the caller that reads it to
// hand the answer over, or the reading.
func (c *Client) laneCall(ctx context.Context, deadline time.Time, l *sock.Blocking, kind Kind, req, reply any) error {
	if err := ctx.Err(); err != nil {
		return c.endedOr(err)
	}
	if !deadline.IsZero() && !time.Now().Before(deadline) {
		return c.endedOr(context.DeadlineExceeded)
	}
	cl := newLaneCall(reply)
	err := c.laneCallOn(ctx, deadline, l, kind, req, cl)
	freeLaneCall(cl)
	return err
}

// endedOr returns why the connection ended, if it has, else err: a call
// that cannot be made says the more useful of the two (see endpoint.call).
func (c *Client) endedOr(err error) error {
	if ended := c.Err(); ended != nil {
		return ended
	}
	return err
}

// laneCalls keeps lane calls, with their channels, for the next ones (a
// call, its channel and the channel's buffer were three allocations a
// call, and garbage to collect). A call goes back only when laneCallOn has
// returned: by then nobody can reach it (it is out of pending, out of the
// followers and not the leader, and whoever took it from pending has
// sent its answer, which laneCallOn received).
var laneCalls = sync.Pool{New: func() any {
	return &call{ch: make(chan error, 1), lead: make(chan struct{}, 1)}
}}

func newLaneCall(reply any) *call {
	cl := laneCalls.Get().(*call)
	cl.reply = reply
	return cl
}

func freeLaneCall(cl *call) {
	select {
	case <-cl.lead: // the reading, handed over as the answer came
	default:
	}
	if len(cl.ch) != 0 || cl.following {
		return // cannot happen (see laneCalls); if it did, never reuse it
	}
	*cl = call{ch: cl.ch, lead: cl.lead}
	laneCalls.Put(cl)
}

// laneCallOn is laneCall with its call made.
func (c *Client) laneCallOn(ctx context.Context, deadline time.Time, l *sock.Blocking, kind Kind, req any, cl *call) error {
	c.mu.Lock()
	if c.err != nil {
		err := c.err
		c.mu.Unlock()
		return err
	}
	c.nextID++
	cl.id = c.nextID
	c.pending[cl.id] = cl
	c.mu.Unlock()

	// The reading is taken only once the request has gone: a caller that
	// waits for room to send must not keep others' answers unread.
	if err := c.writeLane(ctx, deadline, l, cl.id, kind, req); err != nil {
		if c.take(cl.id) != nil {
			return err
		}
		return <-cl.ch // the connection failed meanwhile and answered the call
	}
	c.mu.Lock()
	if c.pending[cl.id] != cl {
		c.mu.Unlock()
		return <-cl.ch // answered already
	}
	lead := c.leader == nil
	if lead {
		c.leader = cl
	} else {
		c.follow(cl)
	}
	wakeDrainer := !lead && c.leader == c.draining
	c.mu.Unlock()
	if wakeDrainer {
		l.Wake() // it hands the reading over
	}
	if !lead {
		if err, done := c.await(ctx, deadline, l, cl); done {
			return err
		}
	}
	return c.lead(ctx, deadline, l, cl)
}

// await waits, as a follower, for cl's answer, the end of ctx or the
// deadline, or for the reading to be handed over to it (done=false). At
// the deadline, while anything is queued on the lane l or the reader
// holds what it took (sock.Blocking.CaughtUp), it waits for the reader
// to deal with it, catchUpWait at most: the answer may have come in time
// while this process did not run (stopped, traced, starved of CPU).
func (c *Client) await(ctx context.Context, deadline time.Time, l *sock.Blocking, cl *call) (err error, done bool) {
	var expired <-chan time.Time
	if !deadline.IsZero() {
		if d, ok := ctx.Deadline(); !ok || deadline.Before(d) {
			t := time.NewTimer(time.Until(deadline))
			defer t.Stop()
			expired = t.C
		}
	}
	select {
	case err := <-cl.ch:
		c.mu.Lock()
		c.resignLane(cl)
		c.mu.Unlock()
		return err, true
	case <-cl.lead:
		return nil, false
	case <-ctx.Done():
		err = ctx.Err()
	case <-expired:
		err = context.DeadlineExceeded
	}
	if errors.Is(err, context.DeadlineExceeded) {
		cl.lateSince = time.Now()
		switch got, aerr := catchUp(l.CaughtUp, cl.ch, cl.lead, nil); got {
		case answerCame:
			c.mu.Lock()
			c.resignLane(cl)
			c.mu.Unlock()
			return aerr, true
		case leadCame:
			return nil, false // it reads for itself now, late: what is queued first
		}
	}
	c.mu.Lock()
	if c.pending[cl.id] == cl {
		delete(c.pending, cl.id)
		c.unfollow(cl)
		c.owed++ // its answer will still come
		c.resignLane(cl)
		c.mu.Unlock()
		c.giveUp(cl.id)
		return err, true
	}
	c.resignLane(cl)
	c.mu.Unlock()
	return <-cl.ch, true // the answer came meanwhile
}

// lead reads the lane for cl until its answer comes, its context ends or
// the connection does, handing the answers of others to them; then it
// hands the reading over.
func (c *Client) lead(ctx context.Context, deadline time.Time, l *sock.Blocking, cl *call) error {
	var stop func() bool
	if ctx.Done() != nil {
		// The reader blocks in the kernel; the lane's wake-up is how a
		// cancellation reaches it.
		stop = context.AfterFunc(ctx, l.Wake)
	}
	err, answered := c.readLane(ctx, deadline, l, cl)
	if stop != nil {
		stop()
	}
	c.mu.Lock()
	c.resignLane(cl)
	c.mu.Unlock()
	if answered {
		return err
	}
	return <-cl.ch
}

// readLane is lead's loop. It reports answered=false when someone else
// took cl from pending (the end of the connection, which answers it).
func (c *Client) readLane(ctx context.Context, deadline time.Time, l *sock.Blocking, cl *call) (err error, answered bool) {
	// A call that cannot be cancelled waits for its answer, its deadline
	// or the end of the connection in one blocking receive: nobody needs
	// to wake it.
	unwoken := ctx.Done() == nil
	delivered := false
	// late is set once the deadline has passed: what is queued on the lane
	// is read first, without waiting, since an answer may have come in
	// time while this process did not run (stopped, traced, starved of
	// CPU); the call gives up when nothing more is (notices of messages
	// not come count as nothing), or at lateUntil.
	late := false
	var lateUntil time.Time // catchUpWait after the deadline: however much comes, it gives up then
	for {
		if delivered {
			// The callers it answered wait on this thread's P, which the
			// runtime does not hand over when Recv blocks: let them run
			// first instead of waiting for the runtime to notice.
			runtime.Gosched()
			delivered = false
		}
		if spin := c.spin; spin > 0 && !late && ctx.Err() == nil {
			// Not past the deadline; a cancellation ends it (its Wake,
			// which only a call that can be cancelled looks at: a Wake
			// left over would end every later spin of a call that
			// cannot, whose receive never clears it).
			if !deadline.IsZero() {
				spin = min(spin, time.Until(deadline))
			}
			switch {
			case spin <= 0:
			case unwoken:
				l.SpinReadable(spin)
			default:
				l.SpinWakeable(spin)
			}
		}
		var n int
		var files []*os.File
		switch {
		case late && !time.Now().Before(lateUntil):
			err = sock.ErrNoMessage
		case late:
			n, files, err = l.TryRecv(c.laneBuf)
			if errors.Is(err, sock.ErrNoMessage) && l.Queued() {
				continue // notices ahead of what is queued: a receive takes only so many
			}
		case unwoken && c.following.Load() == 0:
			// A plain blocking receive marks what it takes only as it
			// returns (see sock.Blocking.CaughtUp): with a call waiting
			// behind the reader when it begins to receive, which looks
			// at the mark when its deadline passes, the reader takes
			// what it can without waiting, or waits first, and marks
			// what it takes before it leaves the socket's queue either
			// way (the cases below). (A call that begins to wait while the
			// plain receive is under way is not covered: see the
			// package doc.)
			n, files, err = l.RecvBy(c.laneBuf, deadline)
		case c.following.Load() > 0 && ctx.Err() == nil && (deadline.IsZero() || time.Now().Before(deadline)):
			// Other calls wait: their answers may be queued already, and
			// taking one needs no wait. Only while this call is in time:
			// the receive that waits is the one that sees its deadline
			// pass or its context end, however much is queued.
			n, files, err = l.TryRecv(c.laneBuf)
			if errors.Is(err, sock.ErrNoMessage) {
				n, files, err = l.Recv(c.laneBuf, deadline)
			}
		default:
			n, files, err = l.Recv(c.laneBuf, deadline)
		}
		if err != nil {
			if !errors.Is(err, sock.ErrWoken) && !errors.Is(err, os.ErrDeadlineExceeded) && !errors.Is(err, sock.ErrNoMessage) {
				var until time.Time
				if !deadline.IsZero() {
					until = deadline.Add(catchUpWait)
				}
				if c.laneEnded(err, ctx.Done(), until) || c.take(cl.id) == nil {
					return nil, false
				}
				// Its own bound came first: it gives up as at its
				// deadline, with no answer owed (the lane is gone).
				cerr := ctx.Err()
				if cerr == nil {
					cerr = context.DeadlineExceeded
				}
				return cerr, true
			}
			cerr := ctx.Err()
			if cerr == nil && !deadline.IsZero() && !time.Now().Before(deadline) {
				cerr = context.DeadlineExceeded // the timer may not have marked ctx yet
			}
			if cerr == nil {
				continue // a wake-up meant for an earlier reader
			}
			if errors.Is(cerr, context.DeadlineExceeded) && !late {
				late, lateUntil = true, time.Now().Add(catchUpWait)
				if !cl.lateSince.IsZero() {
					lateUntil = cl.lateSince.Add(catchUpWait) // it waited for the reader before (await)
				}
				continue
			}
			if c.take(cl.id) == nil {
				return nil, false
			}
			c.mu.Lock()
			c.owed++ // its answer will still come
			c.mu.Unlock()
			c.giveUp(cl.id)
			return cerr, true
		}
		if hook := laneReceived.Load(); hook != nil {
			(*hook)(c)
		}
		f, err := laneAnswer(c.laneBuf[:n], files)
		if err != nil {
			dropFiles(files)
			c.fail(err)
			l.Dealt()
			return nil, false
		}
		if f.ID != cl.id {
			c.deliverLane(f, files) // another caller's, or one nobody waits for
			l.Dealt()
			delivered = true
			continue
		}
		l.Dealt()
		if c.take(cl.id) == nil {
			dropFiles(files)
			return nil, false
		}
		return decodeAnswer(f, files, cl.reply), true
	}
}

// laneReceived, when set (by tests), runs in a call reading the lane
// as each message has been received, before anything is done with it:
// a reader stopped there (its process stopped, traced or starved of CPU)
// holds a message that calls waiting behind it must see (the receive
// marked it: see sock.Blocking.CaughtUp).
var laneReceived atomic.Pointer[func(*Client)]

// giveUp tells the server that the lane call of id was given up, so that
// its handler's context ends (see KindCancel). The notice goes only if it
// fits in the server's queue at once: a server whose queue is full is not
// reading its lane, and answers in its own time anyway.
func (c *Client) giveUp(id uint64) {
	l := c.lane.Load()
	if l == nil {
		return
	}
	b, err := AppendFrame(nil, id, KindCancel, 0, &Cancel{})
	if err == nil {
		_ = l.TrySend(b, nil) // a lane that failed is the reader's to find
	}
}

// laneGrace bounds how long a caller that saw the lane end waits for the
// connection to say why: a server that ends the connection tells the
// reason there (ErrLimit, say), and closes both at once.
const laneGrace = time.Second

// laneEnded ends the connection after the lane failed with err; a lane
// the server closed first gives the connection laneGrace to end and say
// why. The call reading the lane, if any, waits no longer than its own
// bound (done: its context's; until: the end of its time, zero for
// none): laneEnded then reports false and the grace goes on without it,
// so that a server that closes the lane alone holds no call past its
// time. A connection that has ended already comes first, though the
// call's bound has passed too (its process was stopped past it).
func (c *Client) laneEnded(err error, done <-chan struct{}, until time.Time) (ended bool) {
	if !errors.Is(err, io.EOF) && !errors.Is(err, sock.ErrPeerClosed) {
		c.fail(connErr(err))
		return true
	}
	grace := time.NewTimer(laneGrace)
	var bound <-chan time.Time
	if !until.IsZero() {
		b := time.NewTimer(time.Until(until))
		defer b.Stop()
		bound = b.C
	}
	ended = true
	select {
	case <-c.done: // ended already: its reason, not the call's bound
	default:
		select {
		case <-c.done:
		case <-grace.C:
		case <-done:
			ended = false
		case <-bound:
			ended = false
		}
	}
	if ended {
		grace.Stop()
		c.fail(connErr(err))
		return true
	}
	go func() {
		defer grace.Stop()
		select {
		case <-c.done:
		case <-grace.C:
		}
		c.fail(connErr(err))
	}()
	return false
}

// laneAnswer parses a frame read on the lane, which must be the answer
// to a call.
func laneAnswer(b []byte, files []*os.File) (Frame, error) {
	f, err := ParseFrame(b)
	if err == nil && f.Files != len(files) {
		err = fmt.Errorf("%w: %s frame declares %d files, %d came", ErrMalformed, f.Kind, f.Files, len(files))
	}
	if err == nil && (f.Kind != KindReply && f.Kind != KindError || f.ID == 0) {
		err = fmt.Errorf("%w: %s frame with id %d on the call lane", ErrUnknownKind, f.Kind, f.ID)
	}
	return f, err
}

// deliverLane hands an answer read on the lane to its caller, or drops
// it, settling what is owed, if its caller gave up.
func (c *Client) deliverLane(f Frame, files []*os.File) {
	if cl := c.take(f.ID); cl != nil {
		cl.ch <- decodeAnswer(f, files, cl.reply)
		return
	}
	dropFiles(files)
	c.mu.Lock()
	if c.owed > 0 {
		c.owed--
	}
	c.mu.Unlock()
	c.log.Debug("ipc: dropped an answer nobody waits for", "id", f.ID, "kind", f.Kind)
}

// resignLane is resign for the lane: if nobody takes the reading over
// while answers are still owed to calls that gave up, a drainer does, so
// that those answers do not fill the lane while no call is made (the
// server would take the client for one that does not read its replies).
// Call it with mu held.
func (c *Client) resignLane(cl *call) {
	if c.leader != cl {
		return
	}
	c.resign(cl)
	l := c.lane.Load()
	if c.leader != nil || c.owed == 0 || c.err != nil || l == nil {
		return
	}
	d := &call{}
	c.leader, c.draining = d, d
	c.reader.Add(1) // the connection's reader holds it above zero
	go c.drain(l, d)
}

// drain reads the lane for the drainer d while no caller does, dropping
// the answers owed to calls that gave up, until none is owed or a caller
// comes (it wakes the lane: see laneCall), who then takes the reading
// over.
func (c *Client) drain(l *sock.Blocking, d *call) {
	defer c.reader.Done()
	for {
		if c.drained(d) {
			return
		}
		n, files, err := l.Recv(c.laneBuf, time.Time{})
		if errors.Is(err, sock.ErrWoken) {
			continue
		}
		if err != nil {
			c.laneEnded(err, nil, time.Time{})
			return
		}
		f, err := laneAnswer(c.laneBuf[:n], files)
		if err != nil {
			dropFiles(files)
			c.fail(err)
			l.Dealt()
			return
		}
		c.deliverLane(f, files)
		l.Dealt()
	}
}

// drained reports whether the drainer d is done, handing the reading to
// the first caller waiting if there is one.
func (c *Client) drained(d *call) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.leader != d {
		return true // the connection ended
	}
	if c.firstF == nil && c.owed > 0 && c.err == nil {
		return false
	}
	c.draining = nil
	c.resign(d)
	return true
}

// follow queues cl for the reading. Call it with mu held.
func (c *endpoint) follow(cl *call) {
	if cl.lead == nil {
		cl.lead = make(chan struct{}, 1)
	}
	cl.following = true
	c.following.Add(1)
	cl.prev, cl.next = c.lastF, nil
	if c.lastF != nil {
		c.lastF.next = cl
	} else {
		c.firstF = cl
	}
	c.lastF = cl
}

// unfollow takes cl out of the queue for the reading, if it is there.
// Call it with mu held.
func (c *endpoint) unfollow(cl *call) {
	if !cl.following {
		return
	}
	if cl.prev != nil {
		cl.prev.next = cl.next
	} else {
		c.firstF = cl.next
	}
	if cl.next != nil {
		cl.next.prev = cl.prev
	} else {
		c.lastF = cl.prev
	}
	cl.prev, cl.next, cl.following = nil, nil, false
	c.following.Add(-1)
}

// resign hands the reading over to the first caller waiting, if cl has
// it. Call it with mu held.
func (c *endpoint) resign(cl *call) {
	if c.leader != cl {
		return
	}
	c.leader = c.firstF
	if next := c.firstF; next != nil {
		c.unfollow(next)
		next.lead <- struct{}{}
	}
}
