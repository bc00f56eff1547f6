package cache

import (
	"errors"
	"fmt"
	"runtime"
	"sync/atomic"
	"time"

	"github.com/mpmr/mpmr/shm"
)

// Peek is the global cache's state as PeekGlobal read it. It is a plain
// value.
type Peek struct {
	Dump
	// Lock is the global lock as it was found.
	Lock shm.LockState `json:"lock"`
	// Consistent reports that no writer held the lock while the state was
	// read, so the lists and the table agree with each other. When false
	// (a writer stayed in longer than the patience allowed, or died inside
	// and left the lock abandoned), every figure is still a value that was
	// in the segment, but the whole may be torn.
	Consistent bool `json:"consistent"`
}

// errTorn ends a walk whose optimistic read a writer interrupted.
var errTorn = errors.New("cache: a writer interrupted the read")

// PeekGlobal reads the global cache's state in seg — the MR list with its
// chunks, the free list, the table, dev_gen, the counters and the lock —
// without taking the lock and without a process-table slot, so that tools
// can look at a live instance without slowing it down, and at a dead one
// whose primary died holding the lock. It writes nothing: a read-only
// segment (shm.OpenReadOnly) will do.
//
// It reads optimistically, retrying while writers get in the way, for up to
// patience; after that, or at once if the lock is abandoned (its writer
// died), it settles for a best-effort read and says so in
// Peek.Consistent. Whatever it reads is bounds-checked against the
// segment, so a torn or corrupt state gives odd figures or ErrCorrupt,
// never a crash.
func PeekGlobal(seg *shm.Segment, patience time.Duration) (Peek, error) {
	rootOff := seg.Root(shm.RootCache)
	if rootOff == 0 {
		return Peek{}, fmt.Errorf("cache: peek: %w: the segment has no global cache", ErrCorrupt)
	}
	if err := seg.CheckRange(rootOff, globalRootSize); err != nil {
		return Peek{}, fmt.Errorf("cache: peek: %w: global root: %v", ErrCorrupt, err)
	}
	root := shm.At[globalRoot](seg, rootOff)
	view, err := seg.ViewLock(atomic.LoadUint64(&root.Lock))
	if err != nil {
		return Peek{}, fmt.Errorf("cache: peek: global lock: %w", err)
	}
	g := &Global{seg: seg, rootOff: rootOff, root: root, devGen: &root.DevGen}
	deadline := time.Now().Add(patience)
	for try := 0; ; try++ {
		stamp, ok := view.Optimistic()
		if ok {
			d, err := g.peek(func() bool { return view.Validate(stamp) })
			if view.Validate(stamp) {
				return Peek{Dump: d, Lock: view.State(), Consistent: true}, err
			}
		}
		if view.Abandoned() || time.Now().After(deadline) {
			break
		}
		if try < 16 {
			runtime.Gosched()
		} else {
			time.Sleep(min(time.Duration(try)*10*time.Microsecond, time.Millisecond))
		}
	}
	d, err := g.peek(nil)
	return Peek{Dump: d, Lock: view.State()}, err
}

// peek reads the state once. valid, if not nil, is asked now and then
// during long walks; once it says no, the read stops with errTorn.
func (g *Global) peek(valid func() bool) (Dump, error) {
	// Empty lists, not missing ones, for the JSON of operators' tools.
	d := Dump{DevGen: atomic.LoadUint32(g.devGen), Stats: g.Stats(), MRs: []MRInfo{}, FreeMRs: []MRInfo{}, Table: []Entry{}}
	// Every record is an arena block of its own, so a list longer than
	// the arena has blocks runs in a circle.
	limit := g.seg.ArenaStats().Blocks
	walk := func(head uint64, dst *[]MRInfo) error {
		var n uint64
		var torn, circle bool
		err := g.eachMR(head, func(m mr) bool {
			n++
			switch {
			case n%64 == 0 && valid != nil && !valid():
				torn = true
			case n > limit:
				circle = true
			default:
				*dst = append(*dst, m.info())
				return true
			}
			return false
		})
		switch {
		case torn:
			return errTorn
		case circle:
			return fmt.Errorf("%w: list longer than the arena's %d blocks", ErrCorrupt, limit)
		}
		return err
	}
	if err := walk(atomic.LoadUint64(&g.root.MRList), &d.MRs); err != nil {
		return d, fmt.Errorf("cache: peek: MR list: %w", err)
	}
	if err := walk(atomic.LoadUint64(&g.root.FreeList), &d.FreeMRs); err != nil {
		return d, fmt.Errorf("cache: peek: free list: %w", err)
	}
	t, err := openSegmentTable(g.seg, g.rootOff+tableHeaderOff)
	if err != nil {
		return d, fmt.Errorf("cache: peek: %w", err)
	}
	// The length may be torn from a newer, larger array: stay in this one.
	n := min(t.Len(), len(t.ents))
	d.Table = make([]Entry, 0, max(n-1, 0))
	for i := 1; i < n; i++ {
		d.Table = append(d.Table, t.At(i))
	}
	d.TableSize, d.Overflowed = t.Size(), t.Overflowed()
	return d, nil
}
