package testenv

import (
	"errors"
	"fmt"
	"io"
	"os"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// KernelRefusesRights reports whether this kernel can refuse the
// descriptors sent to a socket (SO_PASSRIGHTS, Linux 6.16): then a
// primary's sockets take none, and a peer's send of any fails with EPERM.
func KernelRefusesRights() bool {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return false
	}
	defer unix.Close(fds[0])
	defer unix.Close(fds[1])
	return unix.SetsockoptInt(fds[0], unix.SOL_SOCKET, unix.SO_PASSRIGHTS, 0) == nil
}

// LingeringTCP returns a loopback TCP connection whose sending end's last
// close waits up to linger for the data it could not send: SO_LINGER on,
// its send queue full, and its peer (returned second) reading nothing. A
// process handed the sending end and closing it last waits so, unless it
// resets it; then the peer reads ECONNRESET after the data (see
// ReadUntilEnd), where a close that waited would have let it read to EOF.
func LingeringTCP(linger time.Duration) (sender, peer *os.File, err error) {
	ln, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, nil, err
	}
	defer unix.Close(ln)
	if err = unix.Bind(ln, &unix.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err == nil {
		err = unix.SetsockoptInt(ln, unix.SOL_SOCKET, unix.SO_RCVBUF, 4096)
	}
	if err == nil {
		err = unix.Listen(ln, 1)
	}
	sa, gerr := unix.Getsockname(ln)
	if err == nil {
		err = gerr
	}
	if err != nil {
		return nil, nil, fmt.Errorf("testenv: tcp listener: %w", err)
	}
	s, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, nil, err
	}
	sender = os.NewFile(uintptr(s), "lingering-tcp")
	fail := func(err error) (*os.File, *os.File, error) {
		sender.Close()
		return nil, nil, fmt.Errorf("testenv: lingering tcp: %w", err)
	}
	if err := unix.SetsockoptInt(s, unix.SOL_SOCKET, unix.SO_SNDBUF, 4096); err != nil {
		return fail(err)
	}
	if err := unix.Connect(s, sa); err != nil {
		return fail(err)
	}
	p, _, err := unix.Accept4(ln, unix.SOCK_CLOEXEC)
	if err != nil {
		return fail(err)
	}
	peer = os.NewFile(uintptr(p), "lingering-tcp-peer")
	// Fill the send queue: with the peer not reading, the rest of what
	// is written stays unsent.
	buf := make([]byte, 64<<10)
	for {
		if _, err := unix.SendmsgN(s, buf, nil, nil, unix.MSG_DONTWAIT); err != nil {
			if errors.Is(err, unix.EAGAIN) {
				break
			}
			peer.Close()
			return fail(err)
		}
	}
	l := unix.Linger{Onoff: 1, Linger: int32(linger / time.Second)}
	if err := unix.SetsockoptLinger(s, unix.SOL_SOCKET, unix.SO_LINGER, &l); err != nil {
		peer.Close()
		return fail(err)
	}
	return sender, peer, nil
}

// Lingering is LingeringTCP with a ten-minute linger for a test: both
// ends are closed with it, the peer first, which resets the connection,
// so that no close of the sender (the test's, or one still waiting
// elsewhere) waits then.
func Lingering(tb testing.TB) (sender, peer *os.File) {
	tb.Helper()
	sender, peer, err := LingeringTCP(10 * time.Minute)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { sender.Close() })
	tb.Cleanup(func() { peer.Close() })
	return sender, peer
}

// ReadUntilEnd reads peer until it ends, for at most limit, and returns
// how it ended: io.EOF for a close that let the data go first, the error
// (ECONNRESET for a reset) otherwise.
func ReadUntilEnd(peer *os.File, limit time.Duration) error {
	tv := unix.NsecToTimeval(int64(limit))
	if err := unix.SetsockoptTimeval(int(peer.Fd()), unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv); err != nil {
		return err
	}
	deadline := time.Now().Add(limit)
	buf := make([]byte, 64<<10)
	for time.Now().Before(deadline) {
		n, err := unix.Read(int(peer.Fd()), buf)
		switch {
		case err == unix.EINTR:
		case err != nil:
			return err
		case n == 0:
			return io.EOF
		}
	}
	return os.ErrDeadlineExceeded
}
