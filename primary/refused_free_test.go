package primary_test

import (
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/verbs"
)

// A free's guards run without the memory lock, with its pages marked as
// being freed. A free that a guard then refuses must change nothing: the
// creates of its pages asked while the guards ran (in the primary, by a
// primary queue's miss, by a secondary) wait for the answer and, the free
// refused, get their keys, instead of failing for memory that stays.
func TestCreatesDuringARefusedFreesGuardsGetTheirKeys(t *testing.T) {
	p, cfg := startPrimary(t, testenv.Tmpfs(t))
	ps := p.Backend().PageSize
	r, err := p.Alloc(2 * ps)
	require.NoError(t, err)
	h := startSecondary(t, cfg)

	entered, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	unguard := p.Memory().GuardFree(func(hugetlb.Event) error {
		once.Do(func() { close(entered); <-release })
		return errors.New("not now")
	})
	defer unguard()
	freed := make(chan error, 1)
	go func() { freed <- p.Free(r) }()
	<-entered

	var cerr, lerr error
	var sec string
	var wg sync.WaitGroup
	wg.Go(func() { _, cerr = p.Global().Create(uint64(r.Addr)) })
	wg.Go(func() {
		q := p.NewQueue()
		defer q.Close()
		_, lerr = q.Lookup(r.Addr + uintptr(ps))
	})
	wg.Go(func() { sec = ask(t, h, "create %d", r.Addr) })
	require.Eventually(t, func() bool { return testenv.GoroutinesIn("(*Global).Create(", "chan receive") == 3 },
		20*time.Second, 100*time.Microsecond, "the three creates wait for the guards' answer")
	close(release)
	wg.Wait()
	require.ErrorIs(t, <-freed, hugetlb.ErrNotFreed)
	assert.NoError(t, cerr, "the primary's create")
	assert.NoError(t, lerr, "a primary queue's lookup")
	assert.Contains(t, sec, "key", "a secondary's create")
	e, found, err := p.Global().Lookup(uint64(r.Addr))
	require.NoError(t, err)
	require.True(t, found)
	assert.NoError(t, p.Device().Validate(verbs.SGE{Addr: r.Addr, Len: 1, Key: e.LKey}, verbs.AccessLocalWrite))
	unguard()
	assert.NoError(t, p.Free(r), "the memory is still allocated, and frees once the guard lets it")
}
