package client

import (
	"bytes"
	"context"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/pion/webrtc/v4"

	"github.com/shoal-ml/shoal/proto"
)

// nopSignaler drops signals: the tests here feed a peer's message handler directly.
type nopSignaler struct{}

func (nopSignaler) SendSignal(context.Context, string, proto.Signal) error { return nil }

// TestRTCMessagesOutOfOrder plays pion's js build, where every data-channel message event starts
// its own goroutine and nothing keeps them in order: the frames of several multi-chunk tensors,
// from two steps, are shuffled and each handed to onMessage on a goroutine of its own, while Recv
// already waits for some of the tensors. Every tensor must arrive whole and intact, and nothing
// may stay half-assembled. Without a build tag it also runs under GOOS=js GOARCH=wasm (with
// go_js_wasm_exec), on the single-threaded wasm scheduler the tab uses.
func TestRTCMessagesOutOfOrder(t *testing.T) {
	seed := rand.Uint64()
	t.Logf("seed %d", seed)
	r := rand.New(rand.NewPCG(seed, 1))

	tr := NewRTCTransport("me", RTCConfig{}, nopSignaler{})
	defer tr.Close()
	p := &rtcPeer{t: tr, id: "them", done: make(chan struct{}), reasm: proto.NewReassembler(tr.cfg.Limits)}

	var tensors []proto.Tensor
	var frames [][]byte
	for step := uint64(1); step <= 2; step++ {
		for mb := 0; mb < 3; mb++ {
			rows := 1 + r.IntN(3)
			x := make([]float32, rows*32*640) // 80 KiB a row: 2 to 4 chunks of 64 KiB
			for i := range x {
				x[i] = r.Float32()
			}
			sh, err := proto.ShapeOf(rows, 32, 640)
			if err != nil {
				t.Fatal(err)
			}
			tn := proto.Tensor{Key: proto.TensorKey{Kind: proto.KindActivation, PlanVersion: 1, Step: step, MicroBatch: uint32(mb),
				Block: 2, Expert: proto.NoExpert}, DType: proto.F32, Shape: sh, Data: proto.AppendFloat32s(nil, x)}
			fs, err := proto.SplitTensor(tn, tr.cfg.Limits)
			if err != nil {
				t.Fatal(err)
			}
			tensors = append(tensors, tn)
			frames = append(frames, fs...)
		}
	}
	if len(frames) <= len(tensors) {
		t.Fatalf("%d frames for %d tensors: the test needs tensors of several chunks", len(frames), len(tensors))
	}
	r.Shuffle(len(frames), func(i, j int) { frames[i], frames[j] = frames[j], frames[i] })

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	got := make([]proto.Tensor, len(tensors))
	errs := make([]error, len(tensors))
	var receivers sync.WaitGroup
	// Half the tensors are waited for before any frame arrives, half asked for afterwards.
	recv := func(i int) {
		receivers.Go(func() { got[i], errs[i] = tr.Recv(ctx, tensors[i].Key) })
	}
	for i := 0; i < len(tensors); i += 2 {
		recv(i)
	}
	var senders sync.WaitGroup
	for _, f := range frames {
		senders.Go(func() { p.onMessage(webrtc.DataChannelMessage{Data: f}) })
	}
	senders.Wait()
	for i := 1; i < len(tensors); i += 2 {
		recv(i)
	}
	receivers.Wait()
	for i, tn := range tensors {
		if errs[i] != nil {
			t.Fatalf("receive %v: %v", tn.Key, errs[i])
		}
		if got[i].Shape != tn.Shape || !bytes.Equal(got[i].Data, tn.Data) {
			t.Errorf("%v arrived as %v with different bytes", tn.Key, got[i].Shape)
		}
	}
	if err := p.failure(); err != nil {
		t.Errorf("the peer was failed: %v", err)
	}
	if n := p.reasm.Pending(); n != 0 {
		t.Errorf("%d tensors still half-assembled", n)
	}
}
