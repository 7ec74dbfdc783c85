package local

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"time"

	"github.com/shoal-ml/shoal/data"
	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/model"
)

// Report is what one step measured.
type Report struct {
	Step, Steps int // Step is 0-based; Steps is the job's total
	CE, Aux     float64
	ValLoss     float64 // NaN when not computed this step
	LR          float64
	GradNorm    float64
	TokensPerS  float64 // of this step
	Elapsed     time.Duration
	ETA         time.Duration
	Checkpoint  string // path written after this step, if any
	// StageWait is, on a pipeline, how long each stage waited on the network (neighbours and the
	// coordinator) during the step, in stage order; empty in one process.
	StageWait []time.Duration
	// BytesSent is the tensor payload all workers sent to each other during the step (0 in one
	// process).
	BytesSent int64
}

// Options are the run's side settings: nothing here changes what is computed, except Replay.
type Options struct {
	Out    string       // directory for checkpoints; "" writes none
	Resume string       // checkpoint file, or a directory whose newest checkpoint is taken
	OnStep func(Report) // called after every step
	OnLoad func(c *data.Corpus, m *model.Model)
	// Replay is an outer-mode run's replicas over time, as a distributed run of the job recorded
	// them (`shoal train --workers --out DIR` writes DIR/plans.json): the one process then
	// computes what that run computed — with a replica left out from the step it was lost at —
	// instead of the pinned replicas throughout. Outer mode only (step mode computes the same
	// whatever the replicas), and not with Resume.
	Replay []Period
	// PlanAtStop takes up, on cancellation, the replayed period that begins at the step the run
	// stopped at before the checkpoint is written. A distributed run's checkpoint taken at a
	// step boundary holds the plan in force when it was taken: one that came after a plan change
	// at that step (a grow, a drop) holds the new plan's replicas, which the replay would
	// otherwise take up only at its next step.
	PlanAtStop bool
}

// Result is what a finished (or interrupted) run leaves.
type Result struct {
	Model      *model.Model
	Checkpoint string // the last checkpoint written
}

// Run trains spec from scratch or from opts.Resume until spec.Steps or ctx is done. On
// cancellation it writes a checkpoint of the steps completed (when opts.Out is set) and returns
// ctx's error with the result.
func Run(ctx context.Context, spec job.Spec, opts Options) (*Result, error) {
	if err := spec.Validate(); err != nil {
		return nil, err
	}
	corpus, err := data.Load(spec.Data, spec.DataExtensions)
	if err != nil {
		return nil, err
	}
	if mt := corpus.MaxToken(); mt >= spec.Model.VocabSize {
		return nil, fmt.Errorf("%s has token %d, outside the model's vocab_size %d", corpus.Source, mt, spec.Model.VocabSize)
	}
	T := spec.Model.BlockSize
	vx, vy, err := corpus.Validation(T)
	if err != nil {
		return nil, err
	}
	var t trainer
	if w := spec.SyncWarmup(); w > 0 {
		t, err = newWarmRun(spec, opts, func(seed uint64, s, B int) ([]int32, []int32, error) { return corpus.Batch(seed, s, B, T) })
		if err != nil {
			return nil, err
		}
	} else if spec.Outer() {
		o, err := newOuterRun(spec, opts.Replay) // replicas and outer steps: outer.go
		if err != nil {
			return nil, err
		}
		o.batch = func(seed uint64, s, B int) ([]int32, []int32, error) { return corpus.Batch(seed, s, B, T) }
		if len(opts.Replay) > 0 && opts.Resume != "" {
			return nil, errors.New("a replay runs from step 0: it cannot resume a checkpoint")
		}
		t = o
	} else if len(opts.Replay) > 0 {
		return nil, fmt.Errorf("a replay of replicas is for sync mode %q: in step mode every plan of replicas computes the same steps", job.SyncOuter)
	} else {
		m, err := model.NewModel(spec.Model)
		if err != nil {
			return nil, err
		}
		m.Init(spec.Seed)
		m.SetWire(spec.Wire) // the boundaries quantise as every split of the job does
		t = &plainRun{spec: spec, m: m}
	}
	return drive(ctx, spec, opts, corpus, vx, vy, t)
}

// trainer is what drive trains: the model in one process (plainRun), or outer mode's replicas
// (outerRun).
type trainer interface {
	// model holds what validation evaluates and Result returns; its Step counts the steps done.
	model() *model.Model
	// load restores the run from a checkpoint file; save writes one.
	load(path string) error
	save(path string) error
	// rows is how many sequences of T tokens the last step trained: the batch's B, or with outer
	// mode's own batches every replica's n_r·B/M.
	rows() int
	// step trains step s on its batch (x, y) with the step's settings h, leaving model().Step at
	// s+1, and reports its loss terms and gradient norm.
	step(s int, x, y []int32, h model.Hyper) (model.StepResult, error)
}

// planTaker is a trainer that can take up the replayed plan beginning at step s before it trains
// that step (Options.PlanAtStop).
type planTaker interface {
	planAt(s int) error
}

// plainRun trains the whole model in this process.
type plainRun struct {
	spec job.Spec
	m    *model.Model
}

func (p *plainRun) model() *model.Model { return p.m }

func (p *plainRun) rows() int { return p.spec.BatchSize }

func (p *plainRun) save(path string) error { return p.m.Save(path) }

func (p *plainRun) load(path string) error {
	ck, err := model.LoadCheckpoint(path)
	if err != nil {
		return err
	}
	if ck.Cfg != p.spec.Model {
		return errors.New("its model config differs from the job's")
	}
	if !ck.HasOptimizer(p.m.P) {
		return errors.New("no optimizer state (optim.m./optim.v.): cannot continue training exactly")
	}
	if err := ck.Into(p.m.P, p.m.Opt); err != nil {
		return err
	}
	p.m.Step = ck.Step
	return nil
}

func (p *plainRun) step(s int, x, y []int32, h model.Hyper) (model.StepResult, error) {
	return p.m.TrainStep(x, y, p.spec.BatchSize, h)
}

// drive trains t from its step (or opts.Resume) to spec.Steps: the batches, validation,
// checkpoints and reports around each step. On cancellation it writes a checkpoint of the steps
// completed (when opts.Out is set) and returns ctx's error with the result.
func drive(ctx context.Context, spec job.Spec, opts Options, corpus *data.Corpus, vx, vy []int32, t trainer) (*Result, error) {
	if opts.Resume != "" {
		path, err := ResolveCheckpoint(opts.Resume)
		if err != nil {
			return nil, err
		}
		if err := t.load(path); err != nil {
			return nil, fmt.Errorf("resume %s: %w", path, err)
		}
	}
	m := t.model()
	if opts.OnLoad != nil {
		opts.OnLoad(corpus, m)
	}
	if opts.Out != "" {
		if err := os.MkdirAll(opts.Out, 0o755); err != nil {
			return nil, err
		}
	}
	res := &Result{Model: m}
	save := func() error {
		if opts.Out == "" {
			return nil
		}
		p := filepath.Join(opts.Out, CheckpointName(m.Step))
		if err := t.save(p); err != nil {
			return err
		}
		res.Checkpoint = p
		return nil
	}
	start, first := time.Now(), m.Step
	B, T := spec.BatchSize, spec.Model.BlockSize
	for m.Step < spec.Steps {
		if err := ctx.Err(); err != nil {
			if m.Step > first {
				if u, ok := t.(planTaker); ok && opts.PlanAtStop {
					if perr := u.planAt(m.Step); perr != nil {
						return res, errors.Join(err, perr)
					}
				}
				if serr := save(); serr != nil {
					return res, errors.Join(err, serr)
				}
			}
			return res, err
		}
		s := m.Step
		t0 := time.Now()
		x, y, err := corpus.Batch(spec.Seed, s, B, T)
		if err != nil {
			return res, err
		}
		h := spec.Hyper(s)
		r, err := t.step(s, x, y, h)
		if err != nil {
			return res, fmt.Errorf("step %d: %w", s, err)
		}
		// The model evaluated and returned is the trainer's now: a warm-up's ends at its last step
		// (warmRun).
		m = t.model()
		res.Model = m
		dt := time.Since(t0)
		rep := Report{Step: s, Steps: spec.Steps, CE: r.CE, Aux: r.Aux, LR: h.LR, GradNorm: r.GradNorm,
			TokensPerS: float64(t.rows()*T) / dt.Seconds(), ValLoss: nan()}
		if spec.ValEvery > 0 && (s%spec.ValEvery == 0 || s == spec.Steps-1) {
			if rep.ValLoss, err = ValidationLoss(m, vx, vy, spec.ValPassRows()); err != nil {
				return res, err
			}
		}
		if (spec.CheckpointEvery > 0 && m.Step%spec.CheckpointEvery == 0) || m.Step == spec.Steps {
			if err := save(); err != nil {
				return res, err
			}
			rep.Checkpoint = res.Checkpoint
		}
		rep.Elapsed = time.Since(start)
		done := m.Step - first
		rep.ETA = time.Duration(float64(rep.Elapsed) / float64(done) * float64(spec.Steps-m.Step))
		if opts.OnStep != nil {
			opts.OnStep(rep)
		}
	}
	return res, nil
}

func nan() float64 { v := 0.0; return v / v }

// ValidationLoss is the mean cross-entropy over the validation windows (x, y: rows of T tokens),
// evaluated pass windows at a time (job.Spec.ValPassRows).
func ValidationLoss(m *model.Model, x, y []int32, pass int) (float64, error) {
	T := m.Cfg.BlockSize
	rows := len(x) / T
	if pass < 1 || rows%pass != 0 {
		return 0, fmt.Errorf("%d validation windows is not a multiple of %d", rows, pass)
	}
	var ces []float64
	for r := 0; r < rows; r += pass {
		ce, _, err := m.Evaluate(x[r*T:(r+pass)*T], y[r*T:(r+pass)*T], pass, T)
		if err != nil {
			return 0, err
		}
		ces = append(ces, ce)
	}
	return data.ValLoss(ces, pass), nil
}

// CheckpointName is the file name of the checkpoint after step steps.
func CheckpointName(step int) string { return fmt.Sprintf("ckpt-%06d.safetensors", step) }

var ckptRE = regexp.MustCompile(`^ckpt-(\d+)\.safetensors$`)

// ResolveCheckpoint returns path itself for a file, or the newest checkpoint in a directory.
func ResolveCheckpoint(path string) (string, error) {
	st, err := os.Stat(path)
	if err != nil {
		return "", err
	}
	if !st.IsDir() {
		return path, nil
	}
	ents, err := os.ReadDir(path)
	if err != nil {
		return "", err
	}
	type ck struct {
		step int
		name string
	}
	var cks []ck
	for _, e := range ents {
		if mm := ckptRE.FindStringSubmatch(e.Name()); mm != nil {
			n, _ := strconv.Atoi(mm[1])
			cks = append(cks, ck{n, e.Name()})
		}
	}
	if len(cks) == 0 {
		return "", fmt.Errorf("no ckpt-NNNNNN.safetensors in %s", path)
	}
	sort.Slice(cks, func(i, j int) bool { return cks[i].step < cks[j].step })
	return filepath.Join(path, cks[len(cks)-1].name), nil
}
