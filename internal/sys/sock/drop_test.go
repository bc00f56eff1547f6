package sock

import (
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/mpmr/mpmr/internal/test/testenv"
)

// lingering returns the sending end of a TCP connection whose last close
// waits up to ten minutes, and its peer, both closed with the test (the
// peer first: it resets the connection, so that no close waits then).
func lingering(t *testing.T) (sender, peer *os.File) {
	t.Helper()
	sender, peer, err := testenv.LingeringTCP(10 * time.Minute)
	require.NoError(t, err)
	t.Cleanup(func() { sender.Close() })
	t.Cleanup(func() { peer.Close() })
	return sender, peer
}

// reset checks that the lingering socket whose peer is peer was reset,
// not let to linger: its peer reads ECONNRESET after the data, not EOF.
func reset(t *testing.T, peer *os.File, how string) {
	t.Helper()
	assert.ErrorIs(t, testenv.ReadUntilEnd(peer, 10*time.Second), unix.ECONNRESET, how)
}

// bounded runs fn, failing t if it does not return within 10 s.
func bounded(t *testing.T, what string, fn func()) {
	t.Helper()
	done := make(chan struct{})
	go func() { fn(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatalf("%s did not return within 10 s", what)
	}
}

// sendRaw sends b with fds on c, bypassing Send's own limits.
func sendRaw(t *testing.T, c *Conn, b []byte, fds ...int) {
	t.Helper()
	var err error
	require.NoError(t, c.rc.Control(func(fd uintptr) {
		_, err = unix.SendmsgN(int(fd), b, unix.UnixRights(fds...), nil, 0)
	}))
	require.NoError(t, err)
}

// Descriptors the kernel would close inside a receive or a close, where
// nothing can make them safe first, are taken out and dropped instead:
// those of a message with more than fit (the receive keeps room for all a
// message can carry), those still queued on a connection being closed,
// and those queued on a unix socket that was itself sent and is dropped.
// A socket set to linger among them is reset, and nothing waits.
func TestNoDescriptorIsClosedUnseen(t *testing.T) {
	t.Run("more than MaxFiles in one message", func(t *testing.T) {
		a, b := pair(t)
		sender, peer := lingering(t)
		var fds []int
		for range MaxFiles {
			fds = append(fds, int(os.Stdin.Fd()))
		}
		fds = append(fds, int(sender.Fd())) // last: past MaxFiles
		sendRaw(t, a, []byte("x"), fds...)
		require.NoError(t, sender.Close())
		var err error
		bounded(t, "Recv", func() { _, _, err = b.Recv(make([]byte, 8)) })
		assert.ErrorIs(t, err, ErrTooManyFiles)
		reset(t, peer, "dropped, not closed inside the receive")
	})
	t.Run("queued on a connection being closed", func(t *testing.T) {
		a, b := pair(t)
		sender, peer := lingering(t)
		sendRaw(t, a, []byte("x"), int(sender.Fd()))
		require.NoError(t, sender.Close())
		bounded(t, "Close", func() { b.Close() })
		reset(t, peer, "dropped, not closed inside the close")
	})
	t.Run("queued on a blocking connection being closed", func(t *testing.T) {
		l, f, err := BlockingPair()
		require.NoError(t, err)
		other, err := NewBlocking(f, false)
		require.NoError(t, err)
		t.Cleanup(func() { other.Close(); l.Close() })
		sender, peer := lingering(t)
		require.NoError(t, other.Send([]byte("x"), []*os.File{sender}, time.Time{}))
		require.NoError(t, sender.Close())
		bounded(t, "Close", func() { l.Close() })
		reset(t, peer, "dropped, not closed inside the close")
	})
	t.Run("queued on a unix socket that is dropped", func(t *testing.T) {
		carrier, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
		require.NoError(t, err)
		sender, peer := lingering(t)
		_, err = unix.SendmsgN(carrier[0], []byte("x"), unix.UnixRights(int(sender.Fd())), nil, 0)
		require.NoError(t, err)
		require.NoError(t, sender.Close())
		unix.Close(carrier[0])
		bounded(t, "Drop", func() { Drop([]*os.File{os.NewFile(uintptr(carrier[1]), "carrier")}) })
		reset(t, peer, "dropped, not closed inside the carrier's close")
	})
}
