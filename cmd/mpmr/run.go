package main

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"time"
)

// env is what every command gets: the output streams and the global flags.
type env struct {
	stdout, stderr io.Writer
	rundir         string        // -rundir: the runtimes' RuntimeDir override
	json           bool          // -json: machine-readable output
	timeout        time.Duration // -timeout: bound of a request to a primary
	patience       time.Duration // how long dump waits for a consistent read
	log            *slog.Logger  // library diagnostics, to stderr
}

// command is one subcommand.
type command struct {
	name    string
	args    string // synopsis of the positional arguments
	summary string
	help    string
	nargs   int // positional arguments required
	// flags adds the command's own flags, if any.
	flags func(fs *flag.FlagSet, e *env)
	run   func(e *env, args []string) error
}

var commands = []*command{cmdLs, cmdDump, cmdStats, cmdClean}

// errUsage is a command line mistake: the usage is printed, the exit
// status is 2.
var errUsage = errors.New("usage")

// run is the tool: it parses args, runs the command and returns the exit
// status (0 success, 1 failure, 2 bad usage).
func run(args []string, stdout, stderr io.Writer) int {
	e := &env{stdout: stdout, stderr: stderr, timeout: 2 * time.Second, patience: 500 * time.Millisecond}
	e.log = slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	fs := flag.NewFlagSet("mpmr", flag.ContinueOnError)
	fs.SetOutput(stderr)
	e.globalFlags(fs)
	fs.Usage = func() { usage(stderr) }
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	if fs.NArg() == 0 {
		usage(stderr)
		return 2
	}
	name, rest := fs.Arg(0), fs.Args()[1:]
	if name == "help" {
		return help(e, rest)
	}
	c := lookup(name)
	if c == nil {
		fmt.Fprintf(stderr, "mpmr: unknown command %q\n\n", name)
		usage(stderr)
		return 2
	}
	pos, err := c.parse(e, rest)
	if errors.Is(err, flag.ErrHelp) {
		return 0
	}
	if err != nil {
		return 2
	}
	if err := c.run(e, pos); err != nil {
		if errors.Is(err, errUsage) {
			c.usage(e.stderr)
			return 2
		}
		fmt.Fprintf(stderr, "mpmr %s: %v\n", c.name, err)
		return 1
	}
	return 0
}

func (e *env) globalFlags(fs *flag.FlagSet) {
	fs.StringVar(&e.rundir, "rundir", e.rundir, "runtime directory the instances live under (the runtimes' RuntimeDir; default $XDG_RUNTIME_DIR/mpmr, /run/mpmr for root, else $TMPDIR/mpmr-UID)")
	fs.BoolVar(&e.json, "json", e.json, "print JSON for scripts instead of tables")
}

// parse parses a command's flags, which may come before or after its
// positional arguments, and checks their number.
func (c *command) parse(e *env, args []string) ([]string, error) {
	fs := flag.NewFlagSet("mpmr "+c.name, flag.ContinueOnError)
	fs.SetOutput(e.stderr)
	e.globalFlags(fs)
	if c.flags != nil {
		c.flags(fs, e)
	}
	fs.Usage = func() {
		c.usage(e.stderr)
		fmt.Fprintln(e.stderr, "\nFlags:")
		fs.PrintDefaults()
	}
	var pos []string
	for {
		if err := fs.Parse(args); err != nil {
			return nil, err
		}
		if fs.NArg() == 0 {
			break
		}
		pos = append(pos, fs.Arg(0))
		args = fs.Args()[1:]
	}
	if len(pos) != c.nargs {
		fmt.Fprintf(e.stderr, "mpmr %s: want %d argument(s), got %d\n\n", c.name, c.nargs, len(pos))
		fs.Usage()
		return nil, errUsage
	}
	return pos, nil
}

func (c *command) usage(w io.Writer) {
	fmt.Fprintf(w, "usage: mpmr [-rundir DIR] [-json] %s %s\n\n%s\n", c.name, c.args, strings.TrimSpace(c.help))
}

func lookup(name string) *command {
	for _, c := range commands {
		if c.name == name {
			return c
		}
	}
	return nil
}

func usage(w io.Writer) {
	fmt.Fprint(w, `mpmr inspects and cleans mpmr instances (a primary, its secondaries and
their shared control segment and hugepage memory) without disturbing them.

usage: mpmr [-rundir DIR] [-json] COMMAND [ARGS]

Commands:
`)
	for _, c := range commands {
		fmt.Fprintf(w, "  %-6s %-9s %s\n", c.name, c.args, c.summary)
	}
	fmt.Fprint(w, `  help   [COMMAND] explain a command

Global flags (also accepted after the command):
  -rundir DIR  the runtime directory the instances live under: what the
               runtimes were given as RuntimeDir (default: $XDG_RUNTIME_DIR/mpmr,
               /run/mpmr for root, else $TMPDIR/mpmr-UID)
  -json        machine-readable output for scripts
`)
}

func help(e *env, args []string) int {
	switch len(args) {
	case 0:
		usage(e.stdout)
		return 0
	case 1:
		c := lookup(args[0])
		if c == nil {
			fmt.Fprintf(e.stderr, "mpmr help: unknown command %q\n", args[0])
			return 2
		}
		c.usage(e.stdout)
		return 0
	}
	fmt.Fprintln(e.stderr, "usage: mpmr help [COMMAND]")
	return 2
}

// printJSON writes v indented.
func (e *env) printJSON(v any) error {
	enc := json.NewEncoder(e.stdout)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}
