package main

import (
	"fmt"
	"io"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/mpmr/mpmr/cache"
	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/shm"
	"github.com/mpmr/mpmr/verbs"
)

var cmdDump = &command{
	name:    "dump",
	args:    "PREFIX",
	nargs:   1,
	summary: "print an instance's shared state",
	help: `
Prints the shared state of instance PREFIX, live or dead: the segment
header; the process table (pid, role, live = the slot is claimed, alive =
the kernel still holds the claimant's lock, epoch); the global lock
(writer slot and whether it is alive, readers per slot, inconsistent or
unrecoverable, sequence count); the generation dev_gen and the global
cache's counters; the memseg lists (base, page size, capacity, allocated,
free, file); the MR list with each MR's chunks and keys; the global lookup
table; the MRs on the free list; the soft device's MRs; the mempools; and
the segment arena's use.

The segment is mapped read-only and no slot is claimed; no lock is taken.
The global cache is read optimistically and retried while writers get in
the way; if a writer stays in, or died holding the lock (then the lock is
shown as held by a dead owner), the cache part is a best-effort snapshot
and says so. The -json output has the fields of the runtime's
primary.Dump (processes, lock, memory, cache, device_mrs, pools) and more.`,
	run: runDump,
}

// dumpOut is what dump prints; its JSON has primary.Dump's fields and
// more.
type dumpOut struct {
	Instance  lsEntry            `json:"instance"`
	Segment   shm.Info           `json:"segment"`
	Processes []shm.Proc         `json:"processes"`
	Lock      shm.LockState      `json:"lock"`
	Writer    *writerOut         `json:"lock_writer,omitempty"`
	Memory    []hugetlb.ListInfo `json:"memory"`
	Cache     cache.Dump         `json:"cache"`
	// Consistent: the cache part was read while no writer held the lock.
	Consistent  bool             `json:"consistent"`
	Device      []verbs.MR       `json:"device_mrs"`
	DeviceStats *verbs.SoftStats `json:"device_stats,omitempty"`
	Pools       []cache.PoolInfo `json:"pools"`
	Arena       shm.ArenaStats   `json:"arena"`
	Errors      []string         `json:"errors,omitempty"`
}

// writerOut is the process in the global lock's writer word.
type writerOut struct {
	Slot  int  `json:"slot"`
	PID   int  `json:"pid"`
	Alive bool `json:"alive"`
}

func runDump(e *env, args []string) error {
	d, err := answered(args[0], e.patience, func() (*dumpOut, error) {
		t, err := e.target(args[0])
		if err != nil {
			return nil, err
		}
		return collectDump(e, t)
	})
	if err != nil {
		return err
	}
	if e.json {
		err = e.printJSON(d)
	} else {
		err = d.print(e.stdout)
	}
	if err == nil && len(d.Errors) > 0 {
		err = fmt.Errorf("%d part(s) could not be read: %s", len(d.Errors), strings.Join(d.Errors, "; "))
	}
	return err
}

// collectDump reads everything dump shows. A part that cannot be read is
// noted in Errors and the rest still read.
func collectDump(e *env, t *target) (*dumpOut, error) {
	defer t.release()
	seg, info, err := t.open(e)
	if err != nil {
		return nil, err
	}
	defer seg.Close()
	d := &dumpOut{Instance: describeTarget(e, t), Segment: info, Processes: seg.Procs()}
	d.Instance.Errors = nil // reported below, part by part
	fail := func(part string, err error) { d.Errors = append(d.Errors, part+": "+err.Error()) }

	if d.Memory, err = hugetlb.Describe(seg); err != nil {
		fail("memseg lists", err)
	}
	pk, err := cache.PeekGlobal(seg, e.patience)
	d.Cache, d.Lock, d.Consistent = pk.Dump, pk.Lock, pk.Consistent
	if err != nil {
		fail("global cache", err)
	}
	if d.Lock.Offset == 0 { // not even the lock could be read
		d.Lock.WriterSlot = -1
	}
	if w := d.Lock.WriterSlot; w >= 0 && w < seg.Slots() {
		p := seg.Proc(w)
		// Alive only if the writer's own claim of the slot lives: a later
		// claimant of the slot is somebody else.
		d.Writer = &writerOut{Slot: w, PID: p.PID, Alive: seg.AliveAs(w, d.Lock.WriterEpoch)}
	}
	if dev, err := verbs.AttachSoft(seg); err != nil {
		fail("soft device", err)
	} else {
		d.Device = dev.MRs()
		st := dev.Stats()
		d.DeviceStats = &st
		dev.Close()
	}
	d.Pools = cache.Pools(seg)
	d.Arena = seg.ArenaStats()
	// Empty lists print as [], never null.
	d.Processes, d.Memory, d.Device, d.Pools = orEmpty(d.Processes), orEmpty(d.Memory), orEmpty(d.Device), orEmpty(d.Pools)
	return d, nil
}

// orEmpty returns s, or an empty slice for nil.
func orEmpty[T any](s []T) []T {
	if s == nil {
		return []T{}
	}
	return s
}

func (d *dumpOut) print(out io.Writer) error {
	w := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	in := d.Instance
	fmt.Fprintf(w, "INSTANCE %s: %s", in.Prefix, in.State)
	if in.PID != 0 {
		fmt.Fprintf(w, ", primary pid %d", in.PID)
	}
	if in.Backend != "" {
		fmt.Fprintf(w, ", %s at %s, %s pages", in.Backend, in.BackendDir, size(in.PageSize))
	}
	fmt.Fprintln(w)
	s := d.Segment
	fmt.Fprintf(w, "runtime dir\t%s\n", in.RuntimeDir)
	fmt.Fprintf(w, "segment\t%s: %s, %s used of %s, %d slots, created by pid %d\n",
		s.Path, s.State, size(s.Size), size(s.MaxSize), s.Slots, s.CreatorPID)

	section(w, "PROCESSES (%d)", len(d.Processes))
	fmt.Fprintln(w, "SLOT\tPID\tROLE\tLIVE\tALIVE\tEPOCH\tUID")
	for _, p := range d.Processes {
		fmt.Fprintf(w, "%d\t%d\t%s\t%s\t%s\t%d\t%d\n", p.Slot, p.PID, p.Role, yesNo(p.Live), yesNo(p.Alive), p.Epoch, p.UID)
	}

	l := d.Lock
	section(w, "GLOBAL LOCK at 0x%x", l.Offset)
	switch {
	case l.Offset == 0:
		fmt.Fprintln(w, "writer\tunknown: the lock could not be read (see ERRORS)")
	case l.NotRecoverable:
		fmt.Fprintln(w, "writer\tnone: NOT RECOVERABLE (a repair was abandoned; the lock can never be taken again)")
	case d.Writer == nil:
		fmt.Fprintln(w, "writer\tnone")
	case d.Writer.Alive:
		fmt.Fprintf(w, "writer\tslot %d (pid %d, alive)\n", d.Writer.Slot, d.Writer.PID)
	default:
		fmt.Fprintf(w, "writer\tslot %d (pid %d) HELD BY A DEAD OWNER: the next writer recovers it\n", d.Writer.Slot, d.Writer.PID)
	}
	fmt.Fprintf(w, "readers\t%s\n", d.readers())
	fmt.Fprintf(w, "inconsistent\t%s\n", yesNo(l.Inconsistent))
	fmt.Fprintf(w, "seq\t%d (%s)\n", l.Seq, map[bool]string{true: "odd: a writer is in", false: "even: no writer"}[l.Seq&1 == 1])
	fmt.Fprintf(w, "waiters\t%d\n", l.Waiters)

	c := d.Cache
	st := c.Stats
	section(w, "GLOBAL CACHE")
	fmt.Fprintf(w, "dev_gen\t%d\n", c.DevGen)
	fmt.Fprintf(w, "MRs\t%d registered, %d on the free list\n", st.MRs, st.FreeMRs)
	fmt.Fprintf(w, "table\t%d of %d entries%s\n", len(c.Table), c.TableSize, map[bool]string{true: ", OVERFLOWED", false: ""}[c.Overflowed])
	fmt.Fprintf(w, "counters\t%d creates, %d rebuilds, %d expansions, %d invalidations\n", st.Creates, st.Rebuilds, st.Expansions, st.Invalidations)
	switch {
	case d.Consistent:
		fmt.Fprintln(w, "snapshot\tconsistent (read while no writer held the lock)")
	case d.Writer != nil && !d.Writer.Alive || l.NotRecoverable:
		fmt.Fprintln(w, "snapshot\tBEST EFFORT: the writer died holding the lock; its update may be half done")
	default:
		fmt.Fprintln(w, "snapshot\tBEST EFFORT: a writer held the lock throughout the read; lists and table may disagree")
	}

	section(w, "MEMSEG LISTS (%d)", len(d.Memory))
	fmt.Fprintln(w, "LIST\tBASE\tEND\tPAGE\tCAPACITY\tALLOCATED\tFREE\tLARGEST FREE\tBACKEND\tFILE")
	for _, m := range d.Memory {
		fmt.Fprintf(w, "%d\t0x%x\t0x%x\t%s\t%d\t%d (%s)\t%d\t%d\t%s\t%s\n", m.Index, m.Base, m.End, size(m.PageSize),
			m.Capacity, m.Allocated, size(m.AllocatedBytes), m.Free, m.LargestFree, m.Backend, m.File)
	}

	section(w, "MRS (%d)", len(c.MRs))
	printMRs(w, c.MRs)

	section(w, "GLOBAL TABLE (%d of %d)", len(c.Table), c.TableSize)
	fmt.Fprintln(w, "INDEX\tSTART\tEND\tLEN\tLKEY")
	for i, t := range c.Table {
		fmt.Fprintf(w, "%d\t0x%x\t0x%x\t%s\t0x%x\n", i+1, t.Start, t.End, size(t.End-t.Start), t.LKey)
	}

	section(w, "FREE-LIST MRS (%d): emptied, waiting to be deregistered", len(c.FreeMRs))
	printMRs(w, c.FreeMRs)

	if ds := d.DeviceStats; ds != nil {
		section(w, "SOFT DEVICE MRS (%d of %d slots): %d registrations, %d deregistrations, %s pinned, %d unpinned",
			len(d.Device), ds.MaxMRs, ds.Registrations, ds.Deregistrations, size(ds.PinnedBytes), ds.UnpinnedMRs)
	} else {
		section(w, "SOFT DEVICE MRS")
	}
	fmt.Fprintln(w, "HANDLE\tADDR\tEND\tLEN\tLKEY\tRKEY\tACCESS")
	for _, m := range d.Device {
		fmt.Fprintf(w, "%d\t0x%x\t0x%x\t%s\t0x%x\t0x%x\t%s\n", m.Handle, m.Addr, m.Addr+m.Len, size(uint64(m.Len)), m.LKey, m.RKey, m.Access)
	}

	section(w, "MEMPOOLS (%d)", len(d.Pools))
	fmt.Fprintln(w, "NAME\tBASE\tOBJECT\tCOUNT\tIN USE")
	for _, p := range d.Pools {
		fmt.Fprintf(w, "%s\t0x%x\t%s\t%d\t%d\n", p.Name, p.Base, size(p.ObjSize), p.Count, p.InUse)
	}

	a := d.Arena
	section(w, "ARENA [0x%x, 0x%x)", a.Start, a.End)
	fmt.Fprintf(w, "used\t%s in %d blocks\n", size(a.UsedBytes), a.Blocks)
	fmt.Fprintf(w, "free\t%s in %d blocks, largest %s\n", size(a.FreeBytes), a.FreeBlocks, size(a.LargestFree))

	if len(d.Errors) > 0 {
		section(w, "ERRORS")
		for _, msg := range d.Errors {
			fmt.Fprintln(w, msg)
		}
	}
	fmt.Fprintf(w, "\n(read at %s; the segment was mapped read-only, no slot claimed, no lock taken)\n", time.Now().Format(time.DateTime))
	return w.Flush()
}

func section(w io.Writer, format string, args ...any) {
	fmt.Fprintf(w, "\n"+format+"\n", args...)
}

// readers describes the lock's read holds by slot.
func (d *dumpOut) readers() string {
	if len(d.Lock.Readers) == 0 {
		return "none"
	}
	alive := map[int]shm.Proc{}
	for _, p := range d.Processes {
		alive[p.Slot] = p
	}
	slots := make([]int, 0, len(d.Lock.Readers))
	for s := range d.Lock.Readers {
		slots = append(slots, s)
	}
	sort.Ints(slots)
	var parts []string
	for _, s := range slots {
		p, ok := alive[s]
		who := "dead: discarded by the next writer"
		if ok && p.Alive {
			who = fmt.Sprintf("pid %d", p.PID)
		}
		parts = append(parts, fmt.Sprintf("slot %d holds %d (%s)", s, d.Lock.Readers[s], who))
	}
	return strings.Join(parts, ", ")
}

func printMRs(w io.Writer, mrs []cache.MRInfo) {
	fmt.Fprintln(w, "OFFSET\tLIST\tSTART\tEND\tLEN\tPAGES\tLKEY\tRKEY")
	for _, m := range mrs {
		list := fmt.Sprint(m.List)
		pages := fmt.Sprintf("%d of %d", m.PagesSet, m.BitmapLen)
		if m.List < 0 {
			list, pages = "external", "-"
		}
		fmt.Fprintf(w, "0x%x\t%s\t0x%x\t0x%x\t%s\t%s\t0x%x\t0x%x\n", m.Offset, list, m.Start, m.Start+m.Len,
			size(m.Len), pages, m.LKey, m.RKey)
		for _, ch := range m.Chunks {
			fmt.Fprintf(w, "\t  chunk\t0x%x\t0x%x\t%s\t\t0x%x\t\n", ch.Start, ch.End, size(ch.End-ch.Start), ch.LKey)
		}
	}
}

func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "no"
}

// size prints a byte count in a binary unit, with one decimal when it does
// not divide evenly.
func size(n uint64) string {
	s := hugetlb.FormatSize(n)
	if !strings.HasSuffix(s, " B") || n < 1<<10 {
		return s
	}
	units := []string{"KiB", "MiB", "GiB", "TiB"}
	v, u := float64(n)/1024, 0
	for v >= 1024 && u < len(units)-1 {
		v /= 1024
		u++
	}
	return fmt.Sprintf("%.1f %s", v, units[u])
}
