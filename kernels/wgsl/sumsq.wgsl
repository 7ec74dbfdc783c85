// sumsq: partial sums of squares of x, one per chunk of SUMSQ_CHUNK elements, for gradient norms.
// The host reads the partials back and adds them in float64 in chunk order. Every partial is the
// same fixed tree — invocation i sums elements i, i+128, … of its chunk in order, then the 128
// sums are halved pairwise — so the result depends on n alone, never on timing: a norm computed
// twice is the same bits, as docs/design.md's "Determinism" asks.
// Grid: one workgroup per chunk.

struct Params {
	off_partials: u32,
	off_x: u32,
	n: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> partials: array<f32>;
@group(0) @binding(2) var<storage, read> x: array<f32>;

const SUMSQ_CHUNK: u32 = 4096u; // 32 elements per invocation

var<workgroup> part: array<f32, 128>;

@compute @workgroup_size(128, 1, 1)
fn sumsq(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
	let chunk = wid.y * nwg.x + wid.x; // uniform across the workgroup, unlike flat_index
	let lo = chunk * SUMSQ_CHUNK;
	let hi = min(lo + SUMSQ_CHUNK, p.n);
	var s = 0.0;
	for (var i = lo + lid.x; i < hi; i += WG) {
		let v = x[p.off_x + i];
		s += v * v;
	}
	part[lid.x] = s;
	for (var h = WG / 2u; h > 0u; h /= 2u) {
		workgroupBarrier();
		if (lid.x < h) {
			part[lid.x] += part[lid.x + h];
		}
	}
	if (lid.x == 0u && lo < p.n) {
		partials[p.off_partials + chunk] = part[0];
	}
}
