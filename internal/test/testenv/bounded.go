package testenv

import (
	"testing"
	"time"
)

// Bounded runs fn on a goroutine and returns how long it took and its
// error; it fails the test if fn has not returned within limit. The limit
// catches a wait that is no longer bounded, a hang: how long waits take is
// for the benchmarks to measure.
func Bounded(t *testing.T, what string, limit time.Duration, fn func() error) (time.Duration, error) {
	t.Helper()
	done := make(chan error, 1)
	start := time.Now()
	go func() { done <- fn() }()
	select {
	case err := <-done:
		return time.Since(start), err
	case <-time.After(limit):
		t.Fatalf("%s did not return within %v", what, limit)
		return 0, nil
	}
}

// Receive receives from ch, failing the test if nothing comes within
// limit.
func Receive[T any](tb testing.TB, ch <-chan T, limit time.Duration, what string) T {
	tb.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(limit):
		tb.Fatalf("no %s within %v", what, limit)
		panic("unreachable")
	}
}
