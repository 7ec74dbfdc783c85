package kernels

// The MoE routing of a block run where its tensors are (model's dense local-experts path, for a
// GPU that holds a stage and all its experts): every local expert computes every row of the
// micro-batch, and a gate — the router probability of the experts a row is routed to, zero for
// the others — weights what they return. Nothing about the routing has to come back to the host,
// so the block costs the device no wait. Each function computes what model/moe.go's host path
// computes on the routed rows, in the same order: an unrouted row adds an exact zero.

// TopKGate writes, for each row r of probs (N,E), gate[r,e] = probs[r,e] and mask[r,e] = 1 for the
// K experts of largest probability — ties to the lower index, as model's topK picks them — and
// gate[r,e] = mask[r,e] = 0 for the others.
func TopKGate(gate, mask, probs []float32, N, E, K int) {
	for r := 0; r < N; r++ {
		p := probs[r*E : (r+1)*E]
		g, m := gate[r*E:(r+1)*E], mask[r*E:(r+1)*E]
		clear(g)
		clear(m)
		for s := 0; s < K; s++ {
			best := -1
			for e, v := range p {
				if m[e] == 0 && (best < 0 || v > p[best]) {
					best = e
				}
			}
			m[best], g[best] = 1, p[best]
		}
	}
}

// GateRows sets dst (N,C) to src (N,C) with each row r scaled by gate[r,e] (gate is (N,E)), or
// adds that to dst with acc: the combination of expert e's outputs (acc, experts in order) and
// its share of the output gradient.
func GateRows(dst, src, gate []float32, e, N, C, E int, acc bool) {
	for r := 0; r < N; r++ {
		w := gate[r*E+e]
		d, s := dst[r*C:(r+1)*C], src[r*C:(r+1)*C]
		if acc {
			for c := range d {
				d[c] += w * s[c]
			}
		} else {
			for c := range d {
				d[c] = w * s[c]
			}
		}
	}
}

// GateGrad writes column e of dgate (N,E): Σ_c dout[r,c]·y[r,c], a float32 chain in c order, for
// the rows routed to expert e (mask[r,e] ≠ 0), 0 for the others — the gradient of the loss with
// respect to the gate weight, expert e's output being y (N,C).
func GateGrad(dgate, dout, y, mask []float32, e, N, C, E int) {
	for r := 0; r < N; r++ {
		if mask[r*E+e] == 0 {
			dgate[r*E+e] = 0
			continue
		}
		d, yr := dout[r*C:(r+1)*C], y[r*C:(r+1)*C]
		var s float32
		for c := range d {
			s += d[c] * yr[c]
		}
		dgate[r*E+e] = s
	}
}

// MoEStats writes stats (E+1): stats[e] the number of assignments to expert e (Σ_r mask[r,e]), and
// stats[E] the Switch balancing loss E·Σ_e f_e·P_e with f_e = count_e/(N·K) and P_e the mean of
// column e of probs, computed in float64 as model's host path does and rounded to float32.
func MoEStats(stats, mask, probs []float32, N, E, K int) {
	var aux float64
	for e := 0; e < E; e++ {
		var pm, n float64
		for r := 0; r < N; r++ {
			pm += float64(probs[r*E+e])
			n += float64(mask[r*E+e])
		}
		stats[e] = float32(n)
		aux += n / float64(N*K) * pm / float64(N)
	}
	stats[E] = float32(float64(E) * aux)
}

// AuxGrad adds the balancing loss's gradient to dgate (N,E), scaled by scale (d loss / d aux):
// d aux / d p[r,e] = E·f_e/N, f_e = stats[e]/(N·K) (a count: it has no gradient), in model's
// float32 order.
func AuxGrad(dgate, stats []float32, N, E, K int, scale float32) {
	for e := 0; e < E; e++ {
		f := float32(float64(stats[e]) / float64(N*K))
		g := scale * float32(E) * f / float32(N)
		for r := 0; r < N; r++ {
			dgate[r*E+e] += g
		}
	}
}

// SoftmaxBackwardRows writes dx = p·(dp − Σ_e p·dp) for each row of the softmax output p (N,E)
// and its gradient dp, the sum a float32 chain in e order.
func SoftmaxBackwardRows(dx, p, dp []float32, N, E int) {
	for r := 0; r < N; r++ {
		pr, dr, xr := p[r*E:(r+1)*E], dp[r*E:(r+1)*E], dx[r*E:(r+1)*E]
		var s float32
		for e := range pr {
			s += pr[e] * dr[e]
		}
		for e := range pr {
			xr[e] = pr[e] * (dr[e] - s)
		}
	}
}
