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
// background tensor) while the pipeline sends an activation over it: the state's frames go at
// most one for every bgShare of the activation's (and one already on its way), and both arrive
// whole. Before the classes the two tensors took turns frame by frame. (Across two links the
// scheduler, not the classes, decided the order in the runs tried, so that case could not fail:
// TestBackgroundTrickles shows a foreground tensor anywhere on the transport holding the state
// back, and TestForegroundClasses the rule.)
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
	if n, most := last-first+1-between, (act.NumChunks()-1)/bgShare+1; n != act.NumChunks() || between > most {
		t.Errorf("the activation's %d frames went with %d state frames between them (%d of its own seen): want at most %d, one for every %d", act.NumChunks(), between, n, most, bgShare)
	}
	t.Logf("%d frames; the activation's from %d to %d, %d state frames between", len(order), first, last, between)
}

// TestBackgroundTrickles: a transport whose foreground tensor sends no frame for a while (one
// waiting on the volunteer's upload cap, --max-upload; here held by hand, on the transport, not
// on the link the state takes) still moves background frames, one every bgMaxWait, so that an
// outer step or a newcomer waiting on them does not wait for good; and each of them did wait that
// long.
func TestBackgroundTrickles(t *testing.T) {
	a, b := rtcPair(t, RTCConfig{})
	rng := rtcSeed(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	state := stateTensor(rng, 3*proto.MaxChunkPayload/4) // three frames
	a.fg.enter()
	t0 := time.Now()
	if err := a.Send(ctx, "b", state); err != nil {
		t.Fatal(err)
	}
	took := time.Since(t0)
	a.fg.leave()
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

// TestForegroundClasses: the rule a background frame waits by (foreground.mayGo), step by step.
// A foreground tensor being sent holds it back; one held by its link's back-pressure does not (its
// neighbour's path is full, not the uplink); bgShare foreground frames let one through.
func TestForegroundClasses(t *testing.T) {
	var f foreground
	if ok, _ := f.mayGo(); !ok {
		t.Fatal("no foreground, and a background frame may not go")
	}
	f.enter()
	ok, wake := f.mayGo()
	if ok {
		t.Fatal("a foreground tensor is being sent, and a background frame may go")
	}
	release := f.held(proto.KindActivation)
	select {
	case <-wake:
	default:
		t.Fatal("a foreground tensor held by back-pressure did not wake the background")
	}
	if ok, _ := f.mayGo(); !ok {
		t.Fatal("the only foreground tensor is held by back-pressure, and a background frame may not go")
	}
	release()
	if ok, _ := f.mayGo(); ok {
		t.Fatal("the foreground tensor sends again, and a background frame may go")
	}
	f.held(proto.KindState)() // a background tensor's hold counts for nothing
	for k := range bgShare {
		if ok, _ := f.mayGo(); ok {
			t.Fatalf("after %d foreground frames a background frame may go, want %d", k, bgShare)
		}
		f.sent(false)
	}
	if ok, _ := f.mayGo(); !ok {
		t.Fatalf("after %d foreground frames a background frame may not go", bgShare)
	}
	f.sent(true)
	if ok, _ := f.mayGo(); ok {
		t.Fatal("a background frame went, and the next may go at once")
	}
	if f.quiet() {
		t.Fatal("a foreground tensor is being sent, and the link is quiet")
	}
	f.leave()
	if ok, _ := f.mayGo(); !ok {
		t.Fatal("no foreground left, and a background frame may not go")
	}
	f.mu.Lock()
	f.last = time.Now().Add(time.Hour) // a clock that cannot have run bgMaxWait since
	f.mu.Unlock()
	if f.quiet() {
		t.Fatalf("quiet before %v passed since the last foreground tensor", bgMaxWait)
	}
	f.mu.Lock()
	f.last = time.Now().Add(-bgMaxWait)
	f.mu.Unlock()
	if !f.quiet() {
		t.Fatalf("not quiet %v after the last foreground tensor", bgMaxWait)
	}
}
