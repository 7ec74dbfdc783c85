// Command shoal is Shoal's one binary; each subcommand lives in its own file.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"runtime"
	"runtime/debug"
	"syscall"
)

func main() {
	if runAsService() {
		return
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	m := &Main{Stdout: os.Stdout, Stderr: os.Stderr}
	if err := m.Run(ctx, os.Args[1:]); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			os.Exit(0)
		}
		if errors.Is(err, errUsage) {
			os.Exit(2)
		}
		fmt.Fprintln(os.Stderr, "shoal:", err)
		os.Exit(1)
	}
}

// Main holds what the subcommands write to, so tests can run them in-process.
type Main struct {
	Stdout, Stderr io.Writer
}

// errUsage means a usage message has already been printed.
var errUsage = errors.New("usage")

type command struct {
	name, summary string
	run           func(m *Main, ctx context.Context, args []string) error
}

var commands = []command{
	{"train", "train a job in this process, or on --workers N local worker processes", (*Main).runTrain},
	{"eval", "print {\"loss\", \"aux\"} of a checkpoint on the first N windows of a file", (*Main).runEval},
	{"sample", "generate text from a checkpoint", (*Main).runSample},
	{"serve", "run a coordinator: HTTP API, worker WebSockets, job loop, SQLite store", (*Main).runServe},
	{"worker", "join a coordinator and compute the shard it assigns", (*Main).runWorker},
	{"export", "write a coordinator's checkpoint as one whole-model safetensors file", (*Main).runExport},
	{"status", "print a coordinator's job, plan, peers, router load and recent events", (*Main).runStatus},
	{"simulate", "plan replicas for a synthetic fleet of N volunteers with churn; print goodput and stalls", (*Main).runSimulate},
}

func (m *Main) usage() {
	fmt.Fprintf(m.Stderr, `Shoal trains mixture-of-experts transformers on volunteered compute.

Usage: shoal <command> [flags]

Commands:
`)
	for _, c := range commands {
		fmt.Fprintf(m.Stderr, "  %-8s %s\n", c.name, c.summary)
	}
	fmt.Fprintf(m.Stderr, "\nRun 'shoal <command> --help' for a command's flags, 'shoal --version' for the build.\n")
}

// Run dispatches args (without the program name) to a subcommand.
func (m *Main) Run(ctx context.Context, args []string) error {
	if len(args) == 0 {
		m.usage()
		return errUsage
	}
	switch args[0] {
	case "-h", "-help", "--help", "help":
		m.usage()
		return nil
	case "-version", "--version", "version":
		fmt.Fprintln(m.Stdout, version())
		return nil
	}
	for _, c := range commands {
		if c.name == args[0] {
			return c.run(m, ctx, args[1:])
		}
	}
	fmt.Fprintf(m.Stderr, "shoal: unknown command %q\n\n", args[0])
	m.usage()
	return errUsage
}

// version is the module's version and the VCS revision it was built from, as the Go toolchain
// recorded them in the binary: enough to tell which code a coordinator or a worker runs.
func version() string {
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return "shoal: no build information in this binary"
	}
	v := bi.Main.Version
	if v == "" {
		v = "(devel)"
	}
	var rev, when string
	modified := false
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision":
			rev = s.Value
		case "vcs.time":
			when = s.Value
		case "vcs.modified":
			modified = s.Value == "true"
		}
	}
	out := "shoal " + v
	switch {
	case rev == "":
		out += ", no VCS revision recorded"
	default:
		out += ", revision " + rev
		if when != "" {
			out += " (" + when + ")"
		}
		if modified {
			out += " with local changes"
		}
	}
	return fmt.Sprintf("%s, %s %s/%s", out, bi.GoVersion, runtime.GOOS, runtime.GOARCH)
}

// newFlagSet makes a subcommand's flag set that reports errors instead of exiting.
func (m *Main) newFlagSet(name, synopsis string) *flag.FlagSet {
	fs := flag.NewFlagSet("shoal "+name, flag.ContinueOnError)
	fs.SetOutput(m.Stderr)
	fs.Usage = func() {
		fmt.Fprintf(m.Stderr, "Usage: shoal %s %s\n\nFlags:\n", name, synopsis)
		fs.PrintDefaults()
	}
	return fs
}

// parse parses args, turning flag errors into errUsage (the flag package has printed them).
func parse(fs *flag.FlagSet, args []string) error {
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return errUsage
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(fs.Output(), "%s: unexpected arguments %q\n", fs.Name(), fs.Args())
		return errUsage
	}
	return nil
}
