//go:build !race

package ipc_test

const raceEnabled = false
