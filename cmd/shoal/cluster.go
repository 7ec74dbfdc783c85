package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unicode/utf8"

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
	threads int    // per worker; 0 divides the CPUs among them
	memory  int64  // each worker's --memory; 0 leaves shoal worker's default
	device  string // each worker's --device; "" is cpu
	// cpuProfile: each worker writes a CPU profile to cpuProfile.local-N ("": none).
	cpuProfile string
	// cpu is told each worker's process, for the per-step CPU time --json prints (nil: none).
	cpu    *workerCPU
	onStep func(local.Report)
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
	adminToken := randomToken()
	history := &planHistory{path: ""}
	if opts.out != "" {
		if err := os.MkdirAll(opts.out, 0o755); err != nil {
			return err
		}
		history.path = filepath.Join(opts.out, PlansFile)
	}
	events := &eventPrinter{w: m.Stderr, before: opts.beforePrint, names: map[string]string{}}
	srv, err := coordinator.New(ctx, coordinator.Config{DataDir: dir, Job: &spec, Loopback: true, Relay: opts.relay,
		MinWorkers: opts.workers, OutDir: opts.out, Recompute: (&idleRecomputer{next: recompute}).recompute, OnStep: opts.onStep, Logger: log, AdminToken: adminToken, WasmDir: exeDir(),
		// Every local worker (and a browser tab) shares 127.0.0.1.
		MaxWorkersPerAddr: max(coordinator.DefaultMaxWorkersPerAddr, opts.workers+8),
		OnEvent:           events.print,
		OnPlan: func(p coordinator.PlanStatus) {
			if err := history.add(p); err != nil {
				fmt.Fprintf(m.Stderr, "record the plan: %v\n", err)
			}
			opts.beforePrint()
			fmt.Fprintf(m.Stderr, "plan v%d:", p.Version)
			if p.Replicas > 1 {
				fmt.Fprintf(m.Stderr, " %d pipeline replicas, %s sync", p.Replicas, p.Sync)
				if spec.Outer() && spec.Sync.Delay > 0 {
					fmt.Fprintf(m.Stderr, ", every outer step overlapping %s", plural(spec.Sync.Delay, "inner step"))
				}
				if spec.OwnBatches() {
					fmt.Fprintf(m.Stderr, ", a batch of its own for each (%s batches a step)", ownBatches(p, spec.MicroBatches))
				}
			}
			i := 0
			for k, st := range p.Stages {
				if p.Replicas > 1 && (k == 0 || st.Replica != p.Stages[k-1].Replica) {
					if n := st.MicroBatches[1] - st.MicroBatches[0]; spec.OwnBatches() && n == spec.MicroBatches {
						fmt.Fprintf(m.Stderr, "\n  replica %d: all %d micro-batches of its own batch", st.Replica, n)
					} else if spec.OwnBatches() {
						fmt.Fprintf(m.Stderr, "\n  replica %d: %s of its own batch (the job's batch is %d of %d rows)", st.Replica, plural(n, "micro-batch"), spec.MicroBatches, spec.BatchSize/spec.MicroBatches)
					} else {
						fmt.Fprintf(m.Stderr, "\n  replica %d: micro-batches [%d,%d) of %d", st.Replica, st.MicroBatches[0], st.MicroBatches[1], spec.MicroBatches)
					}
					i = 0
				}
				fmt.Fprintf(m.Stderr, "\n  stage %d: blocks [%d,%d) on %s", i, st.Blocks[0], st.Blocks[1], termText(st.PeerName))
				i++
			}
			for _, h := range p.ExpertHosts {
				fmt.Fprintf(m.Stderr, "\n  expert host: block %d experts %v on %s", h.Block, h.Experts, termText(h.PeerName))
			}
			if p.KeptFrom > 0 {
				fmt.Fprintf(m.Stderr, "\n  every shard kept from plan v%d at step %d, or taken from a pool mate: nothing restored", p.KeptFrom, p.FromStep)
			}
			for _, t := range slices.Sorted(maps.Keys(p.TookFrom)) {
				fmt.Fprintf(m.Stderr, "\n  %s took its stage's state from %s", t, p.TookFrom[t])
			}
			for _, d := range p.Dropped {
				fmt.Fprintf(m.Stderr, "\n  replica %d dropped: a worker of it left; the others carry on from step %d, without a restore", d.Replica, d.Step)
			}
			if len(p.Standby) > 0 {
				fmt.Fprintf(m.Stderr, "\n  standby: %d", len(p.Standby))
			}
			if p.Choice != "" {
				fmt.Fprintf(m.Stderr, "\n  planner: %s", p.Choice)
			}
			if p.Replicas > 1 {
				fmt.Fprintf(m.Stderr, "\n  in flight: depth %d (stage i of a replica holds up to min(S−i+%d, its micro-batches))", p.Depth, p.Depth)
			} else {
				fmt.Fprintf(m.Stderr, "\n  in flight: depth %d (stage i holds up to min(S−i+%d, %d) micro-batches)", p.Depth, p.Depth, spec.MicroBatches)
			}
			fmt.Fprintln(m.Stderr)
		}})
	if err != nil {
		return err
	}
	defer srv.Close()
	tcp, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	// Every peer of a local cluster shares 127.0.0.1, so a cap per address would only be a cap on
	// --workers: the cap in all is the one that means something here.
	ln := coordinator.LimitListener(tcp, coordinator.ConnLimits{Max: coordinator.DefaultMaxConns, Logger: log})
	hs := coordinator.NewHTTPServer(srv.Handler(), coordinator.HTTPLimits{Logger: log})
	go hs.Serve(ln)
	defer hs.Close()
	url := "http://" + ln.Addr().String()
	fmt.Fprintf(m.Stderr, "coordinator %s (data %s); starting %d workers\n", url, dir, opts.workers)
	fmt.Fprintf(m.Stderr, "dashboard %s/admin/ (admin token %s)\n", url, adminToken)
	if raw, _ := srv.WasmSize(); raw > 0 {
		// Browser tabs that join while the job runs become standbys or take work at the next
		// step boundary (a replan), like any worker that joins late.
		fmt.Fprintf(m.Stderr, "join from a browser on this machine: %s/ (press Start)\n", url)
	}

	threads := opts.threads
	if threads <= 0 {
		threads = max(1, runtime.NumCPU()/opts.workers)
	}
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	wctx, stopWorkers := context.WithCancel(context.WithoutCancel(ctx))
	// The workers are this run's own: when so many have exited (a ban, a crash) that the job's
	// pinned plan cannot be staffed, nobody will join to replace them, and waiting would hang.
	runCtx, stopRun := context.WithCancelCause(ctx)
	defer stopRun(nil)
	need := workersNeeded(spec)
	var alive atomic.Int64
	alive.Store(int64(opts.workers))
	var wg sync.WaitGroup
	// Each worker's CPU time, from the kernel's accounting once it has exited: what a volunteer's
	// machine spent, audits' evidence included (scripts/bench_audit.sh compares it).
	cpu := make([]time.Duration, opts.workers)
	for i := 0; i < opts.workers; i++ {
		wlog, err := os.Create(filepath.Join(dir, fmt.Sprintf("worker-%d.log", i)))
		if err != nil {
			stopWorkers()
			return err
		}
		// The CPU kernels unless asked, whatever GPU the machine has: the run is then bitwise
		// `shoal train`'s.
		device := opts.device
		if device == "" {
			device = "cpu"
		}
		// Each local worker is a volunteer of its own, kept in the run's directory rather than
		// the user's.
		args := []string{"worker", "--coordinator", url, "--threads", strconv.Itoa(threads), "--name", fmt.Sprintf("local-%d", i), "--device", device,
			"--identity", filepath.Join(dir, fmt.Sprintf("worker-%d.identity", i))}
		if opts.memory > 0 {
			args = append(args, "--memory", strconv.FormatInt(opts.memory, 10))
		}
		if opts.cpuProfile != "" {
			args = append(args, "--cpuprofile", fmt.Sprintf("%s.local-%d", opts.cpuProfile, i))
		}
		cmd := exec.CommandContext(wctx, exe, args...)
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
		opts.cpu.started(i, cmd.Process.Pid)
		wg.Add(1)
		go func() {
			defer wg.Done()
			err := cmd.Wait()
			wlog.Close()
			if ps := cmd.ProcessState; ps != nil {
				cpu[i] = ps.UserTime() + ps.SystemTime()
				opts.cpu.exited(i, cpu[i])
			}
			if left := alive.Add(-1); left < int64(need) && wctx.Err() == nil {
				stopRun(fmt.Errorf("worker local-%d exited (%v; see %s), and the %d left cannot staff a plan of %d", i, err, wlog.Name(), left, need))
			}
		}()
	}
	runErr := srv.Run(runCtx)
	if cause := context.Cause(runCtx); runErr != nil && cause != nil && !errors.Is(cause, context.Canceled) {
		runErr = cause
	}
	stopWorkers()
	wg.Wait()
	for i, c := range cpu {
		fmt.Fprintf(m.Stderr, "worker local-%d: %.2f CPU-s\n", i, c.Seconds())
	}
	if errors.Is(runErr, context.Canceled) {
		return runErr
	}
	if runErr != nil {
		return fmt.Errorf("%w (logs in %s)", runErr, dir)
	}
	return nil
}

// ownBatches is how many of the job's batches of M micro-batches a step of plan p trains with own
// batches: Σ n_r / M over its replicas, a whole number when every replica trains M (one batch
// each), else to three decimals.
func ownBatches(p coordinator.PlanStatus, M int) string {
	n := 0
	for k, st := range p.Stages {
		if k == 0 || st.Replica != p.Stages[k-1].Replica {
			n += st.MicroBatches[1] - st.MicroBatches[0]
		}
	}
	if n%M == 0 {
		return strconv.Itoa(n / M)
	}
	return strconv.FormatFloat(float64(n)/float64(M), 'f', 3, 64)
}

// workersNeeded is how many workers the job's plan needs at the least: a pinned plan's first
// replica, or its stages and expert hosts; 1 for the planner's, which plans over whoever is there.
func workersNeeded(spec job.Spec) int {
	p := spec.Plan
	switch {
	case p == nil:
		return 1
	case len(p.Replicas) > 0:
		return len(p.Replicas[0].Stages)
	}
	hosts := map[int]bool{}
	for _, e := range p.Experts {
		hosts[e.Host] = true
	}
	return len(p.Stages) + len(hosts)
}

// eventPrinter tells the person watching `shoal train --workers` about departures, abandoned steps
// and recoveries, between progress lines.
type eventPrinter struct {
	w      io.Writer
	before func()
	names  map[string]string // worker id → name, from join events
}

func (e *eventPrinter) print(kind, worker, detail string) {
	var d map[string]any
	json.Unmarshal([]byte(detail), &d)
	name := e.names[worker]
	if name == "" {
		name = termText(worker)
	}
	var msg string
	switch kind {
	case "worker.joined":
		if n, _ := d["name"].(string); n != "" {
			e.names[worker] = termText(n)
		}
		return
	case "worker.left":
		msg = fmt.Sprintf("peer %s left: %s", name, termText(d["reason"]))
	case "step.abandoned":
		msg = fmt.Sprintf("step %v abandoned (%s); restarting every shard from the newest complete checkpoint", d["step"], termText(d["error"]))
	case "plan.failed":
		msg = fmt.Sprintf("the plan could not start (%s); planning again", termText(d["error"]))
	case "replan.join":
		msg = fmt.Sprintf("new peers are waiting: replanning at step %v", d["step"])
	case "replan.drift":
		msg = fmt.Sprintf("expert load drifted: re-placing experts at step %v", d["step"])
	case "job.paused":
		msg = fmt.Sprintf("job paused: %s", termText(d["reason"]))
	case "peer.banned":
		msg = fmt.Sprintf("peer %s BANNED at step %v: %s", name, d["step"], termText(d["reason"]))
	case "job.rollback":
		msg = fmt.Sprintf("rolling back to step %v without the banned peer (%v checkpoints discarded)", d["to_step"], d["checkpoints_discarded"])
	case "audit.inconclusive":
		msg = fmt.Sprintf("audit of %s's step %v inconclusive: %s", name, d["step"], termText(d["reason"]))
	default:
		return
	}
	e.before()
	fmt.Fprintln(e.w, "! "+msg)
}

// termText makes what a peer said or caused (a name, an error's text) fit to print on the
// terminal: escape sequences and other control characters, which could rewrite the screen or
// forge lines, become '?', and it is cut at maxTermText bytes.
func termText(v any) string {
	const maxTermText = 300
	s := strings.ToValidUTF8(fmt.Sprint(v), "?")
	s = strings.Map(func(r rune) rune {
		if r < 0x20 || r == 0x7f || (r >= 0x80 && r < 0xa0) || r == 0x2028 || r == 0x2029 ||
			(r >= 0x202a && r <= 0x202e) || (r >= 0x2066 && r <= 0x2069) {
			return '?'
		}
		return r
	}, s)
	if len(s) > maxTermText {
		cut := maxTermText
		for cut > 0 && !utf8.RuneStart(s[cut]) {
			cut--
		}
		s = s[:cut] + "…"
	}
	return s
}

func randomToken() string {
	var b [16]byte
	rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// PlansFile is where `shoal train --workers --out DIR` records the replicas its plans ran, from
// which step: what `shoal train --replay` needs to compute the same steps in one process in outer
// mode, where the replicas are part of what is computed.
const PlansFile = "plans.json"

// planHistory is the replicas of the plans a run ran, as local.Replay takes them.
type planHistory struct {
	path    string // "" records nothing
	periods []local.Period
}

// add records plan p: the steps from p.FromStep on are p's (a plan restored to an earlier step
// replaces whatever ran from there), and rewrites the file.
func (h *planHistory) add(p coordinator.PlanStatus) error {
	if h.path == "" {
		return nil
	}
	h.periods = p.Period().Then(h.periods)
	b, err := json.MarshalIndent(h.periods, "", "  ")
	if err != nil {
		return err
	}
	tmp := h.path + ".tmp"
	if err := os.WriteFile(tmp, append(b, '\n'), 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, h.path)
}
