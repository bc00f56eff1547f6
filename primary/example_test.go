package primary_test

import (
	"errors"
	"fmt"
	"os"

	"github.com/mpmr/mpmr/cache"
	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/primary"
	"github.com/mpmr/mpmr/verbs"
)

// A primary allocates data memory, looks up the key of a buffer in it (the
// first lookup registers the memory), hands the buffer to the device, and
// frees the memory: lookups after Free no longer find a key.
func Example() {
	dir, err := os.MkdirTemp("", "mpmr-example")
	if err != nil {
		fmt.Println(err)
		return
	}
	defer os.RemoveAll(dir)
	p, err := primary.Start(primary.Config{
		Prefix:      fmt.Sprintf("example-%d", os.Getpid()), // names the instance system-wide
		RuntimeDir:  dir,
		Backend:     hugetlb.Tmpfs, // hugetlbfs is used when available if left to Auto
		MemoryPages: 16,
		Logger:      quiet,
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer p.Close()

	r, err := p.Alloc(4 << 20)
	if err != nil {
		fmt.Println(err)
		return
	}
	q := p.NewQueue()
	defer q.Close()
	buf := r.Addr + 4096
	key, err := q.Lookup(buf)
	fmt.Println("lookup:", err)
	fmt.Println("device accepts the key:",
		p.Device().Validate(verbs.SGE{Addr: buf, Len: 2048, Key: key}, verbs.AccessLocalWrite) == nil)

	if err := p.Free(r); err != nil {
		fmt.Println(err)
		return
	}
	_, err = q.Lookup(buf)
	fmt.Println("after Free:", errors.Is(err, cache.ErrNoMemory))
	// Output:
	// lookup: <nil>
	// device accepts the key: true
	// after Free: true
}
