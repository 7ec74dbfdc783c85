// Prepended, after common.wgsl, to the row kernels (Kernel.Reduce): LANES invocations share a
// row, WG/LANES rows per workgroup (Grid Rows). Lane l of a row first folds the row's elements
// l, l+LANES, l+2·LANES, … in order; row_sum and row_max then combine the LANES values in one
// fixed pairwise tree in workgroup memory (halving: LANES/2 pairs, then LANES/4, …, 1). The
// tree's shape depends on LANES alone, so a row gives the same bits run after run (no atomics:
// docs/design.md, "Determinism").
//
// LANES is set per pipeline: 128 on GPUs — one workgroup per row, its loads of a row coalesced,
// a row's sum in 7 barrier steps instead of C serial adds — and 1 on fallback (software)
// adapters, where an invocation walks its row alone and the reductions, constant-folded away,
// cost no barrier: on SwiftShader a barrier costs far more than the adds it saves. Both are
// validated on every adapter (wasm/webgpu).
//
// Row kernels do not return early (a row past the end would leave its workgroup's barriers
// unmatched): they guard their memory accesses with live instead. row_sum and row_max must be
// called from uniform control flow.

override LANES: u32 = 128u;

var<workgroup> red: array<f32, 128>;

// row_of returns the row of invocation li of workgroup (wid, nwg), and its lane.
fn row_of(wid: vec3<u32>, nwg: vec3<u32>, li: u32) -> vec2<u32> {
	return vec2<u32>(group_index(wid, nwg) * (WG / LANES) + li / LANES, li % LANES);
}

fn row_sum(v: f32, li: u32) -> f32 {
	if (LANES == 1u) {
		return v;
	}
	workgroupBarrier(); // every lane has read the previous reduction's result
	red[li] = v;
	for (var h = LANES / 2u; h > 0u; h /= 2u) {
		workgroupBarrier();
		if (li % LANES < h) {
			red[li] += red[li + h];
		}
	}
	workgroupBarrier();
	return red[li - li % LANES];
}

fn row_max(v: f32, li: u32) -> f32 {
	if (LANES == 1u) {
		return v;
	}
	workgroupBarrier();
	red[li] = v;
	for (var h = LANES / 2u; h > 0u; h /= 2u) {
		workgroupBarrier();
		if (li % LANES < h) {
			red[li] = max(red[li], red[li + h]);
		}
	}
	workgroupBarrier();
	return red[li - li % LANES];
}
