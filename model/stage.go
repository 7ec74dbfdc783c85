package model

import (
	"errors"
	"fmt"
	"math"
)

// Stage is a pipeline stage: blocks [Lo, Hi) of the model, with the embeddings when Lo == 0 and
// ln_f, lm_head and the loss when Hi == L. It runs forward and backward one micro-batch at a time
// and keeps the activations of every micro-batch in flight (1F1B holds up to S of them). The whole
// model in one process is the stage [0, L) with local experts.
//
// A stage computes on a Device: its tensors and activations stay there, and only what it hands
// back — the output activations, the input gradient, the loss, the rows its MoE blocks route —
// is read to the host. P and G are the host mirror of its tensors (see Shard.Pull); on Host they
// are the device tensors themselves.
type Stage struct {
	Cfg     Config
	Lo, Hi  int
	P, G    *Params
	Experts Experts // computes the experts of this stage's MoE blocks; nil when it has none
	// Wire is the job's boundary formats: the residual stream between this stage's blocks is
	// rounded to them, forward and backward, as between stages (see wire.go). Its own input and
	// output cross by whoever carries them: Forward's X and Backward's result are unrounded.
	Wire Wire
	// AfterGroup, when set, is called during Backward(mb) as soon as a group of the stage's
	// tensors (TensorGroup: the head, each block, the embedding) has its micro-batch gradient:
	// the moment to fold it into the gradient tree (Shard.FoldGroup) and send what is final,
	// overlapping a replica's gradient exchange with the rest of the backward pass.
	AfterGroup func(mb, group int)

	dev    Device
	blocks []blockParams
	head   headParams
	acts   map[int]*stageActs // by micro-batch
	free   []*stageActs

	// Defer keeps a training micro-batch's loss and dense MoE blocks' statistics on the device
	// until TakeStats, which the caller then calls once a step, after the norms (with which they
	// come back in one read): for a GPU, where every read is a wait. The loss then comes back
	// through float32 rows. Off, Forward reads them at once, as on Host.
	Defer bool
	// ledger holds what Defer leaves on the device until TakeStats reads it.
	ledger statsLedger

	// Scratch for backward, shared by micro-batches: a stage runs one operation at a time.
	dx, dln, dbuf, dqkv, dfchg, dfch scratch
	dxHost                           []float32 // the input gradient Backward returns, off Host
	crossHost                        []float32 // a block boundary's values while rounded, off Host
	moe                              moeStaging
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
	X  []float32 // (B,T,C) for the next stage (not on the last); valid until Backward
	CE float64   // mean cross-entropy, on the last stage
	// Aux is the balancing loss of each of this stage's MoE blocks, in block order: NaN for a
	// block whose statistics stayed on the device (Deferred), which TakeStats returns.
	Aux []float64
	// Routed is, for each of this stage's MoE blocks in order, how many of the micro-batch's
	// token assignments went to each expert: the router statistics placement is planned on.
	// Nil for a deferred block.
	Routed [][]int
	// Deferred: some of the MoE blocks' statistics stayed on the device (a training
	// micro-batch on a GPU whose blocks take the dense path): Stage.TakeStats reads them, for all
	// the step's micro-batches at once, so that a micro-batch costs the device no wait for them.
	Deferred bool
}

// TakeStats reads the statistics that training forwards left on the device (StageOutput.Deferred)
// — one read for all of them — and forgets them. Nil when there are none.
func (s *Stage) TakeStats() []DeferredStats {
	l := &s.ledger
	if len(l.entries) == 0 {
		return nil
	}
	if !l.fetched { // else read with the step's norms (Shard.GradSquaredNorms)
		l.host = grow(l.host, l.used)
		s.dev.Read(l.host, s.dev.Slice(l.buf.base, 0, l.used))
	}
	out := make([]DeferredStats, len(l.entries))
	for k, en := range l.entries {
		v := l.host[en.off : en.off+en.n]
		if en.Block == lossEntry {
			var sum float64 // in row order, as CrossEntropyForward sums a device's rows
			for _, x := range v {
				sum += float64(x)
			}
			out[k] = DeferredStats{MB: en.MB, Block: lossEntry, CE: sum / float64(len(v))}
			continue
		}
		E := len(v) - 1
		r := make([]int, E)
		for e := range r {
			r[e] = int(v[e])
		}
		out[k] = DeferredStats{MB: en.MB, Block: en.Block, Aux: float64(v[E]), Routed: r}
	}
	l.entries, l.fetched, l.used = l.entries[:0], false, 0
	return out
}

type blockParams struct {
	moe                                              bool
	ln1w, ln1b, attnw, attnb, projw, projb           Buf
	ln2w, ln2b, fcw, fcb, fcprojw, fcprojb, router   Buf
	dln1w, dln1b, dattnw, dattnb, dprojw, dprojb     Buf
	dln2w, dln2b, dfcw, dfcb, dfcprojw, dfcprojb, dr Buf
}

type headParams struct {
	wte, wpe, lnfw, lnfb, lmhead      Buf
	dwte, dwpe, dlnfw, dlnfb, dlmhead Buf
}

type blockActs struct {
	x, ln1, ln1m, ln1r, qkv, att, atty, res2, ln2, ln2m, ln2r, fch, fchg, fcth Buf
	moe                                                                        moeActs
	mem                                                                        [14]scratch
}

type stageActs struct {
	B, T       int
	edge       int // GroupEdge of this micro-batch
	tokens     Buf // (B,T) int32, on the first stage
	targets    Buf // (B,T) int32, on the last stage when hasTargets
	hasTargets bool
	blocks     []blockActs
	out        Buf // residual stream after the last block
	lnf        Buf
	lnfm       Buf
	lnfr       Buf
	logits     Buf
	mem        [7]scratch
	// Host copies of what Forward hands out, off Host: valid while the micro-batch is in flight.
	outHost, logitsHost []float32
}

// NewStage binds blocks [lo, hi) to parameters p and gradients g on Host, which must hold the
// stage's tensors (Config.StageSpecs); experts computes the MoE blocks' experts.
func NewStage(cfg Config, lo, hi int, p, g *Params, experts Experts) (*Stage, error) {
	return newStage(Host{}, cfg, lo, hi, p, g, newDevParams(Host{}, p), newDevParams(Host{}, g), experts)
}

// newStage binds the stage to p and g and to dp and dg, their buffers on dev.
func newStage(dev Device, cfg Config, lo, hi int, p, g *Params, dp, dg *devParams, experts Experts) (*Stage, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if lo < 0 || hi > cfg.NLayer || lo >= hi {
		return nil, fmt.Errorf("stage blocks [%d,%d) outside [0,%d)", lo, hi, cfg.NLayer)
	}
	s := &Stage{Cfg: cfg, Lo: lo, Hi: hi, P: p, G: g, Experts: experts, dev: dev, acts: map[int]*stageActs{}}
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
		b.ln1w, b.dln1w = dp.get(pre+"ln_1.weight"), dg.get(pre+"ln_1.weight")
		b.ln1b, b.dln1b = dp.get(pre+"ln_1.bias"), dg.get(pre+"ln_1.bias")
		b.attnw, b.dattnw = dp.get(pre+"attn.c_attn.weight"), dg.get(pre+"attn.c_attn.weight")
		b.attnb, b.dattnb = dp.get(pre+"attn.c_attn.bias"), dg.get(pre+"attn.c_attn.bias")
		b.projw, b.dprojw = dp.get(pre+"attn.c_proj.weight"), dg.get(pre+"attn.c_proj.weight")
		b.projb, b.dprojb = dp.get(pre+"attn.c_proj.bias"), dg.get(pre+"attn.c_proj.bias")
		b.ln2w, b.dln2w = dp.get(pre+"ln_2.weight"), dg.get(pre+"ln_2.weight")
		b.ln2b, b.dln2b = dp.get(pre+"ln_2.bias"), dg.get(pre+"ln_2.bias")
		if b.moe {
			if experts == nil {
				return nil, fmt.Errorf("stage [%d,%d): block %d is MoE but no experts were given", lo, hi, i)
			}
			b.router, b.dr = dp.get(pre+"mlp.router.weight"), dg.get(pre+"mlp.router.weight")
		} else {
			b.fcw, b.dfcw = dp.get(pre+"mlp.c_fc.weight"), dg.get(pre+"mlp.c_fc.weight")
			b.fcb, b.dfcb = dp.get(pre+"mlp.c_fc.bias"), dg.get(pre+"mlp.c_fc.bias")
			b.fcprojw, b.dfcprojw = dp.get(pre+"mlp.c_proj.weight"), dg.get(pre+"mlp.c_proj.weight")
			b.fcprojb, b.dfcprojb = dp.get(pre+"mlp.c_proj.bias"), dg.get(pre+"mlp.c_proj.bias")
		}
		s.blocks = append(s.blocks, b)
	}
	if s.First() {
		s.head.wte, s.head.dwte = dp.get("transformer.wte.weight"), dg.get("transformer.wte.weight")
		s.head.wpe, s.head.dwpe = dp.get("transformer.wpe.weight"), dg.get("transformer.wpe.weight")
	}
	if s.Last() {
		s.head.lnfw, s.head.dlnfw = dp.get("transformer.ln_f.weight"), dg.get("transformer.ln_f.weight")
		s.head.lnfb, s.head.dlnfb = dp.get("transformer.ln_f.bias"), dg.get("transformer.ln_f.bias")
		s.head.lmhead, s.head.dlmhead = dp.get("lm_head.weight"), dg.get("lm_head.weight")
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
// the logits (Logits returns them), for sampling. The output's X is valid until the micro-batch's
// Backward or Release.
func (s *Stage) Forward(mb int, in StageInput) (StageOutput, error) {
	if err := s.check(mb, in); err != nil {
		return StageOutput{}, err
	}
	c, d := s.Cfg, s.dev
	B, T, C := in.B, in.T, c.NEmbd
	N := B * T
	a := s.alloc(B, T)
	a.edge = GroupEdge(mb, in.Micro, N)
	x := a.blocks[0].x
	if s.First() {
		d.WriteInt32(a.tokens, in.Tokens)
		d.EncoderForward(x, a.tokens, s.head.wte, s.head.wpe, B, T, C)
	} else {
		d.Write(x, in.X)
	}
	a.hasTargets = s.Last() && in.Targets != nil
	if a.hasTargets {
		d.WriteInt32(a.targets, in.Targets)
	}
	var out StageOutput
	// A training micro-batch on a GPU leaves its dense MoE blocks' statistics there, for
	// TakeStats; an evaluation or sampling pass reads them at once.
	var ledger *statsLedger
	if _, host := d.(hostMemory); !host && s.Defer && in.Micro > 0 {
		ledger = &s.ledger
		ledger.reserve(d, in.Micro*(len(s.blocks)*(c.NExpert+1)+N))
	}
	j := 0 // the stage's MoE blocks so far
	for i := range s.blocks {
		next := a.out
		if i+1 < len(a.blocks) {
			next = a.blocks[i+1].x
		}
		if ledger != nil {
			ledger.next = deferred{MB: mb, Block: j}
		}
		aux, err := s.blockForward(i, mb, &a.blocks[i], next, B, T, a.edge, ledger)
		if err != nil {
			s.release(mb, a)
			return StageOutput{}, err
		}
		if i+1 < len(a.blocks) {
			s.cross(next, s.Wire.Activations, C) // block i+1's input, as if sent to it
		}
		if s.blocks[i].moe {
			j++
			out.Aux = append(out.Aux, aux)
			if math.IsNaN(aux) && len(a.blocks[i].moe.counts) == 0 {
				out.Routed = append(out.Routed, nil)
				out.Deferred = true
				continue
			}
			out.Routed = append(out.Routed, append([]int(nil), a.blocks[i].moe.counts...))
		}
	}
	s.acts[mb] = a
	if !s.Last() {
		out.X = readView(d, a.out, &a.outHost)
		return out, nil
	}
	h := s.head
	d.LayerNormForward(a.lnf, a.lnfm, a.lnfr, a.out, h.lnfw, h.lnfb, N, C)
	d.LinearForward(a.logits, a.lnf, h.lmhead, nil, N, C, c.VocabSize)
	if a.hasTargets {
		if slot := ledger.takeLoss(d, mb, N); slot != nil {
			d.CrossEntropyRows(slot, a.logits, a.targets, N, c.VocabSize)
			out.CE, out.Deferred = math.NaN(), true // TakeStats has it
		} else {
			out.CE = d.CrossEntropyForward(a.logits, a.targets, N, c.VocabSize)
		}
	}
	return out, nil
}

// Logits returns the last stage's logits (B·T, V) of an in-flight micro-batch, read from the
// device: for sampling.
func (s *Stage) Logits(mb int) []float32 {
	a := s.acts[mb]
	if a == nil || !s.Last() {
		return nil
	}
	return readView(s.dev, a.logits, &a.logitsHost)
}

func (s *Stage) blockForward(i, mb int, a *blockActs, out Buf, B, T, edge int, ledger *statsLedger) (float64, error) {
	c, d := s.Cfg, s.dev
	C, F, H := c.NEmbd, c.Hidden(), c.NHead
	N := B * T
	p := &s.blocks[i]
	d.LayerNormForward(a.ln1, a.ln1m, a.ln1r, a.x, p.ln1w, p.ln1b, N, C)
	d.LinearForward(a.qkv, a.ln1, p.attnw, p.attnb, N, C, 3*C)
	d.AttentionForward(a.atty, a.att, a.qkv, B, T, C, H)
	d.LinearForward(a.res2, a.atty, p.projw, p.projb, N, C, C)
	d.Add(a.res2, a.x)
	d.LayerNormForward(a.ln2, a.ln2m, a.ln2r, a.res2, p.ln2w, p.ln2b, N, C)
	var aux float64
	if p.moe {
		if err := moeForward(d, &s.moe, &a.moe, out, a.ln2, p.router, s.Experts, s.Lo+i, mb, N, edge, c, ledger); err != nil {
			return 0, err
		}
		aux = a.moe.aux
	} else {
		d.LinearForward(a.fch, a.ln2, p.fcw, p.fcb, N, C, F)
		d.GELUForward(a.fchg, a.fcth, a.fch)
		d.LinearForward(out, a.fchg, p.fcprojw, p.fcprojb, N, F, C)
	}
	d.Add(out, a.res2)
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
	c, d := s.Cfg, s.dev
	B, T, C := a.B, a.T, c.NEmbd
	N := B * T
	dx, dln := s.dx.at(d, N*C), s.dln.at(d, N*C)
	if s.Last() {
		if !a.hasTargets {
			return nil, fmt.Errorf("%w: micro-batch %d was forwarded without targets", ErrInput, mb)
		}
		h := s.head
		d.CrossEntropyBackward(a.logits, a.targets, N, c.VocabSize, lossScale)
		d.LinearBackward(dln, h.dlmhead, nil, a.logits, a.lnf, h.lmhead, N, C, c.VocabSize, false)
		d.Zero(dx)
		d.LayerNormBackward(dx, h.dlnfw, h.dlnfb, dln, a.out, h.lnfw, a.lnfm, a.lnfr, N, C)
		s.afterGroup(mb, c.NLayer)
	} else {
		if len(dout) != N*C {
			return nil, fmt.Errorf("%w: micro-batch %d: gradient of %d floats, want %d", ErrInput, mb, len(dout), N*C)
		}
		d.Write(dx, dout)
	}
	auxScale := float32(c.AuxLossCoef) * lossScale
	for i := len(s.blocks) - 1; i >= 0; i-- {
		if err := s.blockBackward(i, mb, &a.blocks[i], dx, dln, B, T, auxScale); err != nil {
			s.release(mb, a)
			return nil, err
		}
		s.afterGroup(mb, s.Lo+i)
		if i > 0 {
			s.cross(dx, s.Wire.Gradients, C) // block i-1's output gradient, as if sent back to it
		}
	}
	if s.First() {
		d.EncoderBackward(s.head.dwte, s.head.dwpe, dx, a.tokens, B, T, C)
		s.afterGroup(mb, -1)
		s.release(mb, a)
		return nil, nil
	}
	s.release(mb, a)
	return readView(d, dx, &s.dxHost), nil
}

func (s *Stage) afterGroup(mb, group int) {
	if s.AfterGroup != nil {
		s.AfterGroup(mb, group)
	}
}

// blockBackward turns dx, the gradient of block i's output, into the gradient of its input. dln
// is scratch of dx's size.
func (s *Stage) blockBackward(i, mb int, a *blockActs, dx, dln Buf, B, T int, auxScale float32) error {
	c, d := s.Cfg, s.dev
	C, F, H := c.NEmbd, c.Hidden(), c.NHead
	N := B * T
	p := &s.blocks[i]
	if p.moe {
		if err := moeBackward(d, &s.moe, &a.moe, dln, p.dr, dx, a.ln2, p.router, s.Experts, s.Lo+i, mb, N, c, auxScale); err != nil {
			return err
		}
	} else {
		dfchg, dfch := s.dfchg.at(d, N*F), s.dfch.at(d, N*F)
		d.LinearBackward(dfchg, p.dfcprojw, p.dfcprojb, dx, a.fchg, p.fcprojw, N, F, C, false)
		d.GELUBackward(dfch, a.fch, a.fcth, dfchg)
		d.LinearBackward(dln, p.dfcw, p.dfcb, dfch, a.ln2, p.fcw, N, C, F, false)
	}
	d.LayerNormBackward(dx, p.dln2w, p.dln2b, dln, a.res2, p.ln2w, a.ln2m, a.ln2r, N, C)
	// dx is now the gradient of res2 = x + attn(ln1(x)).
	dbuf, dqkv := s.dbuf.at(d, N*C), s.dqkv.at(d, N*3*C)
	d.LinearBackward(dbuf, p.dprojw, p.dprojb, dx, a.atty, p.projw, N, C, C, false)
	d.AttentionBackward(dqkv, dbuf, a.qkv, a.att, B, T, C, H)
	d.LinearBackward(dln, p.dattnw, p.dattnb, dqkv, a.ln1, p.attnw, N, C, 3*C, false)
	d.LayerNormBackward(dx, p.dln1w, p.dln1b, dln, a.x, p.ln1w, a.ln1m, a.ln1r, N, C)
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
	s.ledger.entries, s.ledger.fetched, s.ledger.used = s.ledger.entries[:0], false, 0
}

// Trim lets go of the activation records the stage keeps for reuse (Reset first): after an
// evaluation, whose passes (up to data.ValRows sequences) can be several training micro-batches,
// they would otherwise stay that size for the rest of the job, beside the training ones — memory
// the planner does not budget (sched's memory model counts an evaluation pass or the training
// micro-batches in flight, whichever is larger, not both). The next forward allocates afresh at
// its own size. Only host memory is let go: a device without a way to free a buffer keeps it.
func (s *Stage) Trim() {
	if _, ok := s.dev.(hostMemory); ok {
		s.free = nil
	}
}

// InFlight is the number of micro-batches whose activations the stage holds.
func (s *Stage) InFlight() int { return len(s.acts) }

func (s *Stage) release(mb int, a *stageActs) {
	delete(s.acts, mb)
	s.free = append(s.free, a)
}

// alloc returns an activation record sized for (B, T), reusing a released one and its buffers.
func (s *Stage) alloc(B, T int) *stageActs {
	var a *stageActs
	if n := len(s.free); n > 0 {
		a, s.free = s.free[n-1], s.free[:n-1]
	} else {
		a = &stageActs{blocks: make([]blockActs, len(s.blocks))}
	}
	c, d := s.Cfg, s.dev
	N, C, F, H := B*T, c.NEmbd, c.Hidden(), c.NHead
	a.B, a.T = B, T
	for i := range a.blocks {
		b := &a.blocks[i]
		m := &b.mem
		b.x = m[0].at(d, N*C)
		b.ln1, b.ln1m, b.ln1r = m[1].at(d, N*C), m[2].at(d, N), m[3].at(d, N)
		b.qkv = m[4].at(d, N*3*C)
		b.att = m[5].at(d, B*H*T*T)
		b.atty, b.res2 = m[6].at(d, N*C), m[7].at(d, N*C)
		b.ln2, b.ln2m, b.ln2r = m[8].at(d, N*C), m[9].at(d, N), m[10].at(d, N)
		if !s.blocks[i].moe {
			b.fch, b.fchg, b.fcth = m[11].at(d, N*F), m[12].at(d, N*F), m[13].at(d, N*F)
		}
	}
	m := &a.mem
	a.out = m[0].at(d, N*C)
	if s.First() {
		a.tokens = m[1].atInt32(d, N)
	}
	if s.Last() {
		a.targets = m[2].atInt32(d, N)
		a.lnf, a.lnfm, a.lnfr = m[3].at(d, N*C), m[4].at(d, N), m[5].at(d, N)
		a.logits = m[6].at(d, N*c.VocabSize)
	}
	return a
}
