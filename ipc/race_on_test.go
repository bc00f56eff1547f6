//go:build race

package ipc_test

// raceEnabled: under the race detector sync.Pool drops what it is given
// at random, so allocation counts mean nothing.
const raceEnabled = true
