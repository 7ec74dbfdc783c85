// Workgroup reductions for the one-workgroup-per-row kernels: every invocation contributes one
// value (its strided partial over the row, in element order) and a fixed binary tree over
// invocation indices combines them, so the result depends on the row and the workgroup size
// only, never on timing. Each call ends with a barrier, so calls may follow one another.

shared float red[WG];

float wg_sum(float v) {
	uint l = gl_LocalInvocationID.x;
	red[l] = v;
	barrier();
	for (uint h = WG / 2u; h > 0u; h >>= 1u) {
		if (l < h) {
			red[l] = red[l] + red[l + h];
		}
		barrier();
	}
	float r = red[0];
	barrier();
	return r;
}

float wg_max(float v) {
	uint l = gl_LocalInvocationID.x;
	red[l] = v;
	barrier();
	for (uint h = WG / 2u; h > 0u; h >>= 1u) {
		if (l < h) {
			red[l] = max(red[l], red[l + h]);
		}
		barrier();
	}
	float r = red[0];
	barrier();
	return r;
}
