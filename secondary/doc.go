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
//
// # Sharing CPUs with the runtime
//
// A create waits for its answer on its own thread, blocked in the kernel
// (see package ipc: the answer wakes that thread and nothing else), and
// the Go runtime lets another thread take its P while it waits only once
// it notices, after 20 µs to 10 ms. When the answer comes, the goroutine
// needs a P again: if every P is busy with queues that never block or
// yield, it waits until the runtime preempts one of them (after 10 ms of
// running at the soonest), and the create's round trip grows from tens of
// microseconds to milliseconds. Leave the runtime a P (GOMAXPROCS above the number of
// queues that poll without blocking), and have polling queues call Yield
// between bursts. The same holds across processes: the primary's thread
// that answers a miss, woken on a CPU that another process's queue keeps
// busy, may wait for that queue's time slice in the kernel (milliseconds)
// unless the queue yields the CPU; Yield does both (runtime.Gosched, then
// sched_yield(2)). Config.Spin trades a CPU for the wake-up, and pays only
// when that CPU is spare.
package secondary
