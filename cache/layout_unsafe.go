package cache

import (
	"fmt"
	"sync/atomic"
	"unsafe"

	"github.com/mpmr/mpmr/shm"
)

const entrySize = uint64(unsafe.Sizeof(Entry{}))

// Compile-time size checks of the shared structs.
var (
	_ [24 - unsafe.Sizeof(Entry{})]byte
	_ [unsafe.Sizeof(Entry{}) - 24]byte
	_ [64 - unsafe.Sizeof(tableHeader{})]byte
	_ [unsafe.Sizeof(tableHeader{}) - 64]byte
)

// search is DPDK's MR B-tree binary search over ents[:n] (0 < n <= len(ents)):
// it returns the index of the last entry whose Start is at most addr, the
// sentinel at index 0 when there is none. The loop keeps base+n <= the
// starting n, so every probe is in bounds; indexing through the pointer
// spares the bounds check a slice index would repeat on every step.
func search(ents []Entry, n int, addr uint64) int {
	p := unsafe.Pointer(unsafe.SliceData(ents))
	base := 0
	for n > 1 {
		half := n >> 1
		if addr < atomic.LoadUint64((*uint64)(unsafe.Add(p, uintptr(base+half)*unsafe.Sizeof(Entry{})))) {
			n = half
		} else {
			base += half
			n -= half
		}
	}
	return base
}

const (
	mrRecordSize   = uint64(unsafe.Sizeof(mrRecord{}))
	globalRootSize = uint64(unsafe.Sizeof(globalRoot{}))
	tableHeaderOff = uint64(unsafe.Offsetof(globalRoot{}.Table))
)

var (
	_ [80 - unsafe.Sizeof(mrRecord{})]byte
	_ [unsafe.Sizeof(mrRecord{}) - 80]byte
	_ [192 - unsafe.Sizeof(globalRoot{})]byte
	_ [unsafe.Sizeof(globalRoot{}) - 192]byte
	_ [64 - unsafe.Offsetof(globalRoot{}.Table)]byte
	_ [unsafe.Offsetof(globalRoot{}.Table) - 64]byte
	_ [128 - unsafe.Offsetof(globalRoot{}.DevGen)]byte
	_ [unsafe.Offsetof(globalRoot{}.DevGen) - 128]byte
)

const logEntrySize = uint64(unsafe.Sizeof(logEntry{}))

var (
	_ [32 - unsafe.Sizeof(logEntry{})]byte
	_ [unsafe.Sizeof(logEntry{}) - 32]byte
)

const poolDescSize = uint64(unsafe.Sizeof(poolDesc{}))

var (
	_ [128 - unsafe.Sizeof(poolDesc{})]byte
	_ [unsafe.Sizeof(poolDesc{}) - 128]byte
	_ [512 - unsafe.Sizeof(poolDir{})]byte
	_ [unsafe.Sizeof(poolDir{}) - 512]byte
)

// sliceAddr returns the address of b's first byte.
func sliceAddr(b []byte) uintptr { return uintptr(unsafe.Pointer(unsafe.SliceData(b))) }

// Layout describes this package's shared structs, for the segment's layout
// tag (see shm.LayoutHash).
func Layout() []string {
	return []string{shm.Describe(Entry{}), shm.Describe(tableHeader{}), shm.Describe(mrRecord{}),
		shm.Describe(globalRoot{}), shm.Describe(poolDir{}), shm.Describe(poolDesc{}), shm.Describe(logEntry{}),
		// The meaning of a pool's Next words: taken objects are marked.
		fmt.Sprintf("poolNext:out=0x%x", objectOut)}
}
