package primary_test

import (
	"context"
	"errors"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/ipc"
)

func init() { testproc.Register("slot-first", helperSlotFirst) }

// helperSlotFirst (args: PREFIX RUNDIR MODE OFF LEN) claims a slot, says
// hello, takes the memory files and keeps the first open; then it lets its
// slot go, as a process that dies does, while it lives on. MODE "hangup"
// then closes its connection; MODE "nack" keeps it and answers every sync
// with an error. It maps [OFF, +LEN) of the backing file and says
// "> left"; "peek" then reads the first byte of the mapping ("> byte B").
func helperSlotFirst(args []string) int {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	mode := args[2]
	off, _ := strconv.ParseInt(args[3], 10, 64)
	length, _ := strconv.Atoi(args[4])
	nack := ipc.PushHandlerFunc(func(context.Context, ipc.Kind, *ipc.Decoder) (any, error) {
		return nil, errors.New("not following")
	})
	seg, client, err := claimAndSayHello(ctx, args[0], args[1], ipc.ClientConfig{Logger: quiet, PushHandler: nack})
	if err != nil {
		testproc.Say("> err %v", err)
		return 3
	}
	got := &ipc.WithFiles{Body: &ipc.MemoryFilesReply{}}
	if err := client.Call(ctx, ipc.KindMemoryFiles, &ipc.MemoryFiles{First: 0}, got); err != nil || len(got.Files) == 0 {
		testproc.Say("> err files %v", err)
		return 3
	}
	f := got.Files[0]
	seg.Close()
	if mode == "hangup" {
		client.Close()
	} else {
		defer client.Close()
	}
	mem, err := unix.Mmap(int(f.Fd()), off, length, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		testproc.Say("> err mmap %v", err)
		return 3
	}
	testproc.Say("> left")
	testproc.EachCommand(func(c testproc.Line) {
		if c.Name == "peek" {
			testproc.Say("> byte %d", mem[0])
		}
	})
	return 0
}

// A secondary that lets its slot go while it lives on, and then hangs up
// or fails a sync, is not taken for dead: a process that dies lets its
// slot go only once its memory is unmapped, one that lives may map a
// backing file it kept open at any time. It is fenced, and a page freed
// while it could reach it waits in quarantine until it is gone.
func TestASecondaryThatLetsItsSlotGoFirstIsFenced(t *testing.T) {
	for _, mode := range []string{"hangup", "nack"} {
		t.Run(mode, func(t *testing.T) {
			p, cfg := startPrimary(t, testenv.Tmpfs(t))
			r, err := p.Alloc(p.Backend().PageSize)
			require.NoError(t, err)
			li := p.Memory().Lists()[0]
			fenced := p.Stats().Counters.Fenced
			h := testproc.Start(t, "slot-first", []string{cfg.Prefix, cfg.RuntimeDir, mode,
				strconv.FormatUint(uint64(r.Addr-li.Base), 10), strconv.FormatUint(r.Len, 10)}, b9Env)
			require.Equal(t, "> left", h.Expect("> ", 0))
			if mode == "hangup" {
				require.Eventually(t, func() bool { return p.Stats().Counters.Secondaries == 0 }, 5*time.Second, time.Millisecond,
					"the primary saw the end of its connection")
			}
			r.Bytes()[0] = 0x5a
			require.Equal(t, "byte 90", ask(t, h, "peek"), "the helper maps the page")

			require.NoError(t, p.Free(r))
			assert.Greater(t, p.Stats().Counters.Fenced, fenced, "the process that lives on is fenced")
			assert.Equal(t, 1, p.Memory().Quarantined(), "a page freed while it maps it waits in quarantine")
			p.Memory().ReleaseQuarantine() // the kernel says it maps the page still
			assert.Equal(t, 1, p.Memory().Quarantined(), "the page stays in quarantine while it is mapped")

			h.Kill()
			_ = h.Wait(10 * time.Second) // killed
			p.Memory().ReleaseQuarantine()
			assert.Zero(t, p.Memory().Quarantined(), "the page goes back once the process is gone")
		})
	}
}
