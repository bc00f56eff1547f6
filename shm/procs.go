package shm

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"

	"github.com/mpmr/mpmr/internal/sys/ofd"
)

// Role is what a process does in an instance.
type Role uint32

// Roles recorded in the process table.
const (
	RoleNone      Role = 0
	RolePrimary   Role = 1
	RoleSecondary Role = 2
	RoleObserver  Role = 3 // tools that attach to read
)

func (r Role) String() string {
	switch r {
	case RoleNone:
		return "none"
	case RolePrimary:
		return "primary"
	case RoleSecondary:
		return "secondary"
	case RoleObserver:
		return "observer"
	}
	return "role(" + strconv.Itoa(int(r)) + ")"
}

// MarshalText names the role, for JSON.
func (r Role) MarshalText() ([]byte, error) { return []byte(r.String()), nil }

// UnmarshalText reads what MarshalText wrote.
func (r *Role) UnmarshalText(b []byte) error {
	for _, c := range []Role{RoleNone, RolePrimary, RoleSecondary, RoleObserver} {
		if c.String() == string(b) {
			*r = c
			return nil
		}
	}
	if n, ok := strings.CutPrefix(string(b), "role("); ok {
		if v, err := strconv.ParseUint(strings.TrimSuffix(n, ")"), 10, 32); err == nil {
			*r = Role(v)
			return nil
		}
	}
	return fmt.Errorf("shm: unknown role %q", b)
}

const (
	slotFree uint32 = 0
	slotLive uint32 = 1
)

// Proc describes one process-table slot.
type Proc struct {
	Slot  int    `json:"slot"`
	PID   int    `json:"pid"`
	UID   int    `json:"uid"`
	Start uint64 `json:"start"` // process start time, clock ticks after boot
	Role  Role   `json:"role"`
	Epoch uint32 `json:"epoch"` // how many times the slot has been claimed
	// Live is what the slot says: a process claimed it and has not
	// released it.
	Live bool `json:"live"`
	// Alive is what the kernel says: the claimant still holds the slot's
	// lock. A Live slot that is not Alive belongs to a process that died.
	Alive bool `json:"alive"`
	// Fenced: the primary stopped trusting this claim to follow memory
	// changes (see Segment.Fence).
	Fenced bool `json:"fenced"`
	// Unmapped: the claimant declared it maps no data memory any more.
	Unmapped bool `json:"unmapped"`
	// Seq, in a fence the owner keeps (Holders), changes with every call
	// of Fence for the process and slot while the process lives, those
	// that return false included (fenced already, or an earlier claim):
	// Forget ends the record only as it was read.
	Seq uint64 `json:"seq,omitempty"`
}

// selfStart is this process's start time, read once.
var selfStart = func() uint64 {
	st, _ := ProcessStart(os.Getpid())
	return st
}()

// ProcessStart returns the start time of process pid in clock ticks after
// boot (field 22 of /proc/PID/stat). Together with the pid it names one
// process for its whole life.
func ProcessStart(pid int) (uint64, error) {
	f, err := statFields(pid)
	if err != nil {
		return 0, err
	}
	return strconv.ParseUint(string(f[startField]), 10, 64)
}

// Fields of /proc/PID/stat, as indexes into what statFields returns.
const (
	stateField   = 0 // field 3, the first after the command name
	threadsField = 20 - 3
	startField   = 22 - 3
)

// statFields returns the fields of /proc/PID/stat after the command name
// (field 2, which may hold spaces and parentheses; the fields after the
// last ')' are plain), at least up to the start time.
func statFields(pid int) ([][]byte, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return nil, err
	}
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return nil, fmt.Errorf("shm: unexpected /proc/%d/stat", pid)
	}
	f := bytes.Fields(b[i+1:])
	if len(f) <= startField {
		return nil, fmt.Errorf("shm: short /proc/%d/stat", pid)
	}
	return f, nil
}

func (s *Segment) slots() []procSlot { return s.procs }

// claimSlot takes the first slot whose lock byte nobody holds: a free slot,
// or one whose process died. Holding the byte's lock from here on is what
// makes this process alive in everyone else's eyes.
func (s *Segment) claimSlot(role Role) error {
	slots := s.slots()
	for i := range slots {
		err := ofd.TryLock(s.lockf, int64(i), true)
		if errors.Is(err, ofd.ErrLocked) {
			continue
		}
		if err != nil {
			return err
		}
		p := &slots[i]
		if atomic.LoadUint32(&p.State) == slotLive {
			s.log.Info("reclaiming slot of dead process", "slot", i, "pid", atomic.LoadUint32(&p.PID))
		}
		// The previous claimant's pid and start time go before the epoch
		// moves on: a look at the slot that sees the new epoch (Proc reads
		// it first) must not see them beside it, or the process that left
		// the slot, or one given a dead claimant's pid, could speak for
		// the new claim (a primary admits a hello by these words).
		atomic.StoreUint32(&p.PID, 0)
		atomic.StoreUint64(&p.Start, 0)
		epoch := atomic.AddUint32(&p.Epoch, 1)
		atomic.StoreUint32(&p.Fenced, 0)
		atomic.StoreUint32(&p.Unmapped, 0)
		atomic.StoreUint32(&p.Role, uint32(role))
		atomic.StoreUint32(&p.PID, uint32(os.Getpid()))
		atomic.StoreUint32(&p.UID, uint32(os.Getuid()))
		atomic.StoreUint64(&p.Start, selfStart)
		s.resetReaderLines(i)
		atomic.StoreUint32(&p.State, slotLive)
		s.epoch = epoch
		s.slot.Store(int32(i))
		return nil
	}
	return fmt.Errorf("%w: all %d slots are held by live processes", ErrNoSlot, len(slots))
}

// freeSlot marks this process's slot free in the table; it stays held
// (its lock byte) until releaseSlot. Call it while the segment is mapped.
func (s *Segment) freeSlot() {
	i := s.Slot()
	if i < 0 {
		return
	}
	// The pid stays: until the slot is released, tools that list the
	// processes holding slots name this one. The next claim rewrites it.
	atomic.StoreUint32(&s.slots()[i].State, slotFree)
}

// releaseSlot lets go of this process's slot: from now on other processes
// see it dead. Call it once nothing of this process can write the segment
// any more (it is unmapped, or mapped to private zeros).
func (s *Segment) releaseSlot() {
	i := s.Slot()
	if i < 0 {
		return
	}
	_ = ofd.Unlock(s.lockf, int64(i))
	s.slot.Store(-1)
}

// Slots returns the length of the process table.
func (s *Segment) Slots() int { return len(s.procs) }

// Slot returns this process's process-table slot.
func (s *Segment) Slot() int { return int(s.slot.Load()) }

// Alive reports whether the process in slot i is alive: it holds the slot's
// lock byte. This process's own slot is always alive. A lock-file error
// counts as alive, so that a failure to look never discards live state. On a
// read-only Segment whose lock file does not exist, no slot is alive: nobody
// can hold a lock in a file that is not there; nor on a closed one, whose
// lock file is closed (a reader CloseUnderReaders left behind reads only
// private zeros by then).
func (s *Segment) Alive(i int) bool {
	if i == s.Slot() {
		return true
	}
	s.filesMu.RLock()
	defer s.filesMu.RUnlock()
	if s.lockf == nil {
		return false
	}
	held, err := ofd.Held(s.lockf, int64(i))
	if err != nil {
		s.log.Warn("liveness check failed; assuming alive", "slot", i, "err", err)
		return true
	}
	return held
}

// aliveAs reports whether slot i is alive and still held by the claim that
// had the given epoch: a later claim of the slot by another process does not
// make an earlier claimant look alive.
func (s *Segment) aliveAs(i int, epoch uint32) bool {
	if i == s.Slot() {
		return epoch == s.epoch
	}
	slots := s.slots()
	if i < 0 || i >= len(slots) || atomic.LoadUint32(&slots[i].Epoch) != epoch {
		return false
	}
	return s.Alive(i)
}

// Procs returns every slot that is live or whose process is alive.
func (s *Segment) Procs() []Proc {
	var out []Proc
	for i := range s.slots() {
		p := s.Proc(i)
		if p.Live || p.Alive {
			out = append(out, p)
		}
	}
	return out
}

// Proc describes slot i.
func (s *Segment) Proc(i int) Proc {
	p := &s.procs[i]
	epoch := atomic.LoadUint32(&p.Epoch) // first: see claimSlot
	return Proc{
		Slot:     i,
		PID:      int(atomic.LoadUint32(&p.PID)),
		UID:      int(atomic.LoadUint32(&p.UID)),
		Start:    atomic.LoadUint64(&p.Start),
		Role:     Role(atomic.LoadUint32(&p.Role)),
		Epoch:    epoch,
		Live:     atomic.LoadUint32(&p.State) == slotLive,
		Alive:    s.Alive(i),
		Fenced:   epoch != 0 && atomic.LoadUint32(&p.Fenced) == epoch,
		Unmapped: epoch != 0 && atomic.LoadUint32(&p.Unmapped) == epoch,
	}
}

// AliveAs reports whether slot i is alive and still held by the claim
// that had the given epoch (see Proc.Epoch).
func (s *Segment) AliveAs(i int, epoch uint32) bool { return s.aliveAs(i, epoch) }

// Epoch returns the epoch of this process's claim of its slot.
func (s *Segment) Epoch() uint32 { return s.epoch }

// Fence marks the claim of slot i with the given epoch, made by process
// pid, as no longer following memory changes: the primary dropped it while
// it may still map data memory. The claimant finds out with Fenced and
// should unmap its data memory and say so with MarkUnmapped; until it has
// unmapped it or died, the pages the primary frees are quarantined (see
// hugetlb and Holders). The process is named by its pid and its start
// time (ProcessStart, as the owner read it when it admitted the process),
// so that the fence holds even when its /proc stat cannot be read now.
// Fence reports whether it fenced the claim now:
// false if the process (pid and start) is gone by the kernel's word, or
// the claim was fenced already, or a
// later claim of the slot by the same process was (then the slot's word
// is left as it is: it belongs to the later claim). The owner
// keeps one record per process and slot (see SameHolder), which names the
// latest claim fenced, so that a process that claims a slot and hangs up
// again and again costs one record, not one a claim. Owner only.
//
// The owner keeps its own record of what it fenced, naming the process by
// its pid and start time: every word of the process table can be rewritten
// by any process mapping the segment, and none of them may end a fence.
func (s *Segment) Fence(i int, epoch uint32, pid int, start uint64) bool {
	fenced, _ := s.FenceClaim(i, epoch, pid, start)
	return fenced
}

// FenceClaim is Fence, and also returns the owner's record of the process
// and slot as this call left it (the zero Proc if it keeps none), for a
// caller that may end the record later on an answer about this claim
// alone (Forget ends it only if no fence has changed it since).
func (s *Segment) FenceClaim(i int, epoch uint32, pid int, start uint64) (fenced bool, record Proc) {
	slots := s.slots()
	if !s.owner || i < 0 || i >= len(slots) || i == s.Slot() || !SameProcess(pid, start) {
		return false, Proc{}
	}
	rec := Proc{Slot: i, PID: pid, Start: start, Epoch: epoch, Live: true, Alive: true, Fenced: true}
	s.fenceMu.Lock()
	defer s.fenceMu.Unlock()
	s.fenceSeq++
	j := slices.IndexFunc(s.fences, rec.SameHolder)
	if j >= 0 {
		// Whatever becomes of this fence, the record no longer ends on
		// an answer read before it: the claim fenced now may map what
		// such an answer found unmapped.
		s.fences[j].Seq = s.fenceSeq
	}
	if j >= 0 && int32(epoch-s.fences[j].Epoch) < 0 {
		// An earlier claim of the slot than the one the record names:
		// the slot's word and the record stay with the later claim (a
		// question asked about the earlier one must not end the later
		// one's fence; see Forget).
		return false, s.fences[j]
	}
	atomic.StoreUint32(&slots[i].Fenced, epoch) // again, if fenced already: any process can clear it
	if j >= 0 && s.fences[j].Epoch == epoch {
		return false, s.fences[j] // fenced already
	}
	if j >= 0 {
		s.fences[j].Epoch = epoch // a later claim of the slot: the record names it now
		return true, s.fences[j]
	}
	rec.Seq = s.fenceSeq
	s.fences = append(s.fences, rec)
	return true, rec
}

// Forget ends the fence of holder h (one of Holders): its process has let
// go of the data memory, by the kernel's word, and whatever it maps later
// it maps through a new attachment that follows the owner's changes. A
// record that names a later claim than h's, or that a fence taken since
// h was read changed (Proc.Seq), stays: that fence came after h was read,
// so the kernel's word may predate it. Owner only.
func (s *Segment) Forget(h Proc) {
	s.fenceMu.Lock()
	defer s.fenceMu.Unlock()
	s.fences = slices.DeleteFunc(s.fences, func(f Proc) bool {
		return f.SameHolder(h) && f.Epoch == h.Epoch && f.Seq == h.Seq
	})
}

// SameHolder reports whether p and q are fences of one slot by one
// process (the same slot, pid and start time), whatever claims of the slot
// they were for: the process reaches data memory or not, and the slot is
// held or not, the same for each of them.
func (p Proc) SameHolder(q Proc) bool {
	return p.Slot == q.Slot && p.PID == q.PID && p.Start == q.Start
}

// SameProcess reports whether process pid is still the one that started
// at start (see ProcessStart): it has not exited, and its pid was not
// handed to another. A zombie still counts; it maps nothing. A stat that
// cannot be read for another reason than the process's end counts too
// (see noSuchProcess).
func SameProcess(pid int, start uint64) bool {
	now, err := ProcessStart(pid)
	if err != nil {
		return !noSuchProcess(err)
	}
	return now == start
}

// noSuchProcess reports whether err, from reading a process's /proc
// stat, says the process is no more. Any other failure (this process out
// of descriptors, a stat it cannot parse) says nothing, and the callers
// that decide whether a process may still reach data memory take it as
// alive: a fence forgotten, or none taken, releases its pages.
func noSuchProcess(err error) bool {
	return errors.Is(err, fs.ErrNotExist) || errors.Is(err, syscall.ESRCH)
}

// Running reports whether process pid, started at start, runs still: it is
// the same process (see SameProcess) and not a zombie whose threads have
// all ended. By then the kernel has taken its memory and closed its files;
// a process that has only let its slot go may map a file it kept open at
// any time. A zombie main thread whose other threads run counts as
// running: they share the process's memory; so does a process whose stat
// cannot be read for another reason than its end (see noSuchProcess).
func Running(pid int, start uint64) bool {
	if pid <= 0 {
		return false // no process: a record that names none, or a header's words
	}
	f, err := statFields(pid)
	if err != nil {
		return !noSuchProcess(err)
	}
	if now, err := strconv.ParseUint(string(f[startField]), 10, 64); err != nil || now != start {
		return false
	}
	switch string(f[stateField]) {
	case "X", "x": // dead, being released
		return false
	case "Z":
		threads, err := strconv.Atoi(string(f[threadsField]))
		return err != nil || threads > 1
	}
	return true
}

// Fenced reports whether the primary fenced this process's claim.
func (s *Segment) Fenced() bool {
	slots, i := s.slots(), s.Slot()
	return i >= 0 && i < len(slots) && atomic.LoadUint32(&slots[i].Fenced) == s.epoch
}

// FenceWatch tells, from any goroutine and without reading anything Close
// changes, whether the primary fenced the claim this process holds now.
// The zero FenceWatch never reports a fence.
type FenceWatch struct {
	word  *uint32
	epoch uint32
}

// Fenced reports whether the claim was fenced.
func (w FenceWatch) Fenced() bool { return w.word != nil && atomic.LoadUint32(w.word) == w.epoch }

// FenceWatch returns a FenceWatch for this process's current claim (the
// zero one if it holds none). It reads the claim's word where the segment
// is mapped, so it is for goroutines that may read the segment anyway.
func (s *Segment) FenceWatch() FenceWatch {
	slots, i := s.slots(), s.Slot()
	if i < 0 || i >= len(slots) {
		return FenceWatch{}
	}
	return FenceWatch{word: &slots[i].Fenced, epoch: s.epoch}
}

// MarkUnmapped declares that this process maps no data memory any more, so
// that the primary need not quarantine what it frees on this process's
// account.
func (s *Segment) MarkUnmapped() {
	slots, i := s.slots(), s.Slot()
	if i >= 0 && i < len(slots) {
		atomic.StoreUint32(&slots[i].Unmapped, s.epoch)
	}
}

// Holders returns the processes the owner fenced that are still alive:
// those that may map data memory without following the owner's changes.
// Whether one still maps it, only the kernel can say (see hugetlb); what
// it declared in the process table (Proc.Unmapped) is in Proc, for
// display only: any process mapping the segment can write it. Owner only:
// others, and a closed Segment, get nil.
func (s *Segment) Holders() []Proc {
	if !s.owner || s.closed.Load() {
		return nil
	}
	s.fenceMu.Lock()
	defer s.fenceMu.Unlock()
	live := s.fences[:0]
	for _, f := range s.fences {
		if SameProcess(f.PID, f.Start) {
			live = append(live, f)
		}
	}
	clear(s.fences[len(live):])
	s.fences = live
	out := slices.Clone(live)
	slots := s.slots()
	for i := range out {
		out[i].Unmapped = atomic.LoadUint32(&slots[out[i].Slot].Unmapped) == out[i].Epoch
	}
	return out
}

// Reap marks the slots of dead processes free and returns their numbers.
// Each is locked while it is cleared, so Reap never races a process that is
// claiming the same slot. Locks those processes held are repaired by the
// lock operations themselves; Reap only tidies the table.
func (s *Segment) Reap() []int {
	s.filesMu.RLock()
	defer s.filesMu.RUnlock()
	if s.lockf == nil {
		return nil // closed
	}
	var reaped []int
	slots, mine := s.slots(), s.Slot()
	for i := range slots {
		p := &slots[i]
		if i == mine || atomic.LoadUint32(&p.State) != slotLive {
			continue
		}
		if err := ofd.TryLock(s.lockf, int64(i), true); err != nil {
			continue // alive, or being claimed
		}
		if atomic.LoadUint32(&p.State) == slotLive {
			atomic.StoreUint32(&p.State, slotFree)
			reaped = append(reaped, i)
		}
		_ = ofd.Unlock(s.lockf, int64(i))
	}
	return reaped
}
