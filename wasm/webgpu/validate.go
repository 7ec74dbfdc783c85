//go:build js && wasm

package webgpu

import (
	"fmt"
	"math"
	"math/rand/v2"

	"github.com/shoal-ml/shoal/kernels"
	"github.com/shoal-ml/shoal/kernels/wgsl"
)

// Result is the comparison of one output of one validation case with the Go reference.
type Result struct {
	Kernel string `json:"kernel"`
	Shape  string `json:"shape"`
	Output string `json:"output"`
	// RelErr is ‖gpu − ref‖₂ / ‖ref‖₂ (‖gpu − ref‖₂ when the reference is all zeros). Where the
	// output is the small difference of larger float32 terms (cross-entropy), the denominator
	// is the larger terms' norm when that is bigger: see tolSoftmax.
	RelErr float64 `json:"rel_err"`
	MaxAbs float64 `json:"max_abs"` // max |gpu − ref|
	Tol    float64 `json:"tol"`     // the largest RelErr that passes
	Pass   bool    `json:"pass"`
	// Note says what failed besides the error: a GPU error, a panic, a write outside the view.
	Note string `json:"note,omitempty"`
}

// ValidateOptions configures Validate.
type ValidateOptions struct {
	// Seed makes the random inputs; each case draws from its own stream of (Seed, case index).
	Seed uint64
	// Perturb moves every element of one input of each case by ±1% of that input's RMS
	// (alternating in sign; for Fill the value by 1%, for cross-entropy each target to the
	// next class), on the GPU's side only. Every case must then fail: that shows each
	// comparison can fail, and that its tolerance is far below the effect of a 1% error in an
	// input.
	Perturb bool
	// Only, when not empty, runs only the kernels it names (Result.Kernel values).
	Only []string
}

// Tolerances on RelErr, per kernel. The GPU computes in float32 like the Go kernels, but in a
// different order or with different elementary functions; each says why it is what it is. The
// "worst seen" figures are SwiftShader's, over 20–60 seeds of every case.
const (
	// The same chain per element as the Go kernels (kernels/doc.go); the only freedom is
	// whether a multiply and an add fuse (WGSL allows it), which moves each step by at most half
	// an ulp of the partial sum: ~1e-7 relative on shapes up to 256. Worst seen: 0 (SwiftShader
	// does not fuse, nor does the pure-Go reference).
	tolMatMul = 1e-6
	// The same float32 operations in the same order as the Go reference, so the bits must match:
	// a single add (Add, BiasAdd, EncoderForward), a copy or fill, and EncoderBackward, whose
	// every output element is one chain over its rows in row order (encoder_backward).
	tolExact = 0
	// The same tanh polynomial and GELU formula in the same order; WGSL may fuse a multiply-add,
	// which changes a result by an ulp or so. Worst seen: 0.
	tolGELU = 1e-6
	// Go accumulates LayerNorm's statistics in float64 and takes math.Sqrt in float64; WGSL has
	// float32 only (two passes, the second over centred values, each a workgroup's tree) and a
	// sqrt within a few ulp. The parameter gradients dw, db are column sums, chunked and
	// tree-combined as for tolColSum. Worst seen: 3.5e-7 (dw, db at N=201; out at C=256).
	tolLayerNorm = 1e-5
	// exp and log: Go's are float64 and correctly rounded in practice; WGSL's float32 exp/log
	// are only required to be within 3 + 2·|x| ulp (WGSL §14.6), and the GPU sums the
	// exponentials in float32 where Go sums in float64. Worst seen: 2.5e-7. Cross-entropy's
	// outputs are differences of larger float32 terms (a loss is logsumexp − logit; a gradient
	// softmax − 1, scaled by scale/N), which both sides round at the larger terms' ulp: for a
	// confident row the difference is tiny and its relative error large, though both sides are
	// right to float32 precision. Its errors are therefore measured against the larger terms'
	// norm (‖logsumexp‖, ‖onehot·scale/N‖) when that exceeds the output's (without: 2.4e-5 seen
	// on N=1, V=2).
	tolSoftmax = 1e-5
	// Attention adds the softmax's error to two float32 products over T and hs. Worst seen: 1e-7.
	tolAttention = 2e-5
	// Squared norms: float32 partial sums in a fixed tree against a float64 sum; all terms are
	// positive, so nothing cancels. Worst seen: 2e-8.
	tolSumSq = 1e-6
	// AdamW divides by √v + ε in float32 (WGSL division is within 2.5 ulp, sqrt a few) where Go
	// takes the square root in float64. Compared on the step w − w₀, not on w, so that an error
	// is measured against the step and not hidden by the weights' size; the weights are drawn at
	// a GPT's scale (0.02) so that w's own rounding stays far below the step. Worst seen: 7e-7.
	tolAdamW = 1e-5
	// The MoE routing ops that keep the Go reference's float32 chain per element (kernels/moe.go):
	// GateRows with acc (a multiply, then an add), GateGrad (a dot over C in c order) and
	// SoftmaxBackwardRows (a dot over E in e order, then a subtract and a multiply). As for
	// tolMatMul the only freedom is whether WGSL fuses a multiply and an add, which moves each
	// step by at most half an ulp of its partial sum: ~1e-7 relative at C ≤ 256. GateRows without
	// acc is a single multiply, correctly rounded in WGSL as in Go, and TopKGate compares and
	// copies: both are held to tolExact, as are MoEStats' counts. Worst seen: 0 (SwiftShader
	// does not fuse), 12 seeds of every MoE case.
	tolGate = 1e-6
	// MoEStats' balancing loss E·Σ_e f_e·P_e: Go sums each column in float64 and rounds the loss
	// once; WGSL has no f64, so moe_stats sums in float32 — 128 strided chains of ⌈N/128⌉ rows,
	// then a 7-level pairwise tree (every term positive: nothing cancels) — and adds the experts'
	// terms in a float32 chain in expert order, with two divisions within 2.5 ulp each. Bounded
	// by (⌈N/128⌉ + 7 + E + 2·2.5 + 3)·2⁻²⁴ relative: 5e-6 at the validated N ≤ 201, E ≤ 64,
	// 8.5e-6 at a micro-batch of 8192 rows and 64 experts; far below the ≥ 1e-2 a 1% shift of the
	// probabilities gives. The counts (sums of 0s and 1s, exact in float32) are held to tolExact.
	// Worst seen: 2.3e-7 (N=201, E=64), 12 seeds.
	tolMoEStats = 1e-5
	// AuxGrad: f_e = count_e/(N·K) and scale·E·f_e/N are two divisions that Go makes in float64
	// and float32, correctly rounded, and WGSL within 2.5 ulp each: the added term is within ~6 ulp
	// (4e-7 relative) of the reference's, then one add as the reference's. Worst seen: 0, 12 seeds.
	tolAuxGrad = 1e-6
)

// tolColSum is the tolerance of a column sum over N rows (BiasGrad, LinearBackward's db). Go adds
// the rows to db one by one in row order; the GPU sums chunks of 32 rows in row order, the chunk
// sums in a pairwise tree, then adds that to db (bias_grad, colsum_tree): the same terms in
// another order, so the bits differ. Which side errs is Go's: a sequential float32 sum of N
// terms of random sign rounds N times at partial sums of size ~√r·σ, a random walk whose error
// is ~ε·σ·N/√6 (ε = 2⁻²⁴), against a sum of size ~√N·σ — a relative error of ~0.4·ε·√N, where the
// chunked tree's is ~ε·√(32 + log₂ N). Measured, SwiftShader, 12 seeds: 0.43·ε·√N at N=201
// (3.6e-7) and 0.44·ε·√N at N=64 (2.1e-7). The tolerance is 4·ε·√N, 10× that expectation, with
// a floor of 1e-6; it grows with N because the reference's own error does (3e-6 at a micro-batch
// of 8·1024 rows), and stays far below the 1e-2 a 1% error in dout gives. It is not zero because
// a GPU needs the tree to spread a sum over thousands of rows across its lanes (issue 15).
// LayerNormBackward's dw and db are column sums too, within tolLayerNorm (worst 3.5e-7, N=201).
func tolColSum(N int) float64 { return max(1e-6, 4*0x1p-24*math.Sqrt(float64(N))) }

// Validate runs every kernel on random inputs against its Go reference in package kernels, forward
// and backward, on shapes that include sizes of 1 and odd sizes that fill no tile. Every tensor
// is a view at an odd offset inside a larger buffer, and the elements around each output view
// must come back untouched. Where an op accumulates, outputs start non-zero; where it
// overwrites, they start with garbage.
func Validate(d *Device, o ValidateOptions) []Result {
	var out []Result
	only := map[string]bool{}
	for _, k := range o.Only {
		only[k] = true
	}
	defer func(gpu bool) { d.gpuKernels = gpu }(d.gpuKernels)
	for i, c := range validationCases() {
		if len(only) > 0 && !only[c.kernel] {
			continue
		}
		// Cases whose ops have a variant for GPUs and one for fallback adapters (matmul, the
		// row kernels) run on both, whichever the adapter would pick: both are compiled on
		// every adapter, and a GPU must not run a kernel that was never checked.
		variants := []bool{d.gpuKernels}
		if hasVariants[c.kernel] {
			variants = []bool{false, true}
		}
		for _, gpu := range variants {
			shape := c.shape
			if hasVariants[c.kernel] {
				shape += " " + VariantName(gpu)
			}
			d.gpuKernels = gpu
			v := &vcase{
				d: d, rng: rand.New(rand.NewPCG(o.Seed, uint64(i))), perturb: o.Perturb,
				kernel: c.kernel, shape: shape, where: map[*Tensor]placed{}, sentinels: map[*Tensor][]bool{},
			}
			v.run(c.fn)
			out = append(out, v.results...)
		}
	}
	return out
}

// hasVariants lists the validation cases whose ops run a kernel with a GPU and a fallback
// variant: a matmul or a row kernel.
var hasVariants = map[string]bool{
	"MatMulNN": true, "MatMulNT": true, "MatMulTN": true, "AttentionForward": true, "AttentionBackward": true,
	"LinearForward": true, "LinearBackward": true, "LayerNormForward": true, "LayerNormBackward": true,
	"CrossEntropyForward": true, "CrossEntropyBackward": true, "SoftmaxRows": true, "2-D grid": true,
	"Deterministic": true,
}

// VariantName names the kernel variants, as in a validation case's shape: "[gpu]" (matmul_tiled,
// a workgroup per row) or "[fallback]" (matmul, an invocation per row).
func VariantName(gpu bool) string {
	if gpu {
		return "[gpu]"
	}
	return "[fallback]"
}

type validationCase struct {
	kernel, shape string
	fn            func(v *vcase)
}

// vcase is one case being run: its random stream, its tensors, and its results.
type vcase struct {
	d             *Device
	rng           *rand.Rand
	perturb       bool
	kernel, shape string
	where         map[*Tensor]placed
	sentinels     map[*Tensor][]bool // per buffer, the elements that must stay sentinel
	results       []Result
}

// placed is where a view lies in the buffer the case made for it.
type placed struct {
	root *Tensor
	off  int
}

// sentinel fills the elements around every view; a kernel that writes outside its view
// changes them.
const sentinel = -7777.25

func (v *vcase) run(fn func(v *vcase)) {
	defer func() {
		if r := recover(); r != nil {
			v.results = append(v.results, Result{Kernel: v.kernel, Shape: v.shape, Output: "-", Note: fmt.Sprint("panic: ", r)})
		}
		for root := range v.sentinels {
			v.d.Release(root)
		}
	}()
	fn(v)
}

// randn returns n random values of either sign with magnitudes scale·(0.25 + |N(0,1)|):
// normal-like, but never near zero, so that no case hinges on a draw too small to matter —
// Perturb needs every input of a case to move its outputs.
func (v *vcase) randn(n int, scale float64) []float32 {
	x := make([]float32, n)
	for i := range x {
		m := 0.25 + math.Abs(v.rng.NormFloat64())
		if v.rng.IntN(2) == 0 {
			m = -m
		}
		x[i] = float32(m * scale)
	}
	return x
}

// pack uploads xs as views of one buffer, in order, each after a gap of sentinels of random
// length (so views start at odd, unaligned offsets), with sentinels after the last one too.
func (v *vcase) pack(xs ...[]float32) []*Tensor {
	var buf []float32
	var mask []bool
	offs := make([]int, len(xs))
	gap := func() {
		for g := 1 + 2*v.rng.IntN(34); g > 0; g-- {
			buf = append(buf, sentinel)
			mask = append(mask, true)
		}
	}
	for i, x := range xs {
		gap()
		offs[i] = len(buf)
		buf = append(buf, x...)
		mask = append(mask, make([]bool, len(x))...)
	}
	gap()
	root := v.d.FromFloat32(buf)
	v.sentinels[root] = mask
	ts := make([]*Tensor, len(xs))
	for i, x := range xs {
		ts[i] = root.Slice(offs[i], len(x))
		v.where[ts[i]] = placed{root, offs[i]}
	}
	return ts
}

// in uploads x as a view at a random odd offset inside a larger buffer.
func (v *vcase) in(x []float32) *Tensor { return v.pack(x)[0] }

// perturbed returns x, or with Perturb a copy of x with every element moved by 1% of x's RMS,
// up and down alternately: for the one input of a case that Perturb changes. A shift of fixed
// size (rather than a random one, or a scaling) moves every output the case checks, whatever
// the values drawn: the two logits of a softmax of width 2 move apart, a single element moves
// by 1% of itself.
func (v *vcase) perturbed(x []float32) []float32 {
	if !v.perturb {
		return x
	}
	var ss float64
	for _, e := range x {
		ss += float64(e) * float64(e)
	}
	step := float32(0.01 * math.Sqrt(ss/float64(max(len(x), 1))))
	y := make([]float32, len(x))
	for i, e := range x {
		if i%2 == 0 {
			y[i] = e + step
		} else {
			y[i] = e - step
		}
	}
	return y
}

// perturbedAway is perturbed for a sum of squares: every element moves 1% of the RMS away from
// zero, so that the sum grows by at least 1e-4 of itself, where alternating shifts could cancel.
func (v *vcase) perturbedAway(x []float32) []float32 {
	y := v.perturbed(x)
	if !v.perturb {
		return y
	}
	for i := range y {
		if d := y[i] - x[i]; (d < 0) != (x[i] < 0) {
			y[i] = x[i] - d
		}
	}
	return y
}

// primary uploads the input that Perturb perturbs.
func (v *vcase) primary(x []float32) *Tensor { return v.in(v.perturbed(x)) }

// scalar is primary for a kernel whose only input is a parameter.
func (v *vcase) scalar(x float32) float32 {
	if v.perturb {
		return x * 1.01
	}
	return x
}

// primaryTargets is primary for the class targets of a cross-entropy (ids below V): Perturb
// moves each to the next class. A shift of the logits would not do: where the softmax
// saturates, its gradient barely moves.
func (v *vcase) primaryTargets(x []int32, V int) *Tensor {
	if !v.perturb {
		return v.ints(x)
	}
	y := make([]int32, len(x))
	for i, e := range x {
		y[i] = (e + 1) % int32(V)
	}
	return v.ints(y)
}

func (v *vcase) ints(x []int32) *Tensor {
	pre := 1 + 2*v.rng.IntN(34)
	buf := make([]int32, pre+len(x)+3)
	copy(buf[pre:], x)
	root := v.d.FromInt32(buf)
	v.sentinels[root] = nil
	return root.Slice(pre, len(x))
}

// cp returns a copy, for references that work in place.
func cp(x []float32) []float32 { return append([]float32(nil), x...) }

// read returns the view t and reports whether every sentinel of its buffer is intact.
func (v *vcase) read(t *Tensor) ([]float32, bool, error) {
	p, ok := v.where[t]
	if !ok {
		x, err := v.d.Read(t)
		return x, true, err
	}
	all, err := v.d.Read(p.root)
	if err != nil {
		return nil, false, err
	}
	intact := true
	for i, s := range v.sentinels[p.root] {
		if s && all[i] != sentinel {
			intact = false
		}
	}
	return all[p.off : p.off+t.n], intact, nil
}

// expect compares the output view t with the reference want.
func (v *vcase) expect(name string, t *Tensor, want []float32, tol float64) {
	v.expectFloor(name, t, want, 0, tol)
}

// expectFloor is expect with the error relative to max(‖want‖, floor).
func (v *vcase) expectFloor(name string, t *Tensor, want []float32, floor, tol float64) {
	got, intact, err := v.read(t)
	r := Result{Kernel: v.kernel, Shape: v.shape, Output: name, Tol: tol}
	switch {
	case err != nil:
		r.Note = err.Error()
	default:
		r.RelErr, r.MaxAbs = compare(got, want, floor)
		r.Pass = r.RelErr <= tol
		if !intact {
			r.Pass = false
			r.Note = "wrote outside its view"
		}
	}
	v.results = append(v.results, r)
}

// expectValues is expectFloor for values computed on the host from a GPU read (a mean loss,
// norms).
func (v *vcase) expectValues(name string, got []float64, err error, want []float64, floor, tol float64) {
	r := Result{Kernel: v.kernel, Shape: v.shape, Output: name, Tol: tol}
	if err != nil {
		r.Note = err.Error()
	} else {
		var dd, rr float64
		for i := range want {
			e := got[i] - want[i]
			dd += e * e
			rr += want[i] * want[i]
			r.MaxAbs = math.Max(r.MaxAbs, math.Abs(e))
		}
		r.RelErr = relErr(dd, max(rr, floor*floor))
		r.Pass = r.RelErr <= tol
	}
	v.results = append(v.results, r)
}

// compare returns ‖got − want‖/max(‖want‖, floor) and max |got − want|, in float64. A NaN or an
// infinity in got makes the error infinite, so it never passes.
func compare(got, want []float32, floor float64) (rel, maxAbs float64) {
	if len(got) != len(want) {
		return math.Inf(1), math.Inf(1)
	}
	var dd, rr float64
	for i := range want {
		g, w := float64(got[i]), float64(want[i])
		if math.IsNaN(g) || math.IsInf(g, 0) {
			return math.Inf(1), math.Inf(1)
		}
		e := g - w
		dd += e * e
		rr += w * w
		maxAbs = math.Max(maxAbs, math.Abs(e))
	}
	return relErr(dd, max(rr, floor*floor)), maxAbs
}

func relErr(dd, rr float64) float64 {
	if rr == 0 {
		return math.Sqrt(dd)
	}
	return math.Sqrt(dd / rr)
}

func validationCases() []validationCase {
	var cs []validationCase
	add := func(kernel, shape string, fn func(v *vcase)) {
		cs = append(cs, validationCase{kernel, shape, fn})
	}

	// Matrix multiplies: sizes of 1, primes that fill no 32×64 tile, and one full 256 cube.
	type mmShape struct{ m, k, n int }
	shapes := []mmShape{{1, 1, 1}, {1, 7, 33}, {7, 33, 1}, {33, 1, 7}, {7, 64, 127}, {127, 33, 64},
		{64, 127, 7}, {33, 64, 33}, {64, 1, 64}, {127, 127, 127}, {256, 256, 256}}
	layouts := []struct {
		name   string
		ref    func(c, a, b []float32, m, k, n int, acc bool)
		op     func(d *Device) func(c, a, b *Tensor, m, k, n int, acc bool)
		aTrans bool
	}{
		{"MatMulNN", kernels.MatMulNN, func(d *Device) func(c, a, b *Tensor, m, k, n int, acc bool) { return d.MatMulNN }, false},
		{"MatMulNT", kernels.MatMulNT, func(d *Device) func(c, a, b *Tensor, m, k, n int, acc bool) { return d.MatMulNT }, false},
		{"MatMulTN", kernels.MatMulTN, func(d *Device) func(c, a, b *Tensor, m, k, n int, acc bool) { return d.MatMulTN }, true},
	}
	for _, l := range layouts {
		for _, s := range shapes {
			for _, acc := range []bool{false, true} {
				l, s, acc := l, s, acc
				add(l.name, fmt.Sprintf("m=%d k=%d n=%d acc=%v", s.m, s.k, s.n, acc), func(v *vcase) {
					a, b, c0 := v.randn(s.m*s.k, 1), v.randn(s.k*s.n, 1), v.randn(s.m*s.n, 1)
					ta, tb, tc := v.primary(a), v.in(b), v.in(c0)
					l.op(v.d)(tc, ta, tb, s.m, s.k, s.n, acc)
					want := cp(c0)
					l.ref(want, a, b, s.m, s.k, s.n, acc)
					v.expect("c", tc, want, tolMatMul)
				})
			}
		}
	}
	// A weight gradient accumulated over two row ranges of the same tensors (views of rows
	// lo…hi, as a stage does per micro-batch) against one product over all rows.
	add("MatMulTN", "rows 0..50 then 50..127 of k=127, m=33 n=64", func(v *vcase) {
		m, k, n, lo := 33, 127, 64, 50
		a, b := v.randn(k*m, 1), v.randn(k*n, 1)
		ta, tb, tc := v.primary(a), v.in(b), v.in(v.randn(m*n, 1))
		v.d.MatMulTN(tc, ta.Slice(0, lo*m), tb.Slice(0, lo*n), m, lo, n, false)
		v.d.MatMulTN(tc, ta.Slice(lo*m, (k-lo)*m), tb.Slice(lo*n, (k-lo)*n), m, k-lo, n, true)
		want := make([]float32, m*n)
		kernels.MatMulTN(want, a, b, m, k, n, false)
		v.expect("c", tc, want, tolMatMul)
	})

	for _, s := range [][4]int{{1, 1, 4, 1}, {1, 5, 8, 2}, {2, 17, 12, 3}, {3, 32, 64, 4}} {
		B, T, C, H := s[0], s[1], s[2], s[3]
		shape := fmt.Sprintf("B=%d T=%d C=%d H=%d", B, T, C, H)
		add("AttentionForward", shape, func(v *vcase) {
			qkv := v.randn(B*T*3*C, 1)
			out, att := v.in(v.randn(B*T*C, 1)), v.in(v.randn(B*H*T*T, 1))
			v.d.AttentionForward(out, att, v.primary(qkv), B, T, C, H)
			wo, wa := make([]float32, B*T*C), make([]float32, B*H*T*T)
			kernels.AttentionForward(wo, wa, qkv, B, T, C, H)
			v.expect("out", out, wo, tolAttention)
			v.expect("att", att, wa, tolAttention)
			// The masked upper triangle must be exactly zero, not merely small.
			got, _, err := v.read(att)
			r := Result{Kernel: v.kernel, Shape: v.shape, Output: "att above the diagonal", Tol: 0}
			if err != nil {
				r.Note = err.Error()
			} else {
				for bh := 0; bh < B*H; bh++ {
					for t := 0; t < T; t++ {
						for t2 := t + 1; t2 < T; t2++ {
							r.MaxAbs = math.Max(r.MaxAbs, math.Abs(float64(got[(bh*T+t)*T+t2])))
						}
					}
				}
				r.RelErr = r.MaxAbs
				r.Pass = r.MaxAbs == 0
			}
			v.results = append(v.results, r)
		})
		add("AttentionBackward", shape, func(v *vcase) {
			qkv, dout := v.randn(B*T*3*C, 1), v.randn(B*T*C, 1)
			wo, att := make([]float32, B*T*C), make([]float32, B*H*T*T)
			kernels.AttentionForward(wo, att, qkv, B, T, C, H)
			dqkv := v.in(v.randn(B*T*3*C, 1)) // garbage: the op overwrites
			v.d.AttentionBackward(dqkv, v.primary(dout), v.in(qkv), v.in(att), B, T, C, H)
			want := make([]float32, B*T*3*C)
			kernels.AttentionBackward(want, dout, qkv, att, B, T, C, H)
			v.expect("dqkv", dqkv, want, tolAttention)
		})
	}

	// C=256: two elements per invocation of a row's workgroup; N=201: 7 chunks of column sums.
	for _, s := range [][2]int{{1, 1}, {13, 7}, {33, 64}, {64, 127}, {7, 256}, {201, 64}} {
		N, C := s[0], s[1]
		shape := fmt.Sprintf("N=%d C=%d", N, C)
		// Inputs with a mean far from zero and a spread unlike 1, so that centring and scaling
		// both matter.
		lnInput := func(v *vcase) []float32 {
			x := v.randn(N*C, 2)
			for i := range x {
				x[i] += 3
			}
			return x
		}
		add("LayerNormForward", shape, func(v *vcase) {
			x, w, b := lnInput(v), v.randn(C, 1), v.randn(C, 1)
			out, mean, rstd := v.in(v.randn(N*C, 1)), v.in(v.randn(N, 1)), v.in(v.randn(N, 1))
			v.d.LayerNormForward(out, mean, rstd, v.primary(x), v.in(w), v.in(b), N, C)
			wo, wm, wr := make([]float32, N*C), make([]float32, N), make([]float32, N)
			kernels.LayerNormForward(wo, wm, wr, x, w, b, N, C)
			v.expect("out", out, wo, tolLayerNorm)
			v.expect("mean", mean, wm, tolLayerNorm)
			v.expect("rstd", rstd, wr, tolLayerNorm)
		})
		add("LayerNormBackward", shape, func(v *vcase) {
			x, w, b, dout := lnInput(v), v.randn(C, 1), v.randn(C, 1), v.randn(N*C, 1)
			o, mean, rstd := make([]float32, N*C), make([]float32, N), make([]float32, N)
			kernels.LayerNormForward(o, mean, rstd, x, w, b, N, C)
			dinp0, dw0, db0 := v.randn(N*C, 1), v.randn(C, 1), v.randn(C, 1)
			dinp, dw, db := v.in(dinp0), v.in(dw0), v.in(db0)
			v.d.LayerNormBackward(dinp, dw, db, v.primary(dout), v.in(x), v.in(w), v.in(mean), v.in(rstd), N, C)
			wdi, wdw, wdb := cp(dinp0), cp(dw0), cp(db0)
			kernels.LayerNormBackward(wdi, wdw, wdb, dout, x, w, mean, rstd, N, C)
			v.expect("dinp", dinp, wdi, tolLayerNorm)
			v.expect("dw", dw, wdw, tolLayerNorm)
			v.expect("db", db, wdb, tolLayerNorm)
		})
	}

	for i, s := range [][3]int{{1, 1, 1}, {13, 7, 33}, {64, 127, 33}, {33, 64, 256}} {
		N, IN, OUT := s[0], s[1], s[2]
		for _, bias := range []bool{false, true} {
			add("LinearForward", fmt.Sprintf("N=%d IN=%d OUT=%d bias=%v", N, IN, OUT, bias), func(v *vcase) {
				x, w, b := v.randn(N*IN, 1), v.randn(OUT*IN, 1), v.randn(OUT, 1)
				out := v.in(v.randn(N*OUT, 1)) // garbage: the op overwrites
				var tb *Tensor
				var rb []float32
				if bias {
					tb, rb = v.in(b), b
				}
				v.d.LinearForward(out, v.primary(x), v.in(w), tb, N, IN, OUT)
				want := make([]float32, N*OUT)
				kernels.LinearForward(want, x, w, rb, N, IN, OUT)
				v.expect("out", out, want, tolMatMul)
			})
		}
		for _, accIn := range []bool{false, true} {
			withBias := (i+btoi(accIn))%2 == 0
			add("LinearBackward", fmt.Sprintf("N=%d IN=%d OUT=%d accIn=%v bias=%v", N, IN, OUT, accIn, withBias), func(v *vcase) {
				x, w, dout := v.randn(N*IN, 1), v.randn(OUT*IN, 1), v.randn(N*OUT, 1)
				dinp0, dw0, db0 := v.randn(N*IN, 1), v.randn(OUT*IN, 1), v.randn(OUT, 1)
				dinp, dw := v.in(dinp0), v.in(dw0)
				var db *Tensor
				var wdb []float32
				if withBias {
					db, wdb = v.in(db0), cp(db0)
				}
				v.d.LinearBackward(dinp, dw, db, v.primary(dout), v.in(x), v.in(w), N, IN, OUT, accIn)
				wdi, wdw := cp(dinp0), cp(dw0)
				kernels.LinearBackward(wdi, wdw, wdb, dout, x, w, N, IN, OUT, accIn)
				v.expect("dinp", dinp, wdi, tolMatMul)
				v.expect("dw", dw, wdw, tolMatMul)
				if withBias {
					v.expect("db", db, wdb, tolColSum(N))
				}
			})
		}
	}

	for _, n := range []int{1, 1000, 4099} {
		// Inputs across GELU's range, with the values where Tanh32 switches branches: the
		// clamp at ±7.9 and the linear region below 4e-4. The random ones stay mostly within
		// ±4: beyond, GELU saturates, and a single-element case could not show Perturb's effect.
		geluInput := func(v *vcase) []float32 {
			x := v.randn(n, 1)
			special := []float32{0, 1e-5, -1e-5, 3.9e-4, -3.9e-4, 4.1e-4, 8, -8, 10, -10}
			for i := 0; i < len(special) && i < n-1; i++ {
				x[1+i] = special[i]
			}
			return x
		}
		add("GELUForward", fmt.Sprintf("n=%d", n), func(v *vcase) {
			x := geluInput(v)
			out, th := v.in(v.randn(n, 1)), v.in(v.randn(n, 1))
			v.d.GELUForward(out, th, v.primary(x))
			wo, wt := make([]float32, n), make([]float32, n)
			kernels.GELUForward(wo, wt, x)
			v.expect("out", out, wo, tolGELU)
			v.expect("th", th, wt, tolGELU)
		})
		for _, alias := range []bool{false, true} {
			add("GELUBackward", fmt.Sprintf("n=%d dinp=dout:%v", n, alias), func(v *vcase) {
				x, dout := geluInput(v), v.randn(n, 1)
				wo, th := make([]float32, n), make([]float32, n)
				kernels.GELUForward(wo, th, x)
				tdout := v.primary(dout)
				dinp := tdout
				if !alias {
					dinp = v.in(v.randn(n, 1)) // garbage: the op overwrites
				}
				v.d.GELUBackward(dinp, v.in(x), v.in(th), tdout)
				want := make([]float32, n)
				kernels.GELUBackward(want, x, th, dout)
				v.expect("dinp", dinp, want, tolGELU)
			})
		}
	}

	// V=5 over 132 rows: every token repeats, many times, so encoder_backward's lists are long.
	for _, s := range [][4]int{{1, 1, 1, 1}, {2, 5, 7, 67}, {3, 17, 64, 256}, {4, 33, 8, 5}} {
		B, T, C, V := s[0], s[1], s[2], s[3]
		shape := fmt.Sprintf("B=%d T=%d C=%d V=%d", B, T, C, V)
		tokens := func(v *vcase) []int32 {
			x := make([]int32, B*T)
			for i := range x {
				x[i] = int32(v.rng.IntN(V))
			}
			if B*T > 2 {
				x[1] = x[0] // a repeated token: two rows add into one row of dwte
			}
			return x
		}
		add("EncoderForward", shape, func(v *vcase) {
			inp, wte, wpe := tokens(v), v.randn(V*C, 1), v.randn(T*C, 1)
			out := v.in(v.randn(B*T*C, 1))
			v.d.EncoderForward(out, v.ints(inp), v.primary(wte), v.in(wpe), B, T, C)
			want := make([]float32, B*T*C)
			kernels.EncoderForward(want, inp, wte, wpe, B, T, C)
			v.expect("out", out, want, tolExact)
		})
		add("EncoderBackward", shape, func(v *vcase) {
			inp, dout := tokens(v), v.randn(B*T*C, 1)
			dwte0, dwpe0 := v.randn(V*C, 1), v.randn(T*C, 1)
			dwte, dwpe := v.in(dwte0), v.in(dwpe0)
			v.d.EncoderBackward(dwte, dwpe, v.primary(dout), v.ints(inp), B, T, C)
			wte, wpe := cp(dwte0), cp(dwpe0)
			kernels.EncoderBackward(wte, wpe, dout, inp, B, T, C)
			v.expect("dwte", dwte, wte, tolExact)
			v.expect("dwpe", dwpe, wpe, tolExact)
		})
	}

	for _, s := range [][2]int{{1, 2}, {13, 67}, {64, 256}} {
		N, V := s[0], s[1]
		shape := fmt.Sprintf("N=%d V=%d", N, V)
		targets := func(v *vcase) []int32 {
			t := make([]int32, N)
			for i := range t {
				t[i] = int32(v.rng.IntN(V))
			}
			return t
		}
		add("CrossEntropyForward", shape, func(v *vcase) {
			logits, tg := v.randn(N*V, 2), targets(v)
			losses := v.in(v.randn(N, 1))
			v.d.CrossEntropyForward(losses, v.in(logits), v.primaryTargets(tg, V), N, V)
			// The per-row losses, from the reference one row at a time, and the norm of the
			// logsumexps they are the difference of (see tolSoftmax).
			want := make([]float32, N)
			var lse2, lseSum float64
			for r := range want {
				loss := kernels.CrossEntropyForward(logits[r*V:(r+1)*V], tg[r:r+1], 1, V)
				want[r] = float32(loss)
				lse := loss + float64(logits[r*V+int(tg[r])])
				lse2 += lse * lse
				lseSum += lse
			}
			v.expectFloor("losses", losses, want, math.Sqrt(lse2), tolSoftmax)
			mean, err := v.d.CrossEntropyMean(losses, N)
			v.expectValues("mean loss", []float64{mean}, err, []float64{kernels.CrossEntropyForward(logits, tg, N, V)}, math.Abs(lseSum)/float64(N), tolSoftmax)
		})
		for _, scale := range []float32{1, 0.25} {
			add("CrossEntropyBackward", fmt.Sprintf("%s scale=%g", shape, scale), func(v *vcase) {
				logits, tg := v.randn(N*V, 2), targets(v)
				tl := v.in(logits)
				v.d.CrossEntropyBackward(tl, v.primaryTargets(tg, V), N, V, scale)
				want := cp(logits)
				kernels.CrossEntropyBackward(want, tg, N, V, scale)
				// ‖onehot·scale/N‖: the term the softmax is subtracted from (see tolSoftmax).
				v.expectFloor("dlogits", tl, want, float64(scale)/math.Sqrt(float64(N)), tolSoftmax)
			})
		}
	}

	for _, s := range [][2]int{{1, 2}, {13, 4}, {64, 7}, {5, 67}} {
		N, E := s[0], s[1]
		add("SoftmaxRows", fmt.Sprintf("N=%d E=%d", N, E), func(v *vcase) {
			x := v.randn(N*E, 1) // wider logits saturate a row of 2, which Perturb could not move
			tx := v.primary(x)
			v.d.SoftmaxRows(tx, N, E)
			want := cp(x)
			kernels.SoftmaxRows(want, N, E)
			v.expect("x", tx, want, tolSoftmax)
		})
	}

	// An MoE block's routing on the device (kernels/moe.go). N=37 fills no workgroup of rows,
	// N=201 two, with moe_stats' 128 strided partial sums unequal; E from 2 to 64, K from 1 to E.
	for _, s := range [][4]int{{1, 1, 2, 1}, {37, 53, 4, 1}, {37, 53, 5, 2}, {37, 53, 8, 2}, {5, 9, 3, 3}, {201, 32, 64, 4}} {
		N, C, E, K := s[0], s[1], s[2], s[3]
		shape := fmt.Sprintf("N=%d C=%d E=%d K=%d", N, C, E, K)
		moeCases(add, shape, N, C, E, K)
	}

	for _, n := range []int{1, 1000, 4099} {
		add("AdamW", fmt.Sprintf("n=%d", n), func(v *vcase) {
			// Weights of a GPT's size (initialised at std 0.02): a float32 w rounds at a few
			// 1e-9, well below the ~1e-3 step, so that comparing steps measures the step's
			// arithmetic, not w's last bit.
			w0, g, m0, v0 := v.randn(n, 0.02), v.randn(n, 0.01), v.randn(n, 1e-3), v.randn(n, 1e-3)
			for i := range v0 {
				v0[i] *= v0[i] // second moments are non-negative
			}
			// Step 3 of a job with lr 1e-3 and weight decay 0.1, gradients clipped by 0.7.
			lr, step := 1e-3, 3.0
			decay := float32(1 - lr*0.1)
			stepSize := float32(lr / (1 - math.Pow(kernels.Beta1, step)))
			sqrtBC2 := math.Sqrt(1 - math.Pow(kernels.Beta2, step))
			tw, tm, tv := v.in(w0), v.in(m0), v.in(v0)
			v.d.AdamW(tw, v.primary(g), tm, tv, decay, stepSize, sqrtBC2, 0.7)
			ww, wm, wv := cp(w0), cp(m0), cp(v0)
			kernels.AdamW(ww, g, wm, wv, decay, stepSize, sqrtBC2, 0.7)
			got, intact, err := v.read(tw)
			r := Result{Kernel: v.kernel, Shape: v.shape, Output: "w − w₀", Tol: tolAdamW}
			if err != nil {
				r.Note = err.Error()
			} else {
				dg, dw := make([]float32, n), make([]float32, n)
				for i := range w0 {
					dg[i], dw[i] = got[i]-w0[i], ww[i]-w0[i]
				}
				r.RelErr, r.MaxAbs = compare(dg, dw, 0)
				r.Pass = r.RelErr <= tolAdamW && intact
			}
			v.results = append(v.results, r)
			v.expect("m", tm, wm, tolAdamW)
			v.expect("v", tv, wv, tolAdamW)
		})
	}

	// AdamWSlab: a run of tensors as a shard's slab holds them (vectors undecayed, matrices
	// decayed, sizes that split workgroups), against kernels.AdamW per tensor; and twice with the
	// same segments (the device keeps the table) then with others (it must upload them).
	add("AdamWSlab", "segments 7,1,300,64,4099 decayed F,T,T,F,T; then 5,6 F,T", func(v *vcase) {
		for _, segs := range [][]AdamWSegment{
			{{7, false}, {1, true}, {300, true}, {64, false}, {4099, true}},
			{{7, false}, {1, true}, {300, true}, {64, false}, {4099, true}},
			{{5, false}, {6, true}},
		} {
			n := 0
			for _, s := range segs {
				n += s.N
			}
			w0, g, m0, v0 := v.randn(n, 0.02), v.randn(n, 0.01), v.randn(n, 1e-3), v.randn(n, 1e-3)
			for i := range v0 {
				v0[i] *= v0[i]
			}
			lr, step := 1e-3, 3.0
			decay := float32(1 - lr*0.1)
			stepSize := float32(lr / (1 - math.Pow(kernels.Beta1, step)))
			sqrtBC2 := math.Sqrt(1 - math.Pow(kernels.Beta2, step))
			tw, tm, tv := v.in(w0), v.in(m0), v.in(v0)
			v.d.AdamWSlab(tw, v.primary(g), tm, tv, segs, decay, stepSize, sqrtBC2, 0.7)
			ww, wm, wv := cp(w0), cp(m0), cp(v0)
			off := 0
			for _, s := range segs {
				d := float32(1)
				if s.Decay {
					d = decay
				}
				e := off + s.N
				kernels.AdamW(ww[off:e], g[off:e], wm[off:e], wv[off:e], d, stepSize, sqrtBC2, 0.7)
				off = e
			}
			got, intact, err := v.read(tw)
			r := Result{Kernel: v.kernel, Shape: v.shape, Output: fmt.Sprintf("w − w₀ (%d segments)", len(segs)), Tol: tolAdamW}
			if err != nil {
				r.Note = err.Error()
			} else {
				dg, dw := make([]float32, n), make([]float32, n)
				for i := range w0 {
					dg[i], dw[i] = got[i]-w0[i], ww[i]-w0[i]
				}
				r.RelErr, r.MaxAbs = compare(dg, dw, 0)
				r.Pass = r.RelErr <= tolAdamW && intact
			}
			v.results = append(v.results, r)
			v.expect("m", tm, wm, tolAdamW)
			v.expect("v", tv, wv, tolAdamW)
		}
	})

	// Helpers. 70001 elements: several workgroups and a partial last one.
	for _, n := range []int{1, 1000, 70001} {
		shape := fmt.Sprintf("n=%d", n)
		add("Add", shape, func(v *vcase) {
			a, b := v.randn(n, 1), v.randn(n, 1)
			out := v.in(v.randn(n, 1))
			v.d.Add(out, v.primary(a), v.in(b))
			want := make([]float32, n)
			for i := range want {
				want[i] = a[i] + b[i]
			}
			v.expect("out", out, want, tolExact)
		})
		add("Add", shape+" out=a", func(v *vcase) {
			a, b := v.randn(n, 1), v.randn(n, 1)
			ta := v.primary(a)
			v.d.Add(ta, ta, v.in(b))
			want := make([]float32, n)
			for i := range want {
				want[i] = a[i] + b[i]
			}
			v.expect("out", ta, want, tolExact)
		})
		add("AddInPlace", shape, func(v *vcase) {
			a, b := v.randn(n, 1), v.randn(n, 1)
			ta := v.in(a)
			v.d.AddInPlace(ta, v.primary(b))
			want := cp(a)
			for i := range want {
				want[i] += b[i]
			}
			v.expect("dst", ta, want, tolExact)
		})
		add("Copy", shape, func(v *vcase) {
			a := v.randn(n, 1)
			dst := v.in(v.randn(n, 1))
			v.d.Copy(dst, v.primary(a))
			v.expect("dst", dst, a, tolExact)
		})
		add("Fill", shape, func(v *vcase) {
			dst := v.in(v.randn(n, 1))
			v.d.Fill(dst, v.scalar(0.375))
			want := make([]float32, n)
			for i := range want {
				want[i] = 0.375
			}
			v.expect("dst", dst, want, tolExact)
		})
	}
	// 201 rows: 7 chunks of column sums, the last short, an odd one out in the tree.
	for _, s := range [][2]int{{1, 1}, {13, 67}, {64, 256}, {201, 64}} {
		N, C := s[0], s[1]
		shape := fmt.Sprintf("N=%d C=%d", N, C)
		add("BiasAdd", shape, func(v *vcase) {
			x, b := v.randn(N*C, 1), v.randn(C, 1)
			tx := v.in(x)
			v.d.BiasAdd(tx, v.primary(b), N, C)
			want := cp(x)
			for r := 0; r < N; r++ {
				for i := 0; i < C; i++ {
					want[r*C+i] += b[i]
				}
			}
			v.expect("out", tx, want, tolExact)
		})
		add("BiasGrad", shape, func(v *vcase) {
			dout, db0 := v.randn(N*C, 1), v.randn(C, 1)
			db := v.in(db0)
			v.d.BiasGrad(db, v.primary(dout), N, C)
			want := cp(db0)
			for r := 0; r < N; r++ {
				for i := 0; i < C; i++ {
					want[i] += dout[r*C+i]
				}
			}
			v.expect("db", db, want, tolColSum(N))
		})
	}
	add("SquaredNorms", "n=1,4095,4096,4097,70001", func(v *vcase) {
		var ts []*Tensor
		var want []float64
		for _, n := range []int{1, 4095, 4096, 4097, 70001} {
			x := v.randn(n, 1)
			var s float64
			for _, e := range x {
				s += float64(e) * float64(e)
			}
			want = append(want, s)
			ts = append(ts, v.in(v.perturbedAway(x))) // every one perturbed: each norm must fail on its own
		}
		got, err := v.d.SquaredNorms(ts...)
		v.expectValues("‖x‖²", got, err, want, 0, tolSumSq)
	})

	// 700 dispatches recorded without a read in between: more than the parameter arena holds,
	// so the device must submit mid-batch and keep the order.
	add("AddInPlace", "700 dispatches in one batch, n=33", func(v *vcase) {
		const n, reps = 33, 700
		a, b := v.randn(n, 1), v.randn(n, 1)
		ta, tb := v.in(a), v.primary(b)
		for i := 0; i < reps; i++ {
			v.d.AddInPlace(ta, tb)
		}
		want := cp(a)
		for i := 0; i < reps; i++ {
			for j := range want {
				want[j] += b[j]
			}
		}
		v.expect("dst", ta, want, tolExact)
	})
	// More workgroups than one grid dimension holds (65535 on most adapters): the flat, chunked
	// and row kernels spread them over x and y, and must still visit every element once. The
	// case lowers the device's per-dimension limit to 3 workgroups so that small tensors need a
	// 2-D grid (8.4 M elements would at the adapter's real limit).
	add("2-D grid", "maxComputeWorkgroupsPerDimension lowered to 3", func(v *vcase) {
		defer func(g int) { v.d.maxGroups = g }(v.d.maxGroups)
		v.d.maxGroups = 3
		n := 2*3*wgsl.MaxInvocations + 77 // 7 workgroups: a 3×3 grid, the last row part-empty
		a := v.randn(n, 1)
		dst := v.in(make([]float32, n))
		v.d.Copy(dst, v.primary(a))
		v.expect("Copy", dst, a, tolExact)

		x := v.randn(n, 1)
		out, th := v.in(make([]float32, n)), v.in(make([]float32, n))
		v.d.GELUForward(out, th, v.primary(x))
		wo, wt := make([]float32, n), make([]float32, n)
		kernels.GELUForward(wo, wt, x)
		v.expect("GELUForward out", out, wo, tolGELU)

		N, C := 7, 3 // 7 workgroups of one row each (layernorm_forward: wgsl.Rows)
		xs, w, b := v.randn(N*C, 1), v.randn(C, 1), v.randn(C, 1)
		lo, mean, rstd := v.in(make([]float32, N*C)), v.in(make([]float32, N)), v.in(make([]float32, N))
		v.d.LayerNormForward(lo, mean, rstd, v.primary(xs), v.in(w), v.in(b), N, C)
		wl, wm, wr := make([]float32, N*C), make([]float32, N), make([]float32, N)
		kernels.LayerNormForward(wl, wm, wr, xs, w, b, N, C)
		v.expect("LayerNormForward out", lo, wl, tolLayerNorm)

		big := v.randn(7*wgsl.SumSquaresChunk+5, 1) // 8 chunks: a 3×3 grid
		var want float64
		for _, e := range big {
			want += float64(e) * float64(e)
		}
		got, err := v.d.SquaredNorms(v.in(v.perturbedAway(big)))
		v.expectValues("SquaredNorms", got, err, []float64{want}, 0, tolSumSq)
	})

	// Determinism (docs/design.md, "Determinism"): the same inputs give the same bits, run after run. The kernels
	// reduce in fixed orders and use no atomics; this holds them to it. Perturb changes the
	// second run's input.
	add("Deterministic", "AttentionBackward B=2 T=17 C=12 H=3, LayerNormBackward N=33 C=64, twice", func(v *vcase) {
		B, T, C, H, N, LC := 2, 17, 12, 3, 33, 64
		qkv, dout := v.randn(B*T*3*C, 1), v.randn(B*T*C, 1)
		o, att := make([]float32, B*T*C), make([]float32, B*H*T*T)
		kernels.AttentionForward(o, att, qkv, B, T, C, H)
		x, w, b, dy := v.randn(N*LC, 1), v.randn(LC, 1), v.randn(LC, 1), v.randn(N*LC, 1)
		lo, mean, rstd := make([]float32, N*LC), make([]float32, N), make([]float32, N)
		kernels.LayerNormForward(lo, mean, rstd, x, w, b, N, LC)
		tq, tatt, tx, tw, tm, tr := v.in(qkv), v.in(att), v.in(x), v.in(w), v.in(mean), v.in(rstd)
		run := func(dout, dy []float32) (dqkv, dinp, dw []float32) {
			tdqkv, tdinp, tdw, tdb := v.in(make([]float32, B*T*3*C)), v.in(make([]float32, N*LC)), v.in(make([]float32, LC)), v.in(make([]float32, LC))
			v.d.AttentionBackward(tdqkv, v.in(dout), tq, tatt, B, T, C, H)
			v.d.LayerNormBackward(tdinp, tdw, tdb, v.in(dy), tx, tw, tm, tr, N, LC)
			var err error
			if dqkv, err = v.d.Read(tdqkv); err == nil {
				if dinp, err = v.d.Read(tdinp); err == nil {
					dw, err = v.d.Read(tdw)
				}
			}
			if err != nil {
				panic(err)
			}
			return dqkv, dinp, dw
		}
		q1, i1, w1 := run(dout, dy)
		q2, i2, w2 := run(v.perturbed(dout), v.perturbed(dy))
		for _, c := range []struct {
			name       string
			first, sec []float32
		}{{"dqkv", q1, q2}, {"dinp", i1, i2}, {"dw", w1, w2}} {
			r := Result{Kernel: v.kernel, Shape: v.shape, Output: c.name + " run 2 vs run 1", Tol: 0}
			r.RelErr, r.MaxAbs = compare(c.sec, c.first, 0)
			r.Pass = r.RelErr == 0
			v.results = append(v.results, r)
		}
	})

	// Tensors that share a buffer: inputs beside outputs (bound read-only and writable in one
	// dispatch, which WebGPU refuses) and outputs within 256 bytes of each other (overlapping
	// writable bindings). The device must route them through copies and give the same results.
	add("LayerNormForward", "N=13 C=7, all six tensors in one buffer", func(v *vcase) {
		N, C := 13, 7
		x, w, b := v.randn(N*C, 2), v.randn(C, 1), v.randn(C, 1)
		ts := v.pack(v.randn(N*C, 1), v.randn(N, 1), v.randn(N, 1), v.perturbed(x), w, b)
		v.d.LayerNormForward(ts[0], ts[1], ts[2], ts[3], ts[4], ts[5], N, C)
		wo, wm, wr := make([]float32, N*C), make([]float32, N), make([]float32, N)
		kernels.LayerNormForward(wo, wm, wr, x, w, b, N, C)
		v.expect("out", ts[0], wo, tolLayerNorm)
		v.expect("mean", ts[1], wm, tolLayerNorm)
		v.expect("rstd", ts[2], wr, tolLayerNorm)
	})
	add("LayerNormBackward", "N=13 C=7, dw and db adjacent in one buffer", func(v *vcase) {
		N, C := 13, 7
		x, w, b, dout := v.randn(N*C, 2), v.randn(C, 1), v.randn(C, 1), v.randn(N*C, 1)
		o, mean, rstd := make([]float32, N*C), make([]float32, N), make([]float32, N)
		kernels.LayerNormForward(o, mean, rstd, x, w, b, N, C)
		dinp0, dw0, db0 := v.randn(N*C, 1), v.randn(C, 1), v.randn(C, 1)
		grads := v.pack(dw0, db0)
		dinp := v.in(dinp0)
		v.d.LayerNormBackward(dinp, grads[0], grads[1], v.primary(dout), v.in(x), v.in(w), v.in(mean), v.in(rstd), N, C)
		wdi, wdw, wdb := cp(dinp0), cp(dw0), cp(db0)
		kernels.LayerNormBackward(wdi, wdw, wdb, dout, x, w, mean, rstd, N, C)
		v.expect("dinp", dinp, wdi, tolLayerNorm)
		v.expect("dw", grads[0], wdw, tolLayerNorm)
		v.expect("db", grads[1], wdb, tolLayerNorm)
	})
	add("MatMulNN", "m=33 k=7 n=64 acc=true, c a b in one buffer", func(v *vcase) {
		m, k, n := 33, 7, 64
		a, b, c0 := v.randn(m*k, 1), v.randn(k*n, 1), v.randn(m*n, 1)
		ts := v.pack(c0, v.perturbed(a), b)
		v.d.MatMulNN(ts[0], ts[1], ts[2], m, k, n, true)
		want := cp(c0)
		kernels.MatMulNN(want, a, b, m, k, n, true)
		v.expect("c", ts[0], want, tolMatMul)
	})
	add("Copy", "n=1000 within one buffer", func(v *vcase) {
		a := v.randn(1000, 1)
		ts := v.pack(v.randn(1000, 1), v.perturbed(a))
		v.d.Copy(ts[0], ts[1])
		v.expect("dst", ts[0], a, tolExact)
	})
	add("AdamW", "n=1000, w m v in one buffer", func(v *vcase) {
		n := 1000
		w0, g, m0, v0 := v.randn(n, 1), v.randn(n, 0.01), v.randn(n, 1e-3), v.randn(n, 1e-3)
		for i := range v0 {
			v0[i] *= v0[i]
		}
		ts := v.pack(w0, m0, v0)
		v.d.AdamW(ts[0], v.primary(g), ts[1], ts[2], 0.9999, 1e-3, 0.1, 1)
		ww, wm, wv := cp(w0), cp(m0), cp(v0)
		kernels.AdamW(ww, g, wm, wv, 0.9999, 1e-3, 0.1, 1)
		v.expect("w", ts[0], ww, tolAdamW)
		v.expect("m", ts[1], wm, tolAdamW)
		v.expect("v", ts[2], wv, tolAdamW)
	})
	return cs
}

// moeRouting returns router probabilities (N,E) — the softmax of random logits, with row 0 all
// ties (1/E each) and row 1's largest probability repeated at the next expert, so that ties to
// the lower index matter — and the gate and mask kernels.TopKGate makes of them.
func moeRouting(v *vcase, N, E, K int) (probs, gate, mask []float32) {
	probs = v.randn(N*E, 1)
	kernels.SoftmaxRows(probs, N, E)
	for e := 0; e < E; e++ {
		probs[e] = 1 / float32(E)
	}
	if N > 1 {
		row := probs[E : 2*E]
		m := 0
		for e, x := range row {
			if x > row[m] {
				m = e
			}
		}
		row[(m+1)%E] = row[m]
	}
	gate, mask = make([]float32, N*E), make([]float32, N*E)
	kernels.TopKGate(gate, mask, probs, N, E, K)
	return probs, gate, mask
}

// busiest returns the expert with the most rows routed to it (the lowest such index), so that
// a case on one expert has routed rows for Perturb to move.
func busiest(mask []float32, N, E int) int {
	best, most := 0, -1
	for e := 0; e < E; e++ {
		n := 0
		for r := 0; r < N; r++ {
			if mask[r*E+e] != 0 {
				n++
			}
		}
		if n > most {
			best, most = e, n
		}
	}
	return best
}

// moeCases adds the validation cases of the MoE routing ops on one shape.
func moeCases(add func(kernel, shape string, fn func(v *vcase)), shape string, N, C, E, K int) {
	add("TopKGate", shape+", gate and mask in one buffer", func(v *vcase) {
		probs, gate, mask := moeRouting(v, N, E, K)
		ts := v.pack(v.randn(N*E, 1), v.randn(N*E, 1)) // garbage: the op overwrites
		v.d.TopKGate(ts[0], ts[1], v.primary(probs), N, E, K)
		v.expect("gate", ts[0], gate, tolExact)
		v.expect("mask", ts[1], mask, tolExact)
	})
	add("GateRows", shape+" acc=false, the busiest expert", func(v *vcase) {
		_, gate, mask := moeRouting(v, N, E, K)
		e := busiest(mask, N, E)
		src := v.randn(N*C, 1)
		dst := v.in(v.randn(N*C, 1)) // garbage: the op overwrites
		v.d.GateRows(dst, v.primary(src), v.in(gate), e, N, C, E, false)
		want := make([]float32, N*C)
		kernels.GateRows(want, src, gate, e, N, C, E, false)
		v.expect("dst", dst, want, tolExact)
	})
	add("GateRows", shape+" acc=true, every expert in order", func(v *vcase) {
		_, gate, _ := moeRouting(v, N, E, K)
		dst0 := v.randn(N*C, 1)
		dst, tg := v.in(dst0), v.in(gate)
		want := cp(dst0)
		for e := 0; e < E; e++ {
			src := v.randn(N*C, 1)
			v.d.GateRows(dst, v.primary(src), tg, e, N, C, E, true)
			kernels.GateRows(want, src, gate, e, N, C, E, true)
		}
		v.expect("dst", dst, want, tolGate)
	})
	add("GateGrad", shape+", every expert in order", func(v *vcase) {
		_, _, mask := moeRouting(v, N, E, K)
		dgate0, dout := v.randn(N*E, 1), v.randn(N*C, 1) // garbage: each column is overwritten
		dgate, tdout, tmask := v.in(dgate0), v.primary(dout), v.in(mask)
		want := cp(dgate0)
		for e := 0; e < E; e++ {
			y := v.randn(N*C, 1)
			v.d.GateGrad(dgate, tdout, v.in(y), tmask, e, N, C, E)
			kernels.GateGrad(want, dout, y, mask, e, N, C, E)
		}
		v.expect("dgate", dgate, want, tolGate)
	})
	add("MoEStats", shape, func(v *vcase) {
		probs, _, mask := moeRouting(v, N, E, K)
		stats := v.in(v.randn(E+1, 1)) // garbage: the op overwrites
		// Every probability moved up (they are positive): each P_e grows, and so does the loss,
		// where alternating shifts could cancel over the experts.
		v.d.MoEStats(stats, v.in(mask), v.in(v.perturbedAway(probs)), N, E, K)
		want := make([]float32, E+1)
		kernels.MoEStats(want, mask, probs, N, E, K)
		got, intact, err := v.read(stats)
		for _, o := range []struct {
			name   string
			lo, hi int
			tol    float64
		}{{"counts", 0, E, tolExact}, {"balancing loss", E, E + 1, tolMoEStats}} {
			r := Result{Kernel: v.kernel, Shape: v.shape, Output: o.name, Tol: o.tol}
			switch {
			case err != nil:
				r.Note = err.Error()
			default:
				r.RelErr, r.MaxAbs = compare(got[o.lo:o.hi], want[o.lo:o.hi], 0)
				r.Pass = r.RelErr <= o.tol
				if !intact {
					r.Pass = false
					r.Note = "wrote outside its view"
				}
			}
			v.results = append(v.results, r)
		}
	})
	for _, scale := range []float32{1, 0.01} {
		add("AuxGrad", fmt.Sprintf("%s scale=%g", shape, scale), func(v *vcase) {
			probs, _, mask := moeRouting(v, N, E, K)
			stats := make([]float32, E+1)
			kernels.MoEStats(stats, mask, probs, N, E, K)
			// dgate at the size of the term added (scale·E·f_e/N ≈ scale/N), so that the
			// comparison sees the term and not mostly dgate's own values.
			dgate0 := v.randn(N*E, float64(scale)/float64(N))
			dgate := v.in(dgate0)
			v.d.AuxGrad(dgate, v.primary(stats), N, E, K, scale)
			want := cp(dgate0)
			kernels.AuxGrad(want, stats, N, E, K, scale)
			v.expect("dgate", dgate, want, tolAuxGrad)
		})
	}
	add("SoftmaxBackwardRows", shape, func(v *vcase) {
		probs, _, _ := moeRouting(v, N, E, K)
		dp := v.randn(N*E, 1)
		dx := v.in(v.randn(N*E, 1)) // garbage: the op overwrites
		v.d.SoftmaxBackwardRows(dx, v.in(probs), v.primary(dp), N, E)
		want := make([]float32, N*E)
		kernels.SoftmaxBackwardRows(want, probs, dp, N, E)
		v.expect("dx", dx, want, tolGate)
	})
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}
