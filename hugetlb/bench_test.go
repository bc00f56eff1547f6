package hugetlb_test

import (
	"fmt"
	"runtime"
	"testing"
	"time"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/internal/test/testproc"
)

// One 2 MiB page allocated (fallocate, map, descriptor, events) and freed
// (event, unmap, punch), on each backend.
func BenchmarkAllocFree(b *testing.B) {
	run := func(b *testing.B, be hugetlb.Backend) {
		in := newInstance(b, be, hugetlb.ListConfig{Pages: 4})
		b.ReportAllocs()
		for b.Loop() {
			r, err := in.mem.Alloc(be.PageSize)
			if err != nil {
				b.Fatal(err)
			}
			if err := in.mem.Free(r); err != nil {
				b.Fatal(err)
			}
		}
	}
	b.Run("tmpfs", func(b *testing.B) { run(b, testenv.Tmpfs(b)) })
	b.Run("hugetlbfs", func(b *testing.B) { run(b, testenv.Hugetlb(b, 1)) })
}

// A secondary attaching to 1 GiB of allocated memory: read the descriptors,
// reserve the range, map the allocated pages (target: 50 ms). The machine
// has only 64 hugepages of 2 MiB, so the gigabyte lives on tmpfs with 2 MiB
// pages; attaching does the same work on either backend (one mmap per run
// of allocated pages, nothing is touched). The attach runs in a helper
// process, since the primary holds the same addresses here; ns/attach and
// allocs/attach are measured there, around hugetlb.Attach alone.
func BenchmarkAttach1GiB(b *testing.B) {
	be := testenv.Tmpfs(b)
	be.PageSize = 2 << 20
	const size = 1 << 30
	in := newInstance(b, be, hugetlb.ListConfig{Pages: size / (2 << 20)})
	// Two allocations with a hole between them: two runs to map.
	first, err := in.mem.Alloc(size / 2)
	if err != nil {
		b.Fatal(err)
	}
	if _, err := in.mem.Alloc(size/2 - be.PageSize); err != nil {
		b.Fatal(err)
	}
	if err := in.mem.Free(hugetlb.Region{Addr: first.End() - uintptr(be.PageSize), Len: be.PageSize}); err != nil {
		b.Fatal(err)
	}
	p := testproc.Start(b, "attach-loop", []string{in.opts.Path})
	p.Expect("ready", 0)
	var total time.Duration
	var allocs uint64
	b.ReportAllocs()
	for b.Loop() {
		p.Send("attach")
		var ns, n uint64
		if _, err := fmt.Sscanf(p.Expect("attached", 0), "attached %d %d", &ns, &n); err != nil {
			b.Fatal(err)
		}
		total += time.Duration(ns)
		allocs += n
	}
	b.ReportMetric(float64(total.Nanoseconds())/float64(b.N), "ns/attach")
	b.ReportMetric(float64(allocs)/float64(b.N), "allocs/attach")
}

// helperAttachLoop attaches to and detaches from the instance whose segment
// is args[0], once per "attach" command, and reports how long
// hugetlb.Attach took and how many allocations it made.
func helperAttachLoop(args []string) int {
	testproc.Say("ready")
	in := testproc.Commands()
	for in.Scan() {
		seg, err := attachSegment(args[0])
		if err != nil {
			testproc.Say("error %v", err)
			return 3
		}
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		start := time.Now()
		mem, err := hugetlb.Attach(seg, hugetlb.AttachOptions{Logger: quiet})
		elapsed := time.Since(start)
		runtime.ReadMemStats(&after)
		if err != nil {
			testproc.Say("error %v", err)
			return 3
		}
		if got := mem.Lists()[0].Mapped; got != mem.Lists()[0].Allocated {
			testproc.Say("error mapped %d of %d pages", got, mem.Lists()[0].Allocated)
			return 3
		}
		mem.Close()
		seg.Close()
		testproc.Say("attached %d %d", elapsed.Nanoseconds(), after.Mallocs-before.Mallocs)
	}
	return 0
}

// The lookups the MR cache makes: address to page, and the contiguous run
// around an address in a fragmented list.
func BenchmarkQueries(b *testing.B) {
	be := testenv.Tmpfs(b)
	in := newInstance(b, be, hugetlb.ListConfig{Pages: 64})
	r, err := in.mem.Alloc(64 * be.PageSize)
	if err != nil {
		b.Fatal(err)
	}
	for i := 7; i < 64; i += 8 {
		if err := in.mem.Free(hugetlb.Region{Addr: r.Addr + uintptr(uint64(i)*be.PageSize), Len: be.PageSize}); err != nil {
			b.Fatal(err)
		}
	}
	addr := r.Addr + uintptr(35*be.PageSize) + 12345
	b.Run("PageOf", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, ok := in.mem.PageOf(addr); !ok {
				b.Fatal("no page")
			}
		}
	})
	b.Run("ContigRun", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if run, ok := in.mem.ContigRun(addr); !ok || run.Pages != 7 {
				b.Fatal(run, ok)
			}
		}
	})
}
