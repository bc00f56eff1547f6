package harness

import (
	"fmt"

	"github.com/mpmr/mpmr/cache"
	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/verbs"
)

// mover is one queue's datapath step in a workload: it takes two buffers
// from a pool, writes a payload into one, looks up both buffers' keys and
// has the soft device copy the payload across (which validates both
// elements, as an HCA would), checks what arrived and gives the buffers
// back. A mover belongs to one goroutine.
type mover struct {
	dev  *verbs.Soft
	q    interface{ Lookup(uintptr) (uint32, error) }
	pool *cache.Pool
	size uint32 // payload bytes, at most the pool's object size
	seed byte   // varies the payload from one move to the next
}

// move makes one move. Errors are the pool's, the lookups' or the device's
// (a validation failure is one of verbs' completion errors).
func (m *mover) move() error {
	src, err := m.pool.Get()
	if err != nil {
		return err
	}
	defer m.pool.Put(src)
	dst, err := m.pool.Get()
	if err != nil {
		return err
	}
	defer m.pool.Put(dst)
	payload := hugetlb.Region{Addr: src, Len: uint64(m.size)}.Bytes()
	m.seed++
	for i := range payload {
		payload[i] = m.seed + byte(i)
	}
	sk, err := m.q.Lookup(src)
	if err != nil {
		return err
	}
	dk, err := m.q.Lookup(dst)
	if err != nil {
		return err
	}
	if err := m.dev.Copy(verbs.SGE{Addr: dst, Len: m.size, Key: dk}, verbs.SGE{Addr: src, Len: m.size, Key: sk}); err != nil {
		return err
	}
	out := hugetlb.Region{Addr: dst, Len: uint64(m.size)}.Bytes()
	if out[0] != m.seed || out[m.size-1] != m.seed+byte(m.size-1) {
		return fmt.Errorf("copy 0x%x -> 0x%x: payload not delivered", src, dst)
	}
	return nil
}
