package harness

import (
	"fmt"
	"os"
	"sync/atomic"

	"github.com/mpmr/mpmr/internal/sys/falloc"
	"github.com/mpmr/mpmr/internal/sys/vm"
)

// HeaderField is a word of the control segment's header that an
// attaching process validates, with the error it must then fail with. The
// offsets are those of shm's header layout (shm/layout_unsafe.go).
type HeaderField struct {
	Name string
	Off  int
	Size int    // 4 or 8 bytes
	Want string // the sentinel (see ErrorReport) an attach must match
}

// The header words every attacher checks before trusting anything else.
var (
	HeaderMagic   = HeaderField{Name: "magic", Off: 0, Size: 8, Want: "shm.ErrBadMagic"}
	HeaderVersion = HeaderField{Name: "version", Off: 8, Size: 4, Want: "shm.ErrVersionMismatch"}
	HeaderLayout  = HeaderField{Name: "layout", Off: 12, Size: 4, Want: "shm.ErrLayoutMismatch"}
)

// CorruptHeader inverts field in the header of the segment file at path
// and returns a function that puts the old value back. It writes through
// a shared mapping, since hugetlbfs files cannot be written with write(2);
// processes that map the segment see the change at once.
func CorruptHeader(path string, field HeaderField) (restore func() error, err error) {
	var old uint64
	err = withHeader(path, func(m []byte) {
		switch field.Size {
		case 8:
			old = atomic.LoadUint64(word64(m, field.Off))
			atomic.StoreUint64(word64(m, field.Off), ^old)
		default:
			old = uint64(atomic.LoadUint32(word32(m, field.Off)))
			atomic.StoreUint32(word32(m, field.Off), ^uint32(old))
		}
	})
	if err != nil {
		return nil, err
	}
	return func() error {
		return withHeader(path, func(m []byte) {
			switch field.Size {
			case 8:
				atomic.StoreUint64(word64(m, field.Off), old)
			default:
				atomic.StoreUint32(word32(m, field.Off), uint32(old))
			}
		})
	}, nil
}

// withHeader maps the first backing page of the file at path shared and
// writable and calls fn with its first 4 KiB.
func withHeader(path string, fn func(m []byte)) error {
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return fmt.Errorf("harness: header of %s: %w", path, err)
	}
	defer f.Close()
	page, _, err := falloc.BlockSize(int(f.Fd()))
	if err != nil {
		return fmt.Errorf("harness: header of %s: %w", path, err)
	}
	addr, err := vm.MapShared(int(f.Fd()), uintptr(page), true)
	if err != nil {
		return fmt.Errorf("harness: header of %s: %w", path, err)
	}
	fn(vm.Bytes(addr, 4096))
	return vm.Unmap(addr, uintptr(page))
}
