// Command mpmr is the operator's tool for mpmr instances: it lists the
// instances under a runtime directory, dumps one's shared state, shows its
// live counters, and cleans up after one whose primary died.
//
// It looks without disturbing: it maps the control segment read-only,
// claims no process-table slot, takes no lock (the global cache is read
// optimistically, or as a best-effort snapshot when a writer is in or died
// inside), never maps the data memory, and talks to the primary only to ask
// for its counters, which needs no attach. Only clean changes anything, and
// it refuses while the instance's primary lives.
//
// Usage:
//
//	mpmr [-rundir DIR] [-json] ls
//	mpmr [-rundir DIR] [-json] dump PREFIX
//	mpmr [-rundir DIR] [-json] stats PREFIX
//	mpmr [-rundir DIR] [-json] clean PREFIX
//	mpmr help [COMMAND]
//
// See "mpmr help" for the details.
package main

import "os"

func main() { os.Exit(run(os.Args[1:], os.Stdout, os.Stderr)) }
