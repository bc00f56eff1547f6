package instance

import "unsafe"

const counterLineSize = uint64(unsafe.Sizeof(counterLine{}))

var (
	_ [416 - unsafe.Sizeof(counterLine{})]byte
	_ [unsafe.Sizeof(counterLine{}) - 416]byte
	_ [48 - NumCounters]byte // room for every counter
)
