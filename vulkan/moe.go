package vulkan

import (
	"fmt"

	"github.com/shoal-ml/shoal/model"
)

// The MoE routing ops of model.Device (kernels/moe.go): an MoE block's gate, mask, gate-weighted
// rows, the gate's gradient, the block's counts and balancing loss, the loss's gradient and the
// router softmax's backward, all on the device, so that the dense local-experts path costs no
// wait. E is a handful of experts (2–64), K ≤ E.

// moeShape checks a routing shape. N·K is at most 2^24, so that the float32 counts and the N·K of
// the kernels' f_e = count/(N·K) are exact integers, as Go's float64 ones are.
func moeShape(what string, N, E, K int) {
	if N < 0 || E <= 0 || K < 0 || K > E || N*K > 1<<24 {
		panic(fmt.Sprintf("vulkan: %s: N=%d rows, E=%d experts, K=%d", what, N, E, K))
	}
}

func expertIndex(what string, e, E int) {
	if e < 0 || e >= E {
		panic(fmt.Sprintf("vulkan: %s: expert %d of %d", what, e, E))
	}
}

// TopKGate writes gate and mask (N,E): probs and 1 at each row's K most probable experts (ties
// to the lower index), 0 elsewhere.
func (d *Device) TopKGate(gate, mask, probs model.Buf, N, E, K int) {
	moeShape("TopKGate", N, E, K)
	g, m, p := bf(gate, N*E, false, "TopKGate gate"), bf(mask, N*E, false, "TopKGate mask"), bf(probs, N*E, false, "TopKGate probs")
	defer d.mu.Unlock()
	if d.lock() && N > 0 {
		d.flat("topk_gate", N, []arg{out(g), out(m), in(p)}, g.elem(), m.elem(), p.elem(), u32(N), u32(E), u32(K))
	}
}

// GateRows sets dst (N,C) to src (N,C) with row r scaled by gate[r,e], or adds that with acc.
func (d *Device) GateRows(dst, src, gate model.Buf, e, N, C, E int, acc bool) {
	expertIndex("GateRows", e, E)
	o, s, g := bf(dst, N*C, false, "GateRows dst"), bf(src, N*C, false, "GateRows src"), bf(gate, N*E, false, "GateRows gate")
	a := uint32(0)
	if acc {
		a = 1
	}
	defer d.mu.Unlock()
	if d.lock() && N*C > 0 {
		d.flat("gate_rows", N*C, []arg{out(o), in(s), in(g)}, o.elem(), s.elem(), g.elem(), u32(N), u32(C), u32(E), u32(e), a)
	}
}

// GateGrad writes column e of dgate (N,E): dout·y per row (N,C each) for the rows routed to e,
// 0 for the others.
func (d *Device) GateGrad(dgate, dout, y, mask model.Buf, e, N, C, E int) {
	expertIndex("GateGrad", e, E)
	dg, g := bf(dgate, N*E, false, "GateGrad dgate"), bf(dout, N*C, false, "GateGrad dout")
	yy, m := bf(y, N*C, false, "GateGrad y"), bf(mask, N*E, false, "GateGrad mask")
	defer d.mu.Unlock()
	if d.lock() && N > 0 {
		d.rows("gate_grad", N, []arg{out(dg), in(g), in(yy), in(m)}, dg.elem(), g.elem(), yy.elem(), m.elem(), u32(N), u32(C), u32(E), u32(e))
	}
}

// MoEStats writes stats (E+1): the assignment count of each expert, then the balancing loss.
func (d *Device) MoEStats(stats, mask, probs model.Buf, N, E, K int) {
	moeShape("MoEStats", N, E, K)
	s, m, p := bf(stats, E+1, false, "MoEStats stats"), bf(mask, N*E, false, "MoEStats mask"), bf(probs, N*E, false, "MoEStats probs")
	defer d.mu.Unlock()
	if d.lock() {
		d.dispatch("moe_stats", []arg{out(view(s, 0, E+1)), in(m), in(p)}, []uint32{s.elem(), m.elem(), p.elem(), u32(N), u32(E), u32(K)}, 1, 1, 1)
	}
}

// AuxGrad adds scale times the balancing loss's gradient, E·f_e/N with f_e = stats[e]/(N·K), to
// every row of dgate (N,E).
func (d *Device) AuxGrad(dgate, stats model.Buf, N, E, K int, scale float32) {
	moeShape("AuxGrad", N, E, K)
	g, s := bf(dgate, N*E, false, "AuxGrad dgate"), bf(stats, E, false, "AuxGrad stats")
	defer d.mu.Unlock()
	if d.lock() && N > 0 {
		d.flat("aux_grad", N*E, []arg{out(g), in(s)}, g.elem(), s.elem(), u32(N), u32(E), u32(K), f32(scale))
	}
}

// SoftmaxBackwardRows writes dx = p·(dp − Σ_e p·dp) for each row of p and dp (N,E).
func (d *Device) SoftmaxBackwardRows(dx, p, dp model.Buf, N, E int) {
	x, pp, g := bf(dx, N*E, false, "SoftmaxBackwardRows dx"), bf(p, N*E, false, "SoftmaxBackwardRows p"), bf(dp, N*E, false, "SoftmaxBackwardRows dp")
	defer d.mu.Unlock()
	if d.lock() && N > 0 && E > 0 {
		d.flat("softmax_backward_rows", N, []arg{out(x), in(pp), in(g)}, x.elem(), pp.elem(), g.elem(), u32(N), u32(E))
	}
}
