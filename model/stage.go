package model

import (
	"errors"
	"fmt"

	"github.com/shoal-ml/shoal/kernels"
)

// Stage is a pipeline stage: blocks [Lo, Hi) of the model, with the embeddings when Lo == 0 and
// ln_f, lm_head and the loss when Hi == L. It runs forward and backward one micro-batch at a time
// and keeps the activations of every micro-batch in flight (1F1B holds up to S of them). The whole
// model in one process is the stage [0, L) with local experts.
type Stage struct {
	Cfg     Config
	Lo, Hi  int
	P, G    *Params
	Experts Experts // computes the experts of this stage's MoE blocks; nil when it has none

	blocks []blockParams
	head   headParams
	acts   map[int]*stageActs // by micro-batch
	free   []*stageActs

	// Scratch for backward, shared by micro-batches: a stage runs one operation at a time.
	dx, dln, dbuf, dqkv, dfch []float32
}

// StageInput is what a micro-batch brings to a stage.
type StageInput struct {
	B, T int
	// Micro is M, the step's number of micro-batches, which places this micro-batch's tokens in
	// the experts' token groups (GroupEdge); 0 for evaluation and sampling.
	Micro   int
	Tokens  []int32   // (B,T) on the first stage
	X       []float32 // (B,T,C) residual stream from the previous stage, on the others
	Targets []int32   // (B,T) on the last stage
}

// StageOutput is what a stage's forward produces.
type StageOutput struct {
	X   []float32 // (B,T,C) for the next stage (not on the last); valid until Backward
	CE  float64   // mean cross-entropy, on the last stage
	Aux []float64 // the balancing loss of each of this stage's MoE blocks, in block order
	// Routed is, for each of this stage's MoE blocks in order, how many of the micro-batch's
	// token assignments went to each expert: the router statistics placement is planned on.
	Routed [][]int
}

type blockParams struct {
	moe                                              bool
	ln1w, ln1b, attnw, attnb, projw, projb           []float32
	ln2w, ln2b, fcw, fcb, fcprojw, fcprojb, router   []float32
	dln1w, dln1b, dattnw, dattnb, dprojw, dprojb     []float32
	dln2w, dln2b, dfcw, dfcb, dfcprojw, dfcprojb, dr []float32
}

type headParams struct {
	wte, wpe, lnfw, lnfb, lmhead      []float32
	dwte, dwpe, dlnfw, dlnfb, dlmhead []float32
}

type blockActs struct {
	x, ln1, ln1m, ln1r, qkv, att, atty, res2, ln2, ln2m, ln2r, fch, fchg, fcth []float32
	moe                                                                        moeActs
}

type stageActs struct {
	B, T    int
	edge    int // GroupEdge of this micro-batch
	tokens  []int32
	targets []int32
	blocks  []blockActs
	out     []float32 // residual stream after the last block
	lnf     []float32
	lnfm    []float32
	lnfr    []float32
	logits  []float32
}

// NewStage binds blocks [lo, hi) to parameters p and gradients g, which must hold the stage's
// tensors (Config.StageSpecs); experts computes the MoE blocks' experts.
func NewStage(cfg Config, lo, hi int, p, g *Params, experts Experts) (*Stage, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if lo < 0 || hi > cfg.NLayer || lo >= hi {
		return nil, fmt.Errorf("stage blocks [%d,%d) outside [0,%d)", lo, hi, cfg.NLayer)
	}
	s := &Stage{Cfg: cfg, Lo: lo, Hi: hi, P: p, G: g, Experts: experts, acts: map[int]*stageActs{}}
	for _, sp := range cfg.StageSpecs(lo, hi, false) {
		for _, set := range []*Params{p, g} {
			t, ok := set.Lookup(sp.Name)
			if !ok || len(t.Data) != sp.Size() {
				return nil, fmt.Errorf("stage [%d,%d): tensor %s missing or mis-sized", lo, hi, sp.Name)
			}
		}
	}
	for i := lo; i < hi; i++ {
		pre := fmt.Sprintf("transformer.h.%d.", i)
		b := blockParams{moe: cfg.IsMoE(i)}
		b.ln1w, b.dln1w = p.Get(pre+"ln_1.weight"), g.Get(pre+"ln_1.weight")
		b.ln1b, b.dln1b = p.Get(pre+"ln_1.bias"), g.Get(pre+"ln_1.bias")
		b.attnw, b.dattnw = p.Get(pre+"attn.c_attn.weight"), g.Get(pre+"attn.c_attn.weight")
		b.attnb, b.dattnb = p.Get(pre+"attn.c_attn.bias"), g.Get(pre+"attn.c_attn.bias")
		b.projw, b.dprojw = p.Get(pre+"attn.c_proj.weight"), g.Get(pre+"attn.c_proj.weight")
		b.projb, b.dprojb = p.Get(pre+"attn.c_proj.bias"), g.Get(pre+"attn.c_proj.bias")
		b.ln2w, b.dln2w = p.Get(pre+"ln_2.weight"), g.Get(pre+"ln_2.weight")
		b.ln2b, b.dln2b = p.Get(pre+"ln_2.bias"), g.Get(pre+"ln_2.bias")
		if b.moe {
			if experts == nil {
				return nil, fmt.Errorf("stage [%d,%d): block %d is MoE but no experts were given", lo, hi, i)
			}
			b.router, b.dr = p.Get(pre+"mlp.router.weight"), g.Get(pre+"mlp.router.weight")
		} else {
			b.fcw, b.dfcw = p.Get(pre+"mlp.c_fc.weight"), g.Get(pre+"mlp.c_fc.weight")
			b.fcb, b.dfcb = p.Get(pre+"mlp.c_fc.bias"), g.Get(pre+"mlp.c_fc.bias")
			b.fcprojw, b.dfcprojw = p.Get(pre+"mlp.c_proj.weight"), g.Get(pre+"mlp.c_proj.weight")
			b.fcprojb, b.dfcprojb = p.Get(pre+"mlp.c_proj.bias"), g.Get(pre+"mlp.c_proj.bias")
		}
		s.blocks = append(s.blocks, b)
	}
	if s.First() {
		s.head.wte, s.head.dwte = p.Get("transformer.wte.weight"), g.Get("transformer.wte.weight")
		s.head.wpe, s.head.dwpe = p.Get("transformer.wpe.weight"), g.Get("transformer.wpe.weight")
	}
	if s.Last() {
		s.head.lnfw, s.head.dlnfw = p.Get("transformer.ln_f.weight"), g.Get("transformer.ln_f.weight")
		s.head.lnfb, s.head.dlnfb = p.Get("transformer.ln_f.bias"), g.Get("transformer.ln_f.bias")
		s.head.lmhead, s.head.dlmhead = p.Get("lm_head.weight"), g.Get("lm_head.weight")
	}
	return s, nil
}

// First reports whether the stage holds the embeddings.
func (s *Stage) First() bool { return s.Lo == 0 }

// Last reports whether the stage holds the head and the loss.
func (s *Stage) Last() bool { return s.Hi == s.Cfg.NLayer }

// ErrInput is wrapped by errors about what a stage was given.
var ErrInput = errors.New("bad stage input")

func (s *Stage) check(mb int, in StageInput) error {
	c := s.Cfg
	bad := func(f string, a ...any) error {
		return fmt.Errorf("%w: micro-batch %d: %s", ErrInput, mb, fmt.Sprintf(f, a...))
	}
	if in.B < 1 || in.T < 1 || in.T > c.BlockSize {
		return bad("shape B=%d T=%d (T must be in [1,%d])", in.B, in.T, c.BlockSize)
	}
	N := in.B * in.T
	if s.First() {
		if len(in.Tokens) != N {
			return bad("%d tokens, want %d", len(in.Tokens), N)
		}
		for _, t := range in.Tokens {
			if t < 0 || int(t) >= c.VocabSize {
				return bad("token %d outside vocabulary [0,%d)", t, c.VocabSize)
			}
		}
	} else if len(in.X) != N*c.NEmbd {
		return bad("%d activations, want %d", len(in.X), N*c.NEmbd)
	}
	if s.Last() && in.Targets != nil {
		if len(in.Targets) != N {
			return bad("%d targets, want %d", len(in.Targets), N)
		}
		for _, t := range in.Targets {
			if t < 0 || int(t) >= c.VocabSize {
				return bad("target %d outside vocabulary [0,%d)", t, c.VocabSize)
			}
		}
	}
	if _, busy := s.acts[mb]; busy {
		return bad("already in flight")
	}
	return nil
}

// Forward runs micro-batch mb through the stage. On the last stage without targets it stops at
// the logits (Logits returns them), for sampling.
func (s *Stage) Forward(mb int, in StageInput) (StageOutput, error) {
	if err := s.check(mb, in); err != nil {
		return StageOutput{}, err
	}
	c := s.Cfg
	B, T, C := in.B, in.T, c.NEmbd
	N := B * T
	a := s.alloc(B, T)
	a.edge = GroupEdge(mb, in.Micro, N)
	a.tokens = append(a.tokens[:0], in.Tokens...)
	a.targets = append(a.targets[:0], in.Targets...)
	x := a.blocks[0].x
	if s.First() {
		kernels.EncoderForward(x, in.Tokens, s.head.wte, s.head.wpe, B, T, C)
	} else {
		copy(x, in.X)
	}
	var out StageOutput
	for i := range s.blocks {
		next := a.out
		if i+1 < len(a.blocks) {
			next = a.blocks[i+1].x
		}
		aux, err := s.blockForward(i, mb, &a.blocks[i], next, B, T, a.edge)
		if err != nil {
			s.release(mb, a)
			return StageOutput{}, err
		}
		if s.blocks[i].moe {
			out.Aux = append(out.Aux, aux)
			counts := make([]int, s.Cfg.NExpert)
			for e, toks := range a.blocks[i].moe.tokens {
				counts[e] = len(toks)
			}
			out.Routed = append(out.Routed, counts)
		}
	}
	s.acts[mb] = a
	if !s.Last() {
		out.X = a.out[:N*C]
		return out, nil
	}
	h := s.head
	kernels.LayerNormForward(a.lnf, a.lnfm, a.lnfr, a.out, h.lnfw, h.lnfb, N, C)
	kernels.LinearForward(a.logits, a.lnf, h.lmhead, nil, N, C, c.VocabSize)
	if in.Targets != nil {
		out.CE = kernels.CrossEntropyForward(a.logits, in.Targets, N, c.VocabSize)
	}
	return out, nil
}

// Logits returns the last stage's logits (B·T, V) of an in-flight micro-batch.
func (s *Stage) Logits(mb int) []float32 {
	a := s.acts[mb]
	if a == nil || !s.Last() {
		return nil
	}
	return a.logits[:a.B*a.T*s.Cfg.VocabSize]
}

func (s *Stage) blockForward(i, mb int, a *blockActs, out []float32, B, T, edge int) (float64, error) {
	c := s.Cfg
	C, F, H := c.NEmbd, c.Hidden(), c.NHead
	N := B * T
	p := &s.blocks[i]
	kernels.LayerNormForward(a.ln1, a.ln1m, a.ln1r, a.x, p.ln1w, p.ln1b, N, C)
	kernels.LinearForward(a.qkv, a.ln1, p.attnw, p.attnb, N, C, 3*C)
	kernels.AttentionForward(a.atty, a.att, a.qkv, B, T, C, H)
	kernels.LinearForward(a.res2, a.atty, p.projw, p.projb, N, C, C)
	for j := range a.res2[:N*C] {
		a.res2[j] += a.x[j]
	}
	kernels.LayerNormForward(a.ln2, a.ln2m, a.ln2r, a.res2, p.ln2w, p.ln2b, N, C)
	var aux float64
	if p.moe {
		if err := moeForward(&a.moe, out, a.ln2, p.router, s.Experts, s.Lo+i, mb, N, edge, c); err != nil {
			return 0, err
		}
		aux = a.moe.aux
	} else {
		kernels.LinearForward(a.fch, a.ln2, p.fcw, p.fcb, N, C, F)
		kernels.GELUForward(a.fchg, a.fcth, a.fch)
		kernels.LinearForward(out, a.fchg, p.fcprojw, p.fcprojb, N, F, C)
	}
	for j := range out[:N*C] {
		out[j] += a.res2[j]
	}
	return aux, nil
}

// Backward runs micro-batch mb backwards, accumulating the stage's gradients. dout is the gradient
// of the stage's output (nil on the last stage, which starts from its loss). lossScale multiplies
// the loss this stage owns — 1/M for M micro-batches — and auxCoef·lossScale weights the balancing
// losses. It returns the gradient of the stage's input (nil on the first stage); the slice is
// valid until the next Backward.
func (s *Stage) Backward(mb int, dout []float32, lossScale float32) ([]float32, error) {
	a, ok := s.acts[mb]
	if !ok {
		return nil, fmt.Errorf("%w: backward of micro-batch %d without its forward", ErrInput, mb)
	}
	c := s.Cfg
	B, T, C := a.B, a.T, c.NEmbd
	N := B * T
	s.dx = grow(s.dx, N*C)
	s.dln = grow(s.dln, N*C)
	dx := s.dx
	if s.Last() {
		if len(a.targets) != N {
			return nil, fmt.Errorf("%w: micro-batch %d was forwarded without targets", ErrInput, mb)
		}
		h := s.head
		kernels.CrossEntropyBackward(a.logits, a.targets, N, c.VocabSize, lossScale)
		kernels.LinearBackward(s.dln, h.dlmhead, nil, a.logits, a.lnf, h.lmhead, N, C, c.VocabSize, false)
		clear(dx)
		kernels.LayerNormBackward(dx, h.dlnfw, h.dlnfb, s.dln, a.out, h.lnfw, a.lnfm, a.lnfr, N, C)
	} else {
		if len(dout) != N*C {
			return nil, fmt.Errorf("%w: micro-batch %d: gradient of %d floats, want %d", ErrInput, mb, len(dout), N*C)
		}
		copy(dx, dout)
	}
	auxScale := float32(c.AuxLossCoef) * lossScale
	for i := len(s.blocks) - 1; i >= 0; i-- {
		if err := s.blockBackward(i, mb, &a.blocks[i], dx, B, T, auxScale); err != nil {
			s.release(mb, a)
			return nil, err
		}
	}
	if s.First() {
		kernels.EncoderBackward(s.head.dwte, s.head.dwpe, dx, a.tokens, B, T, C)
		dx = nil
	}
	s.release(mb, a)
	return dx, nil
}

// blockBackward turns dx, the gradient of block i's output, into the gradient of its input.
func (s *Stage) blockBackward(i, mb int, a *blockActs, dx []float32, B, T int, auxScale float32) error {
	c := s.Cfg
	C, F, H := c.NEmbd, c.Hidden(), c.NHead
	N := B * T
	p := &s.blocks[i]
	dln := s.dln
	if p.moe {
		if err := moeBackward(&a.moe, dln, p.dr, dx, a.ln2, p.router, s.Experts, s.Lo+i, mb, N, c, auxScale); err != nil {
			return err
		}
	} else {
		s.dfch = grow(s.dfch, N*F)
		kernels.LinearBackward(s.dfch, p.dfcprojw, p.dfcprojb, dx, a.fchg, p.fcprojw, N, F, C, false)
		kernels.GELUBackward(s.dfch, a.fch, a.fcth, s.dfch)
		kernels.LinearBackward(dln, p.dfcw, p.dfcb, s.dfch, a.ln2, p.fcw, N, C, F, false)
	}
	kernels.LayerNormBackward(dx, p.dln2w, p.dln2b, dln, a.res2, p.ln2w, a.ln2m, a.ln2r, N, C)
	// dx is now the gradient of res2 = x + attn(ln1(x)).
	s.dbuf = grow(s.dbuf, N*C)
	s.dqkv = grow(s.dqkv, N*3*C)
	kernels.LinearBackward(s.dbuf, p.dprojw, p.dprojb, dx, a.atty, p.projw, N, C, C, false)
	kernels.AttentionBackward(s.dqkv, s.dbuf, a.qkv, a.att, B, T, C, H)
	kernels.LinearBackward(dln, p.dattnw, p.dattnb, s.dqkv, a.ln1, p.attnw, N, C, 3*C, false)
	kernels.LayerNormBackward(dx, p.dln1w, p.dln1b, dln, a.x, p.ln1w, a.ln1m, a.ln1r, N, C)
	return nil
}

// Release drops the activations of micro-batch mb without a backward (evaluation, sampling).
func (s *Stage) Release(mb int) {
	if a, ok := s.acts[mb]; ok {
		s.release(mb, a)
	}
}

// Reset drops every in-flight micro-batch: a step abandoned after a failure.
func (s *Stage) Reset() {
	for mb, a := range s.acts {
		s.release(mb, a)
	}
}

// InFlight is the number of micro-batches whose activations the stage holds.
func (s *Stage) InFlight() int { return len(s.acts) }

func (s *Stage) release(mb int, a *stageActs) {
	delete(s.acts, mb)
	s.free = append(s.free, a)
}

// alloc returns an activation record sized for (B, T), reusing a released one.
func (s *Stage) alloc(B, T int) *stageActs {
	var a *stageActs
	if n := len(s.free); n > 0 {
		a, s.free = s.free[n-1], s.free[:n-1]
	} else {
		a = &stageActs{blocks: make([]blockActs, len(s.blocks))}
	}
	c := s.Cfg
	N, C, F, H := B*T, c.NEmbd, c.Hidden(), c.NHead
	a.B, a.T = B, T
	for i := range a.blocks {
		b := &a.blocks[i]
		b.x = grow(b.x, N*C)
		b.ln1, b.ln1m, b.ln1r = grow(b.ln1, N*C), grow(b.ln1m, N), grow(b.ln1r, N)
		b.qkv = grow(b.qkv, N*3*C)
		b.att = grow(b.att, B*H*T*T)
		b.atty, b.res2 = grow(b.atty, N*C), grow(b.res2, N*C)
		b.ln2, b.ln2m, b.ln2r = grow(b.ln2, N*C), grow(b.ln2m, N), grow(b.ln2r, N)
		if !s.blocks[i].moe {
			b.fch, b.fchg, b.fcth = grow(b.fch, N*F), grow(b.fchg, N*F), grow(b.fcth, N*F)
		}
	}
	a.out = grow(a.out, N*C)
	if s.Last() {
		a.lnf, a.lnfm, a.lnfr = grow(a.lnf, N*C), grow(a.lnfm, N), grow(a.lnfr, N)
		a.logits = grow(a.logits, N*c.VocabSize)
	}
	return a
}
