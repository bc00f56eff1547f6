package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"syscall"

	"github.com/mpmr/mpmr/internal/demo"
)

func main() {
	o := demo.Flags(flag.CommandLine)
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
	sum, err := demo.RunSecondary(ctx, *o)
	if err != nil {
		fmt.Fprintln(os.Stderr, "error:", err)
		os.Exit(1)
	}
	fmt.Println(sum)
	if sum.ValidationErrors != 0 || len(sum.Errors) != 0 {
		os.Exit(1)
	}
}
