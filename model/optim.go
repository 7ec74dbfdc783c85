package model

import (
	"math"
	"sort"

	"github.com/shoal-ml/shoal/kernels"
)

// AdamW holds the optimizer state of one set of parameters (a stage, an expert, the whole model):
// the first and second moments, laid out like the parameters themselves.
type AdamW struct {
	M, V *Params

	ends   []int     // Update's tensor boundaries in the slabs, reused
	decays []float32 // and each tensor's decay factor
}

// AdamW's fixed hyperparameters, as docs/design.md ("A training step") and the anchor (nanoGPT) set them.
const (
	Beta1   = kernels.Beta1
	Beta2   = kernels.Beta2
	AdamEps = kernels.AdamEps
)

// NewAdamW allocates zeroed moments for specs.
func NewAdamW(specs []Spec) *AdamW { return &AdamW{M: NewParams(specs), V: NewParams(specs)} }

// Update applies one AdamW step to p with gradients g scaled by gradScale (the clip factor). t is
// the 1-based step count for bias correction. Weight decay is decoupled and applies only to
// tensors of two or more dimensions (matrices and embeddings), as nanoGPT configures it. The
// arithmetic follows torch.optim.AdamW's single-tensor path: decay, moments, then
// p −= (lr/bc1)·m / (√v/√bc2 + eps).
//
// Update works on host memory; a Shard on another device applies the same update there (Apply).
func (o *AdamW) Update(p, g *Params, t int, lr, weightDecay float64, gradScale float32) {
	stepSize, sqrtBC2 := adamwStep(t, lr)
	if sameSlabs(p, g, o.M, o.V) {
		// One pass over the slabs, shared by the threads: the same arithmetic on every element
		// as tensor by tensor (kernels.AdamWTensors).
		o.ends, o.decays = o.ends[:0], o.decays[:0]
		off := 0
		for _, pt := range p.Tensors {
			off += len(pt.Data)
			o.ends = append(o.ends, off)
			o.decays = append(o.decays, adamwDecay(pt.Spec, lr, weightDecay))
		}
		kernels.AdamWTensors(p.Slab, g.Slab, o.M.Slab, o.V.Slab, o.ends, o.decays, stepSize, sqrtBC2, gradScale)
		return
	}
	for i, pt := range p.Tensors {
		gt, mt, vt := g.Tensors[i].Data, o.M.Tensors[i].Data, o.V.Tensors[i].Data
		kernels.AdamW(pt.Data, gt, mt, vt, adamwDecay(pt.Spec, lr, weightDecay), stepSize, sqrtBC2, gradScale)
	}
}

// sameSlabs reports whether every Params owns a slab holding its tensors in order (NewParams),
// all of the same layout, so that the slabs can be updated as one.
func sameSlabs(ps ...*Params) bool {
	for _, p := range ps {
		if p.Slab == nil || len(p.Tensors) != len(ps[0].Tensors) || len(p.Slab) != len(ps[0].Slab) {
			return false
		}
		off := 0
		for i, t := range p.Tensors {
			if len(t.Data) != len(ps[0].Tensors[i].Data) || len(t.Data) > 0 && &t.Data[0] != &p.Slab[off] {
				return false
			}
			off += len(t.Data)
		}
		if off != len(p.Slab) {
			return false
		}
	}
	return true
}

// adamwStep returns step t's lr/bc1 and √bc2, the bias corrections folded into kernels.AdamW's
// arguments.
func adamwStep(t int, lr float64) (stepSize float32, sqrtBC2 float64) {
	bc1 := 1 - math.Pow(Beta1, float64(t))
	bc2 := 1 - math.Pow(Beta2, float64(t))
	return float32(lr / bc1), math.Sqrt(bc2)
}

// adamwDecay is the decoupled weight-decay factor of a tensor: 1 − lr·wd for matrices and
// embeddings, 1 (none) for vectors.
func adamwDecay(s Spec, lr, weightDecay float64) float32 {
	if len(s.Shape) >= 2 {
		return float32(1 - lr*weightDecay)
	}
	return 1
}

// SquaredNorms returns Σg² of every tensor of g, each summed in element order in float64: the
// per-tensor partial sums a shard reports, so that the global norm is the same whatever the
// sharding.
func SquaredNorms(g *Params) map[string]float64 {
	xs := make([][]float32, len(g.Tensors))
	for i, t := range g.Tensors {
		xs[i] = t.Data
	}
	sums := make([]float64, len(xs))
	kernels.SquaredNorms(sums, xs) // each tensor in element order; tensors shared by the threads
	out := make(map[string]float64, len(g.Tensors))
	for i, t := range g.Tensors {
		out[t.Name] = sums[i]
	}
	return out
}

// GlobalNorm sums per-tensor squared norms in tensor-name (byte) order and returns the root.
func GlobalNorm(parts map[string]float64) float64 {
	names := make([]string, 0, len(parts))
	for n := range parts {
		names = append(names, n)
	}
	sort.Strings(names)
	var s float64
	for _, n := range names {
		s += parts[n]
	}
	return math.Sqrt(s)
}

// ClipFactor is min(1, clip/(norm + 1e-6)), as torch.nn.utils.clip_grad_norm_; clip ≤ 0 disables it.
func ClipFactor(norm, clip float64) float32 {
	if clip <= 0 {
		return 1
	}
	return float32(math.Min(1, clip/(norm+1e-6)))
}
