package model

import (
	"fmt"
	"hash/fnv"
	"math"
	"math/rand/v2"
	"strconv"
	"strings"
)

// Spec names one parameter tensor and its shape. Weights are (out, in), as nn.Linear stores them.
type Spec struct {
	Name  string
	Shape []int
}

// Size is the number of elements.
func (s Spec) Size() int {
	n := 1
	for _, d := range s.Shape {
		n *= d
	}
	return n
}

// Specs lists every tensor of the whole model in the anchor's named_parameters order.
func (c Config) Specs() []Spec { return c.StageSpecs(0, c.NLayer, true) }

// StageSpecs lists the tensors of the stage holding blocks [lo, hi): the embeddings when lo == 0,
// ln_f and lm_head when hi == L. withExperts adds the experts of its MoE blocks, for a stage
// that computes its own experts; the router always belongs to the stage.
func (c Config) StageSpecs(lo, hi int, withExperts bool) []Spec {
	return c.StageShardSpecs(lo, hi, func(int, int) bool { return withExperts })
}

// StageShardSpecs lists the tensors of a stage shard of blocks [lo, hi) that holds the experts for
// which local is true (each right after its block's router), in the order the shard's slab lays
// them out: what NewStageShardWith allocates, and what the coordinator expects in its checkpoint.
func (c Config) StageShardSpecs(lo, hi int, local func(blk, e int) bool) []Spec {
	V, T, C, F, E := c.VocabSize, c.BlockSize, c.NEmbd, c.Hidden(), c.NExpert
	var out []Spec
	add := func(name string, shape ...int) { out = append(out, Spec{name, shape}) }
	if lo == 0 {
		add("transformer.wte.weight", V, C)
		add("transformer.wpe.weight", T, C)
	}
	for i := lo; i < hi; i++ {
		p := fmt.Sprintf("transformer.h.%d.", i)
		add(p+"ln_1.weight", C)
		add(p+"ln_1.bias", C)
		add(p+"attn.c_attn.weight", 3*C, C)
		add(p+"attn.c_attn.bias", 3*C)
		add(p+"attn.c_proj.weight", C, C)
		add(p+"attn.c_proj.bias", C)
		add(p+"ln_2.weight", C)
		add(p+"ln_2.bias", C)
		if !c.IsMoE(i) {
			add(p+"mlp.c_fc.weight", F, C)
			add(p+"mlp.c_fc.bias", F)
			add(p+"mlp.c_proj.weight", C, F)
			add(p+"mlp.c_proj.bias", C)
			continue
		}
		add(p+"mlp.router.weight", E, C)
		for e := 0; e < E; e++ {
			if local(i, e) {
				out = append(out, c.ExpertSpecs(i, e)...)
			}
		}
	}
	if hi == c.NLayer {
		add("transformer.ln_f.weight", C)
		add("transformer.ln_f.bias", C)
		add("lm_head.weight", V, C)
	}
	return out
}

// BlockOf is the block whose state tensor name belongs to when a stage's state is handed over by
// blocks (proto.Handover): a block's own tensors and its experts' to it, the embeddings to block
// 0, ln_f and lm_head to the last block. It reports false for a name that is none of the model's.
func (c Config) BlockOf(name string) (int, bool) {
	switch name {
	case "transformer.wte.weight", "transformer.wpe.weight":
		return 0, true
	case "transformer.ln_f.weight", "transformer.ln_f.bias", "lm_head.weight":
		return c.NLayer - 1, true
	}
	rest, ok := strings.CutPrefix(name, "transformer.h.")
	if !ok {
		return 0, false
	}
	num, _, ok := strings.Cut(rest, ".")
	b, err := strconv.Atoi(num)
	if !ok || err != nil || b < 0 || b >= c.NLayer || strconv.Itoa(b) != num {
		return 0, false
	}
	return b, true
}

// SpecIndex numbers the model's tensors by name, in Specs' order: the one numbering every holder
// of some of them shares (proto.StateKey).
func (c Config) SpecIndex() map[string]int {
	specs := c.Specs()
	out := make(map[string]int, len(specs))
	for i, s := range specs {
		out[s.Name] = i
	}
	return out
}

// ExpertSpecs lists the four tensors of expert e of MoE block blk.
func (c Config) ExpertSpecs(blk, e int) []Spec {
	C, F := c.NEmbd, c.Hidden()
	p := ExpertPrefix(blk, e)
	return []Spec{
		{p + "c_fc.weight", []int{F, C}},
		{p + "c_fc.bias", []int{F}},
		{p + "c_proj.weight", []int{C, F}},
		{p + "c_proj.bias", []int{C}},
	}
}

// ExpertPrefix is the name prefix of expert e of block blk.
func ExpertPrefix(blk, e int) string { return fmt.Sprintf("transformer.h.%d.mlp.experts.%d.", blk, e) }

// Tensor is a named view into a parameter slab.
type Tensor struct {
	Spec
	Data []float32
}

// Params is a set of named tensors. NewParams cuts them from one slab, in order; Sub takes views of
// another Params, so a stage or an expert can share the whole model's slab in a single process
// and own a slab of its own on a peer, with the same code working on both.
type Params struct {
	Slab    []float32 // backing store when this Params owns one; nil for a Sub view
	Tensors []Tensor
	index   map[string]int
	// owner is what a slab outside the Go heap belongs to (NewParamsOver): the collector does
	// not follow pointers into such memory, so the Params, and its Sub views, hold the owner
	// alive themselves, whose cleanup would otherwise unmap the slab under them.
	owner any
}

// NewParams allocates one zeroed slab holding specs in order.
func NewParams(specs []Spec) *Params {
	return NewParamsOver(specs, make([]float32, SpecsSize(specs)), nil)
}

// SpecsSize is the number of values of tensors specs: the length of their slab.
func SpecsSize(specs []Spec) int {
	n := 0
	for _, s := range specs {
		n += s.Size()
	}
	return n
}

// NewParamsOver lays tensors specs over slab, which must hold exactly SpecsSize(specs) values:
// memory that is not the Go heap's, such as a file mapping (client/outerstore.go keeps a
// replica's outer state in one). Its values are taken as they are. owner is what the slab belongs
// to, kept alive as long as the Params or a Sub view of it is: a slice of one Tensor's Data alone
// does not keep it.
func NewParamsOver(specs []Spec, slab []float32, owner any) *Params {
	if n := SpecsSize(specs); len(slab) != n {
		panic(fmt.Sprintf("model: a slab of %d values for tensors of %d", len(slab), n))
	}
	p := &Params{Slab: slab, index: make(map[string]int, len(specs)), owner: owner}
	off := 0
	for i, s := range specs {
		sz := s.Size()
		p.Tensors = append(p.Tensors, Tensor{s, p.Slab[off : off+sz : off+sz]})
		p.index[s.Name] = i
		off += sz
	}
	return p
}

// Sub returns views of the named tensors of p, in the order given.
func (p *Params) Sub(specs []Spec) (*Params, error) {
	q := &Params{index: make(map[string]int, len(specs)), owner: p.owner}
	for i, s := range specs {
		t, ok := p.Lookup(s.Name)
		if !ok {
			return nil, fmt.Errorf("tensor %s: not in this parameter set", s.Name)
		}
		q.Tensors = append(q.Tensors, t)
		q.index[s.Name] = i
	}
	return q, nil
}

// Lookup returns the tensor called name.
func (p *Params) Lookup(name string) (Tensor, bool) {
	i, ok := p.index[name]
	if !ok {
		return Tensor{}, false
	}
	return p.Tensors[i], true
}

// Get returns the data of the tensor called name; a missing name is a programming error.
func (p *Params) Get(name string) []float32 {
	t, ok := p.Lookup(name)
	if !ok {
		panic("model: no tensor " + name)
	}
	return t.Data
}

// Specs lists the tensors' specs in order.
func (p *Params) Specs() []Spec {
	out := make([]Spec, len(p.Tensors))
	for i, t := range p.Tensors {
		out[i] = t.Spec
	}
	return out
}

// NumElements counts the parameters.
func (p *Params) NumElements() int {
	n := 0
	for _, t := range p.Tensors {
		n += len(t.Data)
	}
	return n
}

// Zero clears every tensor.
func (p *Params) Zero() {
	for _, t := range p.Tensors {
		clear(t.Data)
	}
}

// CopyFrom copies every tensor of p from the tensor of the same name in src.
func (p *Params) CopyFrom(src *Params) error {
	for _, t := range p.Tensors {
		s, ok := src.Lookup(t.Name)
		if !ok {
			return fmt.Errorf("copy %s: missing from source", t.Name)
		}
		if len(s.Data) != len(t.Data) {
			return fmt.Errorf("copy %s: %d elements, want %d", t.Name, len(s.Data), len(t.Data))
		}
		copy(t.Data, s.Data)
	}
	return nil
}

// Init fills every tensor as the anchor's gpt2_init does, each from its own stream seeded by
// (seed, tensor name): a stage or expert initialised alone on a peer equals the same tensors of the
// whole model initialised in one process.
func (p *Params) Init(cfg Config, seed uint64) {
	for _, t := range p.Tensors {
		InitTensor(cfg, seed, t)
	}
}

// InitTensor initialises one tensor: c_proj weights N(0, 0.02/√(2L)), other matrices N(0, 0.02),
// LayerNorm gains 1, biases 0.
func InitTensor(cfg Config, seed uint64, t Tensor) {
	name := t.Name
	switch {
	case strings.HasSuffix(name, "c_proj.weight"):
		fillNormal(t.Data, seed, name, 0.02/math.Sqrt(2*float64(cfg.NLayer)))
	case strings.HasSuffix(name, ".weight") && len(t.Shape) >= 2:
		fillNormal(t.Data, seed, name, 0.02)
	case strings.Contains(name, "ln_") && strings.HasSuffix(name, ".weight"):
		for i := range t.Data {
			t.Data[i] = 1
		}
	default:
		clear(t.Data)
	}
}

func fillNormal(dst []float32, seed uint64, name string, std float64) {
	h := fnv.New64a()
	h.Write([]byte(name))
	r := rand.New(rand.NewPCG(seed, h.Sum64()))
	for i := range dst {
		dst[i] = float32(r.NormFloat64() * std)
	}
}
