package sched

import (
	"fmt"
	"slices"

	"github.com/shoal-ml/shoal/model"
)

// StateBytesPerParam is what a shard keeps per parameter: the float32 weight, its float32
// gradient (a micro-batch's, then the step's), and AdamW's float32 first and second moments.
// That is 4 copies of 4 bytes; "params + Adam state = 3×" forgets the gradient. The gradient
// tree's node buffers come on top: TreeBytesPerParam.
const StateBytesPerParam = 16

// TreeBytesPerParam is what the gradient tree (model/gradtree.go) adds per parameter for a shard
// computing micro-batches [lo, hi) of M: model.TreeBuffers float32 node buffers the size of the
// gradient — 0 for M = 1, 2 for M = 4 from micro-batch 0.
func TreeBytesPerParam(M, lo, hi int) float64 { return 4 * float64(model.TreeBuffers(M, lo, hi)) }

// EvidenceBytesPerParam is what a worker of an audited job keeps per parameter from one step to
// the next: the copy of its weights and both Adam moments that an audit of the step recomputes
// from (client's trainer, issue 18). Measured on the large model, it was most of what the
// estimate missed before it was counted.
const EvidenceBytesPerParam = 12

// Cost is the cost of one piece of the model (a block, the embedding, the head) for one
// micro-batch.
type Cost struct {
	// FLOPs is forward plus backward, counting a multiply-add as 2. Only matrix multiplies are
	// counted (layer norms, GELU, softmax and residual adds are O(N·C) or O(N·T·H) and small
	// beside them); backward is taken as twice forward (gradients with respect to inputs and
	// weights), the usual estimate (Kaplan et al. 2020, §2.1).
	FLOPs float64
	// Params is the parameter count.
	Params int64
	// StateBytes is the memory kept whatever the micro-batches: StateBytesPerParam per parameter,
	// and EvidenceBytesPerParam per parameter when the job audits (Profile.Audited). The
	// gradient tree's buffers depend on M and are added by the memory formulas.
	StateBytes float64
	// EvalActBytes is the activation memory of one evaluation pass (job.Spec.ValPassRows
	// sequences, never more than a micro-batch's) when the job evaluates (Profile.Evaluated), 0
	// otherwise. A worker holds an evaluation pass or its training micro-batches in flight, never
	// both (model.Stage.Trim).
	EvalActBytes float64
	// ActBytes is the activation memory kept from the micro-batch's forward until its backward,
	// estimated from what llm.c's train_gpt2.c keeps per token (inputs of every matmul, layer-norm
	// statistics, attention scores and probabilities, GELU input and output).
	ActBytes float64
}

// Profile is a model's costs per micro-batch, as the planner sees it. Byte and FLOP counts are
// float64: they are estimates, and float64 cannot overflow for any Config that validates.
type Profile struct {
	// Tokens is N = b·T, the tokens of one micro-batch of b sequences; Width is C, the values of
	// one token's row at a boundary.
	Tokens, Width int
	// Blocks holds each block's cost; an MoE block counts its router and all E experts'
	// parameters (experts stay with their stage for now) and the FLOPs of top_k experts per token.
	Blocks []Cost
	// Embed is wte and wpe, held by the first stage.
	Embed Cost
	// Head is ln_f, lm_head and the cross-entropy, held by the last stage.
	Head Cost
	// BoundaryBytes is the activation one stage sends the next per micro-batch (N·C float32
	// unless the job's wire compresses it: WithWire); GradBoundaryBytes the gradient sent back.
	BoundaryBytes, GradBoundaryBytes float64
}

// NewProfile returns the cost profile of cfg for micro-batches of microBatch sequences of
// cfg.BlockSize tokens (B/M in a job's terms).
func NewProfile(cfg model.Config, microBatch int) (Profile, error) {
	if err := cfg.Validate(); err != nil {
		return Profile{}, fmt.Errorf("%w: %w", ErrBadInput, err)
	}
	if microBatch < 1 || microBatch > 1<<20 {
		return Profile{}, fmt.Errorf("%w: micro-batch of %d sequences", ErrBadInput, microBatch)
	}
	T, C, F, H := float64(cfg.BlockSize), float64(cfg.NEmbd), float64(cfg.Hidden()), float64(cfg.NHead)
	E, K, V := float64(cfg.NExpert), float64(cfg.TopK), float64(cfg.VocabSize)
	N := float64(microBatch) * T
	c, f, e, v, t := int64(cfg.NEmbd), int64(cfg.Hidden()), int64(cfg.NExpert), int64(cfg.VocabSize), int64(cfg.BlockSize)

	// Forward FLOPs of attention: qkv projection 2·N·C·3C, scores QKᵀ and the weighted sum of V
	// 2·N·T·C each (the full T×T, as the reference computes it before masking), output
	// projection 2·N·C·C.
	attnFLOPs := 8*N*C*C + 4*N*T*C
	attnParams := 2*2*c + 4*c*c + 4*c // ln_1, ln_2, c_attn (3C×C + 3C), c_proj (C×C + C)
	mlpParams := 2*f*c + f + c        // c_fc (F×C + F), c_proj (C×F + C)
	// Floats kept per token by every block: ln_1 output and mean/rstd, qkv, attention scores
	// and probabilities (H·T each), attention output, its projection, the residual, ln_2 output
	// and mean/rstd, and the block's output.
	attnAct := 9*C + 4 + 2*H*T

	p := Profile{Tokens: int(N), Width: cfg.NEmbd, BoundaryBytes: 4 * N * C, GradBoundaryBytes: 4 * N * C}
	for i := 0; i < cfg.NLayer; i++ {
		var b Cost
		if cfg.IsMoE(i) {
			// Router 2·N·C·E, then each token through top_k expert MLPs (dropless: no token is
			// dropped, so the count is exact). Kept per token: router logits and probabilities,
			// and per assignment the expert's input, hidden pre- and post-GELU, and output.
			b.FLOPs = 3 * (attnFLOPs + 2*N*C*E + K*4*N*C*F)
			b.Params = attnParams + e*c + e*mlpParams
			b.StateBytes = StateBytesPerParam * float64(b.Params)
			// Per assignment: the expert's input and output, hidden pre- and post-GELU, and the
			// GELU's tanh, kept for its backward (model/moe.go's expertActs).
			b.ActBytes = 4 * N * (attnAct + 2*E + K*(2*C+3*F))
		} else {
			b.FLOPs = 3 * (attnFLOPs + 4*N*C*F)
			b.Params = attnParams + mlpParams
			b.StateBytes = StateBytesPerParam * float64(b.Params)
			b.ActBytes = 4 * N * (attnAct + C + 3*F) // + c_proj output, hidden pre- and post-GELU, its tanh
		}
		p.Blocks = append(p.Blocks, b)
	}
	// Embedding: a gather and an add forward, a scatter-add backward; no matmul, but not free.
	p.Embed = Cost{FLOPs: 3 * N * C, Params: v*c + t*c, StateBytes: StateBytesPerParam * float64(v*c+t*c), ActBytes: 4 * N * C}
	// Head: lm_head 2·N·C·V forward; kept per token: ln_f output and mean/rstd, logits,
	// probabilities and the loss.
	p.Head = Cost{FLOPs: 3 * 2 * N * C * V, Params: 2*c + v*c, StateBytes: StateBytesPerParam * float64(2*c+v*c),
		ActBytes: 4 * N * (C + 2 + 2*V + 1)}
	return p, nil
}

// Evaluated returns p for a job that computes a validation loss (val_every > 0) in passes of
// rows sequences (job.Spec.ValPassRows): every piece's activations per pass, which the memory model sets
// against the training micro-batches in flight (they scale with the tokens: ActBytes is per
// micro-batch of p.Tokens).
func (p Profile) Evaluated(rows, blockSize int) Profile {
	scale := float64(rows*blockSize) / float64(p.Tokens)
	return p.eachCost(func(c *Cost) { c.EvalActBytes = scale * c.ActBytes })
}

// Audited returns p for a job that audits its steps (job spec audit_rate > 0): every parameter
// costs EvidenceBytesPerParam more, the evidence a worker keeps from one step to the next.
func (p Profile) Audited() Profile { return p.withStateBytes(EvidenceBytesPerParam) }

// withStateBytes returns p with perParam more bytes of state per parameter of every piece.
func (p Profile) withStateBytes(perParam float64) Profile {
	return p.eachCost(func(c *Cost) { c.StateBytes += perParam * float64(c.Params) })
}

// eachCost returns p with f applied to the cost of every piece: the embedding, the head, each
// block (p's own Blocks are left as they were).
func (p Profile) eachCost(f func(*Cost)) Profile {
	f(&p.Embed)
	f(&p.Head)
	p.Blocks = slices.Clone(p.Blocks)
	for i := range p.Blocks {
		f(&p.Blocks[i])
	}
	return p
}

// NumBlocks is L.
func (p Profile) NumBlocks() int { return len(p.Blocks) }

// stageCost sums the costs of a stage holding blocks [a, b), with the embedding when a is 0 and
// the head when b is L. Sums run in block order, so every caller gets the same float64.
func (p Profile) stageCost(a, b int) Cost {
	var c Cost
	if a == 0 {
		c = p.Embed
	}
	for _, x := range p.Blocks[a:b] {
		c.FLOPs += x.FLOPs
		c.Params += x.Params
		c.StateBytes += x.StateBytes
		c.EvalActBytes += x.EvalActBytes
		c.ActBytes += x.ActBytes
	}
	if b == len(p.Blocks) {
		c.FLOPs += p.Head.FLOPs
		c.Params += p.Head.Params
		c.StateBytes += p.Head.StateBytes
		c.EvalActBytes += p.Head.EvalActBytes
		c.ActBytes += p.Head.ActBytes
	}
	return c
}

// StageFLOPs is the forward+backward FLOPs of one micro-batch on a stage holding blocks [a, b).
func (p Profile) StageFLOPs(a, b int) float64 { return p.stageCost(a, b).FLOPs }

// StageParams is the parameter count of a stage holding blocks [a, b).
func (p Profile) StageParams(a, b int) int64 { return p.stageCost(a, b).Params }

// SendBytes is what a stage holding blocks [a, b) sends per micro-batch: its activation forward
// unless it is the last stage, and its input's gradient backward unless it is the first.
func (p Profile) SendBytes(a, b int) float64 {
	n := 0.0
	if b < len(p.Blocks) {
		n += p.BoundaryBytes
	}
	if a > 0 {
		n += p.GradBoundaryBytes
	}
	return n
}

// WithWire returns p for a job whose boundaries travel in w's formats (job spec "wire"): what a
// stage sends per micro-batch shrinks with them (int8: C+4 bytes a row instead of 4·C), and the
// planner's transfer times with it.
func (p Profile) WithWire(w model.Wire) Profile {
	p.BoundaryBytes = float64(w.Activations.Bytes(p.Tokens, p.Width))
	p.GradBoundaryBytes = float64(w.Gradients.Bytes(p.Tokens, p.Width))
	return p
}

// StageMemory is the memory a stage holding blocks [a, b) needs as stage index of S stages
// running 1F1B with M micro-batches: its state (Cost.StateBytes), plus the activations of
// the min(S−index, M) micro-batches that OneFOneB has in flight at once on that stage, or of an
// evaluation pass when that is more (Evaluated). It is
// StageMemoryDepth at depth 0.
func (p Profile) StageMemory(a, b, index, S, M int) float64 {
	return stageMemory(p.stageCost(a, b), index, S, M, 0)
}

// StageMemoryDepth is StageMemory for OneFOneBDepth's schedule with depth extra micro-batches in
// flight: the activations of min(S−index+depth, M) micro-batches (InFlight).
func (p Profile) StageMemoryDepth(a, b, index, S, M, depth int) float64 {
	return stageMemory(p.stageCost(a, b), index, S, M, depth)
}

// stageMemory and stageSeconds are the formulas of StageMemory and StageSeconds on a summed
// Cost; the planner calls them on precomputed sums, and must get the very same float64s.
func stageMemory(c Cost, index, S, M, depth int) float64 {
	return c.StateBytes + TreeBytesPerParam(M, 0, M)*float64(c.Params) + max(float64(InFlight(index, S, M, depth))*c.ActBytes, c.EvalActBytes)
}

func stageSeconds(c Cost, sendBytes float64, peer Peer) (compute, transfer float64) {
	return c.FLOPs / (peer.GFLOPS * 1e9), sendBytes / peer.LinkBytesPerS
}

// StageSeconds is the time per micro-batch of a stage holding blocks [a, b) on peer: forward and
// backward compute at the peer's measured speed, plus sending its activation and gradient over
// the peer's measured upload. Compute and transfer are added, not overlapped, which is
// pessimistic but keeps slow links visible to the planner; download is assumed not to be the
// bottleneck (it rarely is on home connections).
func (p Profile) StageSeconds(peer Peer, a, b int) (compute, transfer float64) {
	return stageSeconds(p.stageCost(a, b), p.SendBytes(a, b), peer)
}
