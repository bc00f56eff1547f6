package shm

import (
	"fmt"
	"hash/fnv"
	"reflect"
	"sync"
	"sync/atomic"
	"unsafe"
)

// Magic identifies an mpmr control segment: "MPMRSHM1" read as a
// little-endian word.
const Magic uint64 = 0x314d48534d524d50

// Version is the ABI version of the segment layout. Bump it whenever a
// shared struct of any layer changes meaning without changing shape.
const Version uint32 = 2

const (
	headerSize = 4096
	slotSize   = 64
	lineSize   = 64 // cache line: unit of alignment for contended words

	maxLocks = 8
	maxRoots = 16
)

// Segment states.
const (
	stateInitializing uint32 = 1
	stateReady        uint32 = 2
	stateDead         uint32 = 3
)

// header is the first 512 bytes of the segment (the rest of its 4 KiB page
// is reserved). Every field is read and written with sync/atomic.
//
//	off size field
//	  0   8  Magic        written last by the creator
//	  8   4  Version
//	 12   4  Layout       hash of every shared struct's shape
//	 16   4  State        initializing, ready, dead
//	 20   4  Slots        process table length
//	 24   4  CreatorPID
//	 28   4  CreatorUID
//	 32   8  CreatorStart process start time, clock ticks after boot
//	 40   8  Size         bytes backed by the file and usable
//	 48   8  MaxSize      bytes every process maps (the reservation)
//	 56   8  PageSize     backing page size; Size is a multiple of it
//	 64   8  ProcsOff     offset of the process table
//	 72   8  ArenaOff     first arena byte
//	 80   8  ArenaFree    offset of the first free block header, 0 if none
//	 88   8  ArenaUsed    bytes in allocated blocks, headers included
//	 96   8  ArenaBlocks  number of allocated blocks
//	104  64  Locks        offsets of registered RWLocks (0 = unused)
//	168 128  Roots        named offsets for the layers above (0 = unset)
//	296 216  reserved
type header struct {
	Magic        uint64
	Version      uint32
	Layout       uint32
	State        uint32
	Slots        uint32
	CreatorPID   uint32
	CreatorUID   uint32
	CreatorStart uint64
	Size         uint64
	MaxSize      uint64
	PageSize     uint64
	ProcsOff     uint64
	ArenaOff     uint64
	ArenaFree    uint64
	ArenaUsed    uint64
	ArenaBlocks  uint64
	Locks        [maxLocks]uint64
	Roots        [maxRoots]uint64
	_            [216]byte
}

// procSlot is one process-table entry, one cache line.
//
//	off size field
//	  0   4  State  slotFree or slotLive
//	  4   4  Role
//	  8   4  PID
//	 12   4  Epoch  bumped by every claim
//	 16   8  Start  process start time, clock ticks after boot
//	 24   4  UID
//	 28   4  Fenced    the epoch of a claim the primary stopped trusting to
//	                   follow memory changes (written by the primary)
//	 32   4  Unmapped  the epoch of a claim that maps no data memory any
//	                   more (written by the process itself)
//	 36  28  reserved
type procSlot struct {
	State    uint32
	Role     uint32
	PID      uint32
	Epoch    uint32
	Start    uint64
	UID      uint32
	Fenced   uint32
	Unmapped uint32
	_        [28]byte
}

// blockHeader precedes every arena block, free or allocated.
//
//	off size field
//	  0   8  Size  whole block, header included; multiple of 16
//	  8   8  Tag   blockUsed or blockFree
//	 16   8  Next  free blocks only: offset of the next free block header
type blockHeader struct {
	Size uint64
	Tag  uint64
}

// lockHead is the first cache line of an RWLock; reader lines follow.
//
//	off size field
//	  0   8  Owner    0 free; the holder's slot epoch << 32 | slot+1;
//	                  ownerUnrecoverable. Futex waits use its low half.
//	  8   4  Flags    flagInconsistent
//	 12   4  Waiters  sleepers on Owner
//	 16   4  Seq      odd while a writer holds the lock (optimistic reads)
//	 20   4  Lines    number of reader lines (= process table slots)
//	 24   8  Fences   read holds of live processes a writer stopped waiting for
//	 32  32  reserved
type lockHead struct {
	Owner   uint64
	Flags   uint32
	Waiters uint32
	Seq     uint32
	Lines   uint32
	Fences  uint64
	_       [32]byte
}

// readerLine counts one process's read holds, alone on its cache line.
//
//	off size field
//	  0   8  Count  line generation << 32 | holds. The generation moves
//	                whenever the holds are discarded (the slot is claimed
//	                anew, its process died, or a writer fenced it), so a
//	                hold taken before knows it no longer counts.
//	  8  56  reserved
type readerLine struct {
	Count uint64
	_     [56]byte
}

// Compile-time size checks: each line fails to build if its struct changes
// size.
var (
	_ [512 - unsafe.Sizeof(header{})]byte
	_ [unsafe.Sizeof(header{}) - 512]byte
	_ [slotSize - unsafe.Sizeof(procSlot{})]byte
	_ [unsafe.Sizeof(procSlot{}) - slotSize]byte
	_ [16 - unsafe.Sizeof(blockHeader{})]byte
	_ [unsafe.Sizeof(blockHeader{}) - 16]byte
	_ [lineSize - unsafe.Sizeof(lockHead{})]byte
	_ [unsafe.Sizeof(lockHead{}) - lineSize]byte
	_ [lineSize - unsafe.Sizeof(readerLine{})]byte
	_ [unsafe.Sizeof(readerLine{}) - lineSize]byte
)

// Describe returns a string naming the size, alignment and field offsets of
// a shared struct. Layers above hash these descriptions into the layout tag
// they pass to Create and Attach, so two builds that disagree on any shared
// struct refuse to share a segment.
func Describe(v any) string {
	t := reflect.TypeOf(v)
	s := fmt.Sprintf("%s:%d/%d{", t.Name(), t.Size(), t.Align())
	for i := range t.NumField() {
		f := t.Field(i)
		s += fmt.Sprintf("%s@%d:%s;", f.Name, f.Offset, f.Type)
	}
	return s + "}"
}

// LayoutHash hashes descriptions (see Describe) into a layout tag.
func LayoutHash(descs ...string) uint32 {
	h := fnv.New32a()
	for _, d := range descs {
		h.Write([]byte(d))
		h.Write([]byte{0})
	}
	return h.Sum32()
}

// ownLayout is this package's contribution to the layout hash.
var ownLayout = LayoutHash(Describe(header{}), Describe(procSlot{}),
	Describe(blockHeader{}), Describe(lockHead{}), Describe(readerLine{}))

// plainTypes caches the types checkPlain accepted; plainSeen caches the
// last few of them by their descriptor's address (a type's descriptor
// never moves), which costs At no hashing and the least memory to read.
var (
	plainTypes sync.Map
	plainSeen  [256]atomic.Uintptr
)

// mustBePlain panics if t can hold a Go pointer (see checkPlain); the
// answer is cached per type.
func mustBePlain(t reflect.Type) {
	key := reflect.ValueOf(t).Pointer()
	seen := &plainSeen[key>>4%uintptr(len(plainSeen))]
	if seen.Load() == key {
		return
	}
	if _, ok := plainTypes.Load(t); !ok {
		checkPlain(t)
		plainTypes.Store(t, struct{}{})
	}
	seen.Store(key)
}

// checkPlain panics if t can hold a Go pointer: such a type must never be
// placed in shared memory, where the garbage collector cannot see it and
// other processes would read a meaningless address.
func checkPlain(t reflect.Type) {
	switch t.Kind() {
	case reflect.Bool, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64,
		reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64,
		reflect.Float32, reflect.Float64:
	case reflect.Array:
		checkPlain(t.Elem())
	case reflect.Struct:
		for i := range t.NumField() {
			checkPlain(t.Field(i).Type)
		}
	default:
		panic(fmt.Sprintf("shm: %s cannot live in shared memory (kind %s)", t, t.Kind()))
	}
}

// At returns a pointer to a T at offset off of the segment. T must be made
// only of fixed-size scalars and arrays of them (it panics otherwise), and
// [off, off+sizeof(T)) must lie inside the segment's current size (it
// panics otherwise: offsets come from the segment's own arena, so a bad one
// is a bug, not an input error). Access the fields with sync/atomic.
func At[T any](s *Segment, off uint64) *T {
	t := reflect.TypeFor[T]()
	mustBePlain(t)
	s.mustRange(off, uint64(t.Size()), uint64(t.Align()))
	return (*T)(unsafe.Add(s.basePtr(), off))
}

// Slice returns n consecutive Ts starting at offset off, under the same
// rules as At.
func Slice[T any](s *Segment, off uint64, n int) []T {
	t := reflect.TypeFor[T]()
	mustBePlain(t)
	if n < 0 {
		panic("shm: negative slice length")
	}
	s.mustRange(off, uint64(t.Size())*uint64(n), uint64(t.Align()))
	return unsafe.Slice((*T)(unsafe.Add(s.basePtr(), off)), n)
}

// lowHalf returns the address of the low 32 bits of a 64-bit word: the count
// half of a reader line, which is what a futex can wait on (little-endian).
func lowHalf(p *uint64) *uint32 {
	return (*uint32)(unsafe.Pointer(p))
}

// headerIn views the start of a mapping (at least headerSize bytes) as the
// segment header.
func headerIn(m []byte) *header {
	_ = m[headerSize-1]
	return (*header)(unsafe.Pointer(&m[0]))
}

// procTable views the n process-table slots that follow the header of the
// mapping at base. The caller has checked n against MaxSlots and the
// header's layout, which puts the table inside the first page.
func procTable(base unsafe.Pointer, n int) []procSlot {
	return unsafe.Slice((*procSlot)(unsafe.Add(base, headerSize)), n)
}
