//go:build race

package vm

// raceEnabled: the race detector's shadow memory faults in as the
// program writes, so a count of page faults says little then.
const raceEnabled = true
