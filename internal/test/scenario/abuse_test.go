package scenario

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/cache"
	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/instance"
	"github.com/mpmr/mpmr/internal/sys/sock"
	"github.com/mpmr/mpmr/internal/test/harness"
	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/ipc"
	"github.com/mpmr/mpmr/primary"
	"github.com/mpmr/mpmr/shm"
)

// Bad input of every kind gets a clear error, and nobody else notices: two
// secondaries copy payloads through the soft device and check the region
// the primary keeps freeing and reallocating for the whole test, and must
// finish without a single failure. Meanwhile: garbage, truncated,
// oversized and unknown frames and stray descriptors on the socket;
// thousands of connections that never speak, from this user and another;
// a process that sends requests with descriptors as fast as it can and
// reads nothing; a flood of create requests for addresses outside any
// memory; processes of another user; and calls to the primary's API with
// impossible arguments.
func TestAbuse(t *testing.T) {
	s := harness.New(t, testenv.Tmpfs(t))
	// Connections that never say hello are closed sooner than by default,
	// so that the idle flood ends within the test.
	const helloTimeout = 2 * time.Second
	p := s.StartPrimary(func(c *primary.Config) { c.Limits.HelloTimeout = helloTimeout })
	ps := p.Backend().PageSize
	pool, err := p.CreatePool("abuse", 2048, 256)
	require.NoError(t, err)
	q := p.NewQueue()
	require.NoError(t, p.RegisterMempool(q, pool))
	q.Close()
	board, err := harness.NewBoard(p)
	require.NoError(t, err)
	var good []*harness.Proc
	for i := range 2 {
		sec := s.StartSecondary()
		require.NoError(t, sec.Post("work", harness.WorkSpec{Queues: 2, Worker: 2 * i, Pool: "abuse", BufSize: 512,
			CheckEvery: 4, Limit: 5 * time.Minute}))
		good = append(good, sec)
	}
	stopRounds, pauseRounds := runRounds(board)
	t.Cleanup(func() { stopRounds() })
	sockPath := filepath.Join(p.RuntimeDir(), ipc.SocketName)
	seed := uint64(time.Now().UnixNano())
	t.Logf("random seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 11))

	t.Run("random bytes", func(t *testing.T) {
		outcomes := map[string]int{}
		for i := range harness.Pick(200, 5000) {
			b := make([]byte, 1+rng.IntN(2048))
			for j := range b {
				b[j] = byte(rng.Uint32())
			}
			if i%2 == 0 {
				b[0] = 0x94 // a frame's envelope: let the rest be wrong
			}
			out, err := probe(sockPath, nil, b)
			require.NoError(t, err, "frame %x", b[:min(len(b), 16)])
			outcomes[out]++
		}
		t.Logf("outcomes: %v", outcomes)
		assert.NotZero(t, outcomes[hungUp])
	})
	t.Run("truncated frames", func(t *testing.T) {
		for _, f := range [][]byte{
			frame(t, 1, ipc.KindHello, &ipc.Hello{ABI: ipc.ABI, PID: os.Getpid(), UID: os.Getuid(), Role: "secondary"}),
			frame(t, 2, ipc.KindCreateMR, &ipc.CreateMR{Addr: uint64(pool.Chunks()[0].Addr)}),
			frame(t, 3, ipc.KindStats, &ipc.StatsRequest{}),
			frame(t, 4, ipc.KindRegisterMempool, &ipc.RegisterMempool{Name: "x", Chunks: []ipc.Chunk{{Addr: 1, Len: 2}}}),
		} {
			for cut := 1; cut < len(f); cut++ {
				assert.NoError(t, hangUp(sockPath, nil, f[:cut]), "frame %x cut to %d bytes", f, cut)
			}
		}
	})
	t.Run("oversized frames", func(t *testing.T) {
		// A stats request (served before attaching, so its body is decoded)
		// whose body is a string: the wrong type, and as long as asked.
		big := func(total int) []byte {
			body := total - 7
			f, err := ipc.AppendFrame(nil, 5, ipc.KindStats, 0, string(make([]byte, body)))
			require.NoError(t, err)
			if len(f) != total { // a longer string header
				f, err = ipc.AppendFrame(nil, 5, ipc.KindStats, 0, string(make([]byte, body-(len(f)-total))))
				require.NoError(t, err)
			}
			require.Equal(t, total, len(f))
			return f
		}
		// RegisterMempool with an array32 header claiming 2^31-1 chunks.
		huge := []byte{0x94, 6, byte(ipc.KindRegisterMempool), 0, 0xdd, 0x7f, 0xff, 0xff, 0xff}
		for name, f := range map[string][]byte{
			"one byte over the limit":         big(ipc.MaxMessage + 1),
			"100 KiB":                         big(100 << 10),
			"at the limit, wrong body type":   big(ipc.MaxMessage),
			"array claiming 2^31 items":       huge,
			"zero-length datagram (EOF, too)": {},
		} {
			assert.NoError(t, hangUp(sockPath, nil, f), "%s (%d bytes)", name, len(f))
		}
	})
	t.Run("unknown and misdirected kinds", func(t *testing.T) {
		for _, k := range []ipc.Kind{0, 3, 15, 21, 31, 33, 999, 65535, ipc.KindSync} {
			assert.NoError(t, hangUp(sockPath, nil, frame(t, 7, k, &ipc.Detach{})), "kind %d", k)
		}
		assert.NoError(t, hangUp(sockPath, nil, frame(t, 0, ipc.KindError, &ipc.ErrorReply{Code: "x", Message: "bye"})),
			"an error frame with id 0")
		// An answer nobody asked for is dropped; the connection lives on.
		out, err := probe(sockPath, nil, frame(t, 12345, ipc.KindReply, &ipc.StatsReply{}))
		require.NoError(t, err)
		assert.Equal(t, answered, out, "a stray reply")
	})
	t.Run("descriptors", func(t *testing.T) {
		before := testenv.OpenFDs()
		// send talks with n descriptors of /dev/null, closed here at once.
		send := func(n int, f []byte, followUp bool) (string, error) {
			var fs []*os.File
			for range n {
				f, err := os.Open(os.DevNull)
				require.NoError(t, err)
				fs = append(fs, f)
			}
			defer func() {
				for _, f := range fs {
					f.Close()
				}
			}()
			return talk(sockPath, fs, followUp, f)
		}
		// The primary takes no descriptors: the kernel refuses them at the
		// sender where it can; elsewhere they are closed on arrival, and
		// a request with them is answered, or refused, as below.
		refuses := testenv.KernelRefusesRights()
		out, err := send(sock.MaxFiles, frame(t, 8, ipc.KindStats, &ipc.StatsRequest{}, sock.MaxFiles), true)
		if refuses {
			assert.ErrorIs(t, err, syscall.EPERM, "files with a stats request")
		} else {
			require.NoError(t, err)
			assert.Equal(t, answered, out, "files with a stats request")
		}
		for name, c := range map[string]struct {
			declared, sent int
			body           any
		}{
			"more than allowed":     {sock.MaxFiles + 4, sock.MaxFiles + 4, &ipc.StatsRequest{}},
			"declared, none sent":   {2, 0, &ipc.StatsRequest{}},
			"sent, none declared":   {0, 3, &ipc.StatsRequest{}},
			"fewer than declared":   {5, 2, &ipc.StatsRequest{}},
			"with a malformed body": {1, 1, "not a stats request"},
		} {
			_, err := send(c.sent, frame(t, 9, ipc.KindStats, c.body, c.declared), false)
			if refuses && c.sent > 0 {
				assert.ErrorIs(t, err, syscall.EPERM, "%s: the kernel refuses them", name)
				continue
			}
			assert.NoError(t, err, "%s: the primary hangs up", name)
		}
		// The primary lives in this process: every descriptor it received
		// is closed again.
		assert.Eventually(t, func() bool { return testenv.OpenFDs() <= before }, hangBound, time.Millisecond,
			"descriptors of this process: %d before, %d after", before, testenv.OpenFDs())
	})
	t.Run("idle connection flood", func(t *testing.T) {
		n := harness.Pick(2000, 10000)
		// flood has a process of uid dial n connections that never speak
		// and checks, while it holds them, what the primary holds; then
		// it waits for the primary to close every one, and returns how
		// many it told why, over a limit or refused.
		flood := func(t *testing.T, uid int) harness.IdleFloodCheck {
			goroutines, heap := runtime.NumGoroutine(), liveHeap()
			before := p.Stats().Counters
			h := s.In(t).Start(harness.RoleSocketFlood, harness.SocketFloodArgs{Socket: sockPath, UID: uid, GID: uid,
				Mode: harness.FloodIdle, N: n})
			held, grown, conns := runtime.NumGoroutine(), liveHeap(), p.Stats().Counters.IPCConns
			t.Logf("%d idle connections of uid %d dialled: the primary holds %d connections, %d goroutines (%d before), %+d KiB of heap",
				n, uid, conns, held, goroutines, (int64(grown)-int64(heap))>>10)
			assert.LessOrEqual(t, conns, ipc.DefaultMaxConnsPerUID+before.IPCConns, "connections the primary holds")
			assert.LessOrEqual(t, held, goroutines+2*ipc.DefaultMaxConnsPerUID+32, "goroutines of the primary's process")
			assert.Less(t, int64(grown)-int64(heap), int64(32<<20), "heap held for the flood")
			c, err := harness.AwaitIdleFlood(h, n)
			require.NoError(t, err)
			after := p.Stats().Counters
			t.Logf("closed all %d: %d refused over the per-user cap, %d without hello, %d by credentials; %d told over a limit, %d refused",
				n, after.IPCRefusedConnsUID-before.IPCRefusedConnsUID, after.IPCHelloTimeouts-before.IPCHelloTimeouts,
				n-c.Limit, c.Limit, c.Refused)
			assert.Equal(t, n, c.Limit+c.Refused, "every connection was told why it was closed")
			return c
		}
		t.Run("this user", func(t *testing.T) {
			before := p.Stats().Counters
			c := flood(t, 0)
			after := p.Stats().Counters
			assert.Equal(t, n, c.Limit, "closed over the per-user cap or for an overdue hello")
			assert.EqualValues(t, n, (after.IPCRefusedConnsUID-before.IPCRefusedConnsUID)+(after.IPCHelloTimeouts-before.IPCHelloTimeouts))
			assert.NotZero(t, after.IPCHelloTimeouts-before.IPCHelloTimeouts)
			sec := s.In(t).StartSecondary()
			sec.MustCall("create", harness.Addr{Addr: uint64(pool.Chunks()[0].Addr)}, nil)
			require.NoError(t, sec.Close(), "a secondary attaches once the flood is over")
		})
		t.Run("another user", func(t *testing.T) {
			if os.Geteuid() != 0 {
				t.Skip("needs root to run a helper as uid 65534")
			}
			openSocket(t, s, sockPath)
			requests := p.Stats().Counters.Requests
			c := flood(t, 65534)
			assert.NotZero(t, c.Refused, "refused by credentials")
			assert.Equal(t, requests, p.Stats().Counters.Requests, "no request of theirs reached the primary")
		})
	})
	t.Run("descriptor flood", func(t *testing.T) {
		start := p.Stats().Counters
		h := s.In(t).Start(harness.RoleSocketFlood, harness.SocketFloodArgs{Socket: sockPath, Mode: harness.FloodFiles,
			N: harness.Pick(5000, 50000), Files: sock.MaxFiles})
		before := testenv.OpenFDs()
		stop := make(chan struct{})
		peak := testenv.PeakFDs(stop)
		var r harness.FilesFloodResult
		require.NoError(t, h.Call("flood", nil, &r))
		close(stop)
		most := <-peak
		t.Logf("sent %d requests with %d descriptors each (then %v); the primary's process held at most %d descriptors, %d before",
			r.Sent, sock.MaxFiles, r.Err, most, before)
		// One message's descriptors are open between their arrival and
		// their closing; nothing before the hello keeps any.
		assert.LessOrEqual(t, most, before+sock.MaxFiles+4)
		// Where the kernel refuses descriptors, none arrives: the first
		// send fails, the connection is whole, and the flood goes on
		// without them.
		refuses := testenv.KernelRefusesRights()
		assert.Equal(t, refuses, r.Refused, "the kernel refuses descriptors sent to the primary")
		require.Eventually(t, func() bool {
			c := p.Stats().Counters
			return c.IPCQueueOverflows+c.IPCWriteTimeouts > start.IPCQueueOverflows+start.IPCWriteTimeouts
		}, hangBound, time.Millisecond, "the primary drops a peer that does not read")
		after := p.Stats().Counters
		if refuses {
			assert.Equal(t, start.IPCRefusedFiles, after.IPCRefusedFiles, "none came to refuse")
		} else {
			assert.Greater(t, after.IPCRefusedFiles, start.IPCRefusedFiles)
		}
		assert.Eventually(t, func() bool { return testenv.OpenFDs() < before }, hangBound, time.Millisecond,
			"descriptors of this process: %d before, %d after", before, testenv.OpenFDs())
	})
	t.Run("create flood outside any memory", func(t *testing.T) {
		lists := p.Memory().Lists()
		end := uint64(lists[len(lists)-1].End)
		addrs := []uint64{0, 1, 0x1000, 0x7fff_0000_0000, end, end + ps, ^uint64(0), ^uint64(0) - 4095}
		for i := 8; i < 16; i++ { // reserved pages of the list nobody allocates here
			addrs = append(addrs, uint64(lists[0].Base)+uint64(i)*ps+uint64(i))
		}
		flooder, other := s.In(t).StartSecondary(), s.In(t).StartSecondary()
		n := harness.Pick(5000, 50000)
		errsBefore := p.Stats().Counters.RequestErrors
		require.NoError(t, flooder.Post("flood", harness.FloodArgs{Goroutines: 16, N: n, Addrs: addrs}))
		// Another secondary's requests are answered meanwhile.
		var during harness.Durations
		poolAddr := uint64(pool.Chunks()[0].Addr)
		for i := range 200 {
			start := time.Now()
			require.NoError(t, other.Call("create", harness.Addr{Addr: poolAddr + uint64(i)*64}, nil))
			during = append(during, time.Since(start))
		}
		overlapped := p.Stats().Counters.RequestErrors - errsBefore
		var r harness.FloodResult
		require.NoError(t, flooder.Answer(&r, time.Minute))
		assert.EqualValues(t, n, r.Requests)
		assert.EqualValues(t, n, r.NoMemory, "every request answered with the no-memory error: %v", r.Problems)
		assert.Zero(t, r.Created, "nothing registered: %v", r.Problems)
		assert.Zero(t, r.Other)
		for _, a := range addrs {
			_, found, err := p.Global().Lookup(a)
			require.NoError(t, err)
			assert.False(t, found, "no MR holds 0x%x", a)
		}
		for _, mr := range p.Device().MRs() {
			for _, a := range addrs {
				assert.False(t, a >= uint64(mr.Addr) && a < uint64(mr.Addr+mr.Len), "device MR %v holds 0x%x", mr, a)
			}
		}
		t.Logf("%d creates outside memory answered in p50 %v max %v; another secondary's 200 creates meanwhile (%d flood answers in between): %v",
			r.Requests, r.P50, r.Max, overlapped, during)
	})
	t.Run("another user", func(t *testing.T) {
		if os.Geteuid() != 0 {
			t.Skip("needs root to run a helper as uid 65534")
		}
		as := harness.AsUserArgs{UID: 65534, GID: 65534, Prefix: s.Prefix, RunDir: s.RunDir}
		requests := p.Stats().Counters.Requests
		// The runtime directory is private: it cannot even connect.
		h := s.In(t).Start(harness.RoleAsUser, as)
		var r harness.AsUserResult
		require.NoError(t, decodeData(h.Ready, &r))
		assert.Equal(t, 65534, r.UID)
		// A primary runs: the user is told it lacks permission, not that
		// nobody is there.
		assert.True(t, r.Attach.Matches("secondary.ErrPermission"), "attach: %s", r.Attach)
		assert.True(t, r.Dial.Matches("os.ErrPermission"), "dial: %s", r.Dial)

		// With the socket open to everyone, the primary's credential
		// check refuses it before any handler sees it.
		openSocket(t, s, sockPath)
		h = s.In(t).Start(harness.RoleAsUser, as)
		require.NoError(t, decodeData(h.Ready, &r))
		assert.Nil(t, r.Dial)
		assert.True(t, r.Why.Matches("ipc.ErrRefused"), "a connection of uid 65534 is refused: %s", r.Why)
		// A hello sent before the refusal arrives may only learn that the
		// connection ended: the kernel drops the queued reason when the
		// primary closes a connection with the hello unread.
		assert.True(t, r.Call.Matches("ipc.ErrRefused") || r.Call.Matches("ipc.ErrPeerGone"), "hello from uid 65534: %s", r.Call)
		assert.NotNil(t, r.Attach, "attach as uid 65534")
		assert.Equal(t, requests, p.Stats().Counters.Requests, "no request of theirs reached the primary")
	})
	t.Run("bad calls to the primary", func(t *testing.T) {
		_, err := p.Alloc(0)
		assert.ErrorIs(t, err, hugetlb.ErrZeroLength)
		_, err = p.Alloc(1 << 50)
		assert.ErrorIs(t, err, hugetlb.ErrNoFreeRun)
		x, err := p.Alloc(ps)
		require.NoError(t, err)
		assert.ErrorIs(t, p.Free(hugetlb.Region{Addr: x.Addr + 1, Len: ps}), hugetlb.ErrUnaligned)
		assert.ErrorIs(t, p.Free(hugetlb.Region{Addr: 0x1000, Len: ps}), hugetlb.ErrForeign)
		assert.ErrorIs(t, p.Free(hugetlb.Region{Addr: x.Addr, Len: 0}), hugetlb.ErrZeroLength)
		assert.ErrorIs(t, p.Free(hugetlb.Region{Addr: x.Addr, Len: 1 << 50}), hugetlb.ErrForeign)
		// A round would take the page just freed: the second Free would
		// then free the round's.
		resume := pauseRounds()
		require.NoError(t, p.Free(x))
		assert.ErrorIs(t, p.Free(x), hugetlb.ErrDoubleFree)
		resume()
		for _, a := range []uint64{0, ^uint64(0), uint64(x.Addr)} {
			_, err = p.Global().Create(a)
			assert.ErrorIs(t, err, cache.ErrNoMemory, "create 0x%x", a)
		}
		_, err = p.CreatePool("too-big", 1<<20, 1<<20)
		assert.Error(t, err)
	})

	roundsErr := stopRounds()
	board.Stop()
	var hits uint64
	for i, sec := range good {
		var r harness.WorkResult
		require.NoError(t, sec.Answer(&r, time.Minute), "secondary %d", i)
		assert.Zero(t, r.Failures(), "secondary %d: %v", i, r.Problems)
		assert.NotZero(t, r.Copies, "secondary %d copied", i)
		hits += r.Hits
		t.Logf("secondary %d meanwhile: %d copies, %d checks (%d found the region, %d after its free), %d lookups",
			i, r.Copies, r.Checks, r.Hits, r.Misses, r.Lookups)
	}
	assert.NotZero(t, hits, "the secondaries checked the churned region")
	require.NoError(t, roundsErr)
}

// A segment file whose header has the wrong magic, ABI version or layout
// turns a new secondary away with that very error, and disturbs nobody:
// an attached secondary and the primary keep working, and once the header
// is right again new secondaries attach. On hugetlbfs the header is
// changed through a mapping (write(2) does not work there).
func TestCorruptedSegmentHeader(t *testing.T) {
	testenv.ForEachBackend(t, 8, func(t *testing.T, b hugetlb.Backend) {
		s := harness.New(t, b)
		p := s.StartPrimary()
		r, err := p.Alloc(p.Backend().PageSize)
		require.NoError(t, err)
		attached := s.StartSecondary()
		segPath := s.SegmentPath()
		for _, field := range []harness.HeaderField{harness.HeaderMagic, harness.HeaderVersion, harness.HeaderLayout} {
			restore, err := harness.CorruptHeader(segPath, field)
			require.NoError(t, err)
			_, perr := shm.Probe(segPath, instance.LayoutTag)
			assert.True(t, harness.Report(perr).Matches(field.Want), "probe with a bad %s: %v", field.Name, perr)
			_, aerr := s.TryStartSecondary()
			assert.True(t, aerr.Matches(field.Want), "attach with a bad %s: %s", field.Name, aerr)
			attached.MustCall("check", harness.Span{Addr: uint64(r.Addr) + 64, Len: 64}, nil)
			require.NoError(t, restore())

			fresh := s.StartSecondary()
			fresh.MustCall("check", harness.Span{Addr: uint64(r.Addr), Len: 64}, nil)
			require.NoError(t, fresh.Close())
		}
		x, err := p.Alloc(p.Backend().PageSize)
		require.NoError(t, err, "the primary carries on")
		require.NoError(t, p.Free(x))
		require.NoError(t, attached.Close())
	})
}

// Probe outcomes: the primary closed the connection, or it answered a
// well-formed request sent after the frames (having ignored them).
const (
	hungUp   = "hung up"
	answered = "answered"
)

const probeID = 424242

// probe sends frames on a fresh connection (files with the first), then a
// well-formed stats request, and says what the primary did: it hung up,
// or it answered the stats request. Anything else, silence above all, is
// an error. Requests are handled concurrently, so a frame whose body fails
// to decode may hang up only after the stats request was answered: use
// hangUp for frames that must end the connection. It talks to the socket
// directly, so that it can send what the ipc and sock packages refuse to
// (more descriptors than allowed, say).
func probe(path string, files []*os.File, frames ...[]byte) (string, error) {
	return talk(path, files, true, frames...)
}

// hangUp sends frames on a fresh connection (files with the first) and
// waits for the primary to hang up: answers come first, then the end.
func hangUp(path string, files []*os.File, frames ...[]byte) error {
	_, err := talk(path, files, false, frames...)
	return err
}

func talk(path string, files []*os.File, followUp bool, frames ...[]byte) (string, error) {
	c, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: path, Net: "unixpacket"})
	if err != nil {
		return "", err
	}
	defer c.Close()
	if err := c.SetDeadline(time.Now().Add(hangBound)); err != nil {
		return "", err
	}
	if followUp {
		stats, _ := ipc.AppendFrame(nil, probeID, ipc.KindStats, 0, &ipc.StatsRequest{})
		frames = append(frames, stats)
	}
	for i, f := range frames {
		var oob []byte
		if i == 0 && len(files) > 0 {
			fds := make([]int, len(files))
			for j, file := range files {
				fds[j] = int(file.Fd())
			}
			oob = syscall.UnixRights(fds...)
		}
		if _, _, err := c.WriteMsgUnix(f, oob, nil); err != nil {
			if errors.Is(err, syscall.EPIPE) || errors.Is(err, syscall.ECONNRESET) {
				return hungUp, nil
			}
			return "", fmt.Errorf("send: %w", err)
		}
	}
	buf := make([]byte, ipc.MaxMessage)
	oob := make([]byte, syscall.CmsgSpace(4*sock.MaxFiles))
	for {
		n, oobn, _, _, err := c.ReadMsgUnix(buf, oob)
		if oobn > 0 {
			return "", errors.New("the primary sent descriptors")
		}
		if n <= 0 && (err == nil || errors.Is(err, io.EOF) || errors.Is(err, syscall.ECONNRESET)) {
			return hungUp, nil
		}
		if err != nil {
			return "", fmt.Errorf("the primary neither answered nor hung up: %w", err)
		}
		f, err := ipc.ParseFrame(buf[:n])
		if err != nil {
			return "", fmt.Errorf("the primary sent a bad frame: %w", err)
		}
		if followUp && f.ID == probeID && f.Kind == ipc.KindReply {
			return answered, nil
		}
		// An answer to one of the frames, which made sense after all, or
		// the reason for hanging up: read on.
	}
}

// frame builds a frame, declaring files descriptors if given.
func frame(t testing.TB, id uint64, kind ipc.Kind, body any, files ...int) []byte {
	t.Helper()
	n := 0
	if len(files) > 0 {
		n = files[0]
	}
	b, err := ipc.AppendFrame(nil, id, kind, n, body)
	require.NoError(t, err)
	return b
}

// openSocket lets every user reach the socket until the test ends: only
// the primary's credentials check stands in their way then.
func openSocket(t *testing.T, s *harness.Scenario, sockPath string) {
	t.Helper()
	for path, mode := range map[string]os.FileMode{s.RunDir: 0o711, filepath.Dir(sockPath): 0o711, sockPath: 0o666} {
		fi, err := os.Stat(path)
		require.NoError(t, err)
		require.NoError(t, os.Chmod(path, mode))
		t.Cleanup(func() { os.Chmod(path, fi.Mode().Perm()) })
	}
}

// liveHeap returns the bytes of live heap objects.
func liveHeap() uint64 {
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapAlloc
}

func decodeData(r harness.Ready, v any) error {
	if r.Err != nil {
		return r.Err
	}
	return json.Unmarshal(r.Data, v)
}

// runRounds runs board rounds of one page until stopRounds is called,
// which reports the first error. pause waits for the round under way to
// end and holds the next until the function it returns is called.
func runRounds(board *harness.Board) (stopRounds func() error, pause func() (resume func())) {
	var (
		wg   sync.WaitGroup
		err  error
		stop = make(chan struct{})
		mu   sync.Mutex // held for each round, and while paused
	)
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			default:
			}
			mu.Lock()
			_, err = board.Round(harness.RoundOptions{Pages: 1, While: func() error {
				return board.WaitLookups(50, hangBound)
			}})
			mu.Unlock()
			if err != nil {
				return
			}
		}
	}()
	var once sync.Once
	return func() error {
			once.Do(func() { close(stop); wg.Wait() })
			return err
		}, func() func() {
			mu.Lock()
			return mu.Unlock
		}
}
