// Command primary runs the main job: a primary process that sets up
// shared data memory and a mempool of packet buffers, launches secondary
// processes (this same program in the secondary role) whose queues look up
// the key of every buffer on their datapath and hand the buffers to the
// soft device's loopback copy, churns memory to exercise invalidation, and
// prints a summary per process.
//
//	go run ./examples/primary                 # 2 secondaries, 4 queues each, 3 s
//	go run ./examples/primary -duration 10s -secondaries 3 -backend hugetlbfs
//
// It exits with status 1 if any secondary failed or any validation failed.
package main
