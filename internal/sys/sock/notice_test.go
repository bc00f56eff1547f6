package sock

import (
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// Messages from several senders at once, some carrying descriptors, all
// arrive with exactly the descriptors they were sent with, through every
// way of receiving: a message with files is announced, and however the
// announcements and the messages of other senders interleave, the
// receiver is ready for the files when they come.
func TestBlockingFilesAmongPlainMessagesFromManySenders(t *testing.T) {
	const senders, each = 4, 200
	r, w, err := os.Pipe()
	require.NoError(t, err)
	defer r.Close()
	defer w.Close()

	for name, recv := range map[string]func(b *Blocking, p []byte) (int, []*os.File, error){
		"RecvBy":      func(b *Blocking, p []byte) (int, []*os.File, error) { return b.RecvBy(p, time.Time{}) },
		"RecvBy by":   func(b *Blocking, p []byte) (int, []*os.File, error) { return b.RecvBy(p, time.Now().Add(time.Minute)) },
		"Recv":        func(b *Blocking, p []byte) (int, []*os.File, error) { return b.Recv(p, time.Time{}) },
		"Recv by":     func(b *Blocking, p []byte) (int, []*os.File, error) { return b.Recv(p, time.Now().Add(time.Minute)) },
		"Recv tiny q": func(b *Blocking, p []byte) (int, []*os.File, error) { return b.Recv(p, time.Time{}) },
	} {
		t.Run(name, func(t *testing.T) {
			a, b := blockingPair(t)
			if name == "Recv tiny q" {
				// Senders wait for room, so notices and frames go in
				// separate waits.
				require.NoError(t, unix.SetsockoptInt(a.fd, unix.SOL_SOCKET, unix.SO_SNDBUF, 1))
			}
			before := b8FDs(t)
			var wg sync.WaitGroup
			errs := make(chan error, senders)
			for s := range senders {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for i := range each {
						var files []*os.File
						msg := fmt.Sprintf("plain %d %d", s, i)
						if (s+i)%2 == 0 {
							files, msg = []*os.File{r}, fmt.Sprintf("files %d %d", s, i)
						}
						if err := a.Send([]byte(msg), files, time.Time{}); err != nil {
							errs <- err
							return
						}
					}
				}()
			}
			buf := make([]byte, 64)
			for range senders * each {
				n, files, err := recv(b, buf)
				require.NoError(t, err)
				msg := string(buf[:n])
				if strings.HasPrefix(msg, "files ") {
					assert.Len(t, files, 1, msg)
				} else {
					require.True(t, strings.HasPrefix(msg, "plain "), "an unexpected message %q", msg)
					assert.Empty(t, files, msg)
				}
				Drop(files)
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				require.NoError(t, err)
			}
			assert.Equal(t, before, b8FDs(t), "no descriptor left open")
		})
	}
}

// Descriptors that come without their announcement (a peer writing to the
// socket itself) are closed by the kernel, never installed here: the
// message arrives without them and no descriptor is left open. Announced
// ones arrive.
func TestBlockingUnannouncedFilesAreDropped(t *testing.T) {
	a, b := blockingPair(t)
	r, w, err := os.Pipe()
	require.NoError(t, err)
	defer r.Close()
	defer w.Close()
	buf := make([]byte, 64)
	before := b8FDs(t)

	require.NoError(t, unix.Sendmsg(a.fd, []byte("raw"), unix.UnixRights(int(r.Fd()), int(w.Fd())), nil, 0))
	n, files, err := b.RecvBy(buf, time.Time{})
	require.NoError(t, err)
	assert.Equal(t, "raw", string(buf[:n]))
	assert.Empty(t, files)
	assert.Equal(t, before, b8FDs(t), "no descriptor left open")

	require.NoError(t, a.Send([]byte("sent"), []*os.File{r}, time.Time{}))
	n, files, err = b.Recv(buf, time.Now().Add(time.Minute))
	require.NoError(t, err)
	assert.Equal(t, "sent", string(buf[:n]))
	require.Len(t, files, 1)
	Drop(files)
}

// Announcements without the message they announce (a sender that failed
// between them, or a peer that sends them on purpose) are taken in and
// never reach the caller; what follows arrives as sent, descriptors and
// all. A caller's message that reads as an announcement is refused.
func TestBlockingStrayNoticesAreHarmless(t *testing.T) {
	a, b := blockingPair(t)
	r, w, err := os.Pipe()
	require.NoError(t, err)
	defer r.Close()
	defer w.Close()
	buf := make([]byte, 64)
	before := b8FDs(t)

	for range 3 {
		require.NoError(t, unix.Sendto(a.fd, []byte{filesNotice}, 0, nil))
	}
	require.NoError(t, a.Send([]byte("one"), nil, time.Time{}))
	require.NoError(t, a.Send([]byte("two"), []*os.File{r, w}, time.Time{}))
	require.NoError(t, unix.Sendto(a.fd, []byte{filesNotice}, 0, nil))
	require.NoError(t, a.Send([]byte("three"), nil, time.Time{}))

	n, files, err := b.RecvBy(buf, time.Time{})
	require.NoError(t, err)
	assert.Equal(t, "one", string(buf[:n]))
	assert.Empty(t, files)
	n, files, err = b.Recv(buf, time.Now().Add(time.Minute))
	require.NoError(t, err)
	assert.Equal(t, "two", string(buf[:n]))
	assert.Len(t, files, 2)
	Drop(files)
	n, files, err = b.RecvBy(buf, time.Now().Add(time.Minute))
	require.NoError(t, err)
	assert.Equal(t, "three", string(buf[:n]))
	assert.Empty(t, files)

	// A notice alone does not end a wait: the deadline does.
	require.NoError(t, unix.Sendto(a.fd, []byte{filesNotice}, 0, nil))
	_, _, err = b.Recv(buf, time.Now().Add(20*time.Millisecond))
	assert.ErrorIs(t, err, os.ErrDeadlineExceeded)
	assert.Equal(t, before, b8FDs(t), "no descriptor left open")

	assert.ErrorIs(t, a.Send([]byte{filesNotice}, nil, time.Time{}), ErrReserved)
	assert.ErrorIs(t, a.TrySend([]byte{filesNotice}, []*os.File{r}), ErrReserved)
	require.NoError(t, a.Send([]byte{filesNotice, 0}, nil, time.Time{}), "only the one-byte message is reserved")
	n, _, err = b.RecvBy(buf, time.Time{})
	require.NoError(t, err)
	assert.Equal(t, []byte{filesNotice, 0}, buf[:n])
}

// A message longer than the buffer is refused whether or not files were
// announced, and the connection carries on.
func TestBlockingTruncatedPlainMessage(t *testing.T) {
	a, b := blockingPair(t)
	buf := make([]byte, 4)
	for name, recv := range map[string]func([]byte) (int, []*os.File, error){
		"RecvBy": func(p []byte) (int, []*os.File, error) { return b.RecvBy(p, time.Time{}) },
		"Recv":   func(p []byte) (int, []*os.File, error) { return b.Recv(p, time.Now().Add(time.Minute)) },
	} {
		require.NoError(t, a.Send([]byte("longer than four"), nil, time.Time{}))
		_, _, err := recv(buf)
		assert.ErrorIs(t, err, ErrTruncated, name)
		require.NoError(t, a.Send([]byte("four"), nil, time.Time{}))
		n, _, err := recv(buf)
		require.NoError(t, err, name)
		assert.Equal(t, "four", string(buf[:n]), name)
	}
}

// A send whose message fails after its notice went leaves that notice to
// the next message with descriptors, so notices and such messages stay
// one for one and the receiver goes back to the cheaper receive.
func TestBlockingFailedSendLeavesItsNoticeToTheNext(t *testing.T) {
	a, b := blockingPair(t)
	r, w, err := os.Pipe()
	require.NoError(t, err)
	defer r.Close()
	defer w.Close()
	require.NoError(t, unix.SetsockoptInt(a.fd, unix.SOL_SOCKET, unix.SO_SNDBUF, 8<<10))
	sndbuf, err := unix.GetsockoptInt(a.fd, unix.SOL_SOCKET, unix.SO_SNDBUF)
	require.NoError(t, err)

	// Larger than the send buffer: the notice goes, the message cannot.
	err = a.Send(make([]byte, sndbuf+1), []*os.File{r}, time.Time{})
	require.ErrorIs(t, err, unix.EMSGSIZE)
	require.NoError(t, a.Send([]byte("files"), []*os.File{w}, time.Time{}))
	require.NoError(t, a.Send([]byte("plain"), nil, time.Time{}))

	buf := make([]byte, 64)
	n, files, err := b.RecvBy(buf, time.Time{})
	require.NoError(t, err)
	assert.Equal(t, "files", string(buf[:n]))
	assert.Len(t, files, 1)
	Drop(files)
	n, files, err = b.RecvBy(buf, time.Time{})
	require.NoError(t, err)
	assert.Equal(t, "plain", string(buf[:n]))
	assert.Empty(t, files)
	assert.Zero(t, b.expect, "no notice left pending")
	assert.Zero(t, a.owed.Load(), "no notice left owed")
}

// TryRecv does not wait, and a peer that keeps sending notices with no
// message behind them does not make it: it takes a few and says no
// message is queued. Here a notice is queued again each time one is
// taken, so that the queue never runs dry.
func TestBlockingTryRecvIsNotHeldByAFloodOfNotices(t *testing.T) {
	a, b := blockingPair(t)
	taken := 0
	hook := func() {
		if taken++; taken < 10_000 {
			assert.NoError(t, unix.Sendto(a.fd, []byte{filesNotice}, 0, nil))
		}
	}
	afterRecv.Store(&hook)
	defer afterRecv.Store(nil)
	require.NoError(t, unix.Sendto(a.fd, []byte{filesNotice}, 0, nil))
	_, _, err := b.TryRecv(make([]byte, 8))
	require.ErrorIs(t, err, ErrNoMessage)
	assert.Less(t, taken, 100, "receives before it gave up")
	assert.True(t, b.Queued(), "the flood goes on; it said so with notices still queued")

	// Stray notices ahead of a message are still passed over.
	afterRecv.Store(nil)
	a2, b2 := blockingPair(t)
	for range 3 {
		require.NoError(t, unix.Sendto(a2.fd, []byte{filesNotice}, 0, nil))
	}
	require.NoError(t, a2.Send([]byte("one"), nil, time.Time{}))
	buf := make([]byte, 8)
	n, _, err := b2.TryRecv(buf)
	require.NoError(t, err)
	assert.Equal(t, "one", string(buf[:n]))
}
