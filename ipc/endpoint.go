package ipc

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/mpmr/mpmr/internal/sys/sock"
)

// DefaultWriteTimeout is how long a frame may wait for room in the peer's
// receive queue when no shorter deadline applies. A peer that takes no
// message for that long is not reading: its connection is dropped.
const DefaultWriteTimeout = 5 * time.Second

// WithFiles attaches open files to a message body: pass it (or a pointer
// to it) as a request, push or reply to send them with the body, and a
// *WithFiles whose Body points at the reply value as the reply target of
// Call or Push to receive them. The receiver gets its own descriptors,
// close-on-exec, and owns those. The sender's files stay open and its own
// unless CloseAfterSend is set: then they are closed once the message has
// gone or failed to (for a file made only to be sent, such as in a reply,
// which the handler cannot close after returning). A plain value; the
// files must stay open until the call that sends them returns.
type WithFiles struct {
	Body           any
	Files          []*os.File
	CloseAfterSend bool
}

func splitFiles(body any) (payload any, files []*os.File, closeAfter bool) {
	switch w := body.(type) {
	case WithFiles:
		return w.Body, w.Files, w.CloseAfterSend
	case *WithFiles:
		return w.Body, w.Files, w.CloseAfterSend
	}
	return body, nil, false
}

// Decoder hands a handler the body of one request or push. It is valid
// only during the handler call and is not safe for concurrent use.
type Decoder struct {
	body  []byte
	files []*os.File
	err   error // the first decoding failure: it costs the peer its connection
}

// Decode decodes the body into v as Unmarshal does. A failure (wrapping
// ErrMalformed) means the peer sent a bad message: once the handler
// returns, its connection is closed and no reply is sent.
func (d *Decoder) Decode(v any) error {
	err := Unmarshal(d.body, v)
	if err != nil && d.err == nil {
		d.err = err
	}
	return err
}

// Files returns the files that came with the message and hands them over
// to the caller, who must close them. Files not taken by the time the
// handler returns are dropped as refused ones are (sock.Drop): a socket
// among them is reset, and a unix one shut down for reading and emptied,
// for its sender too if it still holds it. Take the files to keep them
// as they are.
func (d *Decoder) Files() []*os.File {
	f := d.files
	d.files = nil
	return f
}

func (d *Decoder) release() {
	dropFiles(d.files)
	d.files = nil
}

// dropFiles closes descriptors that came from the peer and nobody takes;
// see sock.Drop.
func dropFiles(files []*os.File) { sock.Drop(files) }

// message is a received request or push waiting for its handler. Its body
// is a copy: the receive buffer is reused for the next frame. A request
// refused on arrival (over a limit) carries why instead of a body and
// files, and is answered with that error without a handler.
type message struct {
	id      uint64
	kind    Kind
	body    []byte
	files   []*os.File
	refused error
	lane    *sock.Blocking // the call lane it came on, where its answer goes; nil: the connection
	hello   bool           // a stranger's hello: counted as running from its arrival on

	// The handler's context, for a request not handled inline: it ends
	// with the connection, or when the client gives the call up (see
	// Peer.cancelCall). Nil for one handled inline.
	ctx    context.Context
	cancel context.CancelFunc
}

// call is one request or push waiting for its answer.
type call struct {
	id    uint64
	reply any
	ch    chan error // buffered: whoever takes the call from pending sends once

	// A call on the lane (see Client) that waits for its answer while
	// another reads the lane follows it: it is linked in the client's
	// followers, and lead (buffered) tells it to take over the reading.
	lead       chan struct{}
	prev, next *call
	following  bool
	// lateSince is when it began, past its deadline, to wait for the
	// reader to take what is queued: handed the reading then, it reads
	// what is queued until catchUpWait from then, not from anew.
	lateSince time.Time
}

// endpoint is what both ends of a connection share: writing frames,
// matching answers to the calls that wait for them, and recording why the
// connection ended.
type endpoint struct {
	conn         *Conn
	log          *slog.Logger
	writeTimeout time.Duration
	spin         time.Duration // how long the reader polls before it sleeps
	wsem         chan struct{} // the write lock; a channel so waiting honours ctx

	// frameLimit, when set, gives the largest frame the reader accepts
	// now (else MaxMessage); rearm, when set, says whether the reader
	// goes on after its read deadline fired (someone woke it on purpose);
	// ending, when set, learns why the connection ends before the socket
	// closes.
	frameLimit func() int
	rearm      func() bool
	ending     func(err error)
	server     bool // a Server's end of the connection (for tests' hooks)

	ctx    context.Context // handlers' context: cancelled when the connection ends
	cancel context.CancelFunc

	// lane is the call lane once the server has handed it over: requests
	// and their answers travel there, pushes and theirs on conn. Set once,
	// under mu, and only while the connection is open; fail closes it.
	lane atomic.Pointer[sock.Blocking]
	// laneWait is where frames wait their turn for room on the lane (see
	// writeLane); laneFrames counts the frames sent there.
	laneWait   chan struct{}
	laneFrames atomic.Uint64

	mu      sync.Mutex
	nextID  uint64
	pending map[uint64]*call
	// The reading of a client's lane: leader is the call whose goroutine
	// reads it now (nil: none), firstF to lastF the other calls waiting
	// for their answers there, in order.
	leader        *call
	firstF, lastF *call
	following     atomic.Int32  // how many calls are in firstF to lastF; read without mu
	err           error         // why the connection ended; nil while it is open
	done          chan struct{} // closed when err is set
}

func (e *endpoint) init(conn *Conn, log *slog.Logger, writeTimeout time.Duration) {
	if log == nil {
		log = slog.Default()
	}
	if writeTimeout <= 0 {
		writeTimeout = DefaultWriteTimeout
	}
	e.conn, e.log, e.writeTimeout = conn, log, writeTimeout
	e.wsem = make(chan struct{}, 1)
	e.laneWait = make(chan struct{}, 1)
	e.ctx, e.cancel = context.WithCancel(context.Background())
	e.pending = map[uint64]*call{}
	e.done = make(chan struct{})
}

// Err returns why the connection ended, or nil while it is open.
func (e *endpoint) Err() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.err
}

// fail ends the connection for cause (the first cause wins): every
// pending call fails, handlers' context is cancelled, the socket closes.
func (e *endpoint) fail(cause error) {
	err := gone(cause)
	e.mu.Lock()
	if e.err != nil {
		e.mu.Unlock()
		return
	}
	e.err = err
	pending := e.pending
	e.pending = nil
	e.leader = nil
	for e.firstF != nil { // nobody reads the lane any more: nobody to hand it to
		e.unfollow(e.firstF)
	}
	close(e.done)
	e.mu.Unlock()

	if e.ending != nil {
		e.ending(err)
	}
	// Close before cancelling: a handler that sees its context end must
	// find the connection gone, not slip an answer out.
	e.conn.Close()
	if l := e.lane.Load(); l != nil {
		l.Close()
	}
	e.cancel()
	for _, c := range pending {
		c.ch <- err
	}
}

// hasEnded reports whether the connection has ended (its done is closed).
func (e *endpoint) hasEnded() bool {
	select {
	case <-e.done:
		return true
	default:
		return false
	}
}

// farewell tells the peer why the connection ends, if that can be done at
// once: not while another frame is being written (the peer is then
// likely not reading), nor waiting more than farewellWait for room.
func (e *endpoint) farewell(why error) {
	select {
	case e.wsem <- struct{}{}:
	default:
		return
	}
	defer func() { <-e.wsem }()
	if e.Err() == nil {
		_ = tell(e.conn, why, time.Now().Add(farewellWait))
	}
}

var frameBufs = sync.Pool{New: func() any { b := make([]byte, 0, 512); return &b }}

// frame is an encoded frame ready to send: b, in a pooled buffer, with
// the descriptors that go with it.
type frame struct {
	b          []byte
	files      []*os.File
	closeAfter bool    // close files once done (a WithFiles asked so)
	buf        *[]byte // the pool's buffer b came from
}

// encodeFrame makes the frame of body, checked against the limits on
// descriptors and size. Call release when done with it, whatever the error.
func encodeFrame(id uint64, kind Kind, body any) (frame, error) {
	payload, files, closeAfter := splitFiles(body)
	f := frame{files: files, closeAfter: closeAfter, buf: frameBufs.Get().(*[]byte)}
	if len(files) > MaxFiles {
		return f, fmt.Errorf("ipc: %s with %d files, at most %d", kind, len(files), MaxFiles)
	}
	var err error
	f.b, err = AppendFrame((*f.buf)[:0], id, kind, len(files), payload)
	if err != nil {
		return f, err
	}
	if len(f.b) > MaxMessage {
		return f, fmt.Errorf("%w: %s frame of %d bytes", ErrTooLarge, kind, len(f.b))
	}
	return f, nil
}

// release gives the buffer back and closes the descriptors a WithFiles
// asked to close once sent.
func (f *frame) release() {
	if f.closeAfter {
		for _, file := range f.files {
			file.Close()
		}
	}
	if f.b != nil && cap(f.b) <= 2*MaxMessage {
		*f.buf = f.b[:0]
		frameBufs.Put(f.buf)
	}
}

// write sends one frame. It fails without harm to the connection when the
// body cannot be encoded or is too large, or when ctx ends before the
// frame could go (a datagram goes whole or not at all). Any other failure
// ends the connection.
func (e *endpoint) write(ctx context.Context, id uint64, kind Kind, body any) error {
	return e.writeBounded(ctx, ctx, id, kind, body, false)
}

// writeBounded is write, with bounded saying whether ctx's deadline is the
// send's own bound (see callWithin) rather than the caller's patience,
// caller's context (ctx's parent, or ctx itself).
func (e *endpoint) writeBounded(ctx, caller context.Context, id uint64, kind Kind, body any, bounded bool) error {
	f, err := encodeFrame(id, kind, body)
	defer f.release()
	if err != nil {
		return err
	}
	b, files := f.b, f.files

	select {
	case e.wsem <- struct{}{}:
	case <-ctx.Done():
		// A bound of the send's own that ran out while the send waited
		// for its turn, or before it could wait at all: this process
		// may not have run (stopped, traced, starved of CPU), and the
		// turn may have been free all along, or be about to be, as the
		// other sends that resumed with this one take theirs. Wait
		// catchUpWait more for the turn, within the caller's patience.
		if !bounded || !errors.Is(ctx.Err(), context.DeadlineExceeded) {
			return ctx.Err()
		}
		if err := e.lateTurn(caller); err != nil {
			return err
		}
	case <-e.done:
		return e.Err()
	}
	select { // the lock may have been free while the connection ended
	case <-e.done:
		<-e.wsem
		return e.Err()
	default:
	}
	// A send waits only when the peer's queue is full. Its deadline is
	// the context's or the write timeout, whichever comes first; a context
	// that can be cancelled but has no deadline gets the deadline moved
	// to the past on cancellation (with a deadline, that one bounds it).
	deadline := time.Now().Add(e.writeTimeout)
	ctxDeadline, hasDeadline := ctx.Deadline()
	byCtx := hasDeadline && ctxDeadline.Before(deadline)
	if byCtx {
		deadline = ctxDeadline
	}
	if ctx.Done() != nil && !hasDeadline {
		fired := make(chan struct{})
		stop := context.AfterFunc(ctx, func() {
			e.conn.interruptSend()
			close(fired)
		})
		err = e.conn.send(b, files, deadline)
		if !stop() {
			<-fired // let it finish before the next writer sets its deadline
		}
	} else {
		err = e.conn.send(b, files, deadline)
	}
	if errors.Is(err, os.ErrDeadlineExceeded) && (!byCtx || bounded) && !errors.Is(ctx.Err(), context.Canceled) {
		// The wait for room ran out, not the caller's patience: if this
		// process did not run meanwhile (stopped, traced, starved of CPU),
		// the peer may have made room; it is not to be judged by this
		// process's stall. One more try, without waiting; it fails as
		// a send in time would, unless only for want of room.
		if terr := e.conn.trySend(b, files); !errors.Is(terr, sock.ErrWouldBlock) {
			err = terr
		}
	}
	<-e.wsem

	if errors.Is(err, os.ErrDeadlineExceeded) {
		if err := ctx.Err(); err != nil {
			return err
		}
		if byCtx {
			return context.DeadlineExceeded // the timer may not have marked ctx yet
		}
		err = fmt.Errorf("%w: peer took no message for %v", errSlowReader, e.writeTimeout)
	}
	if errors.Is(err, ErrFilesRefused) {
		return err // nothing went: the connection is whole
	}
	if errors.Is(err, ErrPeerGone) {
		// The peer closed its end. One that ends a connection says why
		// first (a limit, a refusal), in a frame the reader may not have
		// handled yet: the reader, which takes what is queued up to the
		// end, ends the connection with it. Waited for laneGrace at most,
		// within the send's bound (its context's deadline or the write
		// timeout) and the caller's patience: a peer that shut only its
		// reading side keeps the connection open, and the end may not
		// come.
		if h := sentToClosed.Load(); h != nil {
			(*h)()
		}
		grace := time.NewTimer(max(min(peerClosedGrace, time.Until(deadline)), 0))
		select {
		case <-e.done:
		case <-grace.C:
		case <-ctx.Done():
		case <-caller.Done():
		}
		grace.Stop()
	}
	if err != nil {
		e.fail(err)
		return e.Err()
	}
	return nil
}

// peerClosedGrace is how long a send that found the peer's end closed
// waits for the reader to say why; a variable for tests.
var peerClosedGrace = laneGrace

// frameTaken and sentToClosed, when set (by tests), run when a reader has
// taken a frame off the socket, before it handles it (told whether it is
// a Server's), and when a send finds the peer's end closed.
var (
	frameTaken   atomic.Pointer[func(server bool)]
	sentToClosed atomic.Pointer[func()]
)

// call sends a request or push and waits for its answer, decoded into
// reply (which may be nil, or a *WithFiles).
func (e *endpoint) call(ctx context.Context, kind Kind, req, reply any) error {
	return e.callWithin(ctx, 0, kind, req, reply)
}

// callWithin is call, with within, when not zero, bounding the send and,
// counted from when the frame went, the wait for the answer: a stall of
// this process before the frame went does not eat into the peer's time.
func (e *endpoint) callWithin(ctx context.Context, within time.Duration, kind Kind, req, reply any) error {
	sendCtx := ctx
	if within > 0 {
		var cancel context.CancelFunc
		sendCtx, cancel = context.WithTimeout(ctx, within)
		defer cancel()
	}
	c := &call{reply: reply, ch: make(chan error, 1)}
	e.mu.Lock()
	if e.err != nil {
		// First: a connection that has ended says why (a limit, say)
		// even to a call whose time ran out before it was made.
		err := e.err
		e.mu.Unlock()
		return err
	}
	if err := ctx.Err(); err != nil {
		e.mu.Unlock()
		return err
	}
	e.nextID++
	id := e.nextID
	e.pending[id] = c
	e.mu.Unlock()

	// The send's deadline is its own bound unless the caller's comes first.
	d, hasDeadline := ctx.Deadline()
	bounded := within > 0 && (!hasDeadline || !d.Before(time.Now().Add(within)))
	if h := pushSending.Load(); h != nil && within > 0 {
		(*h)(sendCtx)
	}
	if err := e.writeBounded(sendCtx, ctx, id, kind, req, bounded); err != nil {
		if e.take(id) != nil {
			return err
		}
		return <-c.ch // the connection failed meanwhile and answered the call
	}
	if within > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, within)
		defer cancel()
	}
	select {
	case err := <-c.ch:
		return err
	case <-ctx.Done():
		if errors.Is(ctx.Err(), context.DeadlineExceeded) {
			if answered, err := e.cameInTime(c); answered {
				return err
			}
		}
		if e.take(id) != nil {
			return ctx.Err()
		}
		// The reader took the call an instant ago and is decoding into
		// reply: wait for it, so that reply is not written after return.
		return <-c.ch
	}
}

// lateTurn takes the write turn for a send whose bound has run out,
// waiting catchUpWait at most, and no longer than caller's context lasts:
// nil once it has it, else context.DeadlineExceeded, the caller's error,
// or the connection's if it ended.
func (e *endpoint) lateTurn(caller context.Context) error {
	if err := caller.Err(); err != nil {
		return err
	}
	select {
	case e.wsem <- struct{}{}:
		return nil
	default:
	}
	wait := catchUpWait
	if d, ok := caller.Deadline(); ok {
		wait = min(wait, time.Until(d))
	}
	t := time.NewTimer(wait)
	defer t.Stop()
	select {
	case e.wsem <- struct{}{}:
		if err := caller.Err(); err != nil {
			<-e.wsem
			return err
		}
		return nil
	case <-caller.Done():
		return caller.Err()
	case <-e.done:
		return e.Err()
	case <-t.C:
		return context.DeadlineExceeded
	}
}

// pushSending, when set (by this package's tests), runs in PushWithin with
// the context that bounds the send, as the push is about to be sent:
// where the pushing process may stop before its push went out.
var pushSending atomic.Pointer[func(context.Context)]

// catchUpWait bounds how long a call whose deadline has passed waits for
// the connection's reader to take what the peer sent by then (see
// cameInTime), and catchUpLook how often it looks; it also bounds how
// long a push whose send's bound ran out waits for its turn to write
// (see lateTurn).
const (
	catchUpWait = 100 * time.Millisecond
	catchUpLook = time.Millisecond
)

// cameInTime is for call c, whose deadline has passed: its answer may
// wait in the socket, unread, because this process did not run when it
// came (stopped, traced, starved of CPU) and the deadline's timer fired
// before the reader woke. The peer is not to be blamed for this process's
// stall: c waits until the reader has taken everything queued, at most
// catchUpWait, and reports the answer if the reader found it. What counts
// is that the answer was there when this process came to judge, not the
// time it was sent: one sent while this process was stopped, after the
// deadline, counts too, since nothing was judged before it came. A peer
// that has not answered by then leaves nothing queued and costs a look at
// the socket; one that keeps the reader busy gains catchUpWait at most.
func (e *endpoint) cameInTime(c *call) (answered bool, err error) {
	if got, err := catchUp(e.conn.caughtUp, c.ch, nil, e.done); got == answerCame {
		return true, err
	}
	select {
	case err := <-c.ch:
		return true, err
	default:
		return false, nil
	}
}

// caughtUpWith is how catchUp's wait ended.
type caughtUpWith int

const (
	nothingCame caughtUpWith = iota // the reader took what was queued, or the time ran out, or the connection ended
	answerCame                      // the answer came
	leadCame                        // the reading was handed over
)

// catchUp waits, for a call whose deadline has passed, while caughtUp says
// the reader has not yet taken what is queued, looking every catchUpLook
// and for catchUpWait at most, for the call's answer (and its error), the
// reading handed over to it on lead (nil: not a follower), or the end of
// the connection (done).
func catchUp(caughtUp func() bool, answer <-chan error, lead, done <-chan struct{}) (caughtUpWith, error) {
	if caughtUp() {
		return nothingCame, nil
	}
	giveUp := time.NewTimer(catchUpWait)
	defer giveUp.Stop()
	look := time.NewTicker(catchUpLook)
	defer look.Stop()
	for {
		select {
		case err := <-answer:
			return answerCame, err
		case <-lead:
			return leadCame, nil
		case <-done:
			return nothingCame, nil
		case <-giveUp.C:
			return nothingCame, nil
		case <-look.C:
			if caughtUp() {
				return nothingCame, nil
			}
		}
	}
}

// take removes the call waiting for id. Whoever takes it answers it.
func (e *endpoint) take(id uint64) *call {
	e.mu.Lock()
	defer e.mu.Unlock()
	c := e.pending[id]
	if c != nil {
		delete(e.pending, id)
		e.unfollow(c)
	}
	return c
}

// installLane makes l the connection's call lane, unless the connection
// has ended (then l is closed) or has one already (an error).
func (e *endpoint) installLane(l *sock.Blocking) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.err != nil {
		l.Close()
		return nil
	}
	if e.lane.Load() != nil {
		l.Close()
		return errors.New("a second call lane")
	}
	e.lane.Store(l)
	return nil
}

// laneWriteSlice bounds each wait of a frame for room on the lane, so
// that the waiter tries again (see waitLane) and notices its context's end
// in between (the lane's one wake-up is its reader's). A peer that reads
// is dropped as one that does not at most this long after WriteTimeout.
const laneWriteSlice = 10 * time.Millisecond

// writeLane sends one frame on the call lane l, as write does on the
// connection: it fails without harm to the connection when the body
// cannot be encoded, is too large, or when ctx ends or callDeadline (zero:
// none) passes before the frame could go; any other failure ends the
// connection.
//
// A frame goes at once if the peer's queue has room. Otherwise it waits
// in laneWait, one at a time: a frame waiting for room blocks its thread
// in the kernel, and a peer that does not read must not cost a thread
// per answer it leaves waiting (a Go program dies at its thread limit).
func (e *endpoint) writeLane(ctx context.Context, callDeadline time.Time, l *sock.Blocking, id uint64, kind Kind, body any) error {
	f, err := encodeFrame(id, kind, body)
	defer f.release()
	if err != nil {
		return err
	}
	b, files := f.b, f.files
	if err := l.TrySend(b, files); !errors.Is(err, sock.ErrWouldBlock) {
		return e.laneSent(err)
	}
	return e.waitLane(ctx, callDeadline, l, b, files)
}

// waitLane is writeLane's wait for room, in turn with the other frames
// that wait. The wait ends at the context's deadline or callDeadline, or
// once the peer has taken no frame for the write timeout: frames that
// went meanwhile (at once, or those that waited before) show the peer
// reads, however long this one waited for its turn.
func (e *endpoint) waitLane(ctx context.Context, callDeadline time.Time, l *sock.Blocking, b []byte, files []*os.File) error {
	end := callDeadline // the earlier of callDeadline and ctx's; zero: none
	if d, ok := ctx.Deadline(); ok && (end.IsZero() || d.Before(end)) {
		end = d
	}
	var expired <-chan time.Time
	if !end.IsZero() {
		t := time.NewTimer(time.Until(end))
		defer t.Stop()
		expired = t.C
	}
	select {
	case e.laneWait <- struct{}{}:
	case <-ctx.Done():
		return ctx.Err()
	case <-expired:
		return context.DeadlineExceeded
	case <-e.done:
		return e.Err()
	}
	defer func() { <-e.laneWait }()
	deadline := time.Now().Add(e.writeTimeout)
	sent := e.laneFrames.Load()
	for {
		// Every slice starts with a send: a unix socket tells poll there
		// is room only once the peer has read three quarters of what waits,
		// while a frame fits as soon as the peer has read enough for it.
		slice := time.Now().Add(laneWriteSlice)
		if deadline.Before(slice) {
			slice = deadline
		}
		if !end.IsZero() && end.Before(slice) {
			slice = end
		}
		err := l.Send(b, files, slice)
		if !errors.Is(err, os.ErrDeadlineExceeded) {
			return e.laneSent(err)
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		now := time.Now()
		if !end.IsZero() && !now.Before(end) {
			return context.DeadlineExceeded // the timer may not have marked ctx yet
		}
		if n := e.laneFrames.Load(); n != sent {
			// A frame went during the slice (one that did not wait, or
			// one that waited before this one): the peer reads.
			sent, deadline = n, now.Add(e.writeTimeout)
		} else if !now.Before(deadline) {
			return e.laneSent(fmt.Errorf("%w: peer took no message for %v", errSlowReader, e.writeTimeout))
		}
	}
}

// laneSent settles a frame's send on the lane: counted if it went, else
// the end of the connection.
func (e *endpoint) laneSent(err error) error {
	if err == nil {
		e.laneFrames.Add(1)
		return nil
	}
	if !errors.Is(err, errSlowReader) {
		err = connErr(err)
	}
	if errors.Is(err, ErrFilesRefused) {
		return err // nothing went but its notice, which the next frame with descriptors uses
	}
	e.fail(err)
	return e.Err()
}

// readLoop receives frames until the connection ends and returns why:
// answers go to their calls, anything else to incoming.
func (e *endpoint) readLoop(incoming func(Frame, []*os.File) error) error {
	var buf []byte
	for {
		size := MaxMessage
		if e.frameLimit != nil {
			size = e.frameLimit()
		}
		if len(buf) != size {
			buf = make([]byte, size)
		}
		if e.spin > 0 {
			e.conn.c.SpinReadable(e.spin)
		}
		n, files, err := e.conn.recv(buf)
		if err != nil {
			if e.rearm != nil && errors.Is(err, os.ErrDeadlineExceeded) && e.rearm() {
				continue
			}
			return err
		}
		if h := frameTaken.Load(); h != nil {
			(*h)(e.server)
		}
		f, err := ParseFrame(buf[:n])
		if err == nil && f.Files != len(files) {
			err = fmt.Errorf("%w: %s frame declares %d files, %d came", ErrMalformed, f.Kind, f.Files, len(files))
		}
		if err != nil {
			dropFiles(files)
			return err
		}
		if f.Kind == KindReply || f.Kind == KindError {
			err = e.deliver(f, files)
		} else {
			err = incoming(f, files)
		}
		if err != nil {
			return err
		}
	}
}

// deliver hands an answer to the call waiting for it. An answer nobody
// waits for (its caller gave up) is dropped. An error frame with id 0 is
// the peer saying why it drops the connection.
func (e *endpoint) deliver(f Frame, files []*os.File) error {
	if f.ID == 0 {
		dropFiles(files)
		var r ErrorReply
		if f.Kind != KindError || Unmarshal(f.Body, &r) != nil {
			return fmt.Errorf("%w: %s frame with id 0", ErrMalformed, f.Kind)
		}
		return remoteError(&r)
	}
	c := e.take(f.ID)
	if c == nil {
		dropFiles(files)
		e.log.Debug("ipc: dropped an answer nobody waits for", "id", f.ID, "kind", f.Kind)
		return nil
	}
	c.ch <- decodeAnswer(f, files, c.reply)
	return nil
}

// decodeAnswer returns what an answer says: the error of an error frame,
// or nil once the reply is decoded into reply (see decodeReply).
func decodeAnswer(f Frame, files []*os.File, reply any) error {
	if f.Kind != KindError {
		return decodeReply(f.Body, files, reply)
	}
	dropFiles(files)
	var r ErrorReply
	err := Unmarshal(f.Body, &r)
	if err == nil {
		err = remoteError(&r)
	}
	return err
}

// decodeReply decodes an answer into reply, handing its files over when
// reply is a *WithFiles and closing them otherwise.
func decodeReply(body []byte, files []*os.File, reply any) error {
	w, ok := reply.(*WithFiles)
	if !ok {
		dropFiles(files)
		if reply == nil {
			return nil
		}
		return Unmarshal(body, reply)
	}
	if w.Body != nil {
		if err := Unmarshal(body, w.Body); err != nil {
			dropFiles(files)
			return err
		}
	}
	w.Files = files
	return nil
}

// isViolation reports whether a connection ended because the peer broke
// the protocol, which deserves more than a debug line.
func isViolation(err error) bool {
	return errors.Is(err, ErrMalformed) || errors.Is(err, ErrTooLarge) ||
		errors.Is(err, ErrUnknownKind) || errors.Is(err, ErrBacklog)
}
