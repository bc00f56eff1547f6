package secondary_test

import (
	"bufio"
	"context"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/mpmr/mpmr/hugetlb"
	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/primary"
	"github.com/mpmr/mpmr/secondary"
	"github.com/mpmr/mpmr/verbs"
)

func TestMain(m *testing.M) {
	// The example's primary runs in a process of its own: a secondary maps
	// the data memory at the primary's addresses, which the primary's own
	// process already uses.
	testproc.Register("example-primary", func(args []string) int {
		p, err := primary.Start(primary.Config{Prefix: args[0], RuntimeDir: args[1], Backend: hugetlb.Tmpfs,
			MemoryPages: 16, Logger: slog.New(slog.DiscardHandler)})
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		defer p.Close()
		if _, err := p.CreatePool("pkts", 2048, 256); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		fmt.Println("ready")
		bufio.NewScanner(os.Stdin).Scan() // until the example is done
		return 0
	})
	testproc.Main(m)
}

// A secondary attaches to a running primary, opens its packet pool,
// registers it for a queue, and looks up the key of a buffer.
func Example() {
	prefix := fmt.Sprintf("example-%d", os.Getpid())
	dir, _ := os.MkdirTemp("", "mpmr-example")
	defer os.RemoveAll(dir)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	primaryProc := testproc.Command(ctx, "example-primary", prefix, dir)
	in, _ := primaryProc.StdinPipe()
	out, _ := primaryProc.StdoutPipe()
	if err := primaryProc.Start(); err != nil {
		fmt.Println(err)
		return
	}
	defer primaryProc.Wait()
	defer in.Close()
	if line, _ := bufio.NewReader(out).ReadString('\n'); strings.TrimSpace(line) != "ready" {
		fmt.Println("primary did not start")
		return
	}

	s, err := secondary.Attach(secondary.Config{Prefix: prefix, RuntimeDir: dir, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer s.Close()
	pool, err := s.Pool("pkts")
	if err != nil {
		fmt.Println(err)
		return
	}
	q := s.NewQueue()
	defer q.Close()
	fmt.Println("register:", s.RegisterMempool(q, pool))
	buf, _ := pool.Get()
	defer pool.Put(buf)
	key, err := q.Lookup(buf)
	fmt.Println("lookup:", err)
	fmt.Println("device accepts the key:",
		s.Device().Validate(verbs.SGE{Addr: buf, Len: 2048, Key: key}, verbs.AccessLocalWrite) == nil)
	// Output:
	// register: <nil>
	// lookup: <nil>
	// device accepts the key: true
}
