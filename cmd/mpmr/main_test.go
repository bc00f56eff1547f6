package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/instance"
	"github.com/mpmr/mpmr/internal/test/fusetest"
	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/primary"
	"github.com/mpmr/mpmr/secondary"
	"github.com/mpmr/mpmr/shm"
)

func TestMain(m *testing.M) {
	testproc.Register("primary", helperPrimary)
	testproc.Register("secondary", helperSecondary)
	testproc.Register("segment", helperSegment)
	testproc.Register("fuse", fusetest.Helper)
	testproc.Main(m)
}

var quiet = slog.New(slog.DiscardHandler)

// tool runs mpmr with args and returns its output and exit status.
func tool(t testing.TB, args ...string) (stdout, stderr string, status int) {
	t.Helper()
	var out, errOut bytes.Buffer
	status = run(args, &out, &errOut)
	return out.String(), errOut.String(), status
}

// toolJSON runs mpmr -json with args, requires success and decodes the
// output into v.
func toolJSON(t testing.TB, v any, args ...string) {
	t.Helper()
	out, errOut, status := tool(t, append([]string{"-json"}, args...)...)
	require.Equal(t, 0, status, "mpmr %v failed: %s", args, errOut)
	require.NoError(t, json.Unmarshal([]byte(out), v), "output:\n%s", out)
}

// startPrimary starts a primary in this process on a fresh prefix, with its
// runtime files in rundir; it is closed at cleanup.
func startPrimary(t testing.TB, b hugetlb.Backend, rundir string) (*primary.Primary, primary.Config) {
	t.Helper()
	cfg := primary.Config{Prefix: testenv.Prefix(t), RuntimeDir: rundir, Backend: b.Kind, MemoryPages: 16, Logger: quiet}
	p, err := primary.Start(cfg)
	require.NoError(t, err)
	t.Cleanup(func() { p.Close() })
	return p, cfg
}

// helperProc is a helper process with its command loop.
type helperProc struct {
	*testproc.Proc
	t testing.TB
}

// ask sends a command and returns the answer line without its "> ".
func (h helperProc) ask(format string, args ...any) string {
	h.t.Helper()
	h.Send(format, args...)
	return strings.TrimPrefix(h.Expect("> ", 0), "> ")
}

// kill kills the helper and waits for it: it must not have ended by
// itself meanwhile.
func (h helperProc) kill() {
	h.t.Helper()
	h.Kill()
	require.Error(h.t, h.Wait(0))
}

// startDeadable starts a primary in a helper process, which the test may
// SIGKILL; whatever it leaves behind is removed at cleanup.
func startDeadable(t testing.TB, b hugetlb.Backend, rundir string) (helperProc, string) {
	t.Helper()
	prefix := testenv.Prefix(t)
	return startDeadableAs(t, b, rundir, prefix), prefix
}

// startDeadableAs is startDeadable for instance prefix.
func startDeadableAs(t testing.TB, b hugetlb.Backend, rundir, prefix string) helperProc {
	t.Helper()
	t.Cleanup(func() { removeLeftovers(t, b, rundir, prefix) })
	h := testproc.Start(t, "primary", []string{prefix, rundir, b.Kind.String()})
	h.Expect("ready", 0)
	return helperProc{h, t}
}

// removeLeftovers is the safety net of tests that kill primaries: it
// removes the instance's files if a test failed before cleaning them.
func removeLeftovers(t testing.TB, b hugetlb.Backend, rundir, prefix string) {
	name := instanceName(rundir, prefix)
	os.Remove(instance.SegmentPath(b.Dir, name))
	hugetlb.RemoveEndedFiles(b.Dir, name)
	os.Remove(instance.LifePath(b.Dir, name))
	own, _ := filepath.Glob(filepath.Join(b.Dir, "mpmr."+name+".p*"))
	for _, dir := range own {
		os.RemoveAll(dir) // a primary's directory of its own (see instance.PrivateDirName)
	}
	os.RemoveAll(filepath.Join(rundir, prefix))
}

// instanceName is the name that the instance prefix of this user under
// rundir gives its files in backend directories.
func instanceName(rundir, prefix string) string {
	return instance.Name(prefix, os.Geteuid(), filepath.Join(rundir, prefix))
}

// startSecondary attaches a secondary helper process to instance prefix.
func startSecondary(t testing.TB, prefix, rundir string) helperProc {
	t.Helper()
	h := testproc.Start(t, "secondary", []string{prefix, rundir})
	h.Expect("ready", 0)
	return helperProc{h, t}
}

func parseKey(t testing.TB, answer string) uint32 {
	t.Helper()
	var k uint32
	_, err := fmt.Sscanf(answer, "key %d", &k)
	require.NoError(t, err, "answer %q", answer)
	return k
}

// helperPrimary runs a primary for args [prefix, rundir, backend], then
// commands, one per line:
//
//	alloc PAGES  -> "region ADDR"
//	mr ADDR      -> "key K" (a lookup through a primary queue: creates the MR)
//	hold         -> "held", then holds the global write lock until killed
func helperPrimary(args []string) int {
	kind, err := hugetlb.ParseKind(args[2])
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 3
	}
	p, err := primary.Start(primary.Config{Prefix: args[0], RuntimeDir: args[1], Backend: kind, MemoryPages: 16, Logger: quiet})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		testproc.Say("start-failed %v", err)
		return 3
	}
	defer p.Close()
	q := p.NewQueue()
	testproc.Say("ready pid=%d", os.Getpid())
	testproc.EachCommand(func(c testproc.Line) {
		switch c.Name {
		case "alloc":
			r, err := p.Alloc(c.Num(0) * p.Backend().PageSize)
			if err != nil {
				testproc.Say("> err %v", err)
			} else {
				testproc.Say("> region %d", r.Addr)
			}
		case "mr":
			testproc.SayKey(q.Lookup(uintptr(c.Num(0))))
		case "hold":
			err := p.Global().Exclusive(func() {
				testproc.Say("> held")
				select {} // until killed
			})
			testproc.Say("> err %v", err)
		default:
			testproc.Say("> err unknown command %q", c.Name)
		}
	})
	return 0
}

// helperSecondary attaches to instance [prefix, rundir], then runs
// commands, one per line:
//
//	lookup ADDR  -> "key K" or "err TEXT"
//	publish      -> "published lookups=N" (its counters, into the segment)
//	ready        -> "ready BOOL": whether the segment is still in the ready state
func helperSecondary(args []string) int {
	s, err := secondary.Attach(secondary.Config{Prefix: args[0], RuntimeDir: args[1], Logger: quiet})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		testproc.Say("attach-failed %v", err)
		return 3
	}
	defer s.Close()
	q := s.NewQueue()
	testproc.Say("ready slot=%d", s.Slot())
	testproc.EachCommand(func(c testproc.Line) {
		switch c.Name {
		case "lookup":
			testproc.SayKey(q.Lookup(uintptr(c.Num(0))))
		case "publish":
			q.Publish()
			testproc.Say("> published lookups=%d", s.Stats().Counters.Lookups)
		case "ready":
			testproc.Say("> ready %v", s.Segment().Ready())
		default:
			testproc.Say("> err unknown command %q", c.Name)
		}
	})
	return 0
}

// helperSegment creates a control segment at args[0] (lock file args[1])
// and ends without building anything on it: what a primary that died while
// starting leaves.
func helperSegment(args []string) int {
	seg, err := shm.Create(shm.Options{Path: args[0], LockPath: args[1], LayoutTag: instance.LayoutTag,
		Role: shm.RolePrimary, Logger: quiet})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 3
	}
	testproc.Say("created")
	seg.Close()
	return 0
}
