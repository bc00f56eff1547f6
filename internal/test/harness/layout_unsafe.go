package harness

import "unsafe"

// Compile-time size checks of the board's shared structs: each line fails
// to build if its struct changes size.
var (
	_ [boardHeadSize - unsafe.Sizeof(boardHead{})]byte
	_ [unsafe.Sizeof(boardHead{}) - boardHeadSize]byte
	_ [workerLineSize - unsafe.Sizeof(workerLine{})]byte
	_ [unsafe.Sizeof(workerLine{}) - workerLineSize]byte
	_ [roundRecSize - unsafe.Sizeof(roundRec{})]byte
	_ [unsafe.Sizeof(roundRec{}) - roundRecSize]byte
	_ [boardSize - unsafe.Sizeof(board{})]byte
	_ [unsafe.Sizeof(board{}) - boardSize]byte
)

// word64 and word32 view the aligned word at off of a mapping, for
// sync/atomic access to a header another process reads.
func word64(m []byte, off int) *uint64 {
	_ = m[off+7]
	return (*uint64)(unsafe.Pointer(&m[off]))
}

func word32(m []byte, off int) *uint32 {
	_ = m[off+3]
	return (*uint32)(unsafe.Pointer(&m[off]))
}
