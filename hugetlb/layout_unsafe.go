package hugetlb

import (
	"unsafe"

	"github.com/mpmr/mpmr/shm"
)

// The memory's shared state lives in the control segment: a table under root
// shm.RootMemory, and one page bitmap per list in its own arena block. Only
// the primary writes any of it; every word is read and written with
// sync/atomic. The primary fills everything in before it publishes the
// table's offset in the root, so a process that loads a non-zero root sees a
// complete table.

const (
	tableMagic   uint64 = 0x314c534d524d504d // "MPMRMSL1" read as a little-endian word
	tableVersion uint32 = 1

	tableHeaderSize = 64
	listDescSize    = 256
	fileWords       = 24 // listDesc.File: 192 bytes of path
	maxPathLen      = fileWords * 8

	tableLive   uint32 = 1
	tableClosed uint32 = 2
)

// tableHeader starts the block under shm.RootMemory; listDescs follow it.
//
//	off size field
//	  0   8  Magic    tableMagic
//	  8   4  Version  tableVersion
//	 12   4  Lists    number of listDescs after the header
//	 16   4  State    tableLive, or tableClosed once the primary closed
//	 20   4  pad
//	 24   8  Gen      odd while the primary changes pages (a sequence
//	                  count: readers retry a snapshot that saw it move)
//	 32  32  reserved
type tableHeader struct {
	Magic   uint64
	Version uint32
	Lists   uint32
	State   uint32
	_       uint32
	Gen     uint64
	_       [32]byte
}

// listDesc describes one memseg list.
//
//	off size field
//	  0   8  Base       first byte of the list's address range
//	  8   8  PageSize   bytes per page, a power of two
//	 16   8  Capacity   pages in the range
//	 24   8  Allocated  pages allocated now
//	 32   8  BitsOff    segment offset of the page bitmap: Capacity bits in
//	                    ceil(Capacity/64) words, bit i set while page i is
//	                    allocated
//	 40   4  Kind       backend: 1 hugetlbfs, 2 tmpfs
//	 44   4  FileLen    bytes of File in use
//	 48  16  reserved
//	 64 192  File       backing file path, little-endian bytes in 24 words
type listDesc struct {
	Base      uint64
	PageSize  uint64
	Capacity  uint64
	Allocated uint64
	BitsOff   uint64
	Kind      uint32
	FileLen   uint32
	_         [16]byte
	File      [fileWords]uint64
}

// Compile-time size checks: each line fails to build if its struct changes
// size.
var (
	_ [tableHeaderSize - unsafe.Sizeof(tableHeader{})]byte
	_ [unsafe.Sizeof(tableHeader{}) - tableHeaderSize]byte
	_ [listDescSize - unsafe.Sizeof(listDesc{})]byte
	_ [unsafe.Sizeof(listDesc{}) - listDescSize]byte
	_ [64 - unsafe.Offsetof(listDesc{}.File)]byte
	_ [unsafe.Offsetof(listDesc{}.File) - 64]byte
)

// Layout describes every struct this package keeps in the control segment
// (see shm.Describe), for the layout tag the runtime passes to shm.Create
// and shm.Attach.
func Layout() []string {
	return []string{shm.Describe(tableHeader{}), shm.Describe(listDesc{})}
}
