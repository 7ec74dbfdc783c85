// moe_stats: kernels.MoEStats. stats (E+1): stats[e] = Σ_r mask[r,e], the assignments to expert
// e, and stats[E] = E·Σ_e (count_e/(N·K))·(Σ_r probs[r,e])/N, the Switch balancing loss. The Go
// reference sums in float64; WGSL has no f64, so one workgroup sums each column in float32 in a
// fixed order: invocation l adds rows l, l+128, l+256, … in row order, then the 128 partial sums
// combine in a fixed pairwise tree (as reduce.wgsl's), the columns one after another. The counts
// are sums of 0s and 1s, exact in float32 below 2^24 rows, so they are the reference's bits; the
// balancing loss is a float32 chain over the experts in expert order with the reference's
// operations, within wasm/webgpu's tolMoEStats of it. The order depends on N and E alone: the
// same bits run after run.
// Grid: a single workgroup.

struct Params {
	off_stats: u32,
	off_mask: u32,
	off_probs: u32,
	rows: u32,
	e: u32,
	k: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> stats: array<f32>;
@group(0) @binding(2) var<storage, read> mask: array<f32>;
@group(0) @binding(3) var<storage, read> probs: array<f32>;

var<workgroup> psum: array<f32, 128>;
var<workgroup> nsum: array<f32, 128>;

@compute @workgroup_size(128, 1, 1)
fn moe_stats(@builtin(local_invocation_index) li: u32) {
	let nk = f32(p.rows * p.k);
	let n = f32(p.rows);
	var aux = 0.0;
	for (var e = 0u; e < p.e; e++) {
		var ps = 0.0;
		var ns = 0.0;
		for (var r = li; r < p.rows; r += WG) {
			ps += probs[p.off_probs + r * p.e + e];
			ns += mask[p.off_mask + r * p.e + e];
		}
		workgroupBarrier(); // invocation 0 has read the previous column's sums
		psum[li] = ps;
		nsum[li] = ns;
		for (var h = WG / 2u; h > 0u; h /= 2u) {
			workgroupBarrier();
			if (li < h) {
				psum[li] += psum[li + h];
				nsum[li] += nsum[li + h];
			}
		}
		workgroupBarrier();
		if (li == 0u) {
			let cnt = nsum[0];
			stats[p.off_stats + e] = cnt;
			aux += cnt / nk * psum[0] / n;
		}
	}
	if (li == 0u) {
		stats[p.off_stats + p.e] = f32(p.e) * aux;
	}
}
