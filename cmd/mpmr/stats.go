package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"path/filepath"
	"slices"
	"text/tabwriter"
	"time"

	"github.com/mpmr/mpmr/internal/instance"
	"github.com/mpmr/mpmr/ipc"
)

var cmdStats = &command{
	name:    "stats",
	args:    "PREFIX",
	nargs:   1,
	summary: "show an instance's live counters",
	help: `
Shows the counters of instance PREFIX: the primary's, asked over its socket
(a stats request needs no attach, so the tool does not join the instance),
and every live process's counter line as it last published it in the
control segment (secondaries publish about every 250 ms): lookups and which
level answered them (top half, bottom half, global table, created), failed
lookups, cache flushes (FULL dropped everything, SEL only what an
invalidation touched, with the entries each dropped), IPC requests made or
served with their p50/p99 latency, memory syncs, dropped and fenced
secondaries, pages in quarantine, the validation errors the application
reported, and how often the primary's IPC limits tripped (connections
refused or closed without hello, requests refused for their descriptors,
peers dropped for a full queue or for not reading).

For a dead instance the primary cannot be asked; the published lines of
processes still alive are shown. It fails (status 1) when a live primary
does not answer within -timeout, and when it refuses the control segment
or the directory it is reached through as not the instance's (a file of
another user or not a regular file at its name, a description naming a
segment elsewhere; then nothing published is shown).`,
	flags: func(fs *flag.FlagSet, e *env) {
		fs.DurationVar(&e.timeout, "timeout", e.timeout, "how long to wait for the primary's answer")
	},
	run: runStats,
}

// statsOut is what stats prints.
type statsOut struct {
	Prefix string `json:"prefix"`
	State  string `json:"state"`
	// Primary is the primary's answer over IPC; PrimaryError says why
	// there is none.
	Primary      *primaryStats `json:"primary,omitempty"`
	PrimaryError string        `json:"primary_error,omitempty"`
	// Processes are the counter lines published in the segment.
	Processes []instance.ProcCounters `json:"processes"`
	Errors    []string                `json:"errors,omitempty"`
}

type primaryStats struct {
	PID         int               `json:"pid"`
	Secondaries int               `json:"secondaries"`
	MRs         int               `json:"mrs"`
	Counters    instance.Counters `json:"counters"`
}

func runStats(e *env, args []string) error {
	type gathered struct {
		out    statsOut
		askErr error // asking the primary
		refErr error // a segment refused as not the instance's
	}
	g, err := answered(args[0], e.timeout, func() (gathered, error) {
		t, err := e.target(args[0])
		if err != nil {
			return gathered{}, err
		}
		out, askErr, refErr := gatherStats(e, t)
		return gathered{out, askErr, refErr}, nil
	})
	if err != nil {
		return err
	}
	out, askErr := g.out, g.askErr
	if e.json {
		err = e.printJSON(out)
	} else {
		err = out.print(e)
	}
	if err == nil && askErr != nil {
		err = fmt.Errorf("asking the primary: %w", askErr)
	}
	if err == nil && g.refErr != nil {
		err = g.refErr
	}
	return err
}

// gatherStats reads what stats shows of t, and the errors of asking its
// primary, if that failed, and of a control segment refused as not the
// instance's (ipc.ErrPermission).
func gatherStats(e *env, t *target) (out statsOut, askErr, refErr error) {
	defer t.release()
	out = statsOut{Prefix: t.Prefix, State: t.state()}
	if t.Live {
		out.Primary, askErr = askPrimary(e, t)
		if askErr != nil {
			out.PrimaryError = askErr.Error()
		}
	} else {
		out.PrimaryError = "the primary is not running"
	}
	if seg, _, err := t.open(e); err != nil {
		out.Errors = append(out.Errors, err.Error())
		if errors.Is(err, ipc.ErrPermission) {
			refErr = err
		}
	} else {
		if ctrs, err := instance.OpenCounters(seg); err != nil {
			out.Errors = append(out.Errors, err.Error())
		} else {
			out.Processes = ctrs.Read()
		}
		seg.Close()
	}
	out.Processes = orEmpty(out.Processes)
	return out, askErr, refErr
}

// askPrimary asks the primary for its counters. A stats request is served
// without the attach handshake, so this joins nothing.
func askPrimary(e *env, t *target) (*primaryStats, error) {
	// The socket in the checked runtime directory, whatever the
	// description says, and a socket of the instance's user only: the tool
	// speaks to that user's primary and to nothing else.
	rd, err := t.openDir()
	if err != nil {
		return nil, err
	}
	defer rd.Close()
	sock := filepath.Join(rd.Path(), ipc.SocketName)
	// As given to the tool, or by its real path, as the primary writes it.
	if t.Info != nil && t.Info.Socket != "" && !slices.Contains([]string{sock, filepath.Join(t.Dir, ipc.SocketName),
		filepath.Join(instance.RealPath(t.Dir), ipc.SocketName)}, filepath.Clean(t.Info.Socket)) {
		return nil, fmt.Errorf("%w: %s names the socket %s, which is not the instance's (%s); not dialled",
			ipc.ErrPermission, filepath.Join(rd.Path(), instance.InfoFile), t.Info.Socket, sock)
	}
	// The socket checked, by descriptor: a link the instance's user puts
	// at its name meanwhile is not dialled.
	sf, held, err := rd.OpenSocket(ipc.SocketName)
	if err != nil {
		return nil, err
	}
	defer sf.Close()
	ctx, cancel := context.WithTimeout(context.Background(), e.timeout)
	defer cancel()
	c, err := ipc.DialClient(ctx, held, ipc.ClientConfig{Logger: e.log})
	if err != nil {
		return nil, fmt.Errorf("%s: %w", sock, err)
	}
	defer c.Close()
	if cred, err := c.ServerCred(); err != nil {
		return nil, err
	} else if cred.UID != t.UID {
		return nil, fmt.Errorf("%w: the process listening at %s runs as uid %d, not as the instance's user (uid %d)",
			ipc.ErrPermission, sock, cred.UID, t.UID)
	}
	var r ipc.StatsReply
	if err := c.Call(ctx, ipc.KindStats, &ipc.StatsRequest{}, &r); err != nil {
		if errors.Is(err, context.DeadlineExceeded) {
			return nil, fmt.Errorf("no answer within %v: %w", e.timeout, err)
		}
		return nil, err
	}
	return &primaryStats{PID: r.PID, Secondaries: r.Secondaries, MRs: r.MRs,
		Counters: instance.CountersFromMap(r.Counters)}, nil
}

func (s *statsOut) print(e *env) error {
	w := tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(e.stdout, "INSTANCE %s (%s)\n", s.Prefix, s.State)
	if p := s.Primary; p != nil {
		c := p.Counters
		fmt.Fprintf(e.stdout, "primary pid %d (asked over IPC): %d secondaries attached, %d MRs registered\n",
			p.PID, p.Secondaries, p.MRs)
		fmt.Fprintf(e.stdout, "  requests served %d (%d failed), service time p50 %v p99 %v max %v\n",
			c.Requests, c.RequestErrors, c.LatencyP50, c.LatencyP99, c.LatencyMax)
		fmt.Fprintf(e.stdout, "  memory syncs pushed %d, secondaries dropped %d, fenced %d, freed pages in quarantine %d, read holds fenced %d\n",
			c.Syncs, c.SyncDrops, c.Fenced, c.Quarantined, c.ReadFences)
		fmt.Fprintf(e.stdout, "  ipc: %d connections open; refused %d over the total, %d over the per-user cap; %d closed without hello, %d of them to make room; %d stats requests of strangers throttled; "+
			"requests refused for descriptors %d (%d over the held limit); peers dropped: %d queue full, %d not reading, %d breaking the protocol; lanes let go starved %d, given back idle %d\n",
			c.IPCConns, c.IPCRefusedConns, c.IPCRefusedConnsUID, c.IPCHelloTimeouts+c.IPCShedConns, c.IPCShedConns, c.IPCThrottled, c.IPCRefusedFiles+c.IPCRefusedFilesInFlight,
			c.IPCRefusedFilesInFlight, c.IPCQueueOverflows, c.IPCWriteTimeouts, c.IPCViolations, c.IPCStarvedLanes, c.IPCIdleLanes)
		fmt.Fprintf(e.stdout, "  lookups %d (top %d, bottom %d, global %d, created %d, failed %d), flushes %d (%d selective), queues %d\n",
			c.Lookups, c.TopHits, c.BottomHits, c.GlobalHits, c.Created, c.Failed, c.Flushes, c.SelectiveFlushes, c.Queues)
	} else {
		fmt.Fprintf(e.stdout, "primary: %s\n", s.PrimaryError)
	}
	fmt.Fprintf(e.stdout, "\nPUBLISHED COUNTERS (%d processes; per-process lines in the segment)\n", len(s.Processes))
	fmt.Fprintln(w, "SLOT\tPID\tROLE\tLOOKUPS\tTOP\tBOTTOM\tGLOBAL\tCREATED\tFAILED\tFULL\t(DROPPED)\tSEL\t(DROPPED)\tQUEUES\tREQUESTS\tREQ ERR\tP50\tP99\tSYNCS\tDROPS\tVAL ERR\tUPDATED\t")
	for _, p := range s.Processes {
		c := p.Counters
		fmt.Fprintf(w, "%d\t%d\t%s\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%v\t%v\t%d\t%d\t%d\t%s ago\t\n",
			p.Slot, p.PID, p.Role, c.Lookups, c.TopHits, c.BottomHits, c.GlobalHits, c.Created, c.Failed,
			c.Flushes-c.SelectiveFlushes, c.FullDropped, c.SelectiveFlushes, c.SelectiveDropped,
			c.Queues, c.Requests, c.RequestErrors, round(c.LatencyP50), round(c.LatencyP99), c.Syncs, c.SyncDrops,
			c.ValidationErrors, round(time.Since(p.Updated)))
	}
	if err := w.Flush(); err != nil {
		return err
	}
	for _, msg := range s.Errors {
		fmt.Fprintf(e.stdout, "error: %s\n", msg)
	}
	return nil
}

// round shortens a duration for a table.
func round(d time.Duration) time.Duration {
	switch {
	case d >= time.Second:
		return d.Round(10 * time.Millisecond)
	case d >= time.Millisecond:
		return d.Round(10 * time.Microsecond)
	case d >= time.Microsecond:
		return d.Round(10 * time.Nanosecond)
	}
	return d
}
