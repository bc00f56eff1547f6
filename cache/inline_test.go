package cache

import (
	"os/exec"
	"strings"
	"testing"
)

// TestHitInlines: Hit is the top-half probe a datapath loop calls on every
// packet, and it is only worth calling if the compiler inlines it into
// that loop. The compiler says so when asked (-gcflags=-m); a change that
// grows Hit past the inlining budget fails here, not silently in a
// benchmark.
func TestHitInlines(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the package: skipped in -short mode")
	}
	gotool, err := exec.LookPath("go")
	if err != nil {
		t.Skipf("needs the go command to ask the compiler: %v", err)
	}
	out, err := exec.CommandContext(t.Context(), gotool, "build", "-gcflags=-m", "-o", "/dev/null", ".").CombinedOutput()
	if err != nil {
		t.Fatalf("go build -gcflags=-m: %v\n%s", err, out)
	}
	if !hasLine(string(out), ": can inline (*Local).Hit") {
		t.Errorf("the compiler no longer inlines (*Local).Hit; what it said of Hit:\n%s", grepLines(string(out), "Hit"))
	}
}

// hasLine reports whether a line of s ends with suffix.
func hasLine(s, suffix string) bool {
	for line := range strings.Lines(s) {
		if strings.HasSuffix(strings.TrimRight(line, "\n"), suffix) {
			return true
		}
	}
	return false
}

func grepLines(s, sub string) string {
	var b strings.Builder
	for line := range strings.Lines(s) {
		if strings.Contains(line, sub) {
			b.WriteString(line)
		}
	}
	return b.String()
}
