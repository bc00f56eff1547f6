package primary

import (
	"context"
	"log/slog"
	"time"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/ipc"
	"github.com/mpmr/mpmr/shm"
	"github.com/mpmr/mpmr/verbs"
)

// WithDeviceOpener makes Start open the device with f instead of verbs.
func WithDeviceOpener(c *Config, f func(seg *shm.Segment, log *slog.Logger) (verbs.Device, error)) {
	c.openDevice = f
}

// HandleRegisterMempool runs the handler of a secondary's register-mempool
// request, as the server does once the request has its turns (see
// mempoolTurn) and is decoded, with the request's ctx, never yielding the
// primary's turn.
func HandleRegisterMempool(ctx context.Context, p *Primary, m *ipc.RegisterMempool) (any, error) {
	return (*handler)(p).registerMempool(ctx, m, nil)
}

// EnterTurn is enterTurn: how a mempool registration takes its process's
// turn and the primary's.
var EnterTurn = enterTurn

// SetMempoolTurns has f told of each mempool registration's turns (see
// mempoolTurns), with the pid of the secondary that asked, until restore
// is called. Set it before the primary starts.
func SetMempoolTurns(f func(event string, pid int)) (restore func()) {
	old := mempoolTurns
	mempoolTurns = func(event string, peer *ipc.Peer) { f(event, peer.PID()) }
	return func() { mempoolTurns = old }
}

// SetBeforeCollect has f run between a free's invalidation and its
// collection of the MRs it emptied, until restore is called. Set it before
// the primary starts.
func SetBeforeCollect(f func()) (restore func()) {
	old := beforeCollect
	beforeCollect = f
	return func() { beforeCollect = old }
}

// SetSyncPushing has f run in each secondary's memory sync as it is about
// to push, until restore is called. Set it before the primary starts.
func SetSyncPushing(f func()) (restore func()) {
	old := syncPushing
	syncPushing = f
	return func() { syncPushing = old }
}

// SetMempoolSlice sets how long a mempool registration works on while
// others wait for the primary's turn, until restore is called. Set it
// before the primary starts.
func SetMempoolSlice(d time.Duration) (restore func()) {
	old := mempoolSlice
	mempoolSlice = d
	return func() { mempoolSlice = old }
}

// SetDetachAsk sets how long a detach waits for the kernel's description
// of the secondary, until restore is called. Set it before the primary
// starts.
func SetDetachAsk(d time.Duration) (restore func()) {
	old := detachAsk
	detachAsk = d
	return func() { detachAsk = old }
}

// SetHousekeepEvery sets how often housekeeping runs, until restore is
// called. Set it before the primary starts.
func SetHousekeepEvery(d time.Duration) (restore func()) {
	old := reapEvery
	reapEvery = d
	return func() { reapEvery = old }
}

// SetKernelQuestion has f called with the pid, on the hello's goroutine,
// after every question a hello asks the kernel about its process (the
// kernel has read the process by then: f stands for the end of a slow
// reading), until restore is called. Set it before the primary starts.
func SetKernelQuestion(f func(pid int)) (restore func()) {
	old := askKernel
	askKernel = func(m *hugetlb.Memory, pid int, d time.Duration) (reach, known, done bool) {
		reach, known, done = old(m, pid, d)
		f(pid)
		return reach, known, done
	}
	return func() { askKernel = old }
}

// SetLifeTaken has f called, on Start's goroutine, each time a starting
// primary has taken the life file of a backend directory dir and before
// it removes anything there, until restore is called.
func SetLifeTaken(f func(dir string)) (restore func()) {
	old := testHookLifeTaken
	testHookLifeTaken = f
	return func() { testHookLifeTaken = old }
}

// ProcessTurns returns the references each process's mempool turn holds,
// by pid, and how many attachments the primary has, read together.
func ProcessTurns(p *Primary) (refs map[int]int, attached int) {
	p.syncMu.Lock()
	defer p.syncMu.Unlock()
	refs = map[int]int{}
	for pr, t := range p.procTurns {
		refs[pr.pid] += t.refs
	}
	return refs, len(p.peers)
}

// SetStartFailed has f called, on Start's goroutine, when a start's
// first try has failed and been undone, before Start judges whether to
// try again, until restore is called.
func SetStartFailed(f func()) (restore func()) {
	old := testHookStartFailed
	testHookStartFailed = f
	return func() { testHookStartFailed = old }
}

// SetMountsRead has f called, on Start's goroutine, each time a starting
// primary has read the mount table to list the backend directory dir for
// directories of the instance's own, until restore is called.
func SetMountsRead(f func(dir string)) (restore func()) {
	old := testHookMountsRead
	testHookMountsRead = f
	return func() { testHookMountsRead = old }
}
