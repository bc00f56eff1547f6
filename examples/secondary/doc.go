// Command secondary attaches to a running primary (examples/primary, or
// any program that started a primary.Primary with a mempool named "pkts")
// and runs the datapath workload: queues that look up the key of every
// buffer and hand the buffers to the soft device's loopback copy.
//
//	go run ./examples/primary -secondaries 0 -duration 1h &   # a primary alone
//	go run ./examples/secondary -duration 5s
//
// It prints a progress line each second and a summary at the end, and
// exits with status 1 on any validation failure.
package main
