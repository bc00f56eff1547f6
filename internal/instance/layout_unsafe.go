package instance

import "unsafe"

const counterLineSize = uint64(unsafe.Sizeof(counterLine{}))

var (
	_ [288 - unsafe.Sizeof(counterLine{})]byte
	_ [unsafe.Sizeof(counterLine{}) - 288]byte
	_ [32 - NumCounters]byte // room for every counter
)
