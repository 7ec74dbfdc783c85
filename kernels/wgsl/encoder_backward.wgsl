// encoder_backward: kernels.EncoderBackward, accumulating dwte[inp[r]] += dout[r] and
// dwpe[r mod T] += dout[r]. Rows that share a token add into the same row of dwte, so there is
// no output-parallel split by row: one invocation per column walks the rows in order, which is
// race-free without atomics and adds in the Go reference's order.

struct Params {
	off_dwte: u32,
	off_dwpe: u32,
	off_dout: u32,
	off_inp: u32,
	rows: u32,
	t: u32,
	c: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> dwte: array<f32>;
@group(0) @binding(2) var<storage, read_write> dwpe: array<f32>;
@group(0) @binding(3) var<storage, read> dout: array<f32>;
@group(0) @binding(4) var<storage, read> inp: array<i32>;

@compute @workgroup_size(128, 1, 1)
fn encoder_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
	let i = flat_index(wid, nwg, lid);
	if (i >= p.c) {
		return;
	}
	for (var r = 0u; r < p.rows; r++) {
		let g = dout[p.off_dout + r * p.c + i];
		let ix = u32(inp[p.off_inp + r]);
		dwte[p.off_dwte + ix * p.c + i] += g;
		dwpe[p.off_dwpe + (r % p.t) * p.c + i] += g;
	}
}
