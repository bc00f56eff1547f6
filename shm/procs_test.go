package shm_test

import (
	"encoding/binary"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/shm"
)

func slotOf(t *testing.T, p *testproc.Proc) int {
	var slot int
	_, err := fmt.Sscanf(p.Expect("slot ", 0), "slot %d", &slot)
	require.NoError(t, err)
	return slot
}

func TestProcessTableClaimAndRelease(t *testing.T) {
	owner, o := newSegment(t, testenv.Tmpfs(t))
	me := owner.Proc(owner.Slot())
	assert.Equal(t, os.Getpid(), me.PID)
	assert.Equal(t, shm.RolePrimary, me.Role)
	assert.True(t, me.Live && me.Alive)

	h := testproc.Start(t, "attach", []string{o.Path})
	slot := slotOf(t, h)
	p := owner.Proc(slot)
	assert.Equal(t, h.PID(), p.PID)
	assert.Equal(t, shm.RoleSecondary, p.Role)
	assert.True(t, p.Live && p.Alive)
	assert.Len(t, owner.Procs(), 2)

	h.Send("close")
	h.Expect("closed", 0)
	p = owner.Proc(slot)
	assert.False(t, p.Live, "a released slot is free")
	assert.False(t, p.Alive)
}

func TestKilledProcessSlotIsDeadAndReclaimed(t *testing.T) {
	owner, o := newSegment(t, testenv.Tmpfs(t), func(o *shm.Options) { o.Slots = 2 })
	h := testproc.Start(t, "attach", []string{o.Path})
	slot := slotOf(t, h)
	h.Kill()
	require.Error(t, h.Wait(0))

	p := owner.Proc(slot)
	assert.True(t, p.Live, "the slot still says live")
	assert.False(t, p.Alive, "but the kernel dropped the lock")

	// The table is full (2 slots) only if the dead slot is not reusable.
	s := attach(t, o)
	assert.Equal(t, slot, s.Slot(), "a dead process's slot is claimed again")
	assert.Equal(t, os.Getpid(), owner.Proc(slot).PID)
	assert.Equal(t, uint32(2), owner.Proc(slot).Epoch)
}

func TestReapFreesDeadSlots(t *testing.T) {
	owner, o := newSegment(t, testenv.Tmpfs(t))
	h := testproc.Start(t, "attach", []string{o.Path})
	slot := slotOf(t, h)
	assert.Empty(t, owner.Reap(), "nothing to reap while it lives")
	h.Kill()
	require.Error(t, h.Wait(0))
	assert.Equal(t, []int{slot}, owner.Reap())
	assert.False(t, owner.Proc(slot).Live)
	assert.Empty(t, owner.Reap())
}

func TestReusedPidDoesNotLookAlive(t *testing.T) {
	owner, o := newSegment(t, testenv.Tmpfs(t))
	h := testproc.Start(t, "attach", []string{o.Path})
	slot := slotOf(t, h)
	require.True(t, owner.Proc(slot).Alive)

	// Replace the helper's program: the pid lives on in a process that is
	// not attached, exactly as if the pid had been reused. The kernel drops
	// the lock once exec has closed the lock file.
	h.Send("exec")
	require.Eventually(t, func() bool { return !owner.Proc(slot).Alive }, testproc.DefaultTimeout, time.Millisecond,
		"the slot of a process that is no longer attached must read dead")
	comm, err := os.ReadFile(fmt.Sprintf("/proc/%d/comm", h.PID()))
	require.NoError(t, err)
	assert.Equal(t, "sleep", strings.TrimSpace(string(comm)), "the pid now runs another program")
	require.NoError(t, syscall.Kill(h.PID(), 0), "and is alive")
	p := owner.Proc(slot)
	assert.Equal(t, h.PID(), p.PID, "the slot names the live pid")
	assert.True(t, p.Live, "the slot was never released")
	assert.False(t, p.Alive, "yet the slot is dead")
}

func TestProcessTableFull(t *testing.T) {
	_, o := newSegment(t, testenv.Tmpfs(t), func(o *shm.Options) { o.Slots = 1 })
	_, err := shm.Attach(o)
	assert.ErrorIs(t, err, shm.ErrNoSlot)
}

func TestProcessStart(t *testing.T) {
	st, err := shm.ProcessStart(os.Getpid())
	require.NoError(t, err)
	assert.NotZero(t, st)
	parent, err := shm.ProcessStart(os.Getppid())
	require.NoError(t, err)
	assert.LessOrEqual(t, parent, st, "a parent starts before its child")
}

// A process runs until it is a zombie, and not under another start time;
// a zombie is the same process still, for fences, but runs no more.
func TestRunning(t *testing.T) {
	cmd := exec.Command("sleep", "1000")
	require.NoError(t, cmd.Start())
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	pid := cmd.Process.Pid
	st, err := shm.ProcessStart(pid)
	require.NoError(t, err)
	assert.True(t, shm.Running(pid, st))
	assert.False(t, shm.Running(pid, st+1), "another start time names another process")
	assert.False(t, shm.Running(pid, 0), "a record without a start time names no process")
	assert.False(t, shm.Running(0, st), "pid 0 is no process")
	assert.False(t, shm.Running(-pid, st), "a negative pid is no process")

	require.NoError(t, cmd.Process.Kill())
	require.Eventually(t, func() bool { return !shm.Running(pid, st) }, 5*time.Second, time.Millisecond,
		"killed, it ends")
	assert.True(t, shm.SameProcess(pid, st), "a zombie, not yet reaped")
	_ = cmd.Wait()
	assert.False(t, shm.Running(pid, st), "reaped")
}

// Any process that maps a segment can write its header. The process table's
// length and place are fixed when the segment is created: a slot count or
// lock registration changed afterwards must not turn an index into a panic
// in the processes already attached.
func TestProcessTableIgnoresHeaderRewrites(t *testing.T) {
	owner, o := newSegment(t, testenv.Tmpfs(t), func(o *shm.Options) { o.Slots = 4 })
	_, err := owner.NewRWLock()
	require.NoError(t, err)
	other := attach(t, o)
	put := func(at int64, b []byte) {
		t.Helper()
		f, err := os.OpenFile(o.Path, os.O_RDWR, 0)
		require.NoError(t, err)
		defer f.Close()
		_, err = f.WriteAt(b, at)
		require.NoError(t, err)
	}
	le32 := func(v uint32) []byte { return binary.LittleEndian.AppendUint32(nil, v) }
	le64 := func(v uint64) []byte { return binary.LittleEndian.AppendUint64(nil, v) }
	for _, c := range []struct {
		name string
		at   int64
		b    []byte
	}{
		{"slot count raised", offSlots, le32(1 << 30)},
		{"slot count zeroed", offSlots, le32(0)},
		{"table moved", offProcs, le64(1 << 40)},
		{"lock moved past the mapping", offLocks, le64(1 << 40)},
		{"lock moved into the header", offLocks, le64(8)},
	} {
		t.Run(c.name, func(t *testing.T) {
			orig := make([]byte, len(c.b))
			f, err := os.Open(o.Path)
			require.NoError(t, err)
			_, err = f.ReadAt(orig, c.at)
			f.Close()
			require.NoError(t, err)
			put(c.at, c.b)
			defer put(c.at, orig)

			for _, s := range []*shm.Segment{owner, other} {
				require.NotPanics(t, func() {
					assert.Equal(t, 4, s.Slots())
					assert.Len(t, s.Procs(), 2)
					assert.Equal(t, os.Getpid(), s.Proc(other.Slot()).PID)
					assert.False(t, s.Fenced())
					assert.False(t, s.AliveAs(1<<20, 1))
				})
			}
			require.NotPanics(t, func() {
				assert.False(t, owner.Fence(1<<20, 1, os.Getpid(), testenv.ProcessStart(t, os.Getpid())))
				// A new claim in this process resets reader lines in
				// every registered lock.
				if third, err := shm.Attach(o); err == nil {
					third.Close()
				}
			})
		})
	}
}

// The owner keeps one fence record per process and slot, naming the
// latest claim fenced. A holder read before a later claim of the slot was
// fenced (a round of questions about the earlier claim, whose answer may
// predate the later one) does not end the record when forgotten.
func TestFenceRecordsOneProcessAndSlot(t *testing.T) {
	owner, _ := newSegment(t, testenv.Tmpfs(t), func(o *shm.Options) { o.Slots = 4 })
	const slot = 2
	pid := os.Getpid()
	start := testenv.ProcessStart(t, pid)
	require.True(t, owner.Fence(slot, 1, pid, start), "claim 1 fenced")
	assert.False(t, owner.Fence(slot, 1, pid, start), "the same claim again")
	asked := owner.Holders()
	require.Len(t, asked, 1)
	assert.Equal(t, uint32(1), asked[0].Epoch)

	require.True(t, owner.Fence(slot, 2, pid, start), "a later claim of the slot is fenced too")
	now := owner.Holders()
	require.Len(t, now, 1, "one record for the process and slot")
	assert.Equal(t, uint32(2), now[0].Epoch, "naming the later claim")

	owner.Forget(asked[0])
	assert.Len(t, owner.Holders(), 1, "forgetting the earlier claim leaves the later one fenced")
	owner.Forget(now[0])
	assert.Empty(t, owner.Holders())

	require.True(t, owner.Fence(slot+1, 1, pid, start), "another slot: a record of its own")
	require.True(t, owner.Fence(slot, 3, pid, start))
	assert.Len(t, owner.Holders(), 2)
}

// A fence of an earlier claim of a slot that comes after a later claim's
// (the primary may see the earlier claim's connection end late) leaves
// the record, and the slot's word, with the later claim: a round of
// questions that read the record while it named the earlier claim must
// not end the later one's fence.
func TestALateFenceOfAnEarlierClaimLeavesTheRecordWithTheLater(t *testing.T) {
	owner, _ := newSegment(t, testenv.Tmpfs(t), func(o *shm.Options) { o.Slots = 4 })
	const slot = 2
	pid := os.Getpid()
	start := testenv.ProcessStart(t, pid)
	require.True(t, owner.Fence(slot, 1, pid, start), "claim 1 fenced")
	asked := owner.Holders() // a round of questions reads it; the kernel answers "nothing"
	require.Len(t, asked, 1)

	require.True(t, owner.Fence(slot, 2, pid, start), "claim 2 of the slot, which maps, is fenced")
	assert.False(t, owner.Fence(slot, 1, pid, start), "claim 1's connection, seen late")
	now := owner.Holders()
	require.Len(t, now, 1)
	assert.Equal(t, uint32(2), now[0].Epoch, "the record names the latest claim fenced")

	owner.Forget(asked[0]) // the round's answer, about claim 1
	assert.Len(t, owner.Holders(), 1, "forgetting the earlier claim leaves the later one fenced")
}

// A fence the owner takes of a process and slot after a round of
// questions read the record, refused because the record names a later
// claim of the slot (the earlier claim's connection seen late), or taken
// again of the claim the record names, keeps the record from that round's
// answer: the answer may predate what the fenced claim maps.
func TestAFenceTakenAfterARoundReadTheRecordKeepsItFromThatAnswer(t *testing.T) {
	owner, _ := newSegment(t, testenv.Tmpfs(t), func(o *shm.Options) { o.Slots = 4 })
	const slot = 2
	pid := os.Getpid()
	start := testenv.ProcessStart(t, pid)
	require.True(t, owner.Fence(slot, 2, pid, start), "claim 2 fenced")
	asked := owner.Holders() // a round of questions reads it; the kernel answers "nothing"
	require.Len(t, asked, 1)
	assert.False(t, owner.Fence(slot, 1, pid, start), "claim 1, an earlier one, fenced late: refused")
	owner.Forget(asked[0])
	assert.Len(t, owner.Holders(), 1, "the round's answer predates the refused fence")

	asked = owner.Holders()
	assert.False(t, owner.Fence(slot, 2, pid, start), "claim 2 again")
	owner.Forget(asked[0])
	assert.Len(t, owner.Holders(), 1, "the round's answer predates the fence taken again")

	owner.Forget(owner.Holders()[0])
	assert.Empty(t, owner.Holders(), "an answer read after the last fence ends the record")
}

func init() { testproc.Register("stat-without-fds", helperStatWithoutFDs) }

// helperStatWithoutFDs lowers its limit of open files to the descriptors
// it holds, so that reading its own /proc stat fails (EMFILE), and says
// what Running and SameProcess make of itself then.
func helperStatWithoutFDs([]string) int {
	start, err := shm.ProcessStart(os.Getpid())
	if err != nil {
		testproc.Say("result %v", err)
		return 3
	}
	fd, err := syscall.Open("/dev/null", syscall.O_RDONLY|syscall.O_CLOEXEC, 0)
	if err != nil {
		testproc.Say("result %v", err)
		return 3
	}
	syscall.Close(fd) // the lowest free descriptor: every one below it is taken
	lim := syscall.Rlimit{Cur: uint64(fd), Max: uint64(fd)}
	if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		testproc.Say("result %v", err)
		return 3
	}
	_, statErr := shm.ProcessStart(os.Getpid())
	testproc.Say("result running=%t same=%t stat=%v", shm.Running(os.Getpid(), start),
		shm.SameProcess(os.Getpid(), start), statErr)
	return 0
}

func init() { testproc.Register("fence-without-fds", helperFenceWithoutFDs) }

// helperFenceWithoutFDs owns a segment at args[0], lowers its limit of
// open files to the descriptors it holds, and fences a claim made by
// itself, then says whether it did and what Holders keeps.
func helperFenceWithoutFDs(args []string) int {
	fail := func(err error) int {
		testproc.Say("result %v", err)
		return 3
	}
	start, err := shm.ProcessStart(os.Getpid())
	if err != nil {
		return fail(err)
	}
	o := opts(args[0])
	o.Role, o.Slots = shm.RolePrimary, 4
	owner, err := shm.Create(o)
	if err != nil {
		return fail(err)
	}
	defer owner.Close()
	if err := owner.MarkReady(); err != nil {
		return fail(err)
	}
	fd, err := syscall.Open("/dev/null", syscall.O_RDONLY|syscall.O_CLOEXEC, 0)
	if err != nil {
		return fail(err)
	}
	syscall.Close(fd)
	lim := syscall.Rlimit{Cur: uint64(fd), Max: uint64(fd)}
	if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		return fail(err)
	}
	_, statErr := shm.ProcessStart(os.Getpid())
	fenced := owner.Fence(2, 1, os.Getpid(), start)
	testproc.Say("result fenced=%t holders=%d stat=%v", fenced, len(owner.Holders()), statErr)
	return 0
}

// The owner fences a claim whose process's /proc stat it cannot read for
// a reason of its own (here it may open no more files): the process's
// start time is the one the owner took when it admitted it, and only the
// kernel's word that the process is gone lets a claim go unfenced.
func TestAFenceIsTakenWhenTheProcessStatCannotBeRead(t *testing.T) {
	h := testproc.Start(t, "fence-without-fds", []string{testenv.File(t, testenv.Tmpfs(t).Dir)})
	res := h.Expect("result ", 0)
	require.Contains(t, res, "too many open files", "the stat could not be read")
	assert.Contains(t, res, "fenced=true")
	assert.Contains(t, res, "holders=1")
	require.NoError(t, h.Wait(0))
}

// A process whose /proc stat cannot be read for a reason of the reader's
// (here it may open no more files) is not taken for gone: Running and
// SameProcess decide whether a process may still reach data memory (a
// fence forgotten, or none taken, releases its pages), and only the
// kernel's "no such process" says it may not.
func TestRunningWhenStatCannotBeRead(t *testing.T) {
	h := testproc.Start(t, "stat-without-fds", nil)
	res := h.Expect("result ", 0)
	require.Contains(t, res, "too many open files", "the stat could not be read")
	assert.Contains(t, res, "running=true")
	assert.Contains(t, res, "same=true")
	require.NoError(t, h.Wait(0))
}
