//go:build !race

package harness

// RaceEnabled reports whether the race detector is on. Its bookkeeping
// grows a process's memory with every goroutine started, so RSS says
// little about leaks then; its shadow memory faults in as the program
// writes, so a count of page faults says as little.
const RaceEnabled = false
