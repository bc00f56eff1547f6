package shm_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/internal/test/testproc"
)

// Compare with C measured in the same run: an rte_rwlock-style read lock
// (one atomic add to lock, one to unlock) and glibc's process-shared
// pthread_rwlock.
func BenchmarkRLockUnlock(b *testing.B) {
	owner, _ := newSegment(b, testenv.Tmpfs(b))
	f := newLockFixture(b, owner)
	ctx := context.Background()
	b.ReportAllocs()
	for b.Loop() {
		h, err := f.lock.RLock(ctx)
		if err != nil {
			b.Fatal(err)
		}
		_ = f.lock.RUnlock(h)
	}
}

// An optimistic read section: no write to shared memory at all.
func BenchmarkOptimisticRead(b *testing.B) {
	owner, _ := newSegment(b, testenv.Tmpfs(b))
	f := newLockFixture(b, owner)
	b.ReportAllocs()
	var sum uint64
	for b.Loop() {
		stamp, ok := f.lock.Optimistic()
		v := atomic.LoadUint64(f.a)
		if !ok || !f.lock.Validate(stamp) {
			b.Fatal("no writer runs, yet validation failed")
		}
		sum += v
	}
	_ = sum
}

func BenchmarkLockUnlock(b *testing.B) {
	owner, _ := newSegment(b, testenv.Tmpfs(b))
	f := newLockFixture(b, owner)
	ctx := context.Background()
	b.ReportAllocs()
	for b.Loop() {
		if err := f.lock.Lock(ctx); err != nil {
			b.Fatal(err)
		}
		f.lock.Unlock()
	}
}

// Readers in two processes at once: this process runs the benchmark loop, a
// helper process reads flat out. With an occasional writer (every
// millisecond), both sides also pay for the writer's drains.
func BenchmarkRLockTwoProcesses(b *testing.B) {
	for _, writer := range []bool{false, true} {
		b.Run(fmt.Sprintf("writer=%v", writer), func(b *testing.B) {
			owner, o := newSegment(b, testenv.Tmpfs(b))
			f := newLockFixture(b, owner)
			peer := testproc.Start(b, "reader", []string{o.Path, "1"})
			peer.Expect("ready", 0)
			stop := make(chan struct{})
			done := make(chan struct{})
			go func() {
				defer close(done)
				if !writer {
					return
				}
				tick := time.NewTicker(time.Millisecond)
				defer tick.Stop()
				for {
					select {
					case <-stop:
						return
					case <-tick.C:
						if f.lock.Lock(context.Background()) == nil {
							atomic.AddUint64(f.a, 1)
							atomic.AddUint64(f.b, 1)
							f.lock.Unlock()
						}
					}
				}
			}()
			ctx := context.Background()
			b.ReportAllocs()
			start := time.Now()
			for b.Loop() {
				h, err := f.lock.RLock(ctx)
				if err != nil {
					b.Fatal(err)
				}
				_ = f.lock.RUnlock(h)
			}
			elapsed := time.Since(start)
			close(stop)
			<-done
			peer.CloseInput()
			var reads, torn int64
			if _, err := fmt.Sscanf(peer.Expect("done", 0), "done %d %d", &reads, &torn); err != nil {
				b.Fatal(err)
			}
			if torn != 0 {
				b.Fatalf("peer saw %d torn updates", torn)
			}
			b.ReportMetric(float64(b.N)/elapsed.Seconds(), "reads/s-this")
			b.ReportMetric(float64(reads)/elapsed.Seconds(), "reads/s-peer")
		})
	}
}

// How long after a reader's death a waiting writer gets the lock (target:
// 100 ms).
func BenchmarkRecoverFromDeadReader(b *testing.B) {
	owner, o := newSegment(b, testenv.Tmpfs(b))
	f := newLockFixture(b, owner)
	var total time.Duration
	for range b.N {
		h := testproc.Start(b, "rlock-hold", []string{o.Path})
		h.Expect("held", 0)
		got := make(chan error, 1)
		go func() { got <- f.lock.Lock(context.Background()) }()
		for f.lock.State().WriterSlot != owner.Slot() {
			time.Sleep(100 * time.Microsecond)
		}
		h.Kill()
		_ = h.Wait(0)
		died := time.Now()
		if err := <-got; err != nil {
			b.Fatal(err)
		}
		total += time.Since(died)
		f.lock.Unlock()
	}
	b.ReportMetric(float64(total.Microseconds())/float64(b.N)/1000, "ms/recovery")
}
