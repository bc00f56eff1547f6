package shm

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/mpmr/mpmr/internal/sys/falloc"
	"github.com/mpmr/mpmr/internal/sys/owner"
	"github.com/mpmr/mpmr/internal/sys/vm"
)

// Defaults for Options.
const (
	DefaultSize    = 1 << 20
	DefaultMaxSize = 64 << 20
	DefaultSlots   = 64
	MaxSlots       = 1024
)

// Options configure Create and Attach.
type Options struct {
	// Path is the segment file, on hugetlbfs or tmpfs.
	Path string
	// File, if set (Attach only), is the segment file already open for
	// reading and writing: a caller that must not follow a link planted at
	// Path opens it itself. Path then only names it in messages and gives
	// LockPath's default. Attach takes it over: it is closed with the
	// segment, or before Attach returns an error.
	File *os.File
	// LockPath is the file whose bytes carry the process table's liveness
	// locks. Default: Path + ".lock".
	LockPath string
	// LockFile, if set, is the lock file already open for reading and
	// writing, used instead of opening LockPath: a caller that must not
	// follow a link planted at the path opens it itself. Create and Attach
	// take it over: it is closed with the segment, or before they return
	// an error.
	LockFile *os.File
	// NoLockFile (OpenReadOnly only) says that there is no lock file, so
	// that no slot is held: a caller that found none where it looked says
	// so, rather than have a name opened that could be a link by then.
	NoLockFile bool
	// Size is the initial usable size (Create only), rounded up to the
	// backing page size. Default DefaultSize.
	Size uint64
	// MaxSize bounds growth (Create only); every process reserves this much
	// address space. Default DefaultMaxSize.
	MaxSize uint64
	// Slots is the process-table length (Create only). Default DefaultSlots.
	Slots int
	// LayoutTag is mixed into the layout hash: the layers above pass a hash
	// of their own shared structs (see LayoutHash) so that builds that
	// disagree refuse each other. Create and Attach must pass the same tag.
	LayoutTag uint32
	// Role is recorded in the process table for this process.
	Role Role
	// Logger receives diagnostics. Default slog.Default().
	Logger *slog.Logger
}

func (o *Options) lockPath() string {
	if o.LockPath != "" {
		return o.LockPath
	}
	return o.Path + ".lock"
}

// dropLockFileOn closes the lock file the caller handed over if *err is
// set (closing it twice is harmless).
func (o *Options) dropLockFileOn(err *error) {
	if *err != nil && o.LockFile != nil {
		o.LockFile.Close()
	}
}

func (o *Options) logger() *slog.Logger {
	if o.Logger != nil {
		return o.Logger
	}
	return slog.Default()
}

// Segment is one process's view of a control segment. The creating process
// (the owner) is the only one that allocates from the arena, grows the
// segment or changes its state; any process may read and may take locks.
// Segment's methods are safe for concurrent use.
type Segment struct {
	path    string
	f       *os.File
	lockf   *os.File     // nil once closed (and on a read-only Segment without one)
	filesMu sync.RWMutex // held to use lockf where Close may close it meanwhile
	base    uintptr
	mapLen  uintptr
	backed  atomic.Uint64 // bytes of the file known to exist, at most mapLen
	hdr     *header
	// procs is the process table, placed and sized once when the
	// segment is created or its header validated: the header's own
	// words for it can be rewritten by any process that maps it.
	procs []procSlot
	owner bool
	// slot is this process's process-table slot, -1 for none; atomic,
	// since closing under readers releases it while they may look.
	slot  atomic.Int32
	epoch uint32
	log   *slog.Logger
	mu    sync.Mutex // owner: serializes arena and growth
	arena ownArena   // owner only
	// fences: the owner's record of the claims it fenced (see Fence).
	fenceMu  sync.Mutex
	fences   []Proc
	fenceSeq uint64 // fences taken, for Proc.Seq
	closeMu  sync.Mutex
	closed   atomic.Bool
	vacated  bool // CloseUnderReaders left the range as zeros; under closeMu
	// readOnly: mapped by OpenReadOnly, with no slot; lockf may be nil.
	readOnly bool
	// writers: this process's writers of each lock, by offset, shared by
	// every handle on the lock (see RWLock).
	writersMu sync.Mutex
	writers   map[uint64]*lockWriters
}

func roundUp(n, to uint64) uint64 { return (n + to - 1) / to * to }

// Create makes a new segment file at o.Path (failing with ErrExists if one is
// there), maps it, lays out the header, process table and arena, and claims
// a process-table slot for the caller, who becomes the owner. The segment
// stays in the initializing state until MarkReady, so attachers refuse it
// while the layers above build their state.
func Create(o Options) (_ *Segment, err error) {
	defer o.dropLockFileOn(&err)
	if o.Slots == 0 {
		o.Slots = DefaultSlots
	}
	if o.Slots < 1 || o.Slots > MaxSlots {
		return nil, fmt.Errorf("shm: create %s: %d process slots, want 1..%d", o.Path, o.Slots, MaxSlots)
	}
	if o.Size == 0 {
		o.Size = DefaultSize
	}
	if o.MaxSize == 0 {
		o.MaxSize = DefaultMaxSize
	}
	f, err := os.OpenFile(o.Path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if errors.Is(err, os.ErrExist) {
		if who := owner.Foreign(o.Path); who != "" {
			return nil, fmt.Errorf("%w: %s (%s: not an instance's file)", ErrExists, o.Path, who)
		}
		return nil, fmt.Errorf("%w: %s", ErrExists, o.Path)
	}
	if err != nil {
		return nil, fmt.Errorf("shm: create: %w", err)
	}
	s, err := create(f, &o)
	if err != nil {
		f.Close()
		os.Remove(o.Path)
		return nil, fmt.Errorf("shm: create %s: %w", o.Path, err)
	}
	return s, nil
}

func create(f *os.File, o *Options) (*Segment, error) {
	page, _, err := falloc.BlockSize(int(f.Fd()))
	if err != nil {
		return nil, err
	}
	procsOff := uint64(headerSize)
	arenaOff := roundUp(procsOff+uint64(o.Slots)*slotSize, lineSize)
	size := roundUp(max(o.Size, arenaOff+4096), page)
	maxSize := roundUp(max(o.MaxSize, size), page)
	if err := falloc.Allocate(int(f.Fd()), 0, int64(size)); err != nil {
		return nil, err
	}
	s, err := mapSegment(f, o, maxSize, o.Slots)
	if err != nil {
		return nil, err
	}
	s.owner = true
	h := s.hdr
	atomic.StoreUint32(&h.Version, Version)
	atomic.StoreUint32(&h.Layout, ownLayout^o.LayoutTag)
	atomic.StoreUint32(&h.State, stateInitializing)
	atomic.StoreUint32(&h.Slots, uint32(o.Slots))
	atomic.StoreUint32(&h.CreatorPID, uint32(os.Getpid()))
	atomic.StoreUint32(&h.CreatorUID, uint32(os.Getuid()))
	atomic.StoreUint64(&h.CreatorStart, selfStart)
	atomic.StoreUint64(&h.Size, size)
	atomic.StoreUint64(&h.MaxSize, maxSize)
	atomic.StoreUint64(&h.PageSize, page)
	atomic.StoreUint64(&h.ProcsOff, procsOff)
	atomic.StoreUint64(&h.ArenaOff, arenaOff)
	s.arenaInit(arenaOff, size, maxSize, page)
	// The magic goes in last: a reader that sees it sees a complete header.
	atomic.StoreUint64(&h.Magic, Magic)
	if err := s.claimSlot(o.Role); err != nil {
		s.unmap()
		return nil, err
	}
	return s, nil
}

// Attach opens and maps an existing segment after validating its header
// (see Probe for the checks), then claims a process-table slot.
func Attach(o Options) (_ *Segment, err error) {
	defer o.dropLockFileOn(&err)
	f := o.File
	if f == nil {
		if f, err = os.OpenFile(o.Path, os.O_RDWR, 0); err != nil {
			return nil, fmt.Errorf("shm: attach: %w", err)
		}
	}
	info, err := probeFile(f, o.LayoutTag)
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("shm: attach %s: %w", o.Path, err)
	}
	s, err := mapSegment(f, &o, info.MaxSize, info.Slots)
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("shm: attach %s: %w", o.Path, err)
	}
	if err := s.claimSlot(o.Role); err != nil {
		s.unmap()
		return nil, fmt.Errorf("shm: attach %s: %w", o.Path, err)
	}
	return s, nil
}

func mapSegment(f *os.File, o *Options, maxSize uint64, slots int) (*Segment, error) {
	lockf := o.LockFile
	if lockf == nil {
		var err error
		if lockf, err = os.OpenFile(o.lockPath(), os.O_RDWR|os.O_CREATE, 0o600); err != nil {
			return nil, fmt.Errorf("open lock file: %w", err)
		}
	}
	base, err := vm.MapShared(int(f.Fd()), uintptr(maxSize), true)
	if err != nil {
		lockf.Close()
		return nil, err
	}
	seg := &Segment{
		path:   o.Path,
		f:      f,
		lockf:  lockf,
		base:   base,
		mapLen: uintptr(maxSize),
		hdr:    (*header)(vm.Pointer(base)),
		procs:  procTable(vm.Pointer(base), slots),
		log:    o.logger(),
	}
	seg.slot.Store(-1)
	return seg, nil
}

func (s *Segment) unmap() {
	_ = vm.Unmap(s.base, s.mapLen)
	s.closeFiles()
}

func (s *Segment) closeFiles() {
	s.filesMu.Lock()
	defer s.filesMu.Unlock()
	if s.lockf != nil {
		s.lockf.Close()
		s.lockf = nil
	}
	s.f.Close()
}

func (s *Segment) basePtr() unsafe.Pointer { return vm.Pointer(s.base) }

// pointer is the address of offset off, unchecked.
func (s *Segment) pointer(off uint64) unsafe.Pointer { return unsafe.Add(s.basePtr(), off) }

func (s *Segment) mustRange(off, size, align uint64) {
	if end := s.limit(off + size); off%align != 0 || off+size < off || off+size > end {
		panic(fmt.Sprintf("shm: [0x%x, +0x%x) outside segment %s (size 0x%x) or misaligned",
			off, size, s.path, end))
	}
}

// limit returns the end of what this process may touch when it wants to
// reach end. For the owner that is the size it gave the segment. Any other
// process goes by what the file holds, never past what it mapped, and not
// by the header's Size: any process mapping the segment can write that,
// and a Size raised would turn an access into a SIGSEGV (past the mapping)
// or a SIGBUS (past the file's end), while a Size lowered between a check
// and an access would turn the access into a panic. The file is asked
// again only when end lies past what it was last seen to hold: the owner
// grew it since.
func (s *Segment) limit(end uint64) uint64 {
	if s.owner {
		return s.arena.size.Load()
	}
	backed := s.backed.Load()
	if end <= backed {
		return backed
	}
	if fi, err := s.f.Stat(); err == nil && fi.Size() > 0 {
		backed = min(uint64(fi.Size()), uint64(s.mapLen))
		s.backed.Store(backed)
	}
	return backed
}

// CheckRange reports whether [off, off+size) lies inside the segment's
// arena and off is 8-byte aligned (as every shared struct is). Use it on
// offsets read from shared memory before trusting them to At or Slice.
// The bounds are what this process mapped and the file holds, whatever
// the header says.
func (s *Segment) CheckRange(off, size uint64) error {
	if off%8 != 0 || off < s.arenaStart() || off+size < off || off+size > s.limit(off+size) {
		return fmt.Errorf("%w: [0x%x, +0x%x) in %s", ErrBadOffset, off, size, s.path)
	}
	return nil
}

// arenaStart is where the arena begins: for the owner where it put it,
// for others where the header says, never inside the header.
func (s *Segment) arenaStart() uint64 {
	if s.owner {
		return s.arena.start
	}
	return max(atomic.LoadUint64(&s.hdr.ArenaOff), headerSize)
}

// Path returns the segment file's path.
func (s *Segment) Path() string { return s.path }

// Owner reports whether this process created the segment.
func (s *Segment) Owner() bool { return s.owner }

// Size returns the usable size of the segment in bytes.
func (s *Segment) Size() uint64 {
	if s.owner {
		return s.arena.size.Load()
	}
	return atomic.LoadUint64(&s.hdr.Size)
}

// MaxSize returns the size the segment may grow to.
func (s *Segment) MaxSize() uint64 {
	if s.owner {
		return s.arena.maxSize
	}
	return atomic.LoadUint64(&s.hdr.MaxSize)
}

// PageSize returns the backing page size.
func (s *Segment) PageSize() uint64 {
	if s.owner {
		return s.arena.page
	}
	return atomic.LoadUint64(&s.hdr.PageSize)
}

// MarkReady moves the segment from initializing to ready; attachers accept
// it from then on. Owner only.
func (s *Segment) MarkReady() error {
	if !s.owner {
		return ErrNotOwner
	}
	atomic.StoreUint32(&s.hdr.State, stateReady)
	return nil
}

// MarkDead marks the segment as belonging to an ended instance: attachers
// refuse it with ErrDead. The owner does this when it shuts down; a new
// owner does it to a stale segment it found. On a read-only Segment (see
// OpenReadOnly) it does nothing: use MarkDeadFile.
func (s *Segment) MarkDead() {
	if s.readOnly {
		return
	}
	atomic.StoreUint32(&s.hdr.State, stateDead)
}

// Ready reports whether the segment is in the ready state.
func (s *Segment) Ready() bool { return atomic.LoadUint32(&s.hdr.State) == stateReady }

// Root returns the offset stored in named root i (0 if unset).
func (s *Segment) Root(i int) uint64 { return atomic.LoadUint64(&s.hdr.Roots[i]) }

// SetRoot stores off in named root i. Owner only. The layers above keep the
// offsets of their top-level structures here; see the Root constants.
func (s *Segment) SetRoot(i int, off uint64) error {
	if !s.owner {
		return ErrNotOwner
	}
	atomic.StoreUint64(&s.hdr.Roots[i], off)
	return nil
}

// Well-known roots.
const (
	RootMemory = 0 // hugetlb: memseg list table
	RootCache  = 1 // cache: global share cache
	RootDevice = 2 // verbs: soft device
	RootPools  = 3 // cache: mempool directory
	RootStats  = 4 // runtimes: per-process counters
	RootUser   = 8 // first root free for applications
)

// Grow makes at least need more bytes available past the current size,
// extending the backing file in whole pages. The mapping already covers
// MaxSize, so nothing moves. Owner only; it fails with ErrArenaFull when
// MaxSize would be exceeded.
func (s *Segment) Grow(need uint64) error {
	if !s.owner {
		return ErrNotOwner
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed.Load() {
		return ErrClosed
	}
	return s.growLocked(need)
}

func (s *Segment) growLocked(need uint64) error {
	old, page := s.arena.size.Load(), s.arena.page
	size := roundUp(old+max(need, old/2), page)
	if limit := s.arena.maxSize; size > limit {
		size = roundUp(old+need, page)
		if size > limit {
			return fmt.Errorf("%w: need 0x%x more bytes, size 0x%x, max 0x%x", ErrArenaFull, need, old, limit)
		}
	}
	if err := falloc.Allocate(int(s.f.Fd()), int64(old), int64(size-old)); err != nil {
		return fmt.Errorf("shm: grow %s to 0x%x: %w", s.path, size, err)
	}
	s.arena.size.Store(size)
	atomic.StoreUint64(&s.hdr.Size, size)
	s.freeRange(old, size-old)
	s.log.Debug("segment grew", "path", s.path, "from", old, "to", size)
	return nil
}

// Close marks this process's slot free, unmaps the segment, lets go of
// the slot (other processes see it dead from then on, not before) and
// closes its files. It is idempotent. The files stay on disk; removing them is the
// owner's decision (see Remove). Should the mapping fail to go, Close
// returns that error and keeps the slot held, its lock file open, until
// the process exits: other processes must not see it dead while it can
// still write the segment.
func (s *Segment) Close() error { return s.close(false) }

// CloseUnderReaders is Close for a process whose other goroutines may still
// be reading the segment through what they looked up before (a queue's
// lookup that passed its check for Close a moment before it): the segment
// is unmapped as Close does, but its address range is left mapped to
// private zeros (vm.Vacate), so that those reads find an empty segment
// (no generation, no MR, no lock held) instead of faulting, and what they
// write lands in those zeros, nowhere shared. Locks held across it give
// up their holds with ErrClosed. It reports whether the range was
// vacated: if it could not be, the segment was unmapped as Close does,
// and if it could not be unmapped either, the error says so and the slot
// stays held, as with Close. Once nothing can read the range any more,
// Unreserve gives it back.
func (s *Segment) CloseUnderReaders() (vacated bool, err error) {
	err = s.close(true)
	s.closeMu.Lock()
	defer s.closeMu.Unlock()
	return s.vacated, err
}

// Unreserve gives back the address range CloseUnderReaders left as zeros.
// Call it only once nothing reads through pointers into the segment.
// It does nothing if the range was not left so. Idempotent.
func (s *Segment) Unreserve() {
	s.closeMu.Lock()
	defer s.closeMu.Unlock()
	if s.vacated {
		_ = vm.Unmap(s.base, s.mapLen)
		s.vacated = false
	}
}

func (s *Segment) close(underReaders bool) error {
	s.closeMu.Lock()
	defer s.closeMu.Unlock()
	if s.closed.Load() {
		return nil
	}
	// Under the arena's lock: an Alloc, Free or Grow of the owner's other
	// goroutines either finishes before the mapping goes or sees closed.
	s.mu.Lock()
	s.closed.Store(true)
	s.mu.Unlock()
	// The slot is marked free now, but held until the mapping has gone:
	// until then this process's goroutines may still write the segment,
	// and a process that saw the slot dead could take over a lock one of
	// them holds, and repair it while it is written.
	s.freeSlot()
	if testHookBeforeUnmap != nil {
		testHookBeforeUnmap(s)
	}
	if underReaders {
		err := vacateSegment(s.base, s.mapLen)
		if err == nil {
			s.vacated = true
			s.releaseSlot()
			s.closeFiles()
			return nil
		}
		// Unmapped after all: a reader left faults, rather than writing
		// into a segment whose slot this process is about to let go of.
		s.log.Warn("segment unmapped under its readers: it could not be vacated", "path", s.path, "err", err)
	}
	if err := unmapSegment(s.base, s.mapLen); err != nil {
		// Still mapped: this process can still write the segment, so its
		// slot stays held (and the lock file that holds it open) until the
		// process exits and the kernel lets go of both.
		s.log.Error("segment still mapped: its slot stays held until this process exits", "path", s.path, "err", err)
		return fmt.Errorf("shm: close %s: %w", s.path, err)
	}
	s.releaseSlot()
	s.closeFiles()
	return nil
}

// testHookBeforeUnmap, if set, runs in close just before the segment's
// mapping goes.
var testHookBeforeUnmap func(*Segment)

// Remove deletes the segment file and its lock file. Processes that still
// map the segment keep their mapping; the memory is returned to the system
// when the last one unmaps it.
func Remove(o Options) error {
	var errs []error
	for _, p := range []string{o.Path, o.lockPath()} {
		if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// unmapSegment and vacateSegment are vm.Unmap and vm.Vacate, which tests
// replace to see what close does when they fail.
var (
	unmapSegment  = vm.Unmap
	vacateSegment = vm.Vacate
)
