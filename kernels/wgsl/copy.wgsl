// copy: dst = src elementwise. A kernel rather than copyBufferToBuffer, so that a copy stays in
// the open compute pass and needs no 4-byte-aligned, non-overlapping buffer ranges.
// Grid: one invocation per element.

struct Params {
	off_dst: u32,
	off_src: u32,
	n: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> dst: array<f32>;
@group(0) @binding(2) var<storage, read> src: array<f32>;

@compute @workgroup_size(128, 1, 1)
fn copy(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
	let i = flat_index(wid, nwg, lid);
	if (i >= p.n) {
		return;
	}
	dst[p.off_dst + i] = src[p.off_src + i];
}
