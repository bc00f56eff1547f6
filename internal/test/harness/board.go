package harness

import (
	"errors"
	"fmt"
	"runtime"
	"sync/atomic"
	"time"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/primary"
	"github.com/mpmr/mpmr/shm"
)

// The board is how a scenario's primary tells secondaries, across
// processes, which region of data memory is live and which have been
// freed, so that a lookup in a secondary can be judged against the
// primary's Free calls. It lives in the control segment (the primary
// allocates it from the arena and names it in root BoardRoot), so it goes
// away with the instance and needs no file of its own.
//
// The primary runs rounds: allocate a region, register it, publish the
// round's region and key (Pub), let the secondaries look it up, then free
// it, counting the round in Freeing before Free is called and in Freed
// once it has returned. A secondary reads Freed before each lookup; every
// round below that number was freed before the lookup started, so the key
// the lookup returns must belong to a later round. Keys map back to their
// round through the ring of published rounds.

// BoardRoot is the segment root the board is published under.
const BoardRoot = shm.RootUser + 1

const (
	boardMagic = 0x4452414f42524d50 // "PMRBOARD"
	maxWorkers = 64                 // lookup counters, one per queue
	ringSize   = 1024               // published rounds kept for key look-ups

	boardHeadSize  = 64
	workerLineSize = 64
	roundRecSize   = 32
	boardSize      = boardHeadSize + maxWorkers*workerLineSize + ringSize*roundRecSize
)

// boardHead is the board's first cache line. Written by the primary only,
// but for Failures.
//
//	off size field
//	  0   8  Magic    boardMagic once the board is laid out
//	  8   8  Pub      rounds whose region and key are published
//	 16   8  Freeing  rounds whose Free has been called
//	 24   8  Freed    rounds whose Free has returned
//	 32   8  Stop     nonzero: workloads end
//	 40   8  Failures failed checks, added to by the secondaries
//	 48  16  reserved
type boardHead struct {
	Magic    uint64
	Pub      uint64
	Freeing  uint64
	Freed    uint64
	Stop     uint64
	Failures uint64
	_        [16]byte
}

// workerLine counts one queue's lookups, alone on its cache line. Written
// by that queue's goroutine only.
//
//	off size field
//	  0   8  Lookups
//	  8  56  reserved
type workerLine struct {
	Lookups uint64
	_       [56]byte
}

// roundRec is one published round, at index round % ringSize. Written by
// the primary only, Tag last.
//
//	off size field
//	  0   8  Tag   round + 1 once the record is complete (0: never used)
//	  8   8  Addr  region
//	 16   8  Len
//	 24   4  Key   key of the MR the primary registered for the region
//	 28   4  reserved
type roundRec struct {
	Tag  uint64
	Addr uint64
	Len  uint64
	Key  uint32
	_    uint32
}

// board is the whole shared structure.
//
//	off   size                 field
//	   0    64                 head
//	  64    64*maxWorkers      Workers
//	4160    32*ringSize        Rounds
type board struct {
	Head    boardHead
	Workers [maxWorkers]workerLine
	Rounds  [ringSize]roundRec
}

// Round is a published round as a secondary reads it.
type Round struct {
	N    uint64
	Addr uint64
	Len  uint64
	Key  uint32
}

// Board is the primary's handle on the board. Its methods that change the
// board are for one goroutine at a time (the one running the rounds);
// Lookups and the counters may be read from any goroutine.
type Board struct {
	p      *primary.Primary
	b      *board
	rounds uint64
}

// NewBoard lays out a board in p's segment and publishes it.
func NewBoard(p *primary.Primary) (*Board, error) {
	seg := p.Segment()
	off, err := seg.Alloc(boardSize, 64)
	if err != nil {
		return nil, fmt.Errorf("harness: board: %w", err)
	}
	b := shm.At[board](seg, off)
	atomic.StoreUint64(&b.Head.Magic, boardMagic)
	if err := seg.SetRoot(BoardRoot, off); err != nil {
		return nil, fmt.Errorf("harness: board: %w", err)
	}
	return &Board{p: p, b: b}, nil
}

// RoundOptions shape one round.
type RoundOptions struct {
	// Pages to allocate.
	Pages int
	// While runs between publication and Free: the secondaries look the
	// region up meanwhile. It returns an error to abandon the round (the
	// region is freed all the same).
	While func() error
}

// Round allocates a region, registers it, publishes it, runs o.While and
// frees the region, counting the free on the board before Free is called
// and after it returns. It returns the round's region and key.
func (bd *Board) Round(o RoundOptions) (Round, error) {
	p := bd.p
	r, err := p.Alloc(uint64(o.Pages) * p.Backend().PageSize)
	if err != nil {
		return Round{}, fmt.Errorf("round %d: %w", bd.rounds, err)
	}
	e, err := p.Global().Create(uint64(r.Addr))
	if err != nil {
		_ = p.Free(r)
		return Round{}, fmt.Errorf("round %d: create: %w", bd.rounds, err)
	}
	n := bd.rounds
	bd.publish(n, r, e.LKey)
	var werr error
	if o.While != nil {
		werr = o.While()
	}
	atomic.StoreUint64(&bd.b.Head.Freeing, n+1)
	ferr := p.Free(r)
	atomic.StoreUint64(&bd.b.Head.Freed, n+1)
	bd.rounds++
	if err := errors.Join(werr, ferr); err != nil {
		return Round{}, fmt.Errorf("round %d: %w", n, err)
	}
	return Round{N: n, Addr: uint64(r.Addr), Len: r.Len, Key: e.LKey}, nil
}

func (bd *Board) publish(n uint64, r hugetlb.Region, key uint32) {
	rec := &bd.b.Rounds[n%ringSize]
	atomic.StoreUint64(&rec.Tag, 0)
	atomic.StoreUint64(&rec.Addr, uint64(r.Addr))
	atomic.StoreUint64(&rec.Len, r.Len)
	atomic.StoreUint32(&rec.Key, key)
	atomic.StoreUint64(&rec.Tag, n+1)
	atomic.StoreUint64(&bd.b.Head.Pub, n+1)
}

// Rounds returns how many rounds have completed.
func (bd *Board) Rounds() uint64 { return bd.rounds }

// Lookups returns the lookups that found a key of a published region, as
// every queue has counted them so far.
func (bd *Board) Lookups() uint64 {
	var n uint64
	for i := range bd.b.Workers {
		n += atomic.LoadUint64(&bd.b.Workers[i].Lookups)
	}
	return n
}

// ErrCheckFailed means a secondary's check failed: the workloads' results
// say how.
var ErrCheckFailed = errors.New("harness: a secondary's check failed")

// Failures returns how many checks have failed so far.
func (bd *Board) Failures() uint64 { return atomic.LoadUint64(&bd.b.Head.Failures) }

// WaitLookups waits until the queues have counted n more lookups than
// now. It fails if timeout passes first (the secondaries stalled) or as
// soon as a check fails (ErrCheckFailed), so that a broken run ends fast.
func (bd *Board) WaitLookups(n uint64, timeout time.Duration) error {
	target := bd.Lookups() + n
	deadline := time.Now().Add(timeout)
	for bd.Lookups() < target {
		if f := bd.Failures(); f != 0 {
			return fmt.Errorf("%w (%d so far)", ErrCheckFailed, f)
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("harness: %d lookups expected within %v, %d came", n, timeout, n-(target-bd.Lookups()))
		}
		runtime.Gosched()
	}
	return nil
}

// Stop tells the workloads to end.
func (bd *Board) Stop() { atomic.StoreUint64(&bd.b.Head.Stop, 1) }

// boardView is a secondary's view of the board.
type boardView struct{ b *board }

// openBoard finds the board in seg, or returns nil if the primary made
// none.
func openBoard(seg *shm.Segment) (*boardView, error) {
	off := seg.Root(BoardRoot)
	if off == 0 {
		return nil, nil
	}
	if err := seg.CheckRange(off, boardSize); err != nil {
		return nil, fmt.Errorf("harness: board: %w", err)
	}
	b := shm.At[board](seg, off)
	if atomic.LoadUint64(&b.Head.Magic) != boardMagic {
		return nil, errors.New("harness: board: bad magic")
	}
	return &boardView{b: b}, nil
}

func (v *boardView) pub() uint64     { return atomic.LoadUint64(&v.b.Head.Pub) }
func (v *boardView) freeing() uint64 { return atomic.LoadUint64(&v.b.Head.Freeing) }
func (v *boardView) freed() uint64   { return atomic.LoadUint64(&v.b.Head.Freed) }
func (v *boardView) stopped() bool   { return atomic.LoadUint64(&v.b.Head.Stop) != 0 }

func (v *boardView) countFailure() { atomic.AddUint64(&v.b.Head.Failures, 1) }

func (v *boardView) countLookup(worker int) {
	atomic.AddUint64(&v.b.Workers[worker%maxWorkers].Lookups, 1)
}

// round returns published round n, if the ring still holds it.
func (v *boardView) round(n uint64) (Round, bool) {
	rec := &v.b.Rounds[n%ringSize]
	if atomic.LoadUint64(&rec.Tag) != n+1 {
		return Round{}, false
	}
	r := Round{N: n, Addr: atomic.LoadUint64(&rec.Addr), Len: atomic.LoadUint64(&rec.Len), Key: atomic.LoadUint32(&rec.Key)}
	if atomic.LoadUint64(&rec.Tag) != n+1 { // rewritten while read
		return Round{}, false
	}
	return r, true
}

// awaitRound waits up to timeout for a round after pub to be published.
func (v *boardView) awaitRound(pub uint64, timeout time.Duration) {
	deadline := time.Now().Add(timeout)
	for i := 0; v.pub() == pub && !v.stopped() && time.Now().Before(deadline); i++ {
		if i < 16 {
			runtime.Gosched()
		} else {
			time.Sleep(20 * time.Microsecond)
		}
	}
}

// ownerPatience bounds how long a key may stay unpublished: the primary
// publishes a round's key right after registering it.
const ownerPatience = 2 * time.Second

// owner returns the published round whose key is k, newest first, and
// whether it was found. A key the primary has registered but not yet
// published (a secondary's lookup may find a new MR first) is waited for,
// up to ownerPatience.
func (v *boardView) owner(k uint32) (uint64, bool) {
	deadline := time.Now().Add(ownerPatience)
	for {
		pub := v.pub()
		for n := pub; n > pub-min(pub, ringSize); n-- {
			if r, ok := v.round(n - 1); ok && r.Key == k {
				return n - 1, true
			}
		}
		for v.pub() == pub {
			if v.stopped() || time.Now().After(deadline) {
				return 0, false
			}
			runtime.Gosched()
		}
	}
}
