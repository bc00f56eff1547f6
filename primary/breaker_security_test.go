package primary_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
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
	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/ipc"
	"github.com/mpmr/mpmr/primary"
	"github.com/mpmr/mpmr/shm"
)

// An allowed user of another uid, not a secondary of the instance.
const breakerAllowedUID = 44201

func init() {
	testproc.Register("breaker-dial-as", helperBreakerDialAs)
	testproc.Register("breaker-churn", helperBreakerChurn)
	testproc.Register("breaker-stats-flood", helperBreakerStatsFlood)
}

// helperBreakerStatsFlood becomes uid args[0] (unless it is this
// process's), says "flooding", and for args[3] asks the server at args[1]
// for its stats over args[2] connections that never say hello, four calls
// at a time on each, as fast as it is answered; it ends saying "flooded
// ok=N failed=N".
func helperBreakerStatsFlood(args []string) int {
	uid, _ := strconv.Atoi(args[0])
	if uid != os.Geteuid() {
		if err := testenv.BecomeUser(uid); err != nil {
			testproc.Say("flooded %v", err)
			return 3
		}
	}
	conns, _ := strconv.Atoi(args[2])
	d, _ := time.ParseDuration(args[3])
	var ok, failed atomic.Int64
	var wg sync.WaitGroup
	testproc.Say("flooding")
	deadline := time.Now().Add(d)
	ctx, cancel := context.WithDeadline(context.Background(), deadline)
	defer cancel()
	for range conns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ctx.Err() == nil {
				c, err := ipc.DialClient(ctx, args[1], ipc.ClientConfig{Logger: quiet})
				if err != nil {
					failed.Add(1)
					time.Sleep(10 * time.Millisecond)
					continue
				}
				var calls sync.WaitGroup
				for range 4 {
					calls.Add(1)
					go func() {
						defer calls.Done()
						for c.Call(ctx, ipc.KindStats, &ipc.StatsRequest{}, &ipc.StatsReply{}) == nil {
							ok.Add(1)
						}
					}()
				}
				calls.Wait()
				c.Close()
			}
		}()
	}
	wg.Wait()
	testproc.Say("flooded ok=%d failed=%d", ok.Load(), failed.Load())
	return 0
}

// helperBreakerChurn becomes uid args[0] (unless it is this process's),
// says "churning", and then, from args[2] goroutines for args[3], connects
// to the socket at args[1] and hangs up at once, as fast as it can; it
// ends saying "churned ok=N eagain=N other=N".
func helperBreakerChurn(args []string) int {
	uid, _ := strconv.Atoi(args[0])
	if uid != os.Geteuid() {
		if err := testenv.BecomeUser(uid); err != nil {
			testproc.Say("churned %v", err)
			return 3
		}
	}
	g, _ := strconv.Atoi(args[2])
	var ok, eagain, other atomic.Int64
	var stop atomic.Bool
	full := make(chan struct{})
	var fullOnce sync.Once
	var wg sync.WaitGroup
	for range g {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for !stop.Load() {
				fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC|unix.SOCK_NONBLOCK, 0)
				if err == nil {
					err = unix.Connect(fd, &unix.SockaddrUnix{Name: args[1]})
					unix.Close(fd)
				}
				switch err {
				case nil:
					ok.Add(1)
				case unix.EAGAIN:
					eagain.Add(1)
					fullOnce.Do(func() { close(full) })
				default:
					other.Add(1)
				}
			}
		}()
	}
	<-full // the backlog is full: the situation under test
	testproc.Say("churning")
	in := testproc.Commands()
	for in.Scan() {
		testproc.Say("eagain %d", eagain.Load())
	}
	stop.Store(true)
	wg.Wait()
	testproc.Say("churned ok=%d eagain=%d other=%d", ok.Load(), eagain.Load(), other.Load())
	return 0
}

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

	// The attacker hangs up; the victim must not pay for it. The primary
	// counts a connection until it has dealt with its end.
	open := p.Stats().Counters.IPCConns
	unix.Close(conn)
	waitUntil(t, "the primary to deal with the end of the attacker's connection", func() bool {
		return p.Stats().Counters.IPCConns < open
	})
	answer := ask(t, victim, "lookup %d", region.Addr+uintptr(p.Backend().PageSize/2))
	assert.True(t, strings.HasPrefix(answer, "key "),
		"the victim secondary was fenced because someone else's connection in its name ended: %s", answer)
	assert.Zero(t, p.Stats().Counters.Fenced, "secondaries fenced")
}

// A peer that connects and hangs up in a tight loop (two goroutines, no
// request, not even a hello) keeps the primary's listen backlog full: the
// accept loop, which does the credentials check, the caps and a goroutine
// per connection, runs slower than connect(2). A secondary that attaches
// meanwhile gets EAGAIN from connect and Attach fails at once, well within
// its AttachTimeout, with ErrNoPrimary ("no primary is running") although
// one runs. The churner needs nothing but to reach the socket: the
// instance's own user, or any user once the socket is opened for
// AllowUIDs, even one that is not allowed in.
//
// The contract: peers that "open thousands of connections ... are cut off
// by limits, and the legitimate ones keep working"; Attach is bounded by
// AttachTimeout, and ErrNoPrimary "means nothing listens". (A churner of
// the secondaries' own user can also keep that user's connections at
// their cap, not yet retired by the primary: a documented limit of
// per-user caps, which the primary here sets out of the churner's reach.)
func TestBreakerConnectChurnTurnsAttachesAway(t *testing.T) {
	for _, c := range []struct {
		name string
		uid  int
	}{{"this user", os.Geteuid()}, {"a user not allowed in", breakerAllowedUID + 1}} {
		t.Run(c.name, func(t *testing.T) {
			if c.uid != os.Geteuid() {
				requireRoot(t)
			}
			// Caps well above what the churner keeps in flight: the test is
			// about the listen backlog, not the connection caps.
			p, cfg := startPrimary(t, testenv.Tmpfs(t), func(c *primary.Config) {
				c.Limits.MaxConns, c.Limits.MaxConnsPerUID = 4096, 4096
			})
			region, err := p.Alloc(p.Backend().PageSize)
			require.NoError(t, err)
			sock := filepath.Join(p.RuntimeDir(), ipc.SocketName)
			if c.uid != os.Geteuid() {
				// Opened up as a primary with AllowUIDs must be; this user
				// is not among them.
				for _, d := range []string{cfg.RuntimeDir, p.RuntimeDir()} {
					require.NoError(t, os.Chmod(d, 0o711))
				}
				require.NoError(t, os.Chmod(sock, 0o666))
			}
			attached := startSecondary(t, cfg)

			// The churner says it churns once connect(2) found the
			// backlog full, and goes on until its input ends.
			churn := testproc.Start(t, "breaker-churn", []string{strconv.Itoa(c.uid), sock, "2"})
			churn.Expect("churning", 0)
			eagain := func() int64 {
				churn.Send("count")
				var n int64
				_, err := fmt.Sscanf(churn.Expect("eagain ", 0), "eagain %d", &n)
				require.NoError(t, err)
				return n
			}
			before := eagain()
			var failures []string
			const attaches = 6
			for range attaches {
				h := testproc.Start(t, "secondary", []string{cfg.Prefix, cfg.RuntimeDir})
				line := h.Expect("", 0)
				if !strings.HasPrefix(line, "ready") {
					failures = append(failures, line)
				}
				h.Kill()
				_ = h.Wait(0)
				waitUntil(t, "the primary to see the killed secondary go", func() bool {
					return p.Stats().Counters.Secondaries == 1
				})
			}
			// Those attached before the flood are served meanwhile.
			parseKey(t, ask(t, attached, "create %d", region.Addr))
			// The backlog was found full while they attached.
			after := eagain()
			churn.CloseInput()
			t.Logf("%s", churn.Expect("churned", 0))
			assert.Greater(t, after, before, "the churner did not find the backlog full while the secondaries attached")
			assert.Empty(t, failures, "%d of %d secondaries failed to attach while a peer churned connections", len(failures), attaches)
		})
	}
}

// "The instance's own directory is made mode 0700 by the user" (README,
// Robustness). A directory the user made beforehand with the usual umask
// (mkdir -p, a deployment script) is accepted as it is, 0755: every local
// user may list it and stat what is in it. (The files themselves are
// 0600 and the credentials check still turns strangers away: low.)
func TestBreakerPreexistingInstanceDirectoryIsNotMadePrivate(t *testing.T) {
	rundir := testenv.RunDir(t)
	prefix := testenv.Prefix(t)
	require.NoError(t, os.Mkdir(filepath.Join(rundir, prefix), 0o755))
	require.NoError(t, os.Chmod(filepath.Join(rundir, prefix), 0o755))
	p, err := primary.Start(primary.Config{Prefix: prefix, RuntimeDir: rundir, Backend: testenv.Tmpfs(t).Kind,
		MemoryPages: 16, Logger: quiet})
	require.NoError(t, err)
	defer p.Close()
	fi, err := os.Stat(p.RuntimeDir())
	require.NoError(t, err)
	assert.Equal(t, os.FileMode(0o700), fi.Mode().Perm(), "mode of the instance directory %s", p.RuntimeDir())
}

// Before its hello a peer is held to far less than an attached one: one
// request at a time, four waiting. All strangers together must be bounded
// too, or a user the primary merely lets connect (AllowUIDs; it cannot
// even attach), with 100 connections that never say hello and ask for
// stats as fast as they are answered, makes the primary spend itself on
// them: an attached secondary's creations then waited 300 ms to 1.4 s at
// the p99, against about 1 ms. The strangers' stats requests now share a
// budget (and a recent answer): the flood is refused beyond it and
// counted, and the secondary's creations all succeed meanwhile. What it
// costs them in time, BenchmarkCreateDuringStrangersFlood measures.
func TestStrangersStatsFloodIsThrottled(t *testing.T) {
	requireRoot(t)
	p, cfg, sock := floodablePrimary(t)
	region, err := p.Alloc(p.Backend().PageSize)
	require.NoError(t, err)
	sec := startSecondary(t, cfg)

	flood := testproc.Start(t, "breaker-stats-flood", []string{strconv.Itoa(breakerAllowedUID), sock, "100", "2s"})
	start := time.Now()
	flood.Expect("flooding", 0)
	creates := 0
	for done := false; !done; {
		parseKey(t, ask(t, sec, "create %d", region.Addr+uintptr(creates)))
		creates++
		select {
		case line := <-flood.Lines():
			require.True(t, strings.HasPrefix(line, "flooded"), line)
			var ok, failed int
			_, err := fmt.Sscanf(line, "flooded ok=%d failed=%d", &ok, &failed)
			require.NoError(t, err, line)
			elapsed := time.Since(start)
			t.Logf("%d creations while strangers asked for stats: %d answered, %d refused, over %v", creates, ok, failed, elapsed)
			budget := primary.StrangerStatsBurst + int(elapsed.Seconds()*primary.StrangerStatsRate) + 1
			assert.LessOrEqual(t, ok, budget, "the strangers' answers stay within their budget")
			done = true
		default:
		}
	}
	assert.Positive(t, p.Stats().Counters.IPCThrottled, "the refusals are counted")
}

// floodablePrimary starts a primary that lets breakerAllowedUID connect,
// with its directory and socket opened to that user.
func floodablePrimary(t testing.TB) (*primary.Primary, primary.Config, string) {
	p, cfg := startPrimary(t, testenv.Tmpfs(t), func(c *primary.Config) { c.AllowUIDs = []int{breakerAllowedUID} })
	sock := filepath.Join(p.RuntimeDir(), ipc.SocketName)
	for _, d := range []string{cfg.RuntimeDir, p.RuntimeDir()} {
		require.NoError(t, os.Chmod(d, 0o711))
	}
	require.NoError(t, os.Chmod(sock, 0o666))
	return p, cfg, sock
}

// BenchmarkCreateDuringStrangersFlood reports a secondary's MR creations
// (p50, p99) without and with 100 connections of another user asking for
// stats as fast as they are answered.
func BenchmarkCreateDuringStrangersFlood(b *testing.B) {
	if os.Geteuid() != 0 {
		b.Skip("needs root: the flood runs as another user")
	}
	for _, mode := range []string{"idle", "flood"} {
		b.Run(mode, func(b *testing.B) {
			p, cfg, sock := floodablePrimary(b)
			region, err := p.Alloc(p.Backend().PageSize)
			require.NoError(b, err)
			sec := startSecondary(b, cfg)
			if mode == "flood" {
				flood := testproc.Start(b, "breaker-stats-flood", []string{strconv.Itoa(breakerAllowedUID), sock, "100", "1h"})
				flood.Expect("flooding", 0)
			}
			took := make([]time.Duration, 0, b.N)
			b.ResetTimer()
			for i := range b.N {
				start := time.Now()
				parseKey(b, ask(b, sec, "create %d", region.Addr+uintptr(i%4096)))
				took = append(took, time.Since(start))
			}
			b.StopTimer()
			slices.Sort(took)
			b.ReportMetric(float64(took[len(took)/2].Microseconds()), "p50-µs")
			b.ReportMetric(float64(took[len(took)*99/100].Microseconds()), "p99-µs")
		})
	}
}
