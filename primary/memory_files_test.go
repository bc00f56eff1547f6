package primary_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/internal/instance"
	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/ipc"
	"github.com/mpmr/mpmr/shm"
)

func init() { testproc.Register("ask-memory-files", helperAskMemoryFiles) }

// helperAskMemoryFiles claims a slot and says hello as a secondary does
// (args: PREFIX RUNDIR), then asks for the memory files: once from list 0,
// again from list 0, from list 1 (past the one list), and from list 0 in
// 20 calls at once; then says hello again and asks from list 0; then says
// hello naming the same claim on a second connection; then detaches and
// says hello again. It says "> files N" for each of the first three and
// "> files N refused R" for the burst, or "> err ..." for a request that
// failed otherwise.
func helperAskMemoryFiles(args []string) int {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	seg, client, err := claimAndSayHello(ctx, args[0], args[1], ipc.ClientConfig{Logger: quiet})
	if err != nil {
		testproc.Say("> err %v", err)
		return 3
	}
	defer seg.Close()
	defer client.Close()
	ask := func(first int) (int, error) {
		got := &ipc.WithFiles{Body: &ipc.MemoryFilesReply{}}
		err := client.Call(ctx, ipc.KindMemoryFiles, &ipc.MemoryFiles{First: first}, got)
		for _, f := range got.Files {
			f.Close()
		}
		return len(got.Files), err
	}
	for _, first := range []int{0, 0, 1} {
		n, err := ask(first)
		switch {
		case errors.Is(err, ipc.ErrLimit):
			testproc.Say("> files %d refused", n)
		case err != nil:
			testproc.Say("> err %v", err)
		default:
			testproc.Say("> files %d", n)
		}
	}
	type result struct {
		n   int
		err error
	}
	results := make(chan result)
	for range 20 {
		go func() { n, err := ask(0); results <- result{n, err} }()
	}
	files, refused := 0, 0
	for range 20 {
		r := <-results
		files += r.n
		if errors.Is(r.err, ipc.ErrLimit) {
			refused++
		} else if r.err != nil {
			testproc.Say("> err %v", r.err)
		}
	}
	testproc.Say("> files %d refused %d", files, refused)
	// The same hello again, on the same connection: still the same
	// attachment, whose files went.
	start, _ := shm.ProcessStart(os.Getpid())
	if err := client.Call(ctx, ipc.KindHello, &ipc.Hello{ABI: ipc.ABI, PID: os.Getpid(), UID: os.Getuid(),
		Start: start, Role: "secondary", Slot: seg.Slot(), Epoch: seg.Epoch()}, &ipc.WithFiles{Body: &ipc.HelloReply{}}); err != nil {
		testproc.Say("> err hello again %v", err)
		return 0
	}
	n, err := ask(0)
	testproc.Say("> after hello files %d refused %t", n, errors.Is(err, ipc.ErrLimit))
	// A second connection naming the same claim.
	dir, err := instance.Dir(args[0], args[1])
	if err != nil {
		testproc.Say("> err %v", err)
		return 3
	}
	rd, err := ipc.OpenRunDir(dir, ipc.RunDirOptions{})
	if err != nil {
		testproc.Say("> err %v", err)
		return 3
	}
	other, err := ipc.DialClient(ctx, filepath.Join(rd.Path(), ipc.SocketName), ipc.ClientConfig{Logger: quiet})
	rd.Close()
	if err != nil {
		testproc.Say("> err %v", err)
		return 3
	}
	defer other.Close()
	err = other.Call(ctx, ipc.KindHello, &ipc.Hello{ABI: ipc.ABI, PID: os.Getpid(), UID: os.Getuid(),
		Start: start, Role: "secondary", Slot: seg.Slot(), Epoch: seg.Epoch()}, &ipc.WithFiles{Body: &ipc.HelloReply{}})
	testproc.Say("> hello on another connection refused %t", errors.Is(err, ipc.ErrLimit))
	// A detach, and a hello again on the same connection.
	if err := client.Call(ctx, ipc.KindDetach, &ipc.Detach{}, &ipc.DetachReply{}); err != nil {
		testproc.Say("> err detach %v", err)
		return 3
	}
	err = client.Call(ctx, ipc.KindHello, &ipc.Hello{ABI: ipc.ABI, PID: os.Getpid(), UID: os.Getuid(),
		Start: start, Role: "secondary", Slot: seg.Slot(), Epoch: seg.Epoch()}, &ipc.WithFiles{Body: &ipc.HelloReply{}})
	testproc.Say("> hello after detach refused %t", errors.Is(err, ipc.ErrLimit))
	return 0
}

// An attachment is handed its memory's backing files once: each request
// opens them again in the primary, so a peer that asks over and over (or
// many times at once) would make the primary open files without end. The
// first ask gets the one list's file; asking again, past the last list,
// twenty times at once, or after saying hello again, is refused with ipc.ErrLimit and hands over
// nothing. Nor does a claim start afresh with another connection, or with
// a hello after its detach: one connection speaks for a claim, and a
// claim that detached has left.
func TestMemoryFilesAreHandedOnce(t *testing.T) {
	_, cfg := startPrimary(t, testenv.Tmpfs(t))
	h := testproc.Start(t, "ask-memory-files", []string{cfg.Prefix, cfg.RuntimeDir})
	var got []string
	for range 7 {
		got = append(got, strings.TrimPrefix(h.Expect("> ", 0), "> "))
	}
	assert.Equal(t, []string{"files 1", "files 0 refused", "files 0 refused", "files 0 refused 20",
		"after hello files 0 refused true", "hello on another connection refused true",
		"hello after detach refused true"}, got)
	require.NoError(t, h.Wait(0))
}
