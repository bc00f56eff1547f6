package main

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"

	"github.com/mpmr/mpmr/internal/test/testenv"
)

// b7Tool runs mpmr with args on a goroutine and fails the test if it has
// not finished within limit.
func b7Tool(t *testing.T, limit time.Duration, args ...string) (string, string, int, time.Duration) {
	t.Helper()
	type res struct {
		out, errOut string
		status      int
	}
	done := make(chan res, 1)
	start := time.Now()
	go func() {
		o, e, s := tool(t, args...)
		done <- res{o, e, s}
	}()
	select {
	case r := <-done:
		return r.out, r.errOut, r.status, time.Since(start)
	case <-time.After(limit):
		t.Fatalf("mpmr %v did not finish within %v", args, limit)
		return "", "", 0, 0
	}
}

// The tool against an instance whose primary is alive but stopped, once
// idle and once while it holds the global write lock: every command ends
// within its bounds (stats fails for want of an answer; clean refuses).
func TestBreaker7ToolAgainstAStoppedPrimary(t *testing.T) {
	for _, hold := range []bool{false, true} {
		name := "idle"
		if hold {
			name = "holding-the-lock"
		}
		t.Run(name, func(t *testing.T) {
			b := testenv.Tmpfs(t)
			rundir := testenv.RunDir(t)
			h, prefix := startDeadable(t, b, rundir)
			t.Cleanup(h.Kill)
			h.ask("alloc 2")
			if hold {
				h.Send("hold")
				h.Expect("> held", 0)
			}
			h.Stop()
			t.Cleanup(h.Continue)
			for _, args := range [][]string{
				{"-rundir", rundir, "ls"},
				{"-rundir", rundir, "dump", prefix},
				{"-rundir", rundir, "stats", "-timeout", "300ms", prefix},
				{"-rundir", rundir, "clean", prefix},
				{"-json", "-rundir", rundir, "dump", prefix},
			} {
				out, errOut, status, took := b7Tool(t, 10*time.Second, args...)
				t.Logf("mpmr %v: status %d after %v\n%s%s", args, status, took, out, errOut)
				assert.Less(t, took, 5*time.Second, "mpmr %v", args)
				switch args[2] {
				case "clean":
					assert.NotEqual(t, 0, status, "clean refuses a live primary")
				case "stats":
					assert.NotEqual(t, 0, status, "stats without the primary's answer")
					assert.Contains(t, errOut, "no answer within 300ms", "stats says why")
				}
			}
		})
	}
}
