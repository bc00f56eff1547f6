package primary_test

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/mpmr/mpmr/internal/testenv"
	"github.com/mpmr/mpmr/internal/testproc"
	"github.com/mpmr/mpmr/ipc"
	"github.com/mpmr/mpmr/primary"
	"github.com/mpmr/mpmr/shm"
)

// An allowed user of another uid, not a secondary of the instance.
const breakerAllowedUID = 44201

func init() { testproc.Register("breaker-dial-as", helperBreakerDialAs) }

// helperBreakerDialAs becomes uid args[0], connects to the socket at
// args[1] and says "conn FD" with the connection's descriptor; it then
// waits for its input to end and exits, leaving the connection to whoever
// took a copy of the descriptor.
func helperBreakerDialAs(args []string) int {
	uid, _ := strconv.Atoi(args[0])
	if err := testenv.BecomeUser(uid); err != nil {
		testproc.Say("conn -1 %v", err)
		return 3
	}
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_SEQPACKET, 0)
	if err == nil {
		err = unix.Connect(fd, &unix.SockaddrUnix{Name: args[1]})
	}
	if err != nil {
		testproc.Say("conn -1 %v", err)
		return 3
	}
	testproc.Say("conn %d", fd)
	in := testproc.Commands()
	for in.Scan() {
	}
	return 0
}

// startAtPID starts helper name as the next process with pid want (by
// setting ns_last_pid), retrying while other processes on the machine take
// the pid first. It returns nil if that never worked.
func startAtPID(t *testing.T, want int, name string, args []string) *testproc.Proc {
	t.Helper()
	for range 20 {
		require.NoError(t, os.WriteFile("/proc/sys/kernel/ns_last_pid", []byte(strconv.Itoa(want-1)), 0))
		h := testproc.Start(t, name, args)
		if h.PID() == want {
			return h
		}
		h.Kill()
		_ = h.Wait(5 * time.Second)
	}
	return nil
}

// The primary admits a hello when the kernel's pid of the connection
// (SO_PEERCRED, recorded at connect) has a live slot with the start time the
// hello claims. But that pid is the one of the process that connected,
// which may have exited since: once the pid is reused by a real secondary
// (pid_max is 32768 here, and pids are handed out in order, so an attacker
// can wrap them within the hello deadline), whoever holds the old
// connection says hello with the new process's pid and its start time
// (public, in /proc/PID/stat) and is admitted in its name. Here that is a
// user the primary lets connect (AllowUIDs) but who is no secondary at all;
// it then hangs up, and the primary fences the victim secondary, which was
// never told anything and did nothing wrong.
//
// The contract: "both ends check the other's credentials"; a hello that
// claims another process's slot is refused, and a legitimate secondary
// keeps working whatever other peers do.
func TestBreakerHelloFromAReusedPIDIsAdmittedInTheVictimsName(t *testing.T) {
	requireRoot(t)
	b := testenv.Tmpfs(t)
	p, cfg := startPrimary(t, b, func(c *primary.Config) {
		c.AllowUIDs = []int{breakerAllowedUID}
		// Room for the retries below on a busy machine; the attack itself
		// fits well inside the default 5 s.
		c.Limits.HelloTimeout = 30 * time.Second
	})
	region, err := p.Alloc(p.Backend().PageSize)
	require.NoError(t, err)
	// Let the allowed user reach the socket, as AllowUIDs says one must.
	sock := filepath.Join(p.RuntimeDir(), ipc.SocketName)
	for _, d := range []string{cfg.RuntimeDir, p.RuntimeDir()} {
		require.NoError(t, os.Chmod(d, 0o711))
	}
	require.NoError(t, os.Chmod(sock, 0o666))

	// The attacker connects from a process that then exits; its
	// connection lives on (here: in the test, which takes a copy, as the
	// attacker's other process would have received it over SCM_RIGHTS).
	dialer := testproc.Start(t, "breaker-dial-as", []string{strconv.Itoa(breakerAllowedUID), sock})
	var remoteFD int
	line := dialer.Expect("conn ", 0)
	_, err = fmt.Sscanf(line, "conn %d", &remoteFD)
	require.NoError(t, err, line)
	require.GreaterOrEqual(t, remoteFD, 0, line)
	pidfd, err := unix.PidfdOpen(dialer.PID(), 0)
	require.NoError(t, err)
	conn, err := unix.PidfdGetfd(pidfd, remoteFD, 0)
	unix.Close(pidfd)
	require.NoError(t, err)
	defer unix.Close(conn)
	oldPID := dialer.PID()
	dialer.CloseInput()
	require.NoError(t, dialer.Wait(10*time.Second))

	// A real secondary of the instance's own user starts and gets the pid.
	victim := startAtPID(t, oldPID, "secondary", []string{cfg.Prefix, cfg.RuntimeDir})
	if victim == nil {
		t.Skipf("could not get pid %d reused (the machine forks too much)", oldPID)
	}
	victim.Expect("ready", 0)
	parseKey(t, ask(t, victim, "lookup %d", region.Addr))
	start, err := shm.ProcessStart(oldPID)
	require.NoError(t, err)

	// The attacker's hello, in the victim's name.
	hello, err := ipc.AppendFrame(nil, 1, ipc.KindHello, 0, &ipc.Hello{ABI: ipc.ABI, PID: oldPID,
		UID: breakerAllowedUID, Start: start, Role: "secondary"})
	require.NoError(t, err)
	_, err = unix.Write(conn, hello)
	require.NoError(t, err)
	require.NoError(t, unix.SetsockoptTimeval(conn, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &unix.Timeval{Sec: 10}))
	buf := make([]byte, ipc.MaxMessage)
	n, err := unix.Read(conn, buf)
	require.NoError(t, err)
	f, err := ipc.ParseFrame(buf[:n])
	require.NoError(t, err)
	var reply ipc.HelloReply
	if f.Kind == ipc.KindReply {
		_ = ipc.Unmarshal(f.Body, &reply)
	}
	assert.Equal(t, ipc.KindError, f.Kind,
		"a hello on a connection that pid %d made before it exited, for the process now holding that pid, "+
			"was admitted (slot %d of the victim, segment %s handed to uid %d)",
		oldPID, reply.Slot, reply.Segment, breakerAllowedUID)

	// The attacker hangs up; the victim must not pay for it.
	unix.Close(conn)
	time.Sleep(500 * time.Millisecond)
	answer := ask(t, victim, "lookup %d", region.Addr+uintptr(p.Backend().PageSize/2))
	assert.True(t, strings.HasPrefix(answer, "key "),
		"the victim secondary was fenced because someone else's connection in its name ended: %s", answer)
	assert.Zero(t, p.Stats().Counters.Fenced, "secondaries fenced")
}
