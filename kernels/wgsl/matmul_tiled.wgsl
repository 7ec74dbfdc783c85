// matmul_tiled: what matmul computes — C (m×n) = op(A)·op(B), or C += … with acc, batched by
// strides, bias added after the chain with has_bias — staged through workgroup memory, for real
// GPUs. The parameters and bindings are matmul's, so the host drives both alike.
//
// Each element of C is still one sequential chain over k = 0 … K-1 from 0 (or the old C with
// acc), the chain of the Go kernels: a K-step only changes where the operands come from, not the
// order of the adds, so matmul's tolerance holds unchanged.
//
// Tiling: a workgroup of 128 invocations computes a 64×64 tile of C, K in steps of 16. Per step
// it stages the 64×16 slice of op(A) and the 16×64 slice of op(B) in workgroup memory (2 × 16
// rows of 68 floats: 8.5 KiB of the 16 KiB a compatibility device allows), then each invocation
// adds 16 steps to its 4×8 block of C held in registers: 4 rows ty·4 … and two groups of 4
// columns, tx·4 … and 32 + tx·4 …, so that the 32 invocations of a warp read 8 consecutive
// vec4 of the B tile and 4 of the A tile (broadcast), without bank conflicts. Per K-step an
// invocation does 32·16 multiply-adds for 24 loads from workgroup memory and 16 from global
// memory, where matmul does 16 multiply-adds per 8 global loads.
//
// Loads: each invocation loads 8 elements of each tile, chosen so that consecutive invocations
// read consecutive addresses in every layout: along k for A (m×k) and for B stored n×k
// (TRANS_B), along m for A stored k×m (TRANS_A), along n for B (k×n). The tiles are kept k-major
// (row kk holds the 64 values of one k), padded from 16 to 17 vec4 per row so that the
// transposing stores of the two k-contiguous layouts meet at most 2-way bank conflicts instead
// of 16-way.
//
// Global loads are scalar, not vec4: tensor views start at any element (offsets travel in
// Params) and attention reads q, k and v at column offsets C and 2C inside rows of 3C, so 16-byte
// alignment of an operand, its leading dimension and k is the exception, not the rule; a vec4
// path would be a second set of pipelines used only when all three line up. The consecutive
// scalar loads of a warp coalesce into the same memory transactions.
//
// Measured on SwiftShader (a CPU), this kernel is slower than matmul (its barriers cost more
// there than the reuse gains: matmul was 15–65% faster there), which is why fallback adapters
// keep matmul.

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

const BM: u32 = 64u; // rows of C per workgroup
const BN: u32 = 64u; // columns of C per workgroup
const BK: u32 = 16u; // k per stage
const ROW4: u32 = 17u; // vec4 per k-row of a tile: 16 for the 64 values, 1 of padding

var<workgroup> ta: array<vec4<f32>, 272>; // BK × ROW4: ta[kk·ROW4 + i/4][i%4] = op(A)[m0+i, k0+kk]
var<workgroup> tb: array<vec4<f32>, 272>; // BK × ROW4: tb[kk·ROW4 + j/4][j%4] = op(B)[k0+kk, n0+j]

@compute @workgroup_size(128, 1, 1)
fn matmul_tiled(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
	let outer = wid.z / p.batch_inner;
	let inner = wid.z % p.batch_inner;
	let base_c = p.off_c + outer * p.sc_outer + inner * p.sc_inner;
	let base_a = p.off_a + outer * p.sa_outer + inner * p.sa_inner;
	let base_b = p.off_b + outer * p.sb_outer + inner * p.sb_inner;
	let m0 = wid.y * BM;
	let n0 = wid.x * BN;
	let tx = li % 8u; // columns tx·4 … and 32 + tx·4 … of the tile
	let ty = li / 8u; // rows ty·4 … of the tile

	// s[2·i + h] holds row ty·4 + i, columns h·32 + tx·4 … + 3.
	var s: array<vec4<f32>, 8>;
	if (p.acc != 0u) {
		for (var i = 0u; i < 4u; i++) {
			let row = m0 + ty * 4u + i;
			for (var h = 0u; h < 2u; h++) {
				for (var j = 0u; j < 4u; j++) {
					let col = n0 + h * 32u + tx * 4u + j;
					if (row < p.m && col < p.n) {
						s[2u * i + h][j] = c[base_c + row * p.ldc + col];
					}
				}
			}
		}
	}

	for (var k0 = 0u; k0 < p.k; k0 += BK) {
		let kn = min(BK, p.k - k0); // uniform: the last step may be short
		workgroupBarrier(); // the previous step's tiles have been read
		for (var l = 0u; l < 8u; l++) {
			let e = li + 128u * l; // element of the 1024 in each tile
			var i: u32; // row of the A tile
			var kk: u32;
			if (TRANS_A) {
				i = e % BM;
				kk = e / BM;
			} else {
				i = e / BK;
				kk = e % BK;
			}
			var va = 0.0;
			if (m0 + i < p.m && kk < kn) {
				if (TRANS_A) {
					va = a[base_a + (k0 + kk) * p.lda + m0 + i];
				} else {
					va = a[base_a + (m0 + i) * p.lda + k0 + kk];
				}
			}
			ta[kk * ROW4 + i / 4u][i % 4u] = va;

			var j: u32; // column of the B tile
			if (TRANS_B) {
				j = e / BK;
				kk = e % BK;
			} else {
				j = e % BN;
				kk = e / BN;
			}
			var vb = 0.0;
			if (n0 + j < p.n && kk < kn) {
				if (TRANS_B) {
					vb = b[base_b + (n0 + j) * p.ldb + k0 + kk];
				} else {
					vb = b[base_b + (k0 + kk) * p.ldb + n0 + j];
				}
			}
			tb[kk * ROW4 + j / 4u][j % 4u] = vb;
		}
		workgroupBarrier();
		// Only the kn valid steps: a padded zero would add a term (and 0·∞ a NaN) the Go chain has not.
		for (var kk = 0u; kk < kn; kk++) {
			let av = ta[kk * ROW4 + ty];
			let b0 = tb[kk * ROW4 + tx];
			let b1 = tb[kk * ROW4 + 8u + tx];
			s[0] += av.x * b0;
			s[1] += av.x * b1;
			s[2] += av.y * b0;
			s[3] += av.y * b1;
			s[4] += av.z * b0;
			s[5] += av.z * b1;
			s[6] += av.w * b0;
			s[7] += av.w * b1;
		}
	}

	for (var i = 0u; i < 4u; i++) {
		let row = m0 + ty * 4u + i;
		if (row < p.m) {
			let r = base_c + row * p.ldc;
			for (var h = 0u; h < 2u; h++) {
				for (var j = 0u; j < 4u; j++) {
					let col = n0 + h * 32u + tx * 4u + j;
					if (col < p.n) {
						var x = s[2u * i + h][j];
						if (p.has_bias != 0u) {
							x += bias[p.off_bias + col];
						}
						c[r + col] = x;
					}
				}
			}
		}
	}
}
