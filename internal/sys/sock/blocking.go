package sock

import (
	"errors"
	"fmt"
	"net"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
)

// ErrWoken means a wait of a Blocking connection was ended by Wake.
var ErrWoken = errors.New("sock: woken")

// ErrWouldBlock means TrySend found no room in the peer's queue.
var ErrWouldBlock = errors.New("sock: no room in the peer's queue")

// ErrNoMessage means TryRecv found no message queued, or took as many
// notices as it takes in one call (see TryRecv; Queued then says whether
// anything is left).
var ErrNoMessage = errors.New("sock: no message queued")

// ErrNotSeqpacket means NewBlocking was given a file that is not a unix
// SOCK_SEQPACKET socket.
var ErrNotSeqpacket = errors.New("sock: not a unix SOCK_SEQPACKET socket")

// ErrReserved means Send was given the one message a Blocking connection
// keeps for itself: the single byte filesNotice.
var ErrReserved = errors.New("sock: the one-byte message 0xc1 is reserved")

var errBlockingClosed = fmt.Errorf("sock: %w", net.ErrClosed)

// filesNotice is the message a Blocking connection sends ahead of one that
// carries descriptors. 0xc1 is the byte msgpack never uses.
const filesNotice = 0xc1

// Blocking is a SOCK_SEQPACKET connection served by blocking system calls
// on the calling goroutine's own thread, outside Go's network poller.
//
// A goroutine that waits on a Conn parks; when the message comes, the
// poller's thread wakes, finds the goroutine and hands it to a thread that
// can run it, often waking another one to do so. On a machine where a
// thread wake-up costs about as much as a whole round trip between two
// processes, those hand-offs double or triple it. A goroutine that waits
// in Recv here blocks its thread in the kernel instead (its P is free for
// other goroutines meanwhile), and the message wakes exactly that thread,
// which returns to the same goroutine: one wake-up per message, as in C.
// The price is a thread per waiting goroutine, so a Blocking suits a
// connection with one reader at a time that expects its answer soon.
//
// Close wakes every wait at once (the socket is shut down first). Waits
// also end at their deadline, and on a wakeable connection (NewBlocking)
// when Wake is called: that is how a caller's cancellation reaches a
// goroutine blocked in the kernel.
//
// Send may be called from several goroutines at once (each message goes
// whole or not at all); Recv from one at a time. Safe for concurrent use
// otherwise.
type Blocking struct {
	fd     int
	wake   int // eventfd that Wake signals; -1 when not wakeable
	closed atomic.Bool
	// mu is read-held around every system call on fd and wake, and
	// write-held by Close to close them, so that no call ever reaches a
	// descriptor number that was closed and given to someone else.
	mu   sync.RWMutex
	oob  []byte // Recv's control buffer
	once sync.Once
	err  error // of Close
	// rcvtimeo is fd's receive timeout (SO_RCVTIMEO) as RecvBy last set
	// it; 0: none. Like oob, it belongs to the one receiver.
	rcvtimeo time.Duration
	// expect counts the notices received whose messages with descriptors
	// have not come yet (see recvOne); one is the buffer recvOne receives
	// into when the caller's is empty. They too belong to the receiver.
	expect int
	one    [1]byte
	// seeAll has every receive use recvmsg (ReceiveAllRights).
	seeAll bool
	// owed counts the notices sent whose messages could not follow them
	// (see send).
	owed atomic.Int64
	// holding is set from the moment a receive may take a message off
	// the socket's queue (a plain blocking receive: from its return)
	// until the receiver has dealt with it (Dealt, or its next receive)
	// or the receive returned none: while it is clear, every message
	// received has been dealt with (see CaughtUp).
	holding atomic.Bool
}

// BlockingPair returns a connected pair of SOCK_SEQPACKET sockets: the
// first end as a Blocking that is not wakeable, the second as a file to
// hand to another process (over a Conn, say), which takes it over with
// NewBlocking. Both are close-on-exec.
func BlockingPair() (*Blocking, *os.File, error) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, nil, fmt.Errorf("sock: socketpair: %w", err)
	}
	// In blocking mode, the file stays off the network poller.
	return newBlocking(fds[0], -1), os.NewFile(uintptr(fds[1]), "seqpacket-pair"), nil
}

// RefuseRights has the kernel refuse the descriptors the peer sends on c
// (see Listen), and reports whether it does. Call it before the peer has
// its end.
func (c *Blocking) RefuseRights() bool {
	c.mu.RLock()
	defer c.mu.RUnlock()
	return !c.closed.Load() && refuseOn(c.fd)
}

// ReceiveAllRights has every receive on c make room for descriptors,
// announced or not (recvmsg, where a receive with no descriptor announced
// is a cheaper recvfrom): a message's descriptors then always come to the
// caller, to take or to drop (Drop), and the kernel never closes them
// inside the receive, where nothing can make them safe to close first.
// For a connection whose peer may send descriptors unasked and that does
// not refuse them (RefuseRights). Call it before the first receive.
func (c *Blocking) ReceiveAllRights() { c.seeAll = true }

// NewBlocking takes over f, a unix SOCK_SEQPACKET socket (as received from
// a peer), and closes f. With wakeable set, Wake can end its waits.
func NewBlocking(f *os.File, wakeable bool) (*Blocking, error) {
	defer f.Close()
	rc, err := f.SyscallConn()
	if err != nil {
		return nil, fmt.Errorf("sock: take over %s: %w", f.Name(), err)
	}
	fd := -1
	var cerr error
	err = rc.Control(func(d uintptr) {
		var typ, domain int
		if typ, cerr = unix.GetsockoptInt(int(d), unix.SOL_SOCKET, unix.SO_TYPE); cerr != nil {
			cerr = fmt.Errorf("%w: %w", ErrNotSeqpacket, cerr)
			return
		}
		if domain, cerr = unix.GetsockoptInt(int(d), unix.SOL_SOCKET, unix.SO_DOMAIN); cerr != nil {
			cerr = fmt.Errorf("%w: %w", ErrNotSeqpacket, cerr)
			return
		}
		if typ != unix.SOCK_SEQPACKET || domain != unix.AF_UNIX {
			cerr = fmt.Errorf("%w: domain %d type %d", ErrNotSeqpacket, domain, typ)
			return
		}
		fd, cerr = unix.FcntlInt(d, unix.F_DUPFD_CLOEXEC, 0)
	})
	if err == nil {
		err = cerr
	}
	if err != nil {
		return nil, fmt.Errorf("sock: take over %s: %w", f.Name(), err)
	}
	if err := unix.SetNonblock(fd, false); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("sock: take over %s: %w", f.Name(), err)
	}
	// RecvBy keeps its own receive timeout: none set by whoever made the
	// socket must linger (a wait without a deadline would wake at it).
	if err := unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &unix.Timeval{}); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("sock: take over %s: %w", f.Name(), err)
	}
	wake := -1
	if wakeable {
		if wake, err = unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK); err != nil {
			unix.Close(fd)
			return nil, fmt.Errorf("sock: eventfd: %w", err)
		}
	}
	return newBlocking(fd, wake), nil
}

func newBlocking(fd, wake int) *Blocking {
	return &Blocking{fd: fd, wake: wake, oob: make([]byte, oobSize)}
}

// Send sends b as one message, with files' descriptors attached, as
// Conn.Send does. It waits for room in the peer's queue until deadline
// (zero: none), failing with os.ErrDeadlineExceeded then, and nothing was
// sent. Wake does not end it: Wake is for the one receiver.
//
// A message without descriptors is a single sendto, received with a
// single recvfrom: the system calls of a C round trip, which cost less
// than sendmsg and recvmsg. A message with descriptors is announced: a
// one-byte notice (filesNotice, which the receiver takes in, so b may not
// be that byte: ErrReserved) goes ahead of it, so that the receiver
// receives it with room for them. Descriptors that a peer writes to the
// socket without the notice are closed by the kernel on receipt.
func (c *Blocking) Send(b []byte, files []*os.File, deadline time.Time) error {
	return c.send(b, files, deadline, false)
}

// TrySend sends b as Send does if the peer's queue has room for it now,
// and fails with ErrWouldBlock otherwise (nothing was sent).
func (c *Blocking) TrySend(b []byte, files []*os.File) error {
	return c.send(b, files, time.Time{}, true)
}

func (c *Blocking) send(b []byte, files []*os.File, deadline time.Time, try bool) error {
	if len(b) == 1 && b[0] == filesNotice {
		return ErrReserved
	}
	oob, err := rights(files)
	if err != nil {
		return err
	}
	c.mu.RLock()
	defer c.mu.RUnlock()
	defer runtime.KeepAlive(files) // the raw descriptors are in use until here
	if len(oob) == 0 {
		return c.sendOne(b, nil, deadline, try)
	}
	// The notice goes first, unless one that went is still owed its
	// message: a send that failed after its notice leaves it to the next.
	if !c.takeOwed() {
		if err := c.sendOne([]byte{filesNotice}, nil, deadline, try); err != nil {
			return err
		}
	}
	if err := c.sendOne(b, oob, deadline, try); err != nil {
		c.owed.Add(1)
		return err
	}
	return nil
}

// takeOwed takes one of the notices that went without their message, if
// there is one.
func (c *Blocking) takeOwed() bool {
	for {
		n := c.owed.Load()
		if n == 0 {
			return false
		}
		if c.owed.CompareAndSwap(n, n-1) {
			return true
		}
	}
}

// sendOne sends b as one message, with the control message oob, waiting
// for room until deadline unless try is set. Call it with mu read-held.
func (c *Blocking) sendOne(b, oob []byte, deadline time.Time, try bool) error {
	const flags = unix.MSG_DONTWAIT | unix.MSG_NOSIGNAL
	last := false // the wait ran out: one more try, and no wait
	for {
		if c.closed.Load() {
			return errBlockingClosed
		}
		var err error
		if len(oob) == 0 {
			err = unix.Sendto(c.fd, b, flags, nil)
		} else {
			_, err = unix.SendmsgN(c.fd, b, oob, nil, flags)
		}
		switch {
		case err == nil:
			return nil
		case err == unix.EINTR:
		case err == unix.EAGAIN && try:
			return ErrWouldBlock
		case err == unix.EAGAIN && last:
			return os.ErrDeadlineExceeded
		case err == unix.EAGAIN:
			// A sender that did not run while its wait ran out (stopped,
			// traced, starved of CPU) tries once more: the peer may have
			// made room meanwhile.
			if err := c.wait(unix.POLLOUT, deadline, false); errors.Is(err, os.ErrDeadlineExceeded) {
				last = true
			} else if err != nil {
				return err
			}
		case err == unix.EPIPE || err == unix.ECONNRESET:
			if c.closed.Load() {
				return errBlockingClosed
			}
			return ErrPeerClosed
		case err == unix.EPERM && len(oob) > 0:
			return ErrRightsRefused
		default:
			return fmt.Errorf("sock: send: %w", err)
		}
	}
}

// Recv receives one message into b, as Conn.Recv does, waiting for it
// until deadline (zero: none): then it fails with os.ErrDeadlineExceeded,
// and with ErrWoken when Wake is called meanwhile. Without a deadline on
// a connection that is not wakeable, it is a single blocking recvfrom
// (recvmsg for a message with descriptors).
func (c *Blocking) Recv(b []byte, deadline time.Time) (int, []*os.File, error) {
	return c.recv(b, deadline, true)
}

// RecvBy receives one message as Recv does, until deadline (zero: none),
// in a single blocking receive that Wake does not end (Close does). It is
// for a receiver that nobody will need to wake: one fewer system call
// than a wait that watches the wake-up too. A deadline is kept by a
// receive timeout (SO_RCVTIMEO) that changes only when the one set cannot
// serve it, at the kernel timer's granularity: the wait may end a few
// milliseconds after deadline.
func (c *Blocking) RecvBy(b []byte, deadline time.Time) (int, []*os.File, error) {
	return c.recvBlocking(b, deadline)
}

// CaughtUp reports whether c's receiver has dealt with everything the
// peer had sent by the time of the call: nothing is queued on the socket,
// and every message a receive returned has been dealt with (Dealt, or
// the receiver's next receive). A goroutine that waits for the receiver
// to hand it a message, and finds its deadline passed, asks it first: a
// process that did not run for a while (stopped, traced, starved of CPU)
// finds its deadlines passed and the messages that came meanwhile
// queued, or taken by a receiver that has not run since. Recv and
// TryRecv mark a message before it leaves the queue. A plain blocking
// receive (RecvBy; Recv without a deadline on a connection that is not
// wakeable) cannot: the kernel takes the message inside the call, which
// is marked as it returns, so a receiver stopped between the two holds a
// message that CaughtUp does not see (marking it from the call's start
// would have every waiter wait on a receive that took nothing). A
// receiver whose waiters must see every message taken uses Recv. A
// closed connection is caught up. Safe to call from any goroutine, while
// a receive runs.
func (c *Blocking) CaughtUp() bool {
	// In this order: a message taken off the queue before it was found
	// empty was marked before it was taken.
	if c.Queued() {
		return c.closed.Load()
	}
	return !c.holding.Load()
}

// Dealt says that the receiver has dealt with the message its last
// receive returned (see CaughtUp).
func (c *Blocking) Dealt() { c.holding.Store(false) }

// Queued reports whether anything is queued on c to be received (or c
// cannot say, or is closed).
func (c *Blocking) Queued() bool {
	c.mu.RLock()
	defer c.mu.RUnlock()
	if c.closed.Load() {
		return true
	}
	n, err := unix.IoctlGetInt(c.fd, unix.SIOCINQ)
	return err != nil || n > 0
}

// TryRecv receives one message as Recv does if one is queued, and fails
// with ErrNoMessage at once if none is. Like Recv, one goroutine at a time.
// It takes at most maxTryNotices notices (see Send) in one call, and says
// ErrNoMessage at the last of them, whatever is queued behind: a peer
// that keeps sending notices with no message behind them must not keep a
// receive that does not wait from returning. A caller that looks for a
// message behind many notices calls again while Queued says something is.
func (c *Blocking) TryRecv(b []byte) (int, []*os.File, error) {
	c.mu.RLock()
	defer c.mu.RUnlock()
	c.holding.Store(true)
	for notices := 0; ; {
		if c.closed.Load() {
			return c.none(errBlockingClosed)
		}
		n, oobn, rflags, err := c.recvOne(b, unix.MSG_DONTWAIT)
		switch {
		case err == errNoticed:
			if notices++; notices == maxTryNotices {
				return c.none(ErrNoMessage)
			}
			continue // its message may be queued behind it
		case err == unix.EINTR:
			continue
		case err == unix.EAGAIN:
			return c.none(ErrNoMessage)
		}
		return c.received(n, len(b), oobn, rflags, err)
	}
}

// maxTryNotices is how many notices TryRecv takes in one call.
const maxTryNotices = 8

func (c *Blocking) recv(b []byte, deadline time.Time, wakeable bool) (int, []*os.File, error) {
	if deadline.IsZero() && !(wakeable && c.wake >= 0) {
		return c.recvBlocking(b, deadline)
	}
	c.mu.RLock()
	defer c.mu.RUnlock()
	c.cameBack()
	if c.closed.Load() {
		return 0, nil, errBlockingClosed
	}
	if err := c.wait(unix.POLLIN, deadline, true); err != nil {
		return 0, nil, err
	}
	for {
		c.holding.Store(true) // before the message leaves the queue
		n, oobn, rflags, err := c.recvOne(b, unix.MSG_DONTWAIT)
		switch {
		case err == unix.EINTR:
			continue
		case err == unix.EAGAIN || err == errNoticed:
			// Readiness that went away, or a notice (whose message may
			// come later: a flood of them must not hold the deadline or
			// Wake off); wait again.
			c.holding.Store(false)
			if err := c.wait(unix.POLLIN, deadline, true); err != nil {
				return 0, nil, err
			}
			continue
		}
		return c.received(n, len(b), oobn, rflags, err)
	}
}

// recvBlocking receives one message in blocking receive calls, until
// deadline (zero: none).
func (c *Blocking) recvBlocking(b []byte, deadline time.Time) (int, []*os.File, error) {
	c.mu.RLock()
	defer c.mu.RUnlock()
	c.cameBack()
	for {
		if c.closed.Load() {
			return 0, nil, errBlockingClosed
		}
		if err := c.setTimeout(deadline); err != nil {
			return 0, nil, err
		}
		n, oobn, rflags, err := c.recvOne(b, 0)
		if err == unix.EINTR || err == unix.EAGAIN || err == errNoticed {
			continue // a signal, the receive timeout, or a notice: look at the deadline again
		}
		// Marked only now: the kernel took it inside the call (see
		// CaughtUp).
		c.holding.Store(true)
		return c.received(n, len(b), oobn, rflags, err)
	}
}

// cameBack clears the mark of the message the last receive returned: the
// receiver, receiving again, has dealt with it. (Most often Dealt did:
// then it costs no store.)
func (c *Blocking) cameBack() {
	if c.holding.Load() {
		c.holding.Store(false)
	}
}

// none ends a receive that returns no message with err.
func (c *Blocking) none(err error) (int, []*os.File, error) {
	c.holding.Store(false)
	return 0, nil, err
}

// afterRecv, when set (by this package's tests), runs in recvOne after
// each receive system call: where the receiver's thread may stop with
// the message taken off the queue (its process stopped, traced, starved
// of CPU).
var afterRecv atomic.Pointer[func()]

// errNoticed is recvOne's report of a notice taken in: no message for the
// caller, who receives again.
var errNoticed = errors.New("sock: notice of files")

// recvOne makes one receive system call for a message into b, with flags
// added, and returns what recvmsg would: the message's length, that of the
// control messages in c.oob, and MSG_TRUNC in the flags if b was too short.
//
// Descriptors come only with messages that were announced (see Send), so
// that a message receives with the cheaper recvfrom, as in C, unless a
// notice is pending: then recvmsg, with room for the descriptors. A
// message with descriptors that recvfrom receives (a peer that wrote it
// without its notice) has them closed by the kernel: none is installed
// here, and none leaks, but that close happens inside the receive, where
// nothing can make it safe (see Drop); ReceiveAllRights has every receive
// use recvmsg instead. The count of pending notices only ever errs high,
// towards receiving with recvmsg, so descriptors sent through Send, from
// however many senders, always find room.
func (c *Blocking) recvOne(b []byte, flags int) (n, oobn, rflags int, err error) {
	p := b
	if len(p) == 0 {
		p = c.one[:] // to see a message's first byte; it is refused as truncated
	}
	// With MSG_TRUNC, n is the message's whole length.
	rights := false
	if c.expect > 0 || c.seeAll {
		n, oobn, rflags, err = recvmsg(c.fd, p, c.oob, flags|unix.MSG_TRUNC|unix.MSG_CMSG_CLOEXEC)
		// Other control messages (credentials, a pidfd, a timestamp: what
		// options whoever holds the socket set ask for) are no descriptors.
		if rights = err == nil && oobn > 0 && carriesRights(c.oob[:oobn]); rights && c.expect > 0 {
			c.expect--
		}
	} else {
		n, err = recvfrom(c.fd, p, flags|unix.MSG_TRUNC)
	}
	if hook := afterRecv.Load(); hook != nil {
		(*hook)()
	}
	if err != nil {
		return 0, 0, 0, err
	}
	if n == 1 && !rights && p[0] == filesNotice {
		if oobn > 0 {
			files, _ := parseRights(c.oob[:oobn]) // closes a pidfd; none of the files it returns
			Drop(files)
		}
		c.expect++
		return 0, 0, 0, errNoticed
	}
	if n > len(b) {
		n, rflags = len(b), rflags|unix.MSG_TRUNC
	}
	return n, oobn, rflags, nil
}

// minTimeout is the shortest receive timeout set: below it the kernel's
// timer granularity decides anyway.
const minTimeout = time.Millisecond

// setTimeout makes fd's receive timeout fit deadline (zero: none): it
// keeps the one set while that ends a wait between a quarter of the time
// left and all of it, and otherwise sets half the time left. So calls
// with like deadlines set it once, and a deadline reached costs a few
// more system calls.
func (c *Blocking) setTimeout(deadline time.Time) error {
	var want time.Duration
	if !deadline.IsZero() {
		left := time.Until(deadline)
		if left <= 0 {
			return os.ErrDeadlineExceeded
		}
		if cur := c.rcvtimeo; cur != 0 && cur <= left && cur >= left/4 {
			return nil
		}
		want = max(left/2, min(left, minTimeout))
	} else if c.rcvtimeo == 0 {
		return nil
	}
	tv := unix.NsecToTimeval(int64(want))
	if want > 0 && tv.Sec == 0 && tv.Usec == 0 {
		tv.Usec = 1 // a zero timeval means none
	}
	if err := unix.SetsockoptTimeval(c.fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv); err != nil {
		return fmt.Errorf("sock: receive timeout: %w", err)
	}
	c.rcvtimeo = want
	return nil
}

// received finishes a receive: Recv's results from what recvmsg returned.
func (c *Blocking) received(n, size, oobn, rflags int, err error) (int, []*os.File, error) {
	n, files, err := received(n, size, c.oob[:max(oobn, 0)], rflags, err)
	if c.closed.Load() && (err != nil || n == 0 && len(files) == 0) {
		Drop(files)
		return c.none(errBlockingClosed) // Close shut the socket down: not the peer's end
	}
	if err != nil {
		c.holding.Store(false)
	}
	return n, files, err
}

// wait blocks until fd has events, the deadline passes, or, with wake
// set, Wake is called. Call it with mu read-held.
func (c *Blocking) wait(events int16, deadline time.Time, wake bool) error {
	fds := [2]unix.PollFd{{Fd: int32(c.fd), Events: events}, {Fd: int32(c.wake), Events: unix.POLLIN}}
	n := 1
	if wake && c.wake >= 0 {
		n = 2
	}
	for {
		var ts *unix.Timespec
		if !deadline.IsZero() {
			d := time.Until(deadline)
			if d <= 0 {
				return os.ErrDeadlineExceeded
			}
			t := unix.NsecToTimespec(int64(d))
			ts = &t
		}
		ready, err := unix.Ppoll(fds[:n], ts, nil)
		switch {
		case err == unix.EINTR || err == nil && ready == 0:
			continue // a signal, or the deadline: checked above
		case err != nil:
			return fmt.Errorf("sock: poll: %w", err)
		}
		if n == 2 && fds[1].Revents != 0 {
			var v [8]byte
			_, _ = unix.Read(c.wake, v[:]) // reset the count; another waiter may have done it
			return ErrWoken
		}
		if fds[0].Revents != 0 {
			return nil
		}
	}
}

// Wake ends the wait of the Recv under way on a wakeable connection with
// ErrWoken; if none is under way, the next one ends so at once. A
// receiver woken by mistake calls again. It does nothing on a connection
// that is not wakeable, or closed.
func (c *Blocking) Wake() {
	c.mu.RLock()
	defer c.mu.RUnlock()
	if c.wake < 0 || c.closed.Load() {
		return
	}
	one := [8]byte{1} // the eventfd counter is a native (little-endian) uint64
	_, _ = unix.Write(c.wake, one[:])
}

// SpinReadable waits up to d for a message (or the end of the connection)
// without blocking in the kernel: it polls, yielding to other goroutines
// and threads between polls, and reports whether Recv would now return at
// once (see Conn.SpinReadable).
func (c *Blocking) SpinReadable(d time.Duration) bool { return c.spin(d, false) }

// SpinWakeable is SpinReadable that a Wake (on a wakeable connection) ends
// too, leaving it for the Recv that follows: for a receiver whose next
// receive is one that a Wake ends.
func (c *Blocking) SpinWakeable(d time.Duration) bool { return c.spin(d, true) }

func (c *Blocking) spin(d time.Duration, wake bool) bool {
	c.mu.RLock()
	defer c.mu.RUnlock()
	deadline := time.Now().Add(d)
	fds := [2]unix.PollFd{{Fd: int32(c.fd), Events: unix.POLLIN}, {Fd: int32(c.wake), Events: unix.POLLIN}}
	n := 1
	if wake && c.wake >= 0 {
		n = 2
	}
	var zero unix.Timespec
	for !c.closed.Load() {
		ready, err := unix.Ppoll(fds[:n], &zero, nil)
		if err == nil && ready > 0 {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		// Let other goroutines run, and other threads: the peer may be
		// waiting for this very CPU to send what is awaited.
		runtime.Gosched()
		_, _, _ = unix.Syscall(unix.SYS_SCHED_YIELD, 0, 0, 0)
	}
	return true // closed: Recv returns at once
}

// PeerCred returns the credentials of the peer (SO_PEERCRED): for either
// end of a pair, the process that made it.
func (c *Blocking) PeerCred() (Cred, error) {
	c.mu.RLock()
	defer c.mu.RUnlock()
	if c.closed.Load() {
		return Cred{}, errBlockingClosed
	}
	uc, err := unix.GetsockoptUcred(c.fd, unix.SOL_SOCKET, unix.SO_PEERCRED)
	if err != nil {
		return Cred{}, fmt.Errorf("sock: peer credentials: %w", err)
	}
	return Cred{PID: int(uc.Pid), UID: int(uc.Uid), GID: int(uc.Gid)}, nil
}

// Close shuts the connection down, which ends every wait under way at
// once (the peer sees the end too), then closes its descriptors once no
// system call uses them. Idempotent.
func (c *Blocking) Close() error {
	c.once.Do(func() {
		c.closed.Store(true)
		_ = unix.Shutdown(c.fd, unix.SHUT_RDWR)
		c.mu.Lock()
		defer c.mu.Unlock()
		discard(c.fd, 0) // what the peer sent and nobody read, descriptors included
		if err := unix.Close(c.fd); err != nil {
			c.err = fmt.Errorf("sock: close: %w", err)
		}
		if c.wake >= 0 {
			unix.Close(c.wake)
		}
	})
	return c.err
}
