//go:build !js

package client

import (
	"context"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/shoal-ml/shoal/proto"
)

// TestBackgroundYieldsToForeground: a stage's state handed over a link (proto.KindState, a
// background tensor) while the link's pipeline sends an activation: the activation's frames go
// one after another, with at most the one background frame already on its way between them, and
// the state still arrives whole. Before the classes the two tensors took turns frame by frame.
func TestBackgroundYieldsToForeground(t *testing.T) {
	a, b := rtcPair(t, RTCConfig{})
	rng := rtcSeed(t)
	var mu sync.Mutex
	var order []proto.Kind
	started := make(chan struct{})
	a.frameSent = func(k proto.Kind) {
		mu.Lock()
		defer mu.Unlock()
		order = append(order, k)
		if len(order) == 8 {
			close(started)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	// 16 MiB of state, and an activation of 1 MiB.
	state := stateTensor(rng, 1<<22)
	act := rtcTensor(rng, proto.KindActivation, 2, 1<<18)
	sent := make(chan error, 2)
	go func() { sent <- a.Send(ctx, "b", state) }()
	select {
	case <-started:
	case err := <-sent:
		t.Fatalf("the state sent before the activation began: %v", err)
	case <-ctx.Done():
		t.Fatal("the state's first frames were never sent")
	}
	go func() { sent <- a.Send(ctx, "b", act) }()
	for _, tn := range []proto.Tensor{act, state} {
		got, err := b.Recv(ctx, tn.Key)
		if err != nil {
			t.Fatal(err)
		}
		if err := sameTensor(got, tn); err != nil {
			t.Fatal(err)
		}
	}
	for range 2 {
		if err := <-sent; err != nil {
			t.Fatal(err)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	first, last := -1, -1
	for i, k := range order {
		if k == proto.KindActivation {
			if first < 0 {
				first = i
			}
			last = i
		}
	}
	between := 0
	for _, k := range order[first:last] {
		if k == proto.KindState {
			between++
		}
	}
	if n := last - first + 1 - between; n != act.NumChunks() || between > 1 {
		t.Errorf("the activation's %d frames went with %d state frames between them (%d of its own seen): want at most 1", act.NumChunks(), between, n)
	}
	t.Logf("%d frames; the activation's from %d to %d, %d state frames between", len(order), first, last, between)
}

// TestBackgroundTrickles: a link whose foreground never pauses still moves background frames,
// one every bgMaxWait, so that an outer step or a newcomer waiting on them does not wait for
// good; and each of them did wait that long. The foreground is held by hand, as a pipeline
// sending without a gap would hold it.
func TestBackgroundTrickles(t *testing.T) {
	a, b := rtcPair(t, RTCConfig{})
	rng := rtcSeed(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	state := stateTensor(rng, 3*proto.MaxChunkPayload/4) // three frames
	a.mu.Lock()
	p := a.peers["b"]
	a.mu.Unlock()
	p.fgEnter()
	t0 := time.Now()
	if err := a.Send(ctx, "b", state); err != nil {
		t.Fatal(err)
	}
	took := time.Since(t0)
	p.fgLeave()
	if _, err := b.Recv(ctx, state.Key); err != nil {
		t.Fatal(err)
	}
	if n := state.NumChunks(); took < time.Duration(n)*bgMaxWait {
		t.Errorf("%d background frames crossed a busy link in %v: each should have waited %v", n, took, bgMaxWait)
	}
	// With the foreground idle they go at once.
	t0 = time.Now()
	sendRecv(t, a, b, "b", stateTensor(rng, 3*proto.MaxChunkPayload/4))
	if took := time.Since(t0); took >= bgMaxWait {
		t.Logf("three background frames on an idle link took %v (a busy machine?)", took)
	}
}

// stateTensor is a tensor of n float32s of a stage's state, as a handover sends it.
func stateTensor(rng *rand.Rand, n int) proto.Tensor {
	tn := rtcTensor(rng, proto.KindState, 0, n)
	tn.Key.Expert = 0
	return tn
}
