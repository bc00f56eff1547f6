package hugetlb

import (
	"sync"
	"time"
)

// FDInfosRead returns how many fdinfo entries the questions about fenced
// processes have read so far.
func FDInfosRead() int64 { return fdInfos.Load() }

// MapsLinesRead returns how many lines of maps files the questions about
// processes have read.
func MapsLinesRead() int64 { return mapsLines.Load() }

// StallDescribingOnce has the next look at the clock of a bounded question
// about a process wait d first, as if this process had been stopped there.
func StallDescribingOnce(d time.Duration) {
	var once sync.Once
	f := func() { once.Do(func() { time.Sleep(d) }) }
	describeLook.Store(&f)
}

// NoDescribingStall undoes StallDescribingOnce.
func NoDescribingStall() { describeLook.Store(nil) }
