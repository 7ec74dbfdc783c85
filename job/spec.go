package job

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"slices"
	"sort"

	"github.com/shoal-ml/shoal/data"
	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/sched"
)

// Spec is a training job. Every field is required in JSON except Plan: a spec that omits a field
// is refused rather than silently defaulted, so a spec file says everything the run depends on.
type Spec struct {
	Model           model.Config `json:"model"`
	Data            string       `json:"data"`            // file, directory or .bin; "$GOROOT/src" is the Go standard library
	DataExtensions  []string     `json:"data_extensions"` // for a directory: suffixes of the files to read
	Seed            uint64       `json:"seed"`
	Steps           int          `json:"steps"`
	BatchSize       int          `json:"batch_size"`    // B sequences per step
	MicroBatches    int          `json:"micro_batches"` // M; B % M == 0; part of the loss's definition
	LR              float64      `json:"lr"`
	Warmup          int          `json:"warmup"` // steps of linear warm-up; 0 for none
	MinLRRatio      float64      `json:"min_lr_ratio"`
	WeightDecay     float64      `json:"weight_decay"`
	Clip            float64      `json:"clip"`             // global gradient-norm bound; 0 disables clipping
	CheckpointEvery int          `json:"checkpoint_every"` // steps; 0 checkpoints only at the end
	ValEvery        int          `json:"val_every"`        // steps; 0 never computes validation loss
	// StepDeadlineMinS and StepDeadlineMaxS bound how long a distributed step may take before it
	// is abandoned and the peers that did not answer are dropped: the deadline is a few times the
	// recent median step time, clamped to [min, max] (max before any step was measured).
	StepDeadlineMinS float64 `json:"step_deadline_min_s"`
	StepDeadlineMaxS float64 `json:"step_deadline_max_s"`
	// AuditRate is the chance that a shard's step is recomputed to verify it (docs/design.md, "Verification and credit"):
	// every shard commits to its results each step, and besides these random draws a shard is
	// audited at any step that would otherwise leave AuditWindow() of its steps in a row
	// unaudited. 0 turns
	// verification off (and with it the commitments' cost; no work is then credited as verified).
	AuditRate float64 `json:"audit_rate"`
	// Wire is how the tensors crossing a boundary travel: activations (forward) and gradients
	// (backward) each "f32", "bf16", "int8" (one float32 scale per row of C) or "int4" (one
	// bfloat16 scale per 32 values of a row). Every boundary is
	// quantised so in every plan, the single process included (model/wire.go), so it is part of
	// what the job computes: runs with different formats differ, runs with the same agree bit
	// for bit.
	Wire model.Wire `json:"wire"`
	Plan *Plan      `json:"plan,omitempty"` // pinned placement; nil lets the planner choose
	// Sync is how the plan's pipeline replicas agree; nil is step mode (Sync{Mode: "step"}).
	Sync *Sync `json:"sync,omitempty"`
}

// Sync modes (docs/design.md, "Replicas and synchronisation").
const (
	// SyncStep reduces every tensor's gradient across the replicas every step, in the fixed
	// order of model.GradTree: the result is the single process's bit for bit, whatever the
	// replicas and their shares.
	SyncStep = "step"
	// SyncOuter is DiLoCo: each replica takes Every inner AdamW steps on its own micro-batches,
	// then the replicas average their pseudo-gradients (global θ − replica θ) and the global θ
	// takes an outer Nesterov step.
	SyncOuter = "outer"
)

// Sync is a job's synchronisation between pipeline replicas.
type Sync struct {
	Mode string `json:"mode"` // SyncStep or SyncOuter
	// The rest apply to SyncOuter only, where each is required.
	Every         int     `json:"every,omitempty"`          // H: inner steps per outer step
	OuterLR       float64 `json:"outer_lr,omitempty"`       // the outer Nesterov step's learning rate
	OuterMomentum float64 `json:"outer_momentum,omitempty"` // its momentum, in [0, 1)
	Compress      string  `json:"compress,omitempty"`       // pseudo-gradients on the wire: "none" or "int8" (error feedback)
	// Batches is what each replica trains on (outer mode; optional): BatchesShared, the default —
	// its share of the step's micro-batches, so that R replicas train one batch a step — or
	// BatchesOwn: a batch of its own every inner step (ReplicaSeed), so that R replicas train R
	// batches a step and the k-th replica adds tokens/s however many there are, as in DiLoCo.
	// With own batches a replica's micro_batches n_r (1 ≤ n_r ≤ MaxOwnMicroBatches) is how many
	// micro-batches of B/M rows its batch has: M is the job's batch, and a replica twice as fast
	// as the slowest trains about 2·M, so that none waits for another.
	Batches string `json:"batches,omitempty"`
	// Delay overlaps the outer step with training (outer mode; optional, 0 ≤ delay < every; 0,
	// the default, applies each outer step before the next inner step): after an outer step's
	// round every replica sends its pseudo-gradient and trains on, and takes up the new global θ
	// only after Delay more inner steps — θ_r ← θ_new + (θ_r − θ_r at the round's end), keeping
	// those steps' progress — so that the exchange has Delay steps of compute to hide behind
	// (Streaming DiLoCo's overlap, Douillard et al. 2025). The job's last outer step is taken
	// up at once.
	Delay int `json:"delay,omitempty"`
	// Warmup is the synchronous warm-up (outer mode): the job's first Warmup steps run as step
	// mode — the whole batch, one AdamW, the step's gradient reduced across the replicas — and
	// outer mode takes over at step Warmup, every replica starting from the warm-up's state
	// (θ_r and the global θ its parameters, AdamW's moments carried over, the outer momentum and
	// error feedback zero); outer rounds are counted from there. Most of outer mode's loss gap
	// to step mode comes from the replicas' separate AdamWs early in training, and a warm-up of a
	// third of the run brings it from +8.4% to +3.4% (docs/benchmarks.md, "A synchronous
	// warm-up"). Absent from a job file it is that third with shared batches, none with own
	// (DefaultSyncWarmup), written out when the spec is encoded; 0 is none. 0 ≤ warmup < steps.
	Warmup *int `json:"warmup,omitempty"`
}

// MarshalJSON writes a sync section with every field the job runs by: an outer section's warm-up
// always, so that a spec encoded and parsed again (the coordinator's Assign, a stored job) means
// the same steps — nil, in a spec built in Go, is none.
func (y Sync) MarshalJSON() ([]byte, error) {
	type plain Sync
	p := plain(y)
	if p.Mode == SyncOuter && p.Warmup == nil {
		p.Warmup = new(int)
	}
	return json.Marshal(p)
}

// DefaultSyncWarmup is the synchronous warm-up of an outer-mode job whose file leaves it out: a
// third of its steps, the shortest measured that brings outer mode within 4% of step mode's
// validation loss at 600 steps (docs/benchmarks.md, "A synchronous warm-up": a quarter leaves
// +4.7%, a third +3.4%, a half +1.1%) — with the replicas sharing each step's batch, as measured.
// None with own batches: there each outer step trains a batch per replica, hundreds on a fleet,
// and the warm-up's step mode one (the simulator's 1,000 peers run one step-mode replica), so a
// third of the steps would cost far more than it was measured to give; nor when the job pins more
// replicas than the warm-up's step mode can share its batch among.
func DefaultSyncWarmup(s Spec) int {
	if s.OwnBatches() || s.Plan != nil && len(s.Plan.Replicas) > s.MicroBatches {
		return 0
	}
	return s.Steps / 3
}

// SyncWarmup is the number of steps the job trains in step mode before outer mode takes over
// (Sync.Warmup); 0 for a step-mode job or none.
func (s Spec) SyncWarmup() int {
	if !s.Outer() || s.Sync.Warmup == nil {
		return 0
	}
	return *s.Sync.Warmup
}

// WarmingUp reports whether a plan that starts after done steps trains in the synchronous
// warm-up: step mode, which outer mode takes over from at step SyncWarmup.
func (s Spec) WarmingUp(done int) bool { return done < s.SyncWarmup() }

// Phase is the spec a plan that starts after done steps runs by: during the synchronous warm-up
// (WarmingUp) s in step mode — the same model, data and optimiser, every replica sharing the
// step's batch — and s itself after it. A pinned plan's replicas stay; with own batches their
// micro-batches become shares of the step's M in proportion (Validate checks there are at most M
// of them).
func (s Spec) Phase(done int) Spec {
	if !s.WarmingUp(done) {
		return s
	}
	if p := s.Plan; p != nil && len(p.Replicas) > 0 && s.OwnBatches() {
		// Own batches' shares are micro-batches of each replica's own batch; the warm-up shares
		// the step's M among the pinned replicas in proportion to them.
		q := *p
		q.Replicas = slices.Clone(p.Replicas)
		w := make([]int, len(q.Replicas))
		for i, r := range q.Replicas {
			w[i] = r.MicroBatches
		}
		for i, n := range sched.WeightedShares(w, s.MicroBatches) {
			q.Replicas[i].MicroBatches = n
		}
		s.Plan = &q
	}
	s.Sync = &Sync{Mode: SyncStep}
	return s
}

// StatePhase is the spec whose checkpoint layout the state after done steps has: the warm-up's
// (step mode) up to and including step SyncWarmup, whose checkpoint outer mode starts from —
// an outer-mode plan never checkpoints at that step, which the warm-up's checkpoint holds — and
// s after it.
func (s Spec) StatePhase(done int) Spec {
	if w := s.SyncWarmup(); w > 0 && done <= w {
		s.Sync = &Sync{Mode: SyncStep}
	}
	return s
}

// What each replica of an outer-mode job trains on (Sync.Batches).
const (
	BatchesShared = "shared"
	BatchesOwn    = "own"
)

// OwnBatches reports whether every replica trains a batch of its own each step (Sync.Batches).
func (s Spec) OwnBatches() bool { return s.Outer() && s.Sync.Batches == BatchesOwn }

// MaxOwnMicroBatches is the most micro-batches of B/M rows one replica may train of its own batch
// each step (Sync.Batches "own"): sched.MaxOwnMicroBatches, 64·M within a bound on the tokens.
func (s Spec) MaxOwnMicroBatches() int {
	return sched.MaxOwnMicroBatches(s.MicroBatches, s.BatchSize/max(s.MicroBatches, 1)*s.Model.BlockSize)
}

// OuterStepAfter reports whether an outer-mode job synchronises its replicas after step t
// (0-based): every sync.every steps from the end of the synchronous warm-up (SyncWarmup), and
// after the last.
func (s Spec) OuterStepAfter(t int) bool {
	w := s.SyncWarmup()
	return t >= w && ((t+1-w)%s.Sync.Every == 0 || t+1 == s.Steps)
}

// OuterTakeUpAfter is the step after which the replicas take up the outer step taken after step
// e (Sync.Delay): Delay steps later, or after the next outer step's round if it ends sooner (the
// job's last round may be shorter than H), and after e itself without a delay or at the job's
// end.
func (s Spec) OuterTakeUpAfter(e int) int {
	if s.Sync.Delay == 0 || e+1 >= s.Steps {
		return e
	}
	t := e + 1
	for t < e+s.Sync.Delay && !s.OuterStepAfter(t) {
		t++
	}
	return t
}

// OuterPending reports whether, after done steps, the replicas have not yet taken up the latest
// outer step (Sync.Delay), and the step e it followed: a checkpoint taken then holds every
// replica's θ_r as it was at e (model.OuterCheckpointSnap, local/outer.go).
func (s Spec) OuterPending(done int) (e int, pending bool) {
	if !s.Outer() || s.Sync.Delay == 0 {
		return 0, false
	}
	for e := done - 1; e >= 0 && e >= done-1-s.Sync.Every; e-- {
		if s.OuterStepAfter(e) {
			return e, s.OuterTakeUpAfter(e) >= done
		}
	}
	return 0, false
}

// ReplicaSeed is the data seed of replica r's own batches (Sync.Batches "own"): step s of replica
// r trains on corpus.Batch(ReplicaSeed(seed, r), s, n_r·B/M, T), its n_r micro-batches of B/M
// rows (ReplicaPlan.MicroBatches; n_r = M is a whole batch of B). Replica 0's is the job's seed,
// so one replica of M trains what a plain run does; the others' are far from it and from each
// other (splitmix64 of the pair). A batch's rows are drawn one after another from the step's
// generator, so a replica's n_r micro-batches begin with the n micro-batches of any smaller n.
func ReplicaSeed(seed uint64, r int) uint64 {
	if r == 0 {
		return seed
	}
	z := seed + uint64(r)*0x9e3779b97f4a7c15
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
	z = (z ^ (z >> 27)) * 0x94d049bb133111eb
	return z ^ (z >> 31)
}

// Outer reports whether the job synchronises its replicas DiLoCo-style (SyncOuter).
func (s Spec) Outer() bool { return s.Sync != nil && s.Sync.Mode == SyncOuter }

// Validate checks a sync section.
func (y *Sync) Validate() error {
	switch y.Mode {
	case SyncStep:
		if y.Every != 0 || y.OuterLR != 0 || y.OuterMomentum != 0 || y.Compress != "" || y.Batches != "" || y.Delay != 0 || y.Warmup != nil {
			return errors.New("every, outer_lr, outer_momentum, compress, batches, delay and warmup belong to mode \"outer\"")
		}
		return nil
	case SyncOuter:
	default:
		return fmt.Errorf("mode %q: want %q or %q", y.Mode, SyncStep, SyncOuter)
	}
	switch {
	case y.Every < 1:
		return fmt.Errorf("every %d must be a positive number of inner steps", y.Every)
	case !(y.OuterLR > 0) || math.IsInf(y.OuterLR, 0):
		return fmt.Errorf("outer_lr %v must be a positive number", y.OuterLR)
	case !(y.OuterMomentum >= 0 && y.OuterMomentum < 1):
		return fmt.Errorf("outer_momentum %v must be in [0, 1)", y.OuterMomentum)
	case y.Compress != "none" && y.Compress != "int8":
		return fmt.Errorf("compress %q: want \"none\" or \"int8\"", y.Compress)
	case y.Batches != "" && y.Batches != BatchesShared && y.Batches != BatchesOwn:
		return fmt.Errorf("batches %q: want %q or %q", y.Batches, BatchesShared, BatchesOwn)
	case y.Delay < 0 || y.Delay >= y.Every:
		return fmt.Errorf("delay %d must be in [0, every) = [0, %d): inner steps after an outer step's round before its result is taken up", y.Delay, y.Every)
	}
	return nil
}

// Plan pins where a job's shards go, for tests and for admins who know better than the planner.
type Plan struct {
	// Stages are the block ranges [a, b) of the pipeline stages, contiguous from 0 to n_layer: one
	// pipeline. A plan states either Stages or Replicas.
	Stages [][2]int `json:"stages,omitempty"`
	// Replicas are pipeline replicas, each with its own cuts and peers, sharing the step's
	// micro-batches in replica order: replica r computes the MicroBatches after replica r−1's.
	Replicas []ReplicaPlan `json:"replicas,omitempty"`
	// Experts places expert shards on hosts other than their stage; experts not listed stay with
	// the stage that routes to them.
	Experts []ExpertShard `json:"experts,omitempty"`
	// Depth pins the pipeline depth: how many micro-batches beyond plain 1F1B every stage keeps in
	// flight (sched.OneFOneBDepth), 0 ≤ depth < micro_batches. Absent, the coordinator chooses the
	// largest depth whose memory every peer offers. It changes no result, only time and memory.
	Depth *int `json:"depth,omitempty"`
}

// ReplicaPlan is one pipeline replica of a pinned plan.
type ReplicaPlan struct {
	Stages [][2]int `json:"stages"`
	// MicroBatches is its share of the step's micro-batches, or with own batches (Sync.Batches)
	// the micro-batches of B/M rows of its own batch, n_r.
	MicroBatches int `json:"micro_batches"`
}

// Replica is one pipeline replica of a job: its stages' block ranges and the micro-batches
// [First, First+MicroBatches) of every step it computes.
type Replica struct {
	Stages              [][2]int
	First, MicroBatches int
}

// PinnedReplicas are the replicas a pinned plan states, in replica order: Replicas, or Stages as
// the one replica computing every micro-batch. Nil without a pinned plan.
func (s Spec) PinnedReplicas() []Replica {
	p := s.Plan
	if p == nil {
		return nil
	}
	if len(p.Replicas) == 0 {
		return []Replica{{Stages: p.Stages, MicroBatches: s.MicroBatches}}
	}
	var rs []Replica
	first := 0
	for _, r := range p.Replicas {
		rs = append(rs, Replica{Stages: r.Stages, First: first, MicroBatches: r.MicroBatches})
		if !s.OwnBatches() { // own batches: every replica's micro-batches are [0, n_r) of its batch
			first += r.MicroBatches
		}
	}
	return rs
}

// ExpertShard is experts(block, {e…}) on host Host (0-based, among the expert hosts) — and on
// Replicas more when an expert is replicated.
type ExpertShard struct {
	Block   int   `json:"block"`
	Experts []int `json:"experts"`
	Host    int   `json:"host"`
}

// Default is the default job: the anchor's DEFAULT model on the Go standard library's *.go files,
// with the schedule the anchor's curve command trains with (lr 1e-3, warm-up 100, cosine to 0.1×,
// clip 1, weight decay 0.1) and M = 4.
func Default() Spec {
	return Spec{
		Model: model.DefaultConfig(), Data: data.GoRootSource, DataExtensions: []string{".go"},
		Seed: 0, Steps: 600, BatchSize: 16, MicroBatches: 4, LR: 1e-3, Warmup: 100, MinLRRatio: 0.1,
		WeightDecay: 0.1, Clip: 1.0, CheckpointEvery: 100, ValEvery: 50,
		StepDeadlineMinS: 30, StepDeadlineMaxS: 600, AuditRate: 0.1,
		Wire: model.Wire{Activations: model.F32, Gradients: model.F32},
	}
}

// ErrSpec is wrapped by every error about a job spec.
var ErrSpec = errors.New("invalid job spec")

var specKeys = []string{"model", "data", "data_extensions", "seed", "steps", "batch_size", "micro_batches",
	"lr", "warmup", "min_lr_ratio", "weight_decay", "clip", "checkpoint_every", "val_every",
	"step_deadline_min_s", "step_deadline_max_s", "audit_rate", "wire"}

// Parse decodes a spec, refusing unknown keys and naming every missing one.
func Parse(b []byte) (Spec, error) {
	var raw map[string]json.RawMessage
	if err := json.Unmarshal(b, &raw); err != nil {
		return Spec{}, fmt.Errorf("%w: %v", ErrSpec, err)
	}
	var missing []string
	for _, k := range specKeys {
		if _, ok := raw[k]; !ok {
			missing = append(missing, k)
		}
	}
	if len(missing) > 0 {
		return Spec{}, fmt.Errorf("%w: missing %q (every field must be written out; `shoal train --print-job` shows the default job)", ErrSpec, missing)
	}
	var unknown []string
	for k := range raw {
		if k != "plan" && k != "sync" && !contains(specKeys, k) {
			unknown = append(unknown, k)
		}
	}
	if len(unknown) > 0 {
		sort.Strings(unknown)
		return Spec{}, fmt.Errorf("%w: unknown fields %q", ErrSpec, unknown)
	}
	cfg, err := model.ParseConfig(raw["model"])
	if err != nil {
		return Spec{}, fmt.Errorf("%w: model: %v", ErrSpec, err)
	}
	var s Spec
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&s); err != nil {
		return Spec{}, fmt.Errorf("%w: %v", ErrSpec, err)
	}
	s.Model = cfg
	if s.Outer() && s.Sync.Warmup == nil {
		w := DefaultSyncWarmup(s)
		s.Sync.Warmup = &w
	}
	return s, s.Validate()
}

// CheckData reports whether the coordinator can read the job's data (data.Check), as an ErrSpec
// naming the path and why.
func (s Spec) CheckData() error {
	if err := data.Check(s.Data, s.DataExtensions); err != nil {
		return fmt.Errorf("%w: data: %w", ErrSpec, err)
	}
	return nil
}

// ReadFile parses the spec in path.
func ReadFile(path string) (Spec, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return Spec{}, err
	}
	s, err := Parse(b)
	if err != nil {
		return Spec{}, fmt.Errorf("%s: %w", path, err)
	}
	return s, nil
}

func contains(list []string, s string) bool {
	for _, v := range list {
		if v == s {
			return true
		}
	}
	return false
}

// Validate reports the first problem with s, naming the field.
func (s Spec) Validate() error {
	bad := func(f string, a ...any) error { return fmt.Errorf("%w: %s", ErrSpec, fmt.Sprintf(f, a...)) }
	finite := func(v float64) bool { return !math.IsNaN(v) && !math.IsInf(v, 0) }
	if err := s.Model.Validate(); err != nil {
		return fmt.Errorf("%w: model: %v", ErrSpec, err)
	}
	switch {
	case s.Data == "":
		return bad("data must name a file or directory (or %q)", data.GoRootSource)
	case s.Steps < 1:
		return bad("steps %d must be positive", s.Steps)
	case s.BatchSize < 1:
		return bad("batch_size %d must be positive", s.BatchSize)
	case s.MicroBatches < 1 || s.BatchSize%s.MicroBatches != 0:
		return bad("micro_batches %d must be positive and divide batch_size %d", s.MicroBatches, s.BatchSize)
	case !finite(s.LR) || s.LR <= 0:
		return bad("lr %v must be a positive number", s.LR)
	case s.Warmup < 0:
		return bad("warmup %d must be >= 0", s.Warmup)
	case !finite(s.MinLRRatio) || s.MinLRRatio < 0 || s.MinLRRatio > 1:
		return bad("min_lr_ratio %v must be in [0, 1]", s.MinLRRatio)
	case !finite(s.WeightDecay) || s.WeightDecay < 0:
		return bad("weight_decay %v must be >= 0", s.WeightDecay)
	case !finite(s.Clip) || s.Clip < 0:
		return bad("clip %v must be >= 0 (0 disables clipping)", s.Clip)
	case s.CheckpointEvery < 0:
		return bad("checkpoint_every %d must be >= 0", s.CheckpointEvery)
	case s.ValEvery < 0:
		return bad("val_every %d must be >= 0", s.ValEvery)
	case !finite(s.StepDeadlineMinS) || s.StepDeadlineMinS <= 0:
		return bad("step_deadline_min_s %v must be a positive number of seconds", s.StepDeadlineMinS)
	case !(s.AuditRate >= 0 && s.AuditRate <= 1):
		return bad("audit_rate %v must be in [0, 1]", s.AuditRate)
	case !finite(s.StepDeadlineMaxS) || s.StepDeadlineMaxS < s.StepDeadlineMinS:
		return bad("step_deadline_max_s %v must be at least step_deadline_min_s %v", s.StepDeadlineMaxS, s.StepDeadlineMinS)
	}
	if err := s.Wire.Validate(); err != nil {
		return fmt.Errorf("%w: wire: %v", ErrSpec, err)
	}
	if s.Plan != nil {
		if err := s.Plan.Validate(s.Model); err != nil {
			return fmt.Errorf("%w: plan: %v", ErrSpec, err)
		}
		if d := s.Plan.Depth; d != nil && (*d < 0 || *d >= s.MicroBatches) {
			return bad("plan: depth %d must be in [0, micro_batches %d)", *d, s.MicroBatches)
		}
		if rs := s.Plan.Replicas; len(rs) > 0 && s.OwnBatches() {
			// Every replica trains n_r micro-batches of B/M rows of a batch of its own: M for
			// the plain batch, more for a replica fast enough, within a bound.
			most := s.MaxOwnMicroBatches()
			for i, r := range rs {
				if r.MicroBatches > most {
					return bad("plan: replica %d has micro_batches %d; with batches %q a replica trains 1 to %d micro-batches of its own batch (%d times the job's %d, at most %d tokens)",
						i, r.MicroBatches, BatchesOwn, most, sched.OwnShareFactor, s.MicroBatches, sched.MaxOwnTokens)
				}
			}
		} else if len(rs) > 0 {
			n := 0
			for _, r := range rs {
				n += r.MicroBatches
			}
			if n != s.MicroBatches {
				return bad("plan: the replicas' micro_batches add up to %d, the job has %d", n, s.MicroBatches)
			}
		}
	}
	if s.Sync != nil {
		if err := s.Sync.Validate(); err != nil {
			return fmt.Errorf("%w: sync: %v", ErrSpec, err)
		}
		if w := s.SyncWarmup(); w < 0 || w >= s.Steps {
			return bad("sync: warmup %d must be in [0, steps %d): the steps trained in step mode before outer mode takes over", w, s.Steps)
		}
		if w := s.SyncWarmup(); w > 0 && s.Plan != nil && len(s.Plan.Replicas) > s.MicroBatches {
			// The warm-up is step mode: the pinned replicas share the step's batch, at least a
			// micro-batch each.
			return bad("sync: a warm-up of %d steps runs in step mode, where the %d pinned replicas share the step's %d micro-batches: pin at most micro_batches replicas, or set warmup 0", w, len(s.Plan.Replicas), s.MicroBatches)
		}
		if s.Outer() && s.Plan != nil && len(s.Plan.Replicas) == 0 {
			return bad("sync: mode %q needs replicas (plan.replicas, or no pinned plan)", SyncOuter)
		}
		if s.Outer() && s.Plan != nil && len(s.Plan.Experts) > 0 {
			// Each replica trains its own θ between outer steps, experts included: a host shared
			// by the replicas would need a copy per replica. Its experts stay with its stages.
			return bad("sync: mode %q keeps each replica's experts with its stages: a pinned plan with replicas takes no expert hosts there", SyncOuter)
		}
	}
	return nil
}

// Validate checks that the stages (of each replica) tile [0, n_layer), that each replica has
// micro-batches, and that expert shards name real experts once.
func (p *Plan) Validate(cfg model.Config) error {
	switch {
	case len(p.Stages) == 0 && len(p.Replicas) == 0:
		return errors.New("no stages")
	case len(p.Stages) > 0 && len(p.Replicas) > 0:
		return errors.New("stages and replicas: state one pipeline's stages or the replicas, not both")
	}
	if len(p.Replicas) == 0 {
		if err := tiles(p.Stages, cfg); err != nil {
			return err
		}
		return p.validateExperts(cfg)
	}
	for i, r := range p.Replicas {
		if r.MicroBatches < 1 {
			return fmt.Errorf("replica %d: micro_batches %d must be positive", i, r.MicroBatches)
		}
		if err := tiles(r.Stages, cfg); err != nil {
			return fmt.Errorf("replica %d: %v", i, err)
		}
	}
	// Expert hosts serve every replica's stage of their block. An expert replicated over two
	// hosts splits the step's micro-batches at the gradient tree's root, which the replicas'
	// shares cut across: not supported with replicas.
	seen := map[[2]int]bool{}
	for _, es := range p.Experts {
		for _, e := range es.Experts {
			k := [2]int{es.Block, e}
			if seen[k] {
				return fmt.Errorf("block %d expert %d on two hosts: replicated experts are not supported in a plan with replicas", es.Block, e)
			}
			seen[k] = true
		}
	}
	return p.validateExperts(cfg)
}

// tiles checks that stages tile [0, n_layer) in order.
func tiles(stages [][2]int, cfg model.Config) error {
	if len(stages) == 0 {
		return errors.New("no stages")
	}
	next := 0
	for i, st := range stages {
		if st[0] != next || st[1] <= st[0] {
			return fmt.Errorf("stage %d covers [%d,%d); stages must tile [0,%d) in order", i, st[0], st[1], cfg.NLayer)
		}
		next = st[1]
	}
	if next != cfg.NLayer {
		return fmt.Errorf("stages end at block %d, the model has %d", next, cfg.NLayer)
	}
	return nil
}

func (p *Plan) validateExperts(cfg model.Config) error {
	// The same expert may appear in several shards: those are its replicas.
	for _, es := range p.Experts {
		if es.Block < 0 || es.Block >= cfg.NLayer || !cfg.IsMoE(es.Block) {
			return fmt.Errorf("expert shard on block %d, which is not an MoE block", es.Block)
		}
		if es.Host < 0 {
			return fmt.Errorf("expert shard of block %d: host %d", es.Block, es.Host)
		}
		for _, e := range es.Experts {
			if e < 0 || e >= cfg.NExpert {
				return fmt.Errorf("block %d has no expert %d", es.Block, e)
			}
		}
	}
	return nil
}

// EvalRows is the sequences of one validation pass (ValPassRows) when the job computes a
// validation loss, 0 when it never does: a worker's activations then peak at the larger of such a
// pass and its training micro-batches in flight (sched.ShardJob).
func (s Spec) EvalRows() int {
	if s.ValEvery > 0 {
		return s.ValPassRows()
	}
	return 0
}

// ValPassRows is the validation windows of one forward pass in this job: data.PassRows of its
// micro-batch, no more sequences than a training micro-batch. Local runs and pipelines evaluate
// in passes of this size and combine them with data.ValLoss.
func (s Spec) ValPassRows() int {
	return data.PassRows(s.BatchSize / max(s.MicroBatches, 1))
}

// ShardJob is what of the job, besides its model and batch, the memory of a shard depends on
// (sched's memory model): the audit evidence its workers keep, and a validation pass. Outer
// mode's state is not memory a native worker keeps (it maps it from a file:
// sched.OuterStateBytesPerParam); a browser tab's is counted in its offer (sched.HeapOuterOffer).
func (s Spec) ShardJob() sched.ShardJob {
	j := sched.ShardJob{Audited: s.Audits(), EvalRows: s.EvalRows()}
	if s.Outer() && j.Audited {
		// The evidence of the step before an outer step keeps the parameters its update
		// reached, which the outer step then changes (client's trainer.beforeOuter).
		j.OuterBytesPerParam = OuterEvidenceBytesPerParam
	}
	return j
}

// OuterEvidenceBytesPerParam is what an audited outer-mode worker keeps per parameter besides a
// step's evidence (sched.EvidenceBytesPerParam): a float32 copy of its parameters at the end of
// the step an outer step follows, until that step's audit has had its chance.
const OuterEvidenceBytesPerParam = 4

// ReplicaOptions are the job's synchronisation of pipeline replicas in the planner's terms:
// what sched.PlanReplicas plans with and sched.ReplicaShardMemory checks a replica's shard by.
func (s Spec) ReplicaOptions() sched.ReplicaOptions {
	opt := sched.ReplicaOptions{MicroBatches: s.MicroBatches, Sync: sched.SyncStep}
	if s.Outer() {
		opt.Sync, opt.Every, opt.Int8, opt.OwnBatches = sched.SyncOuter, s.Sync.Every, s.Sync.Compress == "int8", s.OwnBatches()
		opt.Delay = s.Sync.Delay
	}
	return opt
}

// Audits reports whether the job verifies its training steps, and so whether its workers commit
// to each step and keep its evidence (the memory sched.Profile.Audited counts): in step mode and
// in outer mode alike, whose replicas' inner steps are audited (docs/design.md, "Verification and
// credit"). A job with no audit rate has its workers hash and copy nothing for audits.
func (s Spec) Audits() bool { return s.AuditRate > 0 }

// AuditWindow is the audit window when AuditRate > 0: ⌈1/rate⌉. Besides the AuditRate draws,
// the coordinator audits a shard's step wherever the draws left the window's last W−1 steps
// unaudited: so any W consecutive steps of a shard hold an audit, a worker faulty on every step
// is caught within W of its steps whatever the draws, and the audits cost rate/(1−(1−rate)^W)
// of the shard-steps (0.154 at 0.1). 0 when audits are off.
func (s Spec) AuditWindow() int {
	if s.AuditRate <= 0 {
		return 0
	}
	return int(math.Ceil(1/s.AuditRate - 1e-9))
}

// LRAt is the learning rate of step s (0-based): linear warm-up over Warmup steps, then cosine from
// LR down to MinLRRatio·LR at the last step —
// lr · min(1, (s+1)/warmup) · (min_lr_ratio + (1 − min_lr_ratio)/2 · (1 + cos(π s / steps))).
func (s Spec) LRAt(step int) float64 {
	w := 1.0
	if s.Warmup > 0 {
		w = math.Min(1, float64(step+1)/float64(s.Warmup))
	}
	return s.LR * w * (s.MinLRRatio + (1-s.MinLRRatio)/2*(1+math.Cos(math.Pi*float64(step)/float64(s.Steps))))
}

// Hyper is the model's per-step settings for step s.
func (s Spec) Hyper(step int) model.Hyper {
	return model.Hyper{MicroBatches: s.MicroBatches, LR: s.LRAt(step), WeightDecay: s.WeightDecay, Clip: s.Clip}
}
