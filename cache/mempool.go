package cache

import (
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/shm"
)

// Chunk is a contiguous piece of a mempool's memory: [Addr, Addr+Len).
type Chunk struct {
	Addr uintptr
	Len  uint64
}

// Check reports whether c is a range at all: ErrBadChunk when it is empty
// or its end wraps past the top of the address space.
func (c Chunk) Check() error {
	if c.Len == 0 || uint64(c.Addr)+c.Len < uint64(c.Addr) {
		return fmt.Errorf("%w: [0x%x, +0x%x)", ErrBadChunk, c.Addr, c.Len)
	}
	return nil
}

// Mempool is a pool of buffers whose memory must be registered before a
// queue uses it (rte_mempool in DPDK).
type Mempool interface {
	Name() string
	Chunks() []Chunk
}

// Mempool errors.
var (
	ErrPoolEmpty  = errors.New("cache: mempool has no free object")
	ErrPoolExists = errors.New("cache: mempool name already used")
	ErrNoPool     = errors.New("cache: no such mempool")
	ErrNotInPool  = errors.New("cache: address is not an object of this mempool")
	// ErrMisaligned means an address inside a mempool's objects that is
	// not the start of one. It matches ErrNotInPool too.
	ErrMisaligned = fmt.Errorf("%w: not the start of an object", ErrNotInPool)
	// ErrDoublePut means an object was put back that is not out: put
	// twice, or never taken. The pool is left as it was.
	ErrDoublePut = errors.New("cache: object put back while not taken (double put)")
	// ErrBadChunk means a mempool chunk of length 0 or whose end wraps
	// past the top of the address space; nothing of the mempool is
	// registered.
	ErrBadChunk = errors.New("cache: bad mempool chunk")
)

// objectOut is the Next word of an object that is taken.
const objectOut = ^uint32(0)

const (
	maxPools    = 64
	poolNameLen = 32
	maxPoolObjs = 1 << 30
)

// poolDir lists the shared pools, under shm.RootPools.
//
//	off size field
//	  0 512  Pools  offsets of pool descriptors, 0 = unused
type poolDir struct {
	Pools [maxPools]uint64
}

// poolDesc describes a shared pool of fixed-size objects in data memory.
// Free objects form a lock-free stack: Head holds a tag (bumped by every
// change, against ABA) in its high half and the top object's index + 1 in
// its low half; Next[i] is the index + 1 of the object under object i
// while it is free, and objectOut while it is taken, so that a put of an
// object that is not out is refused instead of corrupting the stack.
//
//	off size field
//	  0  32  Name     NUL-padded
//	 32   8  Base     address of object 0
//	 40   8  Len      bytes of the region
//	 48   4  ObjSize
//	 52   4  Count
//	 56   8  Head
//	 64   8  Next     offset of Count uint32 words
//	 72   4  InUse    objects taken
//	 76  52  reserved
type poolDesc struct {
	Name    [poolNameLen]byte
	Base    uint64
	Len     uint64
	ObjSize uint32
	Count   uint32
	Head    uint64
	Next    uint64
	InUse   uint32
	_       [52]byte
}

// Pool is a mempool of fixed-size objects carved from one data-memory
// region, shared by every process of an instance: any process may Get and
// Put. The primary creates it (CreatePool); others open it by name
// (OpenPool). Objects taken by a process that dies are not returned.
// Pool is safe for concurrent use.
type Pool struct {
	name string
	desc *poolDesc
	next []uint32
	base uint64
	size uint64
	n    uint32
}

func openDir(seg *shm.Segment, create bool) (*poolDir, error) {
	off := seg.Root(shm.RootPools)
	if off == 0 {
		if !create {
			return nil, fmt.Errorf("%w: the segment has no mempools", ErrNoPool)
		}
		var err error
		if off, err = seg.Alloc(uint64(maxPools*8), 64); err != nil {
			return nil, err
		}
		if err := seg.SetRoot(shm.RootPools, off); err != nil {
			return nil, err
		}
	}
	if err := seg.CheckRange(off, maxPools*8); err != nil {
		return nil, fmt.Errorf("%w: mempool directory: %v", ErrCorrupt, err)
	}
	return shm.At[poolDir](seg, off), nil
}

// CreatePool allocates count objects of objSize bytes (rounded up to 64)
// from mem and publishes the pool under name. Primary only. Calls for one
// segment must not overlap: finding the name free, a free place in the
// directory and publishing the pool there are one step (primary's
// CreatePool runs them one at a time).
func CreatePool(seg *shm.Segment, mem *hugetlb.Memory, name string, objSize, count int) (*Pool, error) {
	if len(name) == 0 || len(name) > poolNameLen || strings.IndexByte(name, 0) >= 0 {
		return nil, fmt.Errorf("cache: mempool name %q: want 1..%d bytes, no NUL", name, poolNameLen)
	}
	if objSize <= 0 || count <= 0 || count > maxPoolObjs || objSize > 1<<30 {
		return nil, fmt.Errorf("cache: mempool %s: %d objects of %d bytes: bad size", name, count, objSize)
	}
	dir, err := openDir(seg, true)
	if err != nil {
		return nil, err
	}
	if findPool(seg, dir, name) != 0 {
		return nil, fmt.Errorf("%w: %s", ErrPoolExists, name)
	}
	slot := -1
	for i := range dir.Pools {
		if atomic.LoadUint64(&dir.Pools[i]) == 0 {
			slot = i
			break
		}
	}
	if slot < 0 {
		return nil, fmt.Errorf("cache: mempool %s: all %d pool slots used", name, maxPools)
	}
	size := (uint64(objSize) + 63) &^ 63
	region, err := mem.Alloc(size * uint64(count))
	if err != nil {
		return nil, fmt.Errorf("cache: mempool %s: %w", name, err)
	}
	descOff, err := seg.Alloc(poolDescSize, 64)
	if err == nil {
		var nextOff uint64
		if nextOff, err = seg.Alloc(uint64(count)*4, 64); err == nil {
			d := shm.At[poolDesc](seg, descOff)
			copy(d.Name[:], name)
			atomic.StoreUint64(&d.Base, uint64(region.Addr))
			atomic.StoreUint64(&d.Len, region.Len)
			atomic.StoreUint32(&d.ObjSize, uint32(size))
			atomic.StoreUint32(&d.Count, uint32(count))
			atomic.StoreUint64(&d.Next, nextOff)
			next := shm.Slice[uint32](seg, nextOff, count)
			for i := range next {
				atomic.StoreUint32(&next[i], uint32(i+2)) // i+1's index + 1
			}
			atomic.StoreUint32(&next[count-1], 0)
			atomic.StoreUint64(&d.Head, 1) // tag 0, object 0
			atomic.StoreUint64(&dir.Pools[slot], descOff)
			// The pool as made, not as the directory says by now: any
			// process of the user can write it, and the allocation
			// above waited for every secondary.
			return &Pool{name: name, desc: d, next: next, base: uint64(region.Addr), size: size, n: uint32(count)}, nil
		}
		_ = seg.Free(descOff)
	}
	_ = mem.Free(region)
	return nil, fmt.Errorf("cache: mempool %s: %w", name, err)
}

// findPool returns the offset of the first descriptor in dir called name,
// valid or not, or 0.
func findPool(seg *shm.Segment, dir *poolDir, name string) uint64 {
	for i := range dir.Pools {
		off := atomic.LoadUint64(&dir.Pools[i])
		if off != 0 && seg.CheckRange(off, poolDescSize) == nil && poolName(shm.At[poolDesc](seg, off)) == name {
			return off
		}
	}
	return 0
}

// OpenPool opens the shared pool called name. It checks that the
// descriptor is whole and its links are in the segment, not that its
// objects are memory this process maps: a caller that has the data
// memory checks that before it uses an object (secondary's Pool does).
func OpenPool(seg *shm.Segment, name string) (*Pool, error) {
	dir, err := openDir(seg, false)
	if err != nil {
		return nil, err
	}
	if off := findPool(seg, dir, name); off != 0 {
		d := shm.At[poolDesc](seg, off)
		n := atomic.LoadUint32(&d.Count)
		nextOff := atomic.LoadUint64(&d.Next)
		base, size := atomic.LoadUint64(&d.Base), uint64(atomic.LoadUint32(&d.ObjSize))
		if n == 0 || n > maxPoolObjs || size == 0 || size%64 != 0 || base+uint64(n)*size < base ||
			seg.CheckRange(nextOff, uint64(n)*4) != nil {
			return nil, fmt.Errorf("%w: mempool %s descriptor", ErrCorrupt, name)
		}
		return &Pool{name: name, desc: d, next: shm.Slice[uint32](seg, nextOff, int(n)),
			base: base, size: size, n: n}, nil
	}
	return nil, fmt.Errorf("%w: %s", ErrNoPool, name)
}

func poolName(d *poolDesc) string {
	b := d.Name[:]
	for i, c := range b {
		if c == 0 {
			return string(b[:i])
		}
	}
	return string(b)
}

// Name implements Mempool.
func (p *Pool) Name() string { return p.name }

// Chunks implements Mempool: a pool is one chunk.
func (p *Pool) Chunks() []Chunk {
	return []Chunk{{Addr: uintptr(p.base), Len: uint64(p.n) * p.size}}
}

// ObjSize returns the size of an object (the requested size rounded up to
// 64 bytes).
func (p *Pool) ObjSize() uint64 { return p.size }

// Count returns the number of objects.
func (p *Pool) Count() int { return int(p.n) }

// InUse returns how many objects are taken. The count is made after an
// object is taken and before it is returned: a process that dies (or is
// stopped) between the two leaves it off by one, within 0..Count.
func (p *Pool) InUse() int { return inUse(atomic.LoadUint32(&p.desc.InUse), p.n) }

// inUse reads a shared count of objects taken: one that went below zero
// (a careless put while the getter had not yet counted) reads as 0, one
// past the pool as the pool.
func inUse(v, n uint32) int {
	switch {
	case int32(v) < 0:
		return 0
	case v > n:
		return int(n)
	}
	return int(v)
}

// Get takes a free object and returns its address, or ErrPoolEmpty.
func (p *Pool) Get() (uintptr, error) {
	for {
		h := atomic.LoadUint64(&p.desc.Head)
		top := uint32(h)
		if top == 0 {
			return 0, ErrPoolEmpty
		}
		if top > p.n {
			return 0, fmt.Errorf("%w: mempool %s head %d", ErrCorrupt, p.name, top)
		}
		next := atomic.LoadUint32(&p.next[top-1])
		if next > p.n {
			// Taken by someone else since we read the head (the head
			// has moved on), or a corrupt link.
			if atomic.LoadUint64(&p.desc.Head) == h {
				return 0, fmt.Errorf("%w: mempool %s object %d links to %d", ErrCorrupt, p.name, top-1, next)
			}
			continue
		}
		if atomic.CompareAndSwapUint64(&p.desc.Head, h, (h>>32+1)<<32|uint64(next)) {
			atomic.StoreUint32(&p.next[top-1], objectOut)
			atomic.AddUint32(&p.desc.InUse, 1)
			return uintptr(p.base + uint64(top-1)*p.size), nil
		}
	}
}

// Put returns the object at addr. An address that is not an object of
// this pool fails with ErrNotInPool (ErrMisaligned inside the pool), an
// object that is not out with ErrDoublePut; either way nothing changes. A
// pool does not know who holds an object: a stale second put of an
// object another Get has taken since is taken for its holder's.
func (p *Pool) Put(addr uintptr) error {
	off := uint64(addr) - p.base
	switch {
	case uint64(addr) < p.base || off/p.size >= uint64(p.n):
		return fmt.Errorf("%w: 0x%x in mempool %s [0x%x, 0x%x)", ErrNotInPool, addr, p.name, p.base, p.base+uint64(p.n)*p.size)
	case off%p.size != 0:
		return fmt.Errorf("%w: 0x%x in mempool %s (objects of %d bytes from 0x%x)", ErrMisaligned, addr, p.name, p.size, p.base)
	}
	i := uint32(off / p.size)
	// Claim the object: only a put that finds it out may push it, so a
	// second put of it fails here, in this process or another.
	if !atomic.CompareAndSwapUint32(&p.next[i], objectOut, 0) {
		return fmt.Errorf("%w: object 0x%x of mempool %s", ErrDoublePut, addr, p.name)
	}
	for {
		h := atomic.LoadUint64(&p.desc.Head)
		atomic.StoreUint32(&p.next[i], uint32(h))
		if atomic.CompareAndSwapUint64(&p.desc.Head, h, (h>>32+1)<<32|uint64(i+1)) {
			atomic.AddUint32(&p.desc.InUse, ^uint32(0))
			return nil
		}
	}
}

// ExternalPool is a mempool over external memory: a mapping the caller made
// outside the memseg lists. Its objects are handed out in this process
// only. Its memory must be registered by the primary (RegisterMempool
// there) before secondaries use it. ExternalPool is safe for concurrent
// use.
type ExternalPool struct {
	name string
	mem  []byte
	size int
	n    int // objects: the tail past the last whole one is none
	mu   sync.Mutex
	free []uintptr
	out  []bool // by object index: taken
}

// NewExternalPool carves objects of objSize bytes out of mem.
func NewExternalPool(name string, mem []byte, objSize int) (*ExternalPool, error) {
	if objSize <= 0 || len(mem) < objSize {
		return nil, fmt.Errorf("cache: external mempool %s: %d bytes cannot hold objects of %d", name, len(mem), objSize)
	}
	n := len(mem) / objSize
	p := &ExternalPool{name: name, mem: mem, size: objSize, n: n, out: make([]bool, n)}
	base := sliceAddr(mem)
	for i := range n {
		p.free = append(p.free, base+uintptr(i*objSize))
	}
	return p, nil
}

// Name implements Mempool.
func (p *ExternalPool) Name() string { return p.name }

// Chunks implements Mempool.
func (p *ExternalPool) Chunks() []Chunk {
	return []Chunk{{Addr: sliceAddr(p.mem), Len: uint64(len(p.mem))}}
}

// Get takes a free object.
func (p *ExternalPool) Get() (uintptr, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.free) == 0 {
		return 0, ErrPoolEmpty
	}
	a := p.free[len(p.free)-1]
	p.free = p.free[:len(p.free)-1]
	p.out[(a-sliceAddr(p.mem))/uintptr(p.size)] = true
	return a, nil
}

// Put returns an object, with the errors of Pool.Put.
func (p *ExternalPool) Put(addr uintptr) error {
	base := sliceAddr(p.mem)
	off := addr - base
	switch {
	case addr < base || off/uintptr(p.size) >= uintptr(p.n):
		return fmt.Errorf("%w: 0x%x in external mempool %s [0x%x, 0x%x)", ErrNotInPool, addr, p.name, base, base+uintptr(p.n*p.size))
	case off%uintptr(p.size) != 0:
		return fmt.Errorf("%w: 0x%x in external mempool %s (objects of %d bytes from 0x%x)", ErrMisaligned, addr, p.name, p.size, base)
	}
	i := off / uintptr(p.size)
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.out[i] {
		return fmt.Errorf("%w: object 0x%x of external mempool %s", ErrDoublePut, addr, p.name)
	}
	p.out[i] = false
	p.free = append(p.free, addr)
	return nil
}

// PoolInfo describes a shared pool, for dumps.
type PoolInfo struct {
	Name    string `json:"name"`
	Base    uint64 `json:"base"`
	ObjSize uint64 `json:"obj_size"`
	Count   int    `json:"count"`
	InUse   int    `json:"in_use"`
}

// Pools lists the shared pools of seg.
func Pools(seg *shm.Segment) []PoolInfo {
	dir, err := openDir(seg, false)
	if err != nil {
		return nil
	}
	var out []PoolInfo
	for i := range dir.Pools {
		off := atomic.LoadUint64(&dir.Pools[i])
		if off == 0 || seg.CheckRange(off, poolDescSize) != nil {
			continue
		}
		d := shm.At[poolDesc](seg, off)
		n := atomic.LoadUint32(&d.Count)
		out = append(out, PoolInfo{Name: poolName(d), Base: atomic.LoadUint64(&d.Base),
			ObjSize: uint64(atomic.LoadUint32(&d.ObjSize)), Count: int(n),
			InUse: inUse(atomic.LoadUint32(&d.InUse), n)})
	}
	return out
}
