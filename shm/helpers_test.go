package shm_test

import (
	"context"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/shm"
)

// The lock tests share one layout: root RootUser points at a block holding
// the lock's offset and two words a writer keeps equal.
type lockFixture struct {
	seg  *shm.Segment
	lock *shm.RWLock
	a, b *uint64
}

const (
	fixLock = 0
	fixA    = 64
	fixB    = 128
)

func newLockFixture(t testing.TB, owner *shm.Segment) *lockFixture {
	t.Helper()
	lockOff, err := owner.NewRWLock()
	require.NoError(t, err)
	data, err := owner.Alloc(192, 64)
	require.NoError(t, err)
	atomic.StoreUint64(shm.At[uint64](owner, data+fixLock), lockOff)
	require.NoError(t, owner.SetRoot(shm.RootUser, data))
	f, err := openFixture(owner)
	require.NoError(t, err)
	return f
}

func openFixture(s *shm.Segment) (*lockFixture, error) {
	data := s.Root(shm.RootUser)
	l, err := s.RWLock(atomic.LoadUint64(shm.At[uint64](s, data+fixLock)))
	if err != nil {
		return nil, err
	}
	return &lockFixture{seg: s, lock: l, a: shm.At[uint64](s, data+fixA), b: shm.At[uint64](s, data+fixB)}, nil
}

func init() {
	testproc.Register("attach", helperAttach)
	testproc.Register("rlock-hold", helperRLockHold)
	testproc.Register("rlock-stall", helperRLockStall)
	testproc.Register("wlock-hold", helperWLockHold)
	testproc.Register("reader", helperReader)
	testproc.Register("writer", helperWriter)
	testproc.Register("flood", helperFlood)
}

func helperSegment(path string) (*shm.Segment, *lockFixture) {
	s, err := shm.Attach(opts(path))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(3)
	}
	f, _ := openFixture(s) // absent for tests without a lock
	return s, f
}

func waitForEOF() {
	in := testproc.Commands()
	for in.Scan() {
	}
}

// helperAttach claims a slot and reports it; "exec" then replaces the
// program with sleep(1): same pid, but the slot's lock is gone (the lock
// file is close-on-exec), which is what pid reuse looks like to the table.
func helperAttach(args []string) int {
	s, _ := helperSegment(args[0])
	testproc.Say("slot %d", s.Slot())
	in := testproc.Commands()
	for in.Scan() {
		switch in.Text() {
		case "exec":
			err := syscall.Exec("/bin/sleep", []string{"sleep", "600"}, nil)
			fmt.Fprintln(os.Stderr, err)
			return 4
		case "close":
			s.Close()
			testproc.Say("closed")
		}
	}
	return 0
}

func helperRLockHold(args []string) int {
	_, f := helperSegment(args[0])
	if _, err := f.lock.RLock(context.Background()); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 3
	}
	testproc.Say("held")
	waitForEOF()
	return 0
}

// helperRLockStall takes a read hold and reports it; it is meant to be
// stopped (SIGSTOP) while it holds. On "release" it gives the hold back and
// says what RUnlock returned; on "again" it takes and drops a fresh hold.
func helperRLockStall(args []string) int {
	_, f := helperSegment(args[0])
	h, err := f.lock.RLock(context.Background())
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 3
	}
	testproc.Say("held")
	in := testproc.Commands()
	for in.Scan() {
		switch in.Text() {
		case "release":
			testproc.Say("released %v", f.lock.RUnlock(h))
		case "again":
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			h, err := f.lock.RLock(ctx)
			cancel()
			if err == nil {
				err = f.lock.RUnlock(h)
			}
			testproc.Say("again %v", err)
		}
	}
	return 0
}

// helperWLockHold dies (when killed) in the middle of an update: a was
// written, b was not. An optional second argument sets how long it waits
// for readers before fencing them.
func helperWLockHold(args []string) int {
	_, f := helperSegment(args[0])
	if len(args) > 1 {
		d, err := time.ParseDuration(args[1])
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 2
		}
		f.lock.SetFenceAfter(d)
	}
	if err := f.lock.Lock(context.Background()); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 3
	}
	atomic.AddUint64(f.a, 1)
	testproc.Say("held")
	waitForEOF()
	return 0
}

// helperReader checks under the read lock that a == b until told to stop,
// then reports how many reads it made and how many saw a torn update.
func helperReader(args []string) int {
	_, f := helperSegment(args[0])
	goroutines, _ := strconv.Atoi(args[1])
	var stop atomic.Bool
	var reads, torn atomic.Int64
	var wg sync.WaitGroup
	for range goroutines {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for !stop.Load() {
				h, err := f.lock.RLock(context.Background())
				if err != nil {
					fmt.Fprintln(os.Stderr, err)
					os.Exit(3)
				}
				differ := atomic.LoadUint64(f.a) != atomic.LoadUint64(f.b)
				if f.lock.RUnlock(h) != nil {
					continue // fenced: what was read does not count
				}
				if differ {
					torn.Add(1)
				}
				reads.Add(1)
			}
		}()
	}
	testproc.Say("ready")
	waitForEOF()
	stop.Store(true)
	wg.Wait()
	testproc.Say("done %d %d", reads.Load(), torn.Load())
	return 0
}

// helperWriter makes n updates of a and b under the write lock.
func helperWriter(args []string) int {
	_, f := helperSegment(args[0])
	n, _ := strconv.Atoi(args[1])
	testproc.Say("ready")
	for range n {
		if err := f.lock.Lock(context.Background()); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 3
		}
		atomic.AddUint64(f.a, 1)
		runtime.Gosched()
		atomic.AddUint64(f.b, 1)
		f.lock.Unlock()
	}
	testproc.Say("done")
	return 0
}

// helperFlood keeps read holds overlapping from many goroutines so that the
// lock is never free of readers, until stdin closes.
func helperFlood(args []string) int {
	_, f := helperSegment(args[0])
	var stop atomic.Bool
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for !stop.Load() {
				h, err := f.lock.RLock(context.Background())
				if err != nil {
					fmt.Fprintln(os.Stderr, err)
					os.Exit(3)
				}
				time.Sleep(50 * time.Microsecond) // a read section with some length
				_ = f.lock.RUnlock(h)
			}
		}()
	}
	testproc.Say("ready")
	waitForEOF()
	stop.Store(true)
	wg.Wait()
	return 0
}
