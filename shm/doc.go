// Package shm owns the shared control segment: one file on hugetlbfs (or
// tmpfs as a fallback) that the primary creates and every other process of
// an instance maps. It holds no pointers, only offsets and indexes, so each
// process may map it at a different address.
//
// The segment is laid out as
//
//	[0, 4096)            header: magic, ABI version, layout hash, sizes,
//	                     creator pid and start time, state, arena state,
//	                     registered locks, named roots
//	[4096, ...)          process table: one 64-byte slot per attached process
//	[arena, size)        an offset-based arena the owner carves blocks from
//	[size, maxSize)      reserved address space the segment grows into
//
// Every process maps the whole reservation up front (MAP_NORESERVE), so
// growing the segment only extends the file: nothing that is mapped moves.
// Cross-process words are only ever touched through sync/atomic.
//
// The creator writes the header last and marks the segment ready after the
// layers above have built their state; an attacher validates the header
// before it trusts any other byte, and each mismatch has its own sentinel
// error.
//
// The process table tells live processes from dead ones with open file
// description locks: each attached process holds an exclusive OFD lock on
// the byte of a lock file that matches its slot for as long as it lives. The
// kernel drops the lock when the process dies, so a reused pid cannot make a
// dead slot look alive.
//
// RWLock is a robust, writer-preferring reader-writer lock for the segment,
// built on shared futexes, that survives the death of any holder and the
// stall of any reader; see its documentation.
//
// # Stalled processes
//
// A process can be alive and still never answer: stopped by a signal, held
// in a debugger, descheduled for long. Waiting for it is not an option (it
// would stop everyone), and neither is treating it as dead (it may resume
// and act on what it held). The segment's answer is fencing, in two forms:
//
//   - A writer waits for a live reader at most FenceAfter, then discards its
//     read holds and goes ahead. Read holds are therefore leases, not
//     locks: RUnlock tells a fenced reader (ErrFenced) that what it read may
//     be torn, and read sections are written like optimistic reads — atomic
//     loads, bounds-checked offsets, nothing acted on before RUnlock
//     succeeds. No reader can hold up a writer for longer than that, and
//     none can act on a state a writer changed under it.
//   - The primary can fence a process's claim of its slot (Fence), for a
//     secondary that stopped following memory changes. The process learns
//     it from Fenced when it resumes, and says when it has let go of the
//     data memory (MarkUnmapped); the data-memory layer keeps what the
//     primary frees meanwhile in quarantine (see hugetlb). The owner keeps
//     its own record of what it fenced (Holders), naming each process by
//     pid and start time, so that no word of the table can end a fence.
//   - Any process mapping the segment can write it. The owner keeps the
//     arena's bounds and free list in its own memory and writes the
//     segment's copy only for those who look; the process table is placed
//     once; everyone else bounds its accesses by the file, not by the
//     header's Size.
//
// Owners are named for good: every claim of a slot bumps its epoch, lock
// owner words carry it, and AliveAs checks it, so a later claimant of a slot
// never makes a dead one look alive.
//
// Tools that must not disturb an instance, live or dead, open its segment
// with OpenReadOnly: a read-only mapping that claims no slot. They look at
// locks through a LockView, which never takes part in locking.
package shm
