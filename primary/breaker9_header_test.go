package primary_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/primary"
)

// Any process that maps the control segment writable (the primary's own
// user: every secondary, any tool of that user) can write every word of
// its header and of the process table. These tests are such a peer: while
// a real primary (in a helper process of its own, so that a crash of it
// is observed rather than taking the test binary down) and real
// secondaries run, they rewrite header or slot words through a write(2)
// to the segment file (tmpfs), then drive the instance's normal
// operations. One peer must not be able to take the primary down, hang
// it, or make anyone serve keys for, or hand out again, memory that was
// freed while a stopped process can still reach it:
//   - the arena's bounds and free list (Size, MaxSize, PageSize, ArenaFree
//     and the free blocks) are the owner's own records, never read back
//     (TestBreaker9HeaderBounds, ...HeaderArena, ...ArenaFree*);
//   - the process table (Slots, ProcsOff) and the registered locks are
//     bound or checked once (...HeaderProcessTable, ...HeaderLocksAndRoots);
//   - the quarantine of freed pages ends when the kernel says the fenced
//     process is gone or reaches no backing file, whatever its slot says
//     (...SlotWordsDoNotReleaseQuarantine, ...FencedPrimarySlot...);
//   - a process other than the owner bounds its accesses by the file, not
//     by the header's Size (...ToolSurvivesRacingSizeWrites).

func init() {
	testproc.Register("b9-primary", b9Primary)
}

// b9Patience bounds every answer: an operation of an instance this small
// takes milliseconds, so one that takes this long hangs.
const b9Patience = 5 * time.Second

// Header word offsets (see shm/layout_unsafe.go).
const (
	b9Magic       = 0
	b9Version     = 8
	b9Layout      = 12
	b9State       = 16
	b9Slots       = 20
	b9CreatorPID  = 24
	b9Size        = 40
	b9MaxSize     = 48
	b9PageSize    = 56
	b9ProcsOff    = 64
	b9ArenaOff    = 72
	b9ArenaFree   = 80
	b9ArenaUsed   = 88
	b9ArenaBlocks = 96
	b9Locks       = 104
	b9Roots       = 168

	b9Table    = 4096 // process table
	b9SlotSize = 64
	// Fields of a process-table slot.
	b9SlotState    = 0
	b9SlotEpoch    = 12
	b9SlotFenced   = 28
	b9SlotUnmapped = 32
)

// b9Primary runs a primary (prefix args[0], runtime directory args[1],
// tmpfs) and serves commands, one per line, answering each with one line:
//
//	alloc PAGES       -> "> region ADDR LEN" or "> err TEXT"
//	free ADDR LEN     -> "> ok" or "> err TEXT"
//	create ADDR       -> "> key K" or "> err TEXT" (the global cache's Create)
//	lookup ADDR       -> the same, through a queue of the primary
//	stats             -> "> stats mrs=N secondaries=N"
//	dump              -> "> dump procs=N mrs=N err=E"
//	pool NAME SZ N    -> CreatePool: "> ok" or "> err TEXT"
//	release           -> "> released PAGES" (a housekeeping pass of the quarantine)
//	quarantined       -> "> quarantined PAGES fenced N"
//	close             -> "> closed ERR"
//
// It says "ready seg=PATH page=N name=NAME dir=DIR" first. A panic or a
// fault ends it with the runtime's report on its standard error.
func b9Primary(args []string) int {
	p, err := primary.Start(primary.Config{Prefix: args[0], RuntimeDir: args[1], Backend: hugetlb.Tmpfs,
		MemoryPages: 64, Logger: quiet, SyncTimeout: time.Second})
	if err != nil {
		testproc.Say("start-failed %v", err)
		return 3
	}
	q := p.NewQueue()
	testproc.Say("ready seg=%s page=%d name=%s dir=%s", p.Segment().Path(), p.Backend().PageSize, p.Name(), p.Backend().Dir)
	testproc.EachCommand(func(c testproc.Line) {
		switch c.Name {
		case "alloc":
			r, err := p.Alloc(c.Num(0) * p.Backend().PageSize)
			if err != nil {
				testproc.Say("> err %v", err)
				return
			}
			testproc.Say("> region %d %d", r.Addr, r.Len)
		case "free":
			if err := p.Free(hugetlb.Region{Addr: uintptr(c.Num(0)), Len: c.Num(1)}); err != nil {
				testproc.Say("> err %v", err)
				return
			}
			testproc.Say("> ok")
		case "create":
			e, err := p.Global().Create(c.Num(0))
			testproc.SayKey(e.LKey, err)
		case "lookup":
			testproc.SayKey(q.Lookup(uintptr(c.Num(0))))
		case "stats":
			st := p.Stats()
			testproc.Say("> stats mrs=%d secondaries=%d", st.Global.MRs, st.Counters.Secondaries)
		case "dump":
			d, err := p.Dump()
			testproc.Say("> dump procs=%d mrs=%d err=%v", len(d.Processes), len(d.Cache.MRs), err)
		case "pool":
			n, _ := strconv.Atoi(c.Args[2])
			size, _ := strconv.Atoi(c.Args[1])
			if _, err := p.CreatePool(c.Args[0], size, n); err != nil {
				testproc.Say("> err %v", err)
				return
			}
			testproc.Say("> ok")
		case "release":
			// One housekeeping pass of the quarantine, now.
			testproc.Say("> released %d", p.Memory().ReleaseQuarantine())
		case "quarantined":
			testproc.Say("> quarantined %d fenced %d", p.Memory().Quarantined(), p.Stats().Counters.Fenced)
		case "close":
			testproc.Say("> closed %v", p.Close())
		default:
			testproc.Say("> err unknown command %q", c.Name)
		}
	})
	p.Close()
	return 0
}

// b9Inst is a primary helper and what the peer needs to attack it.
type b9Inst struct {
	t         *testing.T
	h         *testproc.Proc
	cfg       primary.Config
	seg       string
	page      uint64
	name, dir string // the instance's name and backend directory
}

// b9Start starts a primary helper; it is asked to close cleanly at the
// end of the test, and the files of one that died are removed.
func b9Start(t *testing.T) *b9Inst {
	t.Helper()
	testenv.Tmpfs(t)
	cfg := primary.Config{Prefix: testenv.Prefix(t), RuntimeDir: testenv.RunDir(t)}
	h := testproc.Start(t, "b9-primary", []string{cfg.Prefix, cfg.RuntimeDir})
	line := h.Expect("", 0)
	var b9 b9Inst
	var name, dir string
	_, err := fmt.Sscanf(line, "ready seg=%s page=%d name=%s dir=%s", &b9.seg, &b9.page, &name, &dir)
	require.NoError(t, err, "%s; stderr:\n%s", line, h.Stderr())
	t.Cleanup(func() {
		h.End(5 * time.Second)
		h.Kill()
		if ms, _ := filepath.Glob(filepath.Join(dir, "mpmr."+name+".*")); len(ms) > 0 {
			for _, m := range ms {
				os.Remove(m)
			}
		}
	})
	b9.t, b9.h, b9.cfg, b9.name, b9.dir = t, h, cfg, name, dir
	return &b9
}

// do sends a command to the primary and returns its answer. If the
// primary ended instead, it returns an error that quotes the start of its
// standard error (the panic and the top of its stack).
func (b *b9Inst) do(format string, args ...any) (string, error) {
	b.t.Helper()
	if b9Ended(b.h.PID()) {
		// Sending would fail the test on a broken pipe: wait for the end
		// of its output instead, so that its report is complete.
		_, err := b.h.Next("\x00", b9Patience)
		return "", fmt.Errorf("the primary is gone before %q: %w; its stderr:\n%s", fmt.Sprintf(format, args...),
			err, b9StackTop(b.h.Stderr()))
	}
	b.h.Send(format, args...)
	line, err := b.h.Next("> ", b9Patience)
	if err != nil && !b9Ended(b.h.PID()) {
		// Hung: have the runtime print every goroutine, and show the
		// ones in the library.
		_ = syscall.Kill(b.h.PID(), syscall.SIGQUIT)
		_, _ = b.h.Next("\x00", b9Patience)
		return "", fmt.Errorf("the primary hangs in %q: %w; its goroutines in the library:\n%s", fmt.Sprintf(format, args...),
			err, b9Stuck(b.h.Stderr()))
	}
	if err != nil {
		return "", fmt.Errorf("the primary did not answer %q: %w; its stderr:\n%s", fmt.Sprintf(format, args...),
			err, b9StackTop(b.h.Stderr()))
	}
	return strings.TrimPrefix(line, "> "), nil
}

// b9Ended reports whether process pid (a helper of this test) has ended:
// it is gone, or a zombie.
func b9Ended(pid int) bool {
	st, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return true
	}
	i := strings.LastIndexByte(string(st), ')')
	return i < 0 || i+2 >= len(st) || st[i+2] == 'Z' || st[i+2] == 'X'
}

// must is do, failing the test if the primary did not answer.
func (b *b9Inst) must(format string, args ...any) string {
	b.t.Helper()
	ans, err := b.do(format, args...)
	require.NoError(b.t, err)
	return ans
}

// alloc allocates pages of data memory in the primary.
func (b *b9Inst) alloc(pages int) (addr, length uint64) {
	b.t.Helper()
	ans := b.must("alloc %d", pages)
	_, err := fmt.Sscanf(ans, "region %d %d", &addr, &length)
	require.NoError(b.t, err, ans)
	return addr, length
}

// b9StackTop returns the first lines of a crashed Go process's report: the
// panic message and the frames nearest it.
func b9StackTop(stderr string) string {
	i := strings.Index(stderr, "panic:")
	if j := strings.Index(stderr, "fatal error:"); i < 0 || (j >= 0 && j < i) {
		i = j
	}
	if i < 0 {
		if len(stderr) > 1500 {
			return stderr[len(stderr)-1500:]
		}
		return stderr
	}
	lines := strings.Split(stderr[i:], "\n")
	return strings.Join(lines[:min(len(lines), 24)], "\n")
}

// b9Stuck picks, from a SIGQUIT's goroutine dump, the goroutines running
// in the segment's or the caches' code, 16 lines of each.
func b9Stuck(dump string) string {
	var out []string
	for _, g := range strings.Split(dump, "\n\n") {
		if !strings.HasPrefix(g, "goroutine ") || !strings.Contains(g, "github.com/mpmr/mpmr/shm.") {
			continue
		}
		var keep []string
		for _, l := range strings.Split(g, "\n") {
			if !strings.HasPrefix(l, "\t") { // frames, not their file:line
				keep = append(keep, l)
			}
		}
		out = append(out, strings.Join(keep[:min(len(keep), 16)], "\n"))
		if len(out) == 3 {
			break
		}
	}
	if len(out) == 0 {
		return b9StackTop(dump)
	}
	return strings.Join(out, "\n\n")
}

// read and write access the segment file as another process of the same
// user would: by write(2), which tmpfs allows.
func (b *b9Inst) read(off int64, n int) []byte {
	b.t.Helper()
	f, err := os.Open(b.seg)
	require.NoError(b.t, err)
	defer f.Close()
	buf := make([]byte, n)
	_, err = f.ReadAt(buf, off)
	require.NoError(b.t, err)
	return buf
}

func (b *b9Inst) write(off int64, v []byte) {
	b.t.Helper()
	f, err := os.OpenFile(b.seg, os.O_RDWR, 0)
	require.NoError(b.t, err)
	defer f.Close()
	_, err = f.WriteAt(v, off)
	require.NoError(b.t, err)
}

func (b *b9Inst) u64(off int64) uint64 { return binary.LittleEndian.Uint64(b.read(off, 8)) }
func (b *b9Inst) u32(off int64) uint32 { return binary.LittleEndian.Uint32(b.read(off, 4)) }
func (b *b9Inst) put64(off int64, v uint64) {
	b.write(off, binary.LittleEndian.AppendUint64(nil, v))
}
func (b *b9Inst) put32(off int64, v uint32) {
	b.write(off, binary.LittleEndian.AppendUint32(nil, v))
}

// survives asserts that the primary still answers: Stats and Dump.
func (b *b9Inst) survives(what string) bool {
	b.t.Helper()
	for _, cmd := range []string{"stats", "dump"} {
		if _, err := b.do("%s", cmd); err != nil {
			assert.NoError(b.t, err, "after %s", what)
			return false
		}
	}
	return true
}

// secAsk asks a secondary helper, returning an error if it did not answer
// within b9Patience.
func secAsk(h *testproc.Proc, format string, args ...any) (string, error) {
	if b9Ended(h.PID()) {
		_, err := h.Next("\x00", b9Patience)
		return "", fmt.Errorf("secondary is gone before %q: %w; stderr:\n%s", fmt.Sprintf(format, args...), err, b9StackTop(h.Stderr()))
	}
	h.Send(format, args...)
	line, err := h.Next("> ", b9Patience)
	if err != nil {
		return "", fmt.Errorf("secondary did not answer %q: %w; stderr:\n%s", fmt.Sprintf(format, args...), err, b9StackTop(h.Stderr()))
	}
	return strings.TrimPrefix(line, "> "), nil
}

// b9Word is one header or process-table word a peer rewrites.
type b9Word struct {
	off   int64
	width int // 4 or 8
	val   uint64
}

// b9Scene is two regions with a gap between them, so that the MR made for
// a (the run of allocated pages around it) does not cover other, and a
// secondary that holds a key for a.
type b9Scene struct {
	a, alen, other uint64
	sec            *testproc.Proc
	slot           int
	key            uint32
}

func b9Two(t *testing.T, b *b9Inst) b9Scene {
	t.Helper()
	var sc b9Scene
	sc.a, sc.alen = b.alloc(1)
	gap, glen := b.alloc(1)
	sc.other, _ = b.alloc(1)
	require.Equal(t, "ok", b.must("free %d %d", gap, glen))
	sc.sec, sc.slot = b9Secondary(t, b.cfg)
	sc.key = parseKey(t, ask(t, sc.sec, "create %d", sc.a))
	return sc
}

// b9Drive runs an instance's normal operations after the attack words were
// written, stopping at the first sign that the primary died or hung; it
// asserts that the primary survives all of it and that no secondary
// serves a key for memory the primary freed.
func b9Drive(t *testing.T, attack func(b *b9Inst, secSlot int) string) {
	t0 := time.Now()
	b := b9Start(t)
	sc := b9Two(t, b)
	a, alen, bAddr, sec, slot, keyA := sc.a, sc.alen, sc.other, sc.sec, sc.slot, sc.key
	what := attack(b, slot)
	t.Logf("peer wrote: %s", what)

	step := func(desc string, ans string, err error) bool {
		t.Helper()
		if err != nil {
			assert.NoError(t, err, "after the peer wrote %s: %s", what, desc)
			return false
		}
		t.Logf("%-28s %s (%v)", desc+":", ans, time.Since(t0).Round(time.Millisecond))
		return true
	}
	primaryStep := func(format string, args ...any) (string, bool) {
		t.Helper()
		cmd := fmt.Sprintf(format, args...)
		ans, err := b.do("%s", cmd)
		return ans, step("primary "+strings.Fields(cmd)[0], ans, err)
	}
	// A secondary misses on memory no MR covers: the primary creates one.
	ans, err := secAsk(sec, "create %d", bAddr)
	if !step("secondary create", ans, err) {
		return
	}
	if _, ok := primaryStep("stats"); !ok {
		return
	}
	ans, err = secAsk(sec, "lookup %d", a)
	if !step("secondary lookup", ans, err) {
		return
	}
	// The primary frees memory a secondary holds a key for.
	freed, ok := primaryStep("free %d %d", a, alen)
	if !ok {
		return
	}
	if freed == "ok" {
		ans, err = secAsk(sec, "lookup %d", a)
		if step("lookup of freed memory", ans, err) {
			assert.False(t, strings.HasPrefix(ans, "key "),
				"after the peer wrote %s, a secondary serves a key for memory the primary freed: %s", what, ans)
		}
		ans, err = secAsk(sec, "validate %d %d", a, keyA)
		if step("old key, freed memory", ans, err) {
			assert.NotEqual(t, "ok", ans, "after the peer wrote %s, the device accepts the key of freed memory", what)
		}
	}
	for _, cmd := range []string{"alloc 1", "create %d", "dump", "pool b9 64 300000"} {
		if strings.Contains(cmd, "%d") {
			cmd = fmt.Sprintf(cmd, bAddr)
		}
		if _, ok := primaryStep("%s", cmd); !ok {
			return
		}
	}
	// A new secondary attaches, or refuses to, in bounded time.
	late := testproc.Start(t, "secondary", []string{b.cfg.Prefix, b.cfg.RuntimeDir})
	line, err := late.Next("", 15*time.Second)
	if !step("new secondary", line, err) {
		return
	}
	if strings.HasPrefix(line, "ready") {
		ans, err = secAsk(late, "create %d", bAddr)
		if !step("new secondary create", ans, err) {
			return
		}
	}
	late.End(5 * time.Second)
	if _, ok := primaryStep("stats"); !ok {
		return
	}
	primaryStep("close")
}

// b9Secondary starts a secondary helper and returns it with its
// process-table slot.
func b9Secondary(t *testing.T, cfg primary.Config) (*testproc.Proc, int) {
	t.Helper()
	h := testproc.Start(t, "secondary", []string{cfg.Prefix, cfg.RuntimeDir})
	line := h.Expect("ready", 0)
	var slot int
	_, err := fmt.Sscanf(line, "ready slot=%d", &slot)
	require.NoError(t, err, line)
	return h, slot
}

func (w b9Word) String() string { return fmt.Sprintf("%#x at +%d", w.val, w.off) }

// b9Put writes words (at fixed offsets) and returns what it wrote.
func b9Put(ws ...b9Word) func(b *b9Inst, _ int) string {
	return func(b *b9Inst, _ int) string {
		var s []string
		for _, w := range ws {
			if w.width == 4 {
				b.put32(w.off, uint32(w.val))
			} else {
				b.put64(w.off, w.val)
			}
			s = append(s, w.String())
		}
		return strings.Join(s, ", ")
	}
}

// b9Attack is one rewrite of the segment by a peer.
type b9Attack struct {
	name   string
	attack func(b *b9Inst, secSlot int) string
}

// b9Run runs each attack against an instance of its own.
func b9Run(t *testing.T, cases []b9Attack) {
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) { b9Drive(t, c.attack) })
	}
}

// The header's bounds: Size, MaxSize, PageSize. The primary's arena code
// (Alloc, Free, Grow) reads them on every call.
func TestBreaker9HeaderBounds(t *testing.T) {
	b9Run(t, []b9Attack{
		// limit() takes Size when it is below the file: every At past it
		// panics, the first in allocLocked's walk of the free list.
		{"Size lowered", b9Put(b9Word{b9Size, 8, 4096})},
		{"Size zeroed", b9Put(b9Word{b9Size, 8, 0})},
		{"Size raised past the mapping", b9Put(b9Word{b9Size, 8, 1 << 40})},
		{"Size raised to MaxSize", func(b *b9Inst, _ int) string {
			v := b.u64(b9MaxSize)
			b.put64(b9Size, v)
			return fmt.Sprintf("Size=MaxSize=%#x", v)
		}},
		// growLocked trusts MaxSize, not what this process mapped: the
		// arena grows past the mapping, and the first block carved there
		// is cleared through a Slice that panics.
		{"MaxSize raised, Size near the mapping's end", func(b *b9Inst, _ int) string {
			max := b.u64(b9MaxSize)
			b.put64(b9MaxSize, 1<<40)
			b.put64(b9Size, max-4096)
			return fmt.Sprintf("MaxSize=1<<40, Size=%#x (the mapping is %#x)", max-4096, max)
		}},
		{"MaxSize lowered", b9Put(b9Word{b9MaxSize, 8, 4096})},
		// growLocked rounds up to PageSize: a division by zero.
		{"PageSize zeroed", b9Put(b9Word{b9PageSize, 8, 0})},
		{"PageSize huge", b9Put(b9Word{b9PageSize, 8, 1 << 40})},
		{"PageSize odd", b9Put(b9Word{b9PageSize, 8, 3})},
	})
}

// The process table's place and length, fixed since 02649fa.
func TestBreaker9HeaderProcessTable(t *testing.T) {
	b9Run(t, []b9Attack{
		{"Slots raised", b9Put(b9Word{b9Slots, 4, 1 << 30})},
		{"Slots zeroed", b9Put(b9Word{b9Slots, 4, 0})},
		{"ProcsOff moved", b9Put(b9Word{b9ProcsOff, 8, 1 << 40})},
	})
}

// The arena's words.
func TestBreaker9HeaderArena(t *testing.T) {
	b9Run(t, []b9Attack{
		{"ArenaOff past the end", b9Put(b9Word{b9ArenaOff, 8, 1 << 40})},
		{"ArenaOff zeroed", b9Put(b9Word{b9ArenaOff, 8, 0})},
		// allocLocked follows ArenaFree through At, which panics outside
		// the segment or misaligned.
		{"ArenaFree past the end", b9Put(b9Word{b9ArenaFree, 8, 1 << 40})},
		{"ArenaFree misaligned", func(b *b9Inst, _ int) string {
			v := b.u64(b9ArenaFree) + 4
			b.put64(b9ArenaFree, v)
			return fmt.Sprintf("ArenaFree=%#x", v)
		}},
		{"ArenaFree zeroed", b9Put(b9Word{b9ArenaFree, 8, 0})},
		// (A free list that runs in a circle: TestBreaker9ArenaFreeCycle*.)
		// A free block the header's own words describe: At has no lower
		// bound, so the primary carves its next allocation out of the
		// header and clears it.
		{"ArenaFree into the header", b9Put(b9Word{b9ArenaFree, 8, 8})},
		// A free list that starts at a block in use: the primary carves
		// its next allocations out of live structures and clears them.
		{"ArenaFree at the global root's block", b9FreeAtRoot(1)},
		{"ArenaFree at the device's block", b9FreeAtRoot(2)},
		{"ArenaFree at the memory table's block", b9FreeAtRoot(0)},
		{"ArenaUsed and ArenaBlocks zeroed", b9Put(b9Word{b9ArenaUsed, 8, 0}, b9Word{b9ArenaBlocks, 8, 0})},
		{"ArenaUsed and ArenaBlocks huge", b9Put(b9Word{b9ArenaUsed, 8, 1<<64 - 1}, b9Word{b9ArenaBlocks, 8, 1<<64 - 1})},
	})
}

// b9FreeAtRoot points ArenaFree at the header of the arena block that
// holds root r.
func b9FreeAtRoot(r int64) func(b *b9Inst, _ int) string {
	return func(b *b9Inst, _ int) string {
		v := b.u64(b9Roots+8*r) - 16
		b.put64(b9ArenaFree, v)
		return fmt.Sprintf("ArenaFree=%#x (Roots[%d]-16)", v, r)
	}
}

// Registered locks and roots.
func TestBreaker9HeaderLocksAndRoots(t *testing.T) {
	var cases []b9Attack
	for _, v := range []uint64{0, 8, 1 << 40} {
		cases = append(cases, b9Attack{fmt.Sprintf("Locks[0]=%#x", v), b9Put(b9Word{b9Locks, 8, v})})
	}
	cases = append(cases, b9Attack{"Locks[1..7] garbage", func(b *b9Inst, _ int) string {
		for i := int64(1); i < 8; i++ {
			b.put64(b9Locks+8*i, uint64(4096+64*i))
		}
		return "Locks[i]=0x1000+64*i (the process table), i=1..7"
	}})
	cases = append(cases, b9Attack{"Locks[1] = the global root", func(b *b9Inst, _ int) string {
		v := b.u64(b9Roots + 8*1)
		b.put64(b9Locks+8, v)
		return fmt.Sprintf("Locks[1]=%#x (Roots[RootCache])", v)
	}})
	for r, name := range []string{"Memory", "Cache", "Device", "Pools", "Stats"} {
		for _, v := range []uint64{0, 8, 1 << 40} {
			cases = append(cases, b9Attack{fmt.Sprintf("Roots[%s]=%#x", name, v), b9Put(b9Word{b9Roots + 8*int64(r), 8, v})})
		}
	}
	cases = append(cases, b9Attack{"Roots swapped", func(b *b9Inst, _ int) string {
		c, d := b.u64(b9Roots+8), b.u64(b9Roots+16)
		b.put64(b9Roots+8, d)
		b.put64(b9Roots+16, c)
		return "Roots[RootCache] <-> Roots[RootDevice]"
	}})
	b9Run(t, cases)
}

// Identity and state words.
func TestBreaker9HeaderIdentity(t *testing.T) {
	b9Run(t, []b9Attack{
		{"State dead", b9Put(b9Word{b9State, 4, 3})},
		{"State initializing", b9Put(b9Word{b9State, 4, 1})},
		{"State garbage", b9Put(b9Word{b9State, 4, 99})},
		{"Magic garbage", b9Put(b9Word{b9Magic, 8, 1})},
		{"Version garbage", b9Put(b9Word{b9Version, 4, 99})},
		{"Layout garbage", b9Put(b9Word{b9Layout, 4, 1})},
		{"CreatorPID 1", b9Put(b9Word{b9CreatorPID, 4, 1})},
	})
}

// maps reports whether process pid maps addr from a memseg list file of
// the instance.
func (b *b9Inst) maps(pid int, addr uint64) bool {
	b.t.Helper()
	maps, err := os.ReadFile(fmt.Sprintf("/proc/%d/maps", pid))
	require.NoError(b.t, err)
	for _, l := range strings.Split(string(maps), "\n") {
		f := strings.Fields(l)
		if len(f) < 6 || !strings.Contains(f[5], "mpmr."+b.name+".msl") {
			continue
		}
		var lo, hi uint64
		if _, err := fmt.Sscanf(f[0], "%x-%x", &lo, &hi); err == nil && lo <= addr && addr < hi {
			return true
		}
	}
	return false
}

func (b *b9Inst) quarantined() (pages, fenced int) {
	b.t.Helper()
	ans := b.must("quarantined")
	_, err := fmt.Sscanf(ans, "quarantined %d fenced %d", &pages, &fenced)
	require.NoError(b.t, err, ans)
	return pages, fenced
}

// The quarantine: a secondary that is alive but does not follow a free
// (stopped here) is fenced, and the pages freed wait until it is dead or
// reaches no backing file any more. Its slot's Epoch, State and Unmapped
// words can be rewritten by any peer; none of them may end the wait, or
// keep the primary from fencing it, while the stopped secondary still maps
// the page: what it writes when it resumes would land in someone else's
// buffer.
func TestBreaker9SlotWordsDoNotReleaseQuarantine(t *testing.T) {
	for _, c := range []struct {
		name   string
		before bool // written before the free, not after it
		attack func(b *b9Inst, slot int) string
	}{
		{"Unmapped set after the fence", false, func(b *b9Inst, slot int) string {
			at := int64(b9Table + b9SlotSize*slot)
			e := b.u32(at + b9SlotEpoch)
			b.put32(at+b9SlotUnmapped, e)
			return fmt.Sprintf("slot %d Unmapped=%d (its epoch)", slot, e)
		}},
		{"State free after the fence", false, func(b *b9Inst, slot int) string {
			b.put32(int64(b9Table+b9SlotSize*slot+b9SlotState), 0)
			return fmt.Sprintf("slot %d State=free", slot)
		}},
		{"Epoch bumped after the fence", false, func(b *b9Inst, slot int) string {
			at := int64(b9Table + b9SlotSize*slot + b9SlotEpoch)
			e := b.u32(at)
			b.put32(at, e+1)
			return fmt.Sprintf("slot %d Epoch=%d", slot, e+1)
		}},
		// The primary then takes the stalled secondary's missing answer
		// for a death ("its mappings went with it"): no fence, no
		// quarantine at all.
		{"Epoch bumped before the free", true, func(b *b9Inst, slot int) string {
			at := int64(b9Table + b9SlotSize*slot + b9SlotEpoch)
			e := b.u32(at)
			b.put32(at, e+1)
			return fmt.Sprintf("slot %d Epoch=%d", slot, e+1)
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			b := b9Start(t)
			a, alen := b.alloc(1)
			victim, slot := b9Secondary(t, b.cfg)
			parseKey(t, ask(t, victim, "create %d", a))
			require.True(t, b.maps(victim.PID(), a), "the secondary maps the page")
			if c.before {
				t.Logf("peer wrote %s", c.attack(b, slot))
			}
			victim.Stop()
			// The free waits SyncTimeout for the stopped secondary, then
			// goes on without it.
			require.Equal(t, "ok", b.must("free %d %d", a, alen))
			q, fenced := b.quarantined()
			t.Logf("after the free: %d pages quarantined, %d secondaries fenced", q, fenced)
			if !c.before {
				require.Equal(t, 1, q, "the freed page waits for the stopped secondary")
				t.Logf("peer wrote %s", c.attack(b, slot))
			}
			// A housekeeping pass, then Alloc (which returns what
			// quarantine no longer holds first).
			b.must("release")
			again, _ := b.alloc(1)
			stillMaps := b.maps(victim.PID(), a)
			assert.False(t, again == a && stillMaps,
				"the primary handed page 0x%x out again while the stopped secondary (pid %d) still maps it", a, victim.PID())
			q, _ = b.quarantined()
			assert.Equal(t, 1, q, "pages in quarantine while their holder lives and maps them")
		})
	}
}

// b9Tool builds cmd/mpmr into the test's temporary directory (with the
// race detector, whose packages the test build left in the cache: it takes
// a second) and returns its path.
func b9Tool(t *testing.T) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "mpmr")
	out, err := exec.Command("go", "build", "-race", "-o", path, "github.com/mpmr/mpmr/cmd/mpmr").CombinedOutput()
	require.NoError(t, err, "go build cmd/mpmr:\n%s", out)
	return path
}

// runTool runs the mpmr tool against the instance and returns its exit
// status and output; it fails the test if the tool crashed or did not end
// within b9Patience.
func (b *b9Inst) runTool(tool string, args ...string) (int, string) {
	b.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), b9Patience)
	defer cancel()
	cmd := exec.CommandContext(ctx, tool, append([]string{"-rundir", b.cfg.RuntimeDir}, args...)...)
	cmd.Env = append(os.Environ(), testproc.QuickRaceExit())
	var out, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &stderr
	err := cmd.Run()
	code := cmd.ProcessState.ExitCode()
	all := out.String() + stderr.String()
	crashed := strings.Contains(stderr.String(), "panic:") || strings.Contains(stderr.String(), "fatal error:") ||
		strings.Contains(stderr.String(), "SIGSEGV") || strings.Contains(stderr.String(), "SIGBUS")
	assert.False(b.t, crashed, "mpmr %v crashed (%v):\n%s", args, err, b9StackTop(stderr.String()))
	assert.NoError(b.t, ctx.Err(), "mpmr %v did not end within %v", args, b9Patience)
	return code, all
}

// cmd/mpmr maps the segment read-only and reads what its words say: with
// a header a peer rewrote, each command ends with an answer or an error,
// and clean refuses an instance whose primary lives, whatever the header
// claims.
func TestBreaker9ToolOnRewrittenHeader(t *testing.T) {
	tool := b9Tool(t)
	for _, c := range []b9Attack{
		// Size above the arena's start but below everything the
		// primary put there: the header still validates.
		{"Size lowered past the arena", func(b *b9Inst, _ int) string {
			v := (b.u64(b9ArenaOff)/4096 + 1) * 4096
			b.put64(b9Size, v)
			return fmt.Sprintf("Size=%#x", v)
		}},
		{"Locks[0] into the header", b9Put(b9Word{b9Locks, 8, 64})},
		{"Locks[0] at the device", func(b *b9Inst, _ int) string {
			v := b.u64(b9Roots + 16)
			b.put64(b9Locks, v)
			return fmt.Sprintf("Locks[0]=%#x (the device's header: its words are read as the lock's)", v)
		}},
		{"Roots[Memory] into the header", b9Put(b9Word{b9Roots, 8, 128})},
		{"Roots[Cache] at the device", func(b *b9Inst, _ int) string {
			v := b.u64(b9Roots + 16)
			b.put64(b9Roots+8, v)
			return fmt.Sprintf("Roots[RootCache]=%#x (the device's)", v)
		}},
		{"ArenaFree a cycle in the header", b9Put(b9Word{b9Roots + 8*8, 8, 0}, b9Word{b9Roots + 10*8, 8, b9Roots + 8*8},
			b9Word{b9ArenaFree, 8, b9Roots + 8*8})},
		{"ArenaBlocks zeroed", b9Put(b9Word{b9ArenaBlocks, 8, 0})},
		{"ArenaBlocks huge", b9Put(b9Word{b9ArenaBlocks, 8, 1<<64 - 1})},
		{"State dead, CreatorPID 1", b9Put(b9Word{b9State, 4, 3}, b9Word{b9CreatorPID, 4, 1})},
	} {
		t.Run(c.name, func(t *testing.T) {
			b := b9Start(t)
			a, _ := b.alloc(1)
			sec, slot := b9Secondary(t, b.cfg)
			parseKey(t, ask(t, sec, "create %d", a))
			orig := b.read(0, 512)
			t.Logf("peer wrote %s", c.attack(b, slot))
			for _, args := range [][]string{{"ls"}, {"dump", b.cfg.Prefix}, {"-json", "dump", b.cfg.Prefix},
				{"stats", b.cfg.Prefix}} {
				code, out := b.runTool(tool, args...)
				t.Logf("mpmr %v: exit %d\n%.400s", args, code, out)
			}
			code, out := b.runTool(tool, "clean", b.cfg.Prefix)
			assert.Equal(t, 1, code, "mpmr clean of a live instance:\n%s", out)
			// The words back as they were (the primary's own troubles with
			// them are the other tests'): it still serves.
			b.write(0, orig)
			assert.True(t, b.survives("mpmr ran"))
		})
	}
}

// A peer that keeps rewriting Size (between its value and one that still
// passes the header's validation) while an operator runs mpmr dump: the
// tool checks each offset once and then reads through At and Slice, which
// must not come to another answer because Size changed in between.
func TestBreaker9ToolSurvivesRacingSizeWrites(t *testing.T) {
	tool := b9Tool(t)
	b := b9Start(t)
	a, _ := b.alloc(1)
	sec, _ := b9Secondary(t, b.cfg)
	parseKey(t, ask(t, sec, "create %d", a))
	real := b.u64(b9Size)
	low := (b.u64(b9ArenaOff)/4096 + 1) * 4096
	f, err := os.OpenFile(b.seg, os.O_RDWR, 0)
	require.NoError(t, err)
	defer f.Close()
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		hi, lo := binary.LittleEndian.AppendUint64(nil, real), binary.LittleEndian.AppendUint64(nil, low)
		for {
			select {
			case <-stop:
				_, _ = f.WriteAt(hi, b9Size)
				return
			default:
			}
			_, _ = f.WriteAt(lo, b9Size)
			_, _ = f.WriteAt(hi, b9Size)
		}
	}()
	crashed := 0
	deadline := time.Now().Add(4 * time.Second)
	runs := 0
	for ; time.Now().Before(deadline) && crashed == 0; runs++ {
		before := b.t.Failed()
		b.runTool(tool, "dump", b.cfg.Prefix)
		if !before && b.t.Failed() {
			crashed++
		}
	}
	close(stop)
	<-done
	t.Logf("%d runs of mpmr dump while a peer flipped Size between %#x and %#x", runs, real, low)
}

// ArenaFree pointing into the header: the primary's next allocation must
// not be carved out of the header (which would overwrite Version,
// MaxSize, the registered locks and the roots, and turn every later
// attach away).
func TestBreaker9ArenaFreeInHeaderLeavesHeaderAlone(t *testing.T) {
	b := b9Start(t)
	sc := b9Two(t, b)
	sec, other := sc.sec, sc.other
	before := b.read(0, 512)
	b.put64(b9ArenaFree, 8)
	ans, err := secAsk(sec, "create %d", other)
	require.NoError(t, err)
	t.Logf("secondary create: %s", ans)
	require.True(t, b.survives("ArenaFree=8"))
	after := b.read(0, 512)
	for _, f := range []struct {
		name     string
		off, len int
	}{{"Magic..PageSize", 0, 64}, {"ProcsOff, ArenaOff", 64, 16}, {"Locks, Roots", 104, 192}} {
		assert.Equal(t, before[f.off:f.off+f.len], after[f.off:f.off+f.len],
			"the primary itself rewrote the header's %s after a peer pointed ArenaFree at the header", f.name)
	}
	late := testproc.Start(t, "secondary", []string{b.cfg.Prefix, b.cfg.RuntimeDir})
	line, err := late.Next("", 15*time.Second)
	require.NoError(t, err)
	t.Logf("a new secondary: %s", line)
}

// A free "block" in the header's unused roots whose next is itself: a
// walk of the segment's free list would never end. Close, which frees
// every MR record, must not walk it.
func TestBreaker9ArenaFreeCycleDoesNotHangClose(t *testing.T) {
	b := b9Start(t)
	a, _ := b.alloc(1)
	sec, _ := b9Secondary(t, b.cfg)
	parseKey(t, ask(t, sec, "create %d", a))
	b9Put(b9Word{b9Roots + 8*8, 8, 0}, b9Word{b9Roots + 10*8, 8, b9Roots + 8*8}, b9Word{b9ArenaFree, 8, b9Roots + 8*8})(b, 0)
	_, err := b.do("close")
	require.NoError(t, err, "Close after a peer made the free list a cycle, before any allocation")
}

// The same cycle met by a secondary's MR creation first: the create is
// answered, and the primary's next free of data memory completes.
func TestBreaker9ArenaFreeCycleDoesNotHangFree(t *testing.T) {
	b := b9Start(t)
	sc := b9Two(t, b)
	a, alen, sec, other := sc.a, sc.alen, sc.sec, sc.other
	b9Put(b9Word{b9Roots + 8*8, 8, 0}, b9Word{b9Roots + 10*8, 8, b9Roots + 8*8}, b9Word{b9ArenaFree, 8, b9Roots + 8*8})(b, 0)
	ans, err := secAsk(sec, "create %d", other)
	require.NoError(t, err)
	t.Logf("secondary create: %s", ans)
	_, err = b.do("free %d %d", a, alen)
	require.NoError(t, err, "the primary's Free after a peer made the free list a cycle")
}

// ArenaFree at the arena block of the global cache's root: the primary's
// next allocation (an MR record, for a secondary's create) must not be
// carved out of the root, which would empty the MR list, so that the next
// Free found no MR to invalidate and the device kept accepting the key
// of freed memory (on real hardware, the NIC would go on writing there).
func TestBreaker9ArenaFreeAtGlobalRootRevokesFreedKey(t *testing.T) {
	b := b9Start(t)
	sc := b9Two(t, b)
	a, alen, sec, other, key := sc.a, sc.alen, sc.sec, sc.other, sc.key
	t.Logf("peer wrote %s", b9FreeAtRoot(1)(b, 0))
	ans, err := secAsk(sec, "create %d", other)
	require.NoError(t, err)
	t.Logf("secondary create: %s", ans)
	ans, err = b.do("free %d %d", a, alen)
	require.NoError(t, err)
	require.Equal(t, "ok", ans, "the primary frees the memory")
	ans, err = secAsk(sec, "validate %d %d", a, key)
	require.NoError(t, err)
	assert.NotEqual(t, "ok", ans, "the device accepts key %d for [0x%x, +0x%x), which the primary freed", key, a, alen)
}

// A peer sets the Fenced word of the primary's own slot: the primary
// follows its own changes, so nothing it frees may wait in quarantine for
// it (for as long as it ran, never handed to Alloc again).
func TestBreaker9FencedPrimarySlotQuarantinesNothing(t *testing.T) {
	b := b9Start(t)
	a, alen := b.alloc(1)
	sec, _ := b9Secondary(t, b.cfg)
	parseKey(t, ask(t, sec, "create %d", a))
	primarySlot := -1
	for i := 0; i < 64; i++ {
		at := int64(b9Table + b9SlotSize*i)
		if b.u32(at+4) == 1 && b.u32(at+b9SlotState) == 1 { // RolePrimary, live
			primarySlot = i
		}
	}
	require.GreaterOrEqual(t, primarySlot, 0)
	at := int64(b9Table + b9SlotSize*primarySlot)
	b.put32(at+b9SlotFenced, b.u32(at+b9SlotEpoch))
	require.Equal(t, "ok", b.must("free %d %d", a, alen))
	b.must("release")
	b.alloc(1)
	q, _ := b.quarantined()
	assert.Zero(t, q, "pages quarantined for the primary itself, after a peer set Fenced in slot %d", primarySlot)
}

// Size lowered to a value the header's validation still accepts (past
// the process table, short of everything the primary allocated): the
// secondaries already attached and those attaching meet offsets outside
// the bounds. They answer or refuse; none crashes.
func TestBreaker9SizeLoweredSecondaries(t *testing.T) {
	b := b9Start(t)
	a, _ := b.alloc(1)
	sec, _ := b9Secondary(t, b.cfg)
	key := parseKey(t, ask(t, sec, "create %d", a))
	real := b.u64(b9Size)
	low := (b.u64(b9ArenaOff)/4096 + 1) * 4096
	b.put64(b9Size, low)
	for _, cmd := range []string{fmt.Sprintf("lookup %d", a), fmt.Sprintf("lookup %d", a+b.page/2),
		fmt.Sprintf("validate %d %d", a, key), "stats", fmt.Sprintf("read %d", a)} {
		ans, err := secAsk(sec, "%s", cmd)
		require.NoError(t, err, "Size=%#x", low)
		t.Logf("secondary %s: %s", cmd, ans)
	}
	late := testproc.Start(t, "secondary", []string{b.cfg.Prefix, b.cfg.RuntimeDir})
	line, err := late.Next("", 15*time.Second)
	require.NoError(t, err, "a secondary attaching with Size=%#x; stderr:\n%s", low, b9StackTop(late.Stderr()))
	t.Logf("new secondary: %s", line)
	assert.NotContains(t, late.Stderr(), "panic:")
	b.put64(b9Size, real)
	assert.True(t, b.survives("Size restored"))
}
