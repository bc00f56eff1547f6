package verbs

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"
	"os"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/mpmr/mpmr/internal/sys/vm"
	"github.com/mpmr/mpmr/shm"
)

// Bounds of SoftOptions.MaxMRs. The limit keeps every index below 1<<24-1,
// so no key is ever InvalidKey.
const (
	DefaultMaxMRs = 4096
	MaxMRsLimit   = 1 << 20
)

const (
	variantBits = 8
	variantMask = 1<<variantBits - 1
	variants    = variantMask // variants run 1..255; 0 would allow key 0
)

// variantOf returns the variant of the uses-th key a slot hands out.
func variantOf(uses uint32) uint32 { return (uses-1)%variants + 1 }

// SoftOptions configure CreateSoft.
type SoftOptions struct {
	// MaxMRs bounds the MR table (1..MaxMRsLimit). Default DefaultMaxMRs.
	MaxMRs int
	// Logger receives diagnostics. Default slog.Default().
	Logger *slog.Logger
}

// SGE is a scatter-gather element: what a work request hands the device.
// It is a plain value.
type SGE struct {
	Addr uintptr
	Len  uint32
	Key  uint32
}

func (s SGE) String() string {
	return fmt.Sprintf("{addr 0x%x len %d key 0x%x}", s.Addr, s.Len, s.Key)
}

// SoftStats are the soft device's counters. They live in the segment, so
// every process reads the same figures, and they are read as one
// consistent set.
type SoftStats struct {
	MaxMRs          int    `json:"max_mrs"`
	Registrations   uint64 `json:"registrations"`   // successful registrations since creation
	Deregistrations uint64 `json:"deregistrations"` // deregistrations, explicit or by Close
	LiveMRs         uint64 `json:"live_mrs"`        // Registrations - Deregistrations
	PinnedBytes     uint64 `json:"pinned_bytes"`    // bytes of live MRs pinned: mlocked, or in a Resident range
	UnpinnedMRs     uint64 `json:"unpinned_mrs"`    // live MRs registered without a pin (see RegMR)
}

// Soft is one process's handle on the soft device: a software HCA whose MR
// table lives in the control segment.
//
// The Soft returned by CreateSoft, in the segment's owner, is the only one
// that may register and deregister (through its PDs); it alone writes the
// shared state, serialised by a process-local mutex, and decides from its
// own record of what it registered, never from what it reads back: any
// process of the user may write the segment, and a word forged there
// changes at most what readers see, never which slot, hole, key or PD
// number the owner hands out next. A Soft from
// AttachSoft, in any process, validates, copies and reads counters; its
// PDs' RegMR and DeregMR fail with ErrPermission.
//
// Registering checks that the range is mapped readable in the calling
// process (ErrNotMapped otherwise, never a later crash) and pins it with
// mlock, page by page counted, so deregistering one of two overlapping MRs
// leaves the shared pages pinned. Pinning is best effort: hugetlbfs pages
// are resident anyway (mlock skips them; they count as pinned, and ranges
// declared with Resident are not mlocked at all), and when mlock fails
// because RLIMIT_MEMLOCK is too low and the process lacks CAP_IPC_LOCK, the
// MR is registered unpinned, the first such failure is logged as a warning
// and SoftStats.UnpinnedMRs counts them.
//
// All methods are safe for concurrent use. The segment must stay open
// while the Soft is in use: Close the Soft first.
type Soft struct {
	hdr    *softHeader
	table  []mrSlot
	holes  []hole
	log    *slog.Logger
	closed atomic.Bool
	own    *owner // nil unless made by CreateSoft
}

// owner is the creator's process-local registration state. It is the
// owner's only record of what it registered: the slots and holes in the
// segment are written for readers and never read back, because every
// process of the user maps the segment writable and may have changed
// them.
type owner struct {
	mu        sync.Mutex
	free      []uint32 // ring of free slots: reused oldest-freed first
	head, n   int
	slots     []ownSlot   // by slot index
	holes     []holeRange // by hole index: the range of a hole in use
	pinned    pinSet      // MRs mlock pinned, by slot, in whole pages
	resident  []span      // ranges the kernel keeps resident (Resident)
	pinWarned bool
	freeHoles []uint32 // stack of free hole indexes
	nextPD    uint32   // last PD number handed out
}

// ownSlot is the owner's record of one slot: what it published there.
type ownSlot struct {
	key    uint32 // 0: free
	pd     uint32
	addr   uint64
	len    uint64
	uses   uint32   // keys the slot has handed out
	pinned bool     // counted in PinnedBytes (else in UnpinnedMRs)
	holes  []uint32 // hole indexes, oldest first; the segment's list runs newest first
}

// holeRange is the owner's record of a hole: [lo, hi).
type holeRange struct{ lo, hi uint64 }

// span is a page-rounded address range [lo, hi).
type span struct{ lo, hi uintptr }

// createMu keeps two CreateSoft calls in one process from both finding the
// root unset.
var createMu sync.Mutex

// CreateSoft creates the soft device in seg's arena and publishes it in
// shm.RootDevice. Only the segment's owner may, once per segment (a second
// call fails with ErrExists, even after Close). Create it before marking
// the segment ready so that attachers find it.
func CreateSoft(seg *shm.Segment, o SoftOptions) (*Soft, error) {
	if !seg.Owner() {
		return nil, fmt.Errorf("verbs: create soft device in %s: %w: only the segment owner may", seg.Path(), ErrPermission)
	}
	n := o.MaxMRs
	if n == 0 {
		n = DefaultMaxMRs
	}
	if n < 1 || n > MaxMRsLimit {
		return nil, fmt.Errorf("verbs: create soft device: MaxMRs %d, want 1..%d", n, MaxMRsLimit)
	}
	log := o.Logger
	if log == nil {
		log = slog.Default()
	}
	createMu.Lock()
	defer createMu.Unlock()
	if seg.Root(shm.RootDevice) != 0 {
		return nil, fmt.Errorf("verbs: create soft device in %s: %w", seg.Path(), ErrExists)
	}
	nh := n * holesPerMR
	off, err := seg.Alloc(headerBytes+uint64(n)*slotBytes+uint64(nh)*holeBytes, lineBytes)
	if err != nil {
		return nil, fmt.Errorf("verbs: create soft device with %d MR slots: %w", n, err)
	}
	h := shm.At[softHeader](seg, off)
	holesOff := off + headerBytes + uint64(n)*slotBytes
	atomic.StoreUint32(&h.Version, softVersion)
	atomic.StoreUint32(&h.MaxMRs, uint32(n))
	atomic.StoreUint64(&h.TableOff, off+headerBytes)
	atomic.StoreUint32(&h.Holes, uint32(nh))
	atomic.StoreUint64(&h.HolesOff, holesOff)
	atomic.StoreUint32(&h.State, softOpen)
	atomic.StoreUint32(&h.OwnerPID, uint32(os.Getpid()))
	// The magic goes in last: a reader that sees it sees a whole header.
	atomic.StoreUint64(&h.Magic, softMagic)
	if err := seg.SetRoot(shm.RootDevice, off); err != nil {
		_ = seg.Free(off)
		return nil, fmt.Errorf("verbs: create soft device: %w", err)
	}
	own := &owner{free: make([]uint32, n), n: n, slots: make([]ownSlot, n), holes: make([]holeRange, nh),
		pinned: newPinSet(n), freeHoles: make([]uint32, nh)}
	for i := range own.free {
		own.free[i] = uint32(i)
	}
	for i := range own.freeHoles {
		own.freeHoles[i] = uint32(nh - 1 - i)
	}
	// Registrations write the records of their slots, which they take in
	// turn around the ring: backed now, so that a registration does not
	// fault on its slot's page (once every 73 slots until the ring has
	// gone round, and once every 256 on the pin set's for memory pinned
	// with mlock). What grows with the MRs alive at once (holes, taken
	// from a stack, and the pin set's ordered list) faults only when that
	// count reaches a new height, and is left to grow.
	vm.Prefault(own.slots)
	vm.Prefault(own.pinned.bySlot)
	d := &Soft{hdr: h, table: shm.Slice[mrSlot](seg, off+headerBytes, n), holes: shm.Slice[hole](seg, holesOff, nh),
		log: log, own: own}
	log.Debug("soft device created", "segment", seg.Path(), "max_mrs", n, "offset", off)
	return d, nil
}

// AttachSoft opens the soft device the segment's owner created, after
// checking its header. It fails with ErrNoDevice when there is none yet,
// ErrClosed when the owner closed it, and ErrCorrupt when the header does
// not hold together. The returned Soft cannot register (see Soft).
func AttachSoft(seg *shm.Segment) (*Soft, error) {
	off := seg.Root(shm.RootDevice)
	if off == 0 {
		return nil, fmt.Errorf("verbs: attach soft device in %s: %w: the primary has not created one", seg.Path(), ErrNoDevice)
	}
	if err := seg.CheckRange(off, headerBytes); err != nil || off%lineBytes != 0 {
		return nil, fmt.Errorf("verbs: attach soft device: %w: header at 0x%x", ErrCorrupt, off)
	}
	h := shm.At[softHeader](seg, off)
	if m := atomic.LoadUint64(&h.Magic); m != softMagic {
		return nil, fmt.Errorf("verbs: attach soft device: %w: magic 0x%016x", ErrCorrupt, m)
	}
	if v := atomic.LoadUint32(&h.Version); v != softVersion {
		return nil, fmt.Errorf("verbs: attach soft device: %w: version %d, this build %d", ErrCorrupt, v, softVersion)
	}
	n := atomic.LoadUint32(&h.MaxMRs)
	table := atomic.LoadUint64(&h.TableOff)
	if n < 1 || n > MaxMRsLimit || table%lineBytes != 0 || seg.CheckRange(table, uint64(n)*slotBytes) != nil {
		return nil, fmt.Errorf("verbs: attach soft device: %w: %d slots at 0x%x", ErrCorrupt, n, table)
	}
	nh := uint64(atomic.LoadUint32(&h.Holes))
	holesOff := atomic.LoadUint64(&h.HolesOff)
	if nh > uint64(n)*holesPerMR || holesOff%8 != 0 || seg.CheckRange(holesOff, nh*holeBytes) != nil {
		return nil, fmt.Errorf("verbs: attach soft device: %w: %d holes at 0x%x", ErrCorrupt, nh, holesOff)
	}
	switch s := atomic.LoadUint32(&h.State); s {
	case softOpen:
	case softClosed:
		return nil, fmt.Errorf("verbs: attach soft device in %s: %w", seg.Path(), ErrClosed)
	default:
		return nil, fmt.Errorf("verbs: attach soft device: %w: state %d", ErrCorrupt, s)
	}
	return &Soft{hdr: h, table: shm.Slice[mrSlot](seg, table, int(n)), holes: shm.Slice[hole](seg, holesOff, int(nh)),
		log: slog.Default()}, nil
}

// Name returns SoftName.
func (d *Soft) Name() string { return SoftName }

// Owner reports whether this Soft may register (it was made by CreateSoft).
func (d *Soft) Owner() bool { return d.own != nil }

// MaxMRs returns the MR table's length.
func (d *Soft) MaxMRs() int { return len(d.table) }

// AllocPD allocates a protection domain. Any process may; only the owner's
// PDs register.
func (d *Soft) AllocPD() (PD, error) {
	if d.closed.Load() {
		return nil, fmt.Errorf("verbs: alloc PD: %w", ErrClosed)
	}
	p := &softPD{d: d}
	if o := d.own; o != nil {
		o.mu.Lock()
		o.nextPD++
		p.id = o.nextPD
		atomic.StoreUint32(&d.hdr.NextPD, p.id)
		o.mu.Unlock()
	}
	return p, nil
}

// Close releases this process's handle. In the owner it first deregisters
// every live MR, so every process's keys stop validating, and marks the
// device closed so that nobody attaches any more. It is idempotent. The
// device's block stays in the segment.
func (d *Soft) Close() error {
	if d.own == nil {
		d.closed.Store(true)
		return nil
	}
	o := d.own
	o.mu.Lock()
	defer o.mu.Unlock()
	if d.closed.Load() {
		return nil
	}
	d.closed.Store(true)
	d.invalidateAllLocked(func(uint32) bool { return true })
	atomic.StoreUint32(&d.hdr.State, softClosed)
	return nil
}

// softPD is a protection domain of the soft device. Its number is recorded
// in the MRs it registers, so one PD cannot deregister another's MRs.
type softPD struct {
	d      *Soft
	id     uint32
	closed atomic.Bool
}

// RegMR registers [addr, addr+length): checked, pinned and published as
// the Soft documentation says. Owner only (ErrPermission elsewhere). A
// full table gives ErrNoResources.
func (p *softPD) RegMR(addr, length uintptr, access Access) (MR, error) {
	d := p.d
	if d.own == nil {
		return MR{}, fmt.Errorf("verbs: reg_mr [0x%x, +0x%x): %w: only the process that created the soft device registers", addr, length, ErrPermission)
	}
	if length == 0 || addr+length < addr {
		return MR{}, fmt.Errorf("verbs: reg_mr [0x%x, +0x%x): %w", addr, length, ErrBadRange)
	}
	if err := access.check(); err != nil {
		return MR{}, fmt.Errorf("verbs: reg_mr [0x%x, 0x%x): %w", addr, addr+length, err)
	}
	if err := vm.CheckReadable(addr, length); err != nil {
		return MR{}, fmt.Errorf("verbs: reg_mr [0x%x, 0x%x): %w: %w", addr, addr+length, ErrNotMapped, err)
	}
	o := d.own
	o.mu.Lock()
	defer o.mu.Unlock()
	if d.closed.Load() || p.closed.Load() {
		return MR{}, fmt.Errorf("verbs: reg_mr [0x%x, 0x%x): %w", addr, addr+length, ErrClosed)
	}
	if o.n == 0 {
		return MR{}, fmt.Errorf("verbs: reg_mr [0x%x, 0x%x): %w: all %d MR slots in use", addr, addr+length, ErrNoResources, len(d.table))
	}
	pin, err := d.pinLocked(addr, length)
	pinned := pin != pinNone
	if err != nil {
		return MR{}, fmt.Errorf("verbs: reg_mr [0x%x, 0x%x): %w", addr, addr+length, err)
	}
	idx := o.free[o.head]
	o.head = (o.head + 1) % len(o.free)
	o.n--

	s := &d.table[idx]
	own := &o.slots[idx]
	uses := own.uses + 1
	key := idx<<variantBits | variantOf(uses)
	var flags uint32
	if pinned {
		flags = slotPinned
	}
	if pin == pinMlock {
		o.pinned.add(idx, pageSpan(addr, length))
	}
	*own = ownSlot{key: key, pd: p.id, addr: uint64(addr), len: uint64(length), uses: uses, pinned: pinned, holes: own.holes[:0]}
	atomic.AddUint32(&s.Seq, 1) // odd: readers back off
	atomic.StoreUint64(&s.Addr, uint64(addr))
	atomic.StoreUint64(&s.Len, uint64(length))
	atomic.StoreUint32(&s.Access, uint32(access))
	atomic.StoreUint32(&s.PD, p.id)
	atomic.StoreUint32(&s.Uses, uses)
	atomic.StoreUint32(&s.Flags, flags)
	atomic.StoreUint32(&s.Key, key)
	atomic.AddUint32(&s.Seq, 1)

	h := d.hdr
	atomic.AddUint32(&h.StatSeq, 1)
	atomic.AddUint64(&h.Registrations, 1)
	if pinned {
		atomic.AddUint64(&h.PinnedBytes, uint64(length))
	} else {
		atomic.AddUint64(&h.Unpinned, 1)
	}
	atomic.AddUint32(&h.StatSeq, 1)

	mr := MR{Addr: addr, Len: length, LKey: key, RKey: key, Handle: idx, Access: access}
	if d.log.Enabled(context.Background(), slog.LevelDebug) {
		d.log.Debug("soft MR registered", "mr", mr, "pinned", pinned)
	}
	return mr, nil
}

// How a registered range is pinned.
const (
	pinNone     = iota // mlock failed: registered unpinned
	pinMlock           // mlocked: munlock it when it goes
	pinResident        // inside a Resident range: nothing to undo
)

// pinLocked pins the range: mlock, unless it lies in a range declared
// Resident. A failure is tolerated (and logged once) unless the range
// turns out to be no longer mapped. Called with the owner's mutex held.
func (d *Soft) pinLocked(addr, length uintptr) (int, error) {
	sp := pageSpan(addr, length)
	for _, r := range d.own.resident {
		if r.lo <= sp.lo && sp.hi <= r.hi {
			return pinResident, nil
		}
	}
	err := vm.Lock(addr, length)
	if err == nil {
		return pinMlock, nil
	}
	if cerr := vm.CheckReadable(addr, length); cerr != nil {
		return pinNone, fmt.Errorf("%w: %w", ErrNotMapped, cerr)
	}
	if !d.own.pinWarned {
		d.own.pinWarned = true
		d.log.Warn("verbs: cannot pin registered memory; registering it unpinned "+
			"(raise RLIMIT_MEMLOCK or grant CAP_IPC_LOCK); further failures are only counted",
			"addr", fmt.Sprintf("0x%x", addr), "len", length, "err", err)
	}
	return pinNone, nil
}

// Resident declares [addr, addr+length) memory the kernel keeps resident
// for as long as it is mapped, such as a hugetlbfs mapping: mlock neither
// locks nor counts hugetlb pages, so on such a range it would only fault
// the pages in, which the check every registration makes (that the range
// is mapped readable) has done already. Registrations that lie inside a
// resident range are therefore not mlocked, one system call less each,
// and count as pinned. Declaring a range that is not so makes its MRs
// count as pinned while the kernel may swap their pages. Owner only.
func (d *Soft) Resident(addr, length uintptr) error {
	if d.own == nil {
		return fmt.Errorf("verbs: resident [0x%x, +0x%x): %w: only the process that created the soft device", addr, length, ErrPermission)
	}
	if length == 0 || addr+length < addr {
		return fmt.Errorf("verbs: resident [0x%x, +0x%x): %w", addr, length, ErrBadRange)
	}
	d.own.mu.Lock()
	defer d.own.mu.Unlock()
	d.own.resident = append(d.own.resident, pageSpan(addr, length))
	return nil
}

func pageSpan(addr, length uintptr) span {
	return span{addr &^ (vm.PageSize - 1), (addr + length + vm.PageSize - 1) &^ (vm.PageSize - 1)}
}

// unpinLocked munlocks the pages of slot idx that no other pinned MR
// covers: mlock does not count, so unlocking an overlap would unpin a
// neighbour. Pages already unmapped (memory freed before its MR was
// deregistered) lost their lock with the mapping; munlock's complaint about
// them is expected. Called with the owner's mutex held.
func (d *Soft) unpinLocked(idx uint32) {
	if sp, ok := d.own.pinned.remove(idx); ok {
		d.unpinSpanLocked(sp)
	}
}

// unpinSpanLocked munlocks the pages of sp that no span left in the
// pinned set covers. Called with the owner's mutex held.
func (d *Soft) unpinSpanLocked(sp span) {
	cur := sp.lo
	unlock := func(lo, hi uintptr) {
		if err := vm.Unlock(lo, hi-lo); err != nil {
			d.log.Debug("soft MR unpin", "err", err)
		}
	}
	for _, s := range d.own.pinned.from(sp) {
		if s.lo >= sp.hi {
			break
		}
		if s.hi <= sp.lo {
			continue // ends before it
		}
		if s.lo > cur {
			unlock(cur, min(s.lo, sp.hi))
		}
		cur = max(cur, s.hi)
		if cur >= sp.hi {
			return
		}
	}
	unlock(cur, sp.hi)
}

// pinSet holds the spans of the MRs mlock pinned, by slot and in order of
// their starts, so that a span's overlaps are found without looking at
// every other span: deregistering each of thousands of MRs stays cheap.
// Both have room for every slot from the start, so that a registration
// allocates nothing.
type pinSet struct {
	bySlot []span   // by slot index; empty: not pinned
	byLo   []pinned // ordered by lo, then slot
	// longest is the length of the longest span in the set: no span
	// starting further back than that reaches a point. nLongest spans
	// have that length; when the last of them goes, the spans left are
	// walked for the next longest (rarely: lengths repeat).
	longest  uintptr
	nLongest int
}

func newPinSet(slots int) pinSet {
	return pinSet{bySlot: make([]span, slots), byLo: make([]pinned, 0, slots)}
}

type pinned struct {
	span
	slot uint32
}

func (p *pinSet) find(lo uintptr, slot uint32) (int, bool) {
	return slices.BinarySearchFunc(p.byLo, pinned{span{lo: lo}, slot}, func(a, b pinned) int {
		if c := cmp.Compare(a.lo, b.lo); c != 0 {
			return c
		}
		return cmp.Compare(a.slot, b.slot)
	})
}

func (p *pinSet) add(slot uint32, sp span) {
	p.bySlot[slot] = sp // never empty: it holds a page at least
	i, _ := p.find(sp.lo, slot)
	p.byLo = slices.Insert(p.byLo, i, pinned{sp, slot})
	p.count(sp.hi - sp.lo)
}

// count counts a span of length n in the set's longest.
func (p *pinSet) count(n uintptr) {
	switch {
	case n > p.longest:
		p.longest, p.nLongest = n, 1
	case n == p.longest:
		p.nLongest++
	}
}

func (p *pinSet) remove(slot uint32) (span, bool) {
	sp := p.bySlot[slot]
	if sp.hi == sp.lo {
		return span{}, false
	}
	p.bySlot[slot] = span{}
	if i, found := p.find(sp.lo, slot); found {
		p.byLo = slices.Delete(p.byLo, i, i+1)
	}
	if sp.hi-sp.lo == p.longest {
		if p.nLongest--; p.nLongest == 0 {
			p.longest = 0
			for _, s := range p.byLo {
				p.count(s.hi - s.lo)
			}
		}
	}
	return sp, true
}

// removeWhere takes the spans of the slots for which gone says so out of
// the set, in one pass, and returns them in order of their starts, those
// that overlap or touch merged.
func (p *pinSet) removeWhere(gone func(slot uint32) bool) []span {
	var out []span
	p.byLo = slices.DeleteFunc(p.byLo, func(s pinned) bool {
		if !gone(s.slot) {
			return false
		}
		p.bySlot[s.slot] = span{}
		if n := len(out); n > 0 && s.lo <= out[n-1].hi {
			out[n-1].hi = max(out[n-1].hi, s.hi)
		} else {
			out = append(out, s.span)
		}
		return true
	})
	p.longest, p.nLongest = 0, 0
	for _, s := range p.byLo {
		p.count(s.hi - s.lo)
	}
	return out
}

// from returns the spans, in order of their starts, from the first that
// could overlap sp on: those that do start before sp.hi, and end after
// sp.lo.
func (p *pinSet) from(sp span) []pinned {
	lo := uintptr(0)
	if sp.lo > p.longest {
		lo = sp.lo - p.longest
	}
	i, _ := p.find(lo, 0)
	return p.byLo[i:]
}

// slotLocked returns the index of the slot a key names, for the owner's
// operation op, or why there is none. Called with the owner's mutex held.
func (d *Soft) slotLocked(op string, key uint32) (uint32, error) {
	if d.closed.Load() {
		return 0, fmt.Errorf("verbs: %s key 0x%x: %w", op, key, ErrClosed)
	}
	idx := key >> variantBits
	if key&variantMask == 0 || idx >= uint32(len(d.table)) {
		return 0, fmt.Errorf("verbs: %s key 0x%x: %w", op, key, ErrInvalidKey)
	}
	return idx, nil
}

// DeregMR deregisters mr, which must be a live MR of this PD with the
// range it was registered with. The key stops validating in every process
// before the pages are unpinned. Owner only.
func (p *softPD) DeregMR(mr MR) error {
	d := p.d
	if d.own == nil {
		return fmt.Errorf("verbs: dereg_mr key 0x%x: %w: only the process that created the soft device deregisters", mr.LKey, ErrPermission)
	}
	o := d.own
	o.mu.Lock()
	defer o.mu.Unlock()
	idx, err := d.slotLocked("dereg_mr", mr.LKey)
	if err != nil {
		return err
	}
	switch s := &o.slots[idx]; {
	case s.key != mr.LKey:
		return fmt.Errorf("verbs: dereg_mr key 0x%x: %w (deregistered twice?)", mr.LKey, ErrStaleKey)
	case s.pd != p.id:
		return fmt.Errorf("verbs: dereg_mr key 0x%x: %w: registered by another protection domain", mr.LKey, ErrInvalidKey)
	case s.addr != uint64(mr.Addr) || s.len != uint64(mr.Len):
		return fmt.Errorf("verbs: dereg_mr key 0x%x: %w: [0x%x, 0x%x) is not the registered [0x%x, +0x%x)",
			mr.LKey, ErrBadRange, mr.Addr, mr.End(), s.addr, s.len)
	}
	d.invalidateLocked(idx)
	if d.log.Enabled(context.Background(), slog.LevelDebug) {
		d.log.Debug("soft MR deregistered", "mr", mr)
	}
	return nil
}

// invalidateAllLocked invalidates every live slot that mine picks, as
// invalidateLocked does each, except that their pages are unpinned once
// all their keys are dead, in one pass over the pinned set rather than
// one per MR (closing with thousands of MRs stays linear). Called with
// the owner's mutex held.
func (d *Soft) invalidateAllLocked(mine func(idx uint32) bool) {
	o := d.own
	picked := func(idx uint32) bool { return o.slots[idx].key != 0 && mine(idx) }
	gone := o.pinned.removeWhere(picked)
	for i := range o.slots {
		if picked(uint32(i)) {
			d.invalidateLocked(uint32(i)) // out of the pinned set already: unpins nothing
		}
	}
	for _, sp := range gone {
		d.unpinSpanLocked(sp)
	}
}

// invalidateLocked frees slot idx: the key dies for every process with the
// first store, then the pages are unpinned (a device stops using memory
// before it lets it go) and the slot joins the back of the free ring.
// Called with the owner's mutex held.
func (d *Soft) invalidateLocked(idx uint32) {
	o := d.own
	s := &d.table[idx]
	own := &o.slots[idx]
	pinned, length := own.pinned, own.len
	atomic.AddUint32(&s.Seq, 1)
	atomic.StoreUint32(&s.Key, 0)
	atomic.StoreUint32(&s.Flags, 0)
	atomic.StoreUint32(&s.Holes, 0)
	atomic.AddUint32(&s.Seq, 1)
	o.freeHoles = append(o.freeHoles, own.holes...)
	own.key, own.holes = 0, own.holes[:0]
	d.unpinLocked(idx)

	h := d.hdr
	atomic.AddUint32(&h.StatSeq, 1)
	atomic.AddUint64(&h.Deregistrations, 1)
	if pinned {
		atomic.AddUint64(&h.PinnedBytes, -length)
	} else {
		atomic.AddUint64(&h.Unpinned, ^uint64(0))
	}
	atomic.AddUint32(&h.StatSeq, 1)

	o.free[(o.head+o.n)%len(o.free)] = idx
	o.n++
}

// TrimMR takes [addr, addr+length) out of mr, which stays registered for
// the rest of its range: from now on Validate refuses the key for any
// element that touches the trimmed range, in every process. The data
// memory layer calls it (through the MR cache) when pages an MR covers are
// freed while others stay, so that no key reaches memory that is gone even
// when its MR lives on. Owner only; ErrNoResources when the hole table is
// full.
func (p *softPD) TrimMR(mr MR, addr, length uintptr) error {
	d := p.d
	if d.own == nil {
		return fmt.Errorf("verbs: trim_mr key 0x%x: %w: only the process that created the soft device trims", mr.LKey, ErrPermission)
	}
	lo, hi := max(uint64(addr), uint64(mr.Addr)), min(uint64(addr)+uint64(length), uint64(mr.Addr)+uint64(mr.Len))
	if lo >= hi {
		return nil
	}
	o := d.own
	o.mu.Lock()
	defer o.mu.Unlock()
	idx, err := d.slotLocked("trim_mr", mr.LKey)
	if err != nil {
		return err
	}
	own := &o.slots[idx]
	if own.key != mr.LKey || own.pd != p.id {
		return fmt.Errorf("verbs: trim_mr key 0x%x: %w", mr.LKey, ErrStaleKey)
	}
	s := &d.table[idx]
	// A range freed again (its pages reallocated and freed once more)
	// takes no second hole; one next to a hole widens it.
	for _, i := range own.holes {
		r := &o.holes[i]
		if r.lo <= lo && hi <= r.hi {
			return nil
		}
		if lo <= r.hi && r.lo <= hi { // touching or overlapping: grow it
			r.lo, r.hi = min(r.lo, lo), max(r.hi, hi)
			h := &d.holes[i]
			atomic.AddUint32(&s.Seq, 1)
			atomic.StoreUint64(&h.Start, r.lo)
			atomic.StoreUint64(&h.End, r.hi)
			atomic.AddUint32(&s.Seq, 1)
			return nil
		}
	}
	if len(o.freeHoles) == 0 {
		return fmt.Errorf("verbs: trim_mr key 0x%x [0x%x, 0x%x): %w: all %d holes in use", mr.LKey, lo, hi, ErrNoResources, len(d.holes))
	}
	i := o.freeHoles[len(o.freeHoles)-1]
	o.freeHoles = o.freeHoles[:len(o.freeHoles)-1]
	o.holes[i] = holeRange{lo, hi}
	var next uint32 // the slot's list, newest first, as the owner made it
	if n := len(own.holes); n > 0 {
		next = own.holes[n-1] + 1
	}
	own.holes = append(own.holes, i)
	h := &d.holes[i]
	atomic.StoreUint64(&h.Start, lo)
	atomic.StoreUint64(&h.End, hi)
	atomic.StoreUint32(&h.Next, next)
	atomic.AddUint32(&s.Seq, 1)
	atomic.StoreUint32(&s.Holes, i+1)
	atomic.AddUint32(&s.Seq, 1)
	return nil
}

// Close deregisters the PD's remaining MRs (owner) and closes it. It is
// idempotent.
func (p *softPD) Close() error {
	d := p.d
	if d.own == nil {
		p.closed.Store(true)
		return nil
	}
	o := d.own
	o.mu.Lock()
	defer o.mu.Unlock()
	if p.closed.Swap(true) || d.closed.Load() {
		return nil
	}
	d.invalidateAllLocked(func(idx uint32) bool { return o.slots[idx].pd == p.id })
	return nil
}

// Validate checks sge against the MR table as a device checks a work
// request's element before it touches memory: the length is not zero and
// does not wrap, the key is live, [Addr, Addr+Len) lies inside the key's
// MR, and the MR grants access (AccessRelaxedOrdering is ignored; reading
// needs no right). A failure is one of the completion errors (see
// ErrInvalidKey's group). Any process may call it; it allocates nothing
// and takes no lock.
//
// A deregistration that has started (in the owner) before Validate reads
// the slot makes it fail, so once DeregMR returns no process validates the
// key again.
func (d *Soft) Validate(sge SGE, access Access) error {
	if sge.Len == 0 {
		return errZeroLength
	}
	if uint64(sge.Addr)+uint64(sge.Len) < uint64(sge.Addr) {
		return errWraps
	}
	idx := sge.Key >> variantBits
	if sge.Key&variantMask == 0 || idx >= uint32(len(d.table)) {
		return ErrInvalidKey
	}
	if d.closed.Load() {
		return ErrClosed
	}
	s := &d.table[idx]
	for try := 0; ; try++ {
		seq := atomic.LoadUint32(&s.Seq)
		key := atomic.LoadUint32(&s.Key)
		addr := atomic.LoadUint64(&s.Addr)
		n := atomic.LoadUint64(&s.Len)
		granted := Access(atomic.LoadUint32(&s.Access))
		holes := atomic.LoadUint32(&s.Holes)
		// A slot is rewritten by a registration (which hands out a key
		// nobody holds yet), by the deregistration of the key it holds,
		// and by a trim, which keeps the key. So if the key changed, or a
		// rewrite is under way with another key, the caller's key is dead
		// or about to be: the answer is "stale". A trim under way is
		// waited out.
		if key != sge.Key {
			return keyError(s, sge.Key)
		}
		lo, hi := uint64(sge.Addr), uint64(sge.Addr)+uint64(sge.Len)
		err := error(nil)
		switch {
		case lo < addr || hi > addr+n:
			err = ErrLocalProtection
		case d.inHole(holes, lo, hi):
			err = ErrLocalProtection // that part of the MR was freed
		default:
			if need := access &^ AccessRelaxedOrdering; granted&need != need {
				err = ErrLocalAccess
			}
		}
		if seq&1 == 0 && atomic.LoadUint32(&s.Seq) == seq {
			return err
		}
		if atomic.LoadUint32(&s.Key) != sge.Key || try >= 100 {
			return keyError(s, sge.Key)
		}
		runtime.Gosched()
	}
}

// inHole reports whether [lo, hi) touches any of the holes listed from
// first. The walk is bounded by the table, whatever a torn read says.
func (d *Soft) inHole(first uint32, lo, hi uint64) bool {
	for i, n := first, 0; i != 0 && int(i) <= len(d.holes) && n < len(d.holes); n++ {
		h := &d.holes[i-1]
		if lo < atomic.LoadUint64(&h.End) && atomic.LoadUint64(&h.Start) < hi {
			return true
		}
		i = atomic.LoadUint32(&h.Next)
	}
	return false
}

// keyError tells a key its slot never handed out from one whose MR is
// gone.
func keyError(s *mrSlot, key uint32) error {
	if uses := atomic.LoadUint32(&s.Uses); uses < variants && key&variantMask > uses {
		return ErrInvalidKey
	}
	return ErrStaleKey
}

// Copy is a loopback DMA: it validates src for reading and dst for
// AccessLocalWrite, then copies src.Len bytes from src to dst in the
// calling process. dst must be at least as long as src (ErrLength). If the
// memory is unmapped between validation and copy (an MR whose memory was
// freed), the copy fails with ErrFault instead of crashing; dst may then
// be partly written.
func (d *Soft) Copy(dst, src SGE) error {
	if err := d.Validate(src, 0); err != nil {
		return fmt.Errorf("verbs: copy from %s: %w", src, err)
	}
	if err := d.Validate(dst, AccessLocalWrite); err != nil {
		return fmt.Errorf("verbs: copy to %s: %w", dst, err)
	}
	if dst.Len < src.Len {
		return fmt.Errorf("verbs: copy %s to %s: %w", src, dst, errDstShort)
	}
	if err := copyGuarded(dst.Addr, src.Addr, uintptr(src.Len)); err != nil {
		return fmt.Errorf("verbs: copy %s to %s: %w", src, dst, err)
	}
	return nil
}

// Stats returns the counters, as one consistent set. Any process may call
// it.
func (d *Soft) Stats() SoftStats {
	h := d.hdr
	var st SoftStats
	for try := 0; ; try++ {
		seq := atomic.LoadUint32(&h.StatSeq)
		st = SoftStats{
			MaxMRs:          len(d.table),
			Registrations:   atomic.LoadUint64(&h.Registrations),
			Deregistrations: atomic.LoadUint64(&h.Deregistrations),
			PinnedBytes:     atomic.LoadUint64(&h.PinnedBytes),
			UnpinnedMRs:     atomic.LoadUint64(&h.Unpinned),
		}
		if seq&1 == 0 && atomic.LoadUint32(&h.StatSeq) == seq {
			break
		}
		// An owner that died mid-update leaves StatSeq odd for good; give
		// up after a while with a best-effort set rather than spin.
		if try >= 1000 {
			break
		}
		runtime.Gosched()
	}
	st.LiveMRs = st.Registrations - st.Deregistrations
	return st
}

// MRs returns the live MRs in table order, for dumps. Any process may call
// it; a slot that is being rewritten throughout is left out.
func (d *Soft) MRs() []MR {
	var out []MR
	for i := range d.table {
		if mr, ok := d.readSlot(uint32(i)); ok {
			out = append(out, mr)
		}
	}
	return out
}

// readSlot reads slot idx consistently; ok is false for a free slot.
func (d *Soft) readSlot(idx uint32) (MR, bool) {
	s := &d.table[idx]
	for try := 0; try < 100; try++ {
		seq := atomic.LoadUint32(&s.Seq)
		key := atomic.LoadUint32(&s.Key)
		mr := MR{
			Addr:   uintptr(atomic.LoadUint64(&s.Addr)),
			Len:    uintptr(atomic.LoadUint64(&s.Len)),
			LKey:   key,
			RKey:   key,
			Handle: idx,
			Access: Access(atomic.LoadUint32(&s.Access)),
		}
		if seq&1 == 0 && atomic.LoadUint32(&s.Seq) == seq {
			return mr, key != 0
		}
		runtime.Gosched()
	}
	return MR{}, false
}
