package sock

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/mpmr/mpmr/internal/test/testenv"
)

// reset checks that the lingering socket whose peer is peer was reset,
// not let to linger: its peer reads ECONNRESET after the data, not EOF.
func reset(t *testing.T, peer *os.File, how string) {
	t.Helper()
	assert.ErrorIs(t, testenv.ReadUntilEnd(peer, 10*time.Second), unix.ECONNRESET, how)
}

// sendRaw sends b with fds on c, bypassing Send's own limits.
func sendRaw(t *testing.T, c *Conn, b []byte, fds ...int) {
	t.Helper()
	var oob []byte
	if len(fds) > 0 {
		oob = unix.UnixRights(fds...)
	}
	var err error
	require.NoError(t, c.rc.Control(func(fd uintptr) {
		_, err = unix.SendmsgN(int(fd), b, oob, nil, 0)
	}))
	require.NoError(t, err)
}

// passAndClose sends one byte with sender's descriptor on socket fd, and
// closes sender: the descriptor queued there is the last one.
func passAndClose(t *testing.T, fd int, sender *os.File) {
	t.Helper()
	_, err := unix.SendmsgN(fd, []byte("x"), unix.UnixRights(int(sender.Fd())), nil, 0)
	require.NoError(t, err)
	require.NoError(t, sender.Close())
}

// Descriptors the kernel would close inside a receive or a close, where
// nothing can make them safe first, are taken out and dropped instead:
// those of a message with more than fit (the receive keeps room for all a
// message can carry), those still queued on a connection being closed
// (behind an empty message too, which a read without credentials cannot
// tell from the end), and those queued on a unix socket that was itself
// sent and is dropped (a stream's behind its bytes, a listener's on the
// connections it has not accepted). A socket set to linger among them is
// reset, and nothing waits.
func TestNoDescriptorIsClosedUnseen(t *testing.T) {
	t.Run("more than MaxFiles in one message", func(t *testing.T) {
		a, b := pair(t)
		sender, peer := testenv.Lingering(t)
		var fds []int
		for range MaxFiles {
			fds = append(fds, int(os.Stdin.Fd()))
		}
		fds = append(fds, int(sender.Fd())) // last: past MaxFiles
		sendRaw(t, a, []byte("x"), fds...)
		require.NoError(t, sender.Close())
		var err error
		testenv.Bounded(t, "Recv", 10*time.Second, func() error { _, _, err = b.Recv(make([]byte, 8)); return nil })
		assert.ErrorIs(t, err, ErrTooManyFiles)
		reset(t, peer, "dropped, not closed inside the receive")
	})
	t.Run("queued on a connection being closed", func(t *testing.T) {
		a, b := pair(t)
		sender, peer := testenv.Lingering(t)
		sendRaw(t, a, []byte("x"), int(sender.Fd()))
		require.NoError(t, sender.Close())
		testenv.Bounded(t, "Close", 10*time.Second, b.Close)
		reset(t, peer, "dropped, not closed inside the close")
	})
	t.Run("queued on a blocking connection being closed", func(t *testing.T) {
		l, f, err := BlockingPair()
		require.NoError(t, err)
		other, err := NewBlocking(f, false)
		require.NoError(t, err)
		t.Cleanup(func() { other.Close(); l.Close() })
		sender, peer := testenv.Lingering(t)
		require.NoError(t, other.Send([]byte("x"), []*os.File{sender}, time.Time{}))
		require.NoError(t, sender.Close())
		testenv.Bounded(t, "Close", 10*time.Second, l.Close)
		reset(t, peer, "dropped, not closed inside the close")
	})
	t.Run("behind an empty message, on a connection being closed", func(t *testing.T) {
		a, b := pair(t)
		sender, peer := testenv.Lingering(t)
		sendRaw(t, a, nil) // reads as the end, to a read that is not told apart
		sendRaw(t, a, []byte("x"), int(sender.Fd()))
		require.NoError(t, sender.Close())
		testenv.Bounded(t, "Close", 10*time.Second, b.Close)
		reset(t, peer, "dropped, not closed inside the close")
	})
	t.Run("behind bytes, on a unix stream socket that is dropped", func(t *testing.T) {
		s, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
		require.NoError(t, err)
		sender, peer := testenv.Lingering(t)
		_, err = unix.Write(s[0], make([]byte, 2*maxDiscard))
		require.NoError(t, err)
		passAndClose(t, s[0], sender)
		unix.Close(s[0])
		testenv.Bounded(t, "Drop", 10*time.Second, func() error { Drop([]*os.File{os.NewFile(uintptr(s[1]), "stream")}); return nil })
		reset(t, peer, "dropped, not closed inside the stream's close")
	})
	t.Run("on a connection a dropped listener has not accepted", func(t *testing.T) {
		l, err := unix.Socket(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
		require.NoError(t, err)
		path := filepath.Join(t.TempDir(), "l")
		require.NoError(t, unix.Bind(l, &unix.SockaddrUnix{Name: path}))
		require.NoError(t, unix.Listen(l, 4))
		c, err := unix.Socket(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
		require.NoError(t, err)
		t.Cleanup(func() { unix.Close(c) })
		require.NoError(t, unix.Connect(c, &unix.SockaddrUnix{Name: path}))
		sender, peer := testenv.Lingering(t)
		passAndClose(t, c, sender)
		testenv.Bounded(t, "Drop", 10*time.Second, func() error { Drop([]*os.File{os.NewFile(uintptr(l), "listener")}); return nil })
		reset(t, peer, "dropped, not closed inside the listener's close")
	})
	t.Run("queued on a unix socket that is dropped", func(t *testing.T) {
		carrier, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
		require.NoError(t, err)
		sender, peer := testenv.Lingering(t)
		passAndClose(t, carrier[0], sender)
		unix.Close(carrier[0])
		testenv.Bounded(t, "Drop", 10*time.Second, func() error { Drop([]*os.File{os.NewFile(uintptr(carrier[1]), "carrier")}); return nil })
		reset(t, peer, "dropped, not closed inside the carrier's close")
	})
}
