package testenv

import (
	"os"
	"runtime"
)

// OpenFDs counts this process's open descriptors (not the one that
// reads them).
func OpenFDs() int {
	ents, _ := os.ReadDir("/proc/self/fd")
	return len(ents) - 1
}

// PeakFDs samples this process's open descriptors until stop is closed,
// then sends the most it saw.
func PeakFDs(stop <-chan struct{}) <-chan int {
	out := make(chan int, 1)
	go func() {
		peak := 0
		for {
			peak = max(peak, OpenFDs())
			select {
			case <-stop:
				out <- peak
				return
			default:
				runtime.Gosched()
			}
		}
	}()
	return out
}
