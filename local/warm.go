package local

import (
	"errors"
	"fmt"
	"os"
	"strconv"

	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/safetensors"
)

// warmRun is an outer-mode job with a synchronous warm-up (job.Sync.Warmup W): steps 0 to W−1 are
// step mode's — one model, the whole batch, one AdamW — and at step W outer mode takes over, every
// replica starting from the warm-up's state: θ_r and the global θ its parameters, its AdamW
// moments, the outer momentum and error feedback zero. The distributed job does the same at the
// same step — after the warm-up's checkpoint every stage keeps its state into outer mode, or
// restores it from that checkpoint (client warmingOut, restore.go) — so the two compute the same
// bits.
type warmRun struct {
	spec  job.Spec
	w     int       // the warm-up's steps
	plain *plainRun // until step w; nil after
	outer *outerRun // from step w
	// newOuter makes the outer run at step w, with the replay's periods from there.
	newOuter func() (*outerRun, error)
}

// newWarmRun is the run of an outer-mode job with a warm-up, from step 0. Of a replay's periods
// (Options.Replay) those before the warm-up's end are step mode's, which computes the same
// whatever the replicas: the outer run replays those from step W on.
func newWarmRun(spec job.Spec, opts Options, batch func(seed uint64, s, B int) ([]int32, []int32, error)) (*warmRun, error) {
	w := spec.SyncWarmup()
	var replay []Period
	for _, p := range opts.Replay {
		if p.From >= w {
			replay = append(replay, p)
		}
	}
	if len(opts.Replay) > 0 && opts.Resume != "" {
		return nil, errors.New("a replay runs from step 0: it cannot resume a checkpoint")
	}
	newOuter := func() (*outerRun, error) {
		// Asked when the run reaches the warm-up's end: a replay of a run that stopped before it
		// (a checkpoint's steps) needs no plan from there.
		if len(opts.Replay) > 0 && (len(replay) == 0 || replay[0].From != w) {
			return nil, fmt.Errorf("replay: no plan from step %d, where the warm-up ends and outer mode begins", w)
		}
		o, err := newOuterRun(spec, replay)
		if err != nil {
			return nil, err
		}
		o.batch = batch
		return o, nil
	}
	if len(replay) > 0 {
		if err := checkReplay(spec, replay); err != nil {
			return nil, err
		}
	} else if len(opts.Replay) == 0 && len(spec.PinnedReplicas()) == 0 {
		_, err := newOuter() // says what is missing
		return nil, err
	}
	m, err := model.NewModel(spec.Model)
	if err != nil {
		return nil, err
	}
	m.Init(spec.Seed)
	m.SetWire(spec.Wire)
	return &warmRun{spec: spec, w: w, plain: &plainRun{spec: spec.Phase(0), m: m}, newOuter: newOuter}, nil
}

func (r *warmRun) cur() trainer {
	if r.outer != nil {
		return r.outer
	}
	return r.plain
}

// planAt takes up a replayed period beginning at step s once outer mode runs; a stop at the
// warm-up's end leaves the outer run to its first step, which makes it from the replay.
func (r *warmRun) planAt(s int) error {
	if r.outer == nil {
		return nil
	}
	return r.outer.planAt(s)
}

func (r *warmRun) model() *model.Model { return r.cur().model() }
func (r *warmRun) rows() int           { return r.cur().rows() }
func (r *warmRun) save(path string) error {
	return r.cur().save(path)
}

// load restores a checkpoint of either phase: up to and including step w a plain one (the
// warm-up's; job.Spec.StatePhase), after it an outer one.
func (r *warmRun) load(path string) error {
	f, err := os.Open(path)
	if err != nil {
		return fmt.Errorf("load checkpoint: %w", err)
	}
	h, err := safetensors.ReadHeader(f, 0)
	f.Close()
	if err != nil {
		return fmt.Errorf("load checkpoint: %w", err)
	}
	step, err := strconv.Atoi(h.Meta["step"])
	if err != nil {
		return fmt.Errorf("step %q is not a step count", h.Meta["step"])
	}
	if step <= r.w {
		r.outer = nil
		return r.plain.load(path)
	}
	o, err := r.newOuter()
	if err != nil {
		return err
	}
	if err := o.load(path); err != nil {
		return err
	}
	r.outer, r.plain = o, nil
	return nil
}

func (r *warmRun) step(s int, x, y []int32, h model.Hyper) (model.StepResult, error) {
	if s == r.w && r.outer == nil {
		if err := r.takeOver(); err != nil {
			return model.StepResult{}, fmt.Errorf("the end of the warm-up: %w", err)
		}
	}
	return r.cur().step(s, x, y, h)
}

// takeOver starts outer mode from the warm-up's state after step w.
func (r *warmRun) takeOver() error {
	o, err := r.newOuter()
	if err != nil {
		return err
	}
	return r.start(o)
}

// start makes o's global θ and every replica the warm-up's state (warmStart).
func (r *warmRun) start(o *outerRun) error {
	p := r.plain.m
	p.Pull()
	if err := warmStart(o.global, p); err != nil {
		return err
	}
	for _, m := range o.models {
		if m == nil {
			continue // dropped from the replay's first period
		}
		if err := warmStart(m, p); err != nil {
			return err
		}
	}
	r.outer, r.plain = o, nil
	return nil
}

// warmStart makes m the warm-up's model p: its parameters, AdamW's moments and step count.
func warmStart(m, p *model.Model) error {
	if err := m.P.CopyFrom(p.P); err != nil {
		return err
	}
	if err := m.Opt.M.CopyFrom(p.Opt.M); err != nil {
		return err
	}
	if err := m.Opt.V.CopyFrom(p.Opt.V); err != nil {
		return err
	}
	m.Step = p.Step
	m.Push()
	return nil
}
