package hugetlb

import (
	"fmt"
	"runtime"
	"sync/atomic"
	"time"

	"github.com/mpmr/mpmr/shm"
)

// describePatience bounds how long Describe waits for the primary to finish
// a change of the page state before it settles for a best-effort snapshot.
const describePatience = 100 * time.Millisecond

// Describe returns the accounting of every memseg list, read from the
// descriptors the primary published in seg, without mapping the data
// memory or opening the backing files: what a tool uses to look at an
// instance, live or dead, from a process that is not part of it (a
// read-only segment from shm.OpenReadOnly will do, since Describe writes
// nothing). Mapped is always 0: nothing is mapped here.
//
// The descriptors are validated as Attach validates them, except that a
// table the primary closed is described too. The page state is read as one
// consistent snapshot when the primary is not changing it; if a change
// stays in progress (a primary that died halfway through one), the figures
// are a best-effort snapshot.
func Describe(seg *shm.Segment) ([]ListInfo, error) {
	h, descs, specs, err := readDescriptors(seg)
	if err != nil {
		return nil, fmt.Errorf("hugetlb: describe: %w", err)
	}
	var deadline time.Time
	for try := 0; ; try++ {
		gen := atomic.LoadUint64(&h.Gen)
		out := describeLists(seg, descs, specs)
		if gen&1 == 0 && atomic.LoadUint64(&h.Gen) == gen {
			return out, nil
		}
		switch {
		case try == 0:
			deadline = time.Now().Add(describePatience)
		case time.Now().After(deadline):
			return out, nil
		case try < 16:
			runtime.Gosched()
		default:
			time.Sleep(min(time.Duration(try)*10*time.Microsecond, time.Millisecond))
		}
	}
}

// describeLists reads each list's figures once.
func describeLists(seg *shm.Segment, descs []listDesc, specs []spec) []ListInfo {
	out := make([]ListInfo, len(specs))
	for i, s := range specs {
		state := bitmap(shm.Slice[uint64](seg, s.bitsOff, words(s.pages)))
		alloc := int(min(atomic.LoadUint64(&descs[i].Allocated), uint64(s.pages)))
		_, longest := state.firstFit(s.pages+1, s.pages)
		size := uint64(s.pages) * s.pageSize
		out[i] = ListInfo{
			Index: i, Base: s.base, End: s.end(), PageSize: s.pageSize, Backend: s.kind, File: s.path,
			Capacity: s.pages, Allocated: alloc, Free: s.pages - alloc, LargestFree: longest,
			CapacityBytes:  size,
			AllocatedBytes: uint64(alloc) * s.pageSize,
			FreeBytes:      uint64(s.pages-alloc) * s.pageSize,
		}
	}
	return out
}
