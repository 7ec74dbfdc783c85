package proto

import (
	"math"
	"strings"
	"testing"
)

func TestStepTotals(t *testing.T) {
	// Two stages and an expert replicated on two hosts; the reports arrive in any order.
	first := &StepReport{GradSq: map[string]float64{"wte": 4, "h.0.attn": 1}, Aux: []BlockAux{{Block: 1, Aux: []float64{0.5, 0.25}}}}
	last := &StepReport{GradSq: map[string]float64{"lm_head": 2}, CE: []float64{3, 5}, Aux: []BlockAux{{Block: 0, Aux: []float64{0.125, 0.375}}}}
	hostA := &StepReport{GradSq: map[string]float64{"h.1.experts.0": 9}}
	hostB := &StepReport{GradSq: map[string]float64{"h.1.experts.0": 9}}
	ce, aux, norm, err := StepTotals([]*StepReport{hostB, last, first, hostA}, 2)
	if err != nil {
		t.Fatal(err)
	}
	// The replicated expert counts once; the sum is taken in name (byte) order: h.0.attn,
	// h.1.experts.0, lm_head, wte.
	wantNorm := math.Sqrt(((1.0 + 9) + 2) + 4)
	if got, want := ce, (3.0+5.0)/2; got != want {
		t.Errorf("ce = %v, want %v", got, want)
	}
	// Per micro-batch, blocks in block order: (0.125 + 0.5) + (0.375 + 0.25).
	if got, want := aux, ((0.125+0.5)+0.375+0.25)/2; got != want {
		t.Errorf("aux = %v, want %v", got, want)
	}
	if norm != wantNorm {
		t.Errorf("norm = %v, want %v", norm, wantNorm)
	}

	for _, tc := range []struct {
		name    string
		reports []*StepReport
		M       int
		want    string
	}{
		{"two shards with CE", []*StepReport{{CE: []float64{1}}, {CE: []float64{2}}}, 1, "two shards report cross-entropy"},
		{"no CE", []*StepReport{{GradSq: map[string]float64{"w": 1}}}, 1, "cross-entropy of 0 micro-batches, want 1"},
		{"short aux", []*StepReport{{CE: []float64{1, 2}, Aux: []BlockAux{{Block: 3, Aux: []float64{1}}}}}, 2, "block 3: aux of 1 micro-batches, want 2"},
		{"diverged replicas", []*StepReport{{CE: []float64{1}, GradSq: map[string]float64{"w": 1}}, {GradSq: map[string]float64{"w": 2}}}, 1, "replicas diverged"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, _, _, err := StepTotals(tc.reports, tc.M)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("err = %v, want one saying %q", err, tc.want)
			}
		})
	}
}

func TestTokenTensorsKeys(t *testing.T) {
	st := StepSpec{Step: EvalStep(7), PlanVersion: 3, MicroBatches: 2, Rows: 2}
	x, y, err := TokenTensors(st, 1, 3, []int32{1, 2, 3, 4, 5, 6}, []int32{2, 3, 4, 5, 6, 7})
	if err != nil {
		t.Fatal(err)
	}
	if got, want := x.Key, TokensKey(st, 1); got != want {
		t.Errorf("tokens key = %+v, want %+v", got, want)
	}
	if got, want := y.Key, TargetsKey(st, 1); got != want {
		t.Errorf("targets key = %+v, want %+v", got, want)
	}
	if x.Key.Kind != KindTokens || y.Key.Kind != KindTargets || x.Key.Step != 7|1<<63 || x.Key.Block != NoBlock || x.Key.Expert != NoExpert {
		t.Errorf("keys %+v, %+v", x.Key, y.Key)
	}
	if got, want := x.Shape, (Shape{2, 3, 1, 1}); got != want {
		t.Errorf("shape = %v, want %v", got, want)
	}
}
