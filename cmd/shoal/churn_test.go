package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"text/tabwriter"
	"time"

	"github.com/shoal-ml/shoal/coordinator"
	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/local"
	"github.com/shoal-ml/shoal/model"
)

// TestChurnSoak is the churn soak of issue 30 (`make churn`; never part of `make test`): the
// default job on a coordinator in this process and SHOAL_CHURN_WORKERS (8) worker processes on
// loopback, run once without churn (the baseline) and once with a random worker SIGKILLed and a
// fresh one started every SHOAL_CHURN_EVERY (10 s), each for SHOAL_CHURN_DURATION (5m) of
// training, in step mode and in outer mode (an outer step every 5 steps, int8). It prints per run
// what the departures cost — plans, checkpoint restores, steps replayed, replicas dropped, work
// rerouted, rollbacks — the training throughput over the window and its ratio to the baseline's,
// and whether the final state is the one-process run's bit for bit. It fails only on a run that
// does not train or a final state that differs, never on a count or a rate.
//
// SHOAL_CHURN_MODES (step,outer), SHOAL_CHURN_SEED (which workers are killed; 0 draws one),
// SHOAL_CHURN_STEPS (the job's steps, 100000: the window ends each run, not the job),
// SHOAL_CHURN_WARMUP (outer mode's synchronous warm-up in steps; 0, the default, none),
// SHOAL_CHURN_DELAY (outer mode's delay τ below its every 5: departures during the delayed
// exchange are redone without a restore; 0, the default, none), SHOAL_CHURN_OWN (1: outer mode's
// replicas train batches of their own, so that joins grow new replicas or take the planner's plan
// up from peers, outerReshape; 0, the default, shared batches), SHOAL_CHURN_VANISH (1: a departure
// is a SIGSTOP, not a SIGKILL — a machine that vanishes, its sockets open, noticed only by its
// silence: the heartbeat timeout, or the quick timeout where the job waits on it; the process is
// SIGKILLed 20 s later),
// SHOAL_CHURN_REPLICAS (step mode pinned to that many whole-model replicas: pools; 0, the default,
// leaves the plan to the planner), SHOAL_CHURN_STAGES (those replicas each cut into that many
// stages alike, 1 by default: a lost stage is then taken over by its pool mate), SHOAL_CHURN_KEEP (the coordinator's --keep-checkpoints; 0, the
// default, keeps every checkpoint) and SHOAL_CHURN_DIR (keep the runs' logs and data there)
// change the rest. Without SHOAL_CHURN_DIR each run's data directory, export and one-process
// replay are removed once it is checked: in outer mode each checkpoint, assembled file, export and
// replay checkpoint of the default job is half a gigabyte, and the runs would otherwise pile up
// in the temporary directory until the test ends.
func TestChurnSoak(t *testing.T) {
	if os.Getenv("SHOAL_CHURN") != "1" {
		t.Skip("the churn soak runs with SHOAL_CHURN=1 (make churn)")
	}
	killerTest(t)
	cfg := churnConfig{
		window:    envDuration(t, "SHOAL_CHURN_DURATION", 5*time.Minute),
		every:     envDuration(t, "SHOAL_CHURN_EVERY", 10*time.Second),
		workers:   envInt(t, "SHOAL_CHURN_WORKERS", 8),
		replicas:  envInt(t, "SHOAL_CHURN_REPLICAS", 0),
		stages:    envInt(t, "SHOAL_CHURN_STAGES", 1),
		steps:     envInt(t, "SHOAL_CHURN_STEPS", 100000),
		warmup:    envInt(t, "SHOAL_CHURN_WARMUP", 0),
		delay:     envInt(t, "SHOAL_CHURN_DELAY", 0),
		own:       envInt(t, "SHOAL_CHURN_OWN", 0) == 1,
		vanish:    envInt(t, "SHOAL_CHURN_VANISH", 0) == 1,
		seed:      uint64(envInt(t, "SHOAL_CHURN_SEED", 0)),
		keepCkpts: envInt(t, "SHOAL_CHURN_KEEP", 0),
		dir:       os.Getenv("SHOAL_CHURN_DIR"),
	}
	if cfg.seed == 0 {
		cfg.seed = uint64(time.Now().UnixNano())
	}
	cfg.keepData = cfg.dir != ""
	if cfg.dir == "" {
		cfg.dir = t.TempDir()
	}
	modes := strings.Split(os.Getenv("SHOAL_CHURN_MODES"), ",")
	if modes[0] == "" {
		modes = []string{job.SyncStep, job.SyncOuter}
	}
	// A worker's kernels get its share of the cores, as shoal train --workers gives them.
	cfg.threads = max(1, runtime.NumCPU()/cfg.workers)
	t.Setenv("GOMAXPROCS", strconv.Itoa(cfg.threads))
	fmt.Printf("churn soak: seed %d (SHOAL_CHURN_SEED=%d replays the kills), data in %s\n", cfg.seed, cfg.seed, cfg.dir)
	var rows []churnResult
	for _, mode := range modes {
		if mode != job.SyncStep && mode != job.SyncOuter {
			t.Fatalf("SHOAL_CHURN_MODES: %q is no sync mode (step, outer)", mode)
		}
		for _, churn := range []bool{false, true} {
			r := churnRun(t, cfg, mode, churn)
			rows = append(rows, r)
			fmt.Printf("churn soak: %s %s done: %.0f tokens/s, %d restores, equivalence %s\n", mode, r.run, r.tokensPerS, r.restores, r.equal)
		}
	}
	printChurnReport(os.Stdout, cfg, rows)
}

// churnConfig is the soak's settings.
type churnConfig struct {
	window, every  time.Duration
	workers, steps int
	// warmup is outer mode's synchronous warm-up (job.Sync.Warmup): step mode for that many steps
	// first, so that the switch to outer mode happens under churn; 0, the default, has none.
	warmup int
	// delay is outer mode's delay (job.Sync.Delay), below its every 5; 0, the default, none.
	delay int
	// own: outer mode's replicas train batches of their own (job.BatchesOwn).
	own bool
	// vanish: a departure is a SIGSTOP (a machine gone silent), SIGKILLed vanishAfter later.
	vanish bool
	// replicas, when set, pins step mode to that many whole-model replicas sharing the step's
	// micro-batches (the default job's planner keeps one pipeline and expert hosts, which no
	// departure leaves a twin of): a pool of that many for every block.
	replicas int
	stages   int // each pinned replica's stages, cut alike
	threads  int // each worker's --threads
	seed     uint64
	// keepCkpts is the coordinator's KeepCheckpoints (0: every checkpoint is kept).
	keepCkpts int
	dir       string
	// keepData keeps each run's data directory, export and replay (SHOAL_CHURN_DIR was given);
	// otherwise they are removed as soon as the run is checked.
	keepData bool
}

// churnResult is what one run measured.
type churnResult struct {
	mode, run string
	kills     int
	// from, to: the job's step at the window's start and end (the steps before to that were kept:
	// a restore under way at the end counts back to where it restarts).
	from, to   int
	computed   int     // step reports in the window, a replayed step again each time
	tokensPerS float64 // (to−from)·B·T over the window
	// From the job's events, from the first plan to the final checkpoint.
	plans, restores, replayed, dropped, rerouted, poolJoined, rollbacks, abandoned, joinReplans, driftReplans int
	final                                                                                                     int    // the step of the final checkpoint
	equal                                                                                                     string // the equivalence check's verdict
}

// churnSpec is the default job (as `make demo` trains it) with steps steps, in sync mode mode
// (outer mode after a synchronous warm-up of warmup steps).
func churnSpec(mode string, steps, replicas, stages, warmup, delay int, own bool) job.Spec {
	s := job.Default()
	s.Steps = steps
	if replicas > 0 && mode == job.SyncStep {
		s.Plan = &job.Plan{}
		var cuts [][2]int
		for k := range stages {
			cuts = append(cuts, [2]int{k * s.Model.NLayer / stages, (k + 1) * s.Model.NLayer / stages})
		}
		for r := range replicas {
			n := s.MicroBatches/replicas + min(1, max(0, s.MicroBatches%replicas-r))
			s.Plan.Replicas = append(s.Plan.Replicas, job.ReplicaPlan{Stages: cuts, MicroBatches: n})
		}
	}
	if mode == job.SyncOuter {
		s.Sync = &job.Sync{Mode: job.SyncOuter, Every: 5, OuterLR: 0.7, OuterMomentum: 0.9, Compress: "int8", Warmup: &warmup, Delay: delay}
		if own {
			s.Sync.Batches = job.BatchesOwn
		}
	}
	return s
}

// churnRecorder keeps what the coordinator reports — steps, events, plans — for the soak to wait
// on and count.
type churnRecorder struct {
	mu      sync.Mutex
	changed chan struct{} // closed and replaced at every record
	reports []churnReport
	events  []churnEvent
	last    int // the step after the latest report
}

type churnReport struct {
	at  time.Time
	rep local.Report
}

type churnEvent struct {
	at     time.Time
	kind   string
	detail map[string]any
	// before is the step after the latest report when the event came: where the job stood.
	before int
}

func newChurnRecorder() *churnRecorder { return &churnRecorder{changed: make(chan struct{})} }

func (c *churnRecorder) notify() {
	close(c.changed)
	c.changed = make(chan struct{})
}

func (c *churnRecorder) step(r local.Report) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.reports = append(c.reports, churnReport{time.Now(), r})
	c.last = r.Step + 1
	c.notify()
}

func (c *churnRecorder) event(kind, worker, detail string) {
	var d map[string]any
	json.Unmarshal([]byte(detail), &d)
	c.mu.Lock()
	defer c.mu.Unlock()
	c.events = append(c.events, churnEvent{time.Now(), kind, d, c.last})
	c.notify()
}

// await waits until ok holds of what was recorded (called under the lock), ctx ends or limit
// passes, and reports whether ok held.
func (c *churnRecorder) await(ctx context.Context, limit time.Duration, ok func() bool) bool {
	deadline := time.NewTimer(limit)
	defer deadline.Stop()
	for {
		c.mu.Lock()
		held, ch := ok(), c.changed
		c.mu.Unlock()
		if held {
			return true
		}
		select {
		case <-ch:
		case <-deadline.C:
			return false
		case <-ctx.Done():
			return false
		}
	}
}

// churnRun runs the job in sync mode mode on cfg.workers worker processes for cfg.window of
// training, with churn or without, then takes a checkpoint, exports it and checks it against one
// process computing the same steps.
func churnRun(t *testing.T, cfg churnConfig, mode string, churn bool) churnResult {
	res := churnResult{mode: mode, run: "baseline"}
	if churn {
		res.run = "churn"
	}
	dir := filepath.Join(cfg.dir, mode+"-"+res.run)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	spec := churnSpec(mode, cfg.steps, cfg.replicas, cfg.stages, cfg.warmup, cfg.delay, cfg.own)
	logf, err := os.Create(filepath.Join(dir, "coordinator.log"))
	if err != nil {
		t.Fatal(err)
	}
	defer logf.Close()
	token := randomToken()
	history := &planHistory{path: filepath.Join(dir, PlansFile)}
	rec := newChurnRecorder()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	dataDir := filepath.Join(dir, "data")
	srv, err := coordinator.New(ctx, coordinator.Config{DataDir: dataDir, Job: &spec, Loopback: true,
		MinWorkers: cfg.workers, KeepCheckpoints: cfg.keepCkpts, Recompute: recompute, Logger: slog.New(slog.NewTextHandler(logf, nil)), AdminToken: token,
		// Every worker shares 127.0.0.1, and each fresh one is a new worker.
		MaxWorkersPerAddr: coordinator.DefaultMaxWorkersPerAddr + cfg.workers,
		OnStep:            rec.step, OnEvent: rec.event,
		OnPlan: func(p coordinator.PlanStatus) {
			if err := history.add(p); err != nil {
				t.Errorf("record the plan: %v", err)
			}
		}})
	if err != nil {
		t.Fatal(err)
	}
	closed := false
	closeServer := func() {
		if !closed {
			srv.Close()
			closed = true
		}
	}
	defer closeServer()
	tcp, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	hs := coordinator.NewHTTPServer(srv.Handler(), coordinator.HTTPLimits{})
	go hs.Serve(tcp)
	defer hs.Close()
	url := "http://" + tcp.Addr().String()
	ran := make(chan error, 1)
	go func() { ran <- srv.Run(ctx) }()

	fleet := &churnFleet{t: t, dir: dir, url: url, threads: cfg.threads, vanish: cfg.vanish}
	defer fleet.stop()
	for range cfg.workers {
		fleet.start()
	}
	// The window opens with the first step's report: planning and loading are not churn's cost.
	var start time.Time
	if !rec.await(ctx, 10*time.Minute, func() bool {
		if len(rec.reports) > 0 {
			start, res.from = rec.reports[0].at, rec.reports[0].rep.Step+1
			return true
		}
		return false
	}) {
		t.Fatalf("%s %s: no step within 10 minutes (logs in %s)", mode, res.run, dir)
	}
	end := start.Add(cfg.window)
	rng := rand.New(rand.NewPCG(cfg.seed, uint64(len(mode))))
	for next := start.Add(cfg.every); ; next = next.Add(cfg.every) {
		if !churn || !next.Before(end) {
			next = end
		}
		select {
		case err := <-ran:
			t.Fatalf("%s %s: the job ended in the window: %v (logs in %s)", mode, res.run, err, dir)
		case <-time.After(time.Until(next)):
		}
		if !next.Before(end) {
			break
		}
		fleet.churn(rng)
		res.kills++
	}
	// The steps kept at the end: a restore under way goes back to the step it restarts from,
	// which the first report after the window shows.
	rec.mu.Lock()
	res.to = rec.last
	for _, r := range rec.reports {
		if r.at.Before(end) {
			res.computed++
		}
	}
	seen := len(rec.reports)
	rec.mu.Unlock()
	if rec.await(ctx, 5*time.Minute, func() bool { return len(rec.reports) > seen }) {
		rec.mu.Lock()
		res.to = min(res.to, rec.reports[seen].rep.Step)
		rec.mu.Unlock()
	}

	// The final state: a checkpoint asked for now, taken at the step the job is at.
	ck, err := churnCheckpoint(ctx, url, token, rec)
	if err != nil {
		t.Fatalf("%s %s: the final checkpoint: %v (logs in %s)", mode, res.run, err, dir)
	}
	res.final = ck.step
	rec.mu.Lock()
	upTo := len(rec.events) // what the run cost, not its shutdown
	rec.mu.Unlock()
	cancel()
	if err := <-ran; err != nil && !errors.Is(err, context.Canceled) {
		t.Errorf("%s %s: the coordinator: %v", mode, res.run, err)
	}
	fleet.stop()
	hs.Close()
	closeServer()
	countChurnEvents(rec, upTo, &res)
	tokens, err := trainedTokens(spec, dir, res.from, res.to)
	if err != nil {
		t.Fatalf("%s %s: %v", mode, res.run, err)
	}
	res.tokensPerS = float64(tokens) / cfg.window.Seconds()

	got := filepath.Join(dir, "final.safetensors")
	if _, stderr, err := run(t, "export", "--data-dir", dataDir, "--checkpoint", strconv.FormatInt(ck.id, 10), "--out", got); err != nil {
		t.Fatalf("export: %v\n%s", err, stderr)
	}
	res.equal = churnEquivalence(t, spec, dir, got, ck, rec)
	if !cfg.keepData {
		// What is left is its logs and plans.json, a few megabytes.
		for _, p := range []string{dataDir, got, filepath.Join(dir, "one")} {
			if err := os.RemoveAll(p); err != nil {
				t.Errorf("remove %s: %v", p, err)
			}
		}
	}
	return res
}

// TestTrainedTokens: the soak's count of what a window trained. With own batches a step counts
// each replica's own batch, and a dropped replica's none from its drop on: three replicas of 4,
// 2 and 2 micro-batches, replica 1 dropped from step 3 and replica 1 grown again at step 5.
func TestTrainedTokens(t *testing.T) {
	spec := job.Default()
	spec.Sync = &job.Sync{Mode: job.SyncOuter, Every: 5, Batches: job.BatchesOwn}
	dir := t.TempDir()
	reps := []job.ReplicaPlan{{MicroBatches: 4}, {MicroBatches: 2}, {MicroBatches: 2}}
	periods := []local.Period{{From: 0, Replicas: reps}, {From: 3, Replicas: reps, Dropped: []int{1}}, {From: 5, Replicas: reps, Grown: []int{1}}}
	b, err := json.Marshal(periods)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, PlansFile), b, 0o644); err != nil {
		t.Fatal(err)
	}
	row := spec.BatchSize / spec.MicroBatches * spec.Model.BlockSize // a micro-batch's tokens
	got, err := trainedTokens(spec, dir, 2, 6)                       // steps 2, 3, 4, 5
	if want := (8 + 6 + 6 + 8) * row; err != nil || got != want {
		t.Errorf("own batches, steps 2–5: %d tokens (%v), want %d", got, err, want)
	}
	spec.Sync.Batches = ""
	if got, err := trainedTokens(spec, dir, 2, 6); err != nil || got != 4*spec.BatchSize*spec.Model.BlockSize {
		t.Errorf("shared batches: %d tokens (%v), want four steps of B·T", got, err)
	}
}

// trainedTokens is what steps [from, to) of the job in dir trained: B·T a step, or with own
// batches (outer mode) each replica's own batch, n_r micro-batches of B/M rows of T tokens, but
// none of a replica the plans (PlansFile) dropped, which trains nothing from its drop on — so that
// a step with replicas dropped counts what it trained, not a whole step's.
func trainedTokens(spec job.Spec, dir string, from, to int) (int, error) {
	per := spec.BatchSize * spec.Model.BlockSize
	if !spec.OwnBatches() {
		return (to - from) * per, nil
	}
	b, err := os.ReadFile(filepath.Join(dir, PlansFile))
	if err != nil {
		return 0, err
	}
	var periods []local.Period
	if err := json.Unmarshal(b, &periods); err != nil {
		return 0, fmt.Errorf("%s: %w", PlansFile, err)
	}
	total := 0
	for s := from; s < to; s++ {
		i := len(periods) - 1
		for i >= 0 && periods[i].From > s {
			i--
		}
		if i < 0 {
			total += per // the synchronous warm-up's step mode
			continue
		}
		for r, rp := range periods[i].Replicas {
			if !slices.Contains(periods[i].Dropped, r) {
				total += rp.MicroBatches * per / spec.MicroBatches
			}
		}
	}
	return total, nil
}

// churnFleet is the soak's worker processes.
type churnFleet struct {
	t        *testing.T
	dir, url string
	threads  int
	vanish   bool // churn SIGSTOPs (SIGKILLing vanishAfter later) instead of SIGKILLing
	n        int  // workers started
	live     []*proc
	dead     []*proc
}

func (f *churnFleet) start() {
	name := fmt.Sprintf("w%03d", f.n)
	f.n++
	f.live = append(f.live, startProc(f.t, f.dir, name, "worker", "--coordinator", f.url, "--threads", strconv.Itoa(f.threads),
		"--name", name, "--device", "cpu", "--identity", filepath.Join(f.dir, name+".identity")))
}

// vanishAfter is how long a vanished worker stays stopped before it is SIGKILLed: well past the
// heartbeat timeout, so that the coordinator noticed its silence, not its closed sockets.
const vanishAfter = 20 * time.Second

// churn SIGKILLs a random live worker — or SIGSTOPs it, with vanish — and starts a fresh one.
func (f *churnFleet) churn(rng *rand.Rand) {
	i := rng.IntN(len(f.live))
	if p := f.live[i]; f.vanish {
		p.stop()
		time.AfterFunc(vanishAfter, p.kill)
	} else {
		p.kill()
	}
	f.dead = append(f.dead, f.live[i])
	f.live = slices.Delete(f.live, i, i+1)
	f.start()
}

// stop SIGKILLs the workers left and waits for every process to exit.
func (f *churnFleet) stop() {
	f.dead, f.live = append(f.dead, f.live...), nil
	for _, p := range f.dead {
		p.kill() // the live, and the vanished not yet killed
	}
	for _, p := range f.dead {
		select {
		case <-p.done:
		case <-time.After(30 * time.Second):
			f.t.Errorf("worker %s did not exit within 30 s of SIGKILL", p.name)
		}
	}
	f.dead = nil
}

type churnCkpt struct {
	id   int64
	step int
}

// churnCheckpoint asks the coordinator for a checkpoint of the step the job is at (POST
// /api/checkpoint) and waits for it to complete; asked while the job replans, or superseded by
// a replan's restore, it asks again.
func churnCheckpoint(ctx context.Context, url, token string, rec *churnRecorder) (churnCkpt, error) {
	deadline := time.Now().Add(10 * time.Minute)
	var lastErr error
	for time.Now().Before(deadline) {
		rec.mu.Lock()
		seen := len(rec.events)
		rec.mu.Unlock()
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url+"/api/checkpoint", nil)
		req.Header.Set("Authorization", "Bearer "+token)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return churnCkpt{}, err
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusNoContent {
			// No plan running (a replan under way): ask again shortly.
			lastErr = fmt.Errorf("POST /api/checkpoint: %s %s", resp.Status, b)
			time.Sleep(2 * time.Second)
			continue
		}
		// The checkpoint asked for is the first complete one, after the command, of at least
		// the step the command names.
		var ck churnCkpt
		asked := -1
		if rec.await(ctx, 3*time.Minute, func() bool {
			for _, e := range rec.events[seen:] {
				switch {
				case e.kind == "admin.checkpoint" && asked < 0:
					asked = int(num(e.detail["step"]))
				case e.kind == "checkpoint.complete" && asked >= 0 && int(num(e.detail["step"])) >= asked:
					ck = churnCkpt{id: int64(num(e.detail["id"])), step: int(num(e.detail["step"]))}
					return true
				}
			}
			return false
		}) {
			return ck, nil
		}
		lastErr = fmt.Errorf("the checkpoint asked for at step %d did not complete within 3 minutes", asked)
	}
	return churnCkpt{}, lastErr
}

// planChangedBefore says whether the last plan change recorded at checkpoint ck's step (a plan
// from that step, a replica dropped from it) came before the checkpoint was complete.
func (rec *churnRecorder) planChangedBefore(ck churnCkpt) bool {
	rec.mu.Lock()
	defer rec.mu.Unlock()
	before, done := false, false
	for _, e := range rec.events {
		switch {
		case e.kind == "checkpoint.complete" && int64(num(e.detail["id"])) == ck.id:
			done = true
		case e.kind == "plan" && int(num(e.detail["from_step"])) == ck.step,
			e.kind == "replica.dropped" && int(num(e.detail["step"])) == ck.step:
			before = !done
		}
	}
	return before
}

func num(v any) float64 {
	f, _ := v.(float64)
	return f
}

// countChurnEvents counts what the job's events say the departures and joins cost. A plan after
// the first restores every shard from a checkpoint, unless it says it kept them ("kept": true:
// a departure handled without a restore); the steps it replays are those between its from_step
// and where the job stood.
func countChurnEvents(rec *churnRecorder, upTo int, res *churnResult) {
	rec.mu.Lock()
	defer rec.mu.Unlock()
	for _, e := range rec.events[:upTo] {
		switch e.kind {
		case "plan":
			res.plans++
			if res.plans > 1 {
				if kept, _ := e.detail["kept"].(bool); !kept {
					res.restores++
				}
				res.replayed += max(0, e.before-int(num(e.detail["from_step"])))
			}
		case "replica.dropped":
			res.dropped++
		case "work.rerouted":
			res.rerouted++
		case "pool.joined":
			res.poolJoined++
		case "job.rollback":
			res.rollbacks++
		case "step.abandoned":
			res.abandoned++
		case "replan.join":
			res.joinReplans++
		case "replan.drift":
			res.driftReplans++
		}
	}
}

// churnEquivalence checks the final checkpoint got (ck, after step ck.step) against one process:
// `shoal train` of the job in step mode, `shoal train --replay` of the recorded membership in
// outer mode, stopped after the same step. Every tensor — parameters, optimizer moments, outer
// mode's replica and outer state — must be bitwise the same, and so must every step's losses (a
// step's last report counting, as a replayed step reports again).
func churnEquivalence(t *testing.T, spec job.Spec, dir, got string, ck churnCkpt, rec *churnRecorder) string {
	step := ck.step
	opts := local.Options{Out: filepath.Join(dir, "one")}
	what := "shoal train"
	if spec.Outer() {
		// A plan that changed at the checkpoint's very step before it was taken (a grow, a drop)
		// is in it: the replay takes that period up before it writes its own.
		opts.PlanAtStop = rec.planChangedBefore(ck)
		b, err := os.ReadFile(filepath.Join(dir, PlansFile))
		if err != nil {
			t.Fatal(err)
		}
		if err := json.Unmarshal(b, &opts.Replay); err != nil {
			t.Fatal(err)
		}
		what = "shoal train --replay"
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var want []local.Report
	opts.OnStep = func(r local.Report) {
		want = append(want, r)
		if r.Step+1 >= step {
			cancel()
		}
	}
	if _, err := local.Run(ctx, spec, opts); !errors.Is(err, context.Canceled) {
		t.Fatalf("%s to step %d: %v", what, step, err)
	}
	a, err := model.LoadCheckpoint(got)
	if err != nil {
		t.Fatal(err)
	}
	b, err := model.LoadCheckpoint(filepath.Join(opts.Out, local.CheckpointName(step)))
	if err != nil {
		t.Fatal(err)
	}
	var bad []string
	if a.Step != b.Step {
		bad = append(bad, fmt.Sprintf("checkpoint after step %d, %s's after %d", a.Step, what, b.Step))
	}
	var names []string
	for n := range b.Tensors {
		names = append(names, n)
	}
	for n := range a.Tensors {
		if _, ok := b.Tensors[n]; !ok {
			names = append(names, n)
		}
	}
	slices.Sort(names)
	for _, n := range names {
		x, inA := a.Tensors[n]
		y, inB := b.Tensors[n]
		switch {
		case !inA:
			bad = append(bad, fmt.Sprintf("%s only in %s's checkpoint", n, what))
		case !inB:
			bad = append(bad, fmt.Sprintf("%s only in the cluster's checkpoint", n))
		case len(x.Data) != len(y.Data):
			bad = append(bad, fmt.Sprintf("%s: %d values, %s %d", n, len(x.Data), what, len(y.Data)))
		default:
			for i := range x.Data {
				if math.Float32bits(x.Data[i]) != math.Float32bits(y.Data[i]) {
					bad = append(bad, fmt.Sprintf("%s[%d] = %v, %s %v", n, i, x.Data[i], what, y.Data[i]))
					break
				}
			}
		}
	}
	// The cluster's losses: each step's last report.
	rec.mu.Lock()
	var losses []local.Report
	for _, r := range rec.reports {
		if r.rep.Step < len(losses) {
			losses = losses[:r.rep.Step]
		}
		if r.rep.Step == len(losses) {
			losses = append(losses, r.rep)
		}
	}
	rec.mu.Unlock()
	for i := range min(len(losses), len(want), step) {
		if losses[i].CE != want[i].CE || losses[i].Aux != want[i].Aux {
			bad = append(bad, fmt.Sprintf("step %d loss %v aux %v, %s %v %v", i, losses[i].CE, losses[i].Aux, what, want[i].CE, want[i].Aux))
			break
		}
	}
	if len(bad) > 0 {
		t.Errorf("the final checkpoint is not %s's (%d differences; logs in %s):\n%s", what, len(bad), dir, strings.Join(bad[:min(len(bad), 10)], "\n"))
		return "DIFFERS"
	}
	return fmt.Sprintf("bitwise (%d tensors)", len(names))
}

// printChurnReport prints the soak's two tables, a row per run: what it trained and what its
// departures and joins cost.
func printChurnReport(w io.Writer, cfg churnConfig, rows []churnResult) {
	how := "SIGKILLed"
	if cfg.vanish {
		how = fmt.Sprintf("SIGSTOPped (SIGKILLed %s later)", vanishAfter)
	}
	fmt.Fprintf(w, "\nchurn soak: the default job, %d workers × %d thread(s), a window of %s per run; churn: a random worker\n%s and a fresh one started every %s\n\n",
		cfg.workers, cfg.threads, cfg.window, how, cfg.every)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "mode\trun\tkills\tsteps kept\tsteps run\ttokens/s\t÷ baseline\tfinal step\tequivalence\t")
	base := map[string]float64{}
	for _, r := range rows {
		ratio := "-"
		if r.run == "baseline" {
			base[r.mode] = r.tokensPerS
		} else if b := base[r.mode]; b > 0 {
			ratio = fmt.Sprintf("%.2f", r.tokensPerS/b)
		}
		fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%d\t%.0f\t%s\t%d\t%s\t\n", r.mode, r.run, r.kills, r.to-r.from, r.computed, r.tokensPerS, ratio, r.final, r.equal)
	}
	tw.Flush()
	fmt.Fprintln(w)
	fmt.Fprintln(tw, "mode\trun\tplans\trestores\tsteps replayed\tdropped\trerouted\tpool joins\trollbacks\tabandoned\tjoin replans\tdrift replans\t")
	for _, r := range rows {
		fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t\n", r.mode, r.run, r.plans, r.restores, r.replayed,
			r.dropped, r.rerouted, r.poolJoined, r.rollbacks, r.abandoned, r.joinReplans, r.driftReplans)
	}
	tw.Flush()
	fmt.Fprintln(w, `
steps kept: the job's step at the window's end less at its start (a restore under way at the end
  counts back to where it restarts); steps run: step reports in the window, replays included;
  tokens/s: the steps kept's tokens over the window (batch × block a step; with own batches each
  replica's own batch, none of a replica dropped); ÷ baseline: against the same mode's run
  without churn; equivalence: the final checkpoint (asked for after the window) against one
  process stopped after the same step — shoal train in step mode, shoal train --replay plans.json
  in outer mode — every tensor and every step's loss bit for bit.
From the job's events up to the final checkpoint: plans: plan events; restores: plans after the
  first that restored shards from a checkpoint (all but those marked "kept"); steps replayed:
  where the job stood at each such plan less its from_step; dropped: replica.dropped (outer mode:
  a replica left out, no restore); rerouted: work.rerouted; pool joins: pool.joined; rollbacks:
  job.rollback (an audit abandoned by a killed worker); abandoned: step.abandoned; join and
  drift replans: replan.join, replan.drift (experts re-placed), each a plan of its own.`)
}

func envDuration(t *testing.T, name string, def time.Duration) time.Duration {
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	d, err := time.ParseDuration(v)
	if err != nil || d <= 0 {
		t.Fatalf("%s=%q: want a duration such as 60s or 5m", name, v)
	}
	return d
}

func envInt(t *testing.T, name string, def int) int {
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 0 {
		t.Fatalf("%s=%q: want a whole number", name, v)
	}
	return n
}

// TestPlanChangedBefore: the soak's equivalence check takes up a plan at the checkpoint's step
// only when the job changed its plan there before the checkpoint was complete.
func TestPlanChangedBefore(t *testing.T) {
	ck := churnCkpt{id: 9, step: 70}
	ev := func(kind string, d map[string]any) churnEvent { return churnEvent{kind: kind, detail: d} }
	plan := func(from int) churnEvent { return ev("plan", map[string]any{"from_step": float64(from)}) }
	drop := func(step int) churnEvent { return ev("replica.dropped", map[string]any{"step": float64(step)}) }
	complete := func(id int64) churnEvent {
		return ev("checkpoint.complete", map[string]any{"id": float64(id), "step": float64(70)})
	}
	for name, c := range map[string]struct {
		events []churnEvent
		want   bool
	}{
		"grown before":             {[]churnEvent{plan(60), plan(70), complete(9)}, true},
		"dropped before":           {[]churnEvent{drop(70), complete(9)}, true},
		"grown after":              {[]churnEvent{plan(60), complete(9), plan(70)}, false},
		"grown before and after":   {[]churnEvent{plan(70), complete(9), drop(70)}, false},
		"another step":             {[]churnEvent{plan(69), drop(71), complete(9)}, false},
		"another checkpoint first": {[]churnEvent{complete(8), plan(70), complete(9)}, true},
	} {
		rec := &churnRecorder{events: c.events}
		if got := rec.planChangedBefore(ck); got != c.want {
			t.Errorf("%s: %v, want %v", name, got, c.want)
		}
	}
}
