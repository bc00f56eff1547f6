//go:build race

package cache

// raceEnabled: the race detector slows the tests that spin readers
// against a writer by an order of magnitude; they run fewer rounds.
const raceEnabled = true
