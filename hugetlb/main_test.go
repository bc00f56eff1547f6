package hugetlb_test

import (
	"bytes"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/sys/vm"
	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/shm"
)

func TestMain(m *testing.M) { testproc.Main(m) }

var (
	quiet     = slog.New(slog.DiscardHandler)
	layoutTag = shm.LayoutHash(hugetlb.Layout()...)
)

// instance is a primary's segment and memory, released at cleanup.
type instance struct {
	seg    *shm.Segment
	opts   shm.Options // for attaching
	mem    *hugetlb.Memory
	prefix string
	b      hugetlb.Backend
}

// newInstance creates a memory on b with the given lists. The control
// segment always goes to tmpfs, so that a test's hugepages are all data
// pages.
func newInstance(tb testing.TB, b hugetlb.Backend, lists ...hugetlb.ListConfig) *instance {
	tb.Helper()
	in := newSegment(tb, b)
	mem, err := hugetlb.Create(in.seg, hugetlb.Config{Prefix: in.prefix, Backend: b, Lists: lists, Logger: quiet})
	require.NoError(tb, err)
	tb.Cleanup(func() { mem.Close() })
	in.mem = mem
	require.NoError(tb, in.seg.MarkReady())
	return in
}

// newSegment creates the control segment only.
func newSegment(tb testing.TB, b hugetlb.Backend) *instance {
	tb.Helper()
	o := shm.Options{Path: testenv.File(tb, hugetlb.DefaultTmpfsDir), LayoutTag: layoutTag, Slots: 8,
		Role: shm.RolePrimary, Logger: quiet}
	seg, err := shm.Create(o)
	require.NoError(tb, err)
	tb.Cleanup(func() { seg.Close() })
	prefix := testenv.Name(tb)
	// A safety net: the files go even if a test fails before Close.
	tb.Cleanup(func() { hugetlb.RemoveFiles(b.Dir, prefix) })
	o.Role = shm.RoleSecondary
	return &instance{seg: seg, opts: o, prefix: prefix, b: b}
}

// region returns pages [first, first+n) of list 0 of in.
func (in *instance) region(first, n int) hugetlb.Region {
	l := in.mem.Lists()[0]
	return hugetlb.Region{Addr: l.Base + uintptr(uint64(first)*l.PageSize), Len: uint64(n) * l.PageSize}
}

// pattern is the content tests write: different in every page and for
// every seed.
func pattern(seed int, off, n uint64) []byte {
	b := make([]byte, n)
	for i := range b {
		x := off + uint64(i)
		b[i] = byte(x*131 + x>>12 + uint64(seed)*7)
	}
	return b
}

// fill writes the pattern over mem, page-sized piece by piece.
func fill(mem []byte, seed int) {
	const chunk = 1 << 20
	for off := 0; off < len(mem); off += chunk {
		n := min(chunk, len(mem)-off)
		copy(mem[off:off+n], pattern(seed, uint64(off), uint64(n)))
	}
}

// verify returns the offset of the first byte of mem that differs from
// the pattern, or -1.
func verify(mem []byte, seed int) int {
	const chunk = 1 << 20
	for off := 0; off < len(mem); off += chunk {
		n := min(chunk, len(mem)-off)
		want := pattern(seed, uint64(off), uint64(n))
		if !bytes.Equal(mem[off:off+n], want) {
			for i := range n {
				if mem[off+i] != want[i] {
					return off + i
				}
			}
		}
	}
	return -1
}

func init() {
	testproc.Register("secondary", helperSecondary)
	testproc.Register("attach-loop", helperAttachLoop)
}

// startSecondary starts a helper that attaches to in and waits until it
// has.
func startSecondary(tb testing.TB, in *instance, extra ...string) *testproc.Proc {
	tb.Helper()
	p := testproc.Start(tb, "secondary", append([]string{in.opts.Path}, extra...))
	p.Expect("attached", 0)
	return p
}

// ask sends a command to a helper and returns its answer line (which must
// start with want).
func ask(tb testing.TB, p *testproc.Proc, want string, format string, args ...any) string {
	tb.Helper()
	p.Send(format, args...)
	line, err := p.Next("", 0)
	require.NoError(tb, err)
	require.True(tb, strings.HasPrefix(line, want), "helper answered %q to %q, want %q", line, fmt.Sprintf(format, args...), want)
	return line
}

func attachSegment(path string) (*shm.Segment, error) {
	return shm.Attach(shm.Options{Path: path, LayoutTag: layoutTag, Role: shm.RoleSecondary, Logger: quiet})
}

// helperSecondary attaches to the instance whose segment is args[0] and
// obeys commands, one answer line each. With args[1] == "occupy", it first
// reserves the second page of the default range, as a library that mapped
// something there would, and reports how attaching fails.
func helperSecondary(args []string) int {
	seg, err := attachSegment(args[0])
	if err != nil {
		testproc.Say("attach-error segment %v", err)
		return 3
	}
	if len(args) > 1 && args[1] == "occupy" {
		page := hugetlb.DefaultPageSize()
		if _, err := vm.Reserve(hugetlb.DefaultBase+uintptr(page), uintptr(page)); err != nil {
			testproc.Say("occupy-error %v", err)
			return 3
		}
	}
	o := hugetlb.AttachOptions{Logger: quiet}
	if len(args) > 2 && args[1] == "files" {
		// args[2] is how to open the backing files: "rdwr" or "rdonly";
		// the rest are their paths, handed to Attach as open files.
		flag := os.O_RDWR
		if args[2] == "rdonly" {
			flag = os.O_RDONLY
		}
		o.Files = []*os.File{}
		for _, path := range args[3:] {
			f, err := os.OpenFile(path, flag, 0)
			if err != nil {
				testproc.Say("open-error %v", err)
				return 3
			}
			o.Files = append(o.Files, f)
		}
	}
	mem, err := hugetlb.Attach(seg, o)
	if err != nil {
		testproc.Say("attach-error inuse=%v %v", errors.Is(err, hugetlb.ErrAddressInUse), err)
		return 3
	}
	testproc.Say("attached")
	var taken [2]uintptr // the sentinel's range
	in := testproc.Commands()
	for in.Scan() {
		f := strings.Fields(in.Text())
		num := func(i int) uint64 {
			n, err := strconv.ParseUint(f[i], 0, 64)
			if err != nil {
				testproc.Say("bad-command %q", in.Text())
				os.Exit(3)
			}
			return n
		}
		addrLen := func() []byte { return vm.Bytes(uintptr(num(1)), uintptr(num(2))) }
		say := func(ok string, err error) {
			if err != nil {
				testproc.Say("error %v", err)
			} else {
				testproc.Say("%s", ok)
			}
		}
		switch f[0] {
		case "check": // ADDR LEN SEED
			if i := verify(addrLen(), int(num(3))); i >= 0 {
				testproc.Say("bad at %d", i)
			} else {
				testproc.Say("ok")
			}
		case "fill": // ADDR LEN SEED
			fill(addrLen(), int(num(3)))
			testproc.Say("filled")
		case "map": // LIST FIRST N
			say("mapped", mem.MapPages(int(num(1)), int(num(2)), int(num(3))))
		case "map-failing": // HOW LIST FIRST N: map, the mapping failing as hugetlb.FailNextMapping says
			hugetlb.FailNextMapping(f[1])
			f = f[1:]
			say("mapped", mem.MapPages(int(num(1)), int(num(2)), int(num(3))))
		case "unmap-losing": // LIST FIRST N: unmap, the release leaving a hole that a sentinel takes
			hugetlb.LoseNextRelease(func(addr, length uintptr) {
				if err := sentinel(addr, length); err != nil {
					testproc.Say("sentinel-error %v", err)
					os.Exit(3)
				}
				taken = [2]uintptr{addr, length}
			})
			say("unmapped", mem.UnmapPages(int(num(1)), int(num(2)), int(num(3))))
		case "sentinel": // whether the sentinel of unmap-losing is still there
			testproc.Say("sentinel %v", intact(taken))
		case "unmap": // LIST FIRST N
			say("unmapped", mem.UnmapPages(int(num(1)), int(num(2)), int(num(3))))
		case "resync":
			say("resynced", mem.Resync())
		case "readable": // ADDR LEN
			testproc.Say("readable %v", vm.CheckReadable(uintptr(num(1)), uintptr(num(2))) == nil)
		case "reserved": // ADDR LEN: every small page of the range has something mapped
			testproc.Say("reserved %v", reserved(uintptr(num(1)), uintptr(num(2))))
		case "alloc": // SIZE
			_, err := mem.Alloc(num(1))
			testproc.Say("alloc-error notprimary=%v %v", errors.Is(err, hugetlb.ErrNotPrimary), err)
		case "free": // ADDR LEN
			err := mem.Free(hugetlb.Region{Addr: uintptr(num(1)), Len: num(2)})
			testproc.Say("free-error notprimary=%v %v", errors.Is(err, hugetlb.ErrNotPrimary), err)
		case "subscribe":
			mem.Subscribe(func(e hugetlb.Event) { testproc.Say("event %s %#x %d", e.Kind, e.Addr, e.Len) })
			testproc.Say("subscribed")
		case "mapped": // LIST: pages mapped here
			testproc.Say("mapped %d", mem.Lists()[num(1)].Mapped)
		case "touch": // ADDR: read a byte; a fault kills the process
			if err := dieOnFault(); err != nil {
				testproc.Say("error %v", err)
				continue
			}
			testproc.Say("touching %#x", num(1))
			v := vm.Bytes(uintptr(num(1)), 1)[0]
			testproc.Say("touched %d", v)
		case "resync-loop": // N: resync N times as fast as possible
			var err error
			for range num(1) {
				if err = mem.Resync(); err != nil {
					break
				}
			}
			say("looped", err)
		case "resync-stalled": // MS: resync, waiting MS at most for a change to end, stopped past that as it waits
			wait := time.Duration(num(1)) * time.Millisecond
			looks := 0
			hugetlb.SetResyncWait(wait, func() {
				if looks++; looks != 2 {
					return // the first look starts the wait
				}
				testproc.Say("stalling")
				if !in.Scan() || in.Text() != "go" {
					os.Exit(3)
				}
				time.Sleep(2 * wait) // the stop, past the wait's end
			})
			say("resynced", mem.Resync())
		case "consistent": // the allocated pages are exactly the mapped ones
			testproc.Say("consistent %v", consistent(mem))
		case "close":
			say("closed", mem.Close())
		default:
			testproc.Say("bad-command %q", in.Text())
		}
	}
	return 0
}

// reserved reports whether every small page of [addr, addr+length) has
// something mapped, so that nothing else of the process can be mapped
// there. A page found free is reserved by the look.
func reserved(addr, length uintptr) bool {
	for a := addr; a < addr+length; a += vm.PageSize {
		if _, err := vm.Reserve(a, vm.PageSize); !errors.Is(err, vm.ErrRangeTaken) {
			return false
		}
	}
	return true
}

// startHelperExpectingFailure starts a secondary whose attach is expected to
// fail; the caller reads the "attach-error" line.
func startHelperExpectingFailure(tb testing.TB, in *instance, extra ...string) *testproc.Proc {
	tb.Helper()
	return testproc.Start(tb, "secondary", append([]string{in.opts.Path}, extra...))
}

func hex(a uintptr) string { return fmt.Sprintf("%#x", a) }
func dec(n uint64) string  { return strconv.FormatUint(n, 10) }

// consistent reports whether mem maps exactly the pages its descriptors say
// are allocated: every run readable, and as many pages mapped as allocated.
func consistent(mem *hugetlb.Memory) error {
	for r := range mem.Runs {
		if err := vm.CheckReadable(r.Start, r.End-r.Start); err != nil {
			return err
		}
	}
	for _, l := range mem.Lists() {
		if l.Mapped != l.Allocated {
			return fmt.Errorf("list %d: %d pages mapped, %d allocated", l.Index, l.Mapped, l.Allocated)
		}
	}
	return nil
}
