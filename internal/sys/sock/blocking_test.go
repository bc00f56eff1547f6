package sock

import (
	"errors"
	"io"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/mpmr/mpmr/internal/test/testenv"
)

// blockingPair returns both ends of a fresh pair as Blocking connections,
// the second wakeable (as a client's would be).
func blockingPair(t *testing.T) (*Blocking, *Blocking) {
	t.Helper()
	a, f, err := BlockingPair()
	require.NoError(t, err)
	b, err := NewBlocking(f, true)
	require.NoError(t, err)
	t.Cleanup(func() { a.Close(); b.Close() })
	return a, b
}

// recvAsync runs Recv on b in a goroutine and returns its error.
func recvAsync(b *Blocking, deadline time.Time) <-chan error {
	done := make(chan error, 1)
	go func() {
		_, _, err := b.Recv(make([]byte, 64), deadline)
		done <- err
	}()
	return done
}

func waitErr(t *testing.T, ch <-chan error, what string) error {
	t.Helper()
	select {
	case err := <-ch:
		return err
	case <-time.After(10 * time.Second):
		t.Fatalf("%s did not return", what)
		return nil
	}
}

func TestBlockingKeepsBoundariesAndFilesBothWays(t *testing.T) {
	a, b := blockingPair(t)
	r, w, err := os.Pipe()
	require.NoError(t, err)
	defer r.Close()
	defer w.Close()

	buf := make([]byte, 64<<10)
	for _, dir := range []struct {
		name     string
		from, to *Blocking
	}{{"first to second", a, b}, {"second to first", b, a}} {
		msgs := [][]byte{[]byte("one"), make([]byte, 40000), []byte("x")}
		for i, m := range msgs {
			var files []*os.File
			if i == 0 {
				files = []*os.File{w}
			}
			require.NoError(t, dir.from.Send(m, files, time.Time{}), dir.name)
		}
		for i, m := range msgs {
			n, files, err := dir.to.Recv(buf, time.Time{})
			require.NoError(t, err, dir.name)
			assert.Equal(t, len(m), n, dir.name)
			if i > 0 {
				assert.Empty(t, files, dir.name)
				continue
			}
			require.Len(t, files, 1, dir.name)
			flags, err := unix.FcntlInt(files[0].Fd(), unix.F_GETFD, 0)
			require.NoError(t, err)
			assert.NotZero(t, flags&unix.FD_CLOEXEC, "received descriptors are close-on-exec")
			_, err = files[0].Write([]byte(dir.name))
			require.NoError(t, err)
			files[0].Close()
			got := make([]byte, 64)
			n, err = r.Read(got)
			require.NoError(t, err)
			assert.Equal(t, dir.name, string(got[:n]))
		}
	}
}

func TestBlockingRecvEndsAtDeadlineOnWakeAndOnClose(t *testing.T) {
	a, b := blockingPair(t)

	start := time.Now()
	_, _, err := b.Recv(make([]byte, 8), start.Add(20*time.Millisecond))
	assert.ErrorIs(t, err, os.ErrDeadlineExceeded)
	assert.GreaterOrEqual(t, time.Since(start), 20*time.Millisecond, "not before the deadline")
	_, _, err = b.Recv(make([]byte, 8), time.Now().Add(-time.Second))
	assert.ErrorIs(t, err, os.ErrDeadlineExceeded, "a deadline in the past")

	done := recvAsync(b, time.Time{})
	b.Wake()
	assert.ErrorIs(t, waitErr(t, done, "Recv after Wake"), ErrWoken)

	b.Wake() // before anyone waits: the next wait returns at once
	_, _, err = b.Recv(make([]byte, 8), time.Time{})
	assert.ErrorIs(t, err, ErrWoken)
	_, _, err = b.Recv(make([]byte, 8), time.Now().Add(5*time.Millisecond))
	assert.ErrorIs(t, err, os.ErrDeadlineExceeded, "one Wake ends one wait")

	require.NoError(t, a.Send([]byte("after"), nil, time.Time{}))
	n, _, err := b.Recv(make([]byte, 8), time.Time{})
	require.NoError(t, err)
	assert.Equal(t, 5, n)

	// Close ends a Recv blocked with no deadline on either kind of end.
	for _, wakeable := range []bool{false, true} {
		a, b := blockingPair(t)
		c := a
		if wakeable {
			c = b
		}
		done := recvAsync(c, time.Time{})
		require.NoError(t, c.Close())
		err := waitErr(t, done, "Recv after Close")
		assert.True(t, IsClosed(err), "wakeable %t: got %v", wakeable, err)
		assert.NoError(t, c.Close(), "Close is idempotent")
		_, _, err = c.Recv(make([]byte, 8), time.Time{})
		assert.True(t, IsClosed(err), "wakeable %t: Recv after Close: %v", wakeable, err)
		assert.True(t, IsClosed(c.Send([]byte("x"), nil, time.Time{})), "wakeable %t: Send after Close", wakeable)
	}
}

func TestBlockingPeerEndReadsAsEOF(t *testing.T) {
	t.Run("after what it sent", func(t *testing.T) {
		a, b := blockingPair(t)
		require.NoError(t, a.Send([]byte("last words"), nil, time.Time{}))
		require.NoError(t, a.Close())
		buf := make([]byte, 64)
		n, _, err := b.Recv(buf, time.Time{})
		require.NoError(t, err, "what was sent before the close is still delivered")
		assert.Equal(t, "last words", string(buf[:n]))
		_, _, err = b.Recv(buf, time.Time{})
		assert.ErrorIs(t, err, io.EOF)
		assert.ErrorIs(t, b.Send([]byte("anyone?"), nil, time.Time{}), ErrPeerClosed)
	})
	t.Run("while blocked", func(t *testing.T) {
		for _, wakeable := range []bool{false, true} {
			a, b := blockingPair(t)
			waiter, closer := a, b
			if wakeable {
				waiter, closer = b, a
			}
			done := recvAsync(waiter, time.Time{})
			require.NoError(t, closer.Close())
			assert.ErrorIs(t, waitErr(t, done, "Recv after the peer's Close"), io.EOF, "wakeable %t", wakeable)
		}
	})
	t.Run("with unread data", func(t *testing.T) {
		a, b := blockingPair(t)
		require.NoError(t, b.Send([]byte("never read"), nil, time.Time{}))
		require.NoError(t, a.Close()) // the kernel reports ECONNRESET to b
		_, _, err := b.Recv(make([]byte, 64), time.Time{})
		assert.ErrorIs(t, err, io.EOF)
	})
}

func TestBlockingTruncatedMessageClosesItsFiles(t *testing.T) {
	a, b := blockingPair(t)
	r, w, err := os.Pipe()
	require.NoError(t, err)
	defer r.Close()
	defer w.Close()
	before := openFDs(t)
	require.NoError(t, a.Send(make([]byte, 100), []*os.File{w}, time.Time{}))
	require.NoError(t, a.Send([]byte("next"), nil, time.Time{}))
	buf := make([]byte, 50)
	_, files, err := b.Recv(buf, time.Time{})
	assert.ErrorIs(t, err, ErrTruncated)
	assert.Nil(t, files)
	assert.Equal(t, before, openFDs(t), "the truncated message's descriptor was closed")
	n, _, err := b.Recv(buf, time.Time{})
	require.NoError(t, err)
	assert.Equal(t, "next", string(buf[:n]))
}

// A send that finds the peer's queue full waits for room until its
// deadline, and sends nothing meanwhile: a datagram goes whole or not at
// all. Wake is for the receiver: it neither ends the send's wait nor is
// used up by it.
func TestBlockingSendWaitsForRoom(t *testing.T) {
	a, b := blockingPair(t)
	big := make([]byte, 60<<10)
	queued := 0
	for ; ; queued++ {
		require.Less(t, queued, 1000, "the socket never filled up")
		err := b.Send(big, nil, time.Now().Add(5*time.Millisecond))
		if errors.Is(err, os.ErrDeadlineExceeded) {
			break
		}
		require.NoError(t, err)
	}
	b.Wake()
	assert.ErrorIs(t, b.Send(big, nil, time.Now().Add(5*time.Millisecond)), os.ErrDeadlineExceeded)
	_, _, err := b.Recv(make([]byte, 8), time.Time{})
	assert.ErrorIs(t, err, ErrWoken, "the wake-up is still there for the receiver")

	done := make(chan error, 1)
	go func() { done <- b.Send([]byte("last"), nil, time.Now().Add(10*time.Second)) }()
	buf := make([]byte, 64<<10)
	for range queued {
		n, _, err := a.Recv(buf, time.Time{})
		require.NoError(t, err)
		require.Equal(t, len(big), n, "only whole messages")
	}
	require.NoError(t, waitErr(t, done, "Send once there is room"))
	n, _, err := a.Recv(buf, time.Time{})
	require.NoError(t, err)
	assert.Equal(t, "last", string(buf[:n]))
}

func TestBlockingCloseLeavesNoDescriptors(t *testing.T) {
	before := openFDs(t)
	for range 10 {
		a, f, err := BlockingPair()
		require.NoError(t, err)
		b, err := NewBlocking(f, true)
		require.NoError(t, err)
		done := recvAsync(b, time.Time{})
		require.NoError(t, b.Close())
		assert.True(t, IsClosed(waitErr(t, done, "Recv after Close")))
		require.NoError(t, a.Close())
	}
	assert.Equal(t, before, openFDs(t))
}

func TestNewBlockingTakesOnlySeqpacketSockets(t *testing.T) {
	r, w, err := os.Pipe()
	require.NoError(t, err)
	defer r.Close()
	_, err = NewBlocking(w, false)
	assert.ErrorIs(t, err, ErrNotSeqpacket)

	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	require.NoError(t, err)
	defer unix.Close(fds[1])
	_, err = NewBlocking(os.NewFile(uintptr(fds[0]), "stream"), false)
	assert.ErrorIs(t, err, ErrNotSeqpacket)
}

func TestBlockingPeerCred(t *testing.T) {
	a, b := blockingPair(t)
	for _, c := range []*Blocking{a, b} {
		cred, err := c.PeerCred()
		require.NoError(t, err)
		assert.Equal(t, Cred{PID: os.Getpid(), UID: os.Getuid(), GID: os.Getgid()}, cred)
	}
}

func TestBlockingSpinReadable(t *testing.T) {
	a, b := blockingPair(t)
	assert.False(t, b.SpinReadable(time.Millisecond), "nothing was sent")
	done := make(chan bool)
	go func() { done <- b.SpinReadable(10 * time.Second) }()
	require.NoError(t, a.Send([]byte("x"), nil, time.Time{}))
	assert.True(t, <-done, "a queued message is seen")
	buf := make([]byte, 8)
	n, _, err := b.Recv(buf, time.Time{})
	require.NoError(t, err)
	assert.Equal(t, "x", string(buf[:n]), "spinning consumed nothing")
}

// A Wake ends SpinWakeable and is left for the receive after it; it does
// not end SpinReadable, whose receiver may never clear it.
func TestBlockingSpinWakeable(t *testing.T) {
	_, b := blockingPair(t) // b is wakeable
	b.Wake()
	done := make(chan bool)
	go func() { done <- b.SpinWakeable(10 * time.Second) }()
	select {
	case readable := <-done:
		assert.True(t, readable, "woken: Recv returns at once")
	case <-time.After(5 * time.Second):
		t.Fatal("a pending Wake did not end SpinWakeable")
	}
	assert.False(t, b.SpinReadable(10*time.Millisecond), "a pending Wake does not end it")
	_, _, err := b.Recv(make([]byte, 8), time.Now().Add(10*time.Second))
	assert.ErrorIs(t, err, ErrWoken, "the Wake was left for the receive")
}

// TrySend sends while there is room and otherwise fails at once with
// ErrWouldBlock, having sent nothing.
func TestBlockingTrySend(t *testing.T) {
	a, b := blockingPair(t)
	big := make([]byte, 60<<10)
	queued := 0
	for ; ; queued++ {
		require.Less(t, queued, 1000, "the socket never filled up")
		err := b.TrySend(big, nil)
		if errors.Is(err, ErrWouldBlock) {
			break
		}
		require.NoError(t, err)
	}
	require.NotZero(t, queued)
	buf := make([]byte, 64<<10)
	for range queued {
		n, _, err := a.Recv(buf, time.Now().Add(time.Second))
		require.NoError(t, err)
		require.Equal(t, len(big), n)
	}
	_, _, err := a.Recv(buf, time.Now().Add(5*time.Millisecond))
	assert.ErrorIs(t, err, os.ErrDeadlineExceeded, "the refused message was not sent")
	require.NoError(t, b.TrySend([]byte("room again"), nil))
	n, _, err := a.Recv(buf, time.Now().Add(time.Second))
	require.NoError(t, err)
	assert.Equal(t, "room again", string(buf[:n]))
	require.NoError(t, a.Close())
	assert.ErrorIs(t, b.TrySend([]byte("x"), nil), ErrPeerClosed)
}

// RecvBy on a wakeable end receives, leaves a Wake to the next
// Recv, and ends when the connection is closed.
func TestBlockingRecvBy(t *testing.T) {
	a, b := blockingPair(t)
	b.Wake()
	require.NoError(t, a.Send([]byte("one"), nil, time.Time{}))
	buf := make([]byte, 8)
	n, _, err := b.RecvBy(buf, time.Time{})
	require.NoError(t, err, "a Wake does not end it")
	assert.Equal(t, "one", string(buf[:n]))
	_, _, err = b.Recv(buf, time.Time{})
	assert.ErrorIs(t, err, ErrWoken, "the wake-up waits for a Recv that watches for it")

	done := make(chan error, 1)
	go func() {
		_, _, err := b.RecvBy(buf, time.Time{})
		done <- err
	}()
	require.NoError(t, b.Close())
	assert.True(t, IsClosed(waitErr(t, done, "RecvBy after Close")))
}

// A message without descriptors costs no allocation either way: the call
// lane sends and receives one per round trip.
func TestBlockingMessageAllocatesNothing(t *testing.T) {
	a, b := blockingPair(t)
	out, in := []byte("create-mr 0x7f0012345000"), make([]byte, 64)
	allocs := testing.AllocsPerRun(100, func() {
		if err := a.Send(out, nil, time.Time{}); err != nil {
			t.Fatal(err)
		}
		n, files, err := b.RecvBy(in, time.Time{})
		if err != nil || n != len(out) || files != nil {
			t.Fatalf("received %d bytes, %d files: %v", n, len(files), err)
		}
	})
	assert.Zero(t, allocs)
}

// RecvBy keeps a deadline with the socket's receive timeout: it takes what
// came in time, gives up only once the deadline has passed, and sets the
// timeout once for calls with like deadlines.
func TestBlockingRecvByDeadline(t *testing.T) {
	a, b := blockingPair(t)
	timeout := func() time.Duration {
		tv, err := unix.GetsockoptTimeval(b.fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO)
		require.NoError(t, err)
		return time.Duration(tv.Nano())
	}
	buf := make([]byte, 8)
	var first time.Duration
	for i := range 3 {
		require.NoError(t, a.Send([]byte("one"), nil, time.Time{}))
		n, _, err := b.RecvBy(buf, time.Now().Add(2*time.Second))
		require.NoError(t, err)
		assert.Equal(t, "one", string(buf[:n]))
		if i == 0 {
			first = b.rcvtimeo
		}
	}
	assert.Equal(t, first, b.rcvtimeo, "set once, by the first call")
	set := timeout()
	assert.True(t, set > 500*time.Millisecond && set <= time.Second, "half the time left: %v", set)

	b.Wake()
	deadline := time.Now().Add(30 * time.Millisecond)
	_, _, err := b.RecvBy(buf, deadline)
	assert.ErrorIs(t, err, os.ErrDeadlineExceeded, "neither a Wake nor the timeout ends it early")
	assert.False(t, time.Now().Before(deadline), "not before the deadline")
	_, _, err = b.RecvBy(buf, time.Now().Add(-time.Second))
	assert.ErrorIs(t, err, os.ErrDeadlineExceeded, "a deadline already past")

	require.NoError(t, a.Send([]byte("two"), nil, time.Time{}))
	n, _, err := b.RecvBy(buf, time.Time{})
	require.NoError(t, err)
	assert.Equal(t, "two", string(buf[:n]))
	assert.Zero(t, timeout(), "no deadline, no timeout left behind")

	done := make(chan error, 1)
	go func() {
		_, _, err := b.RecvBy(buf, time.Now().Add(time.Minute))
		done <- err
	}()
	require.NoError(t, b.Close())
	assert.True(t, IsClosed(waitErr(t, done, "RecvBy with a deadline after Close")))
}

// A socket handed over with a receive timeout set (by its maker) loses it:
// RecvBy keeps its own, and a wait without a deadline must not wake at it.
func TestNewBlockingClearsAReceiveTimeout(t *testing.T) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	require.NoError(t, err)
	defer unix.Close(fds[1])
	tv := unix.NsecToTimeval(int64(4 * time.Millisecond))
	require.NoError(t, unix.SetsockoptTimeval(fds[0], unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv))
	b, err := NewBlocking(os.NewFile(uintptr(fds[0]), "timed"), false)
	require.NoError(t, err)
	defer b.Close()
	got, err := unix.GetsockoptTimeval(b.fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO)
	require.NoError(t, err)
	assert.Zero(t, got.Nano(), "the maker's timeout is gone")
}

// TryRecv takes a message that is queued and waits for none.
func TestBlockingTryRecv(t *testing.T) {
	a, b := blockingPair(t)
	buf := make([]byte, 8)
	_, _, err := b.TryRecv(buf)
	require.ErrorIs(t, err, ErrNoMessage)
	require.NoError(t, a.Send([]byte("one"), nil, time.Time{}))
	n, files, err := b.TryRecv(buf)
	require.NoError(t, err)
	assert.Equal(t, "one", string(buf[:n]))
	assert.Empty(t, files)
	_, _, err = b.TryRecv(buf)
	require.ErrorIs(t, err, ErrNoMessage)
}

// Queued says whether a message waits, and a closed connection cannot
// say otherwise.
func TestBlockingQueued(t *testing.T) {
	a, b := blockingPair(t)
	assert.False(t, b.Queued())
	require.NoError(t, a.Send([]byte("one"), nil, time.Time{}))
	assert.True(t, b.Queued())
	_, _, err := b.TryRecv(make([]byte, 8))
	require.NoError(t, err)
	assert.False(t, b.Queued())
	require.NoError(t, b.Close())
	assert.True(t, b.Queued())
}

// CaughtUp says whether everything the peer sent has been dealt with:
// nothing queued, and every message received declared dealt with (Dealt,
// or the next receive). A receive holds none while it waits.
func TestBlockingCaughtUpSaysWhenAllWasDealtWith(t *testing.T) {
	a, b := blockingPair(t)
	buf := make([]byte, 8)
	assert.True(t, b.CaughtUp(), "nothing sent")
	require.NoError(t, a.Send([]byte("one"), nil, time.Time{}))
	assert.False(t, b.CaughtUp(), "a message is queued")
	_, _, err := b.Recv(buf, time.Now().Add(time.Second))
	require.NoError(t, err)
	assert.False(t, b.CaughtUp(), "the message received is not dealt with yet")
	b.Dealt()
	assert.True(t, b.CaughtUp(), "dealt with")

	require.NoError(t, a.Send([]byte("two"), nil, time.Time{}))
	_, _, err = b.TryRecv(buf)
	require.NoError(t, err)
	assert.False(t, b.CaughtUp(), "taken, not dealt with")
	_, _, err = b.Recv(buf, time.Now().Add(time.Millisecond))
	require.ErrorIs(t, err, os.ErrDeadlineExceeded)
	assert.True(t, b.CaughtUp(), "the next receive came back with nothing")

	// A receive that waits first holds nothing while it waits.
	waiting := recvAsync(b, time.Now().Add(10*time.Second))
	waitUntilGoroutinesIn(t, "sock.(*Blocking).wait(")
	assert.True(t, b.CaughtUp(), "a receive waiting for a message")
	require.NoError(t, a.Send([]byte("three"), nil, time.Time{}))
	require.NoError(t, waitErr(t, waiting, "the waiting receive"))
	assert.False(t, b.CaughtUp(), "received, not dealt with")
	b.Dealt()

	// A plain blocking receive marks what it took as it returns.
	plain := make(chan error, 1)
	go func() {
		_, _, err := b.RecvBy(make([]byte, 8), time.Time{})
		plain <- err
	}()
	waitUntilGoroutinesIn(t, "sock.(*Blocking).recvBlocking(")
	assert.True(t, b.CaughtUp(), "a plain receive waiting for a message")
	require.NoError(t, a.Send([]byte("four"), nil, time.Time{}))
	require.NoError(t, waitErr(t, plain, "the plain receive"))
	assert.False(t, b.CaughtUp(), "received, not dealt with")
	_, _, err = b.TryRecv(buf)
	require.ErrorIs(t, err, ErrNoMessage)
	assert.True(t, b.CaughtUp(), "a receive found nothing more")
	require.NoError(t, b.Close())
	assert.True(t, b.CaughtUp(), "closed: nothing more to read")
}

// waitUntilGoroutinesIn waits for a goroutine whose stack holds every one
// of frames.
func waitUntilGoroutinesIn(t *testing.T, frames ...string) {
	t.Helper()
	for end := time.Now().Add(10 * time.Second); testenv.GoroutinesIn(frames...) == 0; {
		require.True(t, time.Now().Before(end), "no goroutine in %v", frames)
		time.Sleep(time.Millisecond) // polling the runtime's answer
	}
}

// A message taken off the queue by Recv or TryRecv is marked held, for
// CaughtUp, from before it left the queue: the receiver's thread may
// stop right after the system call. (A plain blocking receive, RecvBy,
// cannot mark it before the kernel takes it inside the call: see
// CaughtUp.)
func TestBlockingMarksAMessageBeforeItLeavesTheQueue(t *testing.T) {
	for _, how := range []string{"Recv", "TryRecv"} {
		t.Run(how, func(t *testing.T) {
			a, b := blockingPair(t)
			var seen []bool // the mark, as each receive's system call returned
			hook := func() { seen = append(seen, b.holding.Load()) }
			afterRecv.Store(&hook)
			defer afterRecv.Store(nil)
			require.NoError(t, a.Send([]byte("one"), nil, time.Time{}))
			buf := make([]byte, 8)
			var err error
			if how == "Recv" {
				_, _, err = b.Recv(buf, time.Now().Add(time.Second))
			} else {
				_, _, err = b.TryRecv(buf)
			}
			require.NoError(t, err)
			assert.Equal(t, []bool{true}, seen, "the message taken, not yet returned, is not marked")
			assert.False(t, b.CaughtUp(), "returned, not dealt with")
		})
	}
}

// A receive that fails returns no message to deal with: a message too
// long for the buffer, or the peer's end, leaves nothing held, whichever
// receive met it.
func TestBlockingHoldsNothingAfterAFailedReceive(t *testing.T) {
	for _, how := range []string{"Recv", "RecvBy", "TryRecv"} {
		t.Run(how, func(t *testing.T) {
			a, b := blockingPair(t)
			recv := func() error {
				buf := make([]byte, 2)
				var err error
				switch how {
				case "Recv":
					_, _, err = b.Recv(buf, time.Now().Add(time.Second))
				case "RecvBy":
					_, _, err = b.RecvBy(buf, time.Now().Add(time.Second))
				default:
					_, _, err = b.TryRecv(buf)
				}
				return err
			}
			require.NoError(t, a.Send([]byte("too long"), nil, time.Time{}))
			require.ErrorIs(t, recv(), ErrTruncated)
			assert.True(t, b.CaughtUp(), "after a message too long")
			require.NoError(t, a.Close())
			require.ErrorIs(t, recv(), io.EOF)
			assert.True(t, b.CaughtUp(), "after the peer's end")
		})
	}
}

// A peer that closes with a message of ours unread makes the kernel report
// ECONNRESET at our next receive, ahead of what the peer sent before it
// closed (its reason for closing, say). Every receive still returns those
// messages first, then the end.
func TestAPeerThatClosesWithOurMessageUnreadIsReadToTheEnd(t *testing.T) {
	buf := make([]byte, 64)
	for _, c := range []struct {
		name string
		recv func(t *testing.T, why string) (recv func() (int, error))
	}{
		{"Conn", func(t *testing.T, why string) func() (int, error) {
			a, b := pair(t)
			require.NoError(t, b.Send([]byte("unread"), nil))
			require.NoError(t, a.Send([]byte(why), nil))
			require.NoError(t, a.Close())
			return func() (int, error) { n, _, err := b.Recv(buf); return n, err }
		}},
		{"Blocking/blocking", func(t *testing.T, why string) func() (int, error) {
			a, b := blockingPair(t) // a is not wakeable: a plain blocking receive
			require.NoError(t, a.Send([]byte("unread"), nil, time.Time{}))
			require.NoError(t, b.Send([]byte(why), nil, time.Time{}))
			require.NoError(t, b.Close())
			return func() (int, error) { n, _, err := a.Recv(buf, time.Time{}); return n, err }
		}},
		{"Blocking/deadline", func(t *testing.T, why string) func() (int, error) {
			a, b := blockingPair(t)
			require.NoError(t, a.Send([]byte("unread"), nil, time.Time{}))
			require.NoError(t, b.Send([]byte(why), nil, time.Time{}))
			require.NoError(t, b.Close())
			return func() (int, error) { n, _, err := a.Recv(buf, time.Now().Add(10*time.Second)); return n, err }
		}},
		{"Blocking/try", func(t *testing.T, why string) func() (int, error) {
			a, b := blockingPair(t)
			require.NoError(t, a.Send([]byte("unread"), nil, time.Time{}))
			require.NoError(t, b.Send([]byte(why), nil, time.Time{}))
			require.NoError(t, b.Close())
			return func() (int, error) { n, _, err := a.TryRecv(buf); return n, err }
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			recv := c.recv(t, "why")
			n, err := recv()
			require.NoError(t, err, "the message sent before the close comes first")
			assert.Equal(t, "why", string(buf[:n]))
			_, err = recv()
			assert.ErrorIs(t, err, io.EOF, "then the end")
		})
	}
}
