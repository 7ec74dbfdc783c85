// encoder_backward: kernels.EncoderBackward, accumulating dwte[inp[r]] += dout[r] and
// dwpe[r mod T] += dout[r], with encoder_links's lists of the rows of each token.
// Invocation (r, col) adds, to column col:
//   - when r < T, the B rows r, r+T, … (position r of each sequence) into dwpe[r];
//   - when r is the first row of its token, the rows of that token, following links, into
//     dwte[inp[r]].
// Each output element is thus one chain in row order from its old value: the Go reference's
// exact order, so the result is its bits, and no two invocations write one element (no atomics).
// Where the old kernel walked all N rows in each of C invocations, this spreads the rows
// over N·C invocations (consecutive ones on consecutive columns, coalesced).

struct Params {
	off_dwte: u32,
	off_dwpe: u32,
	off_dout: u32,
	off_inp: u32,
	off_links: u32,
	rows: u32,
	t: u32,
	c: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> dwte: array<f32>;
@group(0) @binding(2) var<storage, read_write> dwpe: array<f32>;
@group(0) @binding(3) var<storage, read> dout: array<f32>;
@group(0) @binding(4) var<storage, read> inp: array<i32>;
@group(0) @binding(5) var<storage, read> links: array<i32>;

@compute @workgroup_size(128, 1, 1)
fn encoder_backward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
	let e = flat_index(wid, nwg, lid);
	if (e >= p.rows * p.c) {
		return;
	}
	let r = e / p.c;
	let col = e % p.c;
	if (r < p.t) {
		let j = p.off_dwpe + r * p.c + col;
		var s = dwpe[j];
		for (var q = r; q < p.rows; q += p.t) {
			s += dout[p.off_dout + q * p.c + col];
		}
		dwpe[j] = s;
	}
	if (links[p.off_links + 2u * r + 1u] == 1) {
		let j = p.off_dwte + u32(inp[p.off_inp + r]) * p.c + col;
		var s = dwte[j];
		var q = i32(r);
		loop {
			s += dout[p.off_dout + u32(q) * p.c + col];
			q = links[p.off_links + 2u * u32(q)];
			if (q < 0) {
				break;
			}
		}
		dwte[j] = s;
	}
}
