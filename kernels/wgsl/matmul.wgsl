// matmul: C (m×n) = op(A) (m×k) · op(B) (k×n), or C += … with acc, for a batch of matrices at
// strided offsets. kernels.MatMulNN/NT/TN are the batch-of-one cases; attention runs its
// per-(batch, head) products through the batch strides, straight out of the (B,T,3C) qkv tensor.
// With has_bias, bias[col] is added to each element after its whole chain, as
// kernels.LinearForward adds it after MatMulNT: the same two roundings, one dispatch fewer.
//
// This is the variant for fallback (software) adapters such as SwiftShader; matmul_tiled is the
// one for GPUs. wasm/webgpu picks by the adapter's isFallbackAdapter. Measured on SwiftShader
// (scripts/bench_webgpu.sh), this one is the faster there: see matmul_tiled's header.
//
// Each element of C is one sequential chain over k = 0 … K-1 that starts from 0, or from the old
// C with acc: the chain of the Go kernels (kernels/doc.go), so results differ from them only by
// float32 rounding (fused or separate multiply-add), and never depend on the tile an element
// falls in.
//
// Register blocking: an invocation keeps a 4×4 block of C in registers and reads 4 values of A
// and 4 of B per step of k; 16×8 invocations cover a 32×64 tile. No workgroup memory and no
// barriers: on SwiftShader (a CPU) barrier-heavy shared-memory tiling ran ~10× slower, and on a
// GPU the caches serve the reuse that shared memory would. Rows and columns of an invocation are
// interleaved (row0 + 8·i, col0 + 16·j) so that neighbouring invocations read neighbouring
// addresses.

// TRANS_A: A is stored k×m (MatMulTN); TRANS_B: B is stored n×k (MatMulNT).
override TRANS_A: bool = false;
override TRANS_B: bool = false;

struct Params {
	off_c: u32,
	off_a: u32,
	off_b: u32,
	off_bias: u32,
	m: u32,
	k: u32,
	n: u32,
	ldc: u32,
	lda: u32,
	ldb: u32,
	acc: u32,
	has_bias: u32,
	// Batch index z = outer·batch_inner + inner; a matrix starts s_outer·outer + s_inner·inner
	// elements after its operand's offset.
	batch_inner: u32,
	sc_outer: u32,
	sc_inner: u32,
	sa_outer: u32,
	sa_inner: u32,
	sb_outer: u32,
	sb_inner: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> c: array<f32>;
@group(0) @binding(2) var<storage, read> a: array<f32>;
@group(0) @binding(3) var<storage, read> b: array<f32>;
// Without has_bias the host binds any read-only tensor here (a): it is never read.
@group(0) @binding(4) var<storage, read> bias: array<f32>;

const TM: u32 = 4u; // rows of C per invocation
const TN: u32 = 4u; // columns of C per invocation
const WX: u32 = 16u; // invocations along n
const WY: u32 = 8u; // invocations along m

fn a_at(base: u32, i: u32, kk: u32) -> f32 {
	if (TRANS_A) {
		return a[base + kk * p.lda + i];
	}
	return a[base + i * p.lda + kk];
}

fn b_at(base: u32, kk: u32, j: u32) -> f32 {
	if (TRANS_B) {
		return b[base + j * p.ldb + kk];
	}
	return b[base + kk * p.ldb + j];
}

@compute @workgroup_size(16, 8, 1)
fn matmul(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
	let outer = wid.z / p.batch_inner;
	let inner = wid.z % p.batch_inner;
	let base_c = p.off_c + outer * p.sc_outer + inner * p.sc_inner;
	let base_a = p.off_a + outer * p.sa_outer + inner * p.sa_inner;
	let base_b = p.off_b + outer * p.sb_outer + inner * p.sb_inner;
	let row0 = wid.y * (WY * TM) + lid.y;
	let col0 = wid.x * (WX * TN) + lid.x;
	if (row0 >= p.m || col0 >= p.n) {
		return; // the first row or column of this invocation's block is already outside C
	}
	// Rows and columns past the edge of C read the last valid one (so every load stays inside
	// the operands) and are never stored.
	var ri: array<u32, 4>;
	var cj: array<u32, 4>;
	for (var i = 0u; i < TM; i++) {
		ri[i] = min(row0 + WY * i, p.m - 1u);
	}
	for (var j = 0u; j < TN; j++) {
		cj[j] = min(col0 + WX * j, p.n - 1u);
	}
	var s: array<vec4<f32>, 4>;
	if (p.acc != 0u) {
		for (var i = 0u; i < TM; i++) {
			let r = base_c + ri[i] * p.ldc;
			s[i] = vec4<f32>(c[r + cj[0]], c[r + cj[1]], c[r + cj[2]], c[r + cj[3]]);
		}
	}
	for (var kk = 0u; kk < p.k; kk++) {
		let bv = vec4<f32>(b_at(base_b, kk, cj[0]), b_at(base_b, kk, cj[1]), b_at(base_b, kk, cj[2]), b_at(base_b, kk, cj[3]));
		s[0] += a_at(base_a, ri[0], kk) * bv;
		s[1] += a_at(base_a, ri[1], kk) * bv;
		s[2] += a_at(base_a, ri[2], kk) * bv;
		s[3] += a_at(base_a, ri[3], kk) * bv;
	}
	for (var i = 0u; i < TM; i++) {
		let row = row0 + WY * i;
		if (row < p.m) {
			let r = base_c + row * p.ldc;
			for (var j = 0u; j < TN; j++) {
				let col = col0 + WX * j;
				if (col < p.n) {
					var x = s[i][j];
					if (p.has_bias != 0u) {
						x += bias[p.off_bias + col];
					}
					c[r + col] = x;
				}
			}
		}
	}
}
