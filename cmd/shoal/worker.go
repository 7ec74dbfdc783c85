package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"runtime"
	"runtime/debug"
	"strings"

	"github.com/shoal-ml/shoal/client"
	"github.com/shoal-ml/shoal/kernels"
)

func (m *Main) runWorker(ctx context.Context, args []string) error {
	fs := m.newFlagSet("worker", "--coordinator URL [flags]")
	coord := fs.String("coordinator", "", "coordinator `URL` (http://host:port)")
	threads := fs.Int("threads", 0, "CPU threads for the kernels (default: all)")
	memory := fs.Int64("memory", 8<<30, "`BYTES` of memory this worker offers for its shard")
	name := fs.String("name", "", "a name for this worker in the coordinator's peer list")
	join := fs.String("join", "", "a private job's join `TOKEN` (from its join link)")
	logJSON := fs.Bool("log-json", false, "log as JSON instead of text")
	flagsUsage := fs.Usage
	fs.Usage = func() {
		flagsUsage()
		fmt.Fprintf(m.Stderr, `
Environment:
  SHOAL_FAULT=KIND
    	make this worker misbehave ON PURPOSE on every training step, to show that
    	the coordinator's audits catch it (never on a worker whose work should count);
    	KIND is one of %s
`, strings.Join(client.FaultKinds(), ", "))
	}
	if err := parse(fs, args); err != nil {
		return err
	}
	if *coord == "" {
		fs.Usage()
		return errors.Join(errUsage, errors.New("--coordinator is required"))
	}
	if *threads > 0 {
		runtime.GOMAXPROCS(*threads)
		kernels.SetThreads(*threads)
	}
	// The offer is a promise to the planner, which budgets the shard to fit it: the collector is
	// told to keep the heap under it (unless GOMEMLIMIT says otherwise), where by default it would
	// let the heap grow to twice what is live before collecting — a process twice its offer,
	// which is what gets a worker killed by the OS.
	if *memory > 0 && os.Getenv("GOMEMLIMIT") == "" {
		debug.SetMemoryLimit(*memory)
	}
	// RunWorker refuses an unknown kind, naming the kinds, before it joins.
	return client.RunWorker(ctx, client.WorkerConfig{Coordinator: *coord, Threads: kernels.Threads(),
		MemoryBytes: *memory, Name: *name, JoinToken: *join, Logger: m.logger(*logJSON), Fault: os.Getenv("SHOAL_FAULT")})
}
