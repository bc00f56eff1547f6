// Command primary runs the main job: a primary process that sets up
// shared data memory and a mempool of packet buffers, launches secondary
// processes (this same program in the secondary role) whose queues look up
// the key of every buffer on their datapath and hand the buffers to the
// soft device's loopback copy, churns memory to exercise invalidation, and
// prints a summary per process.
//
//	go run ./examples/primary                 # 2 secondaries, 4 queues each, 3 s
//	go run ./examples/primary -duration 10s -secondaries 3 -backend hugetlbfs
//
// It exits with status 1 if any secondary failed or any validation failed.
package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"syscall"

	"github.com/mpmr/mpmr/internal/demo"
)

func main() {
	o := demo.Flags(flag.CommandLine)
	role := flag.String("role", "primary", "primary, or secondary (how the primary launches its secondaries)")
	verbose := flag.Bool("v", false, "log the library's diagnostics")
	flag.Parse()
	o.Out = os.Stdout
	level := slog.LevelWarn
	if *verbose {
		level = slog.LevelDebug
	}
	o.Logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	var err error
	if *role == "secondary" {
		_, err = demo.RunSecondary(ctx, *o)
	} else {
		err = demo.RunPrimary(ctx, *o, launchSelf)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "error:", err)
		os.Exit(1)
	}
}

// launchSelf runs this program again as a secondary.
func launchSelf(ctx context.Context, o demo.Options, n int) *exec.Cmd {
	exe, err := os.Executable()
	if err != nil {
		exe = os.Args[0]
	}
	return exec.CommandContext(ctx, exe, append(o.Args(), "-role", "secondary")...)
}
