package cache

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/shm"
	"github.com/mpmr/mpmr/verbs"
)

// Errors of the global cache.
var (
	// ErrNoMemory means the address is in no memseg list and no registered
	// external memory: there is nothing to register (ENXIO in DPDK's mlx5 driver).
	ErrNoMemory = errors.New("cache: address is not in any known memory")
	// ErrNotPrimary means the operation needs the primary process.
	ErrNotPrimary = errors.New("cache: only the primary may do this")
	// ErrExternalMemory means an external-memory chunk is not registered
	// and this process cannot register it: register the mempool in the
	// primary before the secondaries use it.
	ErrExternalMemory = errors.New("cache: external memory is not registered; register the mempool in the primary before use")
	// ErrClosed means the cache was closed.
	ErrClosed = errors.New("cache: closed")
	// ErrOverlap means a registration would overlap memory that is already
	// registered or belongs to a memseg list.
	ErrOverlap = errors.New("cache: range overlaps registered memory")
	// ErrBadRange means an empty, null or wrapping address range.
	ErrBadRange = errors.New("cache: bad address range")
	// ErrFenced means the primary fenced this process: it no longer
	// follows memory changes, so what it maps may not be what the global
	// table describes, and the table answers it no more.
	ErrFenced = errors.New("cache: this process was fenced by the primary")
)

// globalRoot is the global share cache's state in the segment.
//
//	off size field
//	  0   8  Lock           offset of the shm.RWLock guarding everything here
//	  8   8  MRList         first MR record, 0 if none
//	 16   8  FreeList       first MR waiting to be deregistered
//	 24   4  MRCount
//	 28   4  FreeCount
//	 32   8  Creates        MRs registered
//	 40   8  Rebuilds       table rebuilds
//	 48   8  Expansions     table expansions
//	 56   8  Invalidations  free events that changed registered memory
//	 64  64  Table          header of the global lookup table
//	128   4  DevGen         generation: bumped before every rebuild
//	132   4  LogLen         entries in the invalidation log
//	136   8  LogOff         offset of the invalidation log (see invlog.go)
//	144  48  reserved       (DevGen's line is written only with DevGen)
type globalRoot struct {
	Lock          uint64
	MRList        uint64
	FreeList      uint64
	MRCount       uint32
	FreeCount     uint32
	Creates       uint64
	Rebuilds      uint64
	Expansions    uint64
	Invalidations uint64
	Table         tableHeader
	DevGen        uint32
	LogLen        uint32
	LogOff        uint64
	_             [48]byte
}

// GlobalConfig configures the primary's global cache.
type GlobalConfig struct {
	// Memory is the data memory whose pages MRs cover. Required.
	Memory *hugetlb.Memory
	// PD registers and deregisters MRs. Required.
	PD verbs.PD
	// TableSize is the initial number of global table entries (default
	// 512). The table doubles when it fills.
	TableSize int
	// SinglePage turns extended-memseg mode off: an MR then covers only the
	// page of the missing address instead of the whole contiguous run of
	// allocated pages around it. Fewer bytes stay registered; more MRs and
	// table entries result.
	SinglePage bool
	// Access is what MRs are registered with (default local write and
	// relaxed ordering).
	Access verbs.Access
	// LockTimeout bounds every wait for the global lock (default 5 s).
	LockTimeout time.Duration
	// LogSize is the number of recent invalidations the segment remembers
	// (default DefaultLogSize): a local cache at most that many generations
	// behind drops only the entries they touched.
	LogSize int
	// FullFlush makes every invalidation flush every local cache entirely,
	// as DPDK's mlx5 does (the log then records each as "everything"). For
	// comparisons; the default flushes only what an invalidation touched.
	FullFlush bool
	// Logger receives diagnostics (default slog.Default()).
	Logger *slog.Logger
}

// Global is a process's handle on the global share cache. The primary
// (CreateGlobal) changes it; every process (AttachGlobal) looks up in it.
// Global is safe for concurrent use.
type Global struct {
	seg     *shm.Segment
	rootOff uint64
	root    *globalRoot
	lock    *shm.RWLock
	devGen  *uint32
	ilog    []logEntry            // the invalidation log; nil: readers flush everything
	tbl     atomic.Pointer[Table] // current view of the table
	timeout time.Duration
	log     *slog.Logger

	// Primary only.
	owner  bool
	mem    *hugetlb.Memory
	pd     verbs.PD
	single bool
	access verbs.Access
	unsub  func()
	// noExpand keeps the table at its size (tests of the overflow path).
	noExpand  bool
	fullFlush bool
	gcMu      sync.Mutex // one collection at a time (see Collect)
	ownMu     sync.Mutex
	owned     map[uint64]ownedMR // what this process registered, by record (see owned.go)
	freed     atomic.Int64       // how many of them are freed, changed under ownMu
	lastGCErr string             // the collection failure last logged, under gcMu
	closeMu   sync.Mutex
	closed    atomic.Bool
	// detached is set once this process lets go of the segment (see
	// Detach): nothing here reads it after that, and queues made later
	// read deadGen, a generation of their own, instead of devGen.
	detached atomic.Bool
	deadGen  uint32
	// fence says whether the primary fenced this process (a secondary's
	// claim; the primary's own is never fenced).
	fence shm.FenceWatch
}

// Detach is for a process about to close the segment g lives in: from
// now on lookups past a queue's top half fail with ErrClosed instead of
// reading it, catching up drops everything instead of reading the
// invalidation log, and queues made afterwards (NewLocal) read nothing
// of it at all. Queues made before still read the generation where it
// was; see Vacated. Call it once, before the segment is closed.
func (g *Global) Detach() {
	if g.detached.Load() {
		return
	}
	// Detached first: a queue that catches up from here on drops
	// everything, and one that caught up selectively read a generation
	// before this, so the one read next is past it, and so is deadGen.
	// (The other way round, a free between the two steps, caught up
	// selectively, left a queue at deadGen with its other entries kept,
	// and Hit answered from them after Close.)
	g.detached.Store(true)
	detachStep()
	atomic.StoreUint32(&g.deadGen, atomic.LoadUint32(g.devGen)+1)
}

// detachStep runs between Detach's two steps: a test puts a free and a
// lookup there.
var detachStep = func() {}

// Vacated is for a segment that Detach let go of and that was closed
// under live queues (shm.Segment.CloseUnderReaders): where they read the
// generation there are now private zeros, and a queue that never saw an
// invalidation remembers generation 0, so it would answer from its cache
// again. Vacated writes a generation past every one a queue can hold
// there, so that each drops what it cached at its next lookup (Hit then
// reports false).
func (g *Global) Vacated() {
	if g.detached.Load() {
		atomic.StoreUint32(g.devGen, atomic.LoadUint32(&g.deadGen))
	}
}

const defaultGlobalTable = 512

// CreateGlobal builds the global cache in seg (which this process owns),
// records it under shm.RootCache, and subscribes to the memory's free
// events.
func CreateGlobal(seg *shm.Segment, c GlobalConfig) (*Global, error) {
	if !seg.Owner() {
		return nil, ErrNotPrimary
	}
	if c.Memory == nil || c.PD == nil {
		return nil, errors.New("cache: GlobalConfig needs Memory and PD")
	}
	if c.TableSize == 0 {
		c.TableSize = defaultGlobalTable
	}
	if c.Access == 0 {
		c.Access = verbs.AccessLocalWrite | verbs.AccessRelaxedOrdering
	}
	rootOff, err := seg.Alloc(globalRootSize, 64)
	if err != nil {
		return nil, fmt.Errorf("cache: global root: %w", err)
	}
	lockOff, err := seg.NewRWLock()
	if err != nil {
		return nil, fmt.Errorf("cache: global lock: %w", err)
	}
	root := shm.At[globalRoot](seg, rootOff)
	atomic.StoreUint64(&root.Lock, lockOff)
	t, err := newSegmentTable(seg, rootOff+tableHeaderOff, c.TableSize)
	if err != nil {
		return nil, err
	}
	if c.LogSize == 0 {
		c.LogSize = DefaultLogSize
	}
	if err := newLog(seg, root, c.LogSize); err != nil {
		return nil, err
	}
	g, err := open(seg, rootOff, &c)
	if err != nil {
		return nil, err
	}
	g.tbl.Store(t)
	g.owner, g.mem, g.pd, g.single, g.access, g.fullFlush = true, c.Memory, c.PD, c.SinglePage, c.Access, c.FullFlush
	if err := seg.SetRoot(shm.RootCache, rootOff); err != nil {
		return nil, err
	}
	g.unsub = c.Memory.GuardFree(g.guardFree)
	return g, nil
}

// AttachGlobal opens the global cache the primary built in seg.
func AttachGlobal(seg *shm.Segment, logger *slog.Logger, lockTimeout time.Duration) (*Global, error) {
	off := seg.Root(shm.RootCache)
	if off == 0 {
		return nil, fmt.Errorf("%w: the segment has no global cache", ErrCorrupt)
	}
	if err := seg.CheckRange(off, globalRootSize); err != nil {
		return nil, fmt.Errorf("%w: global root: %v", ErrCorrupt, err)
	}
	return open(seg, off, &GlobalConfig{Logger: logger, LockTimeout: lockTimeout})
}

func open(seg *shm.Segment, rootOff uint64, c *GlobalConfig) (*Global, error) {
	root := shm.At[globalRoot](seg, rootOff)
	lock, err := seg.RWLock(atomic.LoadUint64(&root.Lock))
	if err != nil {
		return nil, fmt.Errorf("cache: global lock: %w", err)
	}
	g := &Global{seg: seg, rootOff: rootOff, root: root, lock: lock, devGen: &root.DevGen,
		ilog: openLog(seg, root), timeout: c.LockTimeout, log: c.Logger, fence: seg.FenceWatch()}
	if g.timeout <= 0 {
		g.timeout = 5 * time.Second
	}
	if g.log == nil {
		g.log = slog.Default()
	}
	// Only the primary writes the global cache: a word naming any other
	// writer is one a process rewrote, taken back at once.
	lock.OwnerWritesOnly()
	if !seg.Owner() {
		t, err := openSegmentTable(seg, rootOff+tableHeaderOff)
		if err != nil {
			return nil, err
		}
		g.tbl.Store(t)
	}
	return g, nil
}

// Primary reports whether this handle can create MRs.
func (g *Global) Primary() bool { return g.owner }

// DevGen returns the current generation. Local caches flush when it moves.
func (g *Global) DevGen() uint32 { return atomic.LoadUint32(g.devGen) }

// table returns a view of the table that matches the header. Call it with
// the lock held, or inside an optimistic read (the view may then be bogus,
// but is always in bounds).
func (g *Global) table() (*Table, error) {
	t := g.tbl.Load()
	if g.owner || !t.Stale() {
		// The owner's view is the table: it replaces it itself when it
		// expands it, and puts the header right under the write lock
		// (writeLock) if another process rewrote it.
		return t, nil
	}
	nt, err := openSegmentTable(g.seg, g.rootOff+tableHeaderOff)
	if err != nil {
		return nil, err
	}
	g.tbl.Store(nt)
	return nt, nil
}

func (g *Global) lockCtx() (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.Background(), g.timeout)
}

// Lookup finds the registered chunk holding addr. It first tries an
// optimistic read, which writes nothing to shared memory, and takes the
// read lock only when a writer gets in the way or the table has
// overflowed (then the MR list is scanned). It fails, rather than waiting
// or reading a half-written table, if the primary died while writing, and
// with ErrClosed once Detach was called. A secondary the primary fenced
// gets ErrFenced, also when the fence came while its lookup ran, up to
// its read of the table (it may have stopped there; a fence after that is
// one after the lookup): it stopped following memory changes, so an address may
// map, in it, pages the primary freed since and holds in quarantine for
// it, while the table names the pages handed out there afterwards.
func (g *Global) Lookup(addr uint64) (Entry, bool, error) {
	if g.detached.Load() {
		return Entry{}, false, ErrClosed
	}
	if g.fence.Fenced() {
		return Entry{}, false, ErrFenced
	}
	if hook := lookupEntered.Load(); hook != nil {
		(*hook)()
	}
	e, found, err := g.lookup(addr)
	// Once more after the read: a process stopped inside the lookup may
	// resume fenced, and what it read then belongs to changes it no
	// longer follows.
	if g.fence.Fenced() {
		return Entry{}, false, ErrFenced
	}
	return e, found, err
}

// lookup is Lookup's read of the table, or of the MR list.
func (g *Global) lookup(addr uint64) (Entry, bool, error) {
	for range 4 {
		stamp, ok := g.lock.Optimistic()
		if !ok {
			break
		}
		t, err := g.table()
		if err != nil || t.Overflowed() {
			break
		}
		e, _, hit := t.find(addr)
		if g.lock.Validate(stamp) {
			if !hit {
				return Entry{}, false, nil
			}
			return e, true, nil
		}
	}
	return g.lookupLocked(addr)
}

// lookupEntered, when set (by tests), runs in Lookup once its checks on
// entry passed: where its process may stop.
var lookupEntered atomic.Pointer[func()]

func (g *Global) lookupLocked(addr uint64) (Entry, bool, error) {
	var e Entry
	var found bool
	err := g.readLocked(func() (err error) {
		e, found, err = g.find(addr)
		return err
	})
	if err != nil {
		return Entry{}, false, fmt.Errorf("cache: global lookup of 0x%x: %w", addr, err)
	}
	return e, found, nil
}

// readLocked runs fn under the global read lock. If a writer fenced the hold
// meanwhile (this process kept it too long, see shm.RWLock), what fn read
// may be torn: fn runs again, until the lock's timeout. fn must only read.
func (g *Global) readLocked(fn func() error) error {
	// One limit for the whole call, waits and read sections alike, as
	// LockTimeout promises; this is the slow path, so one clock reading
	// more than the lock needs costs nothing that matters.
	until := time.Now().Add(g.timeout)
	for within := g.timeout; ; within = max(time.Until(until), 0) {
		h, err := g.lock.RLockWithin(within)
		if err != nil {
			return err
		}
		ferr := fn()
		if err := g.lock.RUnlock(h); err == nil {
			return ferr
		} else if !time.Now().Before(until) {
			return err
		}
	}
}

// find looks addr up in the table, or in the MR list if the table has
// overflowed. Call it with the lock held.
func (g *Global) find(addr uint64) (Entry, bool, error) {
	t, err := g.table()
	if err != nil {
		return Entry{}, false, err
	}
	if !t.Overflowed() {
		e, _, hit := t.find(addr)
		if !hit {
			return Entry{}, false, nil
		}
		return e, true, nil
	}
	e, _, found, err := g.findInList(addr)
	return e, found, err
}

// findInList scans the MR list for the chunk holding addr (the slow path of
// an overflowed table). Call it with the lock held.
func (g *Global) findInList(addr uint64) (Entry, mr, bool, error) {
	var found Entry
	var owner mr
	ok := false
	err := g.eachMR(atomic.LoadUint64(&g.root.MRList), func(m mr) bool {
		for _, e := range m.chunks() {
			if e.Contains(addr) {
				found, owner, ok = e, m, true
				return false
			}
		}
		return true
	})
	return found, owner, ok, err
}

// maxMRs bounds list walks, so that a corrupt list cannot loop forever.
const maxMRs = 1 << 20

// walkLimit bounds a walk of a list of MRs: in the owner, by how many it
// registered, so that a list another process rewrote into a loop costs
// no more than the real one.
func (g *Global) walkLimit() int {
	if g.owner {
		return g.ownedCount() + 1
	}
	return maxMRs
}

// eachMR calls fn for every record of the list starting at head until fn
// returns false. Call it with the lock held.
func (g *Global) eachMR(head uint64, fn func(mr) bool) error {
	limit := g.walkLimit()
	for off, n := head, 0; off != 0; n++ {
		if n >= limit {
			return fmt.Errorf("%w: MR list does not end", ErrCorrupt)
		}
		m, err := g.mrAt(off)
		if err != nil {
			return err
		}
		next := atomic.LoadUint64(&m.rec.Next)
		if !fn(m) {
			return nil
		}
		off = next
	}
	return nil
}

// GlobalStats are the global cache's counters.
type GlobalStats struct {
	MRs           int    `json:"mrs"`
	FreeMRs       int    `json:"free_mrs"`
	TableLen      int    `json:"table_len"` // entries, sentinel excluded
	TableSize     int    `json:"table_size"`
	Overflowed    bool   `json:"overflowed"`
	DevGen        uint32 `json:"dev_gen"`
	Creates       uint64 `json:"creates"`
	Rebuilds      uint64 `json:"rebuilds"`
	Expansions    uint64 `json:"expansions"`
	Invalidations uint64 `json:"invalidations"`
}

// Stats reads the counters (without the lock: a best-effort snapshot).
func (g *Global) Stats() GlobalStats {
	r := g.root
	st := GlobalStats{
		MRs:           int(atomic.LoadUint32(&r.MRCount)),
		FreeMRs:       int(atomic.LoadUint32(&r.FreeCount)),
		TableLen:      int(atomic.LoadUint32(&r.Table.Len)) - 1,
		TableSize:     int(atomic.LoadUint32(&r.Table.Size)),
		Overflowed:    atomic.LoadUint32(&r.Table.Overflow) != 0,
		DevGen:        atomic.LoadUint32(&r.DevGen),
		Creates:       atomic.LoadUint64(&r.Creates),
		Rebuilds:      atomic.LoadUint64(&r.Rebuilds),
		Expansions:    atomic.LoadUint64(&r.Expansions),
		Invalidations: atomic.LoadUint64(&r.Invalidations),
	}
	return st
}

// LockState describes the global lock, for operators.
func (g *Global) LockState() shm.LockState { return g.lock.State() }
