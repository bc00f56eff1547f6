//go:build !race

package vm

// raceEnabled: see race_on_test.go.
const raceEnabled = false
