package primary_test

import (
	"fmt"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/internal/test/testenv"
	"github.com/mpmr/mpmr/internal/test/testproc"
	"github.com/mpmr/mpmr/primary"
	"github.com/mpmr/mpmr/secondary"
)

func init() { testproc.Register("bound-queue", helperBoundQueue) }

// helperBoundQueue attaches, binds a queue to CPU args[2] and looks up
// args[3] and args[4], two pages no MR holds yet. It prints "refused N":
// how many of the CPUs -1, 1000 (one a CPU set can name, but no machine
// here has: the kernel refuses it) and 1<<20 BindCPU refused; then "bound CPUS
// KEY KEY", the CPUs its thread may use after the lookups and their keys.
// It exits at "exit".
func helperBoundQueue(args []string) int {
	fail := func(err error) int {
		fmt.Fprintln(os.Stderr, err)
		return 3
	}
	s, err := secondary.Attach(secondary.Config{Prefix: args[0], RuntimeDir: args[1], Logger: quiet})
	if err != nil {
		return fail(err)
	}
	defer s.Close()
	q := s.NewQueue()
	defer q.Close()
	refused := 0
	for _, bad := range []int{-1, 1000, 1 << 20} {
		if q.BindCPU(bad) != nil {
			refused++
		}
	}
	testproc.Say("refused %d", refused)
	cpu, _ := strconv.Atoi(args[2])
	if err := q.BindCPU(cpu); err != nil {
		return fail(err)
	}
	var keys [2]uint32
	for i, a := range args[3:5] {
		addr, _ := strconv.ParseUint(a, 10, 64)
		if keys[i], err = q.Lookup(uintptr(addr)); err != nil {
			return fail(err)
		}
	}
	cpus, err := testenv.CPUs()
	if err != nil {
		return fail(err)
	}
	testproc.Say("bound %v %d %d", cpus, keys[0], keys[1])
	in := testproc.Commands()
	for in.Scan() && in.Text() != "exit" {
	}
	return 0
}

// A queue bound to a CPU binds its goroutine's thread there. With
// FollowCPU, its misses have the primary answer it there: the primary's
// thread for that secondary's calls is bound to the same CPU after the
// first, and lets go of it when the secondary leaves. Without, the default,
// the primary binds nothing.
func TestBoundQueueIsAnsweredOnItsCPU(t *testing.T) {
	cpus := testenv.NeedCPUs(t, 2)
	cpu := cpus[len(cpus)-1]
	for _, follow := range []bool{true, false} {
		t.Run(fmt.Sprintf("FollowCPU=%v", follow), func(t *testing.T) {
			p, cfg := startPrimary(t, testenv.Tmpfs(t), func(c *primary.Config) { c.SinglePage, c.FollowCPU = true, follow })
			ps := p.Backend().PageSize
			r, err := p.Alloc(2 * ps)
			require.NoError(t, err)
			before, beforeOthers := testenv.ThreadsBoundTo(t, cpu)

			h := testproc.Start(t, "bound-queue", []string{cfg.Prefix, cfg.RuntimeDir, strconv.Itoa(cpu),
				strconv.FormatUint(uint64(r.Addr)+8, 10), strconv.FormatUint(uint64(r.Addr)+ps+8, 10)})
			assert.Equal(t, "refused 3", h.Expect("refused", 0), "CPUs that do not exist")
			var got int
			var k1, k2 uint32
			line := h.Expect("bound", 0)
			_, err = fmt.Sscanf(line, "bound [%d] %d %d", &got, &k1, &k2)
			require.NoError(t, err, "the queue's thread is bound to one CPU: %s", line)
			assert.Equal(t, cpu, got, "the queue's thread is bound to its CPU")
			assert.NotEqual(t, k1, k2, "two pages, two MRs: both misses went to the primary")
			n, _ := testenv.ThreadsBoundTo(t, cpu)
			if !follow {
				assert.Equal(t, before, n, "the primary binds nothing unless told to")
				h.Send("exit")
				require.NoError(t, h.Wait(0))
				return
			}
			assert.Equal(t, before+1, n, "the primary answers the queue on its CPU")

			h.Send("exit")
			require.NoError(t, h.Wait(0))
			// A thread ends with the goroutine locked to it, unless it is
			// the process's main thread, which the runtime parks for good
			// instead.
			require.Eventually(t, func() bool { _, n := testenv.ThreadsBoundTo(t, cpu); return n == beforeOthers }, testproc.DefaultTimeout,
				time.Millisecond, "the thread bound for the secondary ends with its lane")
		})
	}
}
