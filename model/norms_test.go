package model

import (
	"math/rand/v2"
	"testing"
)

// summingHost is Host with device-side squared norms, summed in the same order as SquaredNorms:
// GradSquaredNorms must then give SquaredNorms' numbers under the gradients' own names.
type summingHost struct {
	Host
	calls int
}

func (h *summingHost) SquaredNorms(bufs []Buf) []float64 {
	h.calls++
	out := make([]float64, len(bufs))
	for i, b := range bufs {
		for _, v := range hf(b) {
			out[i] += float64(v) * float64(v)
		}
	}
	return out
}

func (h *summingHost) SquaredNormsWith(bufs []Buf, also Buf, alsoDst []float32) []float64 {
	if also != nil {
		copy(alsoDst, hf(also))
	}
	return h.SquaredNorms(bufs)
}

func TestGradSquaredNormsOnANormDevice(t *testing.T) {
	cfg := TinyConfig()
	dev := &summingHost{}
	sh, err := NewStageShardOn(dev, cfg, 1, 3, nil)
	if err != nil {
		t.Fatal(err)
	}
	r := rand.New(rand.NewPCG(1, 2))
	for _, g := range sh.G.Tensors {
		for i := range g.Data {
			g.Data[i] = float32(r.NormFloat64())
		}
	}
	got, want := sh.GradSquaredNorms(), SquaredNorms(sh.G)
	if dev.calls != 1 || len(got) != len(want) {
		t.Fatalf("%d device calls, %d norms; want 1 call, %d norms", dev.calls, len(got), len(want))
	}
	for name, w := range want {
		if got[name] != w {
			t.Errorf("%s: %v on the device, %v on the host", name, got[name], w)
		}
	}
}
