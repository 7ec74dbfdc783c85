// gelu_backward: kernels.GELUBackward. dinp = GELU'(x)·dout, overwriting dinp, which may be the
// same tensor as dout (each invocation reads its element before writing it).
// Grid: one invocation per element.

struct Params {
	off_dinp: u32,
	off_inp: u32,
	off_th: u32,
	off_dout: u32,
	n: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> dinp: array<f32>;
@group(0) @binding(2) var<storage, read> inp: array<f32>;
@group(0) @binding(3) var<storage, read> th: array<f32>;
@group(0) @binding(4) var<storage, read> dout: array<f32>;

const GELU_SCALE: f32 = 0.7978845608028654; // √(2/π)

@compute @workgroup_size(128, 1, 1)
fn gelu_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
	let i = flat_index(wid, nwg, lid);
	if (i >= p.n) {
		return;
	}
	let x = inp[p.off_inp + i];
	let t = th[p.off_th + i];
	let g = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * GELU_SCALE * (1.0 + 3.0 * 0.044715 * x * x);
	dinp[p.off_dinp + i] = g * dout[p.off_dout + i];
}
