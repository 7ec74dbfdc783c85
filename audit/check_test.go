package audit

import (
	"maps"
	"math"
	"slices"
	"strings"
	"testing"

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
	if err := Check(honest, 7, 3, commit, next); err != nil {
		t.Fatalf("honest bundle: %v", err)
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
			err := Check(b, 7, 3, commit, next)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("err = %v, want one about %q", err, tt.want)
			}
		})
	}
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
	return &Outcome{Sent: c.Sent, Report: &r, StateOut: c.StateOut}
}

func TestCompare(t *testing.T) {
	b := testBundle()
	rep := &proto.StepReport{Step: 7, PlanVersion: 3, CE: []float64{2.5, 2.25},
		Aux:    []proto.BlockAux{{Block: 1, Aux: []float64{1.01, 1.02}}},
		GradSq: map[string]float64{"transformer.h.0.attn.c_attn.weight": 0.75, "transformer.h.0.ln_1.weight": 0.25}}
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
			o.StateOut[0].Data[2] = math.Nextafter32(o.StateOut[0].Data[2], 10)
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
			if got := Compare(o, b, rep, true); (got == "") != tt.exact {
				t.Errorf("exact: %q, want a pass: %v", got, tt.exact)
			}
			if got := Compare(o, b, rep, false); (got == "") != tt.close {
				t.Errorf("within tolerance: %q, want a pass: %v", got, tt.close)
			}
		})
	}
}
