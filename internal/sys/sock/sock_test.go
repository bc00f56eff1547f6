package sock

import (
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/mpmr/mpmr/internal/test/testenv"
)

func pair(t *testing.T) (*Conn, *Conn) {
	t.Helper()
	a, b, err := Pair()
	require.NoError(t, err)
	t.Cleanup(func() { a.Close(); b.Close() })
	return a, b
}

// openFDs counts this process's open descriptors.
func openFDs(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	require.NoError(t, err)
	return len(ents)
}

func TestMessageBoundariesAreKept(t *testing.T) {
	a, b := pair(t)
	msgs := [][]byte{[]byte("one"), make([]byte, 40000), []byte("x")}
	for _, m := range msgs {
		require.NoError(t, a.Send(m, nil))
	}
	buf := make([]byte, 64<<10)
	for _, m := range msgs {
		n, files, err := b.Recv(buf)
		require.NoError(t, err)
		assert.Empty(t, files)
		assert.Equal(t, len(m), n)
	}
}

func TestClosedPeerReadsAsEOF(t *testing.T) {
	a, b := pair(t)
	require.NoError(t, a.Send([]byte("last words"), nil))
	require.NoError(t, a.Close())
	buf := make([]byte, 64)
	n, _, err := b.Recv(buf)
	require.NoError(t, err, "what was sent before the close is still delivered")
	assert.Equal(t, "last words", string(buf[:n]))
	_, _, err = b.Recv(buf)
	assert.ErrorIs(t, err, io.EOF)
	assert.ErrorIs(t, b.Send([]byte("anyone?"), nil), ErrPeerClosed)
}

func TestPeerClosedWithUnreadDataReadsAsEOF(t *testing.T) {
	a, b := pair(t)
	require.NoError(t, b.Send([]byte("never read"), nil))
	require.NoError(t, a.Close()) // the kernel reports ECONNRESET to b
	_, _, err := b.Recv(make([]byte, 64))
	assert.ErrorIs(t, err, io.EOF)
}

func TestTruncatedMessageIsAnErrorAndTheNextOneIsIntact(t *testing.T) {
	a, b := pair(t)
	r, w, err := os.Pipe()
	require.NoError(t, err)
	defer r.Close()
	defer w.Close()
	before := openFDs(t)

	require.NoError(t, a.Send(make([]byte, 100), []*os.File{w}))
	require.NoError(t, a.Send([]byte("next"), nil))
	buf := make([]byte, 50)
	_, files, err := b.Recv(buf)
	assert.ErrorIs(t, err, ErrTruncated)
	assert.Nil(t, files)
	assert.Equal(t, before, openFDs(t), "the truncated message's descriptor was closed")

	n, _, err := b.Recv(buf)
	require.NoError(t, err)
	assert.Equal(t, "next", string(buf[:n]))
}

func TestFilesTravelAndArriveCloseOnExec(t *testing.T) {
	a, b := pair(t)
	r, w, err := os.Pipe()
	require.NoError(t, err)
	defer r.Close()
	defer w.Close()

	require.NoError(t, a.Send([]byte("here"), []*os.File{w}))
	buf := make([]byte, 16)
	n, files, err := b.Recv(buf)
	require.NoError(t, err)
	require.Len(t, files, 1)
	defer files[0].Close()
	assert.Equal(t, "here", string(buf[:n]))

	flags, err := unix.FcntlInt(files[0].Fd(), unix.F_GETFD, 0)
	require.NoError(t, err)
	assert.NotZero(t, flags&unix.FD_CLOEXEC, "received descriptors are close-on-exec")

	_, err = files[0].Write([]byte("through the passed pipe"))
	require.NoError(t, err)
	got := make([]byte, 64)
	n, err = r.Read(got)
	require.NoError(t, err)
	assert.Equal(t, "through the passed pipe", string(got[:n]))
}

func TestSendDoesNotChangeTheFilesBlockingMode(t *testing.T) {
	a, b := pair(t)
	r, w, err := os.Pipe() // non-blocking, on the poller
	require.NoError(t, err)
	defer r.Close()
	defer w.Close()
	require.NoError(t, a.Send([]byte("x"), []*os.File{r}))
	_, files, err := b.Recv(make([]byte, 4))
	require.NoError(t, err)
	Drop(files)

	// A read deadline only works on a file that is still on the poller.
	require.NoError(t, r.SetReadDeadline(time.Now().Add(time.Millisecond)))
	_, err = r.Read(make([]byte, 1))
	assert.ErrorIs(t, err, os.ErrDeadlineExceeded)
}

func TestTooManyFilesAreRefusedAndClosed(t *testing.T) {
	a, b := pair(t)
	r, w, err := os.Pipe()
	require.NoError(t, err)
	defer r.Close()
	defer w.Close()
	many := make([]*os.File, MaxFiles+1)
	for i := range many {
		many[i] = w
	}
	assert.ErrorIs(t, a.Send([]byte("x"), many), ErrTooManyFiles, "Send refuses to send them")

	// A peer that does not use this package can still send them.
	fds := make([]int, MaxFiles+4)
	for i := range fds {
		fds[i] = int(w.Fd())
	}
	before := openFDs(t)
	rc, err := a.c.SyscallConn()
	require.NoError(t, err)
	var serr error
	require.NoError(t, rc.Control(func(fd uintptr) {
		serr = unix.Sendmsg(int(fd), []byte("x"), unix.UnixRights(fds...), nil, 0)
	}))
	require.NoError(t, serr)
	_, files, err := b.Recv(make([]byte, 4))
	assert.ErrorIs(t, err, ErrTooManyFiles)
	assert.Nil(t, files)
	assert.Equal(t, before, openFDs(t), "none of the descriptors stays open")
}

func TestPeerCred(t *testing.T) {
	a, _ := pair(t)
	c, err := a.PeerCred()
	require.NoError(t, err)
	assert.Equal(t, Cred{PID: os.Getpid(), UID: os.Getuid(), GID: os.Getgid()}, c)
}

func TestCloseInterruptsRecvAndDeadlinesWork(t *testing.T) {
	a, _ := pair(t)
	require.NoError(t, a.SetReadDeadline(time.Now().Add(time.Millisecond)))
	_, _, err := a.Recv(make([]byte, 4))
	assert.ErrorIs(t, err, os.ErrDeadlineExceeded)
	require.NoError(t, a.SetReadDeadline(time.Time{}))

	done := make(chan error, 1)
	go func() {
		_, _, err := a.Recv(make([]byte, 4))
		done <- err
	}()
	require.NoError(t, a.Close())
	select {
	case err := <-done:
		assert.True(t, IsClosed(err), "got %v", err)
	case <-time.After(10 * time.Second):
		t.Fatal("Close did not interrupt Recv")
	}
	assert.NoError(t, a.Close(), "Close is idempotent")
}

func TestListenDialAccept(t *testing.T) {
	path := filepath.Join(t.TempDir(), "s")
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()

	_, err := Dial(ctx, path)
	assert.ErrorIs(t, err, ErrNoSocket)

	l, err := Listen(path, false)
	require.NoError(t, err)
	_, err = Listen(path, false)
	assert.ErrorIs(t, err, ErrAddressInUse)

	accepted := make(chan *Conn, 1)
	go func() {
		c, err := l.Accept()
		if err != nil {
			close(accepted)
			return
		}
		accepted <- c
	}()
	c, err := Dial(ctx, path)
	require.NoError(t, err)
	defer c.Close()
	s, ok := <-accepted
	require.True(t, ok)
	defer s.Close()

	cred, err := s.PeerCred()
	require.NoError(t, err)
	assert.Equal(t, os.Getpid(), cred.PID)
	require.NoError(t, c.Send([]byte("hi"), nil))
	buf := make([]byte, 8)
	n, _, err := s.Recv(buf)
	require.NoError(t, err)
	assert.Equal(t, "hi", string(buf[:n]))

	require.NoError(t, l.Close())
	require.NoError(t, l.Close(), "Close is idempotent")
	_, err = os.Stat(path)
	require.NoError(t, err, "the socket file stays: removing it is the caller's policy")
	_, err = Dial(ctx, path)
	assert.ErrorIs(t, err, ErrRefused)
	_, err = l.Accept()
	assert.True(t, IsClosed(err) || errors.Is(err, os.ErrClosed), "got %v", err)
}

func TestSpinReadable(t *testing.T) {
	a, b, err := Pair()
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	defer b.Close()
	if b.SpinReadable(time.Millisecond) {
		t.Fatal("nothing was sent, yet the socket reads as ready")
	}
	done := make(chan bool)
	go func() { done <- b.SpinReadable(10 * time.Second) }()
	if err := a.Send([]byte("x"), nil); err != nil {
		t.Fatal(err)
	}
	if !<-done {
		t.Fatal("a queued message was not seen")
	}
	buf := make([]byte, 8)
	if n, _, err := b.Recv(buf); err != nil || string(buf[:n]) != "x" {
		t.Fatalf("peek consumed the message: %q %v", buf[:n], err)
	}
	a.Close()
	if !b.SpinReadable(10 * time.Second) {
		t.Fatal("the end of the connection was not seen")
	}
}

// A receive on a connection allocates nothing of its own: the receive
// the poller tries is bound once, and recvmsg asks for no address.
func TestConnRecvAllocatesNothingAndCaughtUpSaysWhenAllWasTaken(t *testing.T) {
	a, b, err := Pair()
	require.NoError(t, err)
	t.Cleanup(func() { a.Close(); b.Close() })
	out, in := []byte("sync unmap 0 1"), make([]byte, 64)
	for range 101 { // AllocsPerRun's warm-up and its runs
		require.NoError(t, a.Send(out, nil))
	}
	allocs := testing.AllocsPerRun(100, func() {
		n, files, err := b.Recv(in)
		if err != nil || n != len(out) || files != nil {
			t.Fatalf("received %d bytes, %d files: %v", n, len(files), err)
		}
	})
	assert.Zero(t, allocs)

	require.NoError(t, a.Send(out, nil))
	assert.False(t, b.CaughtUp(), "a message is queued")
	_, _, err = b.Recv(in)
	require.NoError(t, err)
	assert.False(t, b.CaughtUp(), "the message taken may not have been dealt with yet")
	require.NoError(t, b.SetReadDeadline(time.Now().Add(time.Millisecond)))
	_, _, err = b.Recv(in)
	require.ErrorIs(t, err, os.ErrDeadlineExceeded)
	assert.True(t, b.CaughtUp(), "a receive found nothing more")
	require.NoError(t, b.Close())
	assert.True(t, b.CaughtUp(), "closed: nothing more to read")
}

// TrySend sends when the peer's queue has room, whatever the write
// deadline, and says so at once when it has none.
func TestConnTrySend(t *testing.T) {
	a, b, err := Pair()
	require.NoError(t, err)
	t.Cleanup(func() { a.Close(); b.Close() })
	require.NoError(t, a.SetWriteDeadline(time.Unix(1, 0))) // long past
	msg := []byte("sync unmap 0 1")
	sent := 0
	for {
		err := a.TrySend(msg, nil)
		if errors.Is(err, ErrWouldBlock) {
			break
		}
		require.NoError(t, err)
		sent++
	}
	require.NotZero(t, sent)
	_, _, err = b.Recv(make([]byte, 64))
	require.NoError(t, err)
	assert.NoError(t, a.TrySend(msg, nil), "room for one again")
	require.NoError(t, b.Close())
	assert.ErrorIs(t, a.TrySend(msg, nil), ErrPeerClosed)
}

// A connection waits in the listener's queue until it is accepted, and a
// peer that keeps the queue full makes each one that gets in wait for
// all those ahead of it: the queue is kept short. A non-blocking connect
// that finds it full is refused at once (EAGAIN); Dial waits for a place.
func TestTheListenQueueIsShort(t *testing.T) {
	path := filepath.Join(t.TempDir(), "s")
	l, err := Listen(path, false)
	require.NoError(t, err)
	defer l.Close()
	queued := 0
	for ; queued <= 4096; queued++ {
		fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC|unix.SOCK_NONBLOCK, 0)
		require.NoError(t, err)
		defer unix.Close(fd)
		if err := unix.Connect(fd, &unix.SockaddrUnix{Name: path}); err != nil {
			require.ErrorIs(t, err, unix.EAGAIN)
			break
		}
	}
	// Linux takes one more than the backlog, which it caps at somaxconn.
	b, err := os.ReadFile("/proc/sys/net/core/somaxconn")
	require.NoError(t, err)
	somaxconn, err := strconv.Atoi(strings.TrimSpace(string(b)))
	require.NoError(t, err)
	assert.Equal(t, min(listenBacklog, somaxconn)+1, queued, "connections queued before the queue was full")
}

// fullListener returns a listener, closed with the test, whose queue
// fillQueue has filled, and its path.
func fullListener(t *testing.T) (*Listener, string) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "s")
	l, err := Listen(path, false)
	require.NoError(t, err)
	t.Cleanup(func() { l.Close() })
	fillQueue(t, path)
	return l, path
}

// fillQueue connects to the listener at path until its queue is full,
// and keeps the connections open until the test ends.
func fillQueue(t *testing.T, path string) {
	t.Helper()
	for {
		fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC|unix.SOCK_NONBLOCK, 0)
		require.NoError(t, err)
		t.Cleanup(func() { unix.Close(fd) })
		if err := unix.Connect(fd, &unix.SockaddrUnix{Name: path}); err != nil {
			require.ErrorIs(t, err, unix.EAGAIN)
			return
		}
	}
}

// A Dial that finds the listener's queue full waits in the kernel for a
// place, a slice at a time, rather than trying again and again: woken as
// a place frees, it gets in ahead of a peer that connects in a loop to
// keep the queue full (tries a millisecond apart got in only when one
// came just as a place freed: 9-12 ms at the median, up to a quarter of
// a second, against half a millisecond), and it spends nothing while it
// waits.
func TestDialWaitsInTheKernelForAPlace(t *testing.T) {
	l, path := fullListener(t)
	var tries atomic.Int64
	tried := make(chan struct{}, 1)
	dialTried = func() {
		tries.Add(1)
		select {
		case tried <- struct{}{}:
		default:
		}
	}
	defer func() { dialTried = nil }()

	drain := func() { // the tries of Dials that returned
		for len(tried) > 0 {
			<-tried
		}
	}

	const out = 300 * time.Millisecond
	ctx, cancel := context.WithTimeout(t.Context(), out)
	defer cancel()
	_, err := Dial(ctx, path)
	require.ErrorIs(t, err, ErrBusy)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	// About one a slice; a tick may cut a slice short.
	assert.LessOrEqual(t, tries.Load(), 3*int64(out/dialSlice), "tries while held out for %v", out)

	// A cancellation ends the wait.
	drain()
	ctx, cancel = context.WithCancel(t.Context())
	errc := make(chan error, 1)
	go func() { _, err := Dial(ctx, path); errc <- err }()
	<-tried
	cancel()
	err = <-errc
	require.ErrorIs(t, err, ErrBusy)
	require.ErrorIs(t, err, context.Canceled)

	// A place that frees lets a Dial in while it waits in the kernel: in
	// its first try, however long that may wait.
	drain()
	defer func(s time.Duration) { dialSlice = s }(dialSlice)
	dialSlice = time.Hour
	var full atomic.Int64
	dialFull = func() { full.Add(1) }
	defer func() { dialFull = nil }()
	type dialed struct {
		c   *Conn
		err error
	}
	done := make(chan dialed, 1)
	ctx, cancel = context.WithTimeout(t.Context(), time.Minute) // a bound on a failure only
	defer cancel()
	go func() {
		c, err := Dial(ctx, path)
		done <- dialed{c, err}
	}()
	<-tried
	require.Eventually(t, threadInConnect, 10*time.Second, time.Millisecond, "no thread waits in connect(2)")
	s, err := l.Accept()
	require.NoError(t, err)
	s.Close()
	d := <-done
	require.NoError(t, d.err)
	d.c.Close()
	assert.Zero(t, full.Load(), "tries of the Dial a freed place let in that ended with the queue full")
}

// threadInConnect reports whether a thread of this process is in a
// connect(2) system call, as /proc says.
func threadInConnect() bool { return threadsInConnect() > 0 }

// threadsInConnect counts the threads of this process in a connect(2)
// system call.
func threadsInConnect() int { return testenv.ThreadsInSyscall(unix.SYS_CONNECT) }

// Each Dial that waits in the kernel holds a thread: a process dialing a
// full queue from many goroutines holds only so many, and the other Dials
// wait for their turn without one; all get in as places free.
func TestDialsWaitingInTheKernelAreBounded(t *testing.T) {
	l, path := fullListener(t)
	const limit, dials = 2, 5
	defer func(w chan struct{}, s time.Duration) { dialWaits, dialSlice = w, s }(dialWaits, dialSlice)
	dialWaits, dialSlice = make(chan struct{}, limit), time.Hour // a try ends when a place frees
	var tried, queued atomic.Int64
	dialTried = func() { tried.Add(1) }
	dialQueued = func() { queued.Add(1) }
	defer func() { dialTried, dialQueued = nil, nil }()

	ctx, cancel := context.WithTimeout(t.Context(), time.Minute) // a bound on a failure only
	defer cancel()
	errc := make(chan error, dials)
	for range dials {
		go func() {
			c, err := Dial(ctx, path)
			if err == nil {
				c.Close()
			}
			errc <- err
		}()
	}
	require.Eventually(t, func() bool { return tried.Load()+queued.Load() == dials && threadsInConnect() == limit },
		10*time.Second, time.Millisecond, "%d dials, each trying or waiting for a turn, %d of them in connect(2)", dials, limit)
	assert.Equal(t, int64(limit), tried.Load(), "dials waiting in the kernel")
	for range dials { // each place freed lets one in, and the next takes its turn
		s, err := l.Accept()
		require.NoError(t, err)
		s.Close()
	}
	for range dials {
		require.NoError(t, <-errc)
	}
}

// A Dial whose context has ended before it tried says so, not that the
// listener was busy.
func TestADialThatNeverTriedIsNotBusy(t *testing.T) {
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	_, err := Dial(ctx, filepath.Join(t.TempDir(), "nothing-there"))
	require.ErrorIs(t, err, context.Canceled)
	assert.NotErrorIs(t, err, ErrBusy)

	// Nor does it try after its deadline, whatever it would find: the
	// one more try is for a Dial that found the queue full.
	var tries atomic.Int64
	dialTried = func() { tries.Add(1) }
	defer func() { dialTried = nil }()
	ctx, cancel = context.WithDeadline(t.Context(), time.Now().Add(-time.Second))
	defer cancel()
	_, path := fullListener(t)
	_, err = Dial(ctx, path)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	assert.NotErrorIs(t, err, ErrBusy)
	assert.Zero(t, tries.Load())
}

// A Dial whose process was stopped (SIGSTOP, a debugger, a CPU it did not
// get) after a try found the queue full, until past its deadline, while a
// place freed, tries once more before it says ErrBusy: the server was not
// busy when it looked again. A cancelled Dial does not.
func TestADialStoppedPastItsDeadlineTriesOnceMore(t *testing.T) {
	defer func(s time.Duration) { dialSlice = s }(dialSlice)
	dialSlice = 20 * time.Millisecond
	defer func() { dialFull = nil }()
	for _, cancelled := range []bool{false, true} {
		l, path := fullListener(t)
		// A deadline the first try comes well within, or a cancellation
		// alone.
		var ctx context.Context
		var cancel context.CancelFunc
		if cancelled {
			ctx, cancel = context.WithCancel(t.Context())
		} else {
			ctx, cancel = context.WithTimeout(t.Context(), time.Second)
		}
		defer cancel()
		var once sync.Once
		dialFull = func() {
			once.Do(func() {
				s, err := l.Accept() // a place frees
				require.NoError(t, err)
				s.Close()
				if cancelled {
					cancel()
					return
				}
				<-ctx.Done() // the process is stopped until past the deadline
			})
		}
		c, err := Dial(ctx, path)
		if cancelled {
			require.ErrorIs(t, err, ErrBusy)
			require.ErrorIs(t, err, context.Canceled)
			continue
		}
		require.NoError(t, err, "a place had freed when it looked again")
		c.Close()
	}
}

// HungUp says whether the peer has closed its end, what is queued from it
// notwithstanding, and a connection closed here has hung up too.
func TestHungUp(t *testing.T) {
	a, b := pair(t)
	assert.False(t, b.HungUp(), "both ends open")
	require.NoError(t, a.Send([]byte("queued"), nil))
	assert.False(t, b.HungUp(), "a message queued is no end")
	require.NoError(t, a.Close())
	assert.True(t, b.HungUp(), "the peer closed, its message still queued")
	n, _, err := b.Recv(make([]byte, 16))
	require.NoError(t, err)
	assert.Equal(t, 6, n)
	c, d := pair(t)
	require.NoError(t, d.Close())
	assert.True(t, d.HungUp(), "closed here")
	assert.True(t, c.HungUp())
}
