// topk_gate: kernels.TopKGate. For each row r of probs (N,E), gate[r,e] = probs[r,e] and
// mask[r,e] = 1 for the K experts of largest probability, gate = mask = 0 for the others. The
// selection is the Go reference's, step for step: K scans of the row in expert order, each
// taking the largest probability not yet taken by a strict >, so that ties go to the lower index
// (and a NaN is treated as the reference treats it). The row's mask, already written, records
// what is taken. Comparisons and copies only: the bits are the reference's.
// Grid: one invocation per row.

struct Params {
	off_gate: u32,
	off_mask: u32,
	off_probs: u32,
	rows: u32,
	e: u32,
	k: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> gate: array<f32>;
@group(0) @binding(2) var<storage, read_write> mask: array<f32>;
@group(0) @binding(3) var<storage, read> probs: array<f32>;

@compute @workgroup_size(128, 1, 1)
fn topk_gate(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
	let r = flat_index(wid, nwg, lid);
	if (r >= p.rows) {
		return;
	}
	let g0 = p.off_gate + r * p.e;
	let m0 = p.off_mask + r * p.e;
	let p0 = p.off_probs + r * p.e;
	for (var i = 0u; i < p.e; i++) {
		gate[g0 + i] = 0.0;
		mask[m0 + i] = 0.0;
	}
	for (var s = 0u; s < p.k; s++) {
		var best = p.e; // none yet
		var bv = 0.0;
		for (var i = 0u; i < p.e; i++) {
			let v = probs[p0 + i];
			if (mask[m0 + i] == 0.0 && (best == p.e || v > bv)) {
				best = i;
				bv = v;
			}
		}
		if (best == p.e) {
			break; // K > E: every expert taken (the host refuses it)
		}
		mask[m0 + best] = 1.0;
		gate[g0 + best] = bv;
	}
}
