//go:build race

package harness

// RaceEnabled reports whether the race detector is on. Its bookkeeping
// grows a process's memory with every goroutine started, so RSS says
// little about leaks then.
const RaceEnabled = true
