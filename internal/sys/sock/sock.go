// Package sock wraps unix SOCK_SEQPACKET sockets: listen, accept and dial,
// one message per send and per receive with optional file descriptors
// (SCM_RIGHTS), and the peer's credentials (SO_PEERCRED).
//
// SOCK_SEQPACKET keeps message boundaries like a datagram socket and is
// connection-oriented like a stream: a peer that dies is seen as end of
// file, never as silence. A Conn lives on Go's network poller (it is a
// net.UnixConn underneath), so a blocked receive is interrupted by Close and
// honours deadlines, and a goroutine waiting on one does not hold a thread.
// A Blocking connection does the opposite, for the round trips where the
// poller's hand-offs would cost more than the trip itself: its waits block
// the goroutine's thread in the kernel, and the message wakes that very
// thread.
//
// Received descriptors arrive close-on-exec (MSG_CMSG_CLOEXEC). A receive
// that fails for any reason drops whatever descriptors came with the
// message (Drop), so a misbehaving peer cannot make this process leak them.
//
// Closing a descriptor a peer sent can block: the last close of a TCP
// socket set to linger waits for its unsent data, for as long as the
// linger says, and so does a close of a socket with such a descriptor
// still queued on it. A socket that must take none (Listen's
// refuseRights, Blocking.RefuseRights) has the kernel refuse them at the
// sender (SO_PASSRIGHTS, Linux 6.16 on); Drop makes the sockets it closes
// close at once.
package sock

import (
	"cmp"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"runtime"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// MaxFiles is the most descriptors one message may carry. A message that
// comes with more is refused (ErrTooManyFiles) and all of them are closed.
const MaxFiles = 16

// Errors of this package; system errors are wrapped with what failed.
var (
	// ErrTruncated means a received message was larger than the buffer
	// given to Recv (the kernel set MSG_TRUNC); the rest of it is lost.
	ErrTruncated = errors.New("sock: message truncated")
	// ErrTooManyFiles means a message carried more than MaxFiles
	// descriptors (on receive: the kernel set MSG_CTRUNC).
	ErrTooManyFiles = errors.New("sock: too many file descriptors in one message")
	// ErrPeerClosed means a send found the peer's end closed (EPIPE or
	// ECONNRESET). A receive reports the same situation as io.EOF.
	ErrPeerClosed = errors.New("sock: peer closed the connection")
	// ErrNoSocket means nothing exists at the path that was dialled.
	ErrNoSocket = errors.New("sock: no socket at path")
	// ErrRefused means a socket file exists at the path but nobody
	// listens on it (ECONNREFUSED): it was left by a process that ended.
	ErrRefused = errors.New("sock: connection refused")
	// ErrAddressInUse means the path is already bound (EADDRINUSE).
	ErrAddressInUse = errors.New("sock: address in use")
	// ErrRightsRefused means a send with descriptors found the peer's
	// socket refusing them (EPERM; see Listen): nothing was sent, and the
	// connection goes on.
	ErrRightsRefused = errors.New("sock: the peer takes no descriptors")
)

const network = "unixpacket" // SOCK_SEQPACKET in the net package's terms

// Cred is a peer's identity as the kernel recorded it when the connection
// was made (SO_PEERCRED): the connecting process for an accepted
// connection, the listening process for a dialled one. A plain value.
type Cred struct {
	PID int
	UID int
	GID int
}

// Listener accepts SOCK_SEQPACKET connections on a path. It does not remove
// the socket file when closed: which file to remove, and when, is the
// caller's policy. Safe for concurrent use.
type Listener struct {
	l       *net.UnixListener
	refuses bool // the kernel refuses descriptors sent on its connections
}

// Listen binds and listens on path. The socket file is created with the
// process's umask; tighten it with chmod if needed (the directory around it
// is what really keeps strangers out). With refuseRights, the connections
// it accepts take no descriptors: the kernel fails a peer's send of any
// with EPERM, from the moment the peer connects, if it can
// (RefusesRights); the socket is made so before it is bound. About 256
// connections wait to be accepted (fewer if the system's somaxconn is
// lower); beyond that a non-blocking connect is refused at once (EAGAIN),
// and Dial waits for a place.
func Listen(path string, refuseRights bool) (*Listener, error) {
	var refuses bool
	lc := net.ListenConfig{}
	if refuseRights {
		lc.Control = func(_, _ string, rc syscall.RawConn) error {
			return rc.Control(func(fd uintptr) { refuses = refuseOn(int(fd)) })
		}
	}
	nl, err := lc.Listen(context.Background(), network, path)
	if err != nil {
		if errors.Is(err, unix.EADDRINUSE) {
			return nil, fmt.Errorf("%w: %s", ErrAddressInUse, path)
		}
		return nil, fmt.Errorf("sock: listen on %s: %w", path, err)
	}
	l := nl.(*net.UnixListener)
	l.SetUnlinkOnClose(false)
	// Listening again sets the queue's length (the standard library
	// takes somaxconn).
	rc, err := l.SyscallConn()
	if err == nil {
		cerr := rc.Control(func(fd uintptr) { err = unix.Listen(int(fd), listenBacklog) })
		err = errors.Join(cerr, err)
	}
	if err != nil {
		l.Close() // the socket file stays, as after a listener's Close
		return nil, fmt.Errorf("sock: listen on %s: %w", path, err)
	}
	return &Listener{l: l, refuses: refuses}, nil
}

// listenBacklog is how many connections may wait to be accepted: a
// connection that got in waits for every one ahead of it, so a peer that
// keeps the queue full (connecting and closing in a loop) must not make
// that wait long. The system's default (somaxconn, 4096 on current
// kernels) made it seconds where the accept loop turns each one away in
// half a millisecond (the race detector on). Connections that find the
// queue full wait for a place (Dial), or are refused at once (EAGAIN,
// a non-blocking connect).
const listenBacklog = 256

// RefusesRights reports whether the kernel refuses the descriptors peers
// send on the connections l accepts (see Listen).
func (l *Listener) RefusesRights() bool { return l.refuses }

// refuseOn has the kernel refuse descriptors sent to socket fd
// (SO_PASSRIGHTS off), and reports whether it does; kernels before 6.16
// do not know the option.
func refuseOn(fd int) bool {
	return unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_PASSRIGHTS, 0) == nil
}

// Accept waits for the next connection. After Close it returns an error
// that satisfies errors.Is(err, net.ErrClosed).
func (l *Listener) Accept() (*Conn, error) {
	c, err := l.l.AcceptUnix()
	if err != nil {
		return nil, fmt.Errorf("sock: accept: %w", err)
	}
	return newConn(c), nil
}

// Close stops listening; a blocked Accept returns. It is idempotent.
func (l *Listener) Close() error {
	err := l.l.Close()
	if errors.Is(err, net.ErrClosed) {
		return nil
	}
	return err
}

// Path returns the path the listener is bound to.
func (l *Listener) Path() string { return l.l.Addr().String() }

// dialSlice is how long a Dial waits in the kernel at a time for a place
// in a full listen queue before it looks at its context again. A
// variable for tests.
var dialSlice = 10 * time.Millisecond

// dialWaits holds a token for each Dial of this process that may wait in
// the kernel (each holds a thread meanwhile): a process that dials from
// ten thousand goroutines a server whose queue stays full must not make
// ten thousand threads (the runtime ends the program past 10,000). The
// others wait here, without a thread, for a token. A variable for tests.
var dialWaits = make(chan struct{}, 16)

// dialTried, when set (by tests), is called as Dial tries to connect;
// dialFull when a try found the queue full for its whole wait;
// dialQueued when a Dial waits for a token of dialWaits.
var dialTried, dialFull, dialQueued func()

// Dial connects to the listener at path. It fails with ErrNoSocket when no
// file exists there and ErrRefused when nobody listens on it. When the
// listener's queue of connections to accept is full (the server is busy,
// or someone floods it), Dial waits for a place until ctx ends, and then
// fails with ErrBusy, rather than take a busy server for an absent one
// (when the deadline ran out, after one more try that waits for nothing:
// the process may have been stopped while a place freed).
// It waits in the kernel (a blocking connect), which wakes it as a place
// frees: tries made apart got in only when one came just as a place
// freed, and lost to a peer that connects in a loop to keep the queue
// full. A cancellation is seen within 10 ms (rounded up to the kernel's
// tick). Each Dial that waits in the kernel holds an OS thread meanwhile;
// at most 16 of a process do at once, and the others wait for their turn
// in the process.
func Dial(ctx context.Context, path string) (*Conn, error) {
	addr := &unix.SockaddrUnix{Name: path}
	busy := false // the queue was found full
	late := false // the look after the deadline
	for {
		wait := dialSlice
		if dl, ok := ctx.Deadline(); ok {
			wait = min(wait, time.Until(dl))
		}
		if err := ctx.Err(); late || err != nil || wait < time.Microsecond {
			err = cmp.Or(err, context.DeadlineExceeded)
			// The deadline may have passed while this process was
			// stopped (SIGSTOP, a debugger, a CPU it did not get) after a
			// try found the queue full, and a place freed meanwhile: one
			// more try, which waits for nothing, before ErrBusy. Not
			// after a cancellation.
			if !busy || late || !errors.Is(err, context.DeadlineExceeded) {
				if busy {
					return nil, fmt.Errorf("%w: %s: %w", ErrBusy, path, err)
				}
				return nil, fmt.Errorf("sock: dial %s: %w", path, err)
			}
			late, wait = true, 0
		}
		if !late {
			select {
			case dialWaits <- struct{}{}:
			default:
				if dialQueued != nil {
					dialQueued()
				}
				select {
				case dialWaits <- struct{}{}:
				case <-ctx.Done():
					continue // said at the top
				}
			}
		}
		if dialTried != nil {
			dialTried()
		}
		c, err := connect(addr, wait)
		if !late {
			<-dialWaits
		}
		switch {
		case err == nil:
			return c, nil
		case errors.Is(err, unix.ENOENT):
			return nil, fmt.Errorf("%w: %s", ErrNoSocket, path)
		case errors.Is(err, unix.ECONNREFUSED):
			return nil, fmt.Errorf("%w: %s", ErrRefused, path)
		case errors.Is(err, unix.EAGAIN):
			busy = true // the queue stayed full for wait
			if dialFull != nil {
				dialFull()
			}
			continue
		case errors.Is(err, unix.EINTR):
			busy = true // a signal came while it waited
			continue
		}
		return nil, fmt.Errorf("sock: dial %s: %w", path, err)
	}
}

// connect makes a connection to addr, waiting up to wait (0, or at least
// a microsecond) for a place in the listener's queue: a blocking connect,
// bounded by the send timeout, which bounds it on a unix socket. With
// wait 0 it does not wait: a non-blocking connect, which fails with
// EAGAIN when the queue is full.
func connect(addr *unix.SockaddrUnix, wait time.Duration) (*Conn, error) {
	if wait == 0 {
		fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC|unix.SOCK_NONBLOCK, 0)
		if err != nil {
			return nil, err
		}
		if err := unix.Connect(fd, addr); err != nil {
			unix.Close(fd)
			return nil, err
		}
		return fromFD(fd)
	}
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	tv := unix.NsecToTimeval(wait.Nanoseconds())
	if err = unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_SNDTIMEO, &tv); err == nil {
		if err = unix.Connect(fd, addr); err == nil {
			// Connected: no send timeout from now on, and served by the
			// runtime's poller like every other connection.
			var none unix.Timeval
			if err = unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_SNDTIMEO, &none); err == nil {
				err = unix.SetNonblock(fd, true)
			}
		}
	}
	if err != nil {
		unix.Close(fd)
		return nil, err
	}
	return fromFD(fd)
}

// fromFD makes a Conn of fd, a connected non-blocking socket, which it
// takes over: closed if that fails.
func fromFD(fd int) (*Conn, error) {
	f := os.NewFile(uintptr(fd), "seqpacket")
	nc, err := net.FileConn(f) // dups fd
	f.Close()
	if err != nil {
		return nil, err
	}
	return newConn(nc.(*net.UnixConn)), nil
}

// Pair returns two connected sockets, for tests and for handing one end to
// a child process.
func Pair() (*Conn, *Conn, error) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC|unix.SOCK_NONBLOCK, 0)
	if err != nil {
		return nil, nil, fmt.Errorf("sock: socketpair: %w", err)
	}
	var cs [2]*Conn
	for i, fd := range fds {
		c, err := fromFD(fd)
		if err != nil {
			if i == 1 {
				cs[0].Close()
			} else {
				unix.Close(fds[1])
			}
			return nil, nil, fmt.Errorf("sock: socketpair: %w", err)
		}
		cs[i] = c
	}
	return cs[0], cs[1], nil
}

// Conn is one SOCK_SEQPACKET connection. Send may be called from several
// goroutines at once (each message goes out whole); Recv must be called
// from one goroutine at a time, since it reuses a control buffer.
type Conn struct {
	c       *net.UnixConn
	rc      syscall.RawConn // for Recv, SpinReadable and CaughtUp; nil if unavailable
	oob     []byte          // control-message buffer of Recv
	closing atomic.Bool     // Close has begun: the end a Recv sees is ours
	// holding is set as each receive is tried and cleared only when one
	// finds nothing queued: while it is clear, every message Recv
	// returned has been dealt with by its caller, which has come back
	// for the next (see CaughtUp). It means nothing once Close began.
	holding atomic.Bool
	// The receive tried from the poller (tryRecv, bound once so that a
	// receive allocates nothing): its buffer, and what recvmsg returned.
	recvFn           func(fd uintptr) bool
	rb               []byte
	rn, roobn, rflag int
	rerr             error
}

func newConn(c *net.UnixConn) *Conn {
	rc, _ := c.SyscallConn()
	conn := &Conn{c: c, rc: rc, oob: make([]byte, oobSize)}
	conn.recvFn = conn.tryRecv
	return conn
}

// tryRecv is one receive into c.rb, for the poller: false when nothing is
// queued (then the poller waits for the socket to be readable).
func (c *Conn) tryRecv(fd uintptr) bool {
	c.holding.Store(true)
	for {
		c.rn, c.roobn, c.rflag, c.rerr = recvmsg(int(fd), c.rb, c.oob, unix.MSG_CMSG_CLOEXEC)
		if c.rerr != unix.EINTR {
			break
		}
	}
	if c.rerr == unix.EAGAIN {
		c.holding.Store(false)
		return false
	}
	return true
}

// rights is the control message that passes files' descriptors (none for
// no files). The caller keeps files alive until the message is sent.
func rights(files []*os.File) ([]byte, error) {
	if len(files) > MaxFiles {
		return nil, fmt.Errorf("%w: %d > %d", ErrTooManyFiles, len(files), MaxFiles)
	}
	if len(files) == 0 {
		return nil, nil
	}
	fds := make([]int, len(files))
	for i, f := range files {
		fd, err := rawFD(f)
		if err != nil {
			return nil, fmt.Errorf("sock: send: descriptor of %s: %w", f.Name(), err)
		}
		fds[i] = fd
	}
	return unix.UnixRights(fds...), nil
}

// Send sends b as one message, with files' descriptors attached when there
// are any. The files stay open and owned by the caller; the peer receives
// duplicates. A send blocks while the peer's receive queue is full, until
// the write deadline.
func (c *Conn) Send(b []byte, files []*os.File) error {
	oob, err := rights(files)
	if err != nil {
		return err
	}
	_, _, err = c.c.WriteMsgUnix(b, oob, nil)
	runtime.KeepAlive(files) // the raw descriptors are in use until here
	return sendError(err, len(oob) > 0)
}

// sendError is what a send that failed with err says: the peer's end, or
// descriptors refused (a message that carried some, rights), or err.
func sendError(err error, rights bool) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, unix.EPIPE) || errors.Is(err, unix.ECONNRESET):
		return ErrPeerClosed
	case errors.Is(err, unix.EPERM) && rights:
		return ErrRightsRefused
	}
	return fmt.Errorf("sock: send: %w", err)
}

// TrySend sends b as Send does if the peer's queue has room for it now,
// whatever the write deadline, and fails with ErrWouldBlock otherwise
// (nothing was sent). Call it from the goroutine that sends, or with
// sends held off: it takes none of Send's locks.
func (c *Conn) TrySend(b []byte, files []*os.File) error {
	if c.rc == nil {
		return ErrWouldBlock
	}
	oob, err := rights(files)
	if err != nil {
		return err
	}
	cerr := c.rc.Control(func(fd uintptr) {
		_, err = unix.SendmsgN(int(fd), b, oob, nil, unix.MSG_DONTWAIT|unix.MSG_NOSIGNAL)
	})
	runtime.KeepAlive(files) // the raw descriptors are in use until here
	switch {
	case cerr != nil:
		return fmt.Errorf("sock: send: %w", cerr)
	case err == unix.EAGAIN:
		return ErrWouldBlock
	}
	return sendError(err, len(oob) > 0)
}

// rawFD returns f's descriptor without what f.Fd() also does: switching it
// to blocking mode, which would change the caller's file behind its back.
func rawFD(f *os.File) (int, error) {
	rc, err := f.SyscallConn()
	if err != nil {
		return -1, err
	}
	fd := -1
	if err := rc.Control(func(d uintptr) { fd = int(d) }); err != nil {
		return -1, err
	}
	return fd, nil
}

// SpinReadable waits up to d for a message (or the end of the connection)
// to be queued, without parking: it polls the socket, yielding to other
// goroutines and threads between polls, and reports whether Recv would now
// return at once. Waking a parked reader costs a cross-CPU wake-up, tens of
// microseconds on some machines; a reader that expects a message soon can
// spend that time polling instead. Call it from the goroutine that calls
// Recv.
func (c *Conn) SpinReadable(d time.Duration) bool {
	if c.rc == nil {
		return false
	}
	ready := false
	deadline := time.Now().Add(d)
	_ = c.rc.Control(func(fd uintptr) {
		for {
			// A zero-length peek answers at once: 0 for a queued message
			// or the end of the connection, EAGAIN for nothing yet.
			_, _, err := unix.Syscall6(unix.SYS_RECVFROM, fd, 0, 0, unix.MSG_PEEK|unix.MSG_DONTWAIT, 0, 0)
			if err != unix.EAGAIN && err != unix.EINTR {
				ready = true
				return
			}
			if time.Now().After(deadline) {
				return
			}
			// Let other goroutines run, and other threads: the peer may
			// be waiting for this very CPU to send what is awaited.
			runtime.Gosched()
			_, _, _ = unix.Syscall(unix.SYS_SCHED_YIELD, 0, 0, 0)
		}
	})
	return ready
}

// CaughtUp reports whether the connection's reader has taken everything
// the peer had sent by the time of the call: nothing is queued on the
// socket, and the last Recv found nothing more, so that every message it
// returned before has been dealt with by its caller. A caller that gives
// up waiting for a message at a deadline can ask it first: a process that
// did not run for a while (stopped, traced, starved of CPU) finds its
// deadlines passed and the messages that came meanwhile still queued. A
// closed connection has nothing more to read: it is caught up. Safe to
// call from any goroutine, while a Recv runs.
func (c *Conn) CaughtUp() bool {
	if c.rc == nil || c.closing.Load() {
		return true
	}
	queued := true
	_ = c.rc.Control(func(fd uintptr) {
		n, err := unix.IoctlGetInt(int(fd), unix.SIOCINQ)
		queued = err != nil || n > 0
	})
	// In this order: a message taken from the queue before it was found
	// empty has its receive's mark on until the receive after it finds
	// the queue empty.
	return !queued && !c.holding.Load()
}

// HungUp reports whether the peer has closed its end of the connection
// (or shut down its writing), as poll(2) sees it, whatever is still queued
// to be received before that end. A connection closed here has hung up;
// one whose descriptor cannot be polled has not, as far as it can tell.
// Safe to call from any goroutine, while a Recv runs.
func (c *Conn) HungUp() bool {
	if c.closing.Load() {
		return true
	}
	if c.rc == nil {
		return false
	}
	hup := false
	if err := c.rc.Control(func(fd uintptr) {
		fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLRDHUP}}
		if n, err := unix.Poll(fds, 0); err == nil && n > 0 {
			hup = fds[0].Revents&(unix.POLLRDHUP|unix.POLLHUP|unix.POLLERR) != 0
		}
	}); err != nil {
		return true // closed meanwhile
	}
	return hup
}

// Recv receives one message into b and returns its length and the files
// that came with it, which the caller then owns. A peer that has closed its
// end (or died) reads as io.EOF, and so does an empty message, which this
// socket type cannot tell from the end of the connection. A message longer
// than b fails with ErrTruncated, one with more than MaxFiles descriptors
// with ErrTooManyFiles; either way its descriptors are closed.
func (c *Conn) Recv(b []byte) (int, []*os.File, error) {
	var n, oobn, flags int
	var err error
	if c.rc == nil {
		n, oobn, flags, _, err = c.c.ReadMsgUnix(b, c.oob)
	} else {
		c.rb = b
		if rerr := c.rc.Read(c.recvFn); rerr != nil {
			n, oobn, flags, err = 0, 0, 0, rerr
		} else {
			n, oobn, flags, err = c.rn, c.roobn, c.rflag, c.rerr
		}
		c.rb = nil
	}
	n, files, err := received(n, len(b), c.oob[:max(oobn, 0)], flags, err)
	if c.closing.Load() && (err != nil || n == 0 && len(files) == 0) {
		Drop(files)
		return 0, nil, errBlockingClosed // Close shut the socket down: not the peer's end
	}
	return n, files, err
}

// received turns what recvmsg returned into Recv's results: the files
// that came in oob, and the errors of a truncated message, too many
// descriptors, the peer's end (an empty message or ECONNRESET read as
// io.EOF). On error, every descriptor that came is closed.
func received(n, size int, oob []byte, flags int, err error) (int, []*os.File, error) {
	var files []*os.File
	if len(oob) > 0 {
		var perr error
		files, perr = parseRights(oob)
		if err == nil {
			err = perr
		}
	}
	switch {
	case err != nil:
	case flags&unix.MSG_CTRUNC != 0 || len(files) > MaxFiles:
		err = ErrTooManyFiles
	case flags&unix.MSG_TRUNC != 0:
		err = fmt.Errorf("%w: longer than %d bytes", ErrTruncated, size)
	case n == 0 && len(files) == 0:
		return 0, nil, io.EOF
	}
	if err != nil {
		Drop(files)
		if errors.Is(err, unix.ECONNRESET) {
			return 0, nil, io.EOF // the peer died with our data unread
		}
		if errors.Is(err, ErrTooManyFiles) || errors.Is(err, ErrTruncated) {
			return 0, nil, err
		}
		return 0, nil, fmt.Errorf("sock: receive: %w", err)
	}
	return n, files, nil
}

// parseRights returns the descriptors of every SCM_RIGHTS message in oob as
// files. Each descriptor is wrapped as soon as it is seen, so that on error
// the caller can close all of them.
func parseRights(oob []byte) ([]*os.File, error) {
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return nil, fmt.Errorf("sock: control message: %w", err)
	}
	var files []*os.File
	for i := range msgs {
		if msgs[i].Header.Level != unix.SOL_SOCKET {
			continue
		}
		if msgs[i].Header.Type == unix.SCM_PIDFD {
			closePidfd(msgs[i].Data) // the kernel's, with SO_PASSPIDFD: not ours to keep
			continue
		}
		if msgs[i].Header.Type != unix.SCM_RIGHTS {
			continue
		}
		fds, perr := unix.ParseUnixRights(&msgs[i])
		if perr != nil {
			err = fmt.Errorf("sock: control message: %w", perr)
			continue
		}
		for _, fd := range fds {
			files = append(files, os.NewFile(uintptr(fd), "received-fd"))
		}
	}
	return files, err
}

// closePidfd closes the pidfd of an SCM_PIDFD control message's data: a
// socket with SO_PASSPIDFD set (by whoever holds it) gets one with every
// message received with a control buffer.
func closePidfd(data []byte) {
	if len(data) >= 4 {
		unix.Close(int(int32(binary.NativeEndian.Uint32(data))))
	}
}

// carriesRights reports whether the control messages in oob carry
// descriptors (SCM_RIGHTS), or cannot be read.
func carriesRights(oob []byte) bool {
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return true // malformed: received refuses it
	}
	for i := range msgs {
		if msgs[i].Header.Level == unix.SOL_SOCKET && msgs[i].Header.Type == unix.SCM_RIGHTS {
			return true
		}
	}
	return false
}

// Drop closes descriptors a peer sent and this process refuses. A socket
// among them is made to close at once first (SO_LINGER on, zero: a TCP
// connection is reset, its unsent data discarded), so that the close does
// not wait on a linger its sender set; a unix socket has what is queued on
// it, or waiting on it to be accepted, dropped so too (see discard), four
// sockets deep and 4,096 messages or connections a socket. The sockets are
// changed for whoever else holds them: no linger, and a unix socket shut
// down for reading and asked for credentials (a listening one made
// non-blocking). Other kinds close as usual: one whose close waits on its sender (a file
// on a FUSE mount the sender serves) is kept out only by refusing
// descriptors (Listen), and so is a socket past those bounds.
func Drop(files []*os.File) { drop(files, 0) }

// maxDropDepth bounds how many unix sockets deep Drop looks: a socket
// queued on a socket queued on one that was sent.
const maxDropDepth = 4

func drop(files []*os.File, depth int) {
	for _, f := range files {
		if rc, err := f.SyscallConn(); err == nil {
			_ = rc.Control(func(fd uintptr) { disarm(int(fd), depth) })
		}
		f.Close()
	}
}

// disarm makes socket fd safe to close: no linger, and nothing queued on
// it, or waiting on it to be accepted, that its close would close.
// Anything but a socket is left alone.
func disarm(fd, depth int) {
	domain, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_DOMAIN)
	if err != nil {
		return // not a socket
	}
	_ = unix.SetsockoptLinger(fd, unix.SOL_SOCKET, unix.SO_LINGER, &unix.Linger{Onoff: 1})
	if domain != unix.AF_UNIX || depth >= maxDropDepth {
		return
	}
	if on, _ := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_ACCEPTCONN); on == 1 {
		// Connections made and not accepted: each queues what its
		// peer sent already. Accept has no flag not to wait.
		if err := unix.SetNonblock(fd, true); err != nil {
			return
		}
		for range maxDiscard {
			c, _, err := unix.Accept4(fd, unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC)
			if err == unix.EINTR || err == unix.ECONNABORTED {
				continue
			}
			if err != nil {
				return
			}
			disarm(c, depth+1)
			unix.Close(c)
		}
		return
	}
	discard(fd, depth+1)
}

// maxDiscard bounds the messages discard reads off one socket, and the
// connections disarm accepts on one.
const maxDiscard = 1 << 12

// discard drops the messages queued, unread, on unix socket fd, with
// their descriptors (through drop, at depth): closing the socket with
// them still queued would close them inside that close, with no chance to
// make them safe first. The socket is shut down for reading, so that its
// peer can add nothing more (its sends fail), and asked for the sender's
// credentials with each message (SO_PASSCRED), so that a message, even an
// empty one, always comes with a control message and the end never does.
func discard(fd, depth int) {
	_ = unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_PASSCRED, 1)
	_ = unix.Shutdown(fd, unix.SHUT_RD)
	stream := false
	if t, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_TYPE); err == nil && t == unix.SOCK_STREAM {
		stream = true
	}
	buf := make([]byte, 1) // a record's first byte; MSG_TRUNC drops the rest
	if stream {
		buf = make([]byte, 64<<10) // bytes, not records: take them in bulk
	}
	oob := make([]byte, oobSize)
	for range maxDiscard {
		n, oobn, _, _, err := unix.Recvmsg(fd, buf, oob, unix.MSG_DONTWAIT|unix.MSG_CMSG_CLOEXEC|unix.MSG_TRUNC)
		if err == unix.EINTR {
			continue
		}
		if err != nil || n == 0 && (stream || oobn == 0) {
			return // nothing more (EAGAIN), or the end
		}
		files, _ := parseRights(oob[:oobn])
		drop(files, depth)
	}
}

// oobSize is the room a receive gives control messages: the most
// descriptors one message can carry (the kernel's SCM_MAX_FD), and the
// credentials and pidfd whoever holds the socket may ask for. With less,
// the kernel would close the descriptors that do not fit inside the
// receive, where they cannot be made safe to close first (see Drop).
var oobSize = unix.CmsgSpace(scmMaxFD*4) + unix.CmsgSpace(unix.SizeofUcred) + unix.CmsgSpace(4)

const scmMaxFD = 253

// PeerCred returns the peer's credentials (SO_PEERCRED).
func (c *Conn) PeerCred() (Cred, error) {
	rc, err := c.c.SyscallConn()
	if err != nil {
		return Cred{}, fmt.Errorf("sock: peer credentials: %w", err)
	}
	var uc *unix.Ucred
	var gerr error
	if err := rc.Control(func(fd uintptr) {
		uc, gerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return Cred{}, fmt.Errorf("sock: peer credentials: %w", err)
	}
	if gerr != nil {
		return Cred{}, fmt.Errorf("sock: peer credentials: %w", gerr)
	}
	return Cred{PID: int(uc.Pid), UID: int(uc.Uid), GID: int(uc.Gid)}, nil
}

// soPeerPidfd is SO_PEERPIDFD (Linux 6.5): a pidfd of the peer process as
// the connection recorded it.
const soPeerPidfd = 77

// ErrBusy means a listener's queue of connections stayed full until the
// dial gave up: somebody listens, but does not keep up.
var ErrBusy = errors.New("sock: the listener's queue is full")

// ErrNoPidfd means the kernel cannot name a peer by pidfd (before Linux
// 6.5).
var ErrNoPidfd = errors.New("sock: the kernel gives no peer pidfd")

// PeerPidfd returns a pidfd of the process at the other end as the kernel
// recorded it when the connection was made (SO_PEERPIDFD): unlike the pid
// in PeerCred, it cannot come to name another process once that one
// exits. It fails with ErrNoPidfd on kernels before 6.5.
func (c *Conn) PeerPidfd() (*os.File, error) {
	rc, err := c.c.SyscallConn()
	if err != nil {
		return nil, fmt.Errorf("sock: peer pidfd: %w", err)
	}
	var fd int
	var gerr error
	if err := rc.Control(func(s uintptr) {
		fd, gerr = unix.GetsockoptInt(int(s), unix.SOL_SOCKET, soPeerPidfd)
	}); err != nil {
		return nil, fmt.Errorf("sock: peer pidfd: %w", err)
	}
	if errors.Is(gerr, unix.ENOPROTOOPT) {
		return nil, ErrNoPidfd
	}
	if gerr != nil {
		return nil, fmt.Errorf("sock: peer pidfd: %w", gerr)
	}
	unix.CloseOnExec(fd)
	// Non-blocking, so that os.File puts it in the network poller, where
	// a wait for its process's exit holds no thread (waitid is not used).
	if err := unix.SetNonblock(fd, true); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("sock: peer pidfd: %w", err)
	}
	return os.NewFile(uintptr(fd), "pidfd"), nil
}

// PidfdExited reports whether the process pidfd fd names has exited: the
// pidfd polls readable then, zombie or not. It does not wait.
func PidfdExited(fd uintptr) bool {
	pfd := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
	for {
		n, err := unix.Poll(pfd, 0)
		if err == unix.EINTR {
			continue
		}
		return err == nil && n > 0 && pfd[0].Revents&unix.POLLIN != 0
	}
}

// PidfdAlive reports whether the process a pidfd names has not exited.
// Signal 0 is only a probe: a process this one may not signal (another
// user's) answers EPERM, and is alive all the same; ESRCH means gone.
func PidfdAlive(f *os.File) bool {
	rc, err := f.SyscallConn()
	if err != nil {
		return true // closed: no answer, so no death
	}
	var serr error
	if err := rc.Control(func(fd uintptr) { serr = unix.PidfdSendSignal(int(fd), 0, nil, 0) }); err != nil {
		return true
	}
	return !errors.Is(serr, unix.ESRCH)
}

// SetReadDeadline bounds a blocked Recv, which then fails with an error
// that satisfies errors.Is(err, os.ErrDeadlineExceeded). Zero means none.
func (c *Conn) SetReadDeadline(t time.Time) error { return c.c.SetReadDeadline(t) }

// SetWriteDeadline bounds a blocked Send the same way.
func (c *Conn) SetWriteDeadline(t time.Time) error { return c.c.SetWriteDeadline(t) }

// Close closes the connection; a blocked Recv or Send returns an error that
// satisfies errors.Is(err, net.ErrClosed). It is idempotent.
func (c *Conn) Close() error {
	if c.rc != nil && !c.closing.Swap(true) {
		// What the peer sent and nobody read, descriptors included: a
		// close with them queued would close them inside it.
		_ = c.rc.Control(func(fd uintptr) { discard(int(fd), 0) })
	}
	err := c.c.Close()
	if errors.Is(err, net.ErrClosed) {
		return nil
	}
	return err
}

// IsClosed reports whether err comes from using a connection or listener
// after Close.
func IsClosed(err error) bool { return errors.Is(err, net.ErrClosed) }
