package scenario

import (
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/instance"
	"github.com/mpmr/mpmr/internal/test/harness"
	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/primary"
	"github.com/mpmr/mpmr/secondary"
)

// squatterUID is the hostile local user of the squat scenario. No account
// needs to exist: the kernel checks numeric uids.
const squatterUID = 42031

func init() { testproc.Register("squatter", runSquatter) }

// runSquatter becomes the squatter and then takes commands, one per line,
// answering each with "> " and the result (the error, or <nil>):
//
//	mkdir DIR MODE              makes DIR, the squatter's, with MODE (octal)
//	touch FILE                  makes FILE, mode 0666, the squatter's
//	rename FROM TO              renames
//	create FILE                 creates FILE (in someone else's directory)
//	primary RUNDIR PREFIX UID   starts a primary of PREFIX in RUNDIR that
//	                            lets UID in, everything of it open to all
//	secondaries                 "> secondaries N" of that primary
func runSquatter(args []string) int {
	if err := syscall.Setgroups(nil); err != nil {
		testproc.Say("ready %v", err)
		return 3
	}
	if err := syscall.Setgid(squatterUID); err != nil {
		testproc.Say("ready %v", err)
		return 3
	}
	if err := syscall.Setuid(squatterUID); err != nil {
		testproc.Say("ready %v", err)
		return 3
	}
	testproc.Say("ready <nil>")
	var trap *primary.Primary
	defer func() {
		if trap != nil {
			trap.Close()
		}
	}()
	in := testproc.Commands()
	for in.Scan() {
		f := strings.Fields(in.Text())
		var err error
		switch {
		case len(f) == 3 && f[0] == "mkdir":
			mode, _ := strconv.ParseUint(f[2], 8, 32)
			if err = os.Mkdir(f[1], 0o700); err == nil {
				err = os.Chmod(f[1], os.FileMode(mode&0o777))
			}
		case len(f) == 2 && f[0] == "touch":
			if err = os.WriteFile(f[1], nil, 0o600); err == nil {
				err = os.Chmod(f[1], 0o666)
			}
		case len(f) == 3 && f[0] == "rename":
			err = os.Rename(f[1], f[2])
		case len(f) == 2 && f[0] == "create":
			err = os.WriteFile(f[1], nil, 0o600)
		case len(f) == 4 && f[0] == "primary":
			allow, _ := strconv.Atoi(f[3])
			trap, err = primary.Start(primary.Config{Prefix: f[2], RuntimeDir: f[1], Backend: hugetlb.Tmpfs,
				MemoryPages: 4, AllowUIDs: []int{allow}, Logger: slog.New(slog.DiscardHandler)})
			if err == nil {
				err = harness.OpenToAll(trap)
			}
		case len(f) == 1 && f[0] == "secondaries" && trap != nil:
			testproc.Say("> secondaries %d", trap.Stats().Counters.Secondaries)
			continue
		default:
			err = fmt.Errorf("unknown command %q", in.Text())
		}
		testproc.Say("> %v", err)
	}
	return 0
}

// squatter is the squatter's process.
type squatter struct {
	*testproc.Proc
	t *testing.T
}

func (s squatter) do(format string, args ...any) string {
	s.t.Helper()
	s.Send(format, args...)
	return strings.TrimPrefix(s.Expect("> ", 0), "> ")
}

// Another local user squats where this user's instances go: the runtime
// directories' parent is shared like /tmp, and while this user's instance
// runs, with two secondaries copying and checking payloads through it,
// the squatter pre-creates the runtime directory of the user's next
// instance and runs a primary there that lets the user in, and pre-creates
// the backend segment of a third. The user's primary refuses to start in
// the squatted runtime directory and its secondaries refuse the
// squatter's primary, each with ErrPermission naming the squatter; the
// third starts, its files in a directory of their own beside the
// squatter's file, which is left alone; the squatter can neither move
// nor enter the running instance's directory; and the running instance's
// secondaries finish without one failure, while new ones still attach.
func TestSquattedRuntimeDirectory(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: to act as another user (setuid)")
	}
	s := harness.New(t, testenv.Tmpfs(t))
	require.NoError(t, os.Chmod(s.RunDir, os.ModeSticky|0o777), "the parent is shared, like /tmp")
	p := s.StartPrimary()
	pool, err := p.CreatePool("squat", 2048, 256)
	require.NoError(t, err)
	q := p.NewQueue()
	require.NoError(t, p.RegisterMempool(q, pool))
	q.Close()
	board, err := harness.NewBoard(p)
	require.NoError(t, err)
	var good []*harness.Proc
	for i := range 2 {
		sec := s.StartSecondary()
		require.NoError(t, sec.Post("work", harness.WorkSpec{Queues: 2, Worker: 2 * i, Pool: "squat", BufSize: 512,
			CheckEvery: 4, Limit: 5 * time.Minute}))
		good = append(good, sec)
	}
	stopRounds, _ := runRounds(board)
	t.Cleanup(func() { stopRounds() })

	sq := squatter{testproc.Start(t, "squatter", nil), t}
	require.Equal(t, "ready <nil>", sq.Expect("ready", 0))
	squatter := "owner uid " + strconv.Itoa(squatterUID)

	t.Run("squatted runtime directory with a primary in it", func(t *testing.T) {
		next := testenv.Prefix(t)
		dir := filepath.Join(s.RunDir, next)
		t.Cleanup(func() { os.RemoveAll(dir) })
		// Open to all but the squatter's, so that their own primary
		// accepts it.
		require.Equal(t, "<nil>", sq.do("mkdir %s 711", dir))
		require.Equal(t, "<nil>", sq.do("primary %s %s %d", s.RunDir, next, os.Geteuid()))

		_, err := secondary.Attach(secondary.Config{Prefix: next, RuntimeDir: s.RunDir, Logger: s.Logger()})
		require.ErrorIs(t, err, secondary.ErrPermission)
		assert.Contains(t, err.Error(), dir+" is owned by another user")
		assert.Contains(t, err.Error(), squatter)
		assert.Equal(t, "> secondaries 0", "> "+sq.do("secondaries"), "nobody of ours attached")

		_, err = primary.Start(s.Config(func(c *primary.Config) { c.Prefix = next }))
		require.ErrorIs(t, err, primary.ErrPermission)
		assert.Contains(t, err.Error(), dir+" is owned by another user")
		assert.Contains(t, err.Error(), squatter)
	})
	t.Run("squatted backend file", func(t *testing.T) {
		third := testenv.Prefix(t)
		seg := instance.SegmentPath(s.Backend.Dir, instance.Name(third, os.Geteuid(), filepath.Join(s.RunDir, third)))
		t.Cleanup(func() { os.Remove(seg); os.RemoveAll(filepath.Join(s.RunDir, third)) })
		require.Equal(t, "<nil>", sq.do("touch %s", seg))

		// It starts, with its files in a directory of their own there.
		q, err := primary.Start(s.Config(func(c *primary.Config) {
			c.Prefix = third
			c.MemoryBase = p.Memory().Lists()[0].End + 1<<30 // beside the running one, in this process
		}))
		require.NoError(t, err)
		assert.Equal(t, filepath.Dir(seg), filepath.Dir(q.Backend().Dir))
		assert.NotEqual(t, filepath.Dir(seg), q.Backend().Dir)
		require.NoError(t, q.Close())
		fi, err := os.Stat(seg)
		require.NoError(t, err, "another user's file is left alone")
		assert.Equal(t, uint32(squatterUID), fi.Sys().(*syscall.Stat_t).Uid)
	})
	t.Run("the running instance", func(t *testing.T) {
		dir := p.RuntimeDir()
		assert.Contains(t, sq.do("rename %s %s.old", dir, dir), "operation not permitted", "a sticky parent")
		assert.Contains(t, sq.do("create %s", filepath.Join(dir, "planted")), "permission denied", "a private directory")
		fresh := s.StartSecondary()
		var k harness.KeyReply
		fresh.MustCall("check", harness.Span{Addr: uint64(pool.Chunks()[0].Addr), Len: 64}, &k)
		require.NoError(t, fresh.Close())
	})

	sq.CloseInput()
	require.NoError(t, sq.Wait(0), "the squatter's primary closed")
	roundsErr := stopRounds()
	board.Stop()
	for i, sec := range good {
		var r harness.WorkResult
		require.NoError(t, sec.Answer(&r, time.Minute), "secondary %d", i)
		assert.Zero(t, r.Failures(), "secondary %d: %v", i, r.Problems)
		assert.NotZero(t, r.Copies, "secondary %d copied", i)
		t.Logf("secondary %d meanwhile: %d copies, %d checks, %d lookups", i, r.Copies, r.Checks, r.Lookups)
	}
	require.NoError(t, roundsErr)
}
