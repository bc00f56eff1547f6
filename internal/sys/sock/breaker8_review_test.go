package sock

import (
	"errors"
	"os"
	"os/signal"
	"runtime"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// b8Storm sends SIGUSR1 to every thread of this process until stop is
// closed, so that whichever thread blocks in recvmsg is interrupted.
func b8Storm(t *testing.T) (stop func() int) {
	t.Helper()
	sigs := make(chan os.Signal, 64)
	signal.Notify(sigs, syscall.SIGUSR1)
	quit, done := make(chan struct{}), make(chan int, 1)
	go func() {
		for {
			select {
			case <-sigs:
			case <-quit:
				return
			}
		}
	}()
	go func() {
		sent := 0
		pid := os.Getpid()
		for {
			select {
			case <-quit:
				done <- sent
				return
			default:
			}
			ents, _ := os.ReadDir("/proc/self/task")
			for _, e := range ents {
				var tid int
				for _, c := range e.Name() {
					tid = tid*10 + int(c-'0')
				}
				if unix.Tgkill(pid, tid, unix.SIGUSR1) == nil {
					sent++
				}
			}
			runtime.Gosched()
		}
	}()
	var once sync.Once
	n := 0
	return func() int {
		once.Do(func() {
			close(quit)
			n = <-done
			signal.Stop(sigs)
		})
		return n
	}
}

// Signals that keep interrupting the blocked recvmsg neither end a RecvBy
// early nor make it outlive its deadline, with a deadline or without.
func TestBreaker8RecvByUnderSignals(t *testing.T) {
	a, b := blockingPair(t)
	stop := b8Storm(t)
	defer stop()
	buf := make([]byte, 64)

	for _, d := range []time.Duration{3 * time.Millisecond, 150 * time.Millisecond} {
		start := time.Now()
		deadline := start.Add(d)
		_, _, err := b.RecvBy(buf, deadline)
		took := time.Since(start)
		assert.ErrorIs(t, err, os.ErrDeadlineExceeded, "deadline %v", d)
		assert.False(t, time.Now().Before(deadline), "not before the deadline %v", d)
		assert.Less(t, took, d+time.Second, "near the deadline %v under signals, not hung", d)
	}

	// No deadline: the interrupted wait goes on until the message comes.
	got := make(chan error, 1)
	go func() {
		n, _, err := b.RecvBy(buf, time.Time{})
		if err == nil && string(buf[:n]) != "late" {
			err = errors.New("wrong message " + string(buf[:n]))
		}
		got <- err
	}()
	// Let the storm hit the waiting thread a while (not synchronisation:
	// the message below is what ends the wait).
	select {
	case err := <-got:
		t.Fatalf("RecvBy without a deadline ended before any message: %v", err)
	case <-time.After(100 * time.Millisecond):
	}
	require.NoError(t, a.Send([]byte("late"), nil, time.Time{}))
	require.NoError(t, waitErr(t, got, "RecvBy without a deadline"))
	t.Logf("%d signals sent", stop())
}

// A deadline centuries away is kept as no timeout at all would be: the
// message is received, and Close ends the wait.
func TestBreaker8RecvByFarDeadline(t *testing.T) {
	a, b := blockingPair(t)
	buf := make([]byte, 64)
	far := time.Now().Add(200 * 365 * 24 * time.Hour)
	require.NoError(t, a.Send([]byte("one"), nil, time.Time{}))
	n, _, err := b.RecvBy(buf, far)
	require.NoError(t, err)
	assert.Equal(t, "one", string(buf[:n]))
	tv, err := unix.GetsockoptTimeval(b.fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO)
	require.NoError(t, err)
	assert.Greater(t, time.Duration(tv.Nano()), time.Hour, "half the time left, however far")

	done := make(chan error, 1)
	go func() {
		_, _, err := b.RecvBy(buf, far)
		done <- err
	}()
	require.NoError(t, b.Close())
	assert.True(t, IsClosed(waitErr(t, done, "RecvBy with a far deadline after Close")))
}

// b8FDs counts this process's open descriptors.
func b8FDs(t *testing.T) int {
	ents, err := os.ReadDir("/proc/self/fd")
	require.NoError(t, err)
	return len(ents)
}

// The raw recvmsg behind RecvBy and Recv keeps what unix.Recvmsg did:
// descriptors arrive, a message longer than the buffer or with more
// announced descriptors than MaxFiles is refused without leaking any,
// unannounced ones are dropped, and an empty buffer still consumes and
// refuses the message.
func TestBreaker8RawRecvmsgEdges(t *testing.T) {
	a, b := blockingPair(t)
	buf := make([]byte, 8)
	r, w, err := os.Pipe()
	require.NoError(t, err)
	defer r.Close()
	defer w.Close()

	for name, recv := range map[string]func([]byte) (int, []*os.File, error){
		"RecvBy":      func(p []byte) (int, []*os.File, error) { return b.RecvBy(p, time.Now().Add(5*time.Second)) },
		"RecvBy zero": func(p []byte) (int, []*os.File, error) { return b.RecvBy(p, time.Time{}) },
		"Recv":        func(p []byte) (int, []*os.File, error) { return b.Recv(p, time.Now().Add(5*time.Second)) },
	} {
		before := b8FDs(t)
		require.NoError(t, a.Send([]byte("fd"), []*os.File{r, w}, time.Time{}))
		n, files, err := recv(buf)
		require.NoError(t, err, name)
		assert.Equal(t, "fd", string(buf[:n]), name)
		require.Len(t, files, 2, name)
		Drop(files)

		require.NoError(t, a.Send([]byte("longer than eight"), []*os.File{r}, time.Time{}))
		_, files, err = recv(buf)
		assert.ErrorIs(t, err, ErrTruncated, name)
		assert.Nil(t, files, name)

		require.NoError(t, a.Send([]byte("x"), nil, time.Time{}))
		_, _, err = recv(nil)
		assert.ErrorIs(t, err, ErrTruncated, "%s: an empty buffer", name)

		// More descriptors than the control buffer holds, sent raw after
		// their notice (see Send).
		many := make([]int, 0, MaxFiles+8)
		for range MaxFiles + 8 {
			many = append(many, int(r.Fd()))
		}
		require.NoError(t, unix.Sendto(a.fd, []byte{filesNotice}, 0, nil))
		require.NoError(t, unix.Sendmsg(a.fd, []byte("many"), unix.UnixRights(many...), nil, 0))
		_, files, err = recv(buf)
		assert.ErrorIs(t, err, ErrTooManyFiles, name)
		assert.Nil(t, files, name)
		assert.Equal(t, before, b8FDs(t), "%s: no descriptor left open", name)

		// Without the notice, the kernel closes them all.
		require.NoError(t, unix.Sendmsg(a.fd, []byte("many"), unix.UnixRights(many...), nil, 0))
		n, files, err = recv(buf)
		require.NoError(t, err, name)
		assert.Equal(t, "many", string(buf[:n]), name)
		assert.Nil(t, files, name)
		assert.Equal(t, before, b8FDs(t), "%s: no descriptor left open", name)

		require.NoError(t, a.Send([]byte("ok"), nil, time.Time{}))
		n, _, err = recv(buf)
		require.NoError(t, err, "%s: the connection carries on", name)
		assert.Equal(t, "ok", string(buf[:n]))
	}
}
