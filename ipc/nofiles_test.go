package ipc_test

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/mpmr/mpmr/internal/sys/sock"
	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/ipc"
)

// statsFrame is a stats request declaring files descriptors.
func statsFrame(t *testing.T, files int) []byte {
	t.Helper()
	b, err := ipc.AppendFrame(nil, 7, ipc.KindStats, files, &ipc.StatsRequest{})
	require.NoError(t, err)
	return b
}

// A server drops the descriptors it refuses on arrival, and closing one
// must not wait on its sender: the last close of a TCP socket set to
// linger waits for the data it could not send, for as long as the linger
// says. A socket dropped so is reset instead (its peer reads ECONNRESET,
// not the end of the data), whichever way it came: with a request before
// the hello, on a frame that declares no descriptors, or on an answer
// nobody asked for. And the server's Close returns while the sender holds
// on.
func TestDroppedSocketsCloseAtOnce(t *testing.T) {
	s := startServer(t, newHandler(), withHello) // takes descriptors, after the hello
	for name, frame := range map[string][]byte{
		"a request before the hello": statsFrame(t, 1),
		"a frame that declares none": statsFrame(t, 0),
		"a stray answer":             replyFrame(t, 99, 1),
	} {
		t.Run(name, func(t *testing.T) {
			c, err := sock.Dial(ctxBound(t), s.path)
			require.NoError(t, err)
			t.Cleanup(func() { c.Close() })
			sender, peer := testenv.Lingering(t)
			require.NoError(t, c.Send(frame, []*os.File{sender}))
			require.NoError(t, sender.Close())
			assert.ErrorIs(t, testenv.ReadUntilEnd(peer, bound), unix.ECONNRESET,
				"the server reset the socket it dropped, instead of waiting for its data to go")
		})
	}
	_, err := testenv.Bounded(t, "the server's Close", bound, s.Close)
	assert.NoError(t, err)
}

// A descriptor sent on a call lane without the notice that announces one
// is received and dropped like any other the server does not take, where
// the lane does not refuse it (a server that takes descriptors, or a
// kernel that cannot refuse them): the kernel no longer closes it inside
// the lane thread's receive, where it lingered.
func TestUnannouncedDescriptorOnTheLaneIsDropped(t *testing.T) {
	s := startServer(t, newHandler(), withHello) // takes descriptors: its lanes do not refuse them
	_, lane := rawLaneFD(t, s)
	sender, peer := testenv.Lingering(t)
	_, err := unix.SendmsgN(lane, statsFrame(t, 1), unix.UnixRights(int(sender.Fd())), nil, 0)
	require.NoError(t, err)
	require.NoError(t, sender.Close())
	assert.ErrorIs(t, testenv.ReadUntilEnd(peer, bound), unix.ECONNRESET,
		"the server reset the socket it dropped, instead of waiting for its data to go")
	_, err = testenv.Bounded(t, "the server's Close", bound, s.Close)
	assert.NoError(t, err)
}

// replyFrame is a reply to call id declaring files descriptors.
func replyFrame(t *testing.T, id uint64, files int) []byte {
	t.Helper()
	b, err := ipc.AppendFrame(nil, id, ipc.KindReply, files, &ipc.StatsReply{})
	require.NoError(t, err)
	return b
}

// A server that takes no descriptors (ListenNoFiles, MaxFilesPerMessage
// negative) has the kernel refuse them on the connections it accepts,
// from the moment a peer connects, and on an admitted peer's call lane:
// the peer's send fails with EPERM, and nothing of the server waits on a
// descriptor it never got. On the lane this is the only defence: a
// descriptor sent there without the notice that announces one is closed
// by the kernel inside the lane thread's receive.
func TestServerWithoutFilesHasTheKernelRefuseThem(t *testing.T) {
	if !testenv.KernelRefusesRights() {
		t.Skip("this kernel cannot refuse descriptors (SO_PASSRIGHTS, Linux 6.16)")
	}
	l, err := ipc.ListenNoFiles(filepath.Join(t.TempDir(), "rt", ipc.SocketName))
	require.NoError(t, err)
	require.True(t, l.RefusesFiles())
	s := startServerOn(t, l, newHandler(), withHello, func(c *ipc.ServerConfig) { c.Limits.MaxFilesPerMessage = -1 })

	sender, _ := testenv.Lingering(t) // the test's to close: the server never has it
	// Before the hello, on a connection not yet accepted, and after.
	early, err := sock.Dial(ctxBound(t), s.path)
	require.NoError(t, err)
	t.Cleanup(func() { early.Close() })
	assert.ErrorIs(t, early.Send(statsFrame(t, 1), []*os.File{sender}), sock.ErrRightsRefused, "on the connection")

	// On the lane, without the notice ipc's own sender puts first.
	conn, lane := rawLaneFD(t, s)
	_, err = unix.SendmsgN(lane, statsFrame(t, 1), unix.UnixRights(int(sender.Fd())), nil, 0)
	assert.ErrorIs(t, err, unix.EPERM, "on the lane")

	// Both still serve.
	require.NoError(t, conn.Send(statsFrame(t, 0), nil))
	buf := make([]byte, ipc.MaxMessage)
	require.NoError(t, conn.SetReadDeadline(time.Now().Add(bound)))
	n, _, err := conn.Recv(buf)
	require.NoError(t, err)
	f, err := ipc.ParseFrame(buf[:n])
	require.NoError(t, err)
	assert.Equal(t, ipc.KindReply, f.Kind, "the connection is served")
	_, err = unix.SendmsgN(lane, statsFrame(t, 0), nil, nil, 0)
	require.NoError(t, err)
	require.NoError(t, unix.SetsockoptTimeval(lane, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &unix.Timeval{Sec: int64(bound / time.Second)}))
	n, err = unix.Read(lane, buf)
	require.NoError(t, err)
	f, err = ipc.ParseFrame(buf[:n])
	require.NoError(t, err)
	assert.Equal(t, ipc.KindReply, f.Kind, "the lane is served")

	// An ipc client's call with descriptors fails, on the lane too, and
	// its connection goes on.
	c := laneClient(t, s, true, ipc.ClientConfig{})
	err = c.Call(ctxBound(t), ipc.KindStats, ipc.WithFiles{Body: &ipc.StatsRequest{}, Files: []*os.File{sender}}, &ipc.StatsReply{})
	assert.ErrorIs(t, err, ipc.ErrFilesRefused)
	assert.NoError(t, c.Call(ctxBound(t), ipc.KindStats, &ipc.StatsRequest{}, &ipc.StatsReply{}))
	assert.True(t, ipc.HasLane(c), "the client keeps its lane")

	_, err = testenv.Bounded(t, "the server's Close", bound, s.Close)
	assert.NoError(t, err)
}

// rawLaneFD is rawLane with the lane as a bare descriptor, closed with
// the test, for sending what a sock.Blocking would not.
func rawLaneFD(t *testing.T, s *testServer) (*sock.Conn, int) {
	t.Helper()
	c, f := rawHello(t, s)
	defer f.Close()
	lane, err := unix.Dup(int(f.Fd()))
	require.NoError(t, err)
	t.Cleanup(func() { unix.Close(lane) })
	return c, lane
}
