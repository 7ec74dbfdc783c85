package model

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"testing"
)

func TestWireJSON(t *testing.T) {
	w := Wire{Activations: Int8, Gradients: Int4}
	b, err := json.Marshal(w)
	if err != nil {
		t.Fatal(err)
	}
	if string(b) != `{"activations":"int8","gradients":"int4"}` {
		t.Errorf("marshal: %s", b)
	}
	var back Wire
	if err := json.Unmarshal(b, &back); err != nil || back != w {
		t.Errorf("unmarshal: %+v, %v", back, err)
	}
	for _, tt := range []struct{ name, in, wantIn string }{
		{"missing gradients", `{"activations":"f32"}`, `"gradients"`},
		{"unknown key", `{"activations":"f32","gradients":"f32","weights":"f32"}`, "weights"},
		{"unknown format", `{"activations":"fp8","gradients":"f32"}`, `"fp8"`},
		{"number", `{"activations":1,"gradients":"f32"}`, "activations"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			var w Wire
			err := json.Unmarshal([]byte(tt.in), &w)
			if err == nil || !strings.Contains(err.Error(), tt.wantIn) {
				t.Errorf("got %v, want an error naming %s", err, tt.wantIn)
			}
		})
	}
	if _, err := ParseFormat("F32"); !errors.Is(err, ErrFormat) {
		t.Errorf("ParseFormat is case-sensitive: %v", err)
	}
	if err := (Wire{Gradients: formatEnd}).Validate(); !errors.Is(err, ErrFormat) {
		t.Errorf("Validate of an out-of-range format: %v", err)
	}
}

func TestFormatBytes(t *testing.T) {
	// A row of C = 64: 256 bytes in float32, 128 in bfloat16, 64 codes and a 4-byte scale in int8,
	// 32 bytes of codes and two 2-byte scales in int4.
	for f, want := range map[Format]int{F32: 3 * 256, BF16: 3 * 128, Int8: 3 * 68, Int4: 3 * 36} {
		if got := f.Bytes(3, 64); got != want {
			t.Errorf("%v: %d bytes, want %d", f, got, want)
		}
	}
}

// TestWireSplitsEqualWhole: with boundaries in bfloat16, int8 or int4, the tiny model split at every
// block (every boundary crossing between stages, rounded by gpipe as a network would) and the
// device pipeline (stages and expert shards on farDevices, remote experts and a replicated one,
// rounded by routedExperts) train bit for bit as the whole model does, which rounds at the same
// boundaries in one process. And the formats do change the numbers.
func TestWireSplitsEqualWhole(t *testing.T) {
	cfg := TinyConfig()
	const B, M, steps, lr = 8, 2, 3, 1e-2
	text := testText(t, 4096)
	train := func(w Wire) (*Model, []StepResult) {
		m, err := NewModel(cfg)
		if err != nil {
			t.Fatal(err)
		}
		m.Init(9)
		m.SetWire(w)
		var rs []StepResult
		for s := 0; s < steps; s++ {
			x, y := windows(text[s*300:], B, cfg.BlockSize)
			r, err := m.TrainStep(x, y, B, Hyper{MicroBatches: M, LR: lr, WeightDecay: 0.1, Clip: 1})
			if err != nil {
				t.Fatal(err)
			}
			rs = append(rs, r)
		}
		return m, rs
	}
	_, plain := train(Wire{})
	for _, w := range []Wire{{Int8, Int8}, {BF16, BF16}, {Int8, F32}, {F32, Int8}, {Int4, Int4}, {Int4, Int8}} {
		t.Run(fmt.Sprintf("%v-%v", w.Activations, w.Gradients), func(t *testing.T) {
			whole, want := train(w)
			pl := newPipeline(t, cfg, 9, []int{1, 2, 3})
			for _, st := range pl.stages {
				st.Wire = w
				st.Experts.(*LocalExperts).Wire = w
			}
			far := newWirePipeline(t, cfg, 9, true, w)
			for s := 0; s < steps; s++ {
				x, y := windows(text[s*300:], B, cfg.BlockSize)
				ce, aux := pl.step(t, x, y, B, M, s, lr)
				fce, faux, fnorm, _ := far.step(t, x, y, B, M, s, lr)
				r := want[s]
				if ce != r.CE || aux != r.Aux {
					t.Fatalf("step %d: split at every block: ce %v aux %v, whole %v %v", s, ce, aux, r.CE, r.Aux)
				}
				if fce != r.CE || faux != r.Aux || fnorm != r.GradNorm {
					t.Fatalf("step %d: device pipeline: ce %v aux %v norm %v, whole %v %v %v", s, fce, faux, fnorm, r.CE, r.Aux, r.GradNorm)
				}
			}
			for _, sh := range far.all() {
				sh.Pull()
			}
			for _, tt := range whole.P.Tensors {
				requireSameFloats(t, "split "+tt.Name, pl.lookup(tt.Name), tt.Data)
				for _, sh := range far.all() {
					if got, ok := sh.P.Lookup(tt.Name); ok {
						requireSameFloats(t, "device "+tt.Name, got.Data, tt.Data)
					}
				}
			}
			// Quantising forward changes the first loss; quantising only gradients, the second.
			s := 0
			if w.Activations == F32 {
				s = 1
			}
			if want[s].CE == plain[s].CE {
				t.Errorf("step %d: the same loss %v as in float32: nothing was quantised", s, want[s].CE)
			}
			if d := math.Abs(want[s].CE-plain[s].CE) / plain[s].CE; d > 0.01 {
				t.Errorf("step %d: loss %v, %v in float32: quantisation moved it by %.2g", s, want[s].CE, plain[s].CE, d)
			}
		})
	}
}

// frozenExperts computes a block's experts in float32 with the rounding of their rows replaced by
// constant offsets: at the first call (the base point) it records round(x) − x of each expert's
// input and output rows, and afterwards adds those same offsets. Near the base point it computes
// what the quantised experts compute there, but smoothly — the surrogate whose true derivative is
// the straight-through one.
type frozenExperts struct {
	inner   *LocalExperts // float32 Wire
	f       Format
	C       int
	in, out [][]float32
}

func offsets(x []float32, f Format, C int) []float32 {
	r := append([]float32(nil), x...)
	f.Round(r, C)
	for i := range r {
		r[i] -= x[i]
	}
	return r
}

// shift adds d to x when they still match (a perturbation that moves a token to another expert
// changes the rows; fdCheck then reports the changed routing, the offsets do not matter).
func shift(x, d []float32) {
	if len(x) == len(d) {
		for i := range x {
			x[i] += d[i]
		}
	}
}

func (fe *frozenExperts) Forward(block, mb int, xs [][]float32, splits []int) ([][]float32, error) {
	rec := fe.in == nil
	if rec {
		fe.in, fe.out = make([][]float32, len(xs)), make([][]float32, len(xs))
	}
	for e := range xs {
		if rec {
			fe.in[e] = offsets(xs[e], fe.f, fe.C)
		}
		shift(xs[e], fe.in[e])
	}
	ys, err := fe.inner.Forward(block, mb, xs, splits)
	if err != nil {
		return nil, err
	}
	for e := range ys {
		if rec {
			fe.out[e] = offsets(ys[e], fe.f, fe.C)
		}
		shift(ys[e], fe.out[e])
	}
	return ys, nil
}

func (fe *frozenExperts) Backward(int, int, [][]float32, []int) ([][]float32, error) {
	return nil, errors.New("frozenExperts: forward only")
}

// TestWireStraightThrough checks the backward rule at quantised boundaries by finite differences.
// With activations in bfloat16 or int8 (and float32 gradients, so that only the forward rounds),
// the model's analytic gradient must be the derivative of the surrogate in which every boundary's
// rounding — between blocks, and on each expert's input and output rows — is a constant offset
// frozen at the base point: the straight-through rule, which passes the gradient through
// quantise∘dequantise as if it were the identity. The surrogate is the model's own blocks, one
// stage each, on the model's parameters, with the offsets added between them.
func TestWireStraightThrough(t *testing.T) {
	for _, f := range []Format{Int8, BF16, Int4} {
		t.Run(f.String(), func(t *testing.T) {
			cfg := Config{VocabSize: 32, BlockSize: 8, NLayer: 4, NHead: 2, NEmbd: 16, MLPRatio: 2,
				MoEEvery: 2, NExpert: 4, TopK: 2, AuxLossCoef: 0.1}
			m := perturbedModel(t, cfg, 5)
			for _, tt := range m.P.Tensors {
				for i := range tt.Data {
					tt.Data[i] *= 4 // gradients well above float32 noise, as in TestGradModel
				}
			}
			m.SetWire(Wire{Activations: f, Gradients: F32})
			r := rand.New(rand.NewPCG(5, 5))
			B, T, C := 3, cfg.BlockSize, cfg.NEmbd
			x, y := make([]int32, B*T), make([]int32, B*T)
			for i := range x {
				x[i], y[i] = int32(r.IntN(cfg.VocabSize)), int32(r.IntN(cfg.VocabSize))
			}
			if _, err := m.Gradients(x, y, B, 1); err != nil {
				t.Fatal(err)
			}
			var tensors []fdTensor
			for i, tt := range m.P.Tensors {
				tensors = append(tensors, fdTensor{tt.Name, tt.Data, m.G.Tensors[i].Data})
			}

			blocks := make([]*Stage, cfg.NLayer)
			for i := range blocks {
				var ex Experts
				if cfg.IsMoE(i) {
					var list []*Expert
					for e := 0; e < cfg.NExpert; e++ {
						list = append(list, m.Experts.Get(i, e))
					}
					ex = &frozenExperts{inner: NewLocalExperts(list...), f: f, C: C}
				}
				st, err := NewStage(cfg, i, i+1, m.P, m.G, ex) // forward only: G is not written
				if err != nil {
					t.Fatal(err)
				}
				blocks[i] = st
			}
			between := make([][]float32, cfg.NLayer) // the offset entering block i
			fdCheck(t, tensors, func() (float64, string) {
				in := StageInput{B: B, T: T, Tokens: x}
				var l float64
				var route string
				for i, st := range blocks {
					if st.Last() {
						in.Targets = y
					}
					out, err := st.Forward(0, in)
					if err != nil {
						t.Fatal(err)
					}
					for _, a := range out.Aux {
						l += cfg.AuxLossCoef * a
					}
					if st.blocks[0].moe {
						route += fmt.Sprint(st.acts[0].blocks[0].moe.idx)
					}
					if st.Last() {
						l += out.CE
					} else {
						next := append([]float32(nil), out.X...)
						if between[i+1] == nil {
							between[i+1] = offsets(next, f, C)
						}
						shift(next, between[i+1])
						in = StageInput{B: B, T: T, X: next}
					}
					st.Release(0)
				}
				for _, st := range blocks {
					if fe, ok := st.Experts.(*frozenExperts); ok {
						fe.inner.Reset()
					}
				}
				return l, route
			}, 2e-3)
		})
	}
}
