package shm_test

import (
	"encoding/binary"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/shm"
)

func TestCreateAttachShareMemory(t *testing.T) {
	testenv.ForEachBackend(t, 4, func(t *testing.T, b hugetlb.Backend) {
		owner, o := newSegment(t, b)
		off, err := owner.Alloc(64, 64)
		require.NoError(t, err)
		require.NoError(t, owner.SetRoot(shm.RootUser, off))
		atomic.StoreUint64(shm.At[uint64](owner, off), 0xfeedface)

		other := attach(t, o)
		assert.NotEqual(t, owner.Slot(), other.Slot())
		assert.Equal(t, off, other.Root(shm.RootUser))
		assert.Equal(t, uint64(0xfeedface), atomic.LoadUint64(shm.At[uint64](other, off)))
		atomic.StoreUint64(shm.At[uint64](other, off+8), 42)
		assert.Equal(t, uint64(42), atomic.LoadUint64(shm.At[uint64](owner, off+8)))

		_, err = other.Alloc(64, 16)
		assert.ErrorIs(t, err, shm.ErrNotOwner)
		assert.ErrorIs(t, other.SetRoot(shm.RootUser, 0), shm.ErrNotOwner)
	})
}

func TestCreateRefusesExistingFile(t *testing.T) {
	_, o := newSegment(t, testenv.Tmpfs(t))
	_, err := shm.Create(o)
	assert.ErrorIs(t, err, shm.ErrExists)
	assert.NotContains(t, err.Error(), "not an instance's", "this user's own file")

	// What another user, or something else, put there is named as such,
	// not taken for an instance's leftover.
	o.Path = filepath.Join(t.TempDir(), "planted")
	require.NoError(t, unix.Mkfifo(o.Path, 0o666))
	_, err = shm.Create(o)
	assert.ErrorIs(t, err, shm.ErrExists)
	assert.ErrorContains(t, err, "a FIFO of uid "+strconv.Itoa(os.Geteuid())+": not an instance's file")
}

func TestGrowKeepsMappingsAndContent(t *testing.T) {
	testenv.ForEachBackend(t, 8, func(t *testing.T, b hugetlb.Backend) {
		owner, o := newSegment(t, b, func(o *shm.Options) { o.Size = 1; o.MaxSize = 16 << 20 })
		other := attach(t, o)
		first, err := owner.Alloc(128, 16)
		require.NoError(t, err)
		p := shm.At[uint64](owner, first)
		atomic.StoreUint64(p, 7)
		size := owner.Size()

		// A block larger than what is left forces growth.
		big, err := owner.Alloc(size, 64)
		require.NoError(t, err)
		assert.Greater(t, owner.Size(), size)
		assert.Equal(t, owner.Size(), other.Size(), "the attacher sees the new size")
		assert.Equal(t, uint64(7), atomic.LoadUint64(p), "old pointers stay valid")

		last := big + size - 8
		atomic.StoreUint64(shm.At[uint64](owner, last), 99)
		assert.Equal(t, uint64(99), atomic.LoadUint64(shm.At[uint64](other, last)))
	})
}

func TestGrowStopsAtMaxSize(t *testing.T) {
	owner, _ := newSegment(t, testenv.Tmpfs(t), func(o *shm.Options) { o.Size = 1 << 20; o.MaxSize = 2 << 20 })
	_, err := owner.Alloc(4<<20, 16)
	assert.ErrorIs(t, err, shm.ErrArenaFull)
	off, err := owner.Alloc(1<<19, 16)
	require.NoError(t, err, "a failed growth leaves the arena usable")
	assert.NotZero(t, off)
}

func TestCloseIsIdempotentAndFreesSlot(t *testing.T) {
	owner, o := newSegment(t, testenv.Tmpfs(t))
	s, err := shm.Attach(o)
	require.NoError(t, err)
	slot := s.Slot()
	require.True(t, owner.Proc(slot).Live)
	require.NoError(t, s.Close())
	require.NoError(t, s.Close())
	p := owner.Proc(slot)
	assert.False(t, p.Live)
	assert.False(t, p.Alive)
}

// A process whose goroutines may still read the segment closes it under
// them: what they read afterwards is zeros of their own, what they write
// reaches nobody, and the file is mapped no longer.
func TestCloseUnderReadersLeavesPrivateZeros(t *testing.T) {
	owner, o := newSegment(t, testenv.Tmpfs(t))
	off, err := owner.Alloc(64, 64)
	require.NoError(t, err)
	atomic.StoreUint64(shm.At[uint64](owner, off), 0xfeedface)
	other, err := shm.Attach(o)
	require.NoError(t, err)
	slot := other.Slot()
	p := shm.At[uint64](other, off)
	require.Equal(t, uint64(0xfeedface), atomic.LoadUint64(p))

	vacated, err := other.CloseUnderReaders()
	require.NoError(t, err)
	require.True(t, vacated, "vacated")
	require.NoError(t, other.Close(), "idempotent with Close")
	assert.Zero(t, atomic.LoadUint64(p), "a reader left finds zeros, not a fault")
	atomic.StoreUint64(p, 1)
	assert.Equal(t, uint64(0xfeedface), atomic.LoadUint64(shm.At[uint64](owner, off)),
		"what it writes reaches no other process")
	assert.False(t, owner.Proc(slot).Live, "the slot is released")
	assert.Empty(t, mappingOf(t, reflect.ValueOf(p).Pointer()), "the range maps no file")
}

// mappingOf returns the path /proc/self/maps gives for the mapping that
// holds addr ("" for an anonymous one), failing if none does.
func mappingOf(t *testing.T, addr uintptr) string {
	t.Helper()
	b, err := os.ReadFile("/proc/self/maps")
	require.NoError(t, err)
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) < 5 {
			continue
		}
		lo, hi, ok := strings.Cut(f[0], "-")
		if !ok {
			continue
		}
		start, err1 := strconv.ParseUint(lo, 16, 64)
		end, err2 := strconv.ParseUint(hi, 16, 64)
		if err1 == nil && err2 == nil && uint64(addr) >= start && uint64(addr) < end {
			if len(f) > 5 {
				return f[5]
			}
			return ""
		}
	}
	t.Fatalf("nothing mapped at 0x%x", addr)
	return ""
}

func TestRemoveDeletesFiles(t *testing.T) {
	owner, o := newSegment(t, testenv.Tmpfs(t))
	require.NoError(t, owner.Close())
	require.NoError(t, shm.Remove(o))
	_, err := os.Stat(o.Path)
	assert.ErrorIs(t, err, os.ErrNotExist)
	_, err = os.Stat(o.Path + ".lock")
	assert.ErrorIs(t, err, os.ErrNotExist)
	assert.NoError(t, shm.Remove(o), "removing twice is fine")
}

// Offsets of header fields, from the layout comment in layout_unsafe.go.
const (
	offMagic   = 0
	offVersion = 8
	offLayout  = 12
	offState   = 16
	offSlots   = 20
	offSize    = 40
	offMaxSize = 48
	offProcs   = 64
	offArena   = 72
	offLocks   = 104
)

func TestAttachValidatesHeader(t *testing.T) {
	put32 := func(off int64, v uint32) func(*os.File) error {
		return func(f *os.File) error {
			var b [4]byte
			binary.LittleEndian.PutUint32(b[:], v)
			_, err := f.WriteAt(b[:], off)
			return err
		}
	}
	put64 := func(off int64, v uint64) func(*os.File) error {
		return func(f *os.File) error {
			var b [8]byte
			binary.LittleEndian.PutUint64(b[:], v)
			_, err := f.WriteAt(b[:], off)
			return err
		}
	}
	cases := []struct {
		name    string
		corrupt func(*os.File) error
		want    error
	}{
		{"wrong magic", put64(offMagic, 0x1234), shm.ErrBadMagic},
		{"newer ABI version", put32(offVersion, shm.Version+1), shm.ErrVersionMismatch},
		{"other layout", put32(offLayout, 0xdeadbeef), shm.ErrLayoutMismatch},
		{"still initializing", put32(offState, 1), shm.ErrNotReady},
		{"instance ended", put32(offState, 3), shm.ErrDead},
		{"unknown state", put32(offState, 77), shm.ErrCorrupt},
		{"zero slots", put32(offSlots, 0), shm.ErrCorrupt},
		{"size past max", put64(offSize, 1<<40), shm.ErrCorrupt},
		{"size not page multiple", put64(offSize, 4097), shm.ErrCorrupt},
		{"max below size", put64(offMaxSize, 4096), shm.ErrCorrupt},
		{"arena inside table", put64(offArena, 64), shm.ErrCorrupt},
		{"file shorter than header says", func(f *os.File) error { return f.Truncate(8192) }, shm.ErrTruncated},
		{"file shorter than a header", func(f *os.File) error { return f.Truncate(100) }, shm.ErrTruncated},
		{"header never written", func(f *os.File) error {
			_, err := f.WriteAt(make([]byte, 4096), 0)
			return err
		}, shm.ErrNotReady},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			owner, o := newSegment(t, testenv.Tmpfs(t))
			require.NoError(t, owner.Close())
			f, err := os.OpenFile(o.Path, os.O_RDWR, 0)
			require.NoError(t, err)
			require.NoError(t, c.corrupt(f))
			require.NoError(t, f.Close())

			_, err = shm.Attach(o)
			assert.ErrorIs(t, err, c.want)
			// Every other sentinel must not match: each mismatch has its
			// own error.
			for _, other := range []error{shm.ErrBadMagic, shm.ErrVersionMismatch, shm.ErrLayoutMismatch,
				shm.ErrNotReady, shm.ErrDead, shm.ErrCorrupt, shm.ErrTruncated} {
				if other != c.want {
					assert.NotErrorIs(t, err, other)
				}
			}
		})
	}
}

func TestAttachRefusesOtherLayoutTag(t *testing.T) {
	_, o := newSegment(t, testenv.Tmpfs(t))
	o.LayoutTag++
	_, err := shm.Attach(o)
	assert.ErrorIs(t, err, shm.ErrLayoutMismatch)
}

func TestAttachRefusesUnreadySegment(t *testing.T) {
	o := opts(testenv.File(t, testenv.Tmpfs(t).Dir))
	s, err := shm.Create(o)
	require.NoError(t, err)
	defer s.Close()
	_, err = shm.Attach(o)
	assert.ErrorIs(t, err, shm.ErrNotReady)

	info, err := shm.Probe(o.Path, testTag)
	assert.ErrorIs(t, err, shm.ErrNotReady)
	assert.Equal(t, os.Getpid(), info.CreatorPID, "Probe describes a segment it refuses")

	require.NoError(t, s.MarkReady())
	info, err = shm.Probe(o.Path, testTag)
	require.NoError(t, err)
	assert.Equal(t, "ready", info.State)
	s.MarkDead()
	_, err = shm.Attach(o)
	assert.ErrorIs(t, err, shm.ErrDead)
}

func TestMarkDeadFile(t *testing.T) {
	testenv.ForEachBackend(t, 2, func(t *testing.T, b hugetlb.Backend) {
		owner, o := newSegment(t, b)
		other := attach(t, o)
		require.NoError(t, shm.MarkDeadFile(o.Path))
		assert.False(t, other.Ready(), "attached processes see it")
		_, err := shm.Attach(o)
		assert.ErrorIs(t, err, shm.ErrDead)
		require.NoError(t, owner.Close())

	})
	junk := testenv.File(t, testenv.Tmpfs(t).Dir)
	require.NoError(t, os.WriteFile(junk, make([]byte, 8192), 0o600))
	assert.ErrorIs(t, shm.MarkDeadFile(junk), shm.ErrBadMagic, "not a segment: left alone")
}

func init() { testproc.Register("create-and-end", helperCreateAndEnd) }

// helperCreateAndEnd creates a ready segment at args[0] and ends, leaving
// it: a segment whose creator is gone.
func helperCreateAndEnd(args []string) int {
	o := opts(args[0])
	o.Role = shm.RolePrimary
	s, err := shm.Create(o)
	if err == nil {
		err = s.MarkReady()
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 3
	}
	s.Close()
	return 0
}

// MarkEnded marks a segment whose creator is gone, and spares one that
// may be a live instance's: one whose creator runs (here this process),
// or one with another name.
func TestMarkEndedSparesWhatMayLive(t *testing.T) {
	owner, o := newSegment(t, testenv.Tmpfs(t))
	markEnded := func(path string) bool {
		f, err := os.OpenFile(path, os.O_RDWR, 0)
		require.NoError(t, err)
		defer f.Close()
		marked, err := shm.MarkEnded(f, o.LayoutTag)
		require.NoError(t, err)
		return marked
	}
	assert.False(t, markEnded(o.Path), "its creator runs")
	assert.True(t, owner.Ready())

	for _, linked := range []bool{true, false} {
		path := testenv.File(t, testenv.Tmpfs(t).Dir)
		h := testproc.Start(t, "create-and-end", []string{path})
		require.NoError(t, h.Wait(0))
		if linked {
			require.NoError(t, os.Link(path, path+".linked"))
			t.Cleanup(func() { os.Remove(path + ".linked") })
		}
		assert.Equal(t, !linked, markEnded(path), "creator gone, linked %v", linked)
		info, err := shm.Probe(path, o.LayoutTag)
		if linked {
			assert.NoError(t, err, "spared")
		} else {
			assert.ErrorIs(t, err, shm.ErrDead, "marked")
		}
		assert.Equal(t, h.PID(), info.CreatorPID)
	}
}

// Any process that maps a segment can write its header; a Size raised
// past what this process mapped, or past what the file holds, must turn
// into ErrBadOffset rather than a fault.
func TestCheckRangeBoundedByMapping(t *testing.T) {
	owner, o := newSegment(t, testenv.Tmpfs(t), func(o *shm.Options) { o.Size = 1; o.MaxSize = 1 << 20 })
	other := attach(t, o)
	size, maxSize := other.Size(), other.MaxSize()
	off, err := owner.Alloc(64, 64)
	require.NoError(t, err)
	require.NoError(t, other.CheckRange(off, 64), "a real block is inside")

	put := func(at int64, v uint64) {
		t.Helper()
		f, err := os.OpenFile(o.Path, os.O_RDWR, 0)
		require.NoError(t, err)
		defer f.Close()
		var b [8]byte
		binary.LittleEndian.PutUint64(b[:], v)
		_, err = f.WriteAt(b[:], at)
		require.NoError(t, err)
	}
	raise := func(v uint64) { t.Helper(); put(offSize, v) }
	for _, c := range []struct {
		name       string
		size       uint64
		off, size2 uint64
	}{
		{"past the mapping", 1 << 40, maxSize + 4096, 8},
		{"past the mapping, ending inside the header's size", 1 << 40, maxSize - 8, 64},
		{"inside the mapping, past the file", maxSize, size + 4096, 8},
	} {
		t.Run(c.name, func(t *testing.T) {
			raise(c.size)
			for _, s := range []*shm.Segment{other, owner} {
				assert.ErrorIs(t, s.CheckRange(c.off, c.size2), shm.ErrBadOffset)
				assert.Panics(t, func() { shm.At[uint64](s, c.off) }, "At refuses what CheckRange refuses")
			}
			require.NoError(t, other.CheckRange(off, 64), "what is mapped and backed stays reachable")
			raise(size)
		})
	}
	t.Run("arena start lowered into the header", func(t *testing.T) {
		var arena uint64
		f, err := os.Open(o.Path)
		require.NoError(t, err)
		var b [8]byte
		_, err = f.ReadAt(b[:], offArena)
		f.Close()
		require.NoError(t, err)
		arena = binary.LittleEndian.Uint64(b[:])
		put(offArena, 0)
		t.Cleanup(func() { put(offArena, arena) })
		for _, s := range []*shm.Segment{other, owner} {
			assert.ErrorIs(t, s.CheckRange(0, 8), shm.ErrBadOffset, "the header is never an arena offset")
			assert.ErrorIs(t, s.CheckRange(offSize, 8), shm.ErrBadOffset)
		}
	})
}

// A reader left behind by CloseUnderReaders may still ask about slots (a
// lock it waits on asks whether its writer lives) while the close releases
// this process's own: the race detector must find nothing between them.
func TestCloseUnderReadersWhileReadersAskAboutSlots(t *testing.T) {
	owner, o := newSegment(t, testenv.Tmpfs(t))
	other, err := shm.Attach(o)
	require.NoError(t, err)
	mine, theirs := other.Slot(), owner.Slot()
	stop := make(chan struct{})
	asked := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := 0; ; i++ {
			other.Alive(mine)
			other.Alive(theirs)
			other.Fenced()
			if i == 0 {
				close(asked)
			}
			select {
			case <-stop:
				return
			default:
			}
		}
	}()
	<-asked
	vacated, err := other.CloseUnderReaders()
	require.NoError(t, err)
	require.True(t, vacated, "vacated")
	close(stop)
	<-done
	assert.Equal(t, -1, other.Slot(), "the slot is released")
	assert.False(t, owner.Proc(mine).Live)
}

// At and Slice refuse, every time, a type that can hold a Go pointer or
// whose size depends on the machine; the plain types they accept between
// refusals change nothing.
func TestAtRefusesTypesThatAreNotPlain(t *testing.T) {
	s, _ := newSegment(t, testenv.Tmpfs(t))
	off, err := s.Alloc(64, 16)
	require.NoError(t, err)
	for range 2 {
		assert.NotPanics(t, func() { shm.At[[4]uint64](s, off) })
		assert.NotPanics(t, func() { shm.Slice[struct{ A, B uint32 }](s, off, 2) })
		assert.Panics(t, func() { shm.At[struct{ P *int }](s, off) })
		assert.Panics(t, func() { shm.At[int](s, off) })
		assert.Panics(t, func() { shm.Slice[string](s, off, 1) })
	}
}
