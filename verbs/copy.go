package verbs

import (
	"fmt"
	"runtime/debug"

	"github.com/mpmr/mpmr/internal/sys/vm"
)

// copyGuarded copies n bytes from src to dst, turning a memory fault
// (SIGSEGV or SIGBUS on memory unmapped or truncated since it was
// validated) into an error. SetPanicOnFault applies to the calling
// goroutine only, and is restored on return.
func copyGuarded(dst, src, n uintptr) (err error) {
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer func() {
		r := recover()
		if r == nil {
			return
		}
		fault, ok := r.(interface{ Addr() uintptr })
		if !ok {
			panic(r) // not a memory fault: not ours to hide
		}
		err = fmt.Errorf("%w at 0x%x", ErrFault, fault.Addr())
	}()
	copy(vm.Bytes(dst, n), vm.Bytes(src, n))
	return nil
}
