// Package cache translates buffer addresses into memory-region keys the way
// DPDK's mlx4/mlx5 drivers do, shared between a primary process and its
// secondaries.
//
// Three levels answer a lookup:
//
//   - Local, one per queue and used by one goroutine at a time: an 8-entry
//     top half (most-recently-used entry first, round-robin victim) and a
//     bottom-half Table that starts at 256 entries and doubles. A hit takes
//     no lock and allocates nothing.
//   - Global, in the shared control segment: the list of MRs, the list of
//     MRs waiting to be deregistered, a Table of every registered chunk, the
//     robust reader-writer lock guarding them, and the generation counter
//     dev_gen that tells local caches to flush.
//   - The role's create path: the primary registers the memory around the
//     address itself; a secondary asks the primary over IPC. The cache sees
//     only the Creator interface.
//
// A Table is DPDK's sorted array of chunks with an index of address buckets
// in front of it (see index.go), so that a lookup costs about the same at
// 32,768 entries as at 256. Beyond Lookup, a Local answers a burst of
// addresses with one generation check (LookupBurst) and a whole buffer
// only if one MR holds it, saying otherwise where to split it
// (LookupRange, SplitError).
//
// The primary keeps the global state in step with the data memory: on a
// free event it clears the freed pages from every MR, moves MRs that became
// empty to the free list, bumps dev_gen and rebuilds the table, all under
// the write lock, in that order — so once the memory's Free returns, no
// lookup that starts afterwards, in any process, returns a key for it.
//
// Keys are stored and returned in host byte order; see verbs.KeyToBE for
// the big-endian form hardware descriptors use.
package cache
