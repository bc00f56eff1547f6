package testenv

import (
	"runtime"
	"strings"
	"sync"
)

// stacks is GoroutinesIn's buffer, kept for the next call (tests poll
// with it every millisecond) and grown when a dump fills it.
var stacks struct {
	sync.Mutex
	buf []byte
}

// GoroutinesIn counts this process's goroutines whose stacks hold every
// one of frames (substrings of the stack dump): tests find where a
// goroutine waits by it, instead of sleeping until it should be there.
func GoroutinesIn(frames ...string) int {
	stacks.Lock()
	defer stacks.Unlock()
	if stacks.buf == nil {
		stacks.buf = make([]byte, 1<<20)
	}
	for {
		n := runtime.Stack(stacks.buf, true)
		if n < len(stacks.buf) {
			return countIn(string(stacks.buf[:n]), frames)
		}
		stacks.buf = make([]byte, 2*len(stacks.buf))
	}
}

// countIn counts the goroutines of dump whose stacks hold every one of
// frames.
func countIn(buf string, frames []string) int {
	n := 0
	for _, g := range strings.Split(buf, "\n\n") {
		all := true
		for _, f := range frames {
			all = all && strings.Contains(g, f)
		}
		if all {
			n++
		}
	}
	return n
}
