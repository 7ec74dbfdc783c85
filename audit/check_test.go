package audit

import (
	"maps"
	"math"
	"slices"
	"strings"
	"testing"

	"github.com/shoal-ml/shoal/kernels"
	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/proto"
	"github.com/shoal-ml/shoal/safetensors"
)

// commitOf is the commitment an honest worker made to b.
func commitOf(b *Bundle) (*proto.Commit, string) {
	return NewCommit(StateDigest(b.StateIn), b.Recv, b.Sent), StateDigest(b.StateOut)
}

// cloneBundle copies b deeply, so that a case can change one bit of it.
func cloneBundle(b *Bundle) *Bundle {
	c := *b
	state := func(ts []safetensors.Tensor) []safetensors.Tensor {
		out := make([]safetensors.Tensor, len(ts))
		for i, t := range ts {
			out[i] = safetensors.Tensor{Name: t.Name, Shape: slices.Clone(t.Shape), Data: slices.Clone(t.Data)}
		}
		return out
	}
	c.StateIn, c.StateOut = state(b.StateIn), state(b.StateOut)
	c.Recv = make([]proto.Tensor, len(b.Recv))
	for i, t := range b.Recv {
		t.Data = slices.Clone(t.Data)
		c.Recv[i] = t
	}
	c.Sent = make([]Sent, len(b.Sent))
	for i, s := range b.Sent {
		s.T.Data = slices.Clone(s.T.Data)
		c.Sent[i] = s
	}
	return &c
}

func TestCheck(t *testing.T) {
	honest := testBundle()
	commit, next := commitOf(honest)
	if err := commit.Validate(); err != nil {
		t.Fatalf("the commitment of an honest bundle does not validate: %v", err)
	}
	if err := Check(honest, 7, 3, commit, next, false, 0); err != nil {
		t.Fatalf("honest bundle: %v", err)
	}
	if err := Check(honest, 7, 3, commit, next, true, 0); err != nil {
		t.Fatalf("honest bundle, whole where lean was asked: %v", err)
	}
	if err := Check(leanOf(honest), 7, 3, commit, next, true, 0); err != nil {
		t.Fatalf("honest lean bundle: %v", err)
	}
	// Lean evidence is taken only where the audit asked for it: the coordinator asks only when
	// it recomputes bit for bit, and across kernel families it needs the end state.
	if err := Check(leanOf(honest), 7, 3, commit, next, false, 0); err == nil || !strings.Contains(err.Error(), "lean") {
		t.Fatalf("lean bundle where all was asked: err = %v", err)
	}
	tests := []struct {
		name   string
		change func(b *Bundle)
		want   string
	}{
		{"another step", func(b *Bundle) { b.Step++ }, "asked for step"},
		{"another plan", func(b *Bundle) { b.PlanVersion++ }, "asked for step"},
		{"start state", func(b *Bundle) { b.StateIn[1].Data[5] = math.Nextafter32(b.StateIn[1].Data[5], 1) }, "start state"},
		{"start state renamed", func(b *Bundle) { b.StateIn[0].Name += "x" }, "start state"},
		{"end state", func(b *Bundle) { b.StateOut[0].Data[0] = 0 }, "end state"},
		{"received tensor", func(b *Bundle) { b.Recv[1].Data[0] ^= 1 }, "received tensor"},
		{"received tensor moved", func(b *Bundle) { b.Recv[1].Key.MicroBatch = 1 }, "received tensor"},
		{"received tensor withheld", func(b *Bundle) { b.Recv = b.Recv[:1] }, "missing"},
		{"received tensor twice", func(b *Bundle) { b.Recv = append(b.Recv, b.Recv[0]) }, "received tensor"},
		{"sent tensor", func(b *Bundle) { b.Sent[0].T.Data[3] ^= 0x80 }, "sent tensor"},
		{"sent elsewhere", func(b *Bundle) { b.Sent[0].To = "w-other" }, "sent tensor"},
		{"sent tensor reshaped", func(b *Bundle) { b.Sent[0].T.Shape = proto.Shape{4, 1, 1, 1} }, "sent tensor"},
		{"sent tensor withheld", func(b *Bundle) { b.Sent = b.Sent[1:] }, "missing"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b := cloneBundle(honest)
			tt.change(b)
			err := Check(b, 7, 3, commit, next, false, 0)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("err = %v, want one about %q", err, tt.want)
			}
			// What a lean bundle still carries is bound the same way.
			if lb := leanOf(b); len(b.StateOut) == len(honest.StateOut) && len(b.Sent) == len(honest.Sent) && !strings.Contains(tt.name, "end state") && !strings.HasPrefix(tt.name, "sent") {
				if err := Check(lb, 7, 3, commit, next, true, 0); err == nil || !strings.Contains(err.Error(), tt.want) {
					t.Fatalf("lean: err = %v, want one about %q", err, tt.want)
				}
			}
		})
	}
}

// leanOf is b as a lean bundle (proto.Audit.Lean): without its end state and what it sent.
func leanOf(b *Bundle) *Bundle {
	c := cloneBundle(b)
	c.Lean, c.StateOut, c.Sent = true, nil, nil
	return c
}

// outcomeOf is what a recomputation that agrees with b and rep would return.
func outcomeOf(b *Bundle, rep *proto.StepReport) *Outcome {
	c := cloneBundle(b)
	r := *rep
	r.CE, r.GradSq = slices.Clone(rep.CE), maps.Clone(rep.GradSq)
	r.Aux = nil
	for _, a := range rep.Aux {
		r.Aux = append(r.Aux, proto.BlockAux{Block: a.Block, Aux: slices.Clone(a.Aux)})
	}
	return &Outcome{Sent: c.Sent, Report: &r, StateOut: c.StateOut, Update: testUpdate}
}

// testUpdate is the AdamW step of adamBundle.
var testUpdate = Update{T: 8, LR: 1e-2, WeightDecay: 0.1}

// adamBundle is testBundle with a state that a genuine AdamW step moved: a weight matrix and a
// bias with both moments, the end state computed as kernels.AdamW does from a gradient.
func adamBundle() *Bundle {
	b := testBundle()
	var in, out []safetensors.Tensor
	for _, p := range []struct {
		name  string
		shape []int
	}{{"transformer.h.0.attn.c_attn.weight", []int{2, 3}}, {"transformer.h.0.ln_1.bias", []int{6}}} {
		w, m, v, g := make([]float32, 6), make([]float32, 6), make([]float32, 6), make([]float32, 6)
		for i := range w {
			w[i] = float32(i)*0.1 - 0.2
			m[i] = float32(i%3) * 1e-3
			v[i] = float32(i+1) * 1e-6
			g[i] = float32(i)*0.01 - 0.02
		}
		w2, m2, v2 := slices.Clone(w), slices.Clone(m), slices.Clone(v)
		decay, stepSize, sqrtBC2 := model.AdamWFactors(p.shape, testUpdate.T, testUpdate.LR, testUpdate.WeightDecay)
		kernels.AdamW(w2, g, m2, v2, decay, stepSize, sqrtBC2, 1)
		in = append(in, safetensors.Tensor{Name: p.name, Shape: p.shape, Data: w},
			safetensors.Tensor{Name: "optim.m." + p.name, Shape: p.shape, Data: m},
			safetensors.Tensor{Name: "optim.v." + p.name, Shape: p.shape, Data: v})
		out = append(out, safetensors.Tensor{Name: p.name, Shape: p.shape, Data: w2},
			safetensors.Tensor{Name: "optim.m." + p.name, Shape: p.shape, Data: m2},
			safetensors.Tensor{Name: "optim.v." + p.name, Shape: p.shape, Data: v2})
	}
	b.StateIn, b.StateOut = in, out
	return b
}

// TestCompareUpdate: across backends, a worker's end state must follow from its own moments by
// the AdamW step, and its moments must be the recomputation's within TolMoment.
func TestCompareUpdate(t *testing.T) {
	rep := &proto.StepReport{Step: 7, PlanVersion: 3, CE: []float64{2.5}, GradSq: map[string]float64{"w": 1}}
	tests := []struct {
		name   string
		worker func(b *Bundle) // what the worker did otherwise
		pass   bool
	}{
		{"honest", func(*Bundle) {}, true},
		// A GPU's rounding of the update's last line: within TolApply.
		{"one ulp off in a parameter", func(b *Bundle) { b.StateOut[0].Data[1] = math.Nextafter32(b.StateOut[0].Data[1], 10) }, true},
		{"stale weights", func(b *Bundle) {
			for i := range b.StateOut {
				b.StateOut[i].Data = slices.Clone(b.StateIn[i].Data)
			}
		}, false},
		{"parameters moved but moments kept", func(b *Bundle) {
			for i := range b.StateOut {
				if strings.HasPrefix(b.StateOut[i].Name, "optim.") {
					b.StateOut[i].Data = slices.Clone(b.StateIn[i].Data)
				}
			}
		}, false},
		{"the update ×1.01", func(b *Bundle) {
			for j, x := range b.StateOut[3].Data {
				b.StateOut[3].Data[j] = b.StateIn[3].Data[j] + 1.01*(x-b.StateIn[3].Data[j])
			}
		}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			honest := adamBundle()
			o := outcomeOf(honest, rep)
			b := cloneBundle(honest)
			tt.worker(b)
			if got := Compare(o, b, rep, "", false); (got == "") != tt.pass {
				t.Errorf("within tolerance: %q, want a pass: %v", got, tt.pass)
			}
		})
	}
	// A parameter near 1 whose update is tiny (warm-up): two ulps of it off — a GPU's fused
	// last line — pass, though they are a visible share of the update; the update ×1.01 does not.
	for _, c := range []struct {
		name string
		got  func(want, in float32) float32
		pass bool
	}{
		{"two ulps", func(w, _ float32) float32 { return math.Nextafter32(math.Nextafter32(w, 10), 10) }, true},
		{"update ×1.01", func(w, in float32) float32 { return in + 1.01*(w-in) }, false},
		{"update ×1.5", func(w, in float32) float32 { return in + 1.5*(w-in) }, false},
	} {
		in, want, got := make([]float32, 64), make([]float32, 64), make([]float32, 64)
		for i := range in {
			in[i] = 1 + float32(i)/64
			want[i] = in[i] - 3e-5*float32(1+i%3) // warm-up steps: 250–750 ulps of the parameter
			got[i] = c.got(want[i], in[i])
		}
		if d, ok := applyOff(got, want, in); ok != c.pass {
			t.Errorf("%s: off by %.3g of the update, pass %v, want %v", c.name, d, ok, c.pass)
		}
	}
	// A moment 1e-6 off (the last bits of a gradient on another backend) passes; 1% does not.
	for _, f := range []struct {
		scale float32
		pass  bool
	}{{1 + 1e-6, true}, {1.01, false}} {
		honest := adamBundle()
		o := outcomeOf(honest, rep)
		for j := range o.StateOut[1].Data {
			o.StateOut[1].Data[j] *= f.scale
		}
		if got := Compare(o, honest, rep, "", false); (got == "") != f.pass {
			t.Errorf("moment ×%v: %q, want a pass: %v", f.scale, got, f.pass)
		}
	}
}

func TestCompare(t *testing.T) {
	b := adamBundle()
	rep := &proto.StepReport{Step: 7, PlanVersion: 3, CE: []float64{2.5, 2.25},
		Aux:    []proto.BlockAux{{Block: 1, Aux: []float64{1.01, 1.02}}},
		GradSq: map[string]float64{"transformer.h.0.attn.c_attn.weight": 0.75, "transformer.h.0.ln_1.weight": 0.25}}
	// The worker's commitment, for the lean comparison: bit for bit, with only the digests of
	// what the worker sent and reached, it must judge every case as the whole evidence does.
	var next string
	rep.Commit, next = commitOf(b)
	tests := []struct {
		name string
		// change alters the recomputation (o) away from what the worker reported and kept.
		change       func(o *Outcome)
		exact, close bool // whether the worker passes an exact and a tolerant comparison
	}{
		{"same", func(o *Outcome) {}, true, true},
		{"one ulp in a sent activation", func(o *Outcome) { o.Sent[0].T.Data[0] ^= 1 }, false, true},
		{"a sent activation 1% off", func(o *Outcome) {
			x, _ := proto.Float32s(o.Sent[0].T.Data)
			for i := range x {
				x[i] *= 1.01
			}
			o.Sent[0].T.Data = proto.AppendFloat32s(nil, x)
		}, false, false},
		{"other values sent", func(o *Outcome) {
			o.Sent[0].T.Data = proto.AppendFloat32s(nil, []float32{1, 2, 3, 5})
		}, false, false},
		{"a tensor not sent", func(o *Outcome) { o.Sent = o.Sent[:1] }, false, false},
		{"sent to another", func(o *Outcome) { o.Sent[1].To = "w-else" }, false, false},
		{"loss 1e-6 off", func(o *Outcome) { o.Report.CE[1] *= 1 + 1e-6 }, false, true},
		{"loss ×0.9", func(o *Outcome) { o.Report.CE[0] /= 0.9 }, false, false},
		{"aux ×0.9", func(o *Outcome) { o.Report.Aux[0].Aux[1] /= 0.9 }, false, false},
		{"‖g‖² 1e-6 off", func(o *Outcome) { o.Report.GradSq["transformer.h.0.ln_1.weight"] *= 1 + 1e-6 }, false, true},
		// scale-grad: every gradient ×(1+1e-3) is every ‖g‖² ×(1+1e-3)², 2e-3 over TolNorm.
		{"‖g‖² of gradients ×(1+1e-3)", func(o *Outcome) {
			for n, v := range o.Report.GradSq {
				o.Report.GradSq[n] = v / ((1 + 1e-3) * (1 + 1e-3))
			}
		}, false, false},
		// Compare's doc: a 1e-3 scaled ‖g‖² fails both.
		{"‖g‖² ×(1+1e-3)", func(o *Outcome) {
			for n, v := range o.Report.GradSq {
				o.Report.GradSq[n] = v / (1 + 2e-3)
			}
		}, false, false},
		{"‖g‖² of one tensor ×1.5", func(o *Outcome) { o.Report.GradSq["transformer.h.0.attn.c_attn.weight"] /= 1.5 }, false, false},
		{"end state 1 ulp off", func(o *Outcome) {
			o.StateOut[1].Data[2] = math.Nextafter32(o.StateOut[1].Data[2], 10)
		}, false, true},
		{"the update the other way", func(o *Outcome) {
			// The recomputation moved the other way from the start state than the worker did.
			for i := range o.StateOut {
				for j := range o.StateOut[i].Data {
					o.StateOut[i].Data[j] = b.StateIn[i].Data[j]*2 - b.StateOut[i].Data[j]
				}
			}
		}, false, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			o := outcomeOf(b, rep)
			tt.change(o)
			if got := Compare(o, b, rep, next, true); (got == "") != tt.exact {
				t.Errorf("exact: %q, want a pass: %v", got, tt.exact)
			}
			if got := Compare(o, b, rep, next, false); (got == "") != tt.close {
				t.Errorf("within tolerance: %q, want a pass: %v", got, tt.close)
			}
			if got := Compare(o, leanOf(b), rep, next, true); (got == "") != tt.exact {
				t.Errorf("lean: %q, want a pass: %v", got, tt.exact)
			}
			if got := Compare(o, leanOf(b), rep, next, false); got == "" {
				t.Errorf("lean evidence judged within tolerance: passed")
			}
		})
	}
}

// TestCompareMoved: the neighbour of a stage taken over sent the lost stage some tensors before it
// left, and all of them to the taker; its recomputation sends them to the taker only
// (Outcome.Moved). Each tensor committed to the lost stage must be one committed to the taker,
// bit for bit; then the step passes, lean or whole.
func TestCompareMoved(t *testing.T) {
	base := adamBundle()
	rep := &proto.StepReport{Step: 7, PlanVersion: 3, CE: []float64{2.5, 2.25},
		Aux:    []proto.BlockAux{{Block: 1, Aux: []float64{1.01, 1.02}}},
		GradSq: map[string]float64{"transformer.h.0.attn.c_attn.weight": 0.75, "transformer.h.0.ln_1.weight": 0.25}}
	taker := base.Sent[0].To
	for _, tc := range []struct {
		name  string
		moved bool
		lost  func(s Sent) Sent // the copy the worker sent the lost stage, of the taker's
		pass  bool
	}{
		{"the same tensor", true, func(s Sent) Sent { return s }, true},
		{"without the takeover", false, func(s Sent) Sent { return s }, false},
		{"other bits to the lost stage", true, func(s Sent) Sent {
			s.T.Data = slices.Clone(s.T.Data)
			s.T.Data[0] ^= 1
			return s
		}, false},
		{"a tensor the taker never got", true, func(s Sent) Sent {
			s.T.Key.MicroBatch += 100
			return s
		}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			o := outcomeOf(base, rep) // the recomputation: to the taker only
			b := cloneBundle(base)
			l := tc.lost(b.Sent[0])
			l.To = "w-lost"
			b.Sent = append(b.Sent, l)
			r := *rep
			var next string
			r.Commit, next = commitOf(b)
			if tc.moved {
				o.Moved = map[string]string{"w-lost": taker}
			}
			for _, c := range []struct {
				name string
				b    *Bundle
			}{{"whole", b}, {"lean", leanOf(b)}} {
				if got := Compare(o, c.b, &r, next, true); (got == "") != tc.pass {
					t.Errorf("%s: %q, want a pass: %v", c.name, got, tc.pass)
				}
			}
		})
	}
}
