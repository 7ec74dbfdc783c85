package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/shoal-ml/shoal/coordinator"
	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/local"
)

// clusterOptions are `shoal train --workers N`'s settings beyond the job.
type clusterOptions struct {
	workers int
	dataDir string // "" for a temporary directory
	out     string
	relay   bool
	threads int // per worker; 0 divides the CPUs among them
	onStep  func(local.Report)
	// beforePrint ends the progress line before other output.
	beforePrint func()
}

// runCluster trains spec on a coordinator in this process and opts.workers worker processes on
// loopback, and stops every process when the job ends or ctx is cancelled.
func (m *Main) runCluster(ctx context.Context, spec job.Spec, opts clusterOptions) error {
	dir := opts.dataDir
	if dir == "" {
		tmp, err := os.MkdirTemp("", "shoal-train-")
		if err != nil {
			return err
		}
		defer os.RemoveAll(tmp)
		dir = tmp
	} else if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	// The coordinator's own log goes to a file: the terminal shows the progress line.
	logf, err := os.Create(filepath.Join(dir, "coordinator.log"))
	if err != nil {
		return err
	}
	defer logf.Close()
	log := slog.New(slog.NewTextHandler(logf, nil))
	srv, err := coordinator.New(ctx, coordinator.Config{DataDir: dir, Job: &spec, Loopback: true, Relay: opts.relay,
		MinWorkers: opts.workers, OutDir: opts.out, OnStep: opts.onStep, Logger: log,
		OnPlan: func(p coordinator.PlanStatus) {
			opts.beforePrint()
			fmt.Fprintf(m.Stderr, "plan v%d:", p.Version)
			for i, st := range p.Stages {
				fmt.Fprintf(m.Stderr, "\n  stage %d: blocks [%d,%d) on %s", i, st.Blocks[0], st.Blocks[1], st.PeerName)
			}
			for _, h := range p.ExpertHosts {
				fmt.Fprintf(m.Stderr, "\n  expert host: block %d experts %v on %s", h.Block, h.Experts, h.PeerName)
			}
			if len(p.Standby) > 0 {
				fmt.Fprintf(m.Stderr, "\n  standby: %d", len(p.Standby))
			}
			fmt.Fprintln(m.Stderr)
		}})
	if err != nil {
		return err
	}
	defer srv.Close()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	hs := &http.Server{Handler: srv.Handler(), ReadHeaderTimeout: 10 * time.Second}
	go hs.Serve(ln)
	defer hs.Close()
	url := "http://" + ln.Addr().String()
	fmt.Fprintf(m.Stderr, "coordinator %s (data %s); starting %d workers\n", url, dir, opts.workers)

	threads := opts.threads
	if threads <= 0 {
		threads = max(1, runtime.NumCPU()/opts.workers)
	}
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	wctx, stopWorkers := context.WithCancel(context.WithoutCancel(ctx))
	var wg sync.WaitGroup
	for i := 0; i < opts.workers; i++ {
		wlog, err := os.Create(filepath.Join(dir, fmt.Sprintf("worker-%d.log", i)))
		if err != nil {
			stopWorkers()
			return err
		}
		cmd := exec.CommandContext(wctx, exe, "worker", "--coordinator", url, "--threads", strconv.Itoa(threads), "--name", fmt.Sprintf("local-%d", i))
		cmd.Stdout, cmd.Stderr = wlog, wlog
		cmd.Env = append(os.Environ(), "GOMAXPROCS="+strconv.Itoa(threads))
		// SIGTERM first, so that a worker says goodbye; SIGKILL if it lingers.
		cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGTERM) }
		cmd.WaitDelay = 5 * time.Second
		setParentDeathSignal(cmd)
		if err := cmd.Start(); err != nil {
			wlog.Close()
			stopWorkers()
			wg.Wait()
			return fmt.Errorf("start worker %d: %w", i, err)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			cmd.Wait()
			wlog.Close()
		}()
	}
	runErr := srv.Run(ctx)
	stopWorkers()
	wg.Wait()
	if errors.Is(runErr, context.Canceled) {
		return runErr
	}
	if runErr != nil {
		return fmt.Errorf("%w (logs in %s)", runErr, dir)
	}
	return nil
}
