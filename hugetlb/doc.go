// Package hugetlb finds hugepage memory and manages the shared data memory
// that applications put their buffers in.
//
// # Discovery
//
// Discovery reads /proc/mounts for hugetlbfs mounts and
// /sys/kernel/mm/hugepages for the page pools, and Choose picks a backend:
// hugetlbfs when a writable mount of the wanted page size has enough free
// pages, else tmpfs under /dev/shm with the same page granularity. A caller
// can force either; the chosen Backend says which and why.
//
// # Data memory
//
// A Memory is a set of memseg lists, as in DPDK. Each list is a range of
// virtual addresses, reserved with no access in every process of an
// instance at the same address (MR table entries are virtual addresses),
// and one backing file in the backend's directory.
// Page i of a list lives at base + i*pagesize and at offset i*pagesize of
// the file.
//
// The primary (Create) allocates runs of pages: it allocates the file's
// blocks (fallocate, so a missing hugepage fails the allocation instead of
// killing the process with SIGBUS later), maps them MAP_SHARED|MAP_FIXED
// over the reservation, and records them in the list's page bitmap in the
// control segment. Freeing reverses it: the range becomes an inaccessible
// reservation again and the blocks are punched out of the file, so on
// hugetlbfs the hugepages return to the kernel's pool.
//
// Subscribers hear of allocations after the pages are mapped and of frees
// before anything is unmapped. Before them, guards (GuardFree) may refuse a
// free: the MR cache invalidates its registrations there, as the DPDK
// drivers do on the free event, and refuses the free if it cannot — then
// Free returns ErrNotFreed and nothing changed. A free either completes or
// changes nothing — but for one that completes having lost its pages to
// a failed unmap (ErrHole; see Memory.Free).
//
// # Quarantine
//
// A freed page goes back to the allocator and the kernel only once no live
// process can reach it. While a process the primary fenced (see shm: a
// secondary that stopped following memory changes) lives and may still map
// data memory, freed pages are unmapped in the primary and marked free in
// the descriptors, but neither punched nor reallocated: they wait in
// quarantine until every such process has died or unmapped its memory
// (ReleaseQuarantine; Alloc first takes back the pages whose holders are
// gone by the fences' records, asking the kernel nothing, and Housekeep
// asks it). Punching them would let the
// stalled process, once resumed, fault a fresh page into the file that the
// next Alloc would then share with it. Every page freed during the fence is
// held, not only those the process mapped, since a process that stopped
// listening cannot be trusted about what it maps; the cost is memory held
// for as long as the stall lasts, which Lists (Quarantined) and Alloc's
// errors report. Lost pages (ErrHole) are the exception: never allocated
// again, they are punched at once; a fenced process that writes one
// afterwards makes the file hold that block until the instance ends.
//
// A secondary (Attach) reads the descriptors, reserves each list at the
// same address with MAP_FIXED_NOREPLACE (failing with ErrAddressInUse if
// anything is there) and maps the allocated pages, from the backing files
// the primary handed it (AttachOptions.Files; BackingFiles in the
// primary) rather than from the paths in the descriptors, which any
// process of the primary's user may have rewritten. It then follows the
// primary through MapPages and UnmapPages, which the IPC layer calls so that
// the primary's Alloc and Free return only after every secondary followed;
// Resync rebuilds a secondary's mappings from the descriptors. A secondary
// that touches freed memory faults instead of reaching a new page.
//
// On the tmpfs backend everything behaves the same with the configured page
// size; only physical contiguity and TLB reach differ.
package hugetlb
