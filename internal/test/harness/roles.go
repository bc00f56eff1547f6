package harness

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/mpmr/mpmr/cache"
	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/ipc"
	"github.com/mpmr/mpmr/primary"
	"github.com/mpmr/mpmr/secondary"
	"github.com/mpmr/mpmr/verbs"
)

// Helper roles. Each prints a readiness line, then answers commands read
// from its input, one per line ("name" or "name {json args}"), with one
// answer line each, in order; it may print events in between. When its
// input ends it shuts down cleanly and exits 0.
const (
	// RolePrimary runs a primary (args PrimaryArgs). Commands: alloc
	// {pages}, free {addr,len}, create {addr}, hold-write (takes the global
	// write lock, prints event "holding" and never lets go), stats.
	RolePrimary = "harness-primary"
	// RoleSecondary attaches a secondary (args SecondaryArgs). Commands:
	// lookup {addr}, check {addr,len} (lookup and validate), validate
	// {addr,len,key}, create {addr}, hold-read (takes the global read
	// lock, prints event "holding" and never lets go), hammer HammerArgs,
	// flood FloodArgs, work WorkSpec, await-gone AwaitArgs, stats, close,
	// attach.
	RoleSecondary = "harness-secondary"
	// RoleAsUser switches to another user and tries to attach or to talk
	// to the primary's socket (args AsUserArgs); its readiness line
	// carries an AsUserResult and it exits.
	RoleAsUser = "harness-as-user"
)

func init() {
	register(RolePrimary, runPrimary)
	register(RoleSecondary, runSecondary)
	register(RoleAsUser, runAsUser)
}

// helper is the process side of the line protocol.
type helper struct {
	mu  sync.Mutex
	out *bufio.Writer
	log *slog.Logger
}

func newHelper() *helper {
	return &helper{out: bufio.NewWriterSize(os.Stdout, 64<<10),
		log: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))}
}

func (h *helper) print(prefix string, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		b, _ = json.Marshal(envelope{Err: Report(err)})
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	h.out.WriteString(prefix)
	h.out.WriteByte(' ')
	h.out.Write(b)
	h.out.WriteByte('\n')
	h.out.Flush()
}

func (h *helper) ready(r Ready) { h.print(lineReady, r) }

func (h *helper) event(name string, data any) {
	ev := Event{Name: name, At: time.Now().UnixNano()}
	if data != nil {
		ev.Data, _ = json.Marshal(data)
	}
	h.print(lineEvent, ev)
}

func (h *helper) answer(data any, err error) {
	env := envelope{Err: Report(err)}
	if err == nil && data != nil {
		b, merr := json.Marshal(data)
		if merr != nil {
			env.Err = Report(merr)
		}
		env.Data = b
	}
	h.print(lineReply, env)
}

// command is a command handler: it decodes its arguments from args.
type command func(args []byte) (any, error)

// busyGrace is how long a helper whose input has ended lets a running
// command go on before it exits anyway (status 4): a helper blocked in a
// command (holding a lock, say) must not outlive its test.
const busyGrace = 2 * time.Second

// serve answers commands until the input ends.
func (h *helper) serve(cmds map[string]command) {
	in := make(chan string)
	var busy atomic.Value // name of the command running, or ""
	busy.Store("")
	go func() {
		sc := bufio.NewScanner(os.Stdin)
		sc.Buffer(make([]byte, 64<<10), 16<<20)
		for sc.Scan() {
			in <- sc.Text()
		}
		close(in)
		time.AfterFunc(busyGrace, func() {
			if name := busy.Load().(string); name != "" {
				fmt.Fprintf(os.Stderr, "%s input closed while %q still ran\n", lineFatal, name)
				os.Exit(4)
			}
		})
	}()
	for line := range in {
		name, args, _ := strings.Cut(strings.TrimSpace(line), " ")
		if name == "" {
			continue
		}
		fn, ok := cmds[name]
		if !ok {
			h.answer(nil, fmt.Errorf("unknown command %q", name))
			continue
		}
		busy.Store(name)
		data, err := fn([]byte(args))
		busy.Store("")
		h.answer(data, err)
	}
}

// decode decodes a command's arguments (none is the zero value).
func decode[T any](args []byte) (T, error) {
	var v T
	if len(args) == 0 {
		return v, nil
	}
	err := json.Unmarshal(args, &v)
	return v, err
}

func helperArgs[T any](args []byte) T {
	var v T
	if json.Unmarshal(args, &v) != nil {
		fmt.Fprintf(os.Stderr, "%s bad helper arguments %q\n", lineFatal, args)
		os.Exit(2)
	}
	return v
}

// Addr names an address.
type Addr struct {
	Addr uint64 `json:"addr"`
}

// Span names a range, and a key for it.
type Span struct {
	Addr uint64 `json:"addr"`
	Len  uint64 `json:"len"`
	Key  uint32 `json:"key,omitempty"`
}

// KeyReply answers lookup, check and create.
type KeyReply struct {
	Key   uint32 `json:"key"`
	Start uint64 `json:"start,omitempty"`
	End   uint64 `json:"end,omitempty"`
}

// --- primary ---

func runPrimary(args []byte) int {
	a := helperArgs[PrimaryArgs](args)
	h := newHelper()
	kind, err := hugetlb.ParseKind(a.Backend)
	if err != nil {
		h.ready(Ready{PID: os.Getpid(), Err: Report(err)})
		return 3
	}
	p, err := startPrimary(primary.Config{Prefix: a.Prefix, RuntimeDir: a.RunDir, Backend: kind, BackendDir: a.BackendDir,
		MemoryPages: a.MemoryPages, SinglePage: a.SinglePage, Logger: h.log})
	if err != nil {
		h.ready(Ready{PID: os.Getpid(), Err: Report(err)})
		return 3
	}
	ps := p.Backend().PageSize
	pr := PrimaryReady{PageSize: ps}
	if a.Pages > 0 {
		r, err := p.Alloc(uint64(a.Pages) * ps)
		if err == nil {
			var e cache.Entry
			e, err = p.Global().Create(uint64(r.Addr))
			pr.Addr, pr.Len, pr.Key = uint64(r.Addr), r.Len, e.LKey
		}
		if err != nil {
			h.ready(Ready{PID: os.Getpid(), Err: Report(err)})
			p.Close()
			return 3
		}
	}
	data, _ := json.Marshal(pr)
	h.ready(Ready{PID: os.Getpid(), Slot: p.Segment().Slot(), Data: data})
	h.serve(map[string]command{
		"alloc": func(b []byte) (any, error) {
			a, err := decode[struct {
				Pages int `json:"pages"`
			}](b)
			if err != nil {
				return nil, err
			}
			r, err := p.Alloc(uint64(a.Pages) * ps)
			return Span{Addr: uint64(r.Addr), Len: r.Len}, err
		},
		"free": func(b []byte) (any, error) {
			sp, err := decode[Span](b)
			if err != nil {
				return nil, err
			}
			return nil, p.Free(hugetlb.Region{Addr: uintptr(sp.Addr), Len: sp.Len})
		},
		"create": func(b []byte) (any, error) {
			a, err := decode[Addr](b)
			if err != nil {
				return nil, err
			}
			e, err := p.Global().Create(a.Addr)
			return KeyReply{Key: e.LKey, Start: e.Start, End: e.End}, err
		},
		"hold-write": func([]byte) (any, error) {
			return nil, p.Global().Exclusive(func() {
				h.event("holding", nil)
				select {}
			})
		},
		"stats": func([]byte) (any, error) {
			st := p.Stats()
			return map[string]any{"mrs": st.Global.MRs, "requests": st.Counters.Requests,
				"secondaries": st.Counters.Secondaries}, nil
		},
	})
	if err := p.Close(); err != nil {
		fmt.Fprintln(os.Stderr, "close:", err)
		return 1
	}
	return 0
}

// --- secondary ---

// secHelper is a secondary helper's state.
type secHelper struct {
	*helper
	a SecondaryArgs
	s *secondary.Secondary
	q *secondary.Queue // the command loop's queue
}

func (sh *secHelper) attach() error {
	s, err := secondary.Attach(secondary.Config{Prefix: sh.a.Prefix, RuntimeDir: sh.a.RunDir, Logger: sh.log})
	if err != nil {
		return err
	}
	sh.s, sh.q = s, s.NewQueue()
	return nil
}

func runSecondary(args []byte) int {
	sh := &secHelper{helper: newHelper(), a: helperArgs[SecondaryArgs](args)}
	if err := sh.attach(); err != nil {
		sh.ready(Ready{PID: os.Getpid(), Err: Report(err)})
		return 3
	}
	sh.ready(Ready{PID: os.Getpid(), Slot: sh.s.Slot()})
	sh.serve(sh.commands())
	if sh.s != nil {
		if err := sh.s.Close(); err != nil {
			fmt.Fprintln(os.Stderr, "close:", err)
			return 1
		}
	}
	return 0
}

var errDetached = errors.New("harness: the secondary is closed (attach again)")

func (sh *secHelper) commands() map[string]command {
	// attached wraps a command that needs the secondary.
	attached := func(fn command) command {
		return func(b []byte) (any, error) {
			if sh.s == nil {
				return nil, errDetached
			}
			return fn(b)
		}
	}
	return map[string]command{
		"lookup": attached(func(b []byte) (any, error) {
			a, err := decode[Addr](b)
			if err != nil {
				return nil, err
			}
			k, err := sh.q.Lookup(uintptr(a.Addr))
			return KeyReply{Key: k}, err
		}),
		"check": attached(func(b []byte) (any, error) {
			sp, err := decode[Span](b)
			if err != nil {
				return nil, err
			}
			k, err := sh.q.Lookup(uintptr(sp.Addr))
			if err == nil {
				err = sh.s.Device().Validate(verbs.SGE{Addr: uintptr(sp.Addr), Len: uint32(max(sp.Len, 1)), Key: k}, verbs.AccessLocalWrite)
			}
			return KeyReply{Key: k}, err
		}),
		"validate": attached(func(b []byte) (any, error) {
			sp, err := decode[Span](b)
			if err != nil {
				return nil, err
			}
			return nil, sh.s.Device().Validate(verbs.SGE{Addr: uintptr(sp.Addr), Len: uint32(max(sp.Len, 1)), Key: sp.Key}, verbs.AccessLocalWrite)
		}),
		"create": attached(func(b []byte) (any, error) {
			a, err := decode[Addr](b)
			if err != nil {
				return nil, err
			}
			e, err := sh.s.CreateMR(a.Addr)
			return KeyReply{Key: e.LKey, Start: e.Start, End: e.End}, err
		}),
		"hold-read": attached(func([]byte) (any, error) {
			return nil, sh.s.Global().Shared(func() {
				sh.event("holding", nil)
				select {}
			})
		}),
		"hammer": attached(func(b []byte) (any, error) {
			a, err := decode[HammerArgs](b)
			if err != nil {
				return nil, err
			}
			return hammer(sh, a), nil
		}),
		"flood": attached(func(b []byte) (any, error) {
			a, err := decode[FloodArgs](b)
			if err != nil {
				return nil, err
			}
			return flood(sh.s, a), nil
		}),
		"work": attached(func(b []byte) (any, error) {
			spec, err := decode[WorkSpec](b)
			if err != nil {
				return nil, err
			}
			return work(sh.s, spec)
		}),
		"await-gone": attached(func(b []byte) (any, error) {
			a, err := decode[AwaitArgs](b)
			if err != nil {
				return nil, err
			}
			return awaitGone(sh, a)
		}),
		"stats": attached(func([]byte) (any, error) {
			c := sh.s.Stats().Counters
			return StatsReply{Lookups: c.Lookups, Created: c.Created, Requests: c.Requests,
				RequestErrors: c.RequestErrors, Flushes: c.Flushes, Syncs: c.Syncs, Sample: TakeSample(time.Now())}, nil
		}),
		"close": func([]byte) (any, error) {
			if sh.s == nil {
				return nil, nil
			}
			err := sh.s.Close()
			sh.s, sh.q = nil, nil
			return nil, err
		},
		"attach": func([]byte) (any, error) {
			if sh.s != nil {
				return nil, errors.New("harness: already attached")
			}
			if err := sh.attach(); err != nil {
				return nil, err
			}
			return Ready{PID: os.Getpid(), Slot: sh.s.Slot()}, nil
		},
	}
}

// StatsReply answers a secondary's stats command.
type StatsReply struct {
	Lookups       uint64 `json:"lookups"`
	Created       uint64 `json:"created"`
	Requests      uint64 `json:"requests"`
	RequestErrors uint64 `json:"request_errors"`
	Flushes       uint64 `json:"flushes"`
	Syncs         uint64 `json:"syncs"`
	Sample        Sample `json:"sample"`
}

// AwaitArgs says what a secondary checks once its primary is gone: Cached
// is an address whose key its queue holds, Miss one it has never looked
// up.
type AwaitArgs struct {
	Cached uint64 `json:"cached"`
	Miss   uint64 `json:"miss"`
	// Patience bounds the wait for the primary's end (default 30 s).
	Patience time.Duration `json:"patience"`
}

// AwaitResult is what a secondary saw of its primary's death.
type AwaitResult struct {
	// GoneAt is when PrimaryGone closed (wall clock, Unix nanoseconds).
	GoneAt int64 `json:"gone_at"`
	// Create is the error a create request got afterwards, and how long
	// it took.
	Create   *ErrorReport `json:"create"`
	CreateNs int64        `json:"create_ns"`
	// Miss is the error a lookup of Miss got, and how long it took.
	Miss   *ErrorReport `json:"miss"`
	MissNs int64        `json:"miss_ns"`
	// CachedKey is what a lookup of Cached answered.
	CachedKey uint32       `json:"cached_key"`
	Cached    *ErrorReport `json:"cached_err"`
}

// awaitGone prints event "waiting", waits for the primary's end and then
// tries a create and two lookups.
func awaitGone(sh *secHelper, a AwaitArgs) (AwaitResult, error) {
	if a.Patience <= 0 {
		a.Patience = 30 * time.Second
	}
	sh.event("waiting", nil)
	var r AwaitResult
	select {
	case <-sh.s.PrimaryGone():
		r.GoneAt = time.Now().UnixNano()
	case <-time.After(a.Patience):
		return r, fmt.Errorf("harness: the primary's end went unnoticed for %v", a.Patience)
	}
	start := time.Now()
	_, err := sh.s.CreateMR(a.Miss)
	r.CreateNs, r.Create = time.Since(start).Nanoseconds(), Report(err)
	start = time.Now()
	_, err = sh.q.Lookup(uintptr(a.Miss))
	r.MissNs, r.Miss = time.Since(start).Nanoseconds(), Report(err)
	r.CachedKey, err = sh.q.Lookup(uintptr(a.Cached))
	r.Cached = Report(err)
	return r, nil
}

// --- another user ---

// AsUserArgs configures a RoleAsUser helper.
type AsUserArgs struct {
	UID    int    `json:"uid"`
	GID    int    `json:"gid"`
	Prefix string `json:"prefix"`
	RunDir string `json:"rundir"`
}

// AsUserResult is what a process of another user got: Attach is
// secondary.Attach's error; Dial that of connecting to the primary's
// socket, Why the reason a connection that sends nothing ends, and Call
// the error of a hello sent straight away on another connection.
type AsUserResult struct {
	UID    int          `json:"uid"`
	Attach *ErrorReport `json:"attach"`
	Dial   *ErrorReport `json:"dial"`
	Call   *ErrorReport `json:"call"`
	Why    *ErrorReport `json:"why"`
}

func runAsUser(args []byte) int {
	a := helperArgs[AsUserArgs](args)
	h := newHelper()
	// Group first: once the uid is dropped the gid cannot change.
	if err := syscall.Setgid(a.GID); err != nil {
		h.ready(Ready{PID: os.Getpid(), Err: Report(err)})
		return 3
	}
	if err := syscall.Setuid(a.UID); err != nil {
		h.ready(Ready{PID: os.Getpid(), Err: Report(err)})
		return 3
	}
	r := AsUserResult{UID: os.Getuid()}
	s, err := secondary.Attach(secondary.Config{Prefix: a.Prefix, RuntimeDir: a.RunDir, Logger: h.log,
		AttachTimeout: 5 * time.Second})
	if err == nil {
		s.Close()
	}
	r.Attach = Report(err)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	sock := filepath.Join(a.RunDir, a.Prefix, ipc.SocketName)
	// First listen only: a refused connection is told why.
	c, err := ipc.DialClient(ctx, sock, ipc.ClientConfig{Logger: h.log})
	if err != nil {
		r.Dial = Report(err)
	} else {
		select {
		case <-c.Done():
			r.Why = Report(c.Err())
		case <-ctx.Done():
			r.Why = Report(ctx.Err())
		}
		c.Close()
		// Then say hello at once.
		if c, err = ipc.DialClient(ctx, sock, ipc.ClientConfig{Logger: h.log}); err == nil {
			err = c.Call(ctx, ipc.KindHello, &ipc.Hello{ABI: ipc.ABI, PID: os.Getpid(), UID: os.Getuid(), Role: "secondary"}, &ipc.HelloReply{})
			c.Close()
		}
		r.Call = Report(err)
	}
	data, _ := json.Marshal(r)
	h.ready(Ready{PID: os.Getpid(), Data: data})
	return 0
}
