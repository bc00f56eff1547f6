package primary_test

import (
	"fmt"
	"os"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Offsets of the global cache's words a peer rewrites (see
// shm/layout_unsafe.go: the roots at +168, 8 bytes each; cache/global.go's
// globalRoot: the lock's offset at +0, MRList at +8, MRCount at +24).
const (
	forgedRootCache = b9Roots + 8*1
	forgedMRList    = 8
	forgedMRCount   = 24
)

// cacheRoot returns the offset of the global cache's root.
func (b *b9Inst) cacheRoot() int64 {
	r := b.u64(forgedRootCache)
	require.NotZero(b.t, r, "no cache root")
	return int64(r)
}

// A process of the user unlinks the MR list in the segment (the global
// root's MRList word set to 0). A free must still have the device refuse
// the freed memory's key, there and over the next allocation at the same
// address, and no lookup that starts after it may be served the key: the
// primary takes what it registered from its own record, not from the list.
// (A free refused instead fails closed, which is fine too.)
func TestAnUnlinkedMRListKeepsNoFreedKeyValid(t *testing.T) {
	b := b9Start(t)
	sc := b9Two(t, b)
	a, alen, sec, key := sc.a, sc.alen, sc.sec, sc.key
	require.Equal(t, "ok", ask(t, sec, "validate %d %d", a, key), "the key is good before")

	root := b.cacheRoot()
	t.Logf("MRList %#x, MRCount %d", b.u64(root+forgedMRList), b.u32(root+forgedMRCount))
	b.put64(root+forgedMRList, 0) // the other process's only write

	ans := b.must("free %d %d", a, alen)
	t.Logf("primary free: %s", ans)
	if ans != "ok" {
		return // refused: fail closed, fine
	}
	v1 := ask(t, sec, "validate %d %d", a, key)
	l1 := ask(t, sec, "lookup %d", a)
	t.Logf("after the free: device on the old key: %s; a secondary's fresh lookup: %s", v1, l1)
	assert.NotEqual(t, "ok", v1, "the device accepts key %d over [%#x, +%#x), which the primary freed", key, a, alen)
	assert.False(t, strings.HasPrefix(l1, "key "), "a lookup that starts after the free is served %s", l1)

	na, _ := b.alloc(1)
	t.Logf("the next alloc got %#x (freed region was %#x)", na, a)
	if na == a {
		v2 := ask(t, sec, "validate %d %d", a, key)
		t.Logf("device on the old key over the new allocation: %s", v2)
		assert.NotEqual(t, "ok", v2, "the old key %d validates over a NEW allocation at %#x: DMA into someone else's buffer", key, a)
	}
}

// A process of the user writes, into the global lock's owner word, the
// primary's own mark (its slot and epoch, both readable in the process
// table) while the primary does not hold the lock. The primary's writers
// must take the lock back rather than wait for a hold of their own that
// does not exist: the next free and create work, each at once.
func TestAnOwnerWordForgedWithThePrimarysMarkDoesNotShutItOut(t *testing.T) {
	b := b9Start(t)
	sc := b9Two(t, b)
	a, alen := sc.a, sc.alen

	root := b.cacheRoot()
	lockOff := int64(b.u64(root + 0))
	require.NotZero(t, lockOff)
	// The primary's slot: the one whose pid is the primary helper's.
	pslot := -1
	for i := 0; i < 64; i++ {
		if int(b.u32(b9Table+int64(i)*b9SlotSize+8)) == b.h.PID() {
			pslot = i
			break
		}
	}
	if pslot < 0 {
		for i := 0; i < 8; i++ {
			t.Logf("slot %d: % x", i, b.read(b9Table+int64(i)*b9SlotSize, 40))
		}
		t.Fatalf("primary pid %d not found in the process table", b.h.PID())
	}
	epoch := b.u32(b9Table + int64(pslot)*b9SlotSize + b9SlotEpoch)
	mark := uint64(epoch)<<32 | uint64(pslot+1)
	t.Logf("primary slot %d epoch %d: owner word <- %#x (was %#x)", pslot, epoch, mark, b.u64(lockOff))
	b.put64(lockOff, mark)

	free := b.must("free %d %d", a, alen)
	create := b.must("create %d", sc.other)
	assert.Equal(t, "ok", free, "the free is refused: the primary did not get its own lock back")
	assert.True(t, strings.HasPrefix(create, "key "), "the create failed: the primary did not get its own lock back: %s", create)
}

// The same word written with the mark of a live secondary (its slot and
// epoch): no secondary ever takes the global lock to write, so the word
// is as forged as one naming the primary, and the primary must not wait
// for that secondary to let go of a hold it never took (it waited its
// whole lock timeout, and failed, for as long as the secondary lived).
func TestAnOwnerWordForgedWithASecondarysMarkDoesNotShutThePrimaryOut(t *testing.T) {
	b := b9Start(t)
	sc := b9Two(t, b)
	root := b.cacheRoot()
	lockOff := int64(b.u64(root + 0))
	require.NotZero(t, lockOff)
	epoch := b.u32(b9Table + int64(sc.slot)*b9SlotSize + b9SlotEpoch)
	b.put64(lockOff, uint64(epoch)<<32|uint64(sc.slot+1))

	create := b.must("create %d", sc.other)
	free := b.must("free %d %d", sc.a, sc.alen)
	assert.True(t, strings.HasPrefix(create, "key "), "the create waited for the secondary named: %s", create)
	assert.Equal(t, "ok", free, "the free waited for the secondary named")
}

// A process of the user keeps writing 1 into the global lock's Flags word
// (the word after the owner word: "inconsistent") for a second while the
// primary allocates, frees and creates. Whatever those writes cost while
// they last, once they stop the primary's creates and frees must work:
// a flag written under one of its holds is no repair it owes, and must not
// make it abandon the lock for good.
func TestAForgedInconsistentFlagDoesNotEndThePrimarysWrites(t *testing.T) {
	b := b9Start(t)
	sc := b9Two(t, b)
	root := b.cacheRoot()
	lockOff := int64(b.u64(root + 0))
	require.NotZero(t, lockOff)

	f, err := os.OpenFile(b.seg, os.O_RDWR, 0)
	require.NoError(t, err)
	defer f.Close()
	st, err := f.Stat()
	require.NoError(t, err)
	mem, err := syscall.Mmap(int(f.Fd()), 0, int(st.Size()), syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED)
	require.NoError(t, err)
	defer syscall.Munmap(mem)
	flags := (*uint32)(unsafe.Pointer(&mem[lockOff+8]))

	var stop atomic.Bool
	done := make(chan struct{})
	defer func() { stop.Store(true); <-done }()
	go func() { // the other process's writes
		defer close(done)
		for !stop.Load() {
			atomic.StoreUint32(flags, 1)
		}
	}()
	deadline := time.Now().Add(time.Second)
	var errs []string
	for time.Now().Before(deadline) {
		for _, cmd := range []string{fmt.Sprintf("create %d", sc.other), "alloc 1"} {
			ans, err := b.do("%s", cmd)
			require.NoError(t, err)
			if strings.HasPrefix(ans, "region ") {
				var a, l uint64
				_, _ = fmt.Sscanf(ans, "region %d %d", &a, &l)
				ans, err = b.do("free %d %d", a, l)
				require.NoError(t, err)
			}
			if strings.HasPrefix(ans, "err") && len(errs) < 4 {
				errs = append(errs, ans)
			}
		}
	}
	t.Logf("while the peer wrote, first errors: %q", errs)
	stop.Store(true)
	<-done
	atomic.StoreUint32(flags, 0) // even cleaned up by the peer
	t.Logf("owner word now %#x, flags %d", b.u64(lockOff), b.u32(lockOff+8))

	primaryWorks(t, b, sc.other, b.page)
}

// primaryWorks checks that the primary creates an MR for memory it
// allocates now (a create that takes the write lock: one of registered
// memory is answered from the table without it) and frees
// [free, free+length).
func primaryWorks(t *testing.T, b *b9Inst, free, length uint64) {
	t.Helper()
	fresh, _ := b.alloc(1)
	create := b.must("create %d", fresh)
	freed := b.must("free %d %d", free, length)
	t.Logf("create %q, free %q", create, freed)
	assert.True(t, strings.HasPrefix(create, "key "), "the primary's creates fail for good: %s", create)
	assert.Equal(t, "ok", freed, "the primary's frees are refused for good")
}

// The same without a race: a process of the user writes two words while
// the primary holds nothing, the lock's Flags word ("inconsistent") and
// the root's MRList (a record offset that does not fit the segment), and
// puts both back after the primary's next write. That write is told to
// repair and cannot rebuild from the list; the primary must not abandon
// the lock for it: once the words are back, its creates and frees work.
func TestTwoForgedWordsPutBackLeaveThePrimaryWorking(t *testing.T) {
	b := b9Start(t)
	sc := b9Two(t, b)
	root := b.cacheRoot()
	lockOff := int64(b.u64(root + 0))
	list := b.u64(root + forgedMRList)
	require.NotZero(t, lockOff)

	b.put32(lockOff+8, 1)                // Flags: inconsistent
	b.put64(root+forgedMRList, 1<<40+64) // a list head outside the segment
	first := b.must("create %d", sc.other)
	t.Logf("create while forged: %s", first)

	b.put64(root+forgedMRList, list) // the peer undoes both writes
	b.put32(lockOff+8, 0)
	t.Logf("owner word now %#x, flags %d", b.u64(lockOff), b.u32(lockOff+8))
	primaryWorks(t, b, sc.a, sc.alen)
}
