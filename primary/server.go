package primary

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"sync"
	"syscall"
	"time"

	"github.com/mpmr/mpmr/cache"
	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/instance"
	"github.com/mpmr/mpmr/ipc"
	"github.com/mpmr/mpmr/shm"
)

// inlineKinds are the requests a secondary's call lane reader answers
// itself (see ipc.ServerConfig.Inline): a create, the question on every
// miss, is answered from the thread its request woke, with no goroutine
// hand-off, which would cost about as much again as the round trip. They
// are short: a memory change holds the memory lock only for its checks,
// guards and changes, never while it waits for secondaries to follow it,
// so a stalled secondary holds a create up for the global lock's fence
// time at worst (memoryHold; acknowledgements travel on the connection,
// so they are not stuck behind it). A mempool's registration, which may
// create thousands of MRs, runs on a goroutine of its own.
var inlineKinds = []ipc.Kind{ipc.KindCreateMR, ipc.KindStats, ipc.KindDetach}

// memoryHold is how long a change of memory may hold a create up while a
// secondary is stalled (ipc.HelloReply.Hold): the free's guard waits for
// the stalled process's read hold of the global lock up to the lock's
// fence time, and the create's own write lock may wait as long again.
const memoryHold = 2 * shm.DefaultFenceAfter

// handler serves the secondaries' requests.
type handler Primary

func (h *handler) p() *Primary { return (*Primary)(h) }

func (h *handler) Connected(peer *ipc.Peer) {
	h.log.Debug("peer connected", "peer", peer)
}

// Disconnected drops the peer from the sync set and tidies the process
// table: a secondary that died leaves its slot live but unlocked. A
// secondary whose connection ended while its process runs, and that was
// not judged by a detach, no longer hears of memory changes: if it may
// still reach data memory (mayReachAfterEnd: it holds its slot, or has let
// it go but maps or holds a backing file), it is fenced, and what the
// primary frees from now on waits in quarantine until the kernel says it
// reaches no data memory (see hugetlb).
func (h *handler) Disconnected(peer *ipc.Peer, err error) {
	h.syncMu.Lock()
	s, ok := h.peers[peer]
	h.syncMu.Unlock()
	if ok && !h.tearing.Load() {
		h.awaitJudgement(s)
		h.log.Info("secondary detached", "pid", peer.PID(), "slot", s.slot, "why", err)
		// A process that dies closes its socket (its memory unmapped by
		// then) a moment before it ends: give its death that moment
		// before fencing it as alive.
		// It stays in the sync set meanwhile (a free's push to it fails
		// and fences it there), and leaves it only once fenced or dead:
		// at no moment does a free neither sync it nor quarantine for it.
		if h.p().mayReachAfterEnd(s, deathGrace, detachAsk) {
			// Unless a hello of the process said meanwhile that this
			// attachment had detached (ordered with it by syncMu).
			h.syncMu.Lock()
			if !s.detached {
				h.p().fenceIfAlive(s, "its connection ended")
			}
			h.syncMu.Unlock()
		}
	}
	h.syncMu.Lock()
	if s := h.peers[peer]; s != nil {
		h.leaveTurn(s)
	}
	delete(h.peers, peer)
	delete(h.detached, peer)
	h.syncMu.Unlock()
	if h.tearing.Load() {
		return
	}
	if reaped := h.seg.Reap(); len(reaped) > 0 {
		h.log.Info("reclaimed slots of dead processes", "slots", reaped)
	}
	if ok {
		// A process that dies closes its sockets a moment before the
		// kernel drops its slot's lock: the end of the connection may be
		// seen first. Then housekeeping reclaims the slot once it is gone.
		if pr := h.seg.Proc(s.slot); pr.Live && pr.Epoch == s.epoch {
			h.syncMu.Lock()
			h.unreaped[s.slot] = s.epoch
			h.syncMu.Unlock()
		}
	}
}

// deathGrace bounds how long Disconnected looks for a secondary's death
// before it treats the secondary as alive.
const deathGrace = 100 * time.Millisecond

// aliveAfter reports whether s's process still runs after up to grace.
func (p *Primary) aliveAfter(s *secondary, grace time.Duration) bool {
	for deadline := time.Now().Add(grace); s.running(); {
		if time.Now().After(deadline) {
			return true
		}
		time.Sleep(time.Millisecond) // the kernel's answer, looked at again
	}
	return false
}

// mayReachAtDetach reports whether s, detaching, may still reach data
// memory: as the kernel says, or, where the primary may not ask it,
// unless s has declared in its slot that it unmapped its memory. The
// declaration alone could have been written by any process mapping the
// segment; together with the detach, which comes on s's own connection,
// it is s's word about itself. The kernel is given detachAsk to answer: a
// detach holds up its peer's requests and the primary's Close, and a
// process can hold a great many files open.
func (p *Primary) mayReachAtDetach(s *secondary) bool {
	reach, known, done := p.mem.ReachesWithin(s.peer.PID(), detachAsk)
	switch {
	case !done:
		return true // too long to describe: fenced, and Housekeep asks again
	case known:
		return reach
	}
	pr := p.seg.Proc(s.slot)
	return pr.Epoch != s.epoch || !pr.Unmapped
}

// detachAsk bounds the kernel's description of a detaching secondary. A
// variable for tests.
var detachAsk = 500 * time.Millisecond

// fenceIfAlive fences s, if its process lives: it no longer follows memory
// changes. Whether it still reaches data memory, and so how long what the
// primary frees waits for it, the kernel says later (see hugetlb).
func (p *Primary) fenceIfAlive(s *secondary, why string) {
	fenced, record := p.seg.FenceClaim(s.slot, s.epoch, s.peer.PID(), s.start)
	if s.leaving {
		// A hello of its process judges it (see awaitJudgement): the
		// hello's answer may end this fence.
		s.fence = record
	}
	if fenced {
		p.fenced.Add(1)
		p.log.Warn("fenced a secondary that no longer follows memory changes; memory freed from now on "+
			"waits in quarantine until it ends or unmaps its memory", "pid", s.peer.PID(), "slot", s.slot, "why", why)
	}
}

func (h *handler) Handle(ctx context.Context, peer *ipc.Peer, kind ipc.Kind, body *ipc.Decoder) (any, error) {
	p := h.p()
	if p.closed.Load() {
		return nil, instance.ErrClosing
	}
	start := time.Now()
	reply, err := h.handle(ctx, peer, kind, body)
	p.served.Record(time.Since(start))
	p.requests.Add(1)
	if err != nil {
		p.reqErrors.Add(1)
	}
	return reply, err
}

func (h *handler) handle(ctx context.Context, peer *ipc.Peer, kind ipc.Kind, body *ipc.Decoder) (any, error) {
	p := h.p()
	if kind != ipc.KindHello && kind != ipc.KindStats && !h.attached(peer) {
		return nil, instance.ErrNotAttached
	}
	switch kind {
	case ipc.KindHello:
		var m ipc.Hello
		if err := body.Decode(&m); err != nil {
			return nil, err
		}
		return h.hello(peer, &m)
	case ipc.KindCreateMR:
		var m ipc.CreateMR
		if err := body.Decode(&m); err != nil {
			return nil, err
		}
		if p.cfg.FollowCPU {
			// A caller bound to a CPU is answered there from its next
			// miss on (a lane thread per peer: one peer's word moves
			// only its own).
			peer.Follow(int(m.CPU) - 1)
		}
		e, err := p.global.Create(m.Addr)
		if err != nil {
			return nil, err
		}
		return &ipc.CreateMRReply{Start: e.Start, End: e.End, LKey: e.LKey}, nil
	case ipc.KindRegisterMempool:
		turn, err := h.mempoolTurn(ctx, peer)
		if err != nil {
			return nil, err
		}
		defer turn.end()
		var m ipc.RegisterMempool
		if err := body.Decode(&m); err != nil {
			return nil, err
		}
		return h.registerMempool(ctx, &m, turn)
	case ipc.KindStats:
		var m ipc.StatsRequest
		if err := body.Decode(&m); err != nil {
			return nil, err
		}
		if !h.attached(peer) {
			// Tools ask without attaching; so can anyone the socket lets
			// in. All of them together get a small budget, and an answer
			// that is at most strangerStatsAge old, so that a flood of them
			// costs the attached secondaries nothing much.
			return h.strangerStats()
		}
		return h.stats(), nil
	case ipc.KindMemoryFiles:
		var m ipc.MemoryFiles
		if err := body.Decode(&m); err != nil {
			return nil, err
		}
		return h.memoryFiles(peer, m.First)
	case ipc.KindDetach:
		var m ipc.Detach
		if err := body.Decode(&m); err != nil {
			return nil, err
		}
		for {
			h.syncMu.Lock()
			s := h.peers[peer]
			if s == nil {
				h.detached[peer] = struct{}{} // no hello on it from now on
			}
			h.syncMu.Unlock()
			// Judged outside the lock; a hello again on this connection
			// may replace the record meanwhile: then that one is judged.
			if s == nil || h.detach(s, p.mayReachAtDetach(s)) {
				// Its slots are free now, but not the connection, which a
				// process could keep (and attach again, and again, on
				// others): once answered, it closes by the hello deadline,
				// and counts as one without hello till then.
				return ipc.AndRetire{Reply: &ipc.DetachReply{}, Why: errDetachedConn}, nil
			}
		}
	}
	return nil, fmt.Errorf("primary: request kind %v not served", kind)
}

// errDetachedConn closes a connection kept open after its detach.
var errDetachedConn = fmt.Errorf("%w: the connection detached and serves no attachment", ipc.ErrLimit)

// detach takes s out of the sync set as detached: a secondary unmaps its
// data memory before it detaches; one that may still reach it (reach) is
// fenced like one that stopped answering — before it leaves the sync set,
// so that no free falls between. It reports whether s was still there:
// if not, it was dropped or gone meanwhile (judged then), or a hello
// again on its connection replaced it.
func (h *handler) detach(s *secondary, reach bool) bool {
	h.syncMu.Lock()
	defer h.syncMu.Unlock()
	if h.peers[s.peer] != s {
		return false // dropped, or gone, meanwhile: judged then
	}
	if reach {
		h.p().fenceIfAlive(s, "it detached without unmapping its memory")
	}
	s.detached = true
	h.leaveTurn(s)
	delete(h.peers, s.peer)
	h.detached[s.peer] = struct{}{}
	return true
}

// askKernel asks the kernel, within d, whether process pid reaches data
// memory (hugetlb.Memory.ReachesWithin), for a hello. A variable for
// tests.
var askKernel = func(m *hugetlb.Memory, pid int, d time.Duration) (reach, known, done bool) {
	return m.ReachesWithin(pid, d)
}

// judgeEarlier settles, before a hello of process pid (started at start)
// on peer is admitted, what its earlier attachments left: those the hello
// names as left (see detachLeft), and the fences of earlier claims, which
// end if the kernel shows the process reaching no data memory now —
// before the new attachment maps it, after which no answer could tell
// the two apart. So a hello whose process the kernel does not describe
// within detachAsk is refused, as a limit (Attach tries again), with its
// fences standing: housekeeping asks again, on a goroutine of its own,
// and ends them once the process is seen to have let go, or a later
// hello does. The primary's Close and its other secondaries wait on a
// process's /proc no longer than that bound, however large the process
// makes it (the bound is looked at between batches of reads: the batch
// under way when it runs out is not cut short, one long gap between looks
// counts as the primary's own stop, and a free waits on it judgementWait
// at most; see awaitJudgement and hugetlb.Memory.ReachesWithin).
//
// The kernel's answer is true of the moment it read the process, and
// only what was settled before it read may be judged by it: the fences
// the process had then (a fence taken later may be of an attachment that
// maps what the reading had passed; see shm.Proc.Seq), and the
// attachments named as left, which are taken off the sync set's hand-outs
// of backing files (memoryFiles) before the kernel is asked. One hello of
// a process asks at a time; another waits its turn and asks for itself.
// A hello that names no attachment the primary knows, of a process it
// holds no fence of, asks nothing: saying hello again and again costs the
// primary nothing of the kind.
func (h *handler) judgeEarlier(peer *ipc.Peer, pid int, start uint64, left []ipc.Claim) error {
	p := h.p()
	if len(h.leftOf(pid, start, left)) == 0 && len(fencesOf(p.seg, pid, start)) == 0 {
		return nil
	}
	who := process{pid, start}
	var olds []*secondary
	var handing bool // an attachment named as left is being handed backing files
	for {
		h.syncMu.Lock()
		turn, busy := h.judging[who]
		if !busy {
			h.judging[who] = make(chan struct{})
			olds, handing = h.leaving(pid, start, left)
		}
		h.syncMu.Unlock()
		if !busy {
			break
		}
		select {
		case <-turn:
		case <-peer.Done():
			return fmt.Errorf("%w: the connection ended while its hello waited", ipc.ErrPeerGone)
		}
	}
	defer func() {
		h.syncMu.Lock()
		close(h.judging[who])
		delete(h.judging, who)
		h.syncMu.Unlock()
	}()
	fences := fencesOf(p.seg, pid, start)
	if len(olds) == 0 && len(fences) == 0 {
		return nil // judged by the hello before this one
	}
	reach, known, done := askKernel(p.mem, pid, detachAsk)
	h.detachLeft(pid, olds, handing || !done || known && reach)
	if done && !known {
		// Where the kernel will not describe the process, the hello is its
		// word, as a detach on its own connection is (the claims' slots
		// may be claimed again by now, and their words with them): a
		// claim it names as left that was fenced already, as one whose
		// connection ended while it lived, is forgotten too.
		for _, f := range fences {
			if slices.Contains(left, ipc.Claim{Slot: f.Slot, Epoch: f.Epoch}) {
				p.seg.Forget(f)
			}
		}
	}
	if !done {
		return fmt.Errorf("%w: the kernel took over %v to describe what pid %d maps and holds open; "+
			"an earlier attachment of it was fenced, and a later hello is admitted once the kernel is seen to say it let go",
			ipc.ErrLimit, detachAsk, pid)
	}
	p.mem.ForgetHolders(fences, reach, known)
	return nil
}

// awaitJudgement waits, if a hello of s's process named s as left and
// asks the kernel about the process, until that hello has judged s: it
// detaches s, fenced or not, on an answer about a moment when s could no
// longer be handed backing files. The end of s's connection, or a sync s
// failed, is judged after it (s detached, then, is not fenced again): a
// fence taken while the kernel reads would stand on no answer, and once
// the process's new attachment maps the memory no answer could end it.
// The hello's question takes about detachAsk, checked between batches of
// reads of /proc; a batch the kernel holds up (a process stuck with its
// memory map locked) is not cut short, nor is one long gap counted as the
// primary's own stop, so the wait ends after judgementWait whatever the
// hello does, and s is judged on its own.
func (h *handler) awaitJudgement(s *secondary) {
	h.syncMu.Lock()
	var turn chan struct{}
	if s.leaving {
		turn = h.judging[process{s.peer.PID(), s.start}]
	}
	h.syncMu.Unlock()
	if turn == nil {
		return
	}
	t := time.NewTimer(judgementWait())
	defer t.Stop()
	select {
	case <-turn:
	case <-t.C:
	}
}

// judgementWait bounds awaitJudgement: a hello's question, and a moment.
func judgementWait() time.Duration { return detachAsk + deathGrace }

// process names a process by its pid and start time (shm.ProcessStart).
type process struct {
	pid   int
	start uint64
}

// fencesOf returns the owner's fences of process pid, started at start.
func fencesOf(seg *shm.Segment, pid int, start uint64) []shm.Proc {
	return slices.DeleteFunc(seg.Holders(), func(f shm.Proc) bool { return f.PID != pid || f.Start != start })
}

// leftOf returns the attachments in the sync set of process pid (started
// at start) whose claims left names. Call it without syncMu.
func (h *handler) leftOf(pid int, start uint64, left []ipc.Claim) []*secondary {
	h.syncMu.Lock()
	defer h.syncMu.Unlock()
	olds, _ := h.findLeft(pid, start, left, false)
	return olds
}

// leaving is leftOf for a hello about to ask the kernel, with syncMu
// held: it marks each attachment found as leaving, so that it is handed
// no backing file from now on (it unmapped its memory and asked to
// detach, by its process's word), and reports whether the primary is
// opening some for one now. (Descriptors already sent and not yet
// received are in flight, which the kernel's reading does not show.)
func (h *handler) leaving(pid int, start uint64, left []ipc.Claim) (olds []*secondary, handing bool) {
	return h.findLeft(pid, start, left, true)
}

// findLeft finds the attachments of leftOf, and marks them leaving if
// mark. Call it with syncMu held.
func (h *handler) findLeft(pid int, start uint64, left []ipc.Claim, mark bool) (olds []*secondary, handing bool) {
	if len(left) == 0 {
		return nil, false
	}
	for _, s := range h.peers {
		if s.peer.PID() == pid && s.start == start && slices.Contains(left, ipc.Claim{Slot: s.slot, Epoch: s.epoch}) {
			olds = append(olds, s)
			if mark {
				s.leaving = true
				handing = handing || s.files < 0
			}
		}
	}
	return olds, handing
}

// detachLeft detaches olds, the earlier attachments of a hello's process
// that the hello names as left (leaving), fenced if the kernel's answer
// says the process may still reach data memory (mayReach): each unmapped
// its memory and asked to detach, and had no answer in time (its primary
// was stopped, say), so that its detach may still wait behind other
// requests when the end of its connection is seen, or never come. Judged
// now, as a detach is, while the process maps nothing (its new attachment
// maps after the hello), they are not fenced as attachments whose
// connection ended while they lived — a fence the kernel could no longer
// end once the new attachment maps the memory. Only attachments of the
// hello's own process (pid and start time) are looked at.
//
// One that left the sync set while the kernel read, fenced on the end of
// its connection or on a sync it failed, had its fence taken on no answer
// (see awaitJudgement, which waits so long only): where the answer says
// the process reaches nothing, that fence ends, unless another fence has
// changed the record since. It was handed no backing file after it was
// marked leaving, before the kernel read, so what the process reached
// then was all it could map; once the process's new attachment maps the
// memory, no answer could end the fence.
func (h *handler) detachLeft(pid int, olds []*secondary, mayReach bool) {
	for _, s := range olds {
		if h.detach(s, mayReach) {
			h.log.Info("secondary detached, said a later hello of its process", "pid", pid, "slot", s.slot)
			s.peer.Close() // its process has let it go
		}
		if mayReach {
			continue
		}
		// Judged: an end of its connection or a sync it failed, seen
		// later, takes no fence of it (both look at detached).
		h.syncMu.Lock()
		s.detached = true
		if f := s.fence; f.Epoch == s.epoch && f.Seq != 0 {
			h.p().seg.Forget(f)
		}
		h.syncMu.Unlock()
	}
}

// memoryFiles hands an attached secondary the backing files of its memory
// from list first on: each list's once per attachment, in order, one
// request at a time. Each request opens the files again here, so a peer
// that asked over and over would have this process open files without
// end; a request out of turn is refused with ipc.ErrLimit.
func (h *handler) memoryFiles(peer *ipc.Peer, first int) (any, error) {
	p := h.p()
	h.syncMu.Lock()
	s := h.peers[peer]
	leaving := s != nil && s.leaving
	ok := s != nil && s.files == first && !leaving
	if ok {
		s.files = -1
	}
	h.syncMu.Unlock()
	if s == nil {
		return nil, instance.ErrNotAttached
	}
	if leaving {
		return nil, fmt.Errorf("%w: memory files: a later hello of this process said this attachment has left",
			ipc.ErrLimit)
	}
	if !ok {
		return nil, fmt.Errorf("%w: memory files from list %d: an attachment is handed each list's file once, in order",
			ipc.ErrLimit, first)
	}
	files, lists, err := p.mem.BackingFiles(first, ipc.MaxFiles)
	if err == nil && len(files) == 0 {
		err = fmt.Errorf("%w: memory files from list %d: there are %d lists", ipc.ErrLimit, first, lists)
	}
	h.syncMu.Lock()
	s.files = first + len(files)
	h.syncMu.Unlock()
	if err != nil {
		return nil, err
	}
	return ipc.WithFiles{Body: &ipc.MemoryFilesReply{Lists: lists}, Files: files, CloseAfterSend: true}, nil
}

func (h *handler) attached(peer *ipc.Peer) bool {
	h.syncMu.Lock()
	defer h.syncMu.Unlock()
	_, ok := h.peers[peer]
	return ok
}

// hello admits a secondary that has attached to the segment: it must hold
// the slot it claims, with the pid the kernel gave for the connection.
// It joins the sync set under the memory read lock, so that it misses no
// allocation or free from now on; it maps memory only after this reply.
func (h *handler) hello(peer *ipc.Peer, m *ipc.Hello) (any, error) {
	p := h.p()
	if m.ABI != ipc.ABI {
		return nil, fmt.Errorf("%w: secondary speaks ABI %d, primary %d", instance.ErrABI, m.ABI, ipc.ABI)
	}
	if m.PID != peer.PID() {
		return nil, fmt.Errorf("primary: hello claims pid %d, connection is from pid %d", m.PID, peer.PID())
	}
	// The slot the hello names, claimed by this very attachment (its
	// epoch): a process attached twice holds two slots, and one
	// attachment's connection must never speak for the other's slot.
	slot := -1
	var epoch uint32
	if m.Slot >= 0 && m.Slot < p.seg.Slots() {
		// Only the slot it names: a hello costs one slot's look, however
		// many the table holds.
		proc := p.seg.Proc(m.Slot)
		if proc.Epoch == m.Epoch && proc.PID == m.PID && proc.Alive && proc.Start == m.Start &&
			proc.Role == shm.RoleSecondary && !proc.Fenced {
			slot, epoch = proc.Slot, proc.Epoch
		}
	}
	if slot < 0 {
		return nil, fmt.Errorf("%w: pid %d holds no slot %d (epoch %d) in the process table",
			instance.ErrNotAttached, m.PID, m.Slot, m.Epoch)
	}
	h.syncMu.Lock()
	refused := h.claimTaken(peer, slot, epoch)
	h.syncMu.Unlock()
	if refused != nil {
		return nil, refused
	}
	// After the slot is found: while the process that made the connection
	// lives, its pid is its own, so the slot found is its slot. Once it
	// has exited, the pid may be another process's, and whoever kept the
	// connection must not speak in that process's name.
	start, err := shm.ProcessStart(m.PID)
	if !peer.ProcessAlive() || err != nil {
		return nil, fmt.Errorf("%w: the process that made this connection (pid %d) has exited; pid %d may now be another's",
			ipc.ErrRefused, m.PID, m.PID)
	}
	if err := h.judgeEarlier(peer, m.PID, start, m.Left); err != nil {
		return nil, err
	}
	reply := &ipc.HelloReply{Slot: slot, Segment: p.segOpts.Path, LockFile: p.segOpts.LockPath,
		LayoutTag: instance.LayoutTag, Backend: p.backend.Kind.String(), PageSize: p.backend.PageSize,
		PrimaryPID: os.Getpid(), Device: p.vdev.Name(), Hold: int64(memoryHold)}
	if pd, ok := p.pd.(interface{ Handle() uint32 }); ok {
		reply.PD = pd.Handle()
	}
	// A hardware device is shared by handing over its command file, from
	// which the secondary imports the device context, PD and MRs.
	var files []*os.File
	if dev, ok := p.vdev.(interface{ CmdFD() int }); ok {
		fd, err := syscall.Dup(dev.CmdFD())
		if err != nil {
			return nil, fmt.Errorf("primary: hand the device over: %w", err)
		}
		files = append(files, os.NewFile(uintptr(fd), p.vdev.Name()))
	}
	// No change of memory is under way meanwhile: the secondary either
	// follows a change (it is in the sync set before the change's sync
	// begins) or maps what the change left (it maps after this).
	release := p.mem.HoldChanges()
	h.syncMu.Lock()
	refused = h.claimTaken(peer, slot, epoch) // again: another hello may have run meanwhile
	select {
	case <-peer.Done():
		// It gave up while the hello waited, and Disconnected has run or
		// will find nothing: admitted, the connection would stay in the
		// sync set, and the next change would fence the process for it.
		refused = fmt.Errorf("%w: the connection ended while its hello waited", ipc.ErrPeerGone)
	default:
	}
	if refused == nil {
		s := &secondary{peer: peer, slot: slot, epoch: epoch, start: start}
		if old := h.peers[peer]; old != nil {
			s.files = old.files // a hello again is no new attachment: its files went
			s.turn = old.turn
		} else {
			s.turn = h.joinTurn(process{m.PID, start})
		}
		h.peers[peer] = s
	}
	h.syncMu.Unlock()
	release()
	if refused != nil {
		for _, f := range files {
			f.Close()
		}
		return nil, refused
	}
	h.log.Info("secondary attached", "pid", m.PID, "slot", slot)
	if files == nil {
		return reply, nil
	}
	return ipc.WithFiles{Body: reply, Files: files, CloseAfterSend: true}, nil
}

// claimTaken says why a hello on peer for the claim of slot with epoch is
// refused, or nil: one connection speaks for a claim, and a claim that
// detached has left; neither starts afresh (with its memory files, say)
// by saying hello again. Call it with syncMu held.
func (h *handler) claimTaken(peer *ipc.Peer, slot int, epoch uint32) error {
	if _, ok := h.detached[peer]; ok {
		return fmt.Errorf("%w: slot %d (epoch %d) detached on this connection", ipc.ErrLimit, slot, epoch)
	}
	for other, o := range h.peers {
		if other != peer && o.slot == slot && o.epoch == epoch {
			return fmt.Errorf("%w: slot %d (epoch %d) is attached on another connection", ipc.ErrLimit, slot, epoch)
		}
	}
	return nil
}

// registerMempool registers each chunk of a secondary's mempool. Chunks
// outside data memory are the secondary's own external memory, which this
// process cannot register (DPDK's rule). A chunk that is no range fails
// the request before anything is registered. The work stops when ctx
// ends (the peer went, or the primary closes): nobody waits for it. Each
// chunk's first address is asked of Create (an optimistic lookup when an
// MR covers it already), so that no key in the reply is older than its
// chunk; the rest of a chunk that the MR found covers costs nothing more.
// Between steps it yields the primary's turn, held in turn (nil: none),
// to the registrations waiting for it (see mempoolTurnHold.yield).
func (h *handler) registerMempool(ctx context.Context, m *ipc.RegisterMempool, turn *mempoolTurnHold) (any, error) {
	p := h.p()
	for i, c := range m.Chunks {
		if err := (cache.Chunk{Addr: uintptr(c.Addr), Len: c.Len}).Check(); err != nil {
			return nil, fmt.Errorf("mempool %s chunk %d of %d: %w", m.Name, i, len(m.Chunks), err)
		}
	}
	reply := &ipc.RegisterMempoolReply{Keys: make([]uint32, 0, len(m.Chunks))}
	// The clock is read every yieldSteps steps: a step that registers
	// fresh memory costs tens of microseconds, one that finds an MR tens
	// of nanoseconds, and a read of the clock about as much as the
	// latter here.
	steps := 0
	step := func() error {
		if err := ctx.Err(); err != nil {
			return fmt.Errorf("mempool %s: %w", m.Name, err)
		}
		if steps++; steps%yieldSteps == 0 {
			return turn.yield(ctx)
		}
		return nil
	}
	for _, c := range m.Chunks {
		if err := step(); err != nil {
			return nil, err
		}
		if _, in := p.mem.InList(uintptr(c.Addr)); !in {
			e, found, err := p.global.Lookup(c.Addr)
			if err != nil {
				return nil, err
			}
			if !found {
				return nil, fmt.Errorf("%w: mempool %s chunk 0x%x", cache.ErrExternalMemory, m.Name, c.Addr)
			}
			reply.Keys = append(reply.Keys, e.LKey)
			continue
		}
		var key uint32
		var last cache.Entry // the MR that answered last, in this chunk
		for a := c.Addr; a < c.Addr+c.Len; {
			if err := step(); err != nil {
				return nil, err
			}
			e := last
			if a < e.Start || a >= e.End {
				var err error
				if e, err = p.global.Create(a); err != nil {
					return nil, fmt.Errorf("mempool %s chunk [0x%x, 0x%x): %w", m.Name, c.Addr, c.Addr+c.Len, err)
				}
				if e.End <= a {
					return nil, fmt.Errorf("%w: entry %v for 0x%x does not cover it", cache.ErrCorrupt, e, a)
				}
				last = e
			}
			if a == c.Addr {
				key = e.LKey
			}
			a = e.End
		}
		reply.Keys = append(reply.Keys, key)
	}
	return reply, nil
}

// mempoolTurn waits for the turn of a mempool registration of peer, and
// returns it; end it when the registration is done. Registrations are
// the one request whose work grows with its frame (decoding it, and a
// step per MR each chunk spans), and the requests a peer may have in
// flight could all be registrations: run at once, a careless peer's kept
// every P of the primary busy, and its own frees and memory syncs waited
// behind them. So one registration works at a time, for a slice of
// mempoolSlice at most while others wait (see mempoolTurnHold.yield),
// and a registration queues for that turn only holding its process's
// (see procTurn): whoever else floods, however many attachments each
// flooding process has, a registration waits for at most a slice of each
// other process's at a time.
func (h *handler) mempoolTurn(ctx context.Context, peer *ipc.Peer) (*mempoolTurnHold, error) {
	h.syncMu.Lock()
	s := h.peers[peer]
	var own *procTurn
	if s != nil {
		own = s.turn
		own.refs++ // the process's turn lasts while this registration does
	}
	h.syncMu.Unlock()
	if s == nil {
		return nil, instance.ErrNotAttached
	}
	mempoolTurns("queue", peer)
	err := enterTurn(ctx, own.ch)
	if err == nil && !h.attached(peer) {
		// It left while the process's other registrations went first:
		// not worth a place in the primary's queue.
		<-own.ch
		err = instance.ErrNotAttached
	}
	if err != nil {
		mempoolTurns("abandon", peer)
		h.unrefTurn(own)
		return nil, fmt.Errorf("primary: mempool registration: %w", err)
	}
	t := &mempoolTurnHold{p: h.p(), peer: peer, own: own}
	if err := t.take(ctx); err != nil {
		<-own.ch
		h.unrefTurn(own)
		return nil, err
	}
	return t, nil
}

// enterTurn takes turn, a channel of capacity one, once it is free, or
// fails with ctx's error if ctx ends first. An ended context wins over a
// free turn: a registration given up while it waited for its request's
// slot comes with its context ended, and a select that finds both ready
// picks either.
func enterTurn(ctx context.Context, turn chan struct{}) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	select {
	case turn <- struct{}{}:
		if err := ctx.Err(); err != nil {
			<-turn // it ended as the turn came
			return err
		}
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// procTurn is the turn a process's attachments queue for the primary's
// with (see mempoolTurn): a process with many attachments, which only
// one that means harm has at once, still puts one registration at a
// time ahead of others'.
type procTurn struct {
	pr process
	ch chan struct{} // held by the registration at work or queued
	// refs counts the process's attachments in peers and its
	// registrations under way, which may outlive their attachment's
	// place there (a detach leaves the connection open): the turn is
	// forgotten only once neither is left, so that a process that
	// detaches and attaches again while its registrations run finds the
	// same turn. Guarded by syncMu.
	refs int
}

// joinTurn returns the turn of process pr for a new attachment of it.
// Call it with syncMu held.
func (h *handler) joinTurn(pr process) *procTurn {
	t := h.procTurns[pr]
	if t == nil {
		t = &procTurn{pr: pr, ch: make(chan struct{}, 1)}
		h.procTurns[pr] = t
	}
	t.refs++
	return t
}

// dropTurn lets go of a reference to t, forgetting it with the last.
// Call it with syncMu held.
func (h *handler) dropTurn(t *procTurn) {
	if t.refs--; t.refs == 0 && h.procTurns[t.pr] == t {
		delete(h.procTurns, t.pr)
	}
}

// unrefTurn is dropTurn for a registration, which does not hold syncMu.
func (h *handler) unrefTurn(t *procTurn) {
	h.syncMu.Lock()
	h.dropTurn(t)
	h.syncMu.Unlock()
}

// leaveTurn lets go of the turn of s's process as s leaves peers (see
// procTurn.refs). Call it with syncMu held, once for each attachment
// joinTurn counted.
func (h *handler) leaveTurn(s *secondary) { h.dropTurn(s.turn) }

// mempoolSlice is how long a registration works on while others wait for
// the primary's turn, give or take yieldSteps steps. A variable for
// tests.
var mempoolSlice = 200 * time.Microsecond

// yieldSteps is how many steps a registration makes between looks at how
// long it has worked.
const yieldSteps = 8

// mempoolTurnHold is a registration's hold of its peer's turn and, while
// it works, of the primary's. Used by the registration's goroutine alone.
type mempoolTurnHold struct {
	p     *Primary
	peer  *ipc.Peer
	own   *procTurn // its process's turn, held (and counted) until end
	held  bool      // the primary's turn is held
	since time.Time // when it was taken
}

// take queues for the primary's turn, and fails if the registration's
// attachment has left once it comes.
func (t *mempoolTurnHold) take(ctx context.Context) error {
	mempoolTurns("wait", t.peer)
	if err := enterTurn(ctx, t.p.mempools); err != nil {
		mempoolTurns("abandon", t.peer)
		return fmt.Errorf("primary: mempool registration: %w", err)
	}
	if !(*handler)(t.p).attached(t.peer) {
		// It detached, or was dropped, since: the registration is for
		// nobody now.
		<-t.p.mempools
		mempoolTurns("left", t.peer)
		return fmt.Errorf("primary: mempool registration: %w", instance.ErrNotAttached)
	}
	t.held, t.since = true, time.Now()
	mempoolTurns("start", t.peer)
	return nil
}

// give gives the primary's turn back, if held.
func (t *mempoolTurnHold) give() {
	if t.held {
		mempoolTurns("end", t.peer)
		t.held = false
		<-t.p.mempools
	}
}

// yield, once the registration has worked for mempoolSlice, gives the
// primary's turn to the registrations waiting for it, if any, and queues
// again behind them. A nil hold does nothing.
func (t *mempoolTurnHold) yield(ctx context.Context) error {
	if t == nil || time.Since(t.since) < mempoolSlice {
		return nil
	}
	t.give()
	return t.take(ctx)
}

// end gives back both turns.
func (t *mempoolTurnHold) end() {
	t.give()
	<-t.own.ch
	(*handler)(t.p).unrefTurn(t.own)
}

// mempoolTurns is told of each mempool registration's turns: "queue"
// when it queues for its process's; "wait" when it queues for the
// primary's, having its process's; "start" when it has both; "end" when
// it gives the primary's back; "abandon" when its context ended while it
// waited for either, or its attachment had left as its process's came;
// "left" when its attachment had left as the primary's came (it gives it
// back at once). A variable for tests.
var mempoolTurns = func(event string, peer *ipc.Peer) {}

// syncSecondaries is subscribed to the data memory's events, after the
// cache's guard. It runs without the memory lock (creates go on
// meanwhile), one call per Alloc or Free, several at once if they come at
// once, while no hello is under way: it has every secondary map (after an
// allocation) or unmap (before a free completes) the pages, and waits for
// them all. A secondary that does not answer within SyncTimeout — or whose
// connection fails while it is still alive — is dropped: its connection
// is closed and its slot fenced, so that the pages freed from now on wait
// in quarantine until it is gone (the memory layer does that once the
// event returns), and the secondary, when it resumes, finds out and
// stops.
func (p *Primary) syncSecondaries(ev hugetlb.Event) {
	op := ipc.SyncMap
	if ev.Kind == hugetlb.EventFree {
		op = ipc.SyncUnmap
	}
	list, ok := p.mem.InList(ev.Addr)
	if !ok {
		return
	}
	li := p.mem.Lists()[list]
	msg := &ipc.Sync{Op: op, List: list, First: int((ev.Addr - li.Base) / uintptr(li.PageSize)),
		Count: int(ev.Len / li.PageSize)}
	p.syncMu.Lock()
	targets := make([]*secondary, 0, len(p.peers))
	for _, s := range p.peers {
		targets = append(targets, s)
	}
	p.syncMu.Unlock()
	var wg sync.WaitGroup
	for _, s := range targets {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if syncPushing != nil {
				syncPushing()
			}
			// SyncTimeout counts from when the push went out: a primary
			// stopped before that has not given the secondary its time.
			err := s.peer.PushWithin(context.Background(), p.cfg.SyncTimeout, ipc.KindSync, msg, &ipc.SyncAck{})
			if err == nil {
				p.syncs.Add(1)
				return
			}
			// Once, however many syncs found it wanting; each returns
			// only after the fence, so that the pages of each free
			// wait for it.
			s.drop.Do(func() {
				(*handler)(p).awaitJudgement(s)
				live := p.aliveAtDrop(s, err)
				p.syncMu.Lock()
				switch {
				case s.detached:
					// It detached since the sync began, and closed its
					// connection: judged then.
				case live:
					p.drops.Add(1)
					p.log.Warn("dropping secondary that did not follow a memory change",
						"pid", s.peer.PID(), "slot", s.slot, "op", op, "err", err)
					// Fenced before it leaves the sync set and before its
					// connection closes, so that it finds the fence when it
					// sees the end.
					p.fenceIfAlive(s, fmt.Sprintf("it did not acknowledge a %s sync: %v", op, err))
				} // else it died: its mappings went with it
				if cur := p.peers[s.peer]; cur != nil {
					(*handler)(p).leaveTurn(cur) // a hello again may have replaced s: the same turn
				}
				delete(p.peers, s.peer)
				p.syncMu.Unlock()
				s.peer.Close()
			})
		}()
	}
	wg.Wait()
}

// syncPushing, when set (by tests, before the primary starts), runs in
// each secondary's sync as it is about to push.
var syncPushing func()

// aliveAtDrop reports whether s, which failed a sync with err, is to be
// fenced. It is judged as the end of a connection is (mayReachAfterEnd),
// in time of its own, whatever the sync's deadline: one whose connection
// ended gets deathGrace to end, and a process that has let its slot go is
// described by the kernel within dropAsk. A free waits for the judgement:
// up to deathGrace + dropAsk past its sync's failure (see
// Config.SyncTimeout for when that is), and judgementWait before
// that for s if a hello of its process is judging it (awaitJudgement). A
// secondary that detached meanwhile is not looked at.
func (p *Primary) aliveAtDrop(s *secondary, err error) bool {
	p.syncMu.Lock()
	detached := s.detached
	p.syncMu.Unlock()
	switch {
	case detached:
		return false
	case errors.Is(err, ipc.ErrPeerGone):
		return p.mayReachAfterEnd(s, deathGrace, dropAsk)
	}
	return p.mayReachAfterEnd(s, 0, dropAsk) // it did not answer in time, or answered with an error
}

// dropAsk bounds the kernel's description of a secondary that failed a
// sync and has let its slot go.
const dropAsk = 100 * time.Millisecond

// mayReachAfterEnd reports whether s, whose connection ended or which
// failed a sync, and which was not judged by a detach, may still reach
// data memory. A process that dies closes its connection, its memory gone
// by then, a moment before it ends: it is given grace to end. One that
// runs on and holds its claim's slot may: it has not let go (stalled, or
// its connection was closed for it). One that has let its slot go (as a
// secondary does after its connection, once its detach had no answer) may
// if the kernel, given ask, says it maps or holds open a backing file, or
// does not answer in time. Where the kernel will not describe the process,
// the slot's release is its word that it unmapped, as hugetlb takes it for
// the holders it fenced.
func (p *Primary) mayReachAfterEnd(s *secondary, grace, ask time.Duration) bool {
	if !p.aliveAfter(s, grace) {
		return false
	}
	if p.seg.AliveAs(s.slot, s.epoch) {
		return true
	}
	reach, known, done := p.mem.ReachesWithin(s.peer.PID(), ask)
	return !done || known && reach
}

// reapDisconnected reclaims the slots of secondaries whose connection
// ended while they held it, once their processes are gone; it forgets
// those that someone else reclaimed, or that were claimed anew.
func (p *Primary) reapDisconnected() {
	p.syncMu.Lock()
	n := len(p.unreaped)
	p.syncMu.Unlock()
	if n == 0 {
		return
	}
	if reaped := p.seg.Reap(); len(reaped) > 0 {
		p.log.Info("reclaimed slots of dead processes", "slots", reaped)
	}
	p.syncMu.Lock()
	defer p.syncMu.Unlock()
	for slot, epoch := range p.unreaped {
		if pr := p.seg.Proc(slot); !pr.Live || pr.Epoch != epoch {
			delete(p.unreaped, slot)
		}
	}
}

// Budget of the stats requests of peers that have not attached (tools such
// as mpmr stats), all together: StrangerStatsRate a second,
// StrangerStatsBurst at once. Beyond it they get ipc.ErrLimit, counted in
// Counters.IPCThrottled.
const (
	StrangerStatsRate  = 50
	StrangerStatsBurst = 20
	strangerStatsAge   = 100 * time.Millisecond
)

// strangerStats answers a stats request of a peer that has not attached:
// from the last answer if it is recent enough, within the strangers'
// budget, else with ipc.ErrLimit.
func (h *handler) strangerStats() (*ipc.StatsReply, error) {
	p := h.p()
	p.strangerMu.Lock()
	defer p.strangerMu.Unlock()
	now := time.Now()
	p.strangerTokens = min(StrangerStatsBurst, p.strangerTokens+now.Sub(p.strangerRefill).Seconds()*StrangerStatsRate)
	p.strangerRefill = now
	if p.strangerTokens < 1 {
		p.throttled.Add(1)
		return nil, fmt.Errorf("%w: too many stats requests from processes that have not attached (%d a second at most, all together)",
			ipc.ErrLimit, StrangerStatsRate)
	}
	p.strangerTokens--
	if p.strangerReply == nil || now.Sub(p.strangerAt) > strangerStatsAge {
		p.strangerReply, p.strangerAt = h.stats(), now
	}
	return p.strangerReply, nil
}

// stats answers a Stats request.
func (h *handler) stats() *ipc.StatsReply {
	st := h.p().Stats()
	return &ipc.StatsReply{PID: os.Getpid(), Secondaries: st.Counters.Secondaries, MRs: st.Global.MRs,
		Counters: st.Counters.Map()}
}
