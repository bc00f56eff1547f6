package testenv

import (
	"runtime"
	"strings"
)

// GoroutinesIn counts this process's goroutines whose stacks hold every
// one of frames (substrings of the stack dump): tests find where a
// goroutine waits by it, instead of sleeping until it should be there.
func GoroutinesIn(frames ...string) int {
	buf := make([]byte, 8<<20)
	buf = buf[:runtime.Stack(buf, true)]
	n := 0
	for _, g := range strings.Split(string(buf), "\n\n") {
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
