// Prepended to every kernel of package wgsl (WGSL has no #include): helpers shared by the kernels.

// Workgroups of 128 invocations or fewer: the most a compatibility-mode adapter allows
// (maxComputeInvocationsPerWorkgroup), so every kernel runs on every adapter.
const WG: u32 = 128u;

// flat_index is the index of one invocation in a 1-D launch that the host spread over a 2-D grid
// of workgroups, because a dimension holds at most 65535 workgroups (maxComputeWorkgroupsPerDimension)
// and a tensor of 8.4 M elements already needs more.
fn flat_index(wid: vec3<u32>, nwg: vec3<u32>, lid: vec3<u32>) -> u32 {
	return (wid.y * nwg.x + wid.x) * WG + lid.x;
}

// group_index is the index of a workgroup in a launch of one workgroup per item (a row, a chunk)
// spread over x and y like flat_index's. Unlike flat_index it is uniform across the workgroup,
// so a kernel may return on it and still reach its barriers.
fn group_index(wid: vec3<u32>, nwg: vec3<u32>) -> u32 {
	return wid.y * nwg.x + wid.x;
}

// tanh32 is kernels.Tanh32 (Eigen's generic_fast_tanh_float), the same rational polynomial in
// the same order, so GELU agrees with the Go reference to a few ulp whatever the adapter's own
// tanh does (WGSL leaves tanh's accuracy to the implementation).
fn tanh32(x0: f32) -> f32 {
	let x = clamp(x0, -7.90531110763549805, 7.90531110763549805);
	if (abs(x) < 0.0004) {
		return x;
	}
	let x2 = x * x;
	var p = x2 * -2.76076847742355e-16 + 2.00018790482477e-13;
	p = p * x2 + -8.60467152213735e-11;
	p = p * x2 + 5.12229709037114e-08;
	p = p * x2 + 1.48572235717979e-05;
	p = p * x2 + 6.37261928875436e-04;
	p = p * x2 + 4.89352455891786e-03;
	p = p * x;
	var q = x2 * 1.19825839466702e-06 + 1.18534705686654e-04;
	q = q * x2 + 2.26843463243900e-03;
	q = q * x2 + 4.89352518554385e-03;
	return p / q;
}
