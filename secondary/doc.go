// Package secondary is the runtime of a secondary process: it attaches to
// a running primary, maps the control segment and the data memory at the
// primary's addresses, and translates buffer addresses to keys from
// per-queue local caches, asking the primary over IPC for memory regions
// it misses.
//
// # From attach to first lookup
//
// The primary must be running (see package primary). Attach connects to
// it by the instance's prefix, claims a slot in the process table, and maps
// the data memory; from then on the primary keeps this process's mappings
// in step with its allocations and frees:
//
//	s, err := secondary.Attach(secondary.Config{Prefix: "myapp"})
//	if err != nil { ... }                   // ErrNoPrimary, ErrPermission, or an address conflict naming the knob to change
//	defer s.Close()
//
//	pool, err := s.Pool("pkts")             // a mempool the primary created
//	q := s.NewQueue()                       // one per queue, used by one goroutine
//	err = s.RegisterMempool(q, pool)        // register and warm the cache up front
//	key, err := q.Lookup(addr)
//
// Before it trusts anything of the instance, Attach checks that no other
// user could have made or changed it: every directory on the way to the
// runtime directory belongs to this user, root or a user in
// Config.TrustUIDs and is writable by nobody else, and the process
// listening on the socket runs as one of them (as the kernel reports it,
// SO_PEERCRED). Otherwise it fails with ErrPermission, naming what it
// refused and why.
//
// A lookup that misses every cache becomes a create request to the primary.
// If the primary dies, requests fail at once with ErrPrimaryGone (the
// socket's end of file, or the process table, tells within milliseconds)
// while keys already cached keep resolving; PrimaryGone is closed then.
package secondary
