package hugetlb_test

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/sys/vm"
	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/shm"
)

func TestListsArePlacedAndAccounted(t *testing.T) {
	b := testenv.Tmpfs(t)
	ps := b.PageSize
	explicit := hugetlb.DefaultBase + 64<<30
	in := newInstance(t, b,
		hugetlb.ListConfig{Pages: 4},
		hugetlb.ListConfig{Pages: 2, PageSize: 64 << 10},
		hugetlb.ListConfig{Pages: 3, Base: explicit})
	lists := in.mem.Lists()
	require.Len(t, lists, 3)

	assert.Equal(t, hugetlb.DefaultBase, lists[0].Base)
	assert.Equal(t, hugetlb.DefaultBase+4*uintptr(ps), lists[0].End)
	assert.Equal(t, hugetlb.DefaultBase+2<<30, lists[1].Base, "after a gap, on a 1 GiB boundary")
	assert.Equal(t, uint64(64<<10), lists[1].PageSize)
	assert.Equal(t, explicit, lists[2].Base)
	for i, l := range lists {
		assert.Equal(t, i, l.Index)
		assert.Equal(t, hugetlb.Tmpfs, l.Backend)
		assert.Equal(t, filepath.Join(b.Dir, hugetlb.FileName(in.prefix, i)), l.File)
		st, err := os.Stat(l.File)
		require.NoError(t, err)
		assert.Equal(t, int64(l.CapacityBytes), st.Size(), "the file spans the list")
		assert.Equal(t, l.Capacity, l.Free)
		assert.Equal(t, l.Capacity, l.LargestFree)
	}

	_, err := in.mem.Alloc(3 * ps)
	require.NoError(t, err)
	l := in.mem.Lists()[0]
	assert.Equal(t, hugetlb.ListInfo{
		Index: 0, Base: hugetlb.DefaultBase, End: hugetlb.DefaultBase + 4*uintptr(ps), PageSize: ps,
		Backend: hugetlb.Tmpfs, File: lists[0].File,
		Capacity: 4, Allocated: 3, Free: 1, Mapped: 3, LargestFree: 1,
		CapacityBytes: 4 * ps, AllocatedBytes: 3 * ps, FreeBytes: ps,
	}, l)

	// The small-page list takes what fits it once list 0 is full.
	r, err := in.mem.Alloc(100 << 10)
	require.NoError(t, err)
	assert.Equal(t, hugetlb.Region{Addr: hugetlb.DefaultBase + 3*uintptr(ps), Len: ps}, r, "list 0 still had a page")
	r, err = in.mem.Alloc(100 << 10)
	require.NoError(t, err)
	assert.Equal(t, hugetlb.Region{Addr: lists[1].Base, Len: 128 << 10}, r, "whole pages of list 1")

	for _, l := range lists {
		list, ok := in.mem.InList(l.Base)
		assert.True(t, ok)
		assert.Equal(t, l.Index, list)
		_, ok = in.mem.InList(l.End)
		assert.False(t, ok, "the end is outside")
	}
}

func TestContigRunSplitsWhenAMiddlePageIsFreed(t *testing.T) {
	testenv.ForEachBackend(t, 4, func(t *testing.T, b hugetlb.Backend) {
		ps := uintptr(b.PageSize)
		in := newInstance(t, b, hugetlb.ListConfig{Pages: 8})
		a, err := in.mem.Alloc(2 * b.PageSize)
		require.NoError(t, err)
		c, err := in.mem.Alloc(2 * b.PageSize)
		require.NoError(t, err)
		base := a.Addr

		run := func(first, pages int) hugetlb.Run {
			return hugetlb.Run{List: 0, First: first, Pages: pages, Start: base + uintptr(first)*ps,
				End: base + uintptr(first+pages)*ps, PageSize: b.PageSize}
		}
		runs := func() []hugetlb.Run {
			var out []hugetlb.Run
			for r := range in.mem.Runs {
				out = append(out, r)
			}
			return out
		}

		got, ok := in.mem.ContigRun(c.Addr + 12345)
		require.True(t, ok)
		assert.Equal(t, run(0, 4), got, "adjacent allocations form one run")
		assert.Equal(t, []hugetlb.Run{run(0, 4)}, runs())

		require.NoError(t, in.mem.Free(hugetlb.Region{Addr: base + ps, Len: b.PageSize}))
		got, ok = in.mem.ContigRun(base + 5)
		require.True(t, ok)
		assert.Equal(t, run(0, 1), got)
		got, ok = in.mem.ContigRun(base + 4*ps - 1)
		require.True(t, ok)
		assert.Equal(t, run(2, 2), got)
		_, ok = in.mem.ContigRun(base + ps)
		assert.False(t, ok, "a free page is in no run")
		assert.Equal(t, []hugetlb.Run{run(0, 1), run(2, 2)}, runs())

		page, ok := in.mem.PageOf(base + 3*ps + 7)
		require.True(t, ok)
		assert.Equal(t, hugetlb.Page{List: 0, Index: 3, Addr: base + 3*ps, Size: b.PageSize}, page)
		_, ok = in.mem.PageOf(base + ps)
		assert.False(t, ok, "PageOf knows only allocated pages")
		list, ok := in.mem.InList(base + ps)
		assert.True(t, ok && list == 0, "but the page is inside list 0")
		_, ok = in.mem.PageOf(base - 1)
		assert.False(t, ok)

		// Stopping early.
		n := 0
		in.mem.Runs(func(hugetlb.Run) bool { n++; return false })
		assert.Equal(t, 1, n)

		// First fit fills the hole and the run is whole again.
		r, err := in.mem.Alloc(1)
		require.NoError(t, err)
		assert.Equal(t, base+ps, r.Addr)
		got, _ = in.mem.ContigRun(base)
		assert.Equal(t, run(0, 4), got)
	})
}

func TestEventsAreSynchronousAndOrdered(t *testing.T) {
	testenv.ForEachBackend(t, 2, func(t *testing.T, b hugetlb.Backend) {
		in := newInstance(t, b, hugetlb.ListConfig{Pages: 4})
		var log []string
		cancelA := in.mem.Subscribe(func(e hugetlb.Event) {
			// Alloc: the memory is mapped already. Free: it still is, with
			// its content, and the queries still see the pages.
			readable := vm.CheckReadable(e.Addr, uintptr(e.Len)) == nil
			var first byte
			if readable {
				first = vm.Bytes(e.Addr, 1)[0]
			}
			_, page := in.mem.PageOf(e.Addr + uintptr(e.Len) - 1)
			log = append(log, fmt.Sprintf("A %s %#x %d readable=%v byte=%d page=%v", e.Kind, e.Addr, e.Len, readable, first, page))
		})
		cancelB := in.mem.Subscribe(func(e hugetlb.Event) { log = append(log, "B "+e.Kind.String()) })
		defer cancelB()

		r, err := in.mem.Alloc(2 * b.PageSize)
		require.NoError(t, err)
		assert.Equal(t, []string{
			fmt.Sprintf("A alloc %#x %d readable=true byte=0 page=true", r.Addr, r.Len),
			"B alloc",
		}, log, "delivered before Alloc returns, in subscription order")

		log = nil
		r.Bytes()[0] = 7
		require.NoError(t, in.mem.Free(r))
		assert.Equal(t, []string{
			fmt.Sprintf("A free %#x %d readable=true byte=7 page=true", r.Addr, r.Len),
			"B free",
		}, log, "delivered before the memory goes")
		assert.ErrorIs(t, vm.CheckReadable(r.Addr, uintptr(r.Len)), vm.ErrNotMapped)

		log = nil
		_, err = in.mem.Alloc(5 * b.PageSize)
		require.Error(t, err)
		require.ErrorIs(t, in.mem.Free(r), hugetlb.ErrDoubleFree)
		assert.Empty(t, log, "failures deliver nothing")

		cancelA()
		cancelA()
		r, err = in.mem.Alloc(1)
		require.NoError(t, err)
		assert.Equal(t, []string{"B alloc"}, log, "a cancelled subscriber hears nothing")
	})
}

func TestSubscriberMayCancelFromCallback(t *testing.T) {
	in := newInstance(t, testenv.Tmpfs(t), hugetlb.ListConfig{Pages: 2})
	var calls atomic.Int32
	var cancel func()
	cancel = in.mem.Subscribe(func(hugetlb.Event) { calls.Add(1); cancel() })
	r, err := in.mem.Alloc(1)
	require.NoError(t, err)
	require.NoError(t, in.mem.Free(r))
	assert.Equal(t, int32(1), calls.Load())
}

func TestBadRequestsFailAndChangeNothing(t *testing.T) {
	b := testenv.Tmpfs(t)
	ps := b.PageSize
	in := newInstance(t, b, hugetlb.ListConfig{Pages: 4})
	// Pages 0 and 2 allocated; 1 and 3 free.
	r, err := in.mem.Alloc(3 * ps)
	require.NoError(t, err)
	require.NoError(t, in.mem.Free(in.region(1, 1)))
	events := 0
	defer in.mem.Subscribe(func(hugetlb.Event) { events++ })()

	cases := []struct {
		name string
		call func() error
		want error
		msg  string
	}{
		{"no run large enough", func() error { _, err := in.mem.Alloc(2 * ps); return err },
			hugetlb.ErrNoFreeRun, "alloc 4 MiB (4194304 bytes): hugetlb: no free run of pages large enough: the largest free run is 2 MiB (1 pages of 2 MiB in list 0)"},
		{"larger than the list", func() error { _, err := in.mem.Alloc(1 << 40); return err },
			hugetlb.ErrNoFreeRun, "alloc 1 TiB"},
		{"zero-length alloc", func() error { _, err := in.mem.Alloc(0); return err },
			hugetlb.ErrZeroLength, ""},
		{"double free", func() error { return in.mem.Free(in.region(1, 1)) },
			hugetlb.ErrDoubleFree, "page 1 of list 0"},
		{"free over a free page", func() error { return in.mem.Free(in.region(0, 2)) },
			hugetlb.ErrDoubleFree, "page 1 of list 0"},
		{"unaligned address", func() error { return in.mem.Free(hugetlb.Region{Addr: r.Addr + 4096, Len: ps}) },
			hugetlb.ErrUnaligned, "2 MiB pages"},
		{"unaligned length", func() error { return in.mem.Free(hugetlb.Region{Addr: r.Addr, Len: ps / 2}) },
			hugetlb.ErrUnaligned, ""},
		{"foreign address", func() error { return in.mem.Free(hugetlb.Region{Addr: 0x10000, Len: ps}) },
			hugetlb.ErrForeign, ""},
		{"past the end of the list", func() error { return in.mem.Free(in.region(2, 3)) },
			hugetlb.ErrForeign, "runs past the end of list 0"},
		{"zero-length free", func() error { return in.mem.Free(hugetlb.Region{Addr: r.Addr}) },
			hugetlb.ErrZeroLength, ""},
		{"map in the primary", func() error { return in.mem.MapPages(0, 0, 1) }, hugetlb.ErrNotSecondary, ""},
		{"unmap in the primary", func() error { return in.mem.UnmapPages(0, 0, 1) }, hugetlb.ErrNotSecondary, ""},
		{"resync in the primary", func() error { return in.mem.Resync() }, hugetlb.ErrNotSecondary, ""},
	}
	before := in.mem.Lists()
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			err := c.call()
			require.ErrorIs(t, err, c.want)
			assert.Contains(t, err.Error(), c.msg)
			assert.Equal(t, before, in.mem.Lists(), "nothing changed")
			assert.Zero(t, events)
		})
	}
	assert.NoError(t, vm.CheckReadable(r.Addr, uintptr(ps)), "page 0 is still there")
}

func TestCreateRejectsBadConfig(t *testing.T) {
	b := testenv.Tmpfs(t)
	cases := []struct {
		name string
		cfg  func(*hugetlb.Config)
		msg  string
	}{
		{"no lists", func(c *hugetlb.Config) { c.Lists = nil }, "0 memseg lists"},
		{"empty list", func(c *hugetlb.Config) { c.Lists[0].Pages = 0 }, "0 pages"},
		{"too many pages", func(c *hugetlb.Config) { c.Lists[0].Pages = hugetlb.MaxPages + 1 }, "pages, want"},
		{"page size not a power of two", func(c *hugetlb.Config) { c.Lists[0].PageSize = 3 << 20 }, "page size 3145728"},
		{"page size below the system's", func(c *hugetlb.Config) { c.Lists[0].PageSize = 512 }, "page size 512"},
		{"unaligned base", func(c *hugetlb.Config) { c.Lists[0].Base = hugetlb.DefaultBase + 4096 }, "not aligned"},
		{"base past user space", func(c *hugetlb.Config) { c.Lists[0].Base = 1 << 47 }, "past the user address space"},
		{"overlapping lists", func(c *hugetlb.Config) {
			c.Lists = append(c.Lists, hugetlb.ListConfig{Pages: 1, Base: hugetlb.DefaultBase + 2<<20})
		}, "overlaps list 0"},
		{"auto backend", func(c *hugetlb.Config) { c.Backend.Kind = hugetlb.Auto }, "use Choose"},
		{"empty prefix", func(c *hugetlb.Config) { c.Prefix = "" }, "prefix"},
		{"prefix with a slash", func(c *hugetlb.Config) { c.Prefix = "a/b" }, "prefix"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			in := newSegment(t, b)
			cfg := hugetlb.Config{Prefix: in.prefix, Backend: b, Lists: []hugetlb.ListConfig{{Pages: 4}}, Logger: quiet}
			c.cfg(&cfg)
			_, err := hugetlb.Create(in.seg, cfg)
			require.Error(t, err)
			assert.Contains(t, err.Error(), c.msg)
			assert.Zero(t, in.seg.Root(shm.RootMemory), "nothing published")
			assert.NoFileExists(t, filepath.Join(b.Dir, hugetlb.FileName(in.prefix, 0)))
		})
	}
}

func TestCreateRefusesWhatExists(t *testing.T) {
	b := testenv.Tmpfs(t)
	in := newInstance(t, b, hugetlb.ListConfig{Pages: 1})
	_, err := hugetlb.Create(in.seg, hugetlb.Config{Prefix: in.prefix + "x", Backend: b,
		Lists: []hugetlb.ListConfig{{Pages: 1, Base: hugetlb.DefaultBase + 8<<30}}, Logger: quiet})
	assert.ErrorIs(t, err, hugetlb.ErrExists, "one memory per segment")

	// A file left by an instance that died blocks a new one until removed.
	other := newSegment(t, b)
	stale := filepath.Join(b.Dir, hugetlb.FileName(other.prefix, 0))
	require.NoError(t, os.WriteFile(stale, nil, 0o600))
	cfg := hugetlb.Config{Prefix: other.prefix, Backend: b, Logger: quiet,
		Lists: []hugetlb.ListConfig{{Pages: 1, Base: hugetlb.DefaultBase + 8<<30}}}
	_, err = hugetlb.Create(other.seg, cfg)
	require.ErrorIs(t, err, hugetlb.ErrExists)
	assert.Contains(t, err.Error(), stale)
	assert.FileExists(t, stale, "someone else's file is left alone")
	assert.NotContains(t, err.Error(), "not an instance's", "this user's own file")
	require.NoError(t, hugetlb.RemoveFiles(b.Dir, other.prefix))

	// Something that is no instance's file is named as such.
	require.NoError(t, unix.Mkfifo(stale, 0o600))
	_, err = hugetlb.Create(other.seg, cfg)
	require.ErrorIs(t, err, hugetlb.ErrExists)
	assert.ErrorContains(t, err, fmt.Sprintf("a FIFO of uid %d: not an instance's file", os.Geteuid()))
	require.NoError(t, os.Remove(stale))
	m, err := hugetlb.Create(other.seg, cfg)
	require.NoError(t, err)
	require.NoError(t, m.Close())

	// Only the segment's owner creates memory.
	seg, err := shm.Attach(in.opts)
	require.NoError(t, err)
	defer seg.Close()
	_, err = hugetlb.Create(seg, cfg)
	assert.ErrorIs(t, err, hugetlb.ErrNotPrimary)
}

func TestCreateFailsClearlyWhenRangeIsTaken(t *testing.T) {
	b := testenv.Tmpfs(t)
	in := newSegment(t, b)
	ps := uintptr(b.PageSize)
	taken := hugetlb.DefaultBase + 2*ps
	_, err := vm.Reserve(taken, ps)
	require.NoError(t, err)
	defer vm.Unmap(taken, ps)

	_, err = hugetlb.Create(in.seg, hugetlb.Config{Prefix: in.prefix, Backend: b,
		Lists: []hugetlb.ListConfig{{Pages: 4}}, Logger: quiet})
	require.ErrorIs(t, err, hugetlb.ErrAddressInUse)
	msg := err.Error()
	assert.Contains(t, msg, "["+hex(hugetlb.DefaultBase)+", "+hex(hugetlb.DefaultBase+4*ps)+")")
	assert.Contains(t, msg, "["+hex(taken)+", "+hex(taken+ps)+") ---p")
	assert.Contains(t, msg, "ListConfig.Base")
	assert.NoFileExists(t, filepath.Join(b.Dir, hugetlb.FileName(in.prefix, 0)), "a failed create leaves nothing")
	assert.Zero(t, in.seg.Root(shm.RootMemory))

	// In the same process the primary's own reservation is in the way.
	in2 := newInstance(t, b, hugetlb.ListConfig{Pages: 1})
	seg, err := shm.Attach(in2.opts)
	require.NoError(t, err)
	defer seg.Close()
	_, err = hugetlb.Attach(seg, hugetlb.AttachOptions{Logger: quiet})
	assert.ErrorIs(t, err, hugetlb.ErrAddressInUse)
}

func TestCloseReleasesEverything(t *testing.T) {
	b := testenv.Tmpfs(t)
	in := newInstance(t, b, hugetlb.ListConfig{Pages: 2})
	r, err := in.mem.Alloc(1)
	require.NoError(t, err)
	file := in.mem.Lists()[0].File
	require.NoError(t, in.mem.Close())
	require.NoError(t, in.mem.Close(), "idempotent")
	assert.NoFileExists(t, file)
	assert.ErrorIs(t, vm.CheckReadable(r.Addr, 1), vm.ErrNotMapped)
	_, err = in.mem.Alloc(1)
	assert.ErrorIs(t, err, hugetlb.ErrClosed)
	assert.ErrorIs(t, in.mem.Free(r), hugetlb.ErrClosed)
	_, ok := in.mem.PageOf(r.Addr)
	assert.False(t, ok)
	assert.Nil(t, in.mem.Lists())

	// The range is free again: a new memory may take it.
	m, err := hugetlb.Create(newSegment(t, b).seg, hugetlb.Config{Prefix: in.prefix + "-2", Backend: b,
		Lists: []hugetlb.ListConfig{{Pages: 2}}, Logger: quiet})
	require.NoError(t, err)
	require.NoError(t, m.Close())
}

// allocatedBytes is what the file system holds for a file.
func allocatedBytes(t *testing.T, path string) uint64 {
	t.Helper()
	var st unix.Stat_t
	require.NoError(t, unix.Stat(path, &st))
	return uint64(st.Blocks) * 512
}

func freeHugepages(t *testing.T, pageSize uint64) int64 {
	t.Helper()
	p, err := hugetlb.PoolFor(pageSize)
	require.NoError(t, err)
	return int64(p.Free)
}

func TestHugepagesGoBackToThePool(t *testing.T) {
	b := testenv.Hugetlb(t, 4)
	ps := b.PageSize
	// Other test processes share the pool: a cycle during which someone
	// else took or gave back hugepages is repeated. The file's own blocks
	// are exact and checked every time.
	want := []int64{4, 2, 1, 0}
	var got []int64
	for attempt := 1; attempt <= 5; attempt++ {
		got = nil
		free0 := freeHugepages(t, ps)
		note := func() { got = append(got, free0-freeHugepages(t, ps)) }

		in := newInstance(t, b, hugetlb.ListConfig{Pages: 8})
		file := in.mem.Lists()[0].File
		a, err := in.mem.Alloc(2 * ps)
		require.NoError(t, err)
		c, err := in.mem.Alloc(2 * ps)
		require.NoError(t, err)
		fill(a.Bytes(), 1)
		fill(c.Bytes(), 2)
		note()
		assert.Equal(t, 4*ps, allocatedBytes(t, file))
		require.NoError(t, in.mem.Free(a))
		note()
		assert.Equal(t, 2*ps, allocatedBytes(t, file))
		require.NoError(t, in.mem.Free(hugetlb.Region{Addr: c.Addr, Len: ps}))
		note()
		assert.Equal(t, ps, allocatedBytes(t, file))
		require.NoError(t, in.mem.Close())
		note()
		if slices.Equal(got, want) {
			break
		}
		t.Logf("attempt %d: pool moved by %v, want %v; another process used hugepages meanwhile?", attempt, got, want)
	}
	assert.Equal(t, want, got, "hugepages taken from the pool after 2+2 allocated, 2 freed, 1 freed, close")
}

func TestAllocFailsNowWithoutHugepages(t *testing.T) {
	b := testenv.Hugetlb(t, 2)
	// A private mount limited to two pages runs out without draining the
	// machine's pool, which other tests share.
	dir := t.TempDir()
	err := unix.Mount("none", dir, "hugetlbfs", 0, fmt.Sprintf("pagesize=%d,size=%d", b.PageSize, 2*b.PageSize))
	if err != nil {
		if testenv.HugetlbRequired() {
			t.Fatalf("mount a size-limited hugetlbfs at %s: %v", dir, err)
		}
		t.Skipf("cannot mount a size-limited hugetlbfs (needs CAP_SYS_ADMIN): %v", err)
	}
	t.Cleanup(func() { unix.Unmount(dir, unix.MNT_DETACH) })
	small, err := hugetlb.Choose(hugetlb.Want{Kind: hugetlb.Hugetlbfs, Dir: dir, PageSize: b.PageSize})
	require.NoError(t, err)
	in := newInstance(t, small, hugetlb.ListConfig{Pages: 8})
	events := 0
	defer in.mem.Subscribe(func(hugetlb.Event) { events++ })()

	_, err = in.mem.Alloc(3 * b.PageSize)
	require.ErrorIs(t, err, hugetlb.ErrNoHugepages)
	m := regexp.MustCompile(`asked 3 pages of 2 MiB, (\d+) free`).FindStringSubmatch(err.Error())
	require.NotNil(t, m, "the error says what was asked and what is free: %v", err)
	free, _ := strconv.Atoi(m[1])
	assert.LessOrEqual(t, free, 2)
	assert.Zero(t, events)
	l := in.mem.Lists()[0]
	assert.Equal(t, 0, l.Allocated)
	assert.Zero(t, allocatedBytes(t, l.File), "the pages a failed allocation got are given back")

	r, err := in.mem.Alloc(2 * b.PageSize)
	require.NoError(t, err, "what the mount holds can still be allocated")
	fill(r.Bytes(), 1)
	assert.Equal(t, -1, verify(r.Bytes(), 1))
}

func TestLayoutDescribesSharedStructs(t *testing.T) {
	l := hugetlb.Layout()
	require.Len(t, l, 2)
	assert.True(t, strings.HasPrefix(l[0], "tableHeader:64/8{"), l[0])
	assert.True(t, strings.HasPrefix(l[1], "listDesc:256/8{"), l[1])
	assert.Contains(t, l[1], "File@64:[24]uint64")
}

// Attach reads descriptors another process wrote: whatever they hold, it
// fails cleanly (or, for values that still make sense, succeeds) and never
// panics. The fuzzer overwrites one word of the table at a time; the
// sequence count is left out, since an odd one only makes Attach wait for
// the primary to finish a change.
func FuzzAttachDescriptors(f *testing.F) {
	b := testenv.Tmpfs(f)
	in := newInstance(f, b, hugetlb.ListConfig{Pages: 4}, hugetlb.ListConfig{Pages: 2})
	if _, err := in.mem.Alloc(2 * b.PageSize); err != nil {
		f.Fatal(err)
	}
	seg, err := shm.Attach(in.opts)
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { seg.Close() })
	root := in.seg.Root(shm.RootMemory)
	const tableSize = 64 + 2*256
	const genOff = 24
	for _, c := range []struct {
		off uint16
		val uint64
	}{
		{0, 0}, {8, 2}, {12, 0}, {12, 1 << 20}, {16, 2}, {16, 9},
		{64, 0}, {64, 4096}, {72, 3 << 20}, {72, 0}, {80, 0}, {80, 1 << 40}, {96, 0}, {96, 1 << 50}, {96, 3},
		{104, 7}, {108, 0}, {108, 1000}, {128, 0}, {64 + 256, 1 << 40}, {64 + 256, 0x200_0000_0000},
	} {
		f.Add(c.off, c.val)
	}
	f.Fuzz(func(t *testing.T, off uint16, val uint64) {
		o := uint64(off) % tableSize &^ 7
		if o == genOff {
			return
		}
		p := shm.At[uint64](in.seg, root+o)
		old := atomic.LoadUint64(p)
		atomic.StoreUint64(p, val)
		defer atomic.StoreUint64(p, old)
		m, err := hugetlb.Attach(seg, hugetlb.AttachOptions{Logger: quiet})
		if err == nil {
			// Only a base moved to another free range can pass.
			require.NoError(t, m.Close())
		}
	})
}

func TestConcurrentUseInThePrimary(t *testing.T) {
	b := testenv.Tmpfs(t)
	b.PageSize = 64 << 10
	in := newInstance(t, b, hugetlb.ListConfig{Pages: 64}, hugetlb.ListConfig{Pages: 32})
	var allocs, frees atomic.Int64
	defer in.mem.Subscribe(func(e hugetlb.Event) {
		// The pages of the event are allocated while it is delivered.
		if _, ok := in.mem.PageOf(e.Addr); !ok {
			t.Errorf("%s event for %#x, which is not allocated", e.Kind, e.Addr)
		}
		if e.Kind == hugetlb.EventAlloc {
			allocs.Add(1)
		} else {
			frees.Add(1)
		}
	})()
	done := make(chan struct{})
	var wg, reader sync.WaitGroup
	for g := range 3 {
		wg.Go(func() {
			var held []hugetlb.Region
			for i := range 60 {
				if len(held) > 4 || (i%2 == 1 && len(held) > 0) {
					if err := in.mem.Free(held[0]); err != nil {
						t.Error(err)
						return
					}
					held = held[1:]
					continue
				}
				r, err := in.mem.Alloc(uint64(1+(g+i)%5) * b.PageSize)
				if err != nil {
					t.Error(err)
					return
				}
				fill(r.Bytes(), g)
				held = append(held, r)
			}
			for _, r := range held {
				if verify(r.Bytes(), g) >= 0 {
					t.Errorf("region %#x was overwritten", r.Addr)
				}
				if err := in.mem.Free(r); err != nil {
					t.Error(err)
				}
			}
		})
	}
	reader.Go(func() {
		// A reader of the queries, as the MR cache would be, re-checking a
		// run under the read lock.
		for {
			select {
			case <-done:
				return
			default:
			}
			for r := range in.mem.Runs {
				in.mem.RLock()
				again, ok := in.mem.ContigRun(r.Start)
				if ok && (again.Start > r.Start || again.End <= r.Start) {
					t.Errorf("run %+v does not hold its own start", again)
				}
				in.mem.RUnlock()
			}
			in.mem.Lists()
		}
	})
	wg.Wait()
	close(done)
	reader.Wait()
	assert.Equal(t, allocs.Load(), frees.Load())
	for _, l := range in.mem.Lists() {
		assert.Zero(t, l.Allocated)
	}
}

func TestGuardRefusesFreeAndNothingChanges(t *testing.T) {
	b := testenv.Tmpfs(t)
	in := newInstance(t, b, hugetlb.ListConfig{Pages: 4})
	r, err := in.mem.Alloc(2 * b.PageSize)
	require.NoError(t, err)
	r.Bytes()[0] = 42
	var events []string
	defer in.mem.Subscribe(func(e hugetlb.Event) { events = append(events, e.Kind.String()) })()
	refuse := errors.New("not now")
	var asked int
	cancel := in.mem.GuardFree(func(e hugetlb.Event) error {
		asked++
		assert.Equal(t, hugetlb.Event{Kind: hugetlb.EventFree, Addr: r.Addr, Len: r.Len}, e)
		return refuse
	})
	err = in.mem.Free(r)
	require.ErrorIs(t, err, hugetlb.ErrNotFreed)
	require.ErrorIs(t, err, refuse)
	assert.Equal(t, 1, asked)
	assert.Empty(t, events, "subscribers hear of no free")
	assert.Equal(t, byte(42), r.Bytes()[0], "still mapped, contents kept")
	assert.Equal(t, 2, in.mem.Lists()[0].Allocated, "still allocated")

	cancel()
	require.NoError(t, in.mem.Free(r))
	assert.Equal(t, []string{"free"}, events)
	assert.Equal(t, 0, in.mem.Lists()[0].Allocated)
}

// Mapped answers from what this process mapped, not from the shared page
// state, which any process mapping the segment can write.
func TestMappedIsThisProcesssOwnView(t *testing.T) {
	b := testenv.Tmpfs(t)
	ps := b.PageSize
	in := newInstance(t, b, hugetlb.ListConfig{Pages: 4}, hugetlb.ListConfig{Pages: 2})
	l0, l1 := in.mem.Lists()[0], in.mem.Lists()[1]
	r, err := in.mem.Alloc(2 * ps)
	require.NoError(t, err)

	assert.True(t, in.mem.Mapped(r.Addr, r.Len))
	assert.True(t, in.mem.Mapped(r.Addr+1, r.Len-2))
	assert.False(t, in.mem.Mapped(r.Addr, r.Len+1), "one byte into a free page")
	assert.False(t, in.mem.Mapped(r.Addr-1, 2), "one byte before the list")
	assert.False(t, in.mem.Mapped(r.Addr, 0), "an empty range")
	assert.False(t, in.mem.Mapped(^uintptr(0)-10, 100), "a range that wraps")
	assert.False(t, in.mem.Mapped(0x10000, 64), "outside every list")
	assert.False(t, in.mem.Mapped(l0.End-uintptr(ps), 2*ps), "into the gap after a list")
	assert.False(t, in.mem.Mapped(l1.Base, 1), "a list with nothing allocated")

	// Another process marks the rest of list 0 allocated in the shared
	// state: this process has not mapped it.
	// (The table: a 64-byte header, then the lists' descriptors, each
	// with its bitmap's offset at byte 32.)
	table := in.seg.Root(shm.RootMemory)
	bitsOff := atomic.LoadUint64(&shm.Slice[uint64](in.seg, table+64+32, 1)[0])
	bits := &shm.Slice[uint64](in.seg, bitsOff, 1)[0]
	atomic.StoreUint64(bits, 0xf)
	_, ok := in.mem.ContigRun(l0.Base + 3*uintptr(ps))
	require.True(t, ok, "the shared state says allocated")
	assert.False(t, in.mem.Mapped(l0.Base, 4*ps), "but nothing maps it here")
	atomic.StoreUint64(bits, 0x3)

	require.NoError(t, in.mem.Free(hugetlb.Region{Addr: r.Addr, Len: ps}))
	assert.False(t, in.mem.Mapped(r.Addr, 1), "a freed page")
	assert.True(t, in.mem.Mapped(r.Addr+uintptr(ps), ps))
}

// Mapped against a page-by-page model over lists longer than a bitmap
// word, with ranges ending at every kind of boundary.
func TestMappedMatchesAPageByPageModel(t *testing.T) {
	b := testenv.Tmpfs(t)
	ps := b.PageSize
	in := newInstance(t, b, hugetlb.ListConfig{Pages: 130}, hugetlb.ListConfig{Pages: 70})
	rng := rand.New(rand.NewPCG(1, 2))
	var regions []hugetlb.Region
	for range 40 {
		r, err := in.mem.Alloc(uint64(1+rng.IntN(5)) * ps)
		if err != nil {
			break
		}
		regions = append(regions, r)
	}
	for i, r := range regions {
		if i%3 == 1 {
			require.NoError(t, in.mem.Free(r))
		}
	}
	lists := in.mem.Lists()
	model := func(a uintptr, n uint64) bool {
		if n == 0 || uint64(a)+n < uint64(a) {
			return false
		}
		var li = -1
		for i, l := range lists {
			if a >= l.Base && a < l.End {
				li = i
			}
		}
		if li < 0 || uint64(a)+n > uint64(lists[li].End) {
			return false
		}
		for p := (a - lists[li].Base) / uintptr(ps); uint64(p)*ps < uint64(a-lists[li].Base)+n; p++ {
			if _, ok := in.mem.PageOf(lists[li].Base + p*uintptr(ps)); !ok {
				return false
			}
		}
		return true
	}
	check := func(a uintptr, n uint64) {
		t.Helper()
		require.Equal(t, model(a, n), in.mem.Mapped(a, n), "Mapped(%#x, %#x)", a, n)
	}
	for _, l := range lists {
		pages := int(l.Capacity)
		for first := 0; first < pages; first++ {
			for _, last := range []int{first, first + 1, first + 63, first + 64, first + 65, pages - 1, pages} {
				if last < first {
					continue
				}
				a := l.Base + uintptr(uint64(first)*ps)
				n := uint64(last-first+1) * ps
				for _, d := range []int64{-1, 0, 1} {
					for _, e := range []int64{-1, 0, 1} {
						aa := uintptr(int64(a) + d)
						nn := uint64(int64(n) + e - d)
						check(aa, nn)
					}
				}
			}
		}
		check(l.End-1, 1)
		check(l.End, 1)
		check(l.End-1, 2)
	}
}

// The primary allocates and frees by its own record of what it allocated,
// not by the shared page state, which any process mapping the segment can
// write: a page another process marks free there is not handed out again
// while allocated, and a page it marks allocated is not freed.
func TestAllocAndFreeGoByThePrimarysOwnRecord(t *testing.T) {
	b := testenv.Tmpfs(t)
	ps := b.PageSize
	in := newInstance(t, b, hugetlb.ListConfig{Pages: 4})
	r, err := in.mem.Alloc(ps)
	require.NoError(t, err)
	r.Bytes()[0] = 0x5a

	// (The table: a 64-byte header, then the lists' descriptors, each
	// with its bitmap's offset at byte 32.)
	table := in.seg.Root(shm.RootMemory)
	bitsOff := atomic.LoadUint64(&shm.Slice[uint64](in.seg, table+64+32, 1)[0])
	bits := &shm.Slice[uint64](in.seg, bitsOff, 1)[0]
	atomic.StoreUint64(bits, 0) // the other process's write: page 0 free

	r2, err := in.mem.Alloc(ps)
	require.NoError(t, err)
	assert.NotEqual(t, r.Addr, r2.Addr, "an allocated page was handed out again")
	assert.Equal(t, byte(0x5a), r.Bytes()[0], "the first allocation's memory was replaced")

	free := hugetlb.Region{Addr: r2.Addr + uintptr(ps), Len: ps}
	atomic.StoreUint64(bits, 0xf) // the other process's write: every page allocated
	assert.ErrorIs(t, in.mem.Free(free), hugetlb.ErrDoubleFree, "a page never allocated was freed")
}
