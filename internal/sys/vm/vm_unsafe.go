// Package vm wraps the virtual-memory system calls the project needs beyond
// what the standard library offers: reserving an address range at a fixed
// address without clobbering anything already there, mapping a file into
// part of a reservation, handing part of it back, and checking or pinning a
// range the way a device driver's page walk would.
//
// Addresses are uintptr because the ranges live outside the Go heap and must
// stay at the same virtual address in every process that maps them. Only
// Prefault works on Go memory, a slice.
package vm

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"sync"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

var (
	// ErrRangeTaken means something is already mapped inside the range a
	// fixed reservation asked for.
	ErrRangeTaken = errors.New("vm: address range already in use")
	// ErrNotMapped means part of a range is unmapped or inaccessible.
	ErrNotMapped = errors.New("vm: range not mapped readable")
	// ErrHole means a failed Release left part of its range or all of it
	// with nothing mapped, not even a reservation: any other mapping of
	// the process may be placed there.
	ErrHole = errors.New("vm: range left unmapped")
)

// PageSize is the base page size of the system.
var PageSize = uintptr(os.Getpagesize())

func mmap(addr, length uintptr, prot, flags int, fd int, off int64) (uintptr, error) {
	r, _, e := unix.Syscall6(unix.SYS_MMAP, addr, length, uintptr(prot), uintptr(flags),
		uintptr(fd), uintptr(off))
	if e != 0 {
		return 0, e
	}
	return r, nil
}

// Reserve reserves length bytes of address space with no access, backed by
// nothing. With addr != 0 the reservation is at exactly addr or fails with
// ErrRangeTaken (MAP_FIXED_NOREPLACE: nothing already mapped is replaced);
// with addr == 0 the kernel picks the address.
func Reserve(addr, length uintptr) (uintptr, error) {
	flags := unix.MAP_PRIVATE | unix.MAP_ANONYMOUS | unix.MAP_NORESERVE
	if addr != 0 {
		flags |= unix.MAP_FIXED_NOREPLACE
	}
	got, err := mmap(addr, length, unix.PROT_NONE, flags, -1, 0)
	if errors.Is(err, unix.EEXIST) {
		return 0, fmt.Errorf("%w: [0x%x, 0x%x)", ErrRangeTaken, addr, addr+length)
	}
	if err != nil {
		return 0, fmt.Errorf("vm: reserve 0x%x bytes at 0x%x: %w", length, addr, err)
	}
	if addr != 0 && got != addr {
		// Kernels before 4.17 ignore MAP_FIXED_NOREPLACE and treat the
		// address as a hint; a different result means the range is taken.
		_ = Unmap(got, length)
		return 0, fmt.Errorf("%w: [0x%x, 0x%x)", ErrRangeTaken, addr, addr+length)
	}
	return got, nil
}

// MapFile maps length bytes of fd at off, shared and read-write, at exactly
// addr, replacing whatever part of a reservation is there (MAP_FIXED). The
// caller must own [addr, addr+length). A child this process forks does not
// inherit the mapping (MADV_DONTFORK): the process that made it follows
// what happens to the memory, and a child, which nobody asks to unmap it,
// would keep it after it was freed and handed to someone else.
func MapFile(addr, length uintptr, fd int, off int64) error {
	return mapFile(addr, length, fd, off, false)
}

// mapFile maps, marks the mapping DONTFORK, and only then populates it:
// populating a gigabyte takes long enough for a fork to come in between,
// and the child would keep what it inherited. The mapping and its mark
// are two system calls, and a fork from another thread between them
// inherits the mapping all the same: mapAndMark makes them raw and back
// to back, so that nothing of this process's scheduling comes between
// them (a goroutine back from a system call may wait for a P, or be
// preempted, before its next). Raw calls keep their P while they wait,
// so they are made while none of this package's calls that fault pages
// in runs (populates, mlock: they hold the memory map's lock for seconds
// on tmpfs); what they may still wait for is a short hold of that lock (a
// fault, a read of the maps file). A fork can still come between the two:
// the memory map's lock is let go between them, and the thread may be
// preempted there. Under mlockall(MCL_FUTURE) the mmap populates the
// mapping itself before it returns: the gap then lasts the populate, and
// the raw call holds its P as long.
func mapFile(addr, length uintptr, fd int, off int64, populate bool) error {
	var err error
	populating.Lock()
	e := mapAndMark(addr, length, uintptr(fd), uintptr(off))
	populating.Unlock()
	if e != 0 {
		err = e
	}
	if err == nil && populate {
		populating.RLock()
		perr := unix.Madvise(Bytes(addr, length), unix.MADV_POPULATE_WRITE)
		populating.RUnlock()
		if perr != nil && !errors.Is(perr, unix.EINVAL) {
			// EINVAL: a kernel before 5.14, which cannot; the pages are
			// then faulted in at their first touch.
			err = perr
			if rerr := Release(addr, length); rerr != nil {
				// ErrHole among them: the caller must not map or
				// release over the range again.
				err = fmt.Errorf("%w; releasing it: %w", perr, rerr)
			}
		}
	}
	if err != nil {
		return fmt.Errorf("vm: map fd %d at 0x%x (+0x%x, off 0x%x): %w", fd, addr, length, off, err)
	}
	return nil
}

// populating is held for reading by this package's calls that fault
// pages in (populates, mlock) and for writing by mapAndMark's raw calls
// (see mapFile).
var populating sync.RWMutex

// mapAndMark maps fd at off at exactly addr (MAP_FIXED) and marks the
// mapping DONTFORK, undoing the mapping if the mark fails. It is nosplit
// (and never inlined into a caller that is not): no preemption point of
// the runtime falls between the two calls.
//
//go:nosplit
//go:noinline
func mapAndMark(addr, length, fd, off uintptr) syscall.Errno {
	_, _, e := syscall.RawSyscall6(syscall.SYS_MMAP, addr, length, unix.PROT_READ|unix.PROT_WRITE,
		unix.MAP_SHARED|unix.MAP_FIXED, fd, off)
	if e != 0 {
		return e
	}
	if _, _, e = syscall.RawSyscall(syscall.SYS_MADVISE, addr, length, unix.MADV_DONTFORK); e != 0 {
		// Back to an inaccessible reservation, as Release leaves it.
		syscall.RawSyscall6(syscall.SYS_MMAP, addr, length, unix.PROT_NONE,
			unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_NORESERVE|unix.MAP_FIXED, ^uintptr(0), 0)
	}
	return e
}

// MapShared maps length bytes of fd from offset 0, shared and read-write, at
// an address the kernel picks. With noreserve, hugetlbfs does not reserve
// pages for the whole length: only the part the file has been allocated for
// may be touched.
func MapShared(fd int, length uintptr, noreserve bool) (uintptr, error) {
	flags := unix.MAP_SHARED
	if noreserve {
		flags |= unix.MAP_NORESERVE
	}
	addr, err := mmap(0, length, unix.PROT_READ|unix.PROT_WRITE, flags, fd, 0)
	if err != nil {
		return 0, fmt.Errorf("vm: map fd %d (0x%x bytes): %w", fd, length, err)
	}
	return addr, nil
}

// MapSharedReadOnly maps length bytes of fd from offset 0, shared and
// read-only, at an address the kernel picks, without reserving hugepages
// (MAP_NORESERVE): tools that only look at a file another process keeps
// growing map its whole reservation this way, take nothing from the
// hugepage pool and cannot write a byte (a store faults).
func MapSharedReadOnly(fd int, length uintptr) (uintptr, error) {
	addr, err := mmap(0, length, unix.PROT_READ, unix.MAP_SHARED|unix.MAP_NORESERVE, fd, 0)
	if err != nil {
		return 0, fmt.Errorf("vm: map fd %d read-only (0x%x bytes): %w", fd, length, err)
	}
	return addr, nil
}

// Release turns [addr, addr+length) back into an inaccessible reservation:
// whatever was mapped there is dropped, and a later touch faults instead of
// reaching memory. The range stays reserved so nothing else is placed there.
//
// If it fails, the range is most likely as it was. Kernels before 6.12
// may first remove what was mapped and then fail: Release then reserves
// the whole range again, without replacing anything, and returns nil if
// it can. If it cannot (the reservation fails, or only part of the range
// was emptied), the error matches ErrHole: part of the range or all of
// it has nothing mapped, and any other mapping of the process may be
// placed there. A mapping another thread places in the hole between the
// two calls is not told from what was there: Release then reports the
// failure without ErrHole.
func Release(addr, length uintptr) error {
	const flags = unix.MAP_PRIVATE | unix.MAP_ANONYMOUS | unix.MAP_NORESERVE
	_, err := fixedMap(addr, length, unix.PROT_NONE, flags|unix.MAP_FIXED, -1, 0)
	if err == nil {
		return nil
	}
	got, perr := fixedMap(addr, length, unix.PROT_NONE, flags|unix.MAP_FIXED_NOREPLACE, -1, 0)
	switch {
	case perr == nil && got == addr:
		return nil // it was a hole, and is a reservation again
	case perr == nil:
		// A kernel before 4.17 takes the address as a hint: something
		// is in the range.
		_ = Unmap(got, length)
		perr = unix.EEXIST
	}
	if unmapped(addr, length) {
		return fmt.Errorf("vm: release [0x%x, 0x%x): %w (%w), and reserving it again: %w",
			addr, addr+length, ErrHole, err, perr)
	}
	return fmt.Errorf("vm: release [0x%x, 0x%x): %w", addr, addr+length, err)
}

// unmapped reports whether part of [addr, addr+length) has nothing
// mapped. msync(2) with MS_ASYNC says so (ENOMEM) having done nothing
// else, and, unlike mincore, allocates nothing to find out: it answers
// under the memory pressure that may have made the release fail.
func unmapped(addr, length uintptr) bool {
	start := addr &^ (PageSize - 1)
	end := (addr + length + PageSize - 1) &^ (PageSize - 1)
	_, _, e := unix.Syscall(unix.SYS_MSYNC, start, end-start, unix.MS_ASYNC)
	return e == unix.ENOMEM
}

// fixedMap is the mmap of Release; a variable for tests, which make it
// fail.
var fixedMap = mmap

// Vacate replaces whatever is mapped at [addr, addr+length) with private
// pages of zeros, readable and writable, that cost nothing until written.
// It is for a range other goroutines may still be reading through
// pointers they took earlier: what was mapped there is gone, and their
// accesses land in zeros of their own instead of faulting. The range is
// not given back until the process exits.
func Vacate(addr, length uintptr) error {
	_, err := mmap(addr, length, unix.PROT_READ|unix.PROT_WRITE,
		unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_NORESERVE|unix.MAP_FIXED, -1, 0)
	if err != nil {
		return fmt.Errorf("vm: vacate [0x%x, 0x%x): %w", addr, addr+length, err)
	}
	return nil
}

// MapFilePopulated is MapFile that also sets up the page tables for the
// whole range at once (MADV_POPULATE_WRITE), as a registration that pins the
// memory would anyway: on tmpfs, where a 2 MiB page is 512 small ones,
// that moves the work from the first registration to the mapping. If the
// populate fails, the range is released (see Release) and the error
// says so if that left a hole (ErrHole).
func MapFilePopulated(addr, length uintptr, fd int, off int64) error {
	return mapFile(addr, length, fd, off, true)
}

// Unmap removes [addr, addr+length) from the address space.
func Unmap(addr, length uintptr) error {
	if _, _, e := unix.Syscall(unix.SYS_MUNMAP, addr, length, 0); e != 0 {
		return fmt.Errorf("vm: unmap [0x%x, 0x%x): %w", addr, addr+length, e)
	}
	return nil
}

// CheckReadable reports whether every page of [addr, addr+length) is mapped
// and readable in this process, faulting pages in as a device driver's page
// walk would. It fails with ErrNotMapped for unmapped or PROT_NONE parts,
// never by crashing. It needs Linux 5.14 (MADV_POPULATE_READ).
func CheckReadable(addr, length uintptr) error {
	start := addr &^ (PageSize - 1)
	end := (addr + length + PageSize - 1) &^ (PageSize - 1)
	populating.RLock()
	_, _, e := unix.Syscall(unix.SYS_MADVISE, start, end-start, unix.MADV_POPULATE_READ)
	populating.RUnlock()
	switch e {
	case 0:
		return nil
	case unix.ENOMEM, unix.EFAULT, unix.EINVAL:
		return fmt.Errorf("%w: [0x%x, 0x%x): %v", ErrNotMapped, addr, addr+length, e)
	default:
		return fmt.Errorf("vm: check [0x%x, 0x%x): %w", addr, addr+length, e)
	}
}

// Prefault has the kernel back the whole pages of s's array (to its
// capacity) now, writable (MADV_POPULATE_WRITE), committing the memory
// as writes to it would: for tables a latency-bound path writes into in
// turn, where the first write to each page would otherwise fault. On a
// virtual machine such a fault, on a page its host has not backed yet
// either, costs tens of microseconds. Pages the kernel reclaims or moves
// later fault again. The pages the array shares with other allocations
// at its ends are left as they are, and so is everything on a kernel
// before 5.14 (which cannot, EINVAL), and whatever a populate that ran
// short of memory (ENOMEM) did not reach: those fault at their first
// write, as without this.
func Prefault[T any](s []T) {
	var elem T
	start := uintptr(unsafe.Pointer(unsafe.SliceData(s)))
	end := start + uintptr(cap(s))*unsafe.Sizeof(elem)
	lo, hi := (start+PageSize-1)&^(PageSize-1), end&^(PageSize-1)
	if lo < hi {
		populating.RLock()
		_, _, _ = unix.Syscall(unix.SYS_MADVISE, lo, hi-lo, unix.MADV_POPULATE_WRITE)
		populating.RUnlock()
	}
	runtime.KeepAlive(s)
}

// Lock pins [addr, addr+length) in memory (mlock). The kernel treats
// hugetlbfs ranges as always resident and leaves them alone.
func Lock(addr, length uintptr) error {
	populating.RLock()
	_, _, e := unix.Syscall(unix.SYS_MLOCK, addr, length, 0)
	populating.RUnlock()
	if e != 0 {
		return fmt.Errorf("vm: mlock [0x%x, 0x%x): %w", addr, addr+length, e)
	}
	return nil
}

// Unlock undoes Lock.
func Unlock(addr, length uintptr) error {
	if _, _, e := unix.Syscall(unix.SYS_MUNLOCK, addr, length, 0); e != 0 {
		return fmt.Errorf("vm: munlock [0x%x, 0x%x): %w", addr, addr+length, e)
	}
	return nil
}

// Bytes returns the mapped range [addr, addr+length) as a byte slice. The
// caller guarantees the range stays mapped while the slice is in use.
func Bytes(addr, length uintptr) []byte {
	return unsafe.Slice((*byte)(Pointer(addr)), length)
}

// Pointer converts the address of memory outside the Go heap (a mapping made
// by this package) into an unsafe.Pointer. The garbage collector ignores such
// pointers, so holding one is safe as long as the mapping stays.
func Pointer(addr uintptr) unsafe.Pointer {
	// Going through memory keeps vet's uintptr-to-pointer check quiet; the
	// conversion is sound because the target is not Go-managed memory.
	return *(*unsafe.Pointer)(unsafe.Pointer(&addr))
}
