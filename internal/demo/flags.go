package demo

import (
	"context"
	"flag"
	"log/slog"
	"os"
	"os/signal"
	"strconv"
	"syscall"
	"time"
)

// Flags registers the options shared by both example programs on fs and
// returns them, with defaults that make one command run the main job. Call
// Setup after parsing.
func Flags(fs *flag.FlagSet) *Options {
	o := &Options{}
	fs.BoolVar(&o.verbose, "v", false, "log the library's diagnostics")
	fs.StringVar(&o.Prefix, "prefix", "demo", "instance name")
	fs.StringVar(&o.RuntimeDir, "rundir", "", "runtime directory (default: the standard one for this user)")
	fs.StringVar(&o.Backend, "backend", "auto", "memory backend: auto, hugetlbfs or tmpfs")
	fs.StringVar(&o.Device, "device", "soft", "device: soft, or an rdma-core device name (needs -tags rdma)")
	fs.IntVar(&o.Secondaries, "secondaries", 2, "secondary processes the primary launches")
	fs.IntVar(&o.Queues, "queues", 4, "queues per secondary")
	fs.DurationVar(&o.Duration, "duration", 3*time.Second, "how long the secondaries work")
	fs.IntVar(&o.BufSize, "bufsize", 2048, "bytes per packet buffer")
	fs.IntVar(&o.Buffers, "buffers", 8192, "buffers in the pool")
	fs.BoolVar(&o.Churn, "churn", true, "free and reallocate scratch memory during the run")
	return o
}

// Args returns the command-line arguments that give a child process the
// same options.
func (o *Options) Args() []string {
	args := []string{"-prefix", o.Prefix, "-rundir", o.RuntimeDir, "-backend", o.Backend,
		"-queues", strconv.Itoa(o.Queues), "-duration", o.Duration.String(),
		"-bufsize", strconv.Itoa(o.BufSize), "-buffers", strconv.Itoa(o.Buffers)}
	if o.verbose {
		args = append(args, "-v")
	}
	return args
}

// Setup finishes the options after flag parsing: output to standard output,
// diagnostics to standard error (warnings only, everything with -v). It
// returns a context that ends on SIGINT or SIGTERM.
func (o *Options) Setup() (context.Context, context.CancelFunc) {
	o.Out = os.Stdout
	level := slog.LevelWarn
	if o.verbose {
		level = slog.LevelDebug
	}
	o.Logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
	return signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
}
