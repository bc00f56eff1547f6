package demo

import (
	"fmt"

	"github.com/mpmr/mpmr/cache"
	"github.com/mpmr/mpmr/verbs"
)

// Mover is one queue's datapath step: it takes two buffers from a pool,
// writes a payload into one, looks up both buffers' keys and has the soft
// device copy the payload across (which validates both elements, as an HCA
// would), checks what arrived and gives the buffers back. A Mover belongs
// to one goroutine.
type Mover struct {
	Dev  *verbs.Soft
	Q    interface{ Lookup(uintptr) (uint32, error) }
	Pool *cache.Pool
	Size uint32 // payload bytes, at most the pool's object size
	Seed byte   // varies the payload from one move to the next
}

// Move makes one move. Errors are the pool's, the lookups' or the device's
// (a validation failure is one of verbs' completion errors).
func (m *Mover) Move() error {
	src, err := m.Pool.Get()
	if err != nil {
		return err
	}
	defer m.Pool.Put(src)
	dst, err := m.Pool.Get()
	if err != nil {
		return err
	}
	defer m.Pool.Put(dst)
	payload := bytesAt(src, m.Size)
	m.Seed++
	for i := range payload {
		payload[i] = m.Seed + byte(i)
	}
	sk, err := m.Q.Lookup(src)
	if err != nil {
		return err
	}
	dk, err := m.Q.Lookup(dst)
	if err != nil {
		return err
	}
	if err := m.Dev.Copy(verbs.SGE{Addr: dst, Len: m.Size, Key: dk}, verbs.SGE{Addr: src, Len: m.Size, Key: sk}); err != nil {
		return err
	}
	out := bytesAt(dst, m.Size)
	if out[0] != m.Seed || out[m.Size-1] != m.Seed+byte(m.Size-1) {
		return fmt.Errorf("copy 0x%x -> 0x%x: payload not delivered", src, dst)
	}
	return nil
}
