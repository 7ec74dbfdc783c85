package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/sched"
)

// The 1b model's job in the simulator is the default job's with a global batch of 1,024 sequences
// in 1,024 micro-batches of one sequence. Fewer, larger micro-batches (256 of 4 sequences) were
// considered and not taken: a micro-batch's compute and its boundary bytes both scale with its
// tokens, so their ratio (what makes a stage link-bound) does not change, while the bubble, (S−1)
// slots per replica's share, weighs 4× more with 4× fewer micro-batches a replica, and the
// replicas are capped at 256; the cost of small ones is a per-micro-batch latency, which the
// pipeline's depth hides (one sequence's activations are small), and kernel efficiency at small
// sizes, which the simulator does not model.

func (m *Main) runSimulate(ctx context.Context, args []string) error {
	fs := m.newFlagSet("simulate", "--peers N --hours H [--job FILE] [--model 1b] [--sync step|outer [--own-batches] [--delay D]] [--wire F] [--seed S] [flags]")
	peers := fs.Int("peers", 1000, "fleet size `N`: synthetic volunteers of issue 13's mix, kept about N by arrivals")
	hours := fs.Float64("hours", 1, "simulated `H`ours")
	jobFile := fs.String("job", "", "job spec `FILE` (JSON); default: the default job")
	modelName := fs.String("model", "", "a named model instead of the job's: 1b (≈1B-parameter GPT-MoE, batch 1,024 sequences in 1,024 micro-batches), default, tiny or large")
	syncMode := fs.String("sync", "", "replica synchronisation: step or outer (default: the job's, else step)")
	every := fs.Int("every", 0, "outer mode: inner steps `H` between synchronisations (default: the job's, else 20)")
	int8 := fs.Bool("int8", false, "outer mode: int8 pseudo-gradients")
	delay := fs.Int("delay", 0, "outer mode: inner steps `D` (below --every) the replicas train on after an outer step's round before taking up its result, so that the exchange hides behind their compute (default: the job's sync.delay, else 0: exposed)")
	ownBatches := fs.Bool("own-batches", false, "outer mode: every replica trains a batch of its own each step (the job's sync.batches \"own\"), sized to its speed: the slowest M micro-batches, a faster one as many as it finishes meanwhile; replicas are not bounded by the micro-batches")
	wire := fs.String("wire", "", "boundary formats instead of the job's: `F` (f32, bf16, int8 or int4) both ways, or ACT,GRAD")
	seed := fs.Uint64("seed", 1, "fleet seed: the same seed simulates the same fleet")
	detect := fs.Float64("detect", 5, "seconds a departure takes to notice: the coordinator's heartbeat timeout for a machine or network that vanishes; a killed process's links close at once")
	quick := fs.Float64("detect-waited", 1.625, "seconds a departure takes to notice while the job waits on the departed peer (an outer exchange, a round's end), where the coordinator drops a worker silent past its quick timeout (2 s); at most --detect")
	asJSON := fs.Bool("json", false, "print the result as JSON")
	forSpeed := fs.Bool("plan-for-speed", false, "weigh plans by their speed alone, not (from the first restore on) by their goodput under the fleet's churn as the coordinator does once it has seen departures: for comparison")
	if err := parse(fs, args); err != nil {
		return err
	}
	if !(*quick > 0) {
		return fmt.Errorf("--detect-waited %v: want seconds > 0", *quick)
	}
	if !(*detect > 0) {
		return fmt.Errorf("--detect %v: want seconds > 0", *detect)
	}
	spec, err := jobOrDefault(*jobFile)
	if err != nil {
		return err
	}
	if w := spec.SyncWarmup(); w > 0 {
		// The simulator runs for a time, not a job's steps: its rounds are outer mode's from
		// the start. Said rather than silently dropped.
		fmt.Fprintf(m.Stderr, "note: the job's synchronous warm-up (%d steps in step mode) is not simulated: outer mode throughout\n", w)
	}
	switch *modelName {
	case "":
	case "1b":
		spec.Model, spec.BatchSize, spec.MicroBatches = model.Config1B(), 1024, 1024
	default:
		cfg, ok := model.Configs[*modelName]
		if !ok {
			return fmt.Errorf("--model %q: want 1b, default, tiny or large", *modelName)
		}
		spec.Model = cfg()
	}
	if *wire != "" {
		act, grad, two := strings.Cut(*wire, ",")
		if !two {
			grad = act
		}
		var err error
		if spec.Wire.Activations, err = model.ParseFormat(act); err != nil {
			return fmt.Errorf("--wire: %w", err)
		}
		if spec.Wire.Gradients, err = model.ParseFormat(grad); err != nil {
			return fmt.Errorf("--wire: %w", err)
		}
	}
	opt := spec.ReplicaOptions() // the job's sync: mode, every, compress, batches
	opt.MicroBatches = spec.MicroBatches
	// --sync first, whatever the order of the flags (Visit's is alphabetical), so that outer
	// flags given with --sync step are refused below rather than dropped with the job's.
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	if set["sync"] {
		switch *syncMode {
		case job.SyncStep:
			opt.Sync, opt.Every, opt.Int8, opt.OwnBatches, opt.Delay = sched.SyncStep, 0, false, false, 0
		case job.SyncOuter:
			opt.Sync = sched.SyncOuter
		default:
			return fmt.Errorf("--sync %q: want step or outer", *syncMode)
		}
	}
	fs.Visit(func(f *flag.Flag) {
		switch f.Name {
		case "every":
			opt.Every = *every
		case "int8":
			opt.Int8 = *int8
		case "own-batches":
			opt.OwnBatches = *ownBatches
		case "delay":
			opt.Delay = *delay
		}
	})
	if opt.Sync == sched.SyncOuter && opt.Every == 0 {
		opt.Every = 20
	}
	if opt.Sync == sched.SyncStep && (opt.Every != 0 || opt.Int8 || opt.OwnBatches || opt.Delay != 0) {
		return fmt.Errorf("--every, --int8, --own-batches and --delay belong to --sync outer")
	}
	if opt.Sync == sched.SyncOuter && (opt.Delay < 0 || opt.Delay >= opt.Every) {
		return fmt.Errorf("--delay %d: want 0 ≤ D < every = %d", opt.Delay, opt.Every)
	}
	if err := spec.Model.Validate(); err != nil {
		return err
	}
	if spec.MicroBatches < 1 || spec.BatchSize%spec.MicroBatches != 0 {
		return fmt.Errorf("batch of %d sequences in %d micro-batches: micro_batches must divide batch_size", spec.BatchSize, spec.MicroBatches)
	}
	// The memory of a shard is the coordinator's: the job's audit evidence and validation pass
	// count (job.Spec.ShardJob); outer mode's state is on disk, or in a browser tab's offer
	// (sched.HeapOuterOffer, PeerClass.Browser).
	sj := spec.ShardJob()
	prof, _, err := sj.Profiles(spec.Model, spec.BatchSize/spec.MicroBatches, spec.MicroBatches)
	if err != nil {
		return err
	}
	prof = prof.WithWire(spec.Wire)
	start := time.Now()
	ce := spec.CheckpointEvery
	if ce == 0 {
		ce = -1 // the job checkpoints only at its end
	}
	res, err := sched.Simulate(sched.SimConfig{Profile: prof, Options: opt, Peers: *peers, Hours: *hours, Seed: *seed, CheckpointEvery: ce,
		DetectSeconds: *detect, QuickDetectSeconds: *quick, PlanForSpeed: *forSpeed, Clock: func() float64 { return time.Since(start).Seconds() }})
	if err != nil {
		return err
	}
	if *asJSON {
		enc := json.NewEncoder(m.Stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(res)
	}
	params := 0
	for _, s := range spec.Model.Specs() {
		params += s.Size()
	}
	printSimulation(m.Stdout, res, params, spec, time.Since(start))
	return nil
}

func printSimulation(w io.Writer, r sched.SimResult, params int, spec job.Spec, took time.Duration) {
	sync := r.Sync
	if r.Every > 0 {
		sync = fmt.Sprintf("outer, every %d steps", r.Every)
	}
	if r.OwnBatches {
		sync += ", own batches"
	}
	if r.Delay > 0 {
		sync += fmt.Sprintf(", delay %d steps", r.Delay)
	}
	fmt.Fprintf(w, "model: %s parameters, %d layers; batch %d sequences of %d tokens in %d micro-batches; sync %s; wire %v\n",
		simSI(float64(params)), spec.Model.NLayer, spec.BatchSize, spec.Model.BlockSize, r.M, sync, spec.Wire)
	fmt.Fprintf(w, "fleet: %d peers for %g h (seed %d): %d joins, %d leaves; %sFLOP/s on average, %sFLOP/s of it able to hold a shard\n",
		r.Peers, r.Hours, r.Seed, r.Joins, r.Leaves, simSI(r.FleetFLOPS), simSI(r.CapableFLOPS))
	fmt.Fprintf(w, "planner: first plan %s; PlanReplicas %d calls, max %s, mean %s\n",
		simSecs(r.PlanFirstSeconds), r.PlanCalls, simSecs(r.PlanMaxSeconds), simSecs(r.PlanMeanSeconds))
	e := r.Initial
	hidden := ""
	if r.Delay > 0 {
		hidden = fmt.Sprintf("; %.3g s more hidden behind the delay", e.HiddenSeconds)
	}
	fmt.Fprintf(w, "first plan: %d replicas, step %.3g s (compute %.3g s + exposed sync %.3g s%s), %s tokens/s, goodput %.2f%% of the fleet, %.2f%% of capable peers\n",
		e.Replicas, e.StepSeconds, e.ComputeSeconds, e.SyncSeconds, hidden, simSI(e.TokensPerS), 100*r.InitialGoodput, 100*r.InitialGoodputCapable)
	fmt.Fprintf(w, "run: %.0f steps, %s tokens, useful %sFLOP/s: goodput %.2f%% of the fleet's FLOP/s, %.2f%% of the capable peers'; synchronised %.2f%%\n",
		r.Steps, simSI(r.Tokens), simSI(r.UsefulFLOPS), 100*r.Goodput, 100*r.GoodputCapable, 100*r.GoodputSynchronised)
	used := 0.0
	if r.UsedFLOPS > 0 {
		used = r.UsefulFLOPS / r.UsedFLOPS
	}
	fmt.Fprintf(w, "peers in running replicas: %sFLOP/s on average (%.1f%% of the capable peers'), used at %.1f%%\n",
		simSI(r.UsedFLOPS), 100*r.UsedFLOPS/max(r.CapableFLOPS, 1), 100*used)
	for _, c := range r.Classes {
		fmt.Fprintf(w, "  %-12s %6d peers %9sFLOP/s; able to hold a shard %6d (%sFLOP/s); in the first plan %6d (%sFLOP/s)\n",
			c.Name, c.Peers, simSI(c.FLOPS), c.CapablePeers, simSI(c.CapableFLOPS), c.UsedPeers, simSI(c.UsedFLOPS))
	}
	fmt.Fprintf(w, "churn: %d departures from replicas: %d replicas dropped (%d of them during an outer exchange, delayed or not, taken again without them; %d of those cutting such a redo, which started again), %d rerouted mid-step (%d of them a stage taken over) and %d shared out at a boundary (step mode), %d restores; restore stall %.0f s + rolled back %.0f s + dropped work %.0f s = %.3g s per event; %d join replans and %d joins taken in from peers (%d of them reshaping the plan; stall %.0f s; %d boundaries where a grow and %d where a join replan waited to repay its stall), %d plans after the first\n",
		r.ReplicaLeaves, r.Drops, r.ExchangeRedos, r.RedosCut, r.Reroutes, r.Takeovers, r.Reshares, r.Restores, r.StallSeconds, r.RestoreLostSeconds, r.LostSeconds, r.StallPerEvent, r.JoinReplans, r.Grows, r.Reshapes, r.ReplanStallSeconds, r.GrowsWaited, r.ReplansWaited, r.Replans)
	fmt.Fprintf(w, "replicas: mean %.1f, min %d, max %d; standbys: mean %.0f\n\n", r.ReplicasMean, r.ReplicasMin, r.ReplicasMax, r.StandbyMean)
	fmt.Fprintf(w, "%7s %7s %9s %8s %10s %12s %8s\n", "hours", "live", "replicas", "standby", "step s", "tokens/s", "goodput")
	for _, s := range r.Samples {
		fmt.Fprintf(w, "%7.2f %7d %9d %8d %10.3g %12s %7.2f%%\n", s.Hours, s.Live, s.Replicas, s.Standby, s.StepS, simSI(s.TokensPerS), 100*s.Goodput)
	}
	fmt.Fprintf(w, "\nsimulated in %s\n", took.Round(time.Millisecond))
}

// simSI writes x with an SI prefix: 1.23 k, 4.56 T.
func simSI(x float64) string {
	units := []string{"", " k", " M", " G", " T", " P", " E"}
	i := 0
	for x >= 1000 && i < len(units)-1 {
		x /= 1000
		i++
	}
	return fmt.Sprintf("%.3g%s", x, units[i])
}

func simSecs(s float64) string {
	return time.Duration(s * float64(time.Second)).Round(10 * time.Microsecond).String()
}
