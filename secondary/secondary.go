package secondary

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/mpmr/mpmr/cache"
	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/instance"
	"github.com/mpmr/mpmr/internal/sys/affinity"
	"github.com/mpmr/mpmr/internal/sys/mounts"
	"github.com/mpmr/mpmr/ipc"
	"github.com/mpmr/mpmr/shm"
	"github.com/mpmr/mpmr/verbs"
	"golang.org/x/sys/unix"
)

// Errors of a secondary.
var (
	// ErrPrimaryGone means the primary has ended (or dropped this
	// secondary): requests fail at once, while keys already in local
	// caches keep resolving.
	ErrPrimaryGone = instance.ErrPrimaryGone
	// ErrNoPrimary means no primary serves the prefix: nothing listens
	// there. A primary this user may not reach is ErrPermission.
	ErrNoPrimary = instance.ErrNoPrimary
	// ErrDropped means the primary dropped this secondary because it did
	// not follow a memory change in time (it was stopped, or too slow), or
	// its connection ended while the primary lives. The secondary fails
	// every request and Queue.Lookup fails too; it unmaps its data memory
	// once its queues are closed (or after a short grace). Close it and
	// attach again to carry on.
	ErrDropped = instance.ErrDropped
	// ErrPermission means Attach refused what it found: a runtime
	// directory (or a file in it) that another user could have made or
	// could change, or a primary that runs as a user this process does
	// not trust (see Config.TrustUIDs). The message names the path or the
	// primary, its owner, this process's uid and the fix. It is
	// ipc.ErrPermission.
	ErrPermission = ipc.ErrPermission
	// ErrClosed means the secondary was closed.
	ErrClosed = errors.New("secondary: closed")
)

// Config configures Attach.
type Config struct {
	// Prefix names the instance to attach to. Default "mpmr".
	Prefix string
	// RuntimeDir must match the primary's Config.RuntimeDir.
	RuntimeDir string
	// TrustUIDs lists users besides this process's own and root whose
	// primary this secondary accepts, and who may own the directories on
	// the way to the instance. Default none: a primary of another user is
	// refused with ErrPermission, even one that lets this user in
	// (primary.Config.AllowUIDs).
	TrustUIDs []int
	// AttachTimeout bounds Attach. Default 5 s.
	AttachTimeout time.Duration
	// RequestTimeout bounds each request to the primary (an MR creation).
	// Default 2 s; 100 ms more at most to take an answer already queued when
	// it runs out (this process did not run meanwhile, say). A request may
	// also wait for as long as the primary says, in its hello, that a change
	// of its memory can hold requests up while another secondary is stalled
	// (the global lock's fence time, twice): another process's stall makes a
	// request wait, not fail. A dead primary fails requests at once
	// regardless.
	RequestTimeout time.Duration
	// Spin is how long a request polls for the primary's answer before
	// it blocks: an answer that comes within it needs no wake-up, at the
	// price of a CPU busy meanwhile (yielding between polls). It pays
	// only when both processes have a CPU of their own; on a machine
	// whose CPUs the queues keep busy it costs more than it saves. 0 (the
	// default) never polls.
	Spin time.Duration
	// Logger receives diagnostics. Default slog.Default().
	Logger *slog.Logger
}

// Secondary is a process attached to a primary's instance: it maps the
// control segment and the data memory at the primary's addresses, keeps
// local caches, and asks the primary for MRs it misses. Secondary is safe
// for concurrent use.
type Secondary struct {
	cfg    Config
	log    *slog.Logger
	info   instance.Info
	client *ipc.Client
	seg    *shm.Segment
	mem    *hugetlb.Memory
	dev    *verbs.Soft
	global *cache.Global
	ctrs   *instance.CounterTable
	queues instance.Queues
	ready  chan struct{} // closed once memory is mapped: pushes may run
	gone   chan struct{} // closed when the primary is gone
	goneMu sync.Once
	// unmapped is closed once the data memory has been let go of (see
	// closeMem and waitForInstance).
	unmapped   chan struct{}
	unmappedMu sync.Once
	bg         sync.WaitGroup
	stop       context.CancelFunc

	// Drops started by a request that found the fence, which Close waits
	// for; dropMu orders their start with Close's.
	dropMu   sync.Mutex
	dropping sync.WaitGroup
	// useMu is held for reading by whatever reads the segment on a
	// caller's goroutine (requests, Stats) and for writing by Close while
	// it unmaps it: a request that Close makes fail must not look at the
	// process table after it is gone.
	useMu sync.RWMutex

	primarySlot  int
	primaryEpoch uint32
	dropped      atomic.Bool
	device       string   // the primary's device name
	devFile      *os.File // a hardware device's command file, from the primary
	admitted     bool     // its hello was answered (attach only)
	// requestTimeout bounds a request: RequestTimeout and the primary's
	// hold (see Config.RequestTimeout); set by the hello.
	requestTimeout time.Duration
	// instanceUnlock lets the process's next attach attempt to the
	// instance go (see lockInstance); nil before the lock is taken.
	instanceUnlock func()
	pdHandle       uint32

	rtt      instance.Histogram
	requests atomic.Uint64
	reqErrs  atomic.Uint64
	syncs    atomic.Uint64
	valErrs  atomic.Uint64

	closeMu sync.Mutex
	closed  atomic.Bool
}

// Attach connects to the primary of cfg.Prefix, attaches to its control
// segment (claiming a process-table slot), says hello, and maps the data
// memory at the same addresses as the primary. A process that finds, once
// attached, that the primary has dropped it meanwhile (it was stopped
// through a memory change) starts again on a new slot, within
// AttachTimeout; a drop after Attach returns is what ErrDropped reports.
// While another attachment of this process that the primary dropped still
// maps the data memory (until its queues are closed, or for half a second
// at most), Attach waits for it, within AttachTimeout.
func Attach(cfg Config) (*Secondary, error) {
	if cfg.Prefix == "" {
		cfg.Prefix = "mpmr"
	}
	if cfg.AttachTimeout <= 0 {
		cfg.AttachTimeout = 5 * time.Second
	}
	if cfg.RequestTimeout <= 0 {
		cfg.RequestTimeout = 2 * time.Second
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	ctx, cancel := context.WithTimeout(context.Background(), cfg.AttachTimeout)
	defer cancel()
	var retried error // why the last attempt was worth trying again
	for wait := time.Millisecond; ; wait = min(2*wait, 50*time.Millisecond) {
		s := &Secondary{cfg: cfg, log: cfg.Logger.With("prefix", cfg.Prefix), ready: make(chan struct{}),
			gone: make(chan struct{}), unmapped: make(chan struct{}), primarySlot: -1, requestTimeout: cfg.RequestTimeout}
		err := s.attach(ctx)
		if err == nil {
			s.unlockInstance()
			return s, nil
		}
		if s.admitted && !s.isGone() {
			// The attempt failed after its hello: it leaves as Close
			// does, so that its end is judged before the next says
			// hello (within AttachTimeout: a primary that does not answer
			// gets no more time for this than for the attach).
			if derr := s.detach(ctx); derr != nil {
				s.log.Error("unmapping the data memory after a failed attach", "err", derr)
			}
		}
		if terr := s.teardown(); terr != nil {
			// The attempt's error is the news; what could not be undone
			// (a segment still mapped holds its slot) is logged.
			s.log.Error("cleaning up after a failed attach", "err", terr)
		}
		s.unlockInstance()
		if retried != nil && ctx.Err() != nil {
			// Out of time while trying again: the reason to try again is
			// the news, not the timeout.
			return nil, fmt.Errorf("secondary %s: gave up after %v: %w", cfg.Prefix, cfg.AttachTimeout, retried)
		}
		// A primary that turned the connection away for a limit, or lost it
		// before the hello was answered, lives: try again, up to
		// AttachTimeout, since a flood that fills the limits moves on.
		var again *retryAttach
		if !errors.As(err, &again) || ctx.Err() != nil {
			return nil, fmt.Errorf("secondary %s: %w", cfg.Prefix, err)
		}
		retried = err
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil, fmt.Errorf("secondary %s: gave up after %v: %w", cfg.Prefix, cfg.AttachTimeout, err)
		case <-t.C:
		}
	}
}

// retryAttach marks an attach that failed in a way worth trying again.
type retryAttach struct{ err error }

func (r *retryAttach) Error() string { return r.err.Error() }
func (r *retryAttach) Unwrap() error { return r.err }

func (s *Secondary) attach(ctx context.Context) error {
	dir, err := instance.Dir(s.cfg.Prefix, s.cfg.RuntimeDir)
	if err != nil {
		return err
	}
	// Nothing of the instance is trusted before its directory is: who
	// could have made it, or could change it under us?
	rundir, err := ipc.OpenRunDir(dir, ipc.RunDirOptions{TrustUIDs: s.cfg.TrustUIDs})
	if err != nil {
		if errors.Is(err, ipc.ErrPermission) {
			return err
		}
		if errors.Is(err, fs.ErrPermission) {
			return deniedErr(dir, err)
		}
		return fmt.Errorf("%w: %w", ErrNoPrimary, err)
	}
	defer rundir.Close()
	sock := filepath.Join(rundir.Path(), ipc.SocketName)
	s.client, err = ipc.DialClient(ctx, sock,
		ipc.ClientConfig{PushHandler: (*pushes)(s), Logger: s.log, Spin: s.cfg.Spin})
	if err != nil {
		if errors.Is(err, fs.ErrPermission) {
			// Something listens, or at least is there, but not for us.
			return deniedErr(rundir.Path(), err)
		}
		if !errors.Is(err, ipc.ErrNotListening) {
			return fmt.Errorf("secondary: connect to the primary: %w", err) // busy, or worse: not absent
		}
		return fmt.Errorf("%w: %w", ErrNoPrimary, err)
	}
	// The kernel says who listens; a file only says who wrote it.
	cred, err := s.client.ServerCred()
	if err != nil {
		return err
	}
	if !s.trusted(cred.UID) {
		return fmt.Errorf("%w: the primary listening at %s runs as uid %d (pid %d); this process runs as uid %d "+
			"and trusts only itself, root and TrustUIDs %v: if uid %d is to be trusted, list it in TrustUIDs",
			ErrPermission, sock, cred.UID, cred.PID, os.Geteuid(), s.cfg.TrustUIDs, cred.UID)
	}
	if s.info, err = instance.ReadInfoIn(rundir); err != nil {
		if errors.Is(err, ipc.ErrPermission) {
			return err
		}
		return fmt.Errorf("%w: %w", ErrNoPrimary, err)
	}
	if s.info.PID != cred.PID {
		return fmt.Errorf("%w: %s describes pid %d, the socket belongs to pid %d",
			ErrNoPrimary, filepath.Join(rundir.Path(), instance.InfoFile), s.info.PID, cred.PID)
	}
	segf, err := openSegment(s.info.Segment, cred.UID)
	if err != nil {
		return err
	}
	keepSeg := false
	defer func() {
		if !keepSeg {
			segf.Close()
		}
	}()
	// The primary judges how an attachment of this process ended by
	// asking the kernel whether the process reaches its data memory; it
	// must not see another attachment's mappings then, or it fences the
	// process for as long as it lives. So no hello while an attachment of
	// this process to the instance maps its memory or waits for its detach.
	// One attempt of the process at a time for the instance, from here
	// until it holds the memory or has let it go (Attach unlocks).
	if s.instanceUnlock, err = lockInstance(ctx, s.info.Segment); err != nil {
		return err
	}
	if err := holding.waitForInstance(ctx, s.info.Segment); err != nil {
		return err
	}
	// The slots' lock file is the one in the directory just checked,
	// whatever the description says, opened through it without following
	// a link: a trusted primary's user must not get this process to create
	// or lock files elsewhere as itself.
	lockf, err := rundir.OpenFile(instance.SlotsLockFile, os.O_RDWR, 0)
	if err != nil {
		if errors.Is(err, ErrPermission) {
			return err
		}
		return fmt.Errorf("%w: the process table's lock file: %w", ErrNoPrimary, err)
	}
	keepSeg = true // Attach takes it over
	s.seg, err = shm.Attach(shm.Options{Path: s.info.Segment, File: segf, LockPath: lockf.Name(), LockFile: lockf,
		LayoutTag: instance.LayoutTag, Role: shm.RoleSecondary, Logger: s.log})
	if err != nil {
		return err
	}
	start, _ := shm.ProcessStart(os.Getpid())
	var hello ipc.HelloReply
	withFiles := &ipc.WithFiles{Body: &hello}
	left := holding.leftUnanswered(s.info.Segment)
	if err := s.client.Call(ctx, ipc.KindHello, &ipc.Hello{ABI: ipc.ABI, PID: os.Getpid(), UID: os.Getuid(),
		Start: start, Role: "secondary", Slot: s.seg.Slot(), Epoch: s.seg.Epoch(), Left: left}, withFiles); err != nil {
		err = s.requestError(request{what: "hello"}, err)
		transient := errors.Is(err, ipc.ErrLimit) && !errors.Is(err, ipc.ErrConnsInUse)
		if transient || errors.Is(err, ipc.ErrPeerGone) && !errors.Is(err, ipc.ErrLimit) && !errors.Is(err, ipc.ErrRefused) {
			return &retryAttach{err}
		}
		return err
	}
	s.admitted = true
	holding.heard(s.info.Segment, left)
	s.device, s.pdHandle = hello.Device, hello.PD
	s.requestTimeout = s.cfg.RequestTimeout + time.Duration(hello.Hold)
	for i, f := range withFiles.Files {
		if i == 0 {
			s.devFile = f
		} else {
			f.Close()
		}
	}
	if hello.LayoutTag != instance.LayoutTag || hello.Segment != s.info.Segment || hello.Slot != s.seg.Slot() {
		return fmt.Errorf("%w: primary answered layout 0x%x segment %s slot %d; this process has 0x%x %s %d",
			instance.ErrABI, hello.LayoutTag, hello.Segment, hello.Slot, instance.LayoutTag, s.info.Segment, s.seg.Slot())
	}
	for _, p := range s.seg.Procs() {
		if p.Role == shm.RolePrimary && p.PID == hello.PrimaryPID {
			s.primarySlot, s.primaryEpoch = p.Slot, p.Epoch
		}
	}
	// Memory is mapped after the hello: from the hello on, the primary
	// pushes every change, and pushes wait for s.ready. It is mapped from
	// files the primary hands over, not from paths in the segment.
	files, err := s.memoryFiles(ctx)
	if err != nil {
		if errors.Is(err, ipc.ErrPeerGone) && !errors.Is(err, ipc.ErrLimit) && !errors.Is(err, ipc.ErrRefused) {
			return &retryAttach{err} // dropped since the hello: start again, as below
		}
		return err
	}
	if s.mem, err = hugetlb.Attach(s.seg, hugetlb.AttachOptions{Logger: s.log, Files: files}); err != nil {
		return err
	}
	holding.add(s)
	close(s.ready)
	if s.device == verbs.SoftName {
		if s.dev, err = verbs.AttachSoft(s.seg); err != nil {
			return err
		}
	}
	if s.global, err = cache.AttachGlobal(s.seg, s.log, s.cfg.RequestTimeout); err != nil {
		return err
	}
	if s.ctrs, err = instance.OpenCounters(s.seg); err != nil {
		return err
	}
	// A process stopped after its hello may find itself dropped already:
	// fenced by a memory change it could not follow, its connection
	// closed. It would start out useless; start again on a new slot.
	switch {
	case s.seg.Fenced():
		return &retryAttach{fmt.Errorf("%w while attaching", ErrDropped)}
	case isClosed(s.client.Done()):
		return &retryAttach{fmt.Errorf("secondary: the connection ended while attaching: %w", s.client.Err())}
	}
	bg, stop := context.WithCancel(context.Background())
	s.stop = stop
	s.bg.Add(1)
	go s.watch(bg)
	s.log.Info("attached", "slot", s.seg.Slot(), "primary_pid", hello.PrimaryPID, "backend", hello.Backend)
	return nil
}

// trusted reports whether a primary running as uid may be attached to.
func (s *Secondary) trusted(uid int) bool {
	return uid == os.Geteuid() || uid == 0 || slices.Contains(s.cfg.TrustUIDs, uid)
}

// deniedErr turns the system's "permission denied" on the way to an
// instance into ErrPermission, naming the nearest directory this process
// could look at, its owner and mode, and this process's uid.
func deniedErr(dir string, err error) error {
	for p := dir; ; p = filepath.Dir(p) {
		var st syscall.Stat_t
		if syscall.Stat(p, &st) == nil {
			return fmt.Errorf("%w: %v: %s belongs to uid %d (mode %04o) and this process runs as uid %d: "+
				"run it as uid %d, or have that user's primary let uid %d in (primary.Config.AllowUIDs, "+
				"with the runtime directory and socket opened to it)",
				ErrPermission, err, p, st.Uid, st.Mode&0o7777, os.Geteuid(), st.Uid, os.Geteuid())
		}
		if p == filepath.Dir(p) {
			return fmt.Errorf("%w: %v; this process runs as uid %d", ErrPermission, err, os.Geteuid())
		}
	}
}

// openSegment opens the control segment the primary's description names,
// for reading and writing, if it is a regular file of the primary's user
// (uid). The description is that user's to write, and that user is
// trusted to serve, not to have this process open files as itself: the
// segment's directory is reached asking no file system that might not
// answer (mounts.OpenDir, which follows links on the way), the name in it
// without following a link or entering a mount, and only as a path
// (O_PATH opens nothing) until its type and owner are known; then that
// very file is opened, whatever the name leads to by then.
func openSegment(path string, uid int) (*os.File, error) {
	refused := func(what string) error {
		return fmt.Errorf("%w: %s is not a regular file of the primary's uid %d (%s); this process runs as uid %d: "+
			"remove it and restart the primary", ErrPermission, path, uid, what, os.Geteuid())
	}
	dir, _, fsys, err := mounts.OpenDir(filepath.Dir(path))
	switch {
	case errors.Is(err, mounts.ErrMayHang):
		return nil, fmt.Errorf("%w: the segment %s: %w", ErrPermission, path, err)
	case errors.Is(err, unix.EACCES):
		return nil, deniedErr(filepath.Dir(path), err)
	case err != nil:
		return nil, fmt.Errorf("%w: %w", ErrNoPrimary, err)
	}
	defer dir.Close()
	// A primary makes its segment on tmpfs or hugetlbfs; elsewhere an
	// open may have effects, or wait (under /proc, on another process's
	// exec), and the name is looked up on the directory's own file system.
	if fsys.Type != "tmpfs" && fsys.Type != "hugetlbfs" {
		return nil, fmt.Errorf("%w: the segment %s is on %s (mounted at %s), neither tmpfs nor hugetlbfs; not opened",
			ErrPermission, path, fsys.Type, fsys.Dir)
	}
	how := &unix.OpenHow{Flags: unix.O_PATH | unix.O_NOFOLLOW | unix.O_CLOEXEC,
		Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS | unix.RESOLVE_NO_XDEV}
	fd, err := unix.Openat2(int(dir.Fd()), filepath.Base(path), how)
	switch {
	case errors.Is(err, unix.EXDEV):
		return nil, refused("a mount point")
	case errors.Is(err, unix.ELOOP):
		return nil, refused("a symbolic link")
	case err != nil:
		return nil, fmt.Errorf("%w: %w", ErrNoPrimary, &os.PathError{Op: "open", Path: path, Err: err})
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrNoPrimary, &os.PathError{Op: "stat", Path: path, Err: err})
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG || int(st.Uid) != uid {
		return nil, refused(fmt.Sprintf("owner uid %d, mode %06o", st.Uid, st.Mode))
	}
	// The file looked at, not whatever the name leads to by now; without
	// waiting for a lease on it to be broken (the file's owner may hold
	// one, and the kernel waits lease-break-time, 45 s, for it to go).
	f, err := os.OpenFile("/proc/self/fd/"+strconv.Itoa(fd), os.O_RDWR|unix.O_NONBLOCK, 0)
	switch {
	case errors.Is(err, unix.EWOULDBLOCK):
		return nil, fmt.Errorf("%w: the segment %s is under a lease (uid %d holds it open and keeps it); "+
			"this process will not wait for it", ErrPermission, path, st.Uid)
	case errors.Is(err, fs.ErrPermission):
		return nil, fmt.Errorf("%w: the segment %s (uid %d, mode %04o) may not be written by uid %d: "+
			"have the primary let uid %d in (primary.Config.AllowUIDs)",
			ErrPermission, path, st.Uid, st.Mode&0o7777, os.Geteuid(), os.Geteuid())
	case err != nil:
		return nil, fmt.Errorf("%w: %w", ErrNoPrimary, err)
	}
	return f, nil
}

// watchEvery is how often a secondary looks at the primary's slot and
// publishes its counters.
const watchEvery = 10 * time.Millisecond

// watch notices the primary's end: at once from the socket's end of file,
// or from the process table if the socket somehow stays open. It also
// notices that the primary dropped this secondary, and publishes this
// process's counters now and then.
func (s *Secondary) watch(ctx context.Context) {
	defer s.bg.Done()
	t := time.NewTicker(watchEvery)
	defer t.Stop()
	var n int
	for {
		select {
		case <-ctx.Done():
			return
		case <-s.client.Done():
			s.connectionEnded(ctx)
			return
		case <-t.C:
			if s.seg.Fenced() {
				s.drop("the primary fenced this process")
				return
			}
			if !s.primaryAlive() {
				s.primaryGone("primary's slot is dead")
				return
			}
			if n++; n%25 == 0 {
				s.publish()
			}
		}
	}
}

// primaryAlive reports whether the primary this secondary attached to is
// alive and its instance not ending.
func (s *Secondary) primaryAlive() bool {
	return s.seg.Ready() && (s.primarySlot < 0 || s.seg.AliveAs(s.primarySlot, s.primaryEpoch))
}

// endGrace bounds how long a secondary whose connection ended looks for
// the reason in the segment: the kernel releases a dead primary's slot lock
// a moment after its socket's end of file.
const endGrace = time.Second

// connectionEnded tells a dead or ending primary from one that dropped
// this secondary. While the primary lives, a secondary without a
// connection no longer hears of memory changes: it must stop using the
// data memory, whatever the reason.
func (s *Secondary) connectionEnded(ctx context.Context) {
	deadline := time.Now().Add(endGrace)
	for {
		switch {
		case s.seg.Fenced():
			s.drop("the primary fenced this process")
			return
		case !s.primaryAlive():
			s.primaryGone("connection ended")
			return
		case s.client.ServerExited():
			// Its slot's lock is held by a child it forked, which holds
			// the connection too; the process itself has gone.
			s.primaryGone("the primary's process exited")
			return
		case time.Now().After(deadline):
			s.drop("the connection ended while the primary lives")
			return
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(time.Millisecond):
		}
	}
}

// dropGrace bounds how long a dropped secondary waits for its queues to
// close before it unmaps the data memory: a datapath learns of the drop at
// its next lookup (ErrDropped) and stops; until its queue is closed it may
// still be writing a buffer, which must not fault.
const dropGrace = 500 * time.Millisecond

// drop stops this secondary after the primary dropped it: lookups and
// requests fail with ErrDropped from now on; once the queues are closed
// (or dropGrace has passed) the data memory is unmapped (a touch then
// faults instead of reaching pages the primary may have freed), and the
// process table says so, which lets the primary release what it kept in
// quarantine for it. Until then what this process writes reaches no page
// that was freed and handed out again: what the primary freed meanwhile
// waits in quarantine.
func (s *Secondary) drop(why string) {
	s.dropped.Store(true) // at once, whoever does the rest
	s.goneMu.Do(func() {
		s.log.Error("dropped by the primary: stopping; requests and lookups fail, and the data memory is unmapped "+
			"once the queues are closed", "why", why)
		s.client.Close()
		if !s.queues.WaitEmpty(dropGrace) {
			s.log.Warn("queues still open after a drop; unmapping the data memory under them", "grace", dropGrace)
		}
		if err := s.closeMem(); err != nil {
			s.log.Error("unmapping the data memory", "err", err)
		} else {
			s.seg.MarkUnmapped()
		}
		// Last: whoever waits on PrimaryGone finds the memory gone.
		close(s.gone)
	})
}

// closeMem unmaps the data memory (hugetlb.Memory.Close) and says this
// attachment holds it no more, even if the unmap failed: an attachment
// that waits for it then fails on the addresses still taken, as it would
// have before.
func (s *Secondary) closeMem() error {
	err := s.mem.Close()
	s.unmappedMu.Do(func() {
		holding.remove(s)
		close(s.unmapped)
	})
	return err
}

// holding is this process's attachments that map data memory.
var holding attachments

// unlockInstance lets the process's next attach attempt to the instance
// go, if this one held it up.
func (s *Secondary) unlockInstance() {
	if s.instanceUnlock != nil {
		s.instanceUnlock()
	}
}

// instanceLocks orders the attach attempts of a process to one instance,
// by the instance's segment path (see attach). An entry lives while an
// attempt holds or waits for it.
var instanceLocks struct {
	mu sync.Mutex
	m  map[string]*instanceLock
}

type instanceLock struct {
	c    chan struct{} // holds a token while an attempt holds the lock
	refs int           // attempts holding or waiting
}

// lockInstance waits, until ctx ends, for the process's other attach
// attempts to the instance whose segment is seg, and returns the function
// that lets the next one go.
func lockInstance(ctx context.Context, seg string) (unlock func(), err error) {
	instanceLocks.mu.Lock()
	if instanceLocks.m == nil {
		instanceLocks.m = map[string]*instanceLock{}
	}
	l := instanceLocks.m[seg]
	if l == nil {
		l = &instanceLock{c: make(chan struct{}, 1)}
		instanceLocks.m[seg] = l
	}
	l.refs++
	instanceLocks.mu.Unlock()
	release := func() {
		instanceLocks.mu.Lock()
		defer instanceLocks.mu.Unlock()
		if l.refs--; l.refs == 0 {
			delete(instanceLocks.m, seg)
		}
	}
	select {
	case l.c <- struct{}{}:
		var once sync.Once
		return func() { once.Do(func() { <-l.c; release() }) }, nil
	case <-ctx.Done():
		release()
		return nil, fmt.Errorf("secondary: another attach of this process to the instance is under way: %w", ctx.Err())
	}
}

type attachments struct {
	mu  sync.Mutex
	all map[*Secondary]struct{}
	// leaving is the attachments closing now, each with a channel closed
	// once the primary has answered its detach (or the request failed).
	leaving map[*Secondary]chan struct{}
	// left is, by instance (its segment's path), the claims of this
	// process's attachments whose detach had no answer, oldest first, for
	// the next hello to name (ipc.Hello.Left): ipc.MaxLeft at most.
	left map[string][]ipc.Claim
}

// unanswered notes that the detach of claim c, attached to the instance
// whose segment is seg, had no answer.
func (a *attachments) unanswered(seg string, c ipc.Claim) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.left == nil {
		a.left = map[string][]ipc.Claim{}
	}
	l := append(a.left[seg], c)
	a.left[seg] = l[max(0, len(l)-ipc.MaxLeft):]
}

// leftUnanswered returns the claims a hello to the instance whose segment
// is seg names as left.
func (a *attachments) leftUnanswered(seg string) []ipc.Claim {
	a.mu.Lock()
	defer a.mu.Unlock()
	return slices.Clone(a.left[seg])
}

// heard forgets the claims an admitted hello named: the primary has judged
// them.
func (a *attachments) heard(seg string, named []ipc.Claim) {
	if len(named) == 0 {
		return
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	l := slices.DeleteFunc(a.left[seg], func(c ipc.Claim) bool { return slices.Contains(named, c) })
	if len(l) == 0 {
		delete(a.left, seg)
	} else {
		a.left[seg] = l
	}
}

func (a *attachments) add(s *Secondary) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.all == nil {
		a.all = map[*Secondary]struct{}{}
	}
	a.all[s] = struct{}{}
}

func (a *attachments) remove(s *Secondary) {
	a.mu.Lock()
	defer a.mu.Unlock()
	delete(a.all, s)
}

// leave lists s as closing until the returned function is called, after
// its detach.
func (a *attachments) leave(s *Secondary) (left func()) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.leaving == nil {
		a.leaving = map[*Secondary]chan struct{}{}
	}
	done := make(chan struct{})
	a.leaving[s] = done
	return func() {
		a.mu.Lock()
		defer a.mu.Unlock()
		delete(a.leaving, s)
		close(done)
	}
}

// waitForInstance waits until no attachment of this process to the
// instance whose segment is seg is in the way of a new one: one closing,
// until the primary has answered its detach (RequestTimeout at most); one
// the primary dropped (or fenced, before it noticed), until it has let go
// of the data memory once its queues are closed (dropGrace at most). It
// fails with hugetlb.ErrAddressInUse if one maps the memory otherwise
// (a live attachment, or one whose primary has gone, which keeps its
// memory until it is closed).
//
// The primary judges how an attachment ended by asking the kernel whether
// the process still reaches data memory, and ends a dropped attachment's
// fence at the next hello if the process reaches none; once a new
// attachment has mapped the memory, the kernel can no longer tell the two
// apart, and the fence would last as long as the process.
func (a *attachments) waitForInstance(ctx context.Context, seg string) error {
	for {
		a.mu.Lock()
		var leaving, dropped chan struct{}
		for s, done := range a.leaving {
			if s.info.Segment == seg {
				leaving = done
			}
		}
		mapped := false
		for s := range a.all {
			// Its segment is mapped while it is listed: closeMem comes first.
			switch {
			case s.info.Segment != seg:
			case (s.dropped.Load() || s.seg.Fenced()) && !s.isGone():
				dropped = s.unmapped
			default:
				mapped = true
			}
		}
		a.mu.Unlock()
		switch {
		case leaving != nil:
			select {
			case <-leaving:
			case <-ctx.Done():
				return fmt.Errorf("secondary: an attachment of this process to the instance waits for its detach: %w", ctx.Err())
			}
		case dropped != nil:
			select {
			case <-dropped:
			case <-ctx.Done():
				return fmt.Errorf("secondary: an attachment of this process that the primary dropped still maps "+
					"the data memory: %w", ctx.Err())
			}
		case mapped:
			return fmt.Errorf("secondary: this process is attached to the instance already (%s): close that attachment first: %w",
				seg, hugetlb.ErrAddressInUse)
		default:
			return nil
		}
	}
}

// startDrop drops this secondary on another goroutine, for a caller that
// may hold a queue open itself (drop waits for the queues).
func (s *Secondary) startDrop(why string) {
	s.dropped.Store(true)
	s.dropMu.Lock()
	defer s.dropMu.Unlock()
	if s.closed.Load() {
		return // Close unmaps and tears down by itself
	}
	s.dropping.Add(1)
	go func() {
		defer s.dropping.Done()
		s.drop(why)
	}()
}

// Dropped reports whether the primary dropped this secondary (see
// ErrDropped).
func (s *Secondary) Dropped() bool { return s.dropped.Load() }

func (s *Secondary) primaryGone(why string) {
	s.goneMu.Do(func() {
		s.log.Warn("primary gone", "why", why)
		close(s.gone)
		s.client.Close()
	})
}

// PrimaryGone returns a channel closed once the primary is gone, or has
// dropped this secondary (see Dropped).
func (s *Secondary) PrimaryGone() <-chan struct{} { return s.gone }

func (s *Secondary) isGone() bool { return isClosed(s.gone) }

// isClosed reports whether ch is closed.
func isClosed(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

// request names a request in errors. It is formatted only when one
// fails: a create is on the datapath's miss path.
type request struct {
	what     string // "create MR for", "register mempool"...
	name     string // of a mempool
	addr     uint64
	withAddr bool
}

func (r request) String() string {
	s := r.what
	if r.name != "" {
		s += " " + r.name
	}
	if r.withAddr {
		s += fmt.Sprintf(" 0x%x", r.addr)
	}
	return s
}

// memoryFiles asks the primary for the backing files of every memseg
// list, in list order, as many at a time as a message carries.
func (s *Secondary) memoryFiles(ctx context.Context) (_ []*os.File, err error) {
	var files []*os.File
	defer func() {
		if err != nil {
			for _, f := range files {
				f.Close()
			}
		}
	}()
	for {
		var reply ipc.MemoryFilesReply
		got := &ipc.WithFiles{Body: &reply}
		if err := s.client.Call(ctx, ipc.KindMemoryFiles, &ipc.MemoryFiles{First: len(files)}, got); err != nil {
			return nil, s.requestError(request{what: "memory files"}, err)
		}
		files = append(files, got.Files...)
		switch {
		case reply.Lists < 1 || reply.Lists > hugetlb.MaxLists || len(files) > reply.Lists:
			return nil, fmt.Errorf("%w: the primary handed over %d backing files of %d memseg lists (at most %d)",
				hugetlb.ErrBadDescriptor, len(files), reply.Lists, hugetlb.MaxLists) // 1..MaxLists
		case len(files) == reply.Lists:
			return files, nil
		case len(got.Files) == 0:
			return nil, fmt.Errorf("%w: the primary handed over no backing file for memseg list %d of %d",
				hugetlb.ErrBadDescriptor, len(files), reply.Lists)
		}
	}
}

// requestError maps a failed request to ErrPrimaryGone when the connection
// ended.
func (s *Secondary) requestError(what fmt.Stringer, err error) error {
	if s.closed.Load() {
		// Close ended the connection under the request: the primary
		// may well live.
		return fmt.Errorf("%w: %s: %w", ErrClosed, what, err)
	}
	if s.dropped.Load() || s.seg != nil && s.seg.Fenced() {
		return fmt.Errorf("%w: %s: %w", ErrDropped, what, err)
	}
	if errors.Is(err, ipc.ErrLimit) {
		// The primary lives but turned this connection away (too many
		// connections, an overdue hello): not its end.
		return fmt.Errorf("secondary: %s: %w", what, err)
	}
	if errors.Is(err, ipc.ErrPeerGone) || errors.Is(err, ipc.ErrClosed) || s.isGone() {
		return fmt.Errorf("%w: %s: %w", ErrPrimaryGone, what, err)
	}
	return fmt.Errorf("secondary: %s: %w", what, err)
}

// call makes one request to the primary, bounded by RequestTimeout and the
// primary's hold (see Config.RequestTimeout), and failing at once if the
// primary is gone.
func (s *Secondary) call(what request, kind ipc.Kind, req, reply any) error {
	s.useMu.RLock()
	defer s.useMu.RUnlock()
	if s.closed.Load() {
		return ErrClosed
	}
	if s.dropped.Load() {
		return fmt.Errorf("%w: %s", ErrDropped, what)
	}
	if s.isGone() {
		if s.seg.Fenced() {
			return fmt.Errorf("%w: %s", ErrDropped, what)
		}
		return fmt.Errorf("%w: %s", ErrPrimaryGone, what)
	}
	start := time.Now()
	err := s.client.CallTimeout(s.requestTimeout, kind, req, reply)
	s.rtt.Record(time.Since(start))
	s.requests.Add(1)
	if err != nil {
		s.reqErrs.Add(1)
		return s.requestError(what, err)
	}
	// An answer read after the primary fenced this process (stopped while
	// the answer was on its way, say) may name memory freed since: the
	// primary went on without this process. Stop instead of using it.
	if s.seg.Fenced() {
		s.reqErrs.Add(1)
		s.startDrop("the primary fenced this process")
		return fmt.Errorf("%w: %s", ErrDropped, what)
	}
	return nil
}

// CreateMR asks the primary for the MR covering addr (creating it if
// needed). It implements the create path of this process's local caches.
func (s *Secondary) CreateMR(addr uint64) (cache.Entry, error) { return s.createMR(addr, 0) }

// createMR is CreateMR for a caller bound to CPU cpu-1 (0: to none).
func (s *Secondary) createMR(addr uint64, cpu uint32) (cache.Entry, error) {
	var r ipc.CreateMRReply
	if err := s.call(request{what: "create MR for", addr: addr, withAddr: true}, ipc.KindCreateMR, &ipc.CreateMR{Addr: addr, CPU: cpu}, &r); err != nil {
		return cache.Entry{LKey: cache.InvalidKey}, err
	}
	return cache.Entry{Start: r.Start, End: r.End, LKey: r.LKey}, nil
}

// RegisterExternal is the create path for external memory: a secondary
// cannot register it (register the mempool in the primary before the
// secondaries use it).
func (s *Secondary) RegisterExternal(addr, length uint64) (cache.Entry, error) {
	return cache.Entry{LKey: cache.InvalidKey}, fmt.Errorf("%w: [0x%x, 0x%x)", cache.ErrExternalMemory, addr, addr+length)
}

// creator is a queue's create path: the secondary's requests, saying
// where the queue's thread is bound.
type creator struct {
	s   *Secondary
	cpu uint32 // the CPU + 1 the queue's thread is bound to, 0 none (see Queue.BindCPU)
}

func (c *creator) CreateMR(addr uint64) (cache.Entry, error) { return c.s.createMR(addr, c.cpu) }
func (c *creator) RegisterExternal(addr, length uint64) (cache.Entry, error) {
	return c.s.RegisterExternal(addr, length)
}

// Queue is a per-queue MR cache of a secondary: use it from one goroutine
// at a time. Close it when the queue goes away.
type Queue struct {
	*cache.Local
	s *Secondary
	c *creator
}

// NewQueue returns a local cache whose misses go to the global cache and
// then, as create requests, to the primary.
func (s *Secondary) NewQueue() *Queue {
	c := &creator{s: s}
	l := s.queues.Add(func() *cache.Local { return cache.NewLocal(s.global, c, 0) })
	return &Queue{Local: l, s: s, c: c}
}

// UsableCPUs returns the CPUs the calling goroutine's thread may run on
// now, in order: for a goroutine not bound by BindCPU, the process's.
// BindCPU accepts each of them (and any other the process's cpuset
// allows). Call it before binding.
func UsableCPUs() ([]int, error) {
	cpus, err := affinity.Usable()
	if err != nil {
		return nil, fmt.Errorf("secondary: which CPUs this thread may use: %w", err)
	}
	return cpus, nil
}

// BindCPU binds the calling goroutine's thread to CPU cpu, as DPDK binds
// an lcore, and has the queue's create requests say so: a primary with
// FollowCPU then answers them on that CPU (see ipc.Peer.Follow), so that a
// miss hands the CPU over while it waits and wakes no other. Call it from
// the goroutine that uses the queue; that goroutine stays locked to its
// thread (runtime.LockOSThread) from then on, and the thread ends with it.
// The primary answers all of this process's requests on one thread, bound
// where the last create asked: bind queues that miss at the same time to
// the same CPU, and expect requests from other threads meanwhile to be
// answered on that CPU too.
func (q *Queue) BindCPU(cpu int) error {
	var set unix.CPUSet
	if cpu < 0 || cpu >= len(set)*64 {
		return fmt.Errorf("secondary: bind a queue to CPU %d: no such CPU", cpu)
	}
	set.Set(cpu)
	runtime.LockOSThread()
	if err := unix.SchedSetaffinity(0, &set); err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("secondary: bind a queue to CPU %d: %w", cpu, err)
	}
	q.c.cpu = uint32(cpu) + 1
	return nil
}

// Lookup returns the key for addr like cache.Local.Lookup, reporting a
// global cache whose writer died as ErrPrimaryGone. Once the primary
// dropped this secondary it fails with ErrDropped (Hit, the top-half probe,
// keeps answering for memory that is still registered; the process no
// longer maps it).
func (q *Queue) Lookup(addr uintptr) (uint32, error) {
	if q.s.dropped.Load() {
		return cache.InvalidKey, ErrDropped
	}
	if q.s.closed.Load() {
		return cache.InvalidKey, ErrClosed
	}
	k, err := q.Local.Lookup(addr)
	return k, q.s.lockError(err)
}

// LookupBurst is cache.Local.LookupBurst with Lookup's errors: once the
// primary dropped this secondary it answers nothing and fails with
// ErrDropped; a global cache whose writer died is reported as
// ErrPrimaryGone.
func (q *Queue) LookupBurst(addrs []uintptr, keys []uint32) (int, error) {
	if q.s.dropped.Load() {
		return 0, ErrDropped
	}
	if q.s.closed.Load() {
		return 0, ErrClosed
	}
	n, err := q.Local.LookupBurst(addrs, keys)
	return n, q.s.lockError(err)
}

// LookupRange is cache.Local.LookupRange with Lookup's errors (see
// LookupBurst); a buffer over two MRs still gets a *cache.SplitError.
func (q *Queue) LookupRange(addr uintptr, n uint64) (uint32, error) {
	if q.s.dropped.Load() {
		return cache.InvalidKey, ErrDropped
	}
	if q.s.closed.Load() {
		return cache.InvalidKey, ErrClosed
	}
	k, err := q.Local.LookupRange(addr, n)
	return k, q.s.lockError(err)
}

// RegisterMempool is cache.Local.RegisterMempool, reporting a global cache
// whose writer died as ErrPrimaryGone.
func (q *Queue) RegisterMempool(mp cache.Mempool) error {
	return q.s.lockError(q.Local.RegisterMempool(mp))
}

// lockError turns the global lock's word that a writer died mid-update
// into ErrPrimaryGone when that writer was the primary (it is no longer
// alive); a live primary repairs the lock within moments. A lookup the
// global table refused because the primary fenced this process (before
// the watch noticed) is ErrDropped, and starts the drop.
func (s *Secondary) lockError(err error) error {
	if err == nil {
		return nil
	}
	if errors.Is(err, cache.ErrFenced) {
		s.startDrop("the primary fenced this process")
		return fmt.Errorf("%w: %w", ErrDropped, err)
	}
	if errors.Is(err, shm.ErrNotRecoverable) || errors.Is(err, shm.ErrOwnerDied) && !s.primaryAlive() {
		return fmt.Errorf("%w: %w", ErrPrimaryGone, err)
	}
	return err
}

// Close stops counting the queue in Stats. Call it from the queue's
// goroutine, and use the queue no more: once the secondary is closed too,
// the segment its lookups read may be gone.
func (q *Queue) Close() {
	q.Publish()
	q.s.queues.Remove(q.Local)
}

// RegisterMempool registers mp's chunks through the primary (one request
// for all of them) and fills q with their keys. External memory must have
// been registered by the primary: otherwise this fails with
// cache.ErrExternalMemory.
func (s *Secondary) RegisterMempool(q *Queue, mp cache.Mempool) error {
	req := &ipc.RegisterMempool{Name: mp.Name()}
	for i, c := range mp.Chunks() {
		// The primary would take a bad chunk for a malformed message and
		// hang up: refuse it here.
		if err := c.Check(); err != nil {
			return fmt.Errorf("secondary: register mempool %s chunk %d: %w", mp.Name(), i, err)
		}
		req.Chunks = append(req.Chunks, ipc.Chunk{Addr: uint64(c.Addr), Len: c.Len})
	}
	var r ipc.RegisterMempoolReply
	if err := s.call(request{what: "register mempool", name: mp.Name()}, ipc.KindRegisterMempool, req, &r); err != nil {
		return err
	}
	return q.RegisterMempool(mp)
}

// Pool opens a mempool the primary created. A pool whose objects are not
// data memory this process maps fails with cache.ErrCorrupt: its
// descriptor is in the segment, which any process of the user can write.
// Once the primary has dropped or fenced this process it fails with
// ErrDropped, after Close with ErrClosed. Use no pool after Close: its
// objects and links live in the segment, which Close unmaps.
func (s *Secondary) Pool(name string) (*cache.Pool, error) {
	s.useMu.RLock()
	defer s.useMu.RUnlock()
	if err := s.poolGone(name); err != nil {
		return nil, err
	}
	pool, err := cache.OpenPool(s.seg, name)
	if err != nil {
		return nil, err
	}
	if c := pool.Chunks()[0]; !s.mem.Mapped(c.Addr, c.Len) {
		// Close and a drop unmap the memory; a process the primary
		// fenced did not map what it allocated since.
		if err := s.poolGone(name); err != nil {
			return nil, err
		}
		return nil, fmt.Errorf("%w: mempool %s: objects [0x%x, +0x%x) are not data memory this process maps",
			cache.ErrCorrupt, name, c.Addr, c.Len)
	}
	return pool, nil
}

// poolGone says why this process may use no pool, if it may not.
func (s *Secondary) poolGone(name string) error {
	switch {
	case s.closed.Load():
		return ErrClosed
	case s.dropped.Load() || s.seg.Fenced():
		return fmt.Errorf("%w: mempool %s", ErrDropped, name)
	}
	return nil
}

// Memory returns the data memory, mapped at the primary's addresses.
func (s *Secondary) Memory() *hugetlb.Memory { return s.mem }

// Device returns the soft device (validation and loopback copies), or nil
// when the primary uses a hardware device.
func (s *Secondary) Device() *verbs.Soft { return s.dev }

// DeviceName returns the name of the primary's device.
func (s *Secondary) DeviceName() string { return s.device }

// DeviceFile returns the command file of the primary's hardware device,
// handed over at attach, and the handle of its PD: with the rdma build,
// verbs.ImportDevice and ImportPD turn them into this process's handles on
// the same device and PD (and verbs.ImportMR on its MRs). Both are zero for
// the soft device, which every process reaches through the segment. The
// file belongs to the Secondary and is closed by Close.
func (s *Secondary) DeviceFile() (*os.File, uint32) { return s.devFile, s.pdHandle }

// Global returns the global MR cache.
func (s *Secondary) Global() *cache.Global { return s.global }

// Segment returns the control segment.
func (s *Secondary) Segment() *shm.Segment { return s.seg }

// Slot returns this process's process-table slot.
func (s *Secondary) Slot() int { return s.seg.Slot() }

// Close unmaps the data memory, tells the primary this secondary leaves,
// and releases everything else, its slot last. A primary that does not
// answer within RequestTimeout is told again by the process's next Attach
// to the instance. Idempotent. Close the
// queues first. A lookup after Close fails with ErrClosed (Hit reports
// false), in a queue made before Close or after it; one that races Close
// gets a key or an error, never a fault: while queues are open, Close
// leaves the control segment's address range mapped to private zeros
// instead of unmapping it under them, and the last queue's Close gives it
// back. Requests and Stats racing Close are safe: they fail with
// ErrClosed, or report nothing.
func (s *Secondary) Close() error {
	s.closeMu.Lock()
	defer s.closeMu.Unlock()
	s.dropMu.Lock() // ordered with startDrop: no drop starts once closed is set
	already := s.closed.Swap(true)
	s.dropMu.Unlock()
	if already {
		return nil
	}
	s.dropping.Wait()
	var errs []error
	if s.client != nil && !s.isGone() {
		// Another attachment of this process waits until the detach is
		// answered (see waitForInstance).
		left := holding.leave(s)
		defer left()
		if err := s.detach(context.Background()); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(append(errs, s.teardown())...)
}

// detach unmaps the data memory, says so in the slot, and tells the
// primary this attachment leaves, waiting RequestTimeout at most for its
// answer (a detach does not wait for memory changes), and no longer than
// ctx: the primary then judges the attachment's end on its word, while
// the process maps nothing, before any other attachment of the process
// says hello. It returns what the unmap reported.
func (s *Secondary) detach(ctx context.Context) error {
	// Unmapped first: from the moment the primary stops sending this
	// process memory changes, it must map nothing.
	if s.stop != nil {
		s.stop()
		s.bg.Wait()
	}
	var err error
	if s.mem != nil {
		err = s.closeMem()
	}
	if err == nil {
		s.seg.MarkUnmapped() // only then may the primary reuse what it quarantined
	}
	ctx, cancel := context.WithTimeout(ctx, s.cfg.RequestTimeout)
	if cerr := s.client.Call(ctx, ipc.KindDetach, &ipc.Detach{}, &ipc.DetachReply{}); cerr != nil && err == nil {
		// The primary may not have heard it (it was stopped, say): the
		// process's next hello to the instance says it again — that this
		// claim unmapped its memory, which is why not after a failed unmap.
		holding.unanswered(s.info.Segment, ipc.Claim{Slot: s.seg.Slot(), Epoch: s.seg.Epoch()})
	}
	cancel()
	return err
}

func (s *Secondary) teardown() error {
	var errs []error
	if s.stop != nil {
		s.stop()
		s.bg.Wait()
	}
	if s.client != nil {
		s.client.Close() // requests in flight fail now...
	}
	s.useMu.Lock() // ...and are done with the segment once this returns
	defer s.useMu.Unlock()
	if s.dev != nil {
		errs = append(errs, s.dev.Close())
	}
	if s.devFile != nil {
		errs = append(errs, s.devFile.Close())
	}
	if s.mem != nil {
		errs = append(errs, s.closeMem())
	}
	if s.seg != nil {
		errs = append(errs, s.queues.CloseSegment(s.seg, s.global))
	}
	return errors.Join(errs...)
}

// pushes handles the primary's memory syncs, in order, after the memory is
// mapped.
type pushes Secondary

func (p *pushes) HandlePush(ctx context.Context, kind ipc.Kind, body *ipc.Decoder) (any, error) {
	s := (*Secondary)(p)
	if kind != ipc.KindSync {
		return nil, fmt.Errorf("secondary: push kind %v not handled", kind)
	}
	var m ipc.Sync
	if err := body.Decode(&m); err != nil {
		return nil, err
	}
	select {
	case <-s.ready:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	var err error
	switch m.Op {
	case ipc.SyncMap:
		err = s.mem.MapPages(m.List, m.First, m.Count)
	case ipc.SyncUnmap:
		err = s.mem.UnmapPages(m.List, m.First, m.Count)
	case ipc.SyncResync:
		err = s.mem.Resync()
	default:
		err = fmt.Errorf("secondary: unknown sync op %d", m.Op)
	}
	if errors.Is(err, hugetlb.ErrClosed) && s.closed.Load() {
		// Closing: the data memory is unmapped already, which is all a
		// sync asks for while this process detaches.
		err = nil
	}
	if err != nil {
		s.log.Error("memory sync failed", "op", m.Op, "list", m.List, "first", m.First, "count", m.Count, "err", err)
		return nil, err
	}
	s.syncs.Add(1)
	return &ipc.SyncAck{}, nil
}
