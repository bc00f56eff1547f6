package hugetlb

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"

	"golang.org/x/sys/unix"

	"github.com/mpmr/mpmr/internal/sys/falloc"
	"github.com/mpmr/mpmr/internal/sys/ofd"
	"github.com/mpmr/mpmr/internal/sys/owner"
	"github.com/mpmr/mpmr/internal/sys/vm"
	"github.com/mpmr/mpmr/shm"
)

// DefaultBase is where the first memseg list goes unless ListConfig.Base
// says otherwise: 1 TiB, clear of the Go heap (0xc0_0000_0000 up, also with
// the race detector), the race detector's shadow (0x1000_0000_0000 up), PIE
// binaries and the kernel's mmap area. Further lists follow one after
// another, each aligned to 1 GiB (or its page size, if larger) and separated
// by a 1 GiB gap.
const DefaultBase uintptr = 0x0100_0000_0000

const (
	listGap   = 1 << 30
	listAlign = 1 << 30

	// MaxLists bounds the number of memseg lists of one instance.
	MaxLists = 64
	// MaxPages bounds the capacity of one list.
	MaxPages = 1 << 20

	// maxUserAddr is the end of the user address space with 4-level page
	// tables; nothing is placed above it.
	maxUserAddr = 1 << 47
	maxPageSize = 1 << 30
)

// Errors of the data memory. Operations wrap them with what failed.
var (
	// ErrAddressInUse means a list's address range is already mapped in
	// this process, so the list cannot sit at the same address as in the
	// other processes. The message names the range, what occupies it and
	// the setting that moves the lists.
	ErrAddressInUse = errors.New("hugetlb: address range already in use")
	// ErrNoHugepages means the kernel had fewer free hugepages than an
	// allocation needed; it is the same sentinel as ErrNoPages.
	ErrNoHugepages = ErrNoPages
	// ErrNoFreeRun means no list has a run of free pages long enough.
	ErrNoFreeRun = errors.New("hugetlb: no free run of pages large enough")
	// ErrHole means a failed unmap left part of its range unmapped, and
	// it could not be reserved again: another mapping of the process may
	// take it. The pages are lost: never mapped, unmapped, allocated or
	// freed again by this process (see Free).
	ErrHole = vm.ErrHole
	// ErrDoubleFree means part of a range given to Free is not allocated.
	ErrDoubleFree = errors.New("hugetlb: freeing memory that is not allocated")
	// ErrUnaligned means a range does not start or end on a page boundary.
	ErrUnaligned = errors.New("hugetlb: range not page-aligned")
	// ErrForeign means a range is not inside one memseg list.
	ErrForeign = errors.New("hugetlb: range outside the memseg lists")
	// ErrZeroLength means an empty allocation or range.
	ErrZeroLength = errors.New("hugetlb: zero length")
	// ErrNotAllocated means a secondary was asked to map pages the primary
	// has not allocated.
	ErrNotAllocated = errors.New("hugetlb: pages not allocated")
	// ErrNotPrimary means a primary-only operation was called in a
	// secondary.
	ErrNotPrimary = errors.New("hugetlb: only the primary may do this")
	// ErrNotSecondary means a secondary-only operation was called in the
	// primary.
	ErrNotSecondary = errors.New("hugetlb: only a secondary may do this")
	// ErrExists means the segment already holds memory, or a backing file
	// is left over from an instance that ended (see RemoveFiles).
	ErrExists = errors.New("hugetlb: memory already exists")
	// ErrBadDescriptor means the descriptors in the segment are missing or
	// make no sense; Attach refuses them.
	ErrBadDescriptor = errors.New("hugetlb: bad memseg list descriptor")
	// ErrClosed means the Memory, or the primary's memory, was closed.
	ErrClosed = errors.New("hugetlb: memory closed")
	// ErrNotFreed means a guard (see GuardFree) refused a free: the
	// memory is still allocated and mapped everywhere. A guard may have
	// let go of what it kept about the memory first (the MR cache drops
	// its registrations of it, which are made again on demand).
	ErrNotFreed = errors.New("hugetlb: memory not freed")
	// ErrInUse means a backing file may belong to a live Memory: a lock
	// is held on it, as its creator holds one (see RemoveFiles).
	ErrInUse = errors.New("hugetlb: backing file in use by a live instance")
	// ErrNotOwned means a file where a backing file should be is not a
	// regular file of this user (see RemoveFiles).
	ErrNotOwned = errors.New("hugetlb: not a backing file of this user")
)

// ListConfig configures one memseg list.
type ListConfig struct {
	// PageSize of the list; 0 means the backend's page size. On hugetlbfs
	// it must be the mount's page size.
	PageSize uint64
	// Pages is the list's capacity. Only the address range is reserved up
	// front; pages take memory when they are allocated.
	Pages int
	// Base is the list's fixed virtual address, aligned to PageSize; 0
	// places it after the previous list (the first at DefaultBase).
	Base uintptr
}

// Config configures Create.
type Config struct {
	// Prefix names the instance; list N's backing file is
	// <Backend.Dir>/mpmr.<Prefix>.msl<N>. Backend directories are shared
	// by every user and instance: the runtimes pass a name unique to the
	// instance (its prefix, user and runtime directory).
	Prefix string
	// Backend is where the backing files go, from Choose.
	Backend Backend
	// Lists are the memseg lists, at least one. Alloc tries them in order.
	Lists []ListConfig
	// Logger receives diagnostics; default slog.Default().
	Logger *slog.Logger
}

// AttachOptions configure Attach.
type AttachOptions struct {
	// Logger receives diagnostics; default slog.Default().
	Logger *slog.Logger
	// Files are the lists' backing files in list order, as the primary
	// handed them over (BackingFiles there). Attach maps from them instead
	// of opening the paths the descriptors name, after the same checks;
	// it takes them over, closing them when it fails or with the Memory.
	// A process that does not own the segment's files should pass them:
	// any process of the primary's user may write a descriptor's path
	// (a link to a file of the attaching user, a file system that never
	// answers), and opening it would do so as the attaching user.
	Files []*os.File
}

// Memory is one process's view of an instance's data memory: its memseg
// lists, each a reserved address range at the same virtual address in every
// process, whose allocated pages are mapped from the list's backing file.
//
// The primary (Create) allocates and frees pages; it is the only process
// that writes the shared descriptors. Secondaries (Attach) map what the
// descriptors say is allocated and follow later changes through MapPages,
// UnmapPages and Resync.
//
// Memory is safe for concurrent use. Queries (PageOf, ContigRun, Runs,
// InList, Lists) take no lock and read the shared descriptors atomically;
// hold RLock to get a view that does not change between queries.
type Memory struct {
	seg     *shm.Segment
	primary bool
	log     *slog.Logger
	table   *tableHeader
	lists   []*list // fixed after Create/Attach

	mu sync.RWMutex // the memory lock; see RLock
	// chMu is held for reading by each Alloc and Free of the primary from
	// start to end, its events included, and for writing by Close and
	// HoldChanges. Lock order: chMu, then mu.
	chMu sync.RWMutex
	// qmu orders the queries, which take no memory lock (event callbacks
	// call them), against Close: they read the descriptors under it, and
	// Close marks the memory closed under it, so that none is still
	// reading when the descriptors are unmapped.
	qmu      sync.RWMutex
	closed   atomic.Bool
	closeErr error // what Close reported, under mu

	subMu  sync.Mutex
	subs   atomic.Pointer[[]*subscriber]
	guards atomic.Pointer[[]*subscriber]

	// Primary only, under mu: freed pages a fenced process may still map.
	quarantine []batch
	relMu      sync.Mutex // one quarantine release at a time; after chMu, before mu
	// decided is closed, under mu, whenever the guards of a free have
	// answered, and replaced (see Freeing).
	decided chan struct{}
	// Primary only: when the holders that still reached data memory
	// are asked again (see Housekeep).
	askMu   sync.Mutex
	asked   map[holderKey]askState
	asking  atomic.Bool    // a round of Housekeep's questions runs
	askWG   sync.WaitGroup // that round, which Close waits for (a while)
	idsOnce sync.Once
	mapIDs  map[mapID]bool
	qpages  atomic.Int64
}

// list is one memseg list as this process sees it.
type list struct {
	index    int
	base     uintptr
	pageSize uint64
	pages    int
	kind     Kind
	path     string
	f        *os.File
	desc     *listDesc
	state    bitmap // shared: allocated pages
	mapped   bitmap // private: pages mapped in this process, under Memory.mu
	reserved bool   // the address range is reserved
	// lost are pages whose range a failed release may have left to
	// another mapping of the process (vm.ErrHole): this process never
	// maps, unmaps, allocates or frees them again, nor unmaps them at
	// Close. Under Memory.mu (read atomically without it by Lists).
	lost      bitmap
	lostPages atomic.Int64 // set bits of lost

	// Primary only, under Memory.mu: quarantined pages.
	held      bitmap
	heldPages int
	// Primary only, under Memory.mu: the pages of the Alloc and Free
	// calls whose events are being delivered, outside the memory lock
	// (see Subscribe).
	allocating, freeing bitmap
	// Primary only, under Memory.mu: the pages of the frees whose guards
	// have not answered yet (a subset of freeing).
	guarding bitmap
}

func (l *list) end() uintptr       { return l.base + uintptr(l.size()) }
func (l *list) size() uint64       { return uint64(l.pages) * l.pageSize }
func (l *list) addr(i int) uintptr { return l.base + uintptr(uint64(i)*l.pageSize) }
func (l *list) fd() int            { return int(l.f.Fd()) }

// spec is a list's fixed description, from a Config or from descriptors.
type spec struct {
	base     uintptr
	pageSize uint64
	pages    int
	kind     Kind
	path     string
	bitsOff  uint64 // page bitmap, from descriptors
}

// FileName returns the backing file name of list n of instance prefix.
func FileName(prefix string, n int) string {
	return "mpmr." + prefix + ".msl" + strconv.Itoa(n)
}

// RemoveFiles deletes the backing files of instance prefix in dir that an
// instance left behind when it died. It removes only what it can prove is
// such a file: a regular file of this process's user on which no live
// process holds the lock that Create takes for the Memory's lifetime.
// A file of a live Memory fails it with ErrInUse, a file of another user
// (or not a regular file) with ErrNotOwned; such files are left alone,
// the others are removed. Memory still mapped by live processes stays
// until they unmap it. Whoever holds a backing file open (a secondary is
// handed them) may lock it as Create does, and keep it from being
// removed here for as long as it likes: a caller that can prove the
// instance's end otherwise uses RemoveEndedFiles.
func RemoveFiles(dir, prefix string) error {
	return removeFiles(dir, prefix, ofd.ClaimFile)
}

// RemoveEndedFiles is RemoveFiles for a caller that has proven by other
// means that the instance ended (a primary holds a lock of its own, on a
// file it hands to nobody): it removes the instance's regular files of
// this process's user whatever locks are held on them. The lock Create
// takes proves nothing once the files have been handed to other
// processes, which may lock them too.
func RemoveEndedFiles(dir, prefix string) error {
	return removeFiles(dir, prefix, ofd.ClaimEnded)
}

func removeFiles(dir, prefix string, claim func(path string, uid int) (*ofd.Claim, error)) error {
	if err := checkPrefix(prefix); err != nil {
		return err
	}
	ents, err := os.ReadDir(dir)
	if err != nil {
		return fmt.Errorf("hugetlb: remove files of %q: %w", prefix, err)
	}
	var errs []error
	for _, e := range ents {
		n, ok := strings.CutPrefix(e.Name(), "mpmr."+prefix+".msl")
		if _, err := strconv.ParseUint(n, 10, 32); !ok || err != nil {
			continue
		}
		if err := removeDead(filepath.Join(dir, e.Name()), claim); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// removeDead removes the backing file at path if claim proves that no
// live Memory holds it and it is this user's.
func removeDead(path string, claim func(path string, uid int) (*ofd.Claim, error)) error {
	c, err := claim(path, os.Geteuid())
	switch {
	case errors.Is(err, os.ErrNotExist):
		return nil
	case errors.Is(err, ofd.ErrLocked):
		return fmt.Errorf("%w: %s: a live process holds it", ErrInUse, path)
	case errors.Is(err, ofd.ErrNotOwned):
		return fmt.Errorf("%w: %w", ErrNotOwned, err)
	case err != nil:
		return fmt.Errorf("hugetlb: %w", err)
	}
	if err := c.Remove(); err != nil {
		return fmt.Errorf("hugetlb: %w", err)
	}
	return nil
}

func checkPrefix(p string) error {
	if p == "" || len(p) > 100 || strings.ContainsAny(p, "/\x00") {
		return fmt.Errorf("hugetlb: bad instance prefix %q (want 1..100 characters without '/' or NUL)", p)
	}
	return nil
}

// plan checks cfg and works out each list's place.
func plan(cfg *Config) ([]spec, error) {
	b := cfg.Backend
	if err := checkPrefix(cfg.Prefix); err != nil {
		return nil, err
	}
	if b.Kind != Hugetlbfs && b.Kind != Tmpfs {
		return nil, fmt.Errorf("hugetlb: backend kind %s: want hugetlbfs or tmpfs (use Choose)", b.Kind)
	}
	if len(cfg.Lists) == 0 || len(cfg.Lists) > MaxLists {
		return nil, fmt.Errorf("hugetlb: %d memseg lists, want 1..%d", len(cfg.Lists), MaxLists)
	}
	var dirPage uint64
	if b.Kind == Hugetlbfs {
		page, huge, err := falloc.DirBlockSize(b.Dir)
		if err != nil {
			return nil, fmt.Errorf("hugetlb: backend: %w", err)
		}
		if !huge {
			return nil, fmt.Errorf("%w: %s is not on hugetlbfs", ErrNoMount, b.Dir)
		}
		dirPage = page
	}
	specs := make([]spec, len(cfg.Lists))
	for i, lc := range cfg.Lists {
		s := spec{pageSize: lc.PageSize, pages: lc.Pages, base: lc.Base, kind: b.Kind,
			path: filepath.Join(b.Dir, FileName(cfg.Prefix, i))}
		if s.pageSize == 0 {
			s.pageSize = b.PageSize
		}
		switch {
		case s.pageSize < uint64(vm.PageSize) || s.pageSize > maxPageSize || s.pageSize&(s.pageSize-1) != 0:
			return nil, fmt.Errorf("hugetlb: list %d: page size %d, want a power of two from %d to %s",
				i, s.pageSize, vm.PageSize, FormatSize(maxPageSize))
		case dirPage != 0 && s.pageSize != dirPage:
			return nil, fmt.Errorf("hugetlb: list %d: page size %s, but the hugetlbfs mount %s has %s pages",
				i, FormatSize(s.pageSize), b.Dir, FormatSize(dirPage))
		case s.pages < 1 || s.pages > MaxPages:
			return nil, fmt.Errorf("hugetlb: list %d: %d pages, want 1..%d", i, s.pages, MaxPages)
		case len(s.path) > maxPathLen:
			return nil, fmt.Errorf("hugetlb: list %d: backing file path %s longer than %d bytes", i, s.path, maxPathLen)
		}
		if s.base == 0 {
			s.base = DefaultBase
			if i > 0 {
				prev := specs[i-1]
				align := uintptr(max(listAlign, s.pageSize))
				s.base = (prev.base + uintptr(uint64(prev.pages)*prev.pageSize) + listGap + align - 1) &^ (align - 1)
			}
		}
		if err := checkPlace(s); err != nil {
			return nil, fmt.Errorf("hugetlb: list %d: %w (ListConfig.Base)", i, err)
		}
		for j := range i {
			if overlaps(s, specs[j]) {
				return nil, fmt.Errorf("hugetlb: list %d at [0x%x, 0x%x) overlaps list %d at [0x%x, 0x%x) (ListConfig.Base)",
					i, s.base, s.end(), j, specs[j].base, specs[j].end())
			}
		}
		specs[i] = s
	}
	return specs, nil
}

func (s spec) end() uintptr { return s.base + uintptr(uint64(s.pages)*s.pageSize) }

func checkPlace(s spec) error {
	size := uint64(s.pages) * s.pageSize
	switch {
	case s.base == 0 || uint64(s.base)%s.pageSize != 0:
		return fmt.Errorf("base 0x%x not aligned to the page size %s", s.base, FormatSize(s.pageSize))
	case uint64(s.base) >= maxUserAddr || size > maxUserAddr-uint64(s.base):
		return fmt.Errorf("range [0x%x, +%s) goes past the user address space (0x%x)", s.base, FormatSize(size), uint64(maxUserAddr))
	}
	return nil
}

func overlaps(a, b spec) bool { return a.base < b.end() && b.base < a.end() }

// Create lays out the data memory described by cfg in seg (whose owner the
// caller must be): for each list it creates the backing file, reserves the
// list's whole address range at its base with no access, and writes the
// list's descriptor, then publishes the descriptor table under root
// shm.RootMemory. No page is allocated yet. The caller becomes the primary.
func Create(seg *shm.Segment, cfg Config) (*Memory, error) {
	if !seg.Owner() {
		return nil, fmt.Errorf("hugetlb: create: %w (%w)", ErrNotPrimary, shm.ErrNotOwner)
	}
	if seg.Root(shm.RootMemory) != 0 {
		return nil, fmt.Errorf("%w: segment %s already holds a memory table", ErrExists, seg.Path())
	}
	specs, err := plan(&cfg)
	if err != nil {
		return nil, err
	}
	m := &Memory{seg: seg, primary: true, log: logger(cfg.Logger)}
	var blocks []uint64
	fail := func(err error) (*Memory, error) {
		m.release(true)
		for _, off := range blocks {
			_ = seg.Free(off)
		}
		return nil, fmt.Errorf("hugetlb: create: %w", err)
	}
	tableOff, err := seg.Alloc(tableHeaderSize+uint64(len(specs))*listDescSize, 64)
	if err != nil {
		return fail(err)
	}
	blocks = append(blocks, tableOff)
	m.table = shm.At[tableHeader](seg, tableOff)
	descs := shm.Slice[listDesc](seg, tableOff+tableHeaderSize, len(specs))
	for i, s := range specs {
		bitsOff, err := seg.Alloc(uint64(words(s.pages))*8, 64)
		if err != nil {
			return fail(err)
		}
		blocks = append(blocks, bitsOff)
		l := &list{index: i, base: s.base, pageSize: s.pageSize, pages: s.pages, kind: s.kind, path: s.path,
			desc: &descs[i], state: shm.Slice[uint64](seg, bitsOff, words(s.pages)), mapped: make(bitmap, words(s.pages)),
			lost: make(bitmap, words(s.pages)),
			held: make(bitmap, words(s.pages)), allocating: make(bitmap, words(s.pages)), freeing: make(bitmap, words(s.pages)),
			guarding: make(bitmap, words(s.pages))}
		m.lists = append(m.lists, l)
		f, err := os.OpenFile(s.path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
		if errors.Is(err, os.ErrExist) {
			why := "left by an instance that ended? see RemoveFiles"
			if who := owner.Foreign(s.path); who != "" {
				why = who + ": not an instance's file"
			}
			return fail(fmt.Errorf("%w: backing file %s (%s)", ErrExists, s.path, why))
		}
		if err != nil {
			return fail(err)
		}
		l.f = f
		// Held for the Memory's lifetime: whoever finds the file can tell
		// a live instance's from a dead one's (RemoveFiles), unless a
		// process it was handed to locks it too (see RemoveEndedFiles).
		if err := ofd.TryLock(f, 0, true); err != nil {
			return fail(err)
		}
		// The size covers the whole list; blocks come with fallocate.
		if err := f.Truncate(int64(l.size())); err != nil {
			return fail(fmt.Errorf("size %s: %w", s.path, err))
		}
		if err := m.reserve(l, "set ListConfig.Base to a free range"); err != nil {
			return fail(err)
		}
		d := l.desc
		atomic.StoreUint64(&d.Base, uint64(s.base))
		atomic.StoreUint64(&d.PageSize, s.pageSize)
		atomic.StoreUint64(&d.Capacity, uint64(s.pages))
		atomic.StoreUint64(&d.Allocated, 0)
		atomic.StoreUint64(&d.BitsOff, bitsOff)
		atomic.StoreUint32(&d.Kind, uint32(s.kind))
		atomic.StoreUint32(&d.FileLen, uint32(len(s.path)))
		putPath(&d.File, s.path)
	}
	h := m.table
	atomic.StoreUint32(&h.Version, tableVersion)
	atomic.StoreUint32(&h.Lists, uint32(len(specs)))
	atomic.StoreUint32(&h.State, tableLive)
	atomic.StoreUint64(&h.Gen, 0)
	atomic.StoreUint64(&h.Magic, tableMagic)
	if err := seg.SetRoot(shm.RootMemory, tableOff); err != nil {
		return fail(err)
	}
	for _, l := range m.lists {
		m.log.Info("memseg list created", "list", l.index, "base", fmt.Sprintf("0x%x", l.base),
			"page_size", FormatSize(l.pageSize), "pages", l.pages, "backend", l.kind, "file", l.path)
	}
	return m, nil
}

// Attach maps the data memory whose descriptors the primary published in
// seg: it reserves every list's address range at the same address as in the
// primary and maps the pages allocated there. If any part of a range is
// already taken in this process, it fails with ErrAddressInUse.
//
// Attach takes a consistent snapshot of the page state, but the primary may
// change pages right after it. The process that keeps secondaries in step
// must therefore make sure a secondary hears of every change made after its
// snapshot: for instance, the primary registers a secondary for MapPages and
// UnmapPages requests while holding the memory read lock (which excludes
// Alloc and Free with their events), and the secondary attaches only after
// that registration.
func Attach(seg *shm.Segment, o AttachOptions) (*Memory, error) {
	table, descs, specs, err := readTable(seg)
	if err != nil {
		return nil, fmt.Errorf("hugetlb: attach: %w", err)
	}
	files := o.Files // those not yet a list's
	defer func() {
		for _, f := range files {
			f.Close()
		}
	}()
	if files != nil && len(files) != len(specs) {
		return nil, fmt.Errorf("hugetlb: attach: %w: %d lists, %d backing files handed over", ErrBadDescriptor, len(specs), len(files))
	}
	m := &Memory{seg: seg, log: logger(o.Logger), table: table}
	fail := func(err error) (*Memory, error) {
		m.release(false)
		return nil, fmt.Errorf("hugetlb: attach: %w", err)
	}
	for i, s := range specs {
		d := &descs[i]
		l := &list{index: i, base: s.base, pageSize: s.pageSize, pages: s.pages, kind: s.kind, path: s.path, desc: d,
			state:  shm.Slice[uint64](seg, s.bitsOff, words(s.pages)),
			mapped: make(bitmap, words(s.pages)), lost: make(bitmap, words(s.pages))}
		m.lists = append(m.lists, l)
		if err := m.reserve(l, "start the primary with another base address (ListConfig.Base, the runtime's memory base setting)"); err != nil {
			return fail(err)
		}
		var f *os.File
		if files != nil {
			f, files = files[0], files[1:]
		}
		f, err := openBacking(s, f)
		if err != nil {
			return fail(err)
		}
		l.f = f
	}
	m.mu.Lock()
	err = m.resyncLocked()
	m.mu.Unlock()
	if err != nil {
		return fail(err)
	}
	return m, nil
}

// openBacking checks that f, or the file at the list's path when f is
// nil, can back the list, and returns it open. f is closed if not.
func openBacking(s spec, f *os.File) (*os.File, error) {
	if f == nil {
		var err error
		if f, err = os.OpenFile(s.path, os.O_RDWR|unix.O_NOFOLLOW, 0); err != nil {
			return nil, fmt.Errorf("open backing file: %w", err)
		}
	}
	page, huge, err := falloc.BlockSize(int(f.Fd()))
	var st unix.Stat_t
	if err == nil {
		err = unix.Fstat(int(f.Fd()), &st)
	}
	fl := 0
	if err == nil {
		fl, err = unix.FcntlInt(f.Fd(), unix.F_GETFL, 0)
	}
	switch {
	case err != nil:
	case st.Mode&unix.S_IFMT != unix.S_IFREG:
		err = fmt.Errorf("%w: %s is not a regular file", ErrBadDescriptor, s.path)
	case fl&unix.O_ACCMODE != unix.O_RDWR:
		err = fmt.Errorf("%w: %s is not open for reading and writing", ErrBadDescriptor, s.path)
	case (s.kind == Hugetlbfs) != huge:
		err = fmt.Errorf("%w: %s: descriptor says %s, file is on %s", ErrBadDescriptor, s.path, s.kind, fsName(huge))
	case huge && page != s.pageSize:
		err = fmt.Errorf("%w: %s: descriptor says %s pages, file system has %s", ErrBadDescriptor, s.path,
			FormatSize(s.pageSize), FormatSize(page))
	case uint64(st.Size) < uint64(s.pages)*s.pageSize:
		err = fmt.Errorf("%w: %s has %d bytes, the list needs %d", ErrBadDescriptor, s.path, st.Size, uint64(s.pages)*s.pageSize)
	}
	if err != nil {
		f.Close()
		return nil, err
	}
	return f, nil
}

// BackingFiles opens again the backing files of lists first to
// first+max-1 (fewer past the last), for a primary to hand to a
// secondary's Attach (AttachOptions.Files), and returns them with the
// number of lists. The caller closes them.
func (m *Memory) BackingFiles(first, max int) ([]*os.File, int, error) {
	m.qmu.RLock()
	defer m.qmu.RUnlock()
	if m.closed.Load() {
		return nil, 0, fmt.Errorf("hugetlb: backing files: %w", ErrClosed)
	}
	var out []*os.File
	for i := first; i >= 0 && i < len(m.lists) && len(out) < max; i++ {
		// A new open file description of the same file, not a duplicate
		// of this one: the creator's lock on the file is its description's,
		// and must not outlive the creator in the processes it is handed to.
		l := m.lists[i]
		f, err := os.OpenFile("/proc/self/fd/"+strconv.Itoa(int(l.f.Fd())), os.O_RDWR, 0)
		if err != nil {
			for _, f := range out {
				f.Close()
			}
			return nil, 0, fmt.Errorf("hugetlb: backing file of list %d: %w", i, err)
		}
		out = append(out, f)
	}
	return out, len(m.lists), nil
}

func fsName(huge bool) string {
	if huge {
		return "hugetlbfs"
	}
	return "another file system"
}

// reserve reserves l's address range, or says who holds it.
func (m *Memory) reserve(l *list, knob string) error {
	if _, err := vm.Reserve(l.base, uintptr(l.size())); err != nil {
		if errors.Is(err, vm.ErrRangeTaken) {
			return fmt.Errorf("%w: list %d needs [0x%x, 0x%x), where this process (pid %d) already maps %s; %s",
				ErrAddressInUse, l.index, l.base, l.end(), os.Getpid(), describeOccupants(l.base, l.end()), knob)
		}
		return fmt.Errorf("list %d: %w", l.index, err)
	}
	l.reserved = true
	return nil
}

// readTable reads and validates the descriptors under shm.RootMemory. The
// bytes were written by another process: each field is read once, checked,
// and only the checked copy is used.
func readTable(seg *shm.Segment) (*tableHeader, []listDesc, []spec, error) {
	h, descs, specs, err := readDescriptors(seg)
	if err != nil {
		return nil, nil, nil, err
	}
	if st := atomic.LoadUint32(&h.State); st != tableLive {
		if st == tableClosed {
			return nil, nil, nil, fmt.Errorf("the primary closed its memory: %w", ErrClosed)
		}
		return nil, nil, nil, fmt.Errorf("%w: table state %d", ErrBadDescriptor, st)
	}
	return h, descs, specs, nil
}

// readDescriptors is readTable without the check of the table's state.
func readDescriptors(seg *shm.Segment) (*tableHeader, []listDesc, []spec, error) {
	off := seg.Root(shm.RootMemory)
	if off == 0 {
		return nil, nil, nil, fmt.Errorf("%w: segment %s has no memory table (the primary has not created its memory)",
			ErrBadDescriptor, seg.Path())
	}
	if off%64 != 0 || seg.CheckRange(off, tableHeaderSize) != nil {
		return nil, nil, nil, fmt.Errorf("%w: table offset 0x%x outside the segment", ErrBadDescriptor, off)
	}
	h := shm.At[tableHeader](seg, off)
	if magic := atomic.LoadUint64(&h.Magic); magic != tableMagic {
		return nil, nil, nil, fmt.Errorf("%w: table magic 0x%016x", ErrBadDescriptor, magic)
	}
	if v := atomic.LoadUint32(&h.Version); v != tableVersion {
		return nil, nil, nil, fmt.Errorf("%w: table version %d, this build %d", ErrBadDescriptor, v, tableVersion)
	}
	n := int(atomic.LoadUint32(&h.Lists))
	if n < 1 || n > MaxLists || seg.CheckRange(off+tableHeaderSize, uint64(n)*listDescSize) != nil {
		return nil, nil, nil, fmt.Errorf("%w: %d lists", ErrBadDescriptor, n)
	}
	descs := shm.Slice[listDesc](seg, off+tableHeaderSize, n)
	specs := make([]spec, n)
	for i := range descs {
		s, err := readDesc(seg, &descs[i])
		if err != nil {
			return nil, nil, nil, fmt.Errorf("%w: list %d: %v", ErrBadDescriptor, i, err)
		}
		for j := range i {
			if overlaps(s, specs[j]) {
				return nil, nil, nil, fmt.Errorf("%w: list %d overlaps list %d", ErrBadDescriptor, i, j)
			}
		}
		specs[i] = s
	}
	return h, descs, specs, nil
}

func readDesc(seg *shm.Segment, d *listDesc) (spec, error) {
	s := spec{
		base:     uintptr(atomic.LoadUint64(&d.Base)),
		pageSize: atomic.LoadUint64(&d.PageSize),
		kind:     Kind(atomic.LoadUint32(&d.Kind)),
	}
	capacity := atomic.LoadUint64(&d.Capacity)
	bitsOff := atomic.LoadUint64(&d.BitsOff)
	fileLen := atomic.LoadUint32(&d.FileLen)
	switch {
	case s.pageSize < uint64(vm.PageSize) || s.pageSize > maxPageSize || s.pageSize&(s.pageSize-1) != 0:
		return s, fmt.Errorf("page size %d", s.pageSize)
	case capacity < 1 || capacity > MaxPages:
		return s, fmt.Errorf("capacity %d pages", capacity)
	case s.kind != Hugetlbfs && s.kind != Tmpfs:
		return s, fmt.Errorf("backend kind %d", int(s.kind))
	case fileLen < 2 || fileLen > maxPathLen:
		return s, fmt.Errorf("file name length %d", fileLen)
	case bitsOff%8 != 0 || seg.CheckRange(bitsOff, uint64(words(int(capacity)))*8) != nil:
		return s, fmt.Errorf("page bitmap at 0x%x outside the segment", bitsOff)
	}
	s.pages = int(capacity)
	s.bitsOff = bitsOff
	if err := checkPlace(s); err != nil {
		return s, err
	}
	s.path = getPath(&d.File, int(fileLen))
	if !filepath.IsAbs(s.path) || strings.IndexByte(s.path, 0) >= 0 || filepath.Clean(s.path) != s.path {
		return s, fmt.Errorf("file name %q", s.path)
	}
	return s, nil
}

func putPath(dst *[fileWords]uint64, p string) {
	var b [maxPathLen]byte
	copy(b[:], p)
	for i := range dst {
		var w uint64
		for j := 7; j >= 0; j-- {
			w = w<<8 | uint64(b[i*8+j])
		}
		atomic.StoreUint64(&dst[i], w)
	}
}

func getPath(src *[fileWords]uint64, n int) string {
	var b [maxPathLen]byte
	for i := range src {
		w := atomic.LoadUint64(&src[i])
		for j := range 8 {
			b[i*8+j] = byte(w >> (8 * j))
		}
	}
	return string(b[:n])
}

func logger(l *slog.Logger) *slog.Logger {
	if l != nil {
		return l
	}
	return slog.Default()
}

// Primary reports whether this process created the memory.
func (m *Memory) Primary() bool { return m.primary }

// RLock takes the memory read lock: while it is held, no page changes
// state, no Alloc or Free (in the primary) is in its checks or its
// changes, and no MapPages, UnmapPages or Resync (in a secondary) runs, so
// the allocated pages and the answers of the queries stay as they are. In
// the primary an Alloc or a Free may be delivering its events meanwhile
// (that runs outside the lock): the pages of such a Free are still
// allocated, and Freeing reports them. The MR cache takes it to re-check a
// contiguous chunk before registering it. The lock is process-local. Lock
// order: the memory lock before the cache's locks. Do not call RLock from
// an event callback in a secondary: the write lock is held there.
func (m *Memory) RLock() { m.mu.RLock() }

// RUnlock releases the memory read lock.
func (m *Memory) RUnlock() { m.mu.RUnlock() }

// Freeing reports whether any page of [addr, addr+n) is being freed: a
// Free of the primary has taken it, its guards have let it go ahead, and
// it has not yet returned. While Free delivers EventFree (its secondaries
// unmapping the page) the page is still allocated to the queries, but
// nothing may come to refer to it; then it is free, and Free punches it
// out of its backing file. While the guards of such a Free have not
// answered yet (they may refuse it, and then nothing changes), Freeing
// returns a channel instead, closed once they have: release the read
// lock, wait for it, and ask again. Call it with RLock held for an answer
// that stays true until RUnlock. Always false in a secondary.
func (m *Memory) Freeing(addr uintptr, n uint64) (freeing bool, undecided <-chan struct{}) {
	if !m.primary || n == 0 {
		return false, nil
	}
	for _, l := range m.lists {
		if addr >= l.end() || addr+uintptr(n) <= l.base {
			continue
		}
		first := int(uint64(max(addr, l.base)-l.base) / l.pageSize)
		last := int((uint64(min(addr+uintptr(n), l.end())-l.base) - 1) / l.pageSize)
		if l.guarding.next(first, last+1, true) <= last {
			return false, m.decided
		}
		if l.freeing.next(first, last+1, true) <= last {
			freeing = true
		}
	}
	return freeing, nil
}

// HoldChanges waits until no Alloc or Free of the primary is under way,
// events included, and keeps new ones from starting until release is
// called. The primary's hello takes it: a secondary that joins then maps
// what the shared descriptors say, and follows every change from there.
// It may wait as long as a subscriber takes (a secondary's
// acknowledgement, in the primary). Do not call it from an event callback.
func (m *Memory) HoldChanges() (release func()) {
	m.chMu.Lock()
	return m.chMu.Unlock
}

// Close releases this process's view: it unmaps every list (pages and
// reservation) and closes the backing files. The primary also marks the
// descriptors closed, so later attaches fail, and removes the backing files,
// so the hugepages go back to the kernel once no process maps them any
// more. No events are delivered; the Alloc and Free calls under way finish
// first, events included. Close the Memory before its segment. Close
// is idempotent (a later call reports what the first one did: a mapping it
// could not undo stays an error); other methods fail with ErrClosed
// afterwards and the queries report nothing.
func (m *Memory) Close() error {
	m.chMu.Lock() // the Alloc and Free calls under way finish first
	defer m.chMu.Unlock()
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed.Load() {
		return m.closeErr // a mapping that could not be undone stays an error
	}
	m.qmu.Lock()
	m.closed.Store(true)
	m.qmu.Unlock()
	if m.primary {
		atomic.StoreUint32(&m.table.State, tableClosed)
		m.waitAsking(askWait)
	}
	m.closeErr = m.release(m.primary)
	return m.closeErr
}

// release unmaps and closes whatever the lists hold, removing the files if
// remove is set.
func (m *Memory) release(remove bool) error {
	var errs []error
	for _, l := range m.lists {
		if l.reserved {
			// Around the lost pages: what holds them now is not ours.
			eachRun(l.lost, 0, l.pages, false, func(a, b int) {
				if err := vm.Unmap(l.addr(a), uintptr(uint64(b-a)*l.pageSize)); err != nil {
					errs = append(errs, err)
				}
			})
			l.reserved = false
			l.mapped.clearRange(0, l.pages)
		}
		if l.f != nil {
			// Removed before it is closed, while the lock shows it live.
			if remove {
				if err := os.Remove(l.path); err != nil && !errors.Is(err, os.ErrNotExist) {
					errs = append(errs, err)
				}
			}
			if err := l.f.Close(); err != nil {
				errs = append(errs, err)
			}
			l.f = nil
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("hugetlb: close: %w", err)
	}
	return nil
}
