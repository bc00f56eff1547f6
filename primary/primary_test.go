package primary_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/cache"
	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/ipc"
	"github.com/mpmr/mpmr/primary"
	"github.com/mpmr/mpmr/secondary"
	"github.com/mpmr/mpmr/verbs"
)

func TestSecondaryLooksUpAndCreatesOverIPC(t *testing.T) {
	testenv.ForEachBackend(t, 8, func(t *testing.T, b hugetlb.Backend) {
		p, cfg := startPrimary(t, b)
		r, err := p.Alloc(2 * p.Backend().PageSize)
		require.NoError(t, err)
		r.Bytes()[100] = 42
		h := startSecondary(t, cfg)

		assert.Equal(t, "byte 42", ask(t, h, "read %d", r.Addr+100), "same memory at the same address")
		k := parseKey(t, ask(t, h, "lookup %d", r.Addr+8))
		assert.Equal(t, "ok", ask(t, h, "validate %d %d", r.Addr+8, k))
		require.NoError(t, p.Device().Validate(verbs.SGE{Addr: r.Addr, Len: 1, Key: k}, verbs.AccessLocalWrite))
		assert.Equal(t, 1, p.Global().Stats().MRs, "the primary created the MR for the secondary")

		// Memory allocated after the secondary attached is mapped there
		// before Alloc returns.
		r2, err := p.Alloc(p.Backend().PageSize)
		require.NoError(t, err)
		r2.Bytes()[0] = 7
		assert.Equal(t, "byte 7", ask(t, h, "read %d", r2.Addr))

		// Once Free returns, the secondary no longer gets a key.
		require.NoError(t, p.Free(r))
		assert.Contains(t, ask(t, h, "lookup %d", r.Addr+8), "not in any known memory")
		assert.Contains(t, ask(t, h, "stats"), "requests=")
		assert.Equal(t, "closed", ask(t, h, "close"))
	})
}

func TestManyGoroutinesInTwoSecondariesAllAnswered(t *testing.T) {
	p, cfg := startPrimary(t, testenv.Tmpfs(t), func(c *primary.Config) { c.SinglePage = true })
	ps := p.Backend().PageSize
	r, err := p.Alloc(16 * ps)
	require.NoError(t, err)
	hs := []interface{ Send(string, ...any) }{}
	_ = hs
	a, b := startSecondary(t, cfg), startSecondary(t, cfg)
	a.Send("hammer 8 400 %d %d", r.Addr, r.Len)
	b.Send("hammer 8 400 %d %d", r.Addr, r.Len)
	for _, h := range []string{a.Expect("> done", 0), b.Expect("> done", 0)} {
		var lookups, failures int
		_, err := fmt.Sscanf(h, "> done %d %d", &lookups, &failures)
		require.NoError(t, err)
		assert.Equal(t, 3200, lookups)
		assert.Zero(t, failures)
	}
	st := p.Global().Stats()
	assert.Equal(t, 16, st.MRs, "one MR per page, however many asked at once")
}

func TestSecondPrimaryRefused(t *testing.T) {
	_, cfg := startPrimary(t, testenv.Tmpfs(t))
	_, err := primary.Start(cfg)
	assert.ErrorIs(t, err, primary.ErrPrimaryRunning)
}

func TestCloseLeavesNothingBehind(t *testing.T) {
	testenv.ForEachBackend(t, 8, func(t *testing.T, b hugetlb.Backend) {
		before := freeHugepages(t)
		p, cfg := startPrimary(t, b)
		r, err := p.Alloc(3 * p.Backend().PageSize)
		require.NoError(t, err)
		h := startSecondary(t, cfg)
		parseKey(t, ask(t, h, "lookup %d", r.Addr))
		dir := p.RuntimeDir()
		bdir := p.Backend().Dir
		require.NoError(t, p.Close())
		require.NoError(t, p.Close(), "Close is idempotent")

		// The secondary sees the primary gone at once.
		assert.Contains(t, ask(t, h, "lookup %d", r.Addr+uintptr(p.Backend().PageSize)), "primary has gone")
		assert.Equal(t, "closed", ask(t, h, "close"))
		h.CloseInput()
		require.NoError(t, h.Wait(0))

		_, err = os.Stat(dir)
		assert.ErrorIs(t, err, os.ErrNotExist, "the runtime directory is gone")
		matches, _ := filepath.Glob(filepath.Join(bdir, "mpmr."+cfg.Prefix+".*"))
		assert.Empty(t, matches, "no segment or memory file is left")
		if b.Kind == hugetlb.Hugetlbfs {
			assert.Equal(t, before, freeHugepages(t), "every hugepage went back")
		}
	})
}

func freeHugepages(t testing.TB) uint64 {
	pool, err := hugetlb.PoolFor(hugetlb.DefaultPageSize())
	if err != nil {
		return 0
	}
	return pool.Free
}

func TestSecondaryWithoutPrimary(t *testing.T) {
	_, err := secondary.Attach(secondary.Config{Prefix: "nobody-here", RuntimeDir: t.TempDir(), Logger: quiet})
	assert.ErrorIs(t, err, secondary.ErrNoPrimary)
	assert.True(t, errors.Is(err, secondary.ErrNoPrimary))
}

var _ = verbs.InvalidKey

// A mempool chunk that is no range (empty, or ending past 2^64) gets
// cache.ErrBadChunk from the primary and from a secondary, registers
// nothing, and costs the secondary nothing: its connection stays.
func TestRegisterMempoolRefusesBadChunks(t *testing.T) {
	p, cfg := startPrimary(t, testenv.Tmpfs(t))
	ps := p.Backend().PageSize
	r, err := p.Alloc(ps)
	require.NoError(t, err)
	bad := []ipc.Chunk{
		{Addr: uint64(r.Addr), Len: 0},
		{Addr: 0x1000, Len: 0},
		{Addr: uint64(r.Addr), Len: ^uint64(0)},
		{Addr: ^uint64(0) - 4095, Len: 4096},
	}
	for _, c := range bad {
		reply, err := primary.HandleRegisterMempool(t.Context(), p, &ipc.RegisterMempool{Name: "pkts",
			Chunks: []ipc.Chunk{{Addr: uint64(r.Addr), Len: 64}, c}})
		assert.ErrorIs(t, err, cache.ErrBadChunk, "chunk %+v: reply %+v", c, reply)
		assert.Nil(t, reply, "no key for chunk %+v", c)
	}
	assert.Zero(t, p.Global().Stats().MRs, "nothing registered")

	h := startSecondary(t, cfg)
	for _, c := range bad {
		assert.Contains(t, ask(t, h, "regpool %d %d", c.Addr, c.Len), cache.ErrBadChunk.Error())
	}
	assert.Zero(t, p.Global().Stats().MRs, "nothing registered")
	assert.Equal(t, "ok", ask(t, h, "regpool %d %d", r.Addr, ps), "the secondary is still attached")
	k := parseKey(t, ask(t, h, "lookup %d", r.Addr))
	assert.Equal(t, "ok", ask(t, h, "validate %d %d", r.Addr, k))
}

// A mempool request whose chunks all name memory registered already takes
// no write section, however many chunks it has: a peer cannot turn one
// frame into thousands of write-locked creates.
func TestRegisterMempoolOfRegisteredMemoryTakesNoWriteLock(t *testing.T) {
	p, _ := startPrimary(t, testenv.Tmpfs(t))
	ps := p.Backend().PageSize
	r, err := p.Alloc(2 * ps)
	require.NoError(t, err)
	_, err = p.Global().Create(uint64(r.Addr))
	require.NoError(t, err)
	chunks := make([]ipc.Chunk, ipc.MaxChunks)
	for i := range chunks {
		chunks[i] = ipc.Chunk{Addr: uint64(r.Addr) + uint64(i%64)*64, Len: 64}
	}
	before := p.Global().LockState().Seq
	reply, err := primary.HandleRegisterMempool(t.Context(), p, &ipc.RegisterMempool{Name: "same", Chunks: chunks})
	require.NoError(t, err)
	keys := reply.(*ipc.RegisterMempoolReply).Keys
	require.Len(t, keys, len(chunks))
	want, found, err := p.Global().Lookup(uint64(r.Addr))
	require.NoError(t, err)
	require.True(t, found)
	for _, k := range keys {
		require.Equal(t, want.LKey, k)
	}
	assert.Equal(t, before, p.Global().LockState().Seq, "no writer took the global lock")
}

// The work of a mempool request stops when its context ends (the peer
// went, or the primary closes): nothing more is registered for it.
func TestRegisterMempoolStopsWhenItsPeerGoes(t *testing.T) {
	p, _ := startPrimary(t, testenv.Tmpfs(t))
	ps := p.Backend().PageSize
	r, err := p.Alloc(4 * ps)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	_, err = primary.HandleRegisterMempool(ctx, p, &ipc.RegisterMempool{Name: "gone",
		Chunks: []ipc.Chunk{{Addr: uint64(r.Addr), Len: 4 * ps}}})
	assert.ErrorIs(t, err, context.Canceled)
	assert.Zero(t, p.Global().Stats().MRs, "nothing registered for a peer that is gone")
}
