package primary

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/mpmr/mpmr/cache"
	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/instance"
	"github.com/mpmr/mpmr/internal/sys/mounts"
	"github.com/mpmr/mpmr/internal/sys/ofd"
	"github.com/mpmr/mpmr/ipc"
	"github.com/mpmr/mpmr/shm"
	"github.com/mpmr/mpmr/verbs"
)

// Errors of the primary.
var (
	// ErrPrimaryRunning means a live primary already serves the prefix.
	ErrPrimaryRunning = instance.ErrPrimaryRunning
	// ErrClosed means the primary was closed.
	ErrClosed = errors.New("primary: closed")
	// ErrPermission means the primary refused a runtime directory (or a
	// file in it) that another user could have made or could change: a
	// directory on the way to it that is not this user's or root's, or
	// that others may write to. The message names the path, its owner
	// and mode, this process's uid and the fix. It is ipc.ErrPermission.
	ErrPermission = ipc.ErrPermission
)

// Primary is the process that owns an instance: the control segment, the
// data memory, the device and the global MR cache. It serves secondaries
// over a unix socket. Primary is safe for concurrent use.
type Primary struct {
	cfg    Config
	log    *slog.Logger
	dir    string      // runtime directory
	rundir *ipc.RunDir // dir, opened and checked
	name   string      // the instance's name in backend directories
	lockf  *os.File
	// described: this primary wrote the instance's description (teardown
	// removes only its own; the socket's listener removes its socket).
	described bool
	recorded  bool       // it wrote instance.BackendsFile (teardown removes it once started)
	ownOnly   bool       // recovery finished, recording only its own directory, which teardown empties
	life      *ofd.Claim // its life file (instance.LifePath), locked for the primary's lifetime
	backend   hugetlb.Backend
	private   bool   // its files go in a directory of their own in the backend directory (backend.Dir; see Start)
	madeDir   bool   // that directory, made once the record names it; teardown removes it after them
	shared    string // the backend directory it is made in, looked into as a recorded one (see recoverLeftovers)
	segOpts   shm.Options
	seg       *shm.Segment
	mem       *hugetlb.Memory
	vdev      verbs.Device
	dev       *verbs.Soft // vdev, when it is the soft device
	pd        verbs.PD
	global    *cache.Global
	ctrs      *instance.CounterTable
	queues    instance.Queues
	server    *ipc.Server
	serveWG   sync.WaitGroup
	cancel    context.CancelFunc
	unsub     func()

	// Secondaries that follow memory changes, by peer.
	syncMu sync.Mutex // guards peers, detached, unreaped and judging; taken inside the memory lock and the change hold
	peers  map[*ipc.Peer]*secondary
	// detached holds the connections whose secondary detached: a claim
	// that has left does not come back on them.
	detached map[*ipc.Peer]struct{}
	// unreaped holds the slots (and their claims' epochs) of secondaries
	// whose connection ended while their slot was still held: housekeeping
	// reclaims each once its process is gone.
	unreaped map[int]uint32
	// judging holds, by process, the turn of the hello of the process that
	// asks the kernel about it (see judgeEarlier); closed when it ends.
	judging map[process]chan struct{}
	// procTurns holds, by process, the turn its attachments' mempool
	// registrations queue for the primary's with (see mempoolTurn), while
	// it has attachments in peers or registrations under way.
	procTurns map[process]*procTurn

	served instance.Histogram // service time of requests
	// mempools is held by the secondaries' mempool registration at work
	// (see mempoolTurn).
	mempools  chan struct{}
	requests  atomic.Uint64
	reqErrors atomic.Uint64
	syncs     atomic.Uint64
	drops     atomic.Uint64
	fenced    atomic.Uint64
	throttled atomic.Uint64 // stats requests of strangers refused for the budget

	// The stats answers of peers that have not attached (strangerStats).
	strangerMu     sync.Mutex
	strangerTokens float64
	strangerRefill time.Time
	strangerReply  *ipc.StatsReply
	strangerAt     time.Time

	closeMu sync.Mutex
	closed  atomic.Bool
	// tearing is set once teardown has begun: Close has waited for the
	// Alloc, Free and CreatePool under way, which still sync the
	// secondaries (and fence those that leave) while closed is set.
	tearing atomic.Bool
	// useMu is held for reading by what reads the segment outside the
	// server's handlers (Stats, Dump), and for writing by Close while it
	// unmaps: after that they find closed set.
	useMu sync.RWMutex
	// opMu is held for reading by the calls that change memory or the
	// segment for the caller (Alloc, Free, CreatePool), and for writing by
	// Close before it tears anything down: one under way finishes with
	// the instance whole (its syncs reach the secondaries), a later one
	// finds closed set.
	opMu sync.RWMutex
	// poolMu runs CreatePool one at a time: the mempool directory in the
	// segment is checked and updated in steps.
	poolMu sync.Mutex
}

// secondary is what the primary knows of an attached secondary.
type secondary struct {
	peer  *ipc.Peer
	slot  int
	epoch uint32 // of its claim of the slot
	start uint64 // its process's start time (shm.ProcessStart), read at hello
	// turn is its process's turn, held by the mempool registration of
	// any of its attachments at work or queued for the primary's turn
	// (see mempoolTurn); a hello again on its connection keeps it.
	turn *procTurn
	// files is the first memseg list whose backing file it has not been
	// handed yet (see KindMemoryFiles), or -1 while a request hands some.
	files int
	// drop runs once, for the first of the syncs under way at once that
	// finds it not following; the others wait for it to end (see
	// syncSecondaries).
	drop sync.Once
	// detached says it detached, on its connection or by a later hello of
	// its process (ipc.Hello.Left), and was judged then (fenced if it may
	// still reach data memory): a sync under way that no longer reaches it,
	// and the end of its connection, need no fence. Guarded by syncMu.
	detached bool
	// leaving says a later hello of its process named it as left and asks
	// the kernel about the process: it is handed no backing file. Guarded
	// by syncMu.
	leaving bool
	// fence is the record of the fence taken of it while it was leaving
	// (shm.Segment.FenceClaim), which the hello's answer may end (see
	// detachLeft). Guarded by syncMu.
	fence shm.Proc
}

// running reports whether s's process runs, by the kernel's word
// (shm.Running): whatever its slot says, it may still reach data memory.
// A process that dies lets its slot go once its memory is gone, and ends a
// moment later; one that lets its slot go and lives on may map a backing
// file it kept open at any time.
func (s *secondary) running() bool { return shm.Running(s.peer.PID(), s.start) }

// Start starts the primary of cfg.Prefix: it takes the instance's primary
// lock (failing with ErrPrimaryRunning if a live primary holds it), cleans
// up what a dead predecessor left, creates the control segment, data
// memory, soft device and global cache, and starts serving secondaries.
// Where another user's file, or something that is not a regular file, is
// at one of the names of the instance's files in the backend directory
// (anyone may make one in /dev/shm), or its first try fails on such a
// thing made meanwhile, they go in a directory of their own made there:
// Backend().Dir names it.
func Start(cfg Config) (*Primary, error) {
	if err := cfg.setDefaults(); err != nil {
		return nil, err
	}
	if cfg.Backend == hugetlb.Auto {
		if s := os.Getenv("MPMR_BACKEND"); s != "" {
			k, err := hugetlb.ParseKind(s)
			if err != nil {
				return nil, fmt.Errorf("primary: MPMR_BACKEND: %w", err)
			}
			cfg.Backend = k
		}
	}
	dir, err := instance.Dir(cfg.Prefix, cfg.RuntimeDir)
	if err == nil {
		// The primary names files in it to the end: a relative one must
		// not change meaning when this process changes directory.
		dir, err = filepath.Abs(dir)
	}
	if err != nil {
		return nil, fmt.Errorf("primary: %w", err)
	}
	p := newPrimary(cfg, dir, false)
	err = p.startOrUndo()
	if err != nil && testHookStartFailed != nil {
		testHookStartFailed()
	}
	if err != nil && !p.private && p.squatted(err) {
		// Another user may have made a file at one of the names after
		// this primary looked (see start): once more, in a directory of
		// its own.
		p.log.Warn("the start failed where another user may have made a file at one of the instance's names; "+
			"its files go in a directory of their own there", "err", err)
		first := err
		p = newPrimary(cfg, dir, true)
		if err = p.startOrUndo(); err != nil {
			err = fmt.Errorf("%w (in a directory of its own; in the backend directory: %v)", err, first)
		}
	}
	if err != nil {
		return nil, fmt.Errorf("primary %s: %w", cfg.Prefix, err)
	}
	return p, nil
}

func newPrimary(cfg Config, dir string, private bool) *Primary {
	return &Primary{cfg: cfg, log: cfg.Logger.With("prefix", cfg.Prefix), dir: dir, private: private,
		peers: map[*ipc.Peer]*secondary{}, detached: map[*ipc.Peer]struct{}{}, unreaped: map[int]uint32{},
		judging: map[process]chan struct{}{}, procTurns: map[process]*procTurn{}, mempools: make(chan struct{}, 1)}
}

// testHookStartFailed, if set, runs in Start once a first try has failed
// and been undone.
var testHookStartFailed func()

// startOrUndo starts p, or undoes what it did of the start.
func (p *Primary) startOrUndo() error {
	err := p.start()
	if err != nil {
		if terr := p.teardown(); terr != nil {
			// The start's error is the news; what could not be undone
			// (a file left, a segment still mapped) is logged.
			p.log.Error("cleaning up after a failed start", "err", terr)
		}
	}
	return err
}

// squatted reports whether err, the failure of p's start, may have come
// of what another user made at one of the names of the instance's files in
// its backend directory: something is there, or the start found a file it
// may not use or remove, or could not make one, there. The error decides,
// not what is there now: one who watches the directory can remove its
// file once the start has failed.
func (p *Primary) squatted(err error) bool {
	if p.name == "" || p.backend.Dir == "" {
		return false // it failed before it chose where the files go
	}
	if _, taken := p.nameTaken(); taken {
		return true
	}
	if errors.Is(err, mounts.ErrMayHang) {
		return false // a directory of its own there helps nothing: the names must be looked at still
	}
	for _, e := range []error{ErrPermission, fs.ErrPermission, fs.ErrExist, shm.ErrExists, hugetlb.ErrExists,
		syscall.EISDIR, syscall.ENOTDIR} {
		if errors.Is(err, e) {
			return true
		}
	}
	return false
}

// nameTaken returns the path of what is at one of the names of the
// instance's files in its backend directory and is not a regular file of
// this user, if anything is: another user's file or directory, or a FIFO,
// which the primary may neither use nor remove. Where anything is mounted
// on one of the names (by the mount table, or found so) nothing is looked
// up there, and nothing is said taken: a directory of its own there would
// not help, for the names must still be looked at (see recoverLeftovers),
// and the start fails on it.
func (p *Primary) nameTaken() (string, bool) {
	if p.name == "" || p.backend.Dir == "" {
		return "", false
	}
	tab, err := mounts.Read()
	if err != nil {
		return "", false
	}
	f, dir, _, err := mounts.OpenDir(p.backend.Dir)
	if err != nil {
		return "", false
	}
	defer f.Close()
	if instance.MountOnNames(tab, dir, p.name) != nil {
		return "", false
	}
	for _, path := range instance.Files(dir, p.name) {
		// Through the directory held, crossing into no mount: one may
		// have been made since the table was read.
		st, err := mounts.StatAt(f, filepath.Base(path))
		if err != nil {
			continue
		}
		if st.Mode&syscall.S_IFMT != syscall.S_IFREG || int(st.Uid) != os.Geteuid() {
			return path, true
		}
	}
	return "", false
}

func (p *Primary) start() error {
	var err error
	if p.rundir, err = ipc.OpenRunDir(p.dir, ipc.RunDirOptions{Create: true}); err != nil {
		return err
	}
	if err := p.lockPrimary(); err != nil {
		return err
	}
	c := &p.cfg
	p.backend, err = hugetlb.Choose(hugetlb.Want{Kind: c.Backend, PageSize: c.PageSize, Pages: 2, Dir: c.BackendDir})
	if err != nil {
		return err
	}
	// Secondaries open the files by the paths the primary names: a
	// directory given relative to this process's working directory must
	// not be named so.
	if p.backend.Dir, err = filepath.Abs(p.backend.Dir); err != nil {
		return err
	}
	p.name = instance.Name(c.Prefix, os.Geteuid(), p.rundir.Path())
	// Anyone may make a file in a directory such as /dev/shm, at a name
	// of the instance's files (which anyone can tell): the primary may
	// neither use such a file nor remove it. Its files then go in a
	// directory of its own made there (under a name nobody can foresee,
	// so that nobody makes it first; see recoverLeftovers), which
	// secondaries reach through the description.
	if path, taken := p.nameTaken(); taken && !p.private {
		p.log.Warn("another user's file is at one of the instance's names where its files go; they go in a "+
			"directory of their own there", "path", path)
		p.private = true
	}
	if p.private {
		p.shared = p.backend.Dir
		p.backend.Dir = filepath.Join(p.backend.Dir, instance.PrivateDirName(p.name))
	}
	p.log.Info("backend chosen", "backend", p.backend.Kind, "dir", p.backend.Dir,
		"page_size", hugetlb.FormatSize(p.backend.PageSize), "reason", p.backend.Reason)
	if err := p.recoverLeftovers(); err != nil {
		return err
	}

	p.segOpts = shm.Options{
		Path:      instance.SegmentPath(p.backend.Dir, p.name),
		LockPath:  filepath.Join(p.dir, instance.SlotsLockFile),
		Slots:     c.Slots,
		LayoutTag: instance.LayoutTag,
		Role:      shm.RolePrimary,
		Logger:    p.log,
	}
	// The slots' lock file goes in the checked runtime directory, opened
	// through it without following links.
	create := p.segOpts
	if create.LockFile, err = p.rundir.OpenFile(instance.SlotsLockFile, os.O_RDWR|os.O_CREATE, 0o600); err != nil {
		return err
	}
	if p.seg, err = shm.Create(create); err != nil {
		return err
	}
	if p.mem, err = hugetlb.Create(p.seg, hugetlb.Config{Prefix: p.name, Backend: p.backend,
		Lists: []hugetlb.ListConfig{{Pages: c.MemoryPages, Base: c.MemoryBase}}, Logger: p.log}); err != nil {
		return err
	}
	if err := p.openDevice(); err != nil {
		return err
	}
	if p.dev != nil {
		// The kernel keeps hugetlbfs memory resident: the soft device
		// need not mlock it (mlock would do nothing there but cost a
		// system call on every create).
		for _, l := range p.mem.Lists() {
			if l.Backend != hugetlb.Hugetlbfs {
				continue
			}
			if err := p.dev.Resident(l.Base, l.End-l.Base); err != nil {
				return err
			}
		}
	}
	if p.pd, err = p.vdev.AllocPD(); err != nil {
		return err
	}
	if p.global, err = cache.CreateGlobal(p.seg, cache.GlobalConfig{Memory: p.mem, PD: p.pd,
		SinglePage: c.SinglePage, FullFlush: c.FullFlush, Logger: p.log}); err != nil {
		return err
	}
	if p.ctrs, err = instance.CreateCounters(p.seg); err != nil {
		return err
	}
	// The cache guards frees, so it invalidates (or refuses the free)
	// before secondaries are told to unmap; then the MRs the free emptied
	// are deregistered, so that the device lets go of the memory before
	// anyone does.
	unguard := p.mem.GuardFree(p.collectFreed)
	unsync := p.mem.Subscribe(p.syncSecondaries)
	p.unsub = func() { unsync(); unguard() }
	if err := p.seg.MarkReady(); err != nil {
		return err
	}
	// Everything so far went in through the directory's descriptor; the
	// socket is bound by path, so the path must still lead there.
	if err := p.rundir.Check(); err != nil {
		return err
	}
	sock := filepath.Join(p.dir, ipc.SocketName)
	// No request of the primary takes a descriptor: none is let in,
	// which the kernel enforces where it can (see Config.Limits).
	ln, err := ipc.ListenNoFiles(sock)
	if err != nil {
		return err
	}
	if !ln.RefusesFiles() {
		p.log.Debug("this kernel cannot refuse descriptors sent to the primary (SO_PASSRIGHTS, Linux 6.16); they are dropped on arrival")
	}
	limits := c.Limits
	limits.MaxFilesPerMessage, limits.MaxFilesPerPeer = -1, -1
	// Until a secondary's hello succeeds, its connection is a stranger's
	// (see Config.Limits).
	p.server, err = ipc.NewServer(ipc.ServerConfig{Listener: ln, Handler: (*handler)(p), Logger: p.log,
		AllowUIDs: c.AllowUIDs, Spin: c.Spin, HelloKind: ipc.KindHello, Limits: limits,
		WriteTimeout: c.ReplyTimeout, Inline: inlineKinds})
	if err != nil {
		ln.Close()
		return err
	}
	ctx, cancel := context.WithCancel(context.Background())
	p.cancel = cancel
	p.serveWG.Add(1)
	go func() {
		defer p.serveWG.Done()
		if err := p.server.Serve(ctx); err != nil && !errors.Is(err, ipc.ErrClosed) && ctx.Err() == nil {
			p.log.Error("serving secondaries stopped", "err", err)
		}
	}()
	p.serveWG.Add(1)
	go p.housekeeping(ctx)
	start, _ := shm.ProcessStart(os.Getpid())
	// The runtime directory's files by its real path: the directory may
	// have been given relative to this process's working directory, or
	// through a link, and the description is read by other processes.
	real := instance.RealPath(p.dir)
	if err := instance.WriteInfoIn(p.rundir, instance.Info{
		Prefix: c.Prefix, PID: os.Getpid(), Start: start, Backend: p.backend.Kind.String(),
		BackendDir: p.backend.Dir, PageSize: p.backend.PageSize, Segment: p.segOpts.Path,
		LockFile: filepath.Join(real, instance.SlotsLockFile), Socket: filepath.Join(real, ipc.SocketName),
		Created: time.Now(),
	}); err != nil {
		return err
	}
	p.described = true
	p.log.Info("primary ready", "segment", p.segOpts.Path, "socket", sock)
	return nil
}

// lockPrimary takes the instance's primary lock: byte 0 of the primary lock
// file, held for the primary's lifetime. The file is removed at Close, so
// a lock taken on a file that was unlinked meanwhile is retried on the new
// one.
func (p *Primary) lockPrimary() error {
	name := instance.PrimaryLockFile
	for range 100 {
		f, err := p.rundir.OpenFile(name, os.O_RDWR|os.O_CREATE, 0o600)
		if err != nil {
			return err
		}
		if err := ofd.TryLock(f, 0, true); err != nil {
			f.Close()
			if !errors.Is(err, ofd.ErrLocked) {
				return err
			}
			info, ierr := instance.ReadInfoIn(p.rundir)
			if ierr != nil {
				return ErrPrimaryRunning
			}
			if start, err := shm.ProcessStart(info.PID); err == nil && start == info.Start {
				return fmt.Errorf("%w (pid %d)", ErrPrimaryRunning, info.PID)
			}
			// The lock outlives no process: someone else holds it.
			return fmt.Errorf("%w: its lock is held, but pid %d, the primary %s names, has exited: "+
				"another process holds the lock (an mpmr clean at work, or a primary starting)",
				ErrPrimaryRunning, info.PID, instance.InfoFile)
		}
		if sameFile(f, p.rundir, name) {
			p.lockf = f
			return nil
		}
		f.Close() // a closing primary removed it under us: try the new one
	}
	return fmt.Errorf("%w: %s keeps changing", ErrPrimaryRunning, filepath.Join(p.rundir.Path(), name))
}

// sameFile reports whether f is the file name in d.
func sameFile(f *os.File, d *ipc.RunDir, name string) bool {
	held, err := f.Stat()
	if err != nil {
		return false
	}
	now, err := d.Stat(name)
	st, ok := held.Sys().(*syscall.Stat_t)
	return err == nil && ok && st.Dev == now.Dev && st.Ino == now.Ino
}

// Name returns the instance's name in backend directories: its prefix,
// its user and a hash of its runtime directory (see instance.Name).
func (p *Primary) Name() string { return p.name }

// publishEvery is how often the runtime publishes its counters into the
// segment for tools; reapEvery how often it looks whether quarantined pages
// can go back to the allocator.
const publishEvery = 250 * time.Millisecond

var reapEvery = 20 * time.Millisecond // a variable for tests that must not race housekeeping

// housekeeping publishes the counters now and then, and returns quarantined
// pages once the fenced processes they wait for are gone.
func (p *Primary) housekeeping(ctx context.Context) {
	defer p.serveWG.Done()
	t := time.NewTicker(reapEvery)
	defer t.Stop()
	for n := 1; ; n++ {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		p.reapDisconnected()
		p.mem.Housekeep(time.Now())
		// A process that died holding the global write lock leaves every
		// lookup failing until a writer comes: be that writer.
		if repaired, err := p.global.Repair(); err != nil {
			p.log.Error("repairing the global cache after its writer died", "err", err)
		} else if repaired {
			p.log.Warn("took the global cache lock over from a dead writer and rebuilt the table")
		}
		if n%max(1, int(publishEvery/reapEvery)) == 0 {
			p.Stats()
			// Slots of processes that died where no disconnect told of it
			// (killed while attaching, say).
			if reaped := p.seg.Reap(); len(reaped) > 0 {
				p.log.Info("reclaimed slots of dead processes", "slots", reaped)
			}
		}
	}
}

// openDevice opens the configured device: the soft device in the segment,
// or a hardware one.
func (p *Primary) openDevice() error {
	c := &p.cfg
	var err error
	switch {
	case c.openDevice != nil:
		p.vdev, err = c.openDevice(p.seg, p.log)
	case c.Device == verbs.SoftName:
		p.dev, err = verbs.CreateSoft(p.seg, verbs.SoftOptions{MaxMRs: c.MaxMRs, Logger: p.log})
		p.vdev = p.dev
	default:
		p.vdev, err = verbs.Open(c.Device, verbs.OpenOptions{Segment: p.seg, Logger: p.log})
	}
	if err != nil {
		return err
	}
	if soft, ok := p.vdev.(*verbs.Soft); ok {
		p.dev = soft
	}
	p.log.Info("device opened", "device", p.vdev.Name())
	return nil
}

// Backend returns the backend the data memory and the segment live on.
func (p *Primary) Backend() hugetlb.Backend { return p.backend }

// RuntimeDir returns the instance's runtime directory.
func (p *Primary) RuntimeDir() string { return p.dir }

// Memory returns the data memory.
func (p *Primary) Memory() *hugetlb.Memory { return p.mem }

// Device returns the soft device, or nil when Config.Device names a
// hardware device (see VerbsDevice).
func (p *Primary) Device() *verbs.Soft { return p.dev }

// VerbsDevice returns the device MRs are registered with.
func (p *Primary) VerbsDevice() verbs.Device { return p.vdev }

// Global returns the global MR cache.
func (p *Primary) Global() *cache.Global { return p.global }

// Segment returns the control segment.
func (p *Primary) Segment() *shm.Segment { return p.seg }

// Alloc allocates size bytes of data memory, in whole pages. It returns
// once every attached secondary has mapped them (or was dropped for not
// answering within Config.SyncTimeout: see there how long that can be).
// An error matching hugetlb.ErrHole says the pages it chose are lost (see
// Free) and nothing was allocated.
func (p *Primary) Alloc(size uint64) (hugetlb.Region, error) {
	p.opMu.RLock()
	defer p.opMu.RUnlock()
	if p.closed.Load() {
		return hugetlb.Region{}, ErrClosed
	}
	return p.mem.Alloc(size)
}

// Free frees a region of data memory, any page-aligned part of what Alloc
// returned. Either it completes everything, or it changes nothing and says
// so. When it returns nil, every MR covering the region has been trimmed or
// queued for deregistration, every queue in every process will flush before
// its next lookup, no lookup that starts now returns a key for the region,
// and every secondary has unmapped the pages — or, if one did not answer
// within Config.SyncTimeout (see there how long that can be), it was
// dropped and fenced, and the pages wait
// in quarantine (mapped nowhere here, never handed to Alloc, not returned
// to the kernel) until it is gone. If the registrations cannot be
// invalidated (the global lock cannot be had within its timeout), Free
// returns an error matching hugetlb.ErrNotFreed and the region stays
// allocated, mapped and registered. One exception to all or nothing: an
// error matching hugetlb.ErrHole says the region was freed as above but
// its unmap here left a hole, and its pages are never used again by this
// process (see hugetlb.Memory.Free; they wait in no quarantine); do not
// free it again.
func (p *Primary) Free(r hugetlb.Region) error {
	p.opMu.RLock()
	defer p.opMu.RUnlock()
	if p.closed.Load() {
		return ErrClosed
	}
	return p.mem.Free(r)
}

// collectFreed is the primary's free guard, after the cache's: the MRs the
// invalidation emptied are deregistered before the pages go (a device stops
// using memory before it is released), not at the next creation. If the
// device keeps one of this free's MRs, the free is refused: the memory
// stays, without the registrations the invalidation already removed. One
// it keeps from another free does not refuse this one.
func (p *Primary) collectFreed(ev hugetlb.Event) error {
	if beforeCollect != nil {
		beforeCollect()
	}
	return p.global.CollectFor(uint64(ev.Addr), ev.Len)
}

// beforeCollect, when set (by tests, before the primary starts), runs as
// collectFreed starts: after the invalidation, before the collection.
var beforeCollect func()

// Queue is a per-queue MR cache of the primary: use it from one goroutine
// at a time. Close it when the queue goes away. Its lookups (Lookup, Hit,
// LookupBurst, LookupRange) are cache.Local's.
type Queue struct {
	*cache.Local
	p *Primary
}

// NewQueue returns a local cache whose misses register memory in this
// process.
func (p *Primary) NewQueue() *Queue {
	l := p.queues.Add(func() *cache.Local { return cache.NewLocal(p.global, p.global, 0) })
	return &Queue{Local: l, p: p}
}

// Close stops counting the queue in Stats (its counters so far stay).
// Call it from the queue's goroutine, and use the queue no more: once the
// primary is closed too, the segment its lookups read may be gone.
func (q *Queue) Close() {
	q.Publish()
	q.p.queues.Remove(q.Local)
}

// CreatePool allocates a shared mempool of count objects of objSize bytes
// in data memory, which every secondary can open by name: 1 to 32 bytes,
// no NUL, and no other pool's (cache.ErrPoolExists).
func (p *Primary) CreatePool(name string, objSize, count int) (*cache.Pool, error) {
	// It writes the pool's descriptor into the segment after allocating
	// it: Close must not unmap the segment meanwhile.
	p.opMu.RLock()
	defer p.opMu.RUnlock()
	if p.closed.Load() {
		return nil, ErrClosed
	}
	p.poolMu.Lock()
	defer p.poolMu.Unlock()
	return cache.CreatePool(p.seg, p.mem, name, objSize, count)
}

// RegisterMempool registers every chunk of mp (external memory included)
// and fills q's cache with the keys, as a driver does before starting a
// queue.
func (p *Primary) RegisterMempool(q *Queue, mp cache.Mempool) error {
	if p.closed.Load() {
		return ErrClosed
	}
	return q.RegisterMempool(mp)
}

// Close stops serving (secondaries see ErrPrimaryGone at once), releases
// every MR, the data memory (hugepages go back to the kernel once no
// secondary maps them) and the segment, and removes the instance's files.
// Idempotent. Close the queues first. A lookup after Close fails with
// cache.ErrClosed (Hit reports false), in a queue made before Close or
// after it; one that races Close gets a key or an error, never a fault:
// while queues are open, Close leaves the segment's address range mapped
// to private zeros instead of unmapping it under them, and the last
// queue's Close gives it back. Alloc, Free and CreatePool calls under way
// finish first (a Free's sync still reaches the secondaries); later ones
// fail with ErrClosed. Use no pool after Close: its objects and links
// live in the segment.
func (p *Primary) Close() error {
	p.closeMu.Lock()
	defer p.closeMu.Unlock()
	if p.closed.Swap(true) {
		return nil
	}
	// Alloc, Free and CreatePool under way finish first, with their syncs;
	// later ones see closed.
	p.opMu.Lock()
	defer p.opMu.Unlock()
	return p.teardown()
}

// teardown releases whatever start managed to build, in reverse.
func (p *Primary) teardown() error {
	p.tearing.Store(true)
	var errs []error
	add := func(err error) {
		if err != nil {
			errs = append(errs, err)
		}
	}
	if p.seg != nil && p.server != nil {
		// First, so that a secondary that sees its connection end knows
		// the instance is ending (and not that it was dropped).
		p.seg.MarkDead()
	}
	if p.server != nil {
		add(p.server.Close())
		p.cancel()
		p.serveWG.Wait()
	}
	if p.unsub != nil {
		p.unsub()
	}
	// The handlers are done; whoever else reads the segment (Stats, Dump)
	// finishes first, or finds it closed.
	p.useMu.Lock()
	defer p.useMu.Unlock()
	if p.global != nil {
		add(p.global.Close())
	}
	if p.vdev != nil {
		add(p.vdev.Close())
	}
	if p.mem != nil {
		add(p.mem.Close())
	}
	if p.seg != nil {
		p.seg.MarkDead()
		add(p.queues.CloseSegment(p.seg, p.global))
		add(shm.Remove(p.segOpts))
	}
	if p.life != nil {
		add(p.life.Remove()) // last: unlinked before it is unlocked
	}
	if p.madeDir {
		if err := os.Remove(p.backend.Dir); err != nil && !errors.Is(err, os.ErrNotExist) {
			add(err)
		}
	}
	if p.lockf != nil {
		// Only what this primary made: a start refused because another
		// primary lives (one whose primary lock file was removed) leaves
		// that one's socket and description where they are.
		if p.described {
			if err := p.rundir.Remove(instance.InfoFile); err != nil && !errors.Is(err, os.ErrNotExist) {
				add(err)
			}
		}
		// After the backend files, and only once they are all removed
		// and the record names nothing else (recovery finished and left
		// nothing elsewhere): a primary that dies in between, or a start
		// that failed before recovery was done, leaves the next one the
		// record of where files may be.
		if p.recorded && (p.described || p.ownOnly) && len(errs) == 0 {
			if err := p.rundir.Remove(instance.BackendsFile); err != nil && !errors.Is(err, os.ErrNotExist) {
				add(err)
			}
		}
		// The primary lock goes last: a new primary may start from here.
		if sameFile(p.lockf, p.rundir, instance.PrimaryLockFile) {
			add(p.rundir.Remove(instance.PrimaryLockFile))
		}
		add(p.lockf.Close())
		_ = p.rundir.RemoveDir() // only if empty and still ours: not removed and made anew meanwhile
	}
	if p.rundir != nil {
		p.rundir.Close()
	}
	return errors.Join(errs...)
}
