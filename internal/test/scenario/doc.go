// Package scenario holds the multi-process scenarios (tests only):
// invalidation across processes, secondaries and primaries killed at random
// points, abuse of the socket and the segment, and the soak. Each is an
// ordinary test, short by default; -mpmr.long (or MPMR_LONG=1) makes them
// longer and runs the soak, -mpmr.soak=DURATION (or MPMR_SOAK=DURATION)
// runs the soak for that long. The benchmarks measure recovery times. See
// internal/test/harness for how the processes are run and checked.
package scenario
