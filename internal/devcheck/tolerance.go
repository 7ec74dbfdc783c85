package devcheck

import "math"

// The tolerance table: the largest Result.RelErr that passes, per op (and, where one op has
// outputs of different kinds, per output). Every device computes in float32, as the Go kernels
// do — the one dtype of device arithmetic (bf16 and int8 are wire formats, converted on the host)
// — but in a different order or with different elementary functions; each entry says where a
// device may differ, and it holds for every backend (WebGPU, Vulkan): docs/design.md,
// "Equivalence, defined". Each is far below the ≥ 1e-2 that a 1% error in one input gives, which
// Options.Perturb shows case by case. "Worst seen" figures are SwiftShader's over 20–60 seeds of
// every case and lavapipe's, where stated.
const (
	// TolExact: the same float32 operations in the same order as the Go reference, so the bits
	// must match: a single add (Add, AddOut, BiasAdd, EncoderForward), copies and fills,
	// EncoderBackward (every output element one chain over its rows in row order), TopKGate
	// (comparisons and copies), GateRows without acc (one correctly rounded multiply) and
	// MoEStats' counts (sums of 0s and 1s, exact in float32 below 2²⁴).
	TolExact = 0
	// TolMatMul: each element of a product is the Go kernel's chain over k; the only freedom is
	// whether a multiply and an add fuse (WGSL allows it; Vulkan's shaders fuse explicitly as the
	// AVX2/AVX-512 micro-kernels do, the pure-Go kernels do not), which moves each step by at
	// most half an ulp of the partial sum: ~1e-7 relative on shapes up to 256. Worst seen: 0
	// (SwiftShader does not fuse, nor does the pure-Go reference); 9.7e-7 on lavapipe (which
	// fuses) where a 1×1 product added to c₀ cancels it. Such a result is the difference of
	// larger float32 terms, rounded at their ulp by either side, so a product accumulated into
	// c₀ is measured against ‖c₀‖ when that exceeds the result's norm (as TolSoftmax's outputs
	// are; without: 1.5e-6 seen on lavapipe, 1×1×1, over 150 seeds). Linear's products too.
	TolMatMul = 1e-6
	// TolGELU: the same tanh polynomial and GELU formula in the same order; a device may fuse a
	// multiply-add or divide within 2.5 ulp, which changes a result by an ulp or so. Worst
	// seen: 0.
	TolGELU = 1e-6
	// TolLayerNorm: Go accumulates LayerNorm's statistics in float64 and takes math.Sqrt in
	// float64; a device sums in float32 (two passes, the second over centred values, each a
	// workgroup's tree) with a sqrt within a few ulp. The parameter gradients dw, db are column
	// sums (see TolSum). Worst seen: 3.5e-7 (dw, db at N=201; out at C=256).
	TolLayerNorm = 1e-5
	// TolSoftmax (SoftmaxRows, cross-entropy): Go's exp and log are float64 and correctly
	// rounded in practice; a device's float32 exp and log are only required to be within
	// 3 + 2·|x| ulp (WGSL §14.6, Vulkan's precision rules), and it sums the exponentials in
	// float32 where Go sums in float64. Worst seen: 2.5e-7. Cross-entropy's outputs are
	// differences of larger float32 terms (a loss is logsumexp − logit; a gradient softmax − 1,
	// scaled by scale/N), which both sides round at the larger terms' ulp: for a confident row
	// the difference is tiny and its relative error large, though both sides are right to
	// float32 precision. Its errors are therefore measured against the larger terms' norm
	// (‖logsumexp‖, ‖onehot·scale/N‖) when that exceeds the output's (without: 2.4e-5 seen on
	// N=1, V=2).
	TolSoftmax = 1e-5
	// TolAttention: the softmax's error carried through two float32 products over T and hs.
	// Worst seen: 1e-7.
	TolAttention = 2e-5
	// TolSumSq: squared norms are float32 partial sums over fixed chunks in a fixed tree (added in
	// float64 on the host) against a float64 sum; all terms are positive, so nothing cancels.
	// Worst seen: 2e-8.
	TolSumSq = 1e-6
	// TolAdamW: a device divides by √v + ε in float32 (division within 2.5 ulp, sqrt a few) where
	// Go takes the square root in float64. Compared on the step w − w₀, not on w, so that an
	// error is measured against the step and not hidden by the weights' size; the weights are
	// drawn at a GPT's scale (0.02) so that w's own rounding stays far below the step. Worst
	// seen: 7e-7.
	TolAdamW = 1e-5
	// TolGate: the MoE routing ops that keep the Go reference's float32 chain per element
	// (kernels/moe.go): GateRows with acc (a multiply, then an add) and SoftmaxBackwardRows (a dot
	// over E in e order, then a subtract and a multiply). As for TolMatMul the only freedom is
	// whether a multiply and an add fuse — on the device, or in Go where the target has an fma
	// (arm64) — which moves each step by at most half an ulp of its partial sum: ~1e-7 relative.
	// Worst seen: 0.
	TolGate = 1e-6
	// TolMoEStats: MoEStats' balancing loss E·Σ_e f_e·P_e. Go sums each column in float64 and
	// rounds the loss once; a device sums in float32 — strided chains of rows, then a pairwise
	// tree (every term positive: nothing cancels) — and adds the experts' terms in a float32
	// chain in expert order, with two divisions within 2.5 ulp each. Bounded by
	// (⌈N/128⌉ + 7 + E + 2·2.5 + 3)·2⁻²⁴ relative: 5e-6 at N ≤ 201, E ≤ 64, 8.5e-6 at a
	// micro-batch of 8192 rows and 64 experts. Worst seen: 2.3e-7 (N=201, E=64).
	TolMoEStats = 1e-5
	// TolAuxGrad: f_e = count_e/(N·K) and scale·E·f_e/N are two divisions that Go makes
	// correctly rounded and a device within 2.5 ulp each: the added term is within ~6 ulp
	// (4e-7 relative) of the reference's, then one add as the reference's. Worst seen: 0.
	TolAuxGrad = 1e-6
)

// TolSum is the tolerance of a float32 sum of n terms of either sign that a device adds in
// another order than Go: a column sum over n rows (BiasGrad, LinearBackward's db, LayerNorm's dw
// and db) and GateGrad's dot over n = C channels. Go adds the terms one by one; a device adds
// chunks of them, the chunk sums in a tree (WebGPU's bias_grad and colsum_tree, Vulkan's colsum;
// Vulkan's gate_grad spreads the dot over a workgroup and reduces it in a tree). The bits differ,
// and the larger error is Go's: a sequential float32 sum of n terms of random sign rounds n
// times at partial sums of size ~√r·σ, a random walk whose error is ~ε·σ·n/√6 (ε = 2⁻²⁴),
// against a sum of size ~√n·σ — a relative error of ~0.4·ε·√n, where a chunked tree's is
// ~ε·√(32 + log₂ n). Measured on SwiftShader, 12 seeds: 0.43·ε·√n at n=201 (3.6e-7) and
// 0.44·ε·√n at n=64 (2.1e-7); on lavapipe, 200 seeds: 4.1e-7 (LayerNorm's dw, N=201) and, for
// GateGrad, 4.6e-7 at C=300 and 2.6e-7 at C=53. The tolerance is 4·ε·√n, 10× that expectation, with a floor of
// 1e-6; it grows with n because the reference's own error does (3e-6 at a micro-batch of
// 8·1024 rows). It is not zero because a GPU needs the tree to spread a sum over thousands of
// rows across its lanes (issue 15).
func TolSum(n int) float64 { return max(1e-6, 4*0x1p-24*math.Sqrt(float64(n))) }
