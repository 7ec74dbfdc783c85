package model

import (
	"encoding/json"
	"fmt"
	"strconv"
	"strings"

	"github.com/shoal-ml/shoal/safetensors"
)

// Checkpoint layout (docs/design.md, "Checkpoints and storage"): one safetensors file per shard holding the model tensors under
// their global (nanoGPT) names, Adam's moments as optim.m.<name> and optim.v.<name>, and metadata
// "config" (the model config as JSON, every key) and "step" (steps completed). A whole-model file is
// the union of its shards' files.
const (
	optimM = "optim.m."
	optimV = "optim.v."
)

// StateParam is the parameter a state tensor named name belongs to: name itself, or the
// parameter of one of Adam's moments (optim.m.<name>, optim.v.<name>).
func StateParam(name string) string {
	if p, ok := strings.CutPrefix(name, optimM); ok {
		return p
	}
	if p, ok := strings.CutPrefix(name, optimV); ok {
		return p
	}
	return name
}

// Checkpoint is a decoded checkpoint file (a shard's or the whole model's).
type Checkpoint struct {
	Cfg     Config
	Step    int
	Tensors map[string]safetensors.Tensor
}

// CheckpointTensors lists what a checkpoint of p (and opt, when non-nil) holds, in p's order.
func CheckpointTensors(p *Params, opt *AdamW) []safetensors.Tensor {
	var out []safetensors.Tensor
	for _, t := range p.Tensors {
		out = append(out, safetensors.Tensor{Name: t.Name, Shape: t.Shape, Data: t.Data})
	}
	if opt != nil {
		for i, t := range p.Tensors {
			out = append(out, safetensors.Tensor{Name: optimM + t.Name, Shape: t.Shape, Data: opt.M.Tensors[i].Data})
		}
		for i, t := range p.Tensors {
			out = append(out, safetensors.Tensor{Name: optimV + t.Name, Shape: t.Shape, Data: opt.V.Tensors[i].Data})
		}
	}
	return out
}

// CheckpointLayout is the names and shapes CheckpointTensors gives a shard of the tensors specs
// with an optimizer, in the same order, without their values: what a state digest is composed of
// (audit.ComposeState) where the values are not at hand.
func CheckpointLayout(specs []Spec) []safetensors.Tensor {
	out := make([]safetensors.Tensor, 0, 3*len(specs))
	for _, pre := range []string{"", optimM, optimV} {
		for _, s := range specs {
			out = append(out, safetensors.Tensor{Name: pre + s.Name, Shape: s.Shape})
		}
	}
	return out
}

// CheckpointMeta is the metadata of a checkpoint of cfg after step steps.
func CheckpointMeta(cfg Config, step int) map[string]string {
	b, _ := json.Marshal(cfg)
	return map[string]string{"config": string(b), "step": strconv.Itoa(step), "format": "shoal/1"}
}

// SaveCheckpoint writes p and opt atomically to path.
func SaveCheckpoint(path string, cfg Config, step int, p *Params, opt *AdamW) error {
	if err := safetensors.WriteFile(path, CheckpointTensors(p, opt), CheckpointMeta(cfg, step)); err != nil {
		return fmt.Errorf("save checkpoint %s: %w", path, err)
	}
	return nil
}

// LoadCheckpoint reads a checkpoint file and its metadata.
func LoadCheckpoint(path string) (*Checkpoint, error) {
	ts, meta, err := safetensors.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("load checkpoint: %w", err)
	}
	return decodeCheckpoint(path, ts, meta)
}

func decodeCheckpoint(path string, ts []safetensors.Tensor, meta map[string]string) (*Checkpoint, error) {
	cs, ok := meta["config"]
	if !ok {
		return nil, fmt.Errorf("checkpoint %s: no config in its metadata", path)
	}
	cfg, err := ParseConfig([]byte(cs))
	if err != nil {
		return nil, fmt.Errorf("checkpoint %s: %w", path, err)
	}
	step, err := strconv.Atoi(meta["step"])
	if err != nil || step < 0 {
		return nil, fmt.Errorf("checkpoint %s: step %q is not a step count", path, meta["step"])
	}
	ck := &Checkpoint{Cfg: cfg, Step: step, Tensors: make(map[string]safetensors.Tensor, len(ts))}
	for _, t := range ts {
		ck.Tensors[t.Name] = t
	}
	return ck, nil
}

// HasOptimizer reports whether the checkpoint holds Adam's moments for every tensor of p.
func (ck *Checkpoint) HasOptimizer(p *Params) bool {
	for _, t := range p.Tensors {
		if _, ok := ck.Tensors[optimM+t.Name]; !ok {
			return false
		}
		if _, ok := ck.Tensors[optimV+t.Name]; !ok {
			return false
		}
	}
	return true
}

// Into copies the checkpoint's tensors into p and, when opt is non-nil, its moments into opt.
// Every tensor must be present with p's shape.
func (ck *Checkpoint) Into(p *Params, opt *AdamW) error {
	if err := ck.intoPrefixed("", p); err != nil {
		return err
	}
	if opt == nil {
		return nil
	}
	if err := ck.intoPrefixed(optimM, opt.M); err != nil {
		return err
	}
	return ck.intoPrefixed(optimV, opt.V)
}

// intoPrefixed copies the checkpoint's tensors prefix+name into p's tensors name, each of which
// must be present with p's shape.
func (ck *Checkpoint) intoPrefixed(prefix string, p *Params) error {
	for _, dst := range p.Tensors {
		name := prefix + dst.Name
		t, ok := ck.Tensors[name]
		if !ok {
			return fmt.Errorf("checkpoint lacks %s", name)
		}
		if !sameShape(t.Shape, dst.Shape) {
			return fmt.Errorf("checkpoint %s: shape %v, want %v", name, t.Shape, dst.Shape)
		}
		copy(dst.Data, t.Data)
	}
	return nil
}

// IntoOuterGlobal loads an outer-mode checkpoint's global part (OuterCheckpointGlobal) for the
// tensors of global: θ into global, the outer momentum and, with int8, the average's error
// feedback into o.
func (ck *Checkpoint) IntoOuterGlobal(global *Params, o *Outer) error {
	if err := ck.intoPrefixed("", global); err != nil {
		return err
	}
	if err := ck.intoPrefixed(OuterMomentumPrefix, o.V); err != nil {
		return err
	}
	if o.Err != nil {
		return ck.intoPrefixed(OuterErrPrefix, o.Err)
	}
	return nil
}

// IntoOuterReplica loads replica r's part of an outer-mode checkpoint (OuterCheckpointReplica)
// for the tensors of p: θ_r into p, its AdamW moments into opt and, when e is not nil, its int8
// error feedback into e. It reports false, loading nothing, when the checkpoint has no part of
// replica r — a replica new to the job, which starts from the global θ.
func (ck *Checkpoint) IntoOuterReplica(r int, p *Params, opt *AdamW, e *Params) (bool, error) {
	pre := ReplicaPrefix(r)
	if len(p.Tensors) == 0 {
		return false, nil
	}
	if _, ok := ck.Tensors[pre+p.Tensors[0].Name]; !ok {
		return false, nil
	}
	if err := ck.intoPrefixed(pre, p); err != nil {
		return false, err
	}
	if err := ck.intoPrefixed(pre+optimM, opt.M); err != nil {
		return false, err
	}
	if err := ck.intoPrefixed(pre+optimV, opt.V); err != nil {
		return false, err
	}
	if e != nil {
		if err := ck.intoPrefixed(pre+ReplicaErrPrefix, e); err != nil {
			return false, err
		}
	}
	return true, nil
}

// IntoOuterSnap loads replica r's snapshot of a delayed outer step (OuterCheckpointSnap) into
// snap, reporting false, loading nothing, when the checkpoint has none of replica r.
func (ck *Checkpoint) IntoOuterSnap(r int, snap *Params) (bool, error) {
	pre := ReplicaPrefix(r) + ReplicaSnapPrefix
	if len(snap.Tensors) == 0 {
		return false, nil
	}
	if _, ok := ck.Tensors[pre+snap.Tensors[0].Name]; !ok {
		return false, nil
	}
	return true, ck.intoPrefixed(pre, snap)
}

func sameShape(a, b []int) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// LoadModel builds a whole model from a checkpoint file: parameters, and the optimizer state and
// step when the file has them.
func LoadModel(path string) (*Model, *Checkpoint, error) {
	ck, err := LoadCheckpoint(path)
	if err != nil {
		return nil, nil, err
	}
	m, err := NewModel(ck.Cfg)
	if err != nil {
		return nil, nil, err
	}
	var opt *AdamW
	if ck.HasOptimizer(m.P) {
		opt = m.Opt
	}
	if err := ck.Into(m.P, opt); err != nil {
		return nil, nil, fmt.Errorf("%s: %w", path, err)
	}
	m.Step = ck.Step
	return m, ck, nil
}

// LoadModelBytes is LoadModel for a checkpoint file already in memory.
func LoadModelBytes(b []byte) (*Model, error) {
	ts, meta, err := safetensors.Read(b)
	if err != nil {
		return nil, err
	}
	ck, err := decodeCheckpoint("checkpoint", ts, meta)
	if err != nil {
		return nil, err
	}
	m, err := NewModel(ck.Cfg)
	if err != nil {
		return nil, err
	}
	if err := ck.Into(m.P, nil); err != nil {
		return nil, err
	}
	m.Step = ck.Step
	return m, nil
}

// Save writes the whole model and its optimizer state.
func (m *Model) Save(path string) error { return SaveCheckpoint(path, m.Cfg, m.Step, m.P, m.Opt) }
