//go:build !js

package client

import (
	"context"
	"os"
	"sync/atomic"
	"testing"
	"time"

	"github.com/pion/webrtc/v4"

	"github.com/shoal-ml/shoal/proto"
)

// The two benchmarks move 64 KiB messages one way over loopback, through RTCTransport and
// through a bare pion data channel set up the same way (same settings, same pre-negotiated
// channel, same 4 MiB / 1 MiB flow control), so that their ratio is the data plane's overhead:
// framing, finiteness checks, reassembly and the Mailbox. Each also reports the CPU time the
// process spent per frame (both ends), which a busy machine disturbs less than MB/s. Compare
// them with
//
//	go test ./client -run '^$' -bench 'RTC(Throughput|BareDataChannel)' -benchtime 2000x -count 6
//
// On Linux they also report the datagrams per sendmsg of segmentation offload
// (rtc_udp_linux.go); SHOAL_RTC_OFFLOAD=0 turns it off, to compare alternating runs.

func init() {
	if os.Getenv("SHOAL_RTC_OFFLOAD") == "0" {
		udpOffload = false
	}
}

// BenchmarkRTCThroughput sends b.N one-frame tensors (64 KiB on the wire each) from a to b and
// waits until b has received the last one.
func BenchmarkRTCThroughput(b *testing.B) {
	r := newRTCRelay(b)
	cfg := RTCConfig{Loopback: true}
	a, z := r.add("a", cfg), r.add("b", cfg)
	connectRTC(b, a, z)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	x := make([]float32, proto.MaxChunkPayload/4)
	for i := range x {
		x[i] = float32(i)
	}
	tn := proto.Tensor{Key: proto.TensorKey{Kind: proto.KindActivation, Step: 1, Block: 0, Expert: proto.NoExpert},
		DType: proto.F32, Shape: proto.Shape{uint32(len(x)), 1, 1, 1}, Data: proto.AppendFloat32s(nil, x)}

	b.SetBytes(proto.MaxFrameSize)
	b.ResetTimer()
	cpu, dg := processCPU(), gsoCounts()
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
		if err := a.Send(ctx, "b", tn); err != nil {
			b.Fatal(err)
		}
	}
	if err := <-recvd; err != nil {
		b.Fatal(err)
	}
	b.StopTimer()
	reportCPU(b, cpu, dg)
}

// reportCPU reports the process's CPU time per frame since start, both ends together, and the
// datagrams per sendmsg since dg when segmentation offload sent any.
func reportCPU(b *testing.B, start time.Duration, dg [2]int64) {
	b.ReportMetric(float64((processCPU()-start).Microseconds())/float64(b.N), "cpu-µs/frame")
	if now := gsoCounts(); now[1] > dg[1] {
		b.ReportMetric(float64(now[0]-dg[0])/float64(now[1]-dg[1]), "dgrams/send")
	}
}

// gsoCounts is the datagrams and sendmsg calls of segmentation offload so far.
func gsoCounts() [2]int64 { return [2]int64{gsoStats.datagrams.Load(), gsoStats.sends.Load()} }

// BenchmarkRTCBareDataChannel is the baseline: b.N messages of 64 KiB through a pion data
// channel with nothing of Shoal's on either end.
func BenchmarkRTCBareDataChannel(b *testing.B) {
	cfg := RTCConfig{Loopback: true}.withDefaults()
	newPC := func() (*webrtc.PeerConnection, *webrtc.DataChannel) {
		api, err := newRTCAPI(cfg, nil)
		if err != nil {
			b.Fatal(err)
		}
		pc, err := api.NewPeerConnection(webrtc.Configuration{})
		if err != nil {
			b.Fatal(err)
		}
		negotiated, id := true, uint16(0)
		dc, err := pc.CreateDataChannel("bare", &webrtc.DataChannelInit{Negotiated: &negotiated, ID: &id})
		if err != nil {
			b.Fatal(err)
		}
		return pc, dc
	}
	pa, da := newPC()
	pz, dz := newPC()
	defer pa.GracefulClose()
	defer pz.GracefulClose()

	opened := make(chan struct{}, 2)
	da.OnOpen(func() { opened <- struct{}{} })
	dz.OnOpen(func() { opened <- struct{}{} })
	var got atomic.Int64
	done := make(chan struct{})
	n := int64(b.N)
	dz.OnMessage(func(m webrtc.DataChannelMessage) {
		if got.Add(1) == n {
			close(done)
		}
	})
	low := make(chan struct{}, 1)
	da.SetBufferedAmountLowThreshold(uint64(cfg.LowBuffered))
	da.OnBufferedAmountLow(func() {
		select {
		case low <- struct{}{}:
		default:
		}
	})

	// Non-trickle signaling is enough here: loopback gathering is immediate.
	signal := func(from, to *webrtc.PeerConnection, desc webrtc.SessionDescription) {
		gathered := webrtc.GatheringCompletePromise(from)
		if err := from.SetLocalDescription(desc); err != nil {
			b.Fatal(err)
		}
		<-gathered
		if err := to.SetRemoteDescription(*from.LocalDescription()); err != nil {
			b.Fatal(err)
		}
	}
	offer, err := pa.CreateOffer(nil)
	if err != nil {
		b.Fatal(err)
	}
	signal(pa, pz, offer)
	answer, err := pz.CreateAnswer(nil)
	if err != nil {
		b.Fatal(err)
	}
	signal(pz, pa, answer)
	for range 2 {
		select {
		case <-opened:
		case <-time.After(10 * time.Second):
			b.Fatal("data channel did not open")
		}
	}

	msg := make([]byte, proto.MaxFrameSize)
	b.SetBytes(proto.MaxFrameSize)
	b.ResetTimer()
	cpu, dg := processCPU(), gsoCounts()
	for range b.N {
		for da.BufferedAmount() > uint64(cfg.MaxBuffered) {
			<-low
		}
		if err := da.Send(msg); err != nil {
			b.Fatal(err)
		}
	}
	<-done
	b.StopTimer()
	reportCPU(b, cpu, dg)
}
