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
// built on shared futexes, that survives the death of any holder; see its
// documentation.
//
// Tools that must not disturb an instance, live or dead, open its segment
// with OpenReadOnly: a read-only mapping that claims no slot. They look at
// locks through a LockView, which never takes part in locking.
package shm
