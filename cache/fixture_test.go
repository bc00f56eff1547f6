package cache

import (
	"log/slog"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/shm"
	"github.com/mpmr/mpmr/verbs"
)

func TestMain(m *testing.M) { testproc.Main(m) }

var quiet = slog.New(slog.DiscardHandler)

// layoutTag is what the runtimes pass: every layer's shared structs.
var layoutTag = func() uint32 {
	var d []string
	d = append(d, Layout()...)
	d = append(d, hugetlb.Layout()...)
	d = append(d, verbs.Layout()...)
	return shm.LayoutHash(d...)
}()

// primary is an in-process primary: segment, memory, soft device, global
// cache.
type primary struct {
	seg  *shm.Segment
	mem  *hugetlb.Memory
	dev  *verbs.Soft
	g    *Global
	opts shm.Options
	name string
}

type fixtureConfig struct {
	backend   hugetlb.Backend
	pages     int
	tableSize int
	single    bool
	maxMRs    int
	// lockTimeout bounds the global lock's waits (default 5 s).
	lockTimeout time.Duration
	// pageSize of the memseg list (default: the backend's).
	pageSize uint64
	// logSize and fullFlush configure the invalidation log.
	logSize   int
	fullFlush bool
}

func newPrimary(t testing.TB, c fixtureConfig) *primary {
	t.Helper()
	if c.backend.Dir == "" {
		c.backend = testenv.Tmpfs(t)
	}
	if c.pages == 0 {
		c.pages = 64
	}
	name := testenv.Name(t)
	o := shm.Options{Path: filepath.Join(c.backend.Dir, "mpmr."+name+".ctl"), LayoutTag: layoutTag,
		Slots: 16, Role: shm.RolePrimary, Logger: quiet}
	seg, err := shm.Create(o)
	require.NoError(t, err)
	p := &primary{seg: seg, opts: o, name: name}
	t.Cleanup(func() { p.close(t) })
	p.mem, err = hugetlb.Create(seg, hugetlb.Config{Prefix: name, Backend: c.backend,
		Lists: []hugetlb.ListConfig{{Pages: c.pages, PageSize: c.pageSize}}, Logger: quiet})
	require.NoError(t, err)
	p.dev, err = verbs.CreateSoft(seg, verbs.SoftOptions{MaxMRs: c.maxMRs, Logger: quiet})
	require.NoError(t, err)
	for _, l := range p.mem.Lists() { // as the primary does
		if l.Backend == hugetlb.Hugetlbfs {
			require.NoError(t, p.dev.Resident(l.Base, l.End-l.Base))
		}
	}
	pd, err := p.dev.AllocPD()
	require.NoError(t, err)
	p.g, err = CreateGlobal(seg, GlobalConfig{Memory: p.mem, PD: pd, TableSize: c.tableSize,
		SinglePage: c.single, LockTimeout: c.lockTimeout, LogSize: c.logSize, FullFlush: c.fullFlush, Logger: quiet})
	require.NoError(t, err)
	require.NoError(t, seg.MarkReady())
	return p
}

// holdLock takes the global write lock on another goroutine and keeps it
// until release is called; release returns what Exclusive returned.
func (p *primary) holdLock(t testing.TB) (release func() error) {
	t.Helper()
	held, let := make(chan struct{}), make(chan struct{})
	done := make(chan error, 1)
	go func() {
		done <- p.g.Exclusive(func() {
			close(held)
			<-let
		})
	}()
	<-held
	var once sync.Once
	return func() error {
		once.Do(func() { close(let) })
		return <-done
	}
}

// close releases everything, going on past failures so that no file is
// left behind.
func (p *primary) close(t testing.TB) {
	if p.g != nil {
		assert.NoError(t, p.g.Close())
	}
	if p.dev != nil {
		assert.NoError(t, p.dev.Close())
	}
	if p.mem != nil {
		assert.NoError(t, p.mem.Close())
	}
	assert.NoError(t, p.seg.Close())
	assert.NoError(t, shm.Remove(p.opts))
}

func (p *primary) alloc(t testing.TB, pages int) hugetlb.Region {
	t.Helper()
	r, err := p.mem.Alloc(uint64(pages) * p.pageSize())
	require.NoError(t, err)
	return r
}

func (p *primary) pageSize() uint64 { return p.mem.Lists()[0].PageSize }

// validates reports whether the soft device accepts key for one byte at
// addr, as a device would check a descriptor.
func (p *primary) validates(addr uintptr, key uint32) error {
	return p.dev.Validate(verbs.SGE{Addr: addr, Len: 1, Key: key}, verbs.AccessLocalWrite)
}

// forwarder is the test double of a secondary's create path: it forwards to
// the primary's Global in-process, where a real secondary would use IPC.
type forwarder struct {
	g     *Global
	calls int
}

func (f *forwarder) CreateMR(addr uint64) (Entry, error) {
	f.calls++
	return f.g.Create(addr)
}

func (f *forwarder) RegisterExternal(addr, length uint64) (Entry, error) {
	return Entry{}, ErrExternalMemory
}

// attachView opens the global cache through a second attachment of the
// segment, as another process would see it.
func (p *primary) attachView(t testing.TB) *Global {
	t.Helper()
	o := p.opts
	o.Role = shm.RoleSecondary
	seg, err := shm.Attach(o)
	require.NoError(t, err)
	t.Cleanup(func() { seg.Close() })
	g, err := AttachGlobal(seg, quiet, 0)
	require.NoError(t, err)
	return g
}

// externalBuffer maps anonymous memory outside every memseg list.
func externalBuffer(t testing.TB, size int) []byte {
	t.Helper()
	b, err := syscall.Mmap(-1, 0, size, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
	require.NoError(t, err)
	t.Cleanup(func() { syscall.Munmap(b) })
	return b
}

func hugetlbOrSkip(tb testing.TB) hugetlb.Backend { return testenv.Hugetlb(tb, 4) }
