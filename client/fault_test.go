package client

import (
	"bytes"
	"math"
	"math/bits"
	"slices"
	"strings"
	"testing"

	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/proto"
)

func TestCheckFault(t *testing.T) {
	for _, k := range append(FaultKinds(), "") {
		if err := CheckFault(k); err != nil {
			t.Errorf("CheckFault(%q): %v", k, err)
		}
		if k != "" && faultDoes(k) == "" {
			t.Errorf("%s: nothing says what it does", k)
		}
	}
	err := CheckFault("Flip-Bit")
	if err == nil {
		t.Fatal("an unknown kind was taken")
	}
	for _, k := range FaultKinds() {
		if !strings.Contains(err.Error(), k) {
			t.Errorf("the error %q does not list %s", err, k)
		}
	}
	if f, err := newFault(""); f != nil || err != nil {
		t.Errorf(`newFault(""): %v, %v; want an honest worker`, f, err)
	}
	if c, err := newConduct(""); c != (honest{}) || err != nil {
		t.Errorf(`newConduct(""): %v, %v; want the honest conduct`, c, err)
	}
}

func floatTensor(kind proto.Kind, mb uint32, x ...float32) proto.Tensor {
	sh, _ := proto.ShapeOf(len(x))
	return proto.Tensor{Key: proto.TensorKey{Kind: kind, PlanVersion: 1, MicroBatch: mb, Block: 1, Expert: proto.NoExpert},
		DType: proto.F32, Shape: sh, Data: proto.AppendFloat32s(nil, x)}
}

func bitsApart(a, b []byte) int {
	n := 0
	for i := range a {
		n += bits.OnesCount8(a[i] ^ b[i])
	}
	return n
}

// TestFaultSend: what each kind does to the tensors of a step — and that it never writes into
// the runner's payload.
func TestFaultSend(t *testing.T) {
	empty := floatTensor(proto.KindExpertOut, 0)
	act := floatTensor(proto.KindActivation, 0, 1.5, -2, 0, float32(math.MaxFloat32))
	act2 := floatTensor(proto.KindActivation, 1, 3, 4)
	tokens := proto.Tensor{Key: proto.TensorKey{Kind: proto.KindTokens}, DType: proto.I32, Shape: proto.Shape{2, 1, 1, 1},
		Data: proto.AppendInt32s(nil, []int32{7, 9})}
	orig := [][]byte{bytes.Clone(act.Data), bytes.Clone(act2.Data)}

	t.Run("flip-bit", func(t *testing.T) {
		f, _ := newFault(FaultFlipBit)
		for step := range 2 {
			f.begin()
			if got := f.send(empty); len(got.Data) != 0 {
				t.Fatal("an empty tensor grew")
			}
			got := f.send(act)
			if n := bitsApart(got.Data, orig[0]); n != 1 || got.Data[0] == orig[0][0] {
				t.Fatalf("step %d: %d bits flipped, want the lowest bit of the first value", step, n)
			}
			x, _ := proto.Float32s(got.Data)
			if math.IsInf(float64(x[0]), 0) || math.IsNaN(float64(x[0])) || x[0] == 1.5 {
				t.Fatalf("flipped to %v", x[0])
			}
			if got := f.send(act2); !bytes.Equal(got.Data, orig[1]) {
				t.Fatalf("step %d: a second tensor changed", step)
			}
		}
	})
	t.Run("zero-act", func(t *testing.T) {
		f, _ := newFault(FaultZeroAct)
		f.begin()
		if got := f.send(act); !bytes.Equal(got.Data, make([]byte, len(orig[0]))) {
			t.Fatal("not zeros")
		}
		if got := f.send(tokens); !bytes.Equal(got.Data, tokens.Data) {
			t.Fatal("int32 tensor changed")
		}
	})
	t.Run("replay", func(t *testing.T) {
		f, _ := newFault(FaultReplay)
		// A failed first step is not the one replayed.
		f.begin()
		f.send(floatTensor(proto.KindActivation, 0, 9, 9, 9, 9))
		f.stepDone(nil, false)
		f.begin()
		f.send(act)
		f.send(empty)
		first := &proto.StepReport{CE: []float64{2}, GradSq: map[string]float64{"w": 1}, Aux: []proto.BlockAux{{Block: 1, Aux: []float64{1}}}}
		f.stepDone(first, true)
		if first.CE[0] != 2 || first.GradSq["w"] != 1 {
			t.Fatal("the first step's report changed")
		}
		f.begin()
		later := floatTensor(proto.KindActivation, 0, 5, 6, 7, 8)
		later.Key.Step = 3
		got := f.send(later)
		if !bytes.Equal(got.Data, orig[0]) || got.Key != later.Key {
			t.Fatal("want the first step's payload under the current key")
		}
		grown := floatTensor(proto.KindExpertOut, 0, 1, 2)
		if got := f.send(grown); !bytes.Equal(got.Data, grown.Data) {
			t.Fatal("a payload of another size was replayed")
		}
		rep := &proto.StepReport{CE: []float64{1}, GradSq: map[string]float64{"w": 4}, Aux: []proto.BlockAux{{Block: 1, Aux: []float64{3}}}}
		f.stepDone(rep, true)
		if rep.CE[0] != 2 || rep.GradSq["w"] != 1 || rep.Aux[0].Aux[0] != 1 {
			t.Fatalf("report %+v, want the first step's numbers", rep)
		}
	})
	for i, o := range orig {
		if !bytes.Equal([]byte(o), [][]byte{act.Data, act2.Data}[i]) {
			t.Fatal("a fault wrote into the runner's payload")
		}
	}
}

// TestFaultReport: what the reporting kinds do to a step's report, and to its update.
func TestFaultReport(t *testing.T) {
	report := func() *proto.StepReport {
		return &proto.StepReport{CE: []float64{2, 3}, GradSq: map[string]float64{"a": 2, "b": 4, "c": 4},
			Aux: []proto.BlockAux{{Block: 1, Aux: []float64{1, 1.5}}}}
	}
	g := float64(gradScale) // at run time, rounding as the fault does: a constant expression would not
	tests := []struct {
		kind string
		want *proto.StepReport
		clip float32 // of a clip factor 0.5
	}{
		{FaultScaleGrad, &proto.StepReport{CE: []float64{2, 3}, GradSq: map[string]float64{"a": 2 * g * g, "b": 4 * g * g, "c": 4 * g * g},
			Aux: []proto.BlockAux{{Block: 1, Aux: []float64{1, 1.5}}}}, 0.5 * gradScale},
		{FaultFalseNorm, &proto.StepReport{CE: []float64{2, 3}, GradSq: map[string]float64{"a": 2, "b": 6, "c": 4},
			Aux: []proto.BlockAux{{Block: 1, Aux: []float64{1, 1.5}}}}, 0.5},
		{FaultFalseLoss, &proto.StepReport{CE: []float64{2 * 0.9, 3 * 0.9}, GradSq: map[string]float64{"a": 2, "b": 4, "c": 4},
			Aux: []proto.BlockAux{{Block: 1, Aux: []float64{0.9, 1.5 * 0.9}}}}, 0.5},
		{FaultStaleWeights, report(), 0.5},
		{FaultFlipBit, report(), 0.5},
	}
	for _, tt := range tests {
		t.Run(tt.kind, func(t *testing.T) {
			f, _ := newFault(tt.kind)
			f.begin()
			rep := report()
			f.stepDone(rep, true)
			if !sameReport(rep, tt.want) {
				t.Errorf("report %+v, want %+v", rep, tt.want)
			}
			if got := f.clip(0.5); got != tt.clip {
				t.Errorf("clip factor %v, want %v", got, tt.clip)
			}
		})
	}
}

func sameReport(a, b *proto.StepReport) bool {
	if len(a.CE) != len(b.CE) || len(a.GradSq) != len(b.GradSq) || len(a.Aux) != len(b.Aux) {
		return false
	}
	for i := range a.CE {
		if a.CE[i] != b.CE[i] {
			return false
		}
	}
	for n, v := range a.GradSq {
		if b.GradSq[n] != v {
			return false
		}
	}
	for i := range a.Aux {
		for j := range a.Aux[i].Aux {
			if a.Aux[i].Aux[j] != b.Aux[i].Aux[j] {
				return false
			}
		}
	}
	return true
}

// TestFaultRareCheatOnce: rare-cheat changes no clip factor until an audit request arrives, then
// exactly one — the next — and never another.
func TestFaultRareCheatOnce(t *testing.T) {
	f, err := newFault(FaultRareCheat)
	if err != nil {
		t.Fatal(err)
	}
	if c := f.clip(0.5); c != 0.5 {
		t.Fatalf("before any audit request: clip %v, want 0.5", c)
	}
	f.audited(&proto.Audit{Unapplied: true}) // of a step not applied yet: no window opened
	if c := f.clip(0.5); c != 0.5 {
		t.Fatalf("after an audit request of an unapplied step: clip %v, want 0.5", c)
	}
	f.audited(&proto.Audit{})
	if c := f.clip(0.5); c != 0.5*rareCheatClip {
		t.Fatalf("the update after an audit request: clip %v, want %v", c, 0.5*rareCheatClip)
	}
	f.audited(&proto.Audit{})
	for range 3 {
		if c := f.clip(0.5); c != 0.5 {
			t.Fatalf("after its one cheat: clip %v, want 0.5", c)
		}
	}
}

// TestFaultPoisonStart: poison-start scales the shard's parameters ×3 and leaves its moments; the
// honest conduct and another kind's change nothing.
func TestFaultPoisonStart(t *testing.T) {
	sh, err := model.NewStageShard(model.TinyConfig(), 0, 2, nil)
	if err != nil {
		t.Fatal(err)
	}
	sh.Init(1)
	sh.Opt.M.Tensors[0].Data[0] = 0.25
	want := slices.Clone(sh.P.Slab)
	honest{}.started(sh)
	other, _ := newFault(FaultFlipBit)
	other.started(sh)
	if !slices.Equal(sh.P.Slab, want) {
		t.Fatal("an honest worker's shard changed")
	}
	f, _ := newFault(FaultPoisonStart)
	f.started(sh)
	for i, v := range sh.P.Slab {
		if v != poisonFactor*want[i] {
			t.Fatalf("parameter %d: %v, want %v", i, v, poisonFactor*want[i])
		}
	}
	if sh.Opt.M.Tensors[0].Data[0] != 0.25 {
		t.Error("the moments changed")
	}
}
