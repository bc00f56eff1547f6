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
