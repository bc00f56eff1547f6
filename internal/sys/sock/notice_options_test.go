package sock

import (
	"os"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// recvOptions are the receive options that make the kernel add a control
// message to every message received with recvmsg. Whoever holds the
// socket (the process that made a pair, or one that kept a copy of the
// descriptor) can set them at any time.
var recvOptions = map[string]int{
	"SO_PASSCRED":  unix.SO_PASSCRED,
	"SO_PASSSEC":   unix.SO_PASSSEC,
	"SO_PASSPIDFD": unix.SO_PASSPIDFD,
	"SO_TIMESTAMP": unix.SO_TIMESTAMP,
}

// optionPair is blockingPair with the receive option opt set on the
// second end, before NewBlocking takes it over (before) or after.
func optionPair(t *testing.T, opt int, before bool) (*Blocking, *Blocking) {
	t.Helper()
	a, f, err := BlockingPair()
	require.NoError(t, err)
	if before {
		if err := unix.SetsockoptInt(int(f.Fd()), unix.SOL_SOCKET, opt, 1); err != nil {
			f.Close()
			a.Close()
			t.Skipf("the kernel does not have the option: %v", err)
		}
	}
	b, err := NewBlocking(f, true)
	require.NoError(t, err)
	t.Cleanup(func() { a.Close(); b.Close() })
	if !before {
		if err := unix.SetsockoptInt(b.fd, unix.SOL_SOCKET, opt, 1); err != nil {
			t.Skipf("the kernel does not have the option: %v", err)
		}
	}
	return a, b
}

// Control messages other than descriptors (credentials, a security
// label, a pidfd, a timestamp) neither count as the descriptors a notice
// announced nor hide a notice: the order notice, plain message, message
// with files (a send that failed after its notice leaves it to the next,
// or two senders at once) still delivers the files, and nothing else
// arrives. No pidfd is left open.
func TestBlockingReceiveOptionsKeepFilesAndNotices(t *testing.T) {
	for name, opt := range recvOptions {
		for when, before := range map[string]bool{"set before": true, "set after": false} {
			t.Run(name+" "+when, func(t *testing.T) {
				a, b := optionPair(t, opt, before)
				r, w, err := os.Pipe()
				require.NoError(t, err)
				defer r.Close()
				defer w.Close()
				fds := b8FDs(t)

				require.NoError(t, unix.SetsockoptInt(a.fd, unix.SOL_SOCKET, unix.SO_SNDBUF, 8<<10))
				sndbuf, err := unix.GetsockoptInt(a.fd, unix.SOL_SOCKET, unix.SO_SNDBUF)
				require.NoError(t, err)
				require.ErrorIs(t, a.Send(make([]byte, sndbuf+1), []*os.File{r}, time.Time{}), unix.EMSGSIZE)
				require.NoError(t, a.Send([]byte("plain"), nil, time.Time{}))
				require.NoError(t, a.Send([]byte("files"), []*os.File{w}, time.Time{}))
				require.NoError(t, unix.Sendto(a.fd, []byte{filesNotice}, 0, nil)) // a stray one
				require.NoError(t, a.Send([]byte("last"), nil, time.Time{}))

				buf := make([]byte, 64)
				n, files, err := b.RecvBy(buf, time.Time{})
				require.NoError(t, err)
				assert.Equal(t, "plain", string(buf[:n]))
				assert.Empty(t, files)
				n, files, err = b.Recv(buf, time.Now().Add(time.Minute))
				require.NoError(t, err)
				assert.Equal(t, "files", string(buf[:n]))
				assert.Len(t, files, 1)
				Drop(files)
				n, files, err = b.RecvBy(buf, time.Now().Add(time.Minute))
				require.NoError(t, err)
				assert.Equal(t, "last", string(buf[:n]), "the stray notice is not the caller's")
				assert.Empty(t, files)
				assert.Equal(t, fds, b8FDs(t), "no descriptor left open")
			})
		}
	}
}

// The same with senders at once, on a socket that passes credentials.
func TestBlockingReceiveOptionsManySenders(t *testing.T) {
	a, b := optionPair(t, unix.SO_PASSCRED, true)
	r, w, err := os.Pipe()
	require.NoError(t, err)
	defer r.Close()
	defer w.Close()

	const senders, each = 4, 200
	var wg sync.WaitGroup
	errs := make(chan error, senders)
	for s := range senders {
		wg.Go(func() {
			for i := range each {
				var files []*os.File
				msg := "plain"
				if (s+i)%2 == 0 {
					files, msg = []*os.File{r}, "files"
				}
				if err := a.Send([]byte(msg), files, time.Time{}); err != nil {
					errs <- err
					return
				}
			}
		})
	}
	buf := make([]byte, 64)
	for range senders * each {
		n, files, err := b.RecvBy(buf, time.Now().Add(time.Minute))
		require.NoError(t, err)
		switch msg := string(buf[:n]); msg {
		case "files":
			assert.Len(t, files, 1)
		case "plain":
			assert.Empty(t, files)
		default:
			t.Fatalf("an unexpected message %q", msg)
		}
		Drop(files)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
}

// A pidfd the kernel attaches (SO_PASSPIDFD) is closed on arrival, on the
// other kind of connection too.
func TestConnClosesPidfds(t *testing.T) {
	a, b := pair(t)
	rc, err := b.c.SyscallConn()
	require.NoError(t, err)
	var serr error
	require.NoError(t, rc.Control(func(fd uintptr) {
		serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_PASSPIDFD, 1)
	}))
	if serr != nil {
		t.Skipf("the kernel does not have the option: %v", serr)
	}
	fds := b8FDs(t)
	buf := make([]byte, 64)
	for range 3 {
		require.NoError(t, a.Send([]byte("m"), nil))
		n, files, err := b.Recv(buf)
		require.NoError(t, err)
		assert.Equal(t, 1, n)
		assert.Empty(t, files)
	}
	assert.Equal(t, fds, b8FDs(t), "no pidfd left open")
}
