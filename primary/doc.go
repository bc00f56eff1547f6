// Package primary is the runtime of an instance's primary process: the one
// that owns the hugepage data memory, the shared control segment, the device
// and the global MR cache, and serves the secondaries.
//
// # From start to first lookup
//
// Start takes the instance's primary lock (one primary per prefix), cleans
// up what a dead predecessor left behind, picks a backend (hugetlbfs when a
// mount with free hugepages exists, else tmpfs under /dev/shm — Backend
// says which and why), and starts listening for secondaries:
//
//	p, err := primary.Start(primary.Config{Prefix: "myapp"})
//	if err != nil { ... }
//	defer p.Close()
//
// Data memory comes in whole pages mapped at the same address in every
// process, so a buffer's address means the same thing everywhere:
//
//	r, err := p.Alloc(64 << 20)            // every secondary maps it before Alloc returns
//	pool, err := p.CreatePool("pkts", 2048, 8192)
//
// Each queue of the datapath gets its own local cache. A lookup answers
// from the queue's top half (a hit takes no lock and allocates nothing),
// then its bottom-half table, then the global table; the first lookup of
// an address registers the contiguous memory around it:
//
//	q := p.NewQueue()
//	key, err := q.Lookup(addr)             // host byte order; verbs.KeyToBE for descriptors
//
// Free invalidates before it returns: no lookup that starts afterwards, in
// any process, gets a key for the freed memory, and every secondary has
// unmapped it.
//
// Secondaries attach with secondary.Attach and the same Prefix. Stats and
// Dump describe the instance; the mpmr command shows the same from outside.
package primary
