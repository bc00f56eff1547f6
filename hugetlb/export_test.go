package hugetlb

import (
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mpmr/mpmr/internal/sys/vm"
)

// FDInfosRead returns how many fdinfo entries the questions about fenced
// processes have read so far.
func FDInfosRead() int64 { return fdInfos.Load() }

// MapsLinesRead returns how many lines of maps files the questions about
// processes have read.
func MapsLinesRead() int64 { return mapsLines.Load() }

// StallDescribingOnce has the next look at the clock of a bounded question
// about a process wait d first, as if this process had been stopped there.
func StallDescribingOnce(d time.Duration) {
	var once sync.Once
	f := func() { once.Do(func() { time.Sleep(d) }) }
	describeLook.Store(&f)
}

// StallDescribingEvery has every look at the clock of a bounded question
// about a process wait d first, as if the kernel were that slow to answer
// between two looks, and returns the count of looks so far.
func StallDescribingEvery(d time.Duration) (looks func() int64) {
	var n atomic.Int64
	f := func() {
		n.Add(1)
		time.Sleep(d)
	}
	describeLook.Store(&f)
	return n.Load
}

// NoDescribingStall undoes StallDescribingOnce and StallDescribingEvery.
func NoDescribingStall() { describeLook.Store(nil) }

// BeginChange and EndChange bracket a change of the page state, as the
// primary's Alloc and Free do, without changing anything: a secondary's
// Resync waits while one is open.
func (m *Memory) BeginChange() { m.mu.Lock(); m.beginChange(); m.mu.Unlock() }
func (m *Memory) EndChange()   { m.mu.Lock(); m.endChange(); m.mu.Unlock() }

// SetResyncWait sets how long Resync waits for a change to end (for the
// rest of the process) and has stall run each time it finds one open,
// before it judges how long it has waited.
func SetResyncWait(d time.Duration, stall func()) {
	resyncTimeout = d
	resyncOpen.Store(&stall)
}

// FailNextMapping has the next mapping of pages in a secondary fail as the
// kernel may fail it. With how "kept", nothing changes, as a MAP_FIXED
// that fails leaves the range since 6.12. With "hole", the range is left
// with nothing mapped at all, as a MAP_FIXED that removed what was there
// and then failed leaves it (kernels before 6.12). With "unmarked", the
// file is mapped read-write without DONTFORK, as a mark that failed and
// whose undo failed too leaves it. With "kept-twice", nothing changes and
// the release that undoes it fails too, as both do at the limit of the
// process's mappings. Not safe for concurrent use: for a helper process
// whose commands map pages one at a time.
func FailNextMapping(how string) {
	mapFile = func(addr, length uintptr, fd int, off int64) error {
		mapFile = vm.MapFile
		switch how {
		case "kept":
		case "kept-twice":
			releaseRange = func(addr, length uintptr) error {
				releaseRange = vm.Release
				return fmt.Errorf("vm: release [0x%x, 0x%x): %w (made to fail)", addr, addr+length, unix.ENOMEM)
			}
		case "hole":
			if err := vm.Unmap(addr, length); err != nil {
				return err
			}
		case "unmarked":
			if err := vm.MapFile(addr, length, fd, off); err != nil {
				return err
			}
			if err := unix.Madvise(vm.Bytes(addr, length), unix.MADV_DOFORK); err != nil {
				return err
			}
		default:
			panic("FailNextMapping: " + how)
		}
		return fmt.Errorf("vm: map fd %d at 0x%x: %w (made to fail: %s)", fd, addr, unix.ENOMEM, how)
	}
}

// LoseNextRelease has the next release of pages (a Free's unmap in the
// primary, the undoing of a failed Alloc, an unmap in a secondary) fail
// as a failed MAP_FIXED may on kernels before 6.12, leaving a hole it
// could not reserve again: the range is unmapped, take runs (another
// mapping of the process taking the hole), and the error matches
// ErrHole. Not safe for concurrent use.
func LoseNextRelease(take func(addr, length uintptr)) {
	releaseRange = func(addr, length uintptr) error {
		releaseRange = vm.Release
		if err := vm.Unmap(addr, length); err != nil {
			return err
		}
		take(addr, length)
		return fmt.Errorf("vm: release [0x%x, 0x%x): %w (made to fail)", addr, addr+length, vm.ErrHole)
	}
}

// FailNextPopulate has the next mapping of an Alloc fail. With take nil
// it changes nothing; otherwise the range is left as a populate that
// failed leaves it when its release leaves a hole it could not reserve
// again: unmapped, take run (another mapping taking the hole), and the
// error matching ErrHole. Not safe for concurrent use.
func FailNextPopulate(take func(addr, length uintptr)) {
	mapPopulated = func(addr, length uintptr, fd int, off int64) error {
		mapPopulated = vm.MapFilePopulated
		if take == nil {
			return fmt.Errorf("vm: map fd %d at 0x%x: %w (made to fail)", fd, addr, unix.ENOMEM)
		}
		if err := vm.Unmap(addr, length); err != nil {
			return err
		}
		take(addr, length)
		return fmt.Errorf("vm: map fd %d at 0x%x: %w; releasing it: %w (made to fail)", fd, addr, unix.EFAULT, vm.ErrHole)
	}
}
