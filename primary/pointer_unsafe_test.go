package primary_test

import (
	"unsafe"

	"github.com/mpmr/mpmr/internal/vm"
)

// pointer turns a data-memory address into a pointer, for helpers that
// touch memory on purpose.
func pointer(addr uintptr) unsafe.Pointer { return vm.Pointer(addr) }
