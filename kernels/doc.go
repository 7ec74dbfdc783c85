// Package kernels holds the numeric kernels every Shoal backend is built from: matrix multiplies
// in the three layouts training uses, the layers of the model as forward/backward pairs over
// flat slices (layers.go: embedding, LayerNorm, linear, causal attention, GELU, cross-entropy,
// softmax, AdamW), and the quantisers of the tensors that cross a boundary (quant.go: bfloat16,
// int8 with a scale per row), which run on the host for every backend. These Go functions are the reference: the WGSL shaders of the browser's WebGPU
// backend (kernels/wgsl) compute the same things and are validated against them.
//
// Determinism is part of the contract: an output element depends only on its row of A, its column
// of B and the reduction length K — never on M, N, where the element sits in a tile, or how many
// threads ran. That is what lets a pipeline stage or a remote expert, fed the same rows, reproduce
// the single-process reference bit for bit.
//
// # How the multiplies keep that promise
//
// Every element of C is one sequential chain over k = 0, 1, …, K-1:
//
//	s = 0 (or the old c when acc); s = s + a[i,k]·b[k,j] for each k in order; c = s
//
// The SIMD kernels (AVX-512, AVX2+FMA) do each step as one fused multiply-add; the portable
// kernel rounds the product to float32 and then adds. Nothing else varies:
//
//   - Threads split C into blocks of rows and columns, never K, so no element's sum is ever
//     split between goroutines.
//   - K is cut into blocks (a function of K alone) only for the caches: a block's partial sums are
//     stored in C as float32 and the next block continues the chain from them, which is exact.
//   - An element is a lane of a vector accumulator in a tile; every lane runs the same chain, and
//     partial tiles at the edges run the same kernel on zero-padded panels (or a kernel of
//     exactly their height), never a scalar tail with its own rounding.
//   - With acc the chain starts from the old c instead of adding it at the end. One consequence,
//     tested: accumulating a weight gradient over token groups (MatMulTN with acc=false, then
//     acc=true) gives the bits of one MatMulTN over all the tokens.
//
// So AVX-512 and AVX2 give identical bits (same chain, different tile shapes), and the portable
// kernel gives identical bits on every GOARCH, wasm included (the explicit float32 rounding of
// the product forbids the compiler from fusing it). Between the two families results differ by
// float32 rounding; the tests bound it by 1e-5·Σ|a·b|.
//
// The elementwise layers that would otherwise rival the multiplies — GELU (a float32 tanh on every
// hidden activation) and AdamW (every parameter) — have AVX2 loops (gelu_amd64.s, adamw_amd64.s)
// that do the Go loop's operations in the Go loop's order, one rounding each, so that they give
// the Go loop's bits; they are used only below GOAMD64=v3, where the compiler fuses no
// multiply-add. LayerNorm's backward has such loops too (layernorm_amd64.s). Elementwise sums
// (sum_amd64.s) and the exponentials of softmax and cross-entropy (exp_amd64.s: math.Exp's own
// amd64 algorithm on four lanes, or eight with AVX-512, checked against math.Exp bit for bit) need
// no fused multiply-add to agree, so they are used at every level. Sums over rows (bias and
// LayerNorm gradients) are split between threads by columns, each column summed over the rows in
// order; norms by tensor; float64 sums that are chains (LayerNorm's statistics) run four rows'
// chains side by side, each in its own order. The attention's products skip what the causal mask makes exact zeros at the
// start of a chain, or throws away (causalNT, causalTN).
//
// Lanes runs independent work side by side with the threads shared among it (model.Model's two
// halves of a step's micro-batches, outer mode's replicas in one process): each lane's kernels
// then run on fewer threads, which changes no result.
//
// # Choosing an instruction set and threads
//
// The fastest instruction set the CPU supports is picked at start-up from CPUID (ISAs lists the
// usable ones); SHOAL_KERNELS=purego|avx2|avx512 or SetISA overrides it. Build with -tags purego
// (or for wasm) to leave the assembly out. A multiply runs on the caller's goroutine plus up to
// Threads()-1 pool goroutines (SetThreads; default GOMAXPROCS), which claim tiles from an atomic
// counter; small multiplies stay on the caller's goroutine.
//
// # Tests and benchmarks
//
//	go test ./kernels/                                  # every usable ISA, against the reference
//	GOOS=js GOARCH=wasm go test -exec="$(go env GOROOT)/lib/wasm/go_js_wasm_exec" ./kernels/
//	go test -run '^$' -bench 'GEMM/NT/avx512/1024x1024x1024' -benchtime 10x ./kernels/
//
// The assembly is generated: go generate ./kernels/ (see internal/asmgen).
//
// kernels imports nothing outside the standard library: it is compiled into the wasm worker.
package kernels
