package main

import (
	"fmt"
	"text/tabwriter"
	"time"

	"github.com/mpmr/mpmr/hugetlb"
)

var cmdLs = &command{
	name:    "ls",
	summary: "list the instances under the runtime directory",
	help: `
Lists every instance whose runtime directory is under the runtime directory
(-rundir, or the runtimes' default). For each: its prefix; live (a process
holds the instance's primary lock) or dead (files are left but no primary
holds the lock, e.g. it was killed: see "mpmr clean"); the primary's pid;
the backend and its page size; the data memory in use (allocated pages of
the memseg lists, read from the control segment); and how many processes
are attached (alive in the process table). Nothing is locked or mapped
writable; no slot is claimed.`,
	run: runLs,
}

// lsEntry is one instance, as ls -json prints it.
type lsEntry struct {
	Prefix      string    `json:"prefix"`
	State       string    `json:"state"` // live, dead, unknown
	Live        bool      `json:"live"`
	RuntimeDir  string    `json:"runtime_dir"`
	UID         int       `json:"uid"` // the instance's user: its runtime directory's owner
	PID         int       `json:"pid,omitempty"`
	Backend     string    `json:"backend,omitempty"`
	BackendDir  string    `json:"backend_dir,omitempty"`
	PageSize    uint64    `json:"page_size,omitempty"`
	Segment     string    `json:"segment,omitempty"`
	Created     time.Time `json:"created,omitzero"`
	Lists       int       `json:"memseg_lists"`
	Capacity    uint64    `json:"capacity_bytes"`
	Pages       int       `json:"allocated_pages"`
	Bytes       uint64    `json:"allocated_bytes"`
	Processes   int       `json:"processes"`    // alive in the process table
	SegmentDead bool      `json:"segment_dead"` // the header says the instance ended
	Errors      []string  `json:"errors,omitempty"`
}

func runLs(e *env, _ []string) error {
	root, ts, err := e.targets()
	if err != nil {
		return err
	}
	out := make([]lsEntry, 0, len(ts))
	for _, t := range ts {
		tc := *t // the caller's is not touched if the files do not answer
		x, err := answered(t.Dir, 0, func() (lsEntry, error) {
			defer tc.release()
			return describeTarget(e, &tc), nil
		})
		if err != nil {
			x = lsEntry{Prefix: t.Prefix, State: "unknown", RuntimeDir: t.Dir, UID: t.UID, Errors: []string{err.Error()}}
		}
		out = append(out, x)
	}
	if e.json {
		return e.printJSON(out)
	}
	if len(out) == 0 {
		fmt.Fprintf(e.stdout, "no instances under %s\n", root)
		return nil
	}
	w := tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(w, "PREFIX\tSTATE\tUID\tPID\tBACKEND\tPAGE\tIN USE\tPROCS\tCREATED")
	for _, x := range out {
		page, inUse, procs, created := "-", "-", "-", "-"
		if x.PageSize != 0 {
			page = size(x.PageSize)
		}
		if x.Lists > 0 {
			inUse = fmt.Sprintf("%d pages (%s)", x.Pages, size(x.Bytes))
		}
		if x.Segment != "" && len(x.Errors) == 0 {
			procs = fmt.Sprint(x.Processes)
		}
		if !x.Created.IsZero() {
			created = x.Created.Local().Format(time.DateTime)
		}
		fmt.Fprintf(w, "%s\t%s\t%d\t%s\t%s\t%s\t%s\t%s\t%s\n", x.Prefix, x.State, x.UID, orDash(x.PID),
			orDashS(x.Backend), page, inUse, procs, created)
	}
	if err := w.Flush(); err != nil {
		return err
	}
	for _, x := range out {
		for _, msg := range x.Errors {
			fmt.Fprintf(e.stdout, "%s: %s\n", x.Prefix, msg)
		}
	}
	return nil
}

// describeTarget gathers what ls shows of t.
func describeTarget(e *env, t *target) lsEntry {
	x := lsEntry{Prefix: t.Prefix, State: t.state(), Live: t.Live, RuntimeDir: t.Dir, UID: t.UID, PID: t.primaryPID()}
	if t.Unreachable != nil {
		x.Errors = []string{t.Unreachable.Error()}
		return x
	}
	if t.LiveErr != nil {
		x.Errors = append(x.Errors, "primary lock: "+t.LiveErr.Error())
	}
	if t.InfoErr != nil {
		x.Errors = append(x.Errors, t.InfoErr.Error())
	}
	if t.Info != nil {
		x.Backend, x.BackendDir, x.PageSize, x.Created = t.Info.Backend, t.Info.BackendDir, t.Info.PageSize, t.Info.Created
	}
	seg, info, err := t.open(e)
	x.Segment = info.Path
	if err != nil {
		if t.Live && t.Info == nil {
			return x // a primary still starting up
		}
		x.Errors = append(x.Errors, err.Error())
		return x
	}
	defer seg.Close()
	x.SegmentDead = info.State == "dead"
	for _, p := range seg.Procs() {
		if p.Alive {
			x.Processes++
		}
	}
	lists, err := hugetlb.Describe(seg)
	if err != nil {
		x.Errors = append(x.Errors, err.Error())
		return x
	}
	x.Lists = len(lists)
	for _, l := range lists {
		x.Capacity += l.CapacityBytes
		x.Pages += l.Allocated
		x.Bytes += l.AllocatedBytes
		if x.Backend == "" {
			x.Backend = l.Backend.String()
		}
		if x.PageSize == 0 {
			x.PageSize = l.PageSize
		}
	}
	return x
}

func orDash(n int) string {
	if n == 0 {
		return "-"
	}
	return fmt.Sprint(n)
}

func orDashS(s string) string {
	if s == "" {
		return "-"
	}
	return s
}
