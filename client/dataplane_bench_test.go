//go:build !js

package client

import (
	"context"
	"testing"
	"time"

	"github.com/shoal-ml/shoal/proto"
)

// BenchmarkDataPlane moves 64 KiB frames (one-frame tensors) one way between two RTCTransports in
// this process over loopback, on each path a native link can take:
//
//	datachannel  pion's SCTP over DTLS on ICE's own sockets, as with SHOAL_QUIC=0
//	quic         the QUIC link two native workers open on the pair ICE selected
//
// and reports MB/s and the CPU time of both ends per GB moved (process CPU time, user and system,
// from getrusage), which a shared machine disturbs less than MB/s:
//
//	go test ./client -run '^$' -bench 'BenchmarkDataPlane' -benchtime 4000x -count 3
func BenchmarkDataPlane(b *testing.B) {
	for _, path := range []string{"datachannel", "quic"} {
		b.Run(path, func(b *testing.B) {
			defer func(off bool) { quicOff = off }(quicOff)
			quicOff = path != "quic"
			r := newRTCRelay(b)
			cfg := RTCConfig{Loopback: true}
			a, z := r.add("a", cfg), r.add("b", cfg)
			connectRTC(b, a, z)
			waitLink(b, a, "b", path)
			waitLink(b, z, "a", path)
			benchSend(b, a, z)
			if got := a.Link("b"); got != path {
				b.Fatalf("the link ended on %q, want %q", got, path)
			}
		})
	}
}

// waitLink waits until t's frames to peer travel on path.
func waitLink(tb testing.TB, t *RTCTransport, peer, path string) {
	tb.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for t.Link(peer) != path {
		if time.Now().After(deadline) {
			tb.Fatalf("%s's link to %s is %q after 30 s, want %q", t.id, peer, t.Link(peer), path)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// benchSend sends b.N one-frame tensors from a to z and waits until z has received the last.
func benchSend(b *testing.B, a, z *RTCTransport) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	x := make([]float32, proto.MaxChunkPayload/4)
	for i := range x {
		x[i] = float32(i)
	}
	tn := proto.Tensor{Key: proto.TensorKey{Kind: proto.KindActivation, Step: 1, Block: 0, Expert: proto.NoExpert},
		DType: proto.F32, Shape: proto.Shape{uint32(len(x)), 1, 1, 1}, Data: proto.AppendFloat32s(nil, x)}
	b.SetBytes(proto.MaxFrameSize)
	b.ResetTimer()
	start, cpu := time.Now(), processCPU()
	recvd := make(chan error, 1)
	go func() {
		key := tn.Key
		for i := range b.N {
			key.Step, key.MicroBatch = uint64(i>>16), uint32(i&0xffff)
			if _, err := z.Recv(ctx, key); err != nil {
				recvd <- err
				return
			}
		}
		recvd <- nil
	}()
	for i := range b.N {
		tn.Key.Step, tn.Key.MicroBatch = uint64(i>>16), uint32(i&0xffff)
		if err := a.Send(ctx, z.id, tn); err != nil {
			b.Fatal(err)
		}
	}
	if err := <-recvd; err != nil {
		b.Fatal(err)
	}
	b.StopTimer()
	gb := float64(b.N) * proto.MaxFrameSize / 1e9
	b.ReportMetric(gb*1e3/time.Since(start).Seconds(), "MB/s")
	b.ReportMetric((processCPU()-cpu).Seconds()/gb, "cpu-s/GB")
}
