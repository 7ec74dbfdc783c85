//go:build !js

package client

import (
	"context"
	"math"
	"testing"
	"time"

	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/proto"
)

// TestOuterParts: what a replica sends at an outer step with int8 — full chunks and the short
// last one, codes and scales — decodes on the other side to exactly the values the sender's
// outer step uses, and what does not have the expected dtype, shape or length is refused.
func TestOuterParts(t *testing.T) {
	const n = 2*model.OuterChunk + 37
	g, r := make([]float32, n), make([]float32, n)
	for i := range g {
		g[i] = float32(math.Sin(float64(i)))
		r[i] = g[i] - float32(math.Cos(float64(i)))*1e-3
	}
	x, e := make([]float32, n), make([]float32, n)
	parts := int8Parts(g, r, x, e)
	m := &proto.OuterSync{Step: 7, PlanVersion: 2, Participants: []int{0, 1}}
	rt := reduceTensor{name: "w", global: 3, size: n}
	send := func(ts []proto.Tensor) Transport {
		net := NewMemNetwork()
		t.Cleanup(net.Close)
		for _, pt := range ts {
			if err := net.Peer("a").Send(context.Background(), "b", pt); err != nil {
				t.Fatal(err)
			}
		}
		return net.Peer("b")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	got := make([]float32, n)
	if err := recvOuter(ctx, send(outerTensors(m, rt, 1, r, parts, true)), m, rt, 1, got, true); err != nil {
		t.Fatal(err)
	}
	for i := range x {
		if math.Float32bits(got[i]) != math.Float32bits(x[i]) {
			t.Fatalf("value %d decoded %v, the sender's %v", i, got[i], x[i])
		}
	}
	// θ_r as float32.
	if err := recvOuter(ctx, send(outerTensors(m, rt, 1, r, parts, false)), m, rt, 1, got, false); err != nil {
		t.Fatal(err)
	}
	for i := range r {
		if got[i] != r[i] {
			t.Fatalf("θ_r value %d received %v, sent %v", i, got[i], r[i])
		}
	}
	// A part of another shape, or float32 where int8 is due, is refused.
	bad := outerTensors(m, rt, 1, r, parts, true)
	bad[0].Shape = proto.Shape{1, uint32(2 * model.OuterChunk), 1, 1}
	bad[0].Data = append(append([]byte(nil), bad[0].Data[:4]...), bad[0].Data[8:]...)
	short, cancelShort := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancelShort()
	if err := recvOuter(short, send(bad), m, rt, 1, got, true); err == nil {
		t.Error("an int8 part of the wrong shape was taken")
	}
	if err := recvOuter(short, send(outerTensors(m, rt, 1, r, parts, false)), m, rt, 1, got, true); err == nil {
		t.Error("float32 taken where int8 was due")
	}
}
