package demo

import "github.com/mpmr/mpmr/internal/vm"

// bytesAt views n bytes of data memory at addr.
func bytesAt(addr uintptr, n uint32) []byte { return vm.Bytes(addr, uintptr(n)) }
