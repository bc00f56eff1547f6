package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/exec"

	"github.com/mpmr/mpmr/internal/demo"
)

func main() {
	o := demo.Flags(flag.CommandLine)
	role := flag.String("role", "primary", "primary, or secondary (how the primary launches its secondaries)")
	flag.Parse()
	ctx, stop := o.Setup()
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
