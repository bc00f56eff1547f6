package cache

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"os"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/shm"
)

func init() { testproc.Register("hold-global", helperHoldGlobal) }

// helperHoldGlobal attaches to the segment at args[0], takes the global
// write lock and holds it until it is killed.
func helperHoldGlobal(args []string) int {
	seg, err := shm.Attach(shm.Options{Path: args[0], LayoutTag: layoutTag, Role: shm.RoleObserver, Logger: quiet})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 3
	}
	g, err := AttachGlobal(seg, quiet, 0)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 3
	}
	// Exclusive is the primary's alone: this stands for a process that
	// takes the segment's lock anyway (or a primary), as a test needs.
	if err := g.lock.Lock(context.Background()); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 3
	}
	testproc.Say("held slot=%d", seg.Slot())
	in := testproc.Commands()
	for in.Scan() {
	}
	g.lock.Unlock()
	return 0
}

// readOnly opens p's segment the way a tool does.
func (p *primary) readOnly(t testing.TB) *shm.Segment {
	t.Helper()
	seg, _, err := shm.OpenReadOnly(p.opts)
	require.NoError(t, err)
	t.Cleanup(func() { seg.Close() })
	return seg
}

func TestPeekGlobalMatchesDump(t *testing.T) {
	p := newPrimary(t, fixtureConfig{single: true})
	ps := p.pageSize()
	r := p.alloc(t, 4)
	for i := range 4 {
		_, err := p.g.Create(uint64(r.Addr) + uint64(i)*ps)
		require.NoError(t, err)
	}
	// Freeing a page empties its MR, which moves to the free list until it
	// is deregistered.
	require.NoError(t, p.mem.Free(hugetlb.Region{Addr: r.Addr + uintptr(ps), Len: ps}))
	want, err := p.g.Dump()
	require.NoError(t, err)

	ro := p.readOnly(t)
	before := p.seg.Procs()
	got, err := PeekGlobal(ro, time.Second)
	require.NoError(t, err)
	assert.True(t, got.Consistent)
	assert.Equal(t, want, got.Dump)
	assert.Len(t, got.MRs, 3)
	assert.Len(t, got.Table, 3)
	assert.Equal(t, p.g.LockState(), got.Lock)
	assert.Equal(t, -1, got.Lock.WriterSlot)
	assert.Equal(t, before, p.seg.Procs(), "no slot was claimed")
}

func TestPeekGlobalWithAWriterIn(t *testing.T) {
	p := newPrimary(t, fixtureConfig{})
	_, err := p.g.Create(uint64(p.alloc(t, 1).Addr))
	require.NoError(t, err)
	ro := p.readOnly(t)

	t.Run("live writer", func(t *testing.T) {
		release := p.holdLock(t)
		defer release()
		got, err := PeekGlobal(ro, 20*time.Millisecond)
		require.NoError(t, err)
		assert.False(t, got.Consistent, "the writer stayed in longer than the patience")
		assert.Equal(t, p.seg.Slot(), got.Lock.WriterSlot)
		assert.Len(t, got.MRs, 1, "a best-effort read still sees the state")
	})

	t.Run("dead writer", func(t *testing.T) {
		h := testproc.Start(t, "hold-global", []string{p.opts.Path})
		var slot int
		_, err := fmt.Sscanf(h.Expect("held", 0), "held slot=%d", &slot)
		require.NoError(t, err)
		h.Kill()
		require.Error(t, h.Wait(0))

		start := time.Now()
		got, err := PeekGlobal(ro, time.Minute)
		require.NoError(t, err)
		assert.Less(t, time.Since(start), 5*time.Second, "an abandoned lock is not waited for")
		assert.False(t, got.Consistent)
		assert.Equal(t, slot, got.Lock.WriterSlot)
		assert.False(t, ro.Alive(slot), "held by a dead process")
		assert.Len(t, got.MRs, 1)
		assert.Len(t, got.Table, 1)

		// The primary recovers the lock; peeking is consistent again.
		require.NoError(t, p.g.Exclusive(func() {}))
		got, err = PeekGlobal(ro, time.Second)
		require.NoError(t, err)
		assert.True(t, got.Consistent)
	})
}

// FuzzPeekGlobalSurvivesCorruption overwrites bytes anywhere in the arena
// of a segment with MRs in it — what a dying or buggy writer could leave —
// and reads it the way a tool does: answers may be odd or errors, but
// nothing may crash or loop.
func FuzzPeekGlobalSurvivesCorruption(f *testing.F) {
	p := newPrimary(f, fixtureConfig{single: true})
	ps := p.pageSize()
	r := p.alloc(f, 3)
	for i := range 3 {
		_, err := p.g.Create(uint64(r.Addr) + uint64(i)*ps)
		require.NoError(f, err)
	}
	_, err := CreatePool(p.seg, p.mem, "pool", 64, 4)
	require.NoError(f, err)
	arena := p.seg.ArenaStats()
	at := func(off uint64) uint32 { return uint32(off - arena.Start) }
	d, err := p.g.Dump()
	require.NoError(f, err)
	root := p.seg.Root(shm.RootCache)
	f.Add(at(root), []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f})            // lock offset
	f.Add(at(root+8), []byte{0x10})                                                    // MR list head
	f.Add(at(d.MRs[0].Offset), binary.LittleEndian.AppendUint64(nil, d.MRs[0].Offset)) // a list in a circle
	f.Add(at(d.MRs[1].Offset+44), []byte{0xff, 0xff, 0xff, 0x0f})                      // bitmap length
	f.Add(at(root+64), []byte{0xff, 0xff, 0, 0, 0xff, 0xff, 0, 0})                     // table length and size
	f.Add(at(p.seg.Root(shm.RootMemory)+12), []byte{0x40})                             // memseg list count
	f.Add(at(p.seg.Root(shm.RootPools)), []byte{0x01, 0x02, 0x03})                     // pool directory
	f.Fuzz(func(t *testing.T, where uint32, data []byte) {
		off := arena.Start + uint64(where)%(arena.End-arena.Start)
		b := shm.Slice[byte](p.seg, off, min(len(data), int(arena.End-off)))
		saved := bytes.Clone(b)
		copy(b, data)
		defer copy(b, saved)
		_, _ = PeekGlobal(p.seg, 0)
		_, _ = hugetlb.Describe(p.seg)
		_ = Pools(p.seg)
	})
}

func TestPeekGlobalStopsOnACircularList(t *testing.T) {
	p := newPrimary(t, fixtureConfig{})
	_, err := p.g.Create(uint64(p.alloc(t, 1).Addr))
	require.NoError(t, err)
	d, err := p.g.Dump()
	require.NoError(t, err)
	next := shm.At[uint64](p.seg, d.MRs[0].Offset) // mrRecord.Next
	atomic.StoreUint64(next, d.MRs[0].Offset)
	defer atomic.StoreUint64(next, 0)

	_, err = PeekGlobal(p.readOnly(t), time.Second)
	assert.ErrorIs(t, err, ErrCorrupt)
	assert.ErrorContains(t, err, "longer than the arena")
}
