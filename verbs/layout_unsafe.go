package verbs

import (
	"unsafe"

	"github.com/mpmr/mpmr/shm"
)

// The soft device is one arena block of the control segment, found through
// shm.RootDevice: a 128-byte header followed by the MR table, MaxMRs slots
// of one cache line each, and the hole table, MaxMRs*holesPerMR entries.
// Only the owner writes any of it; every field is read and written with
// sync/atomic.

// softMagic identifies the block: "MPMRSOFT" read as a little-endian word.
const softMagic uint64 = 0x54464f53524d504d

// softVersion is bumped when a shared struct changes meaning without
// changing shape (a shape change already changes Layout).
const softVersion uint32 = 2

const (
	headerBytes = 128
	slotBytes   = 64
	lineBytes   = 64
	holeBytes   = 24
	// holesPerMR sizes the hole table: on average this many trimmed
	// ranges per MR slot.
	holesPerMR = 4
)

// Soft device states.
const (
	softOpen   uint32 = 1
	softClosed uint32 = 2
)

// softHeader starts the block. The first line is written once at creation
// (State and NextPD aside); the second holds the counters, which the owner
// updates under StatSeq so that readers get a consistent set.
//
//	off size field
//	  0   8  Magic            softMagic, written last at creation
//	  8   4  Version          softVersion
//	 12   4  MaxMRs           table length
//	 16   8  TableOff         segment offset of slot 0
//	 24   4  State            softOpen, softClosed
//	 28   4  OwnerPID         creator, for dumps
//	 32   4  NextPD           last PD number handed out
//	 36   4  Holes            hole table length
//	 40   8  HolesOff         segment offset of hole 0
//	 48  16  reserved
//	 64   4  StatSeq          odd while the owner updates the counters
//	 68   4  reserved
//	 72   8  Registrations    successful RegMR calls
//	 80   8  Deregistrations  successful deregistrations (DeregMR, Close)
//	 88   8  PinnedBytes      bytes of live MRs mlock succeeded on
//	 96   8  Unpinned         live MRs registered without a pin
//	104  24  reserved
type softHeader struct {
	Magic           uint64
	Version         uint32
	MaxMRs          uint32
	TableOff        uint64
	State           uint32
	OwnerPID        uint32
	NextPD          uint32
	Holes           uint32
	HolesOff        uint64
	_               [16]byte
	StatSeq         uint32
	_               uint32
	Registrations   uint64
	Deregistrations uint64
	PinnedBytes     uint64
	Unpinned        uint64
	_               [24]byte
}

// mrSlot is one MR table entry, one cache line. Seq makes it a seqlock: the
// owner makes Seq odd, rewrites the slot, makes it even again; a reader that
// sees an odd Seq, or a different Seq after reading, raced with a rewrite.
//
//	off size field
//	  0   4  Seq      even when stable, odd while the owner rewrites the slot
//	  4   4  Key      the live key, 0 when the slot is free
//	  8   8  Addr     first byte of the MR
//	 16   8  Len      bytes
//	 24   4  Access   rights granted
//	 28   4  PD       number of the PD that registered it
//	 32   4  Uses     keys handed out from this slot so far (variant source)
//	 36   4  Flags    slotPinned
//	 40   4  Holes    first trimmed range (hole index + 1), 0 if none
//	 44  20  reserved
type mrSlot struct {
	Seq    uint32
	Key    uint32
	Addr   uint64
	Len    uint64
	Access uint32
	PD     uint32
	Uses   uint32
	Flags  uint32
	Holes  uint32
	_      [20]byte
}

// hole is a range an MR no longer covers: its pages were freed while the
// rest of the MR stays registered (see TrimMR). A slot's holes form a list
// through Next (hole index + 1, 0 at the end).
//
//	off size field
//	  0   8  Start
//	  8   8  End
//	 16   4  Next
//	 20   4  reserved
type hole struct {
	Start uint64
	End   uint64
	Next  uint32
	_     uint32
}

const slotPinned uint32 = 1

// Compile-time size checks: each line fails to build if its struct changes
// size.
var (
	_ [headerBytes - unsafe.Sizeof(softHeader{})]byte
	_ [unsafe.Sizeof(softHeader{}) - headerBytes]byte
	_ [slotBytes - unsafe.Sizeof(mrSlot{})]byte
	_ [unsafe.Sizeof(mrSlot{}) - slotBytes]byte
	_ [holeBytes - unsafe.Sizeof(hole{})]byte
	_ [unsafe.Sizeof(hole{}) - holeBytes]byte
	_ [lineBytes - unsafe.Offsetof(softHeader{}.StatSeq)]byte
	_ [unsafe.Offsetof(softHeader{}.StatSeq) - lineBytes]byte
)

// Layout returns shm.Describe of every struct this package keeps in shared
// memory. The runtime hashes them, with the other layers', into the layout
// tag it passes to shm.Create and shm.Attach.
func Layout() []string {
	return []string{shm.Describe(softHeader{}), shm.Describe(mrSlot{}), shm.Describe(hole{})}
}
