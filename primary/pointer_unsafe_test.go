package primary_test

import (
	"runtime/debug"
	"unsafe"

	"github.com/mpmr/mpmr/internal/sys/vm"
)

// pointer turns a data-memory address into a pointer, for helpers that
// touch memory on purpose.
func pointer(addr uintptr) unsafe.Pointer { return vm.Pointer(addr) }

// poke writes b at addr and reports whether it could: a fault (memory that
// is not mapped) is survived.
func poke(addr uintptr, b byte) (ok bool) {
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer func() {
		if recover() != nil {
			ok = false
		}
	}()
	*(*byte)(pointer(addr)) = b
	return true
}

// peek reads the byte at addr, surviving a fault.
func peek(addr uintptr) (b byte, ok bool) {
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer func() {
		if recover() != nil {
			ok = false
		}
	}()
	return *(*byte)(pointer(addr)), true
}
