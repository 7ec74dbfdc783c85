//go:build !js

package client

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/shoal-ml/shoal/proto"
)

// The tests below run real pion peers in loopback mode (RTCConfig.Loopback): candidates on lo
// only, so nothing leaves the machine. Signaling goes through rtcRelay, which plays the
// coordinator.

// rtcRelay relays signals between transports in one process as the coordinator does: it
// validates each signal, sends it through JSON, and overwrites From with the sender's id.
type rtcRelay struct {
	t       testing.TB
	mu      sync.Mutex
	peers   map[string]*RTCTransport
	signals []proto.Signal // every signal relayed, in order
	// rewrite, when set, changes a signal on its way (a coordinator that lies).
	rewrite func(*proto.Signal)
}

// signalsFrom returns the signals worker from has sent so far.
func (r *rtcRelay) signalsFrom(from string) []proto.Signal {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []proto.Signal
	for _, s := range r.signals {
		if s.From == from {
			out = append(out, s)
		}
	}
	return out
}

func newRTCRelay(t testing.TB) *rtcRelay {
	return &rtcRelay{t: t, peers: map[string]*RTCTransport{}}
}

// add makes worker id reachable through the relay, replacing an earlier worker of that id.
func (r *rtcRelay) add(id string, cfg RTCConfig) *RTCTransport {
	tr := NewRTCTransport(id, cfg, relayEnd{r, id})
	r.mu.Lock()
	r.peers[id] = tr
	r.mu.Unlock()
	r.t.Cleanup(func() { tr.Close() })
	return tr
}

type relayEnd struct {
	r    *rtcRelay
	from string
}

func (e relayEnd) SendSignal(ctx context.Context, to string, s proto.Signal) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	s.From = e.from
	if err := s.Validate(); err != nil {
		e.r.t.Errorf("%s sent an invalid signal: %v", e.from, err)
		return err
	}
	b, err := json.Marshal(&s)
	if err != nil {
		return err
	}
	var got proto.Signal
	if err := json.Unmarshal(b, &got); err != nil {
		return err
	}
	e.r.mu.Lock()
	if e.r.rewrite != nil {
		e.r.rewrite(&got)
	}
	dst := e.r.peers[to]
	e.r.signals = append(e.r.signals, got)
	e.r.mu.Unlock()
	if dst == nil {
		return fmt.Errorf("no worker %s", to)
	}
	if err := dst.HandleSignal(e.from, got); err != nil && !errors.Is(err, ErrClosed) {
		e.r.t.Logf("%s refused a signal from %s: %v", to, e.from, err)
	}
	return nil
}

// connectRTC connects a (offering) and b and fails the test if that takes over 10 s.
func connectRTC(t testing.TB, a, b *RTCTransport) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	errs := make(chan error, 2)
	go func() { errs <- a.Connect(ctx, b.id, true) }()
	go func() { errs <- b.Connect(ctx, a.id, false) }()
	for range 2 {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
}

// rtcPair returns two connected transports, a and b, closed when the test ends, after which no
// goroutine of theirs or pion's may be left.
func rtcPair(t *testing.T, cfg RTCConfig) (a, b *RTCTransport) {
	t.Helper()
	checkRTCGoroutines(t)
	cfg.Loopback = true
	r := newRTCRelay(t)
	a, b = r.add("a", cfg), r.add("b", cfg)
	connectRTC(t, a, b)
	return a, b
}

// checkRTCGoroutines fails the test if, once its other cleanups have run, goroutines of pion or
// of the RTC transport are still alive after a grace period (pion ends some asynchronously).
// Matching stacks rather than counting goroutines keeps the check blind to other tests' work.
func checkRTCGoroutines(t *testing.T) {
	t.Helper()
	t.Cleanup(func() {
		deadline := time.Now().Add(5 * time.Second)
		for {
			left := rtcGoroutines()
			if len(left) == 0 {
				return
			}
			if time.Now().After(deadline) {
				t.Errorf("%d goroutines left behind:\n\n%s", len(left), strings.Join(left, "\n\n"))
				return
			}
			time.Sleep(20 * time.Millisecond)
		}
	})
}

func rtcGoroutines() []string {
	buf := make([]byte, 4<<20)
	buf = buf[:runtime.Stack(buf, true)]
	var left []string
	for _, g := range strings.Split(string(buf), "\n\n") {
		if strings.Contains(g, "rtcGoroutines") {
			continue // this one
		}
		if strings.Contains(g, "github.com/pion/") || strings.Contains(g, "client.(*rtcPeer)") ||
			strings.Contains(g, "client.(*RTCTransport)") || strings.Contains(g, "github.com/quic-go/") ||
			strings.Contains(g, "client.(*quicLink)") || strings.Contains(g, "client.(*quicEndpoint)") {
			left = append(left, g)
		}
	}
	return left
}

// rtcTensor returns an activation (or, for kind KindTokens, a token tensor) of the given shape
// with random contents.
func rtcTensor(rng *rand.Rand, kind proto.Kind, mb uint32, dims ...int) proto.Tensor {
	shape, err := proto.ShapeOf(dims...)
	if err != nil {
		panic(err)
	}
	n := 1
	for _, d := range shape {
		n *= int(d)
	}
	tn := proto.Tensor{Key: proto.TensorKey{Kind: kind, Step: 7, MicroBatch: mb, Block: 2, Expert: proto.NoExpert},
		DType: proto.F32, Shape: shape}
	if kind == proto.KindTokens {
		tn.Key.Block, tn.DType = proto.NoBlock, proto.I32
		ids := make([]int32, n)
		for i := range ids {
			ids[i] = rng.Int32N(256)
		}
		tn.Data = proto.AppendInt32s(nil, ids)
		return tn
	}
	x := make([]float32, n)
	for i := range x {
		x[i] = float32(rng.NormFloat64())
	}
	tn.Data = proto.AppendFloat32s(nil, x)
	return tn
}

func rtcSeed(t *testing.T) *rand.Rand {
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	return rand.New(rand.NewPCG(seed, 0))
}

// peakBuffered is the most bytes a's channel to peer held right after a send.
func peakBuffered(a *RTCTransport, peer string) uint64 {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.peers[peer].peakBuf.Load()
}

func sameTensor(got, want proto.Tensor) error {
	if got.Key != want.Key || got.DType != want.DType || got.Shape != want.Shape {
		return fmt.Errorf("got %v %v %v, want %v %v %v", got.Key, got.DType, got.Shape, want.Key, want.DType, want.Shape)
	}
	if !bytes.Equal(got.Data, want.Data) {
		return fmt.Errorf("%v: payload differs (%d bytes, want %d)", got.Key, len(got.Data), len(want.Data))
	}
	return nil
}

// TestRTCExchange sends tensors of every size class both ways at once, and receives them in the
// reverse of the order they were sent.
func TestRTCExchange(t *testing.T) {
	a, b := rtcPair(t, RTCConfig{})
	rng := rtcSeed(t)
	const floatsPerChunk = proto.MaxChunkPayload / 4
	sizes := []struct {
		name string
		kind proto.Kind
		dims []int
	}{
		{"empty", proto.KindActivation, []int{0, 16}},
		{"one-float", proto.KindActivation, []int{1}},
		{"one-chunk", proto.KindActivation, []int{floatsPerChunk}},
		{"one-chunk-and-a-float", proto.KindActivation, []int{floatsPerChunk + 1}},
		{"tokens", proto.KindTokens, []int{8, 32}},
		{"3MiB", proto.KindActivation, []int{16, 128, 384}},
	}
	type dir struct {
		from, to *RTCTransport
		sent     []proto.Tensor
	}
	dirs := []*dir{{from: a, to: b}, {from: b, to: a}}
	for _, d := range dirs {
		for i, s := range sizes {
			d.sent = append(d.sent, rtcTensor(rng, s.kind, uint32(i), s.dims...))
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	for _, d := range dirs {
		wg.Go(func() {
			for _, tn := range d.sent {
				if err := d.from.Send(ctx, d.to.id, tn); err != nil {
					t.Errorf("%s: %v", d.from.id, err)
					return
				}
			}
		})
		wg.Go(func() {
			for i := len(d.sent) - 1; i >= 0; i-- {
				got, err := d.to.Recv(ctx, d.sent[i].Key)
				if err != nil {
					t.Errorf("%s: %s: %v", d.to.id, sizes[i].name, err)
					return
				}
				if err := sameTensor(got, d.sent[i]); err != nil {
					t.Errorf("%s -> %s, %s: %v", d.from.id, d.to.id, sizes[i].name, err)
				}
			}
		})
	}
	wg.Wait()
	for _, tr := range []*RTCTransport{a, b} {
		if err := tr.Err(); err != nil {
			t.Errorf("%s: Err() = %v, want nil", tr.id, err)
		}
	}
}

// TestRTCBackPressure sends 64 MiB to a receiver that starts slow: the sender must hold at most
// MaxBuffered (plus the frame that crossed it) on the channel, and memory must stay bounded.
func TestRTCBackPressure(t *testing.T) {
	cfg := RTCConfig{Loopback: true}
	checkRTCGoroutines(t)
	r := newRTCRelay(t)
	a, b := r.add("a", cfg), r.add("b", cfg)
	// For its first 4 MiB the receiver takes 3 ms a frame (about 20 MB/s, slower than pion's
	// 30-50 MB/s here), so its SCTP window and then the sender's buffered amount fill up; then it
	// speeds up, and the link must recover. It is not slow throughout because pion then crawls:
	// its receiver sends no window update when the application catches up, so the sender learns
	// of the space only by a zero-window probe after the 1 s minimum retransmission timeout,
	// and 64 MiB read at 20 MB/s took 46 s (1.4 MB/s).
	var frames int // only pion's read loop for this channel touches it
	b.beforeFrame = func(string) {
		if frames++; frames <= 64 {
			time.Sleep(3 * time.Millisecond)
		}
	}
	connectRTC(t, a, b)

	total := 64 << 20
	if rtcRaceEnabled {
		total = 16 << 20 // the race detector slows pion down about tenfold
	}
	const tensorBytes = 1 << 20
	rng := rtcSeed(t)
	tn := rtcTensor(rng, proto.KindActivation, 0, tensorBytes/4)
	n := total / tensorBytes

	// What bounded buffering bounds is the live heap: the sampler collects before each reading,
	// so garbage never counts. (The heap in use counts garbage too, which the collector's pacing
	// lets grow with the machine's load: a tight GC percent still read 66–77 MiB under a full
	// `go test ./...` on two cores.)
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	base := ms.HeapAlloc
	var peakHeap atomic.Uint64
	stopSampling := make(chan struct{})
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		tick := time.NewTicker(50 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-stopSampling:
				return
			case <-tick.C:
				runtime.GC()
				var ms runtime.MemStats
				runtime.ReadMemStats(&ms)
				if ms.HeapAlloc > peakHeap.Load() {
					peakHeap.Store(ms.HeapAlloc)
				}
			}
		}
	}()

	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	start := time.Now()
	var wg sync.WaitGroup
	wg.Go(func() {
		for i := range n {
			tn := tn
			tn.Key.MicroBatch = uint32(i)
			if err := a.Send(ctx, "b", tn); err != nil {
				t.Error(err)
				return
			}
		}
	})
	wg.Go(func() {
		for i := range n {
			key := tn.Key
			key.MicroBatch = uint32(i)
			if _, err := b.Recv(ctx, key); err != nil {
				t.Error(err)
				return
			}
		}
	})
	wg.Wait()
	elapsed := time.Since(start)
	close(stopSampling)
	<-sampled

	peakBuf := peakBuffered(a, "b")
	t.Logf("%d MiB in %v (%.1f MB/s); peak buffered %d KiB; peak live heap %d MiB over a base of %d MiB",
		total>>20, elapsed.Round(time.Millisecond), float64(total)/elapsed.Seconds()/1e6, peakBuf>>10,
		(peakHeap.Load()-min(base, peakHeap.Load()))>>20, base>>20)
	if limit := uint64(DefaultMaxBuffered + proto.MaxFrameSize); peakBuf > limit {
		t.Errorf("peak buffered amount %d, want <= %d", peakBuf, limit)
	}
	if peakBuf < DefaultMaxBuffered/2 {
		t.Errorf("peak buffered amount %d: the sender never got near the high-water mark, so back-pressure was not tested", peakBuf)
	}
	// Unbounded buffering would hold the whole 64 MiB (plus pion's per-message copies) live;
	// bounded, the live data is a few tensors and the two windows.
	if !rtcRaceEnabled {
		if grew := peakHeap.Load() - min(base, peakHeap.Load()); grew > 48<<20 {
			t.Errorf("heap grew by %d MiB while sending %d MiB: buffering is not bounded", grew>>20, total>>20)
		}
	}
}

// TestRTCSendRespectsContext stalls the receiver completely: Send must block on the full channel
// and give up when its context ends.
func TestRTCSendRespectsContext(t *testing.T) {
	cfg := RTCConfig{Loopback: true, MaxBuffered: 256 << 10}
	checkRTCGoroutines(t)
	r := newRTCRelay(t)
	a, b := r.add("a", cfg), r.add("b", cfg)
	release := make(chan struct{})
	var once sync.Once
	unblock := func() { once.Do(func() { close(release) }) }
	b.beforeFrame = func(string) { <-release }
	t.Cleanup(unblock) // runs before the transports close: pion's read loop must be free to end
	connectRTC(t, a, b)

	tn := rtcTensor(rtcSeed(t), proto.KindActivation, 0, 8<<20/4)
	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	start := time.Now()
	err := a.Send(ctx, "b", tn)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Send to a stalled receiver: %v, want context.DeadlineExceeded", err)
	}
	if waited := time.Since(start); waited > 3*time.Second {
		t.Errorf("Send returned %v after its deadline", waited-500*time.Millisecond)
	}
	if peak := peakBuffered(a, "b"); peak > uint64(cfg.MaxBuffered+proto.MaxFrameSize) {
		t.Errorf("peak buffered amount %d, want <= %d", peak, cfg.MaxBuffered+proto.MaxFrameSize)
	}
	t.Logf("Send gave up after %v: %v", time.Since(start).Round(time.Millisecond), err)
}

// TestRTCProtocolViolation has a sends what a correct peer never sends: b must drop it, name it
// in the error of its pending Recv, Err and OnPeerFailed, and a must see its connection gone.
func TestRTCProtocolViolation(t *testing.T) {
	rng := rtcSeed(t)
	good := rtcTensor(rng, proto.KindActivation, 3, 64)
	nanFrame, err := proto.AppendChunk(nil, good, 0, proto.Limits{})
	if err != nil {
		t.Fatal(err)
	}
	binary.LittleEndian.PutUint32(nanFrame[proto.HeaderSize+8:], math.Float32bits(float32(math.NaN())))

	tests := []struct {
		name string
		send func(ctx context.Context, a *RTCTransport) error
		want error // what the violation error wraps besides ErrProtocolViolation
	}{
		{"short-frame", func(_ context.Context, a *RTCTransport) error { return a.sendRaw("b", []byte{'S', 'H', 1}, false) }, proto.ErrShortFrame},
		{"not-a-frame", func(_ context.Context, a *RTCTransport) error {
			return a.sendRaw("b", make([]byte, proto.HeaderSize+4), false)
		}, proto.ErrFrameVersion},
		{"non-finite", func(_ context.Context, a *RTCTransport) error { return a.sendRaw("b", nanFrame, false) }, proto.ErrNonFinite},
		{"text-message", func(_ context.Context, a *RTCTransport) error { return a.sendRaw("b", []byte("hello"), true) }, nil},
		{"duplicate-tensor", func(ctx context.Context, a *RTCTransport) error {
			if err := a.Send(ctx, "b", good); err != nil {
				return err
			}
			return a.Send(ctx, "b", good)
		}, ErrDuplicate},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			failed := make(chan string, 4)
			cfg := RTCConfig{OnPeerFailed: func(peer string, err error) { failed <- peer }}
			a, b := rtcPair(t, cfg)
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()

			never := good.Key
			never.MicroBatch = 99 // pending on both sides, and never sent
			bRecv, aRecv := make(chan error, 1), make(chan error, 1)
			go func() { _, err := b.Recv(ctx, never); bRecv <- err }()
			go func() { _, err := a.Recv(ctx, never); aRecv <- err }()
			waitPending(t, b, never)
			waitPending(t, a, never)

			if err := tt.send(ctx, a); err != nil {
				t.Fatal(err)
			}
			err := <-bRecv
			var pe *PeerError
			switch {
			case !errors.Is(err, ErrProtocolViolation):
				t.Fatalf("b's pending Recv: %v, want ErrProtocolViolation", err)
			case tt.want != nil && !errors.Is(err, tt.want):
				t.Errorf("b's pending Recv: %v, want it to wrap %v", err, tt.want)
			case !errors.As(err, &pe) || pe.Peer != "a" || !strings.Contains(err.Error(), "peer a"):
				t.Errorf("b's pending Recv: %v, want a *PeerError naming peer a", err)
			}
			t.Logf("b: %v", err)
			if err := b.Err(); !errors.Is(err, ErrProtocolViolation) {
				t.Errorf("b.Err() = %v, want ErrProtocolViolation", err)
			}
			// Both transports share cfg, and a reports b too (below), in either order. Only b can
			// report peer a.
			var got []string
			for len(got) < 2 {
				select {
				case p := <-failed:
					got = append(got, p)
				case <-ctx.Done():
					t.Fatalf("OnPeerFailed called for %q only", got)
				}
			}
			if got[0] != "a" && got[1] != "a" {
				t.Errorf("OnPeerFailed called for %q, want a among them", got)
			}
			if _, err := b.Recv(ctx, never); !errors.Is(err, ErrProtocolViolation) {
				t.Errorf("b's later Recv: %v, want ErrProtocolViolation", err)
			}
			if err := b.Send(ctx, "a", good); !errors.As(err, &pe) || pe.Peer != "a" {
				t.Errorf("b.Send to a: %v, want a *PeerError naming a", err)
			}

			// b closed the connection, so a loses its neighbour too, long before PeerTimeout.
			if err := <-aRecv; !errors.Is(err, ErrPeerGone) || !errors.As(err, &pe) || pe.Peer != "b" {
				t.Errorf("a's pending Recv: %v, want ErrPeerGone from peer b", err)
			} else {
				t.Logf("a: %v", err)
			}
		})
	}
}

// TestRTCPeerClosedMidTransfer closes the sender halfway through a tensor: the receiver's Recv
// must fail at once, not at its deadline or after PeerTimeout.
func TestRTCPeerClosedMidTransfer(t *testing.T) {
	checkRTCGoroutines(t)
	r := newRTCRelay(t)
	cfg := RTCConfig{Loopback: true}
	a, b := r.add("a", cfg), r.add("b", cfg)
	var frames atomic.Int32
	midway := make(chan struct{})
	b.beforeFrame = func(string) {
		if frames.Add(1) == 20 {
			close(midway)
		}
		time.Sleep(time.Millisecond)
	}
	connectRTC(t, a, b)

	tn := rtcTensor(rtcSeed(t), proto.KindActivation, 0, 8<<20/4) // 129 frames
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	sent := make(chan error, 1)
	go func() { sent <- a.Send(ctx, "b", tn) }()
	recvd := make(chan error, 1)
	go func() { _, err := b.Recv(ctx, tn.Key); recvd <- err }()

	<-midway
	closed := time.Now()
	a.Close()
	err := <-recvd
	took := time.Since(closed)
	var pe *PeerError
	if !errors.Is(err, ErrPeerGone) || !errors.As(err, &pe) || pe.Peer != "a" {
		t.Fatalf("b's Recv after a closed: %v, want ErrPeerGone from a", err)
	}
	if took > 3*time.Second {
		t.Errorf("b's Recv failed %v after a closed, want well under PeerTimeout (%v)", took, DefaultPeerTimeout)
	}
	t.Logf("b's Recv failed %v after a closed: %v", took.Round(time.Millisecond), err)
	if err := <-sent; err == nil {
		t.Errorf("a's Send survived a.Close")
	}
}

// TestRTCReconnect replaces a failed neighbour: after a's process is gone, a new worker with the
// same id connects, and b's Recvs wait normally again.
func TestRTCReconnect(t *testing.T) {
	checkRTCGoroutines(t)
	r := newRTCRelay(t)
	cfg := RTCConfig{Loopback: true}
	a, b := r.add("a", cfg), r.add("b", cfg)
	connectRTC(t, a, b)
	a.Close()
	deadline := time.Now().Add(5 * time.Second)
	for b.Err() == nil && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if !errors.Is(b.Err(), ErrPeerGone) {
		t.Fatalf("b.Err() after a closed = %v, want ErrPeerGone", b.Err())
	}

	a2 := r.add("a", cfg)
	connectRTC(t, a2, b)
	if err := b.Err(); err != nil {
		t.Fatalf("b.Err() after reconnecting = %v, want nil", err)
	}
	sendRecv(t, a2, b, "b", rtcTensor(rtcSeed(t), proto.KindActivation, 1, 1000))
}

// sendRecv sends tn from one transport to another (to, by id) and checks that it arrives whole.
func sendRecv(t *testing.T, from, to *RTCTransport, toID string, tn proto.Tensor) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	go func() {
		if err := from.Send(ctx, toID, tn); err != nil {
			t.Error(err)
		}
	}()
	got, err := to.Recv(ctx, tn.Key)
	if err != nil {
		t.Fatal(err)
	}
	if err := sameTensor(got, tn); err != nil {
		t.Error(err)
	}
}

// TestRTCHandleSignalRefuses checks the signals a transport must not act on, without a network.
func TestRTCHandleSignalRefuses(t *testing.T) {
	checkRTCGoroutines(t)
	r := newRTCRelay(t)
	b := r.add("b", RTCConfig{Loopback: true})
	b.SetPlanVersion(5)
	cand := &proto.ICECandidate{Candidate: "candidate:1 1 udp 2130706431 127.0.0.1 5000 typ host"}
	tests := []struct {
		name    string
		from    string
		s       proto.Signal
		wantErr bool
	}{
		{"wrong-recipient", "a", proto.Signal{To: "c", PlanVersion: 5, Candidate: cand}, true},
		{"invalid", "a", proto.Signal{To: "b", PlanVersion: 5}, true},
		{"no-connection", "a", proto.Signal{To: "b", PlanVersion: 5, Candidate: cand}, true},
		{"answer-without-offer", "a", proto.Signal{To: "b", PlanVersion: 5, SDP: &proto.SessionDescription{Type: "answer", SDP: "v=0"}}, true},
		{"old-plan-ignored", "a", proto.Signal{To: "b", PlanVersion: 4, SDP: &proto.SessionDescription{Type: "offer", SDP: "v=0"}}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := b.HandleSignal(tt.from, tt.s)
			if (err != nil) != tt.wantErr {
				t.Errorf("HandleSignal: %v, want error: %v", err, tt.wantErr)
			}
		})
	}
	if n := len(b.peers); n != 0 {
		t.Errorf("%d connections set up by refused signals", n)
	}
}

// TestRTCLoopbackFilter checks that loopback mode drops remote candidates it would otherwise
// send connectivity checks to.
func TestRTCLoopbackFilter(t *testing.T) {
	tests := []struct {
		name string
		cand string
		want bool
	}{
		{"ipv4-loopback", "candidate:1 1 udp 2130706431 127.0.0.1 50000 typ host", true},
		{"ipv6-loopback", "candidate:1 1 udp 2130706431 ::1 50000 typ host", true},
		{"lan", "candidate:2 1 udp 2130706431 192.168.1.20 50000 typ host", false},
		{"srflx", "candidate:3 1 udp 1694498815 203.0.113.7 61000 typ srflx raddr 127.0.0.1 rport 50000", false},
		{"mdns", "candidate:4 1 udp 2130706431 0b4c7d2e-1111-4222-8333-444455556666.local 50000 typ host", false},
		{"garbage", "candidate:nonsense", false},
	}
	var sdp strings.Builder
	sdp.WriteString("v=0\r\nm=application 9 UDP/DTLS/SCTP webrtc-datachannel\r\n")
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := loopbackCandidate(tt.cand); got != tt.want {
				t.Errorf("loopbackCandidate(%q) = %v, want %v", tt.cand, got, tt.want)
			}
		})
		sdp.WriteString("a=" + tt.cand + "\r\n")
	}
	sdp.WriteString("a=end-of-candidates\r\n")
	got := loopbackOnlySDP(sdp.String())
	want := "v=0\r\nm=application 9 UDP/DTLS/SCTP webrtc-datachannel\r\n" +
		"a=" + tests[0].cand + "\r\n" + "a=" + tests[1].cand + "\r\n" + "a=end-of-candidates\r\n"
	if got != want {
		t.Errorf("loopbackOnlySDP:\n got %q\nwant %q", got, want)
	}
}

// TestRTCOfferFromNonNeighbour: a transport told its neighbours answers an offer from anyone else
// with nothing — no description, no candidate, no connection — and connects to its neighbour as
// usual.
func TestRTCOfferFromNonNeighbour(t *testing.T) {
	checkRTCGoroutines(t)
	r := newRTCRelay(t)
	a := r.add("a", RTCConfig{Loopback: true}) // the lower id: a offers
	b := r.add("b", RTCConfig{Loopback: true, Neighbours: []string{"c"}})
	c := r.add("c", RTCConfig{Loopback: true})
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	if err := a.Connect(ctx, "b", true); err == nil {
		t.Fatal("a connected to b, which a is not a neighbour of")
	}
	if got := r.signalsFrom("b"); len(got) != 0 {
		t.Fatalf("b answered the offer of a peer outside its neighbours with %d signals: %+v", len(got), got)
	}
	b.mu.Lock()
	n := len(b.peers)
	b.mu.Unlock()
	if n != 0 {
		t.Fatalf("b set up %d connections for a peer outside its neighbours", n)
	}
	if err := b.HandleSignal("a", proto.Signal{To: "b", SDP: &proto.SessionDescription{Type: "offer", SDP: "v=0"}}); !errors.Is(err, ErrNotNeighbour) {
		t.Errorf("HandleSignal of an outsider's offer: %v, want ErrNotNeighbour", err)
	}
	if err := b.Connect(ctx, "a", false); !errors.Is(err, ErrNotNeighbour) {
		t.Errorf("Connect to a peer outside the neighbours: %v, want ErrNotNeighbour", err)
	}

	connectRTC(t, b, c)
	sendRecv(t, c, b, "b", rtcTensor(rtcSeed(t), proto.KindActivation, 0, 1000))
}

// TestRTCNeighbourSendsWhatItMustNot: over a real data channel, a neighbour that sends a tensor
// the receiver's plan does not have it send (checked by the worker's admission, RTCConfig.Admit)
// is failed as a protocol violation; what it may send arrives.
func TestRTCNeighbourSendsWhatItMustNot(t *testing.T) {
	spec := testJobSpec(21)
	plan := twoStagePlan(t, spec, "a", "b", false)
	ad := newAdmission("b", plan.assigns["b"], spec, nil, []string{"a"}, nil, nil, nil)
	T, C := spec.Model.BlockSize, spec.Model.NEmbd
	N := spec.BatchSize / spec.MicroBatches * T
	st := proto.StepSpec{Step: 3, PlanVersion: plan.version}
	tensor := func(key proto.TensorKey, rows int) proto.Tensor {
		sh, _ := proto.ShapeOf(rows, C)
		return proto.Tensor{Key: key, DType: proto.F32, Shape: sh, Data: make([]byte, 4*rows*C)}
	}
	tests := []struct {
		name string
		tn   proto.Tensor
		want error // nil: b receives it
	}{
		{"activation", tensor(actKey(st, 0, 2), N), nil},
		{"gradient from the previous stage", tensor(gradKey(st, 0, 2), N), ErrUnexpectedTensor},
		{"activation for another block", tensor(actKey(st, 0, 1), N), ErrUnexpectedTensor},
		{"activation larger than the job's", tensor(actKey(st, 0, 2), ad.lim.MaxTensorBytes/(4*C)+1), proto.ErrTensorTooLarge},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			checkRTCGoroutines(t)
			r := newRTCRelay(t)
			failed := make(chan error, 4)
			a := r.add("a", RTCConfig{Loopback: true})
			b := r.add("b", RTCConfig{Loopback: true, Neighbours: []string{"a"}, Limits: ad.lim, Admit: ad.check,
				OnPeerFailed: func(_ string, err error) { failed <- err }})
			connectRTC(t, a, b)
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			// b may cut the link after the first chunk of a tensor it refuses, before a has sent
			// the rest: then a's Send fails, which is b doing its job.
			if err := a.Send(ctx, "b", tt.tn); err != nil && tt.want == nil {
				t.Fatal(err)
			}
			if tt.want == nil {
				if _, err := b.Recv(ctx, tt.tn.Key); err != nil {
					t.Fatal(err)
				}
				return
			}
			select {
			case err := <-failed:
				if !errors.Is(err, ErrProtocolViolation) || !errors.Is(err, tt.want) {
					t.Errorf("a failed with %v, want a protocol violation wrapping %v", err, tt.want)
				}
				t.Logf("a failed: %v", err)
			case <-ctx.Done():
				t.Fatal("a was not failed")
			}
		})
	}
}

// TestRTCBudgetSharedByNeighbours: every neighbour's reassembler draws on the one budget of the
// worker. Two neighbours that each stay within their own limit still cannot pass it together,
// and the bytes of a neighbour's incomplete tensors go back to it when its connection closes.
func TestRTCBudgetSharedByNeighbours(t *testing.T) {
	checkRTCGoroutines(t)
	const tensorBytes = 2 * proto.MaxChunkPayload
	budget := proto.NewBudget(4 * tensorBytes)
	r := newRTCRelay(t)
	failed := make(chan string, 4)
	b := r.add("b", RTCConfig{Loopback: true, Limits: proto.Limits{MaxInFlightBytes: 3 * tensorBytes, Budget: budget},
		OnPeerFailed: func(p string, err error) {
			if errors.Is(err, proto.ErrInFlight) {
				failed <- p
			}
		}})
	a, c := r.add("a", RTCConfig{Loopback: true}), r.add("c", RTCConfig{Loopback: true})
	connectRTC(t, a, b)
	connectRTC(t, b, c)
	rng := rtcSeed(t)
	firstChunk := func(mb uint32) []byte {
		frames, err := proto.SplitTensor(rtcTensor(rng, proto.KindActivation, mb, tensorBytes/4), proto.Limits{})
		if err != nil {
			t.Fatal(err)
		}
		return frames[0]
	}
	for mb := range uint32(3) {
		if err := a.sendRaw("b", firstChunk(mb), false); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, "a's three tensors", func() bool { return budget.InUse() == 3*tensorBytes })
	for mb := uint32(10); mb < 12; mb++ {
		if err := c.sendRaw("b", firstChunk(mb), false); err != nil {
			t.Fatal(err)
		}
	}
	select {
	case p := <-failed:
		if p != "c" {
			t.Fatalf("%s failed for passing the budget, want c", p)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("nobody failed: two neighbours held more than the budget together")
	}
	if budget.InUse() > budget.Max() {
		t.Errorf("%d bytes held, over the budget of %d", budget.InUse(), budget.Max())
	}
	// c's connection is closed, and its tensor's bytes go back; then Close returns a's.
	waitFor(t, "c's bytes to be given back", func() bool { return budget.InUse() == 3*tensorBytes })
	b.Close()
	if budget.InUse() != 0 {
		t.Errorf("%d bytes still counted after the transport closed", budget.InUse())
	}
}

// waitPending returns once a Recv of key waits on tr: the state the test means to fail, which a
// sleep only made likely on a loaded machine.
func waitPending(t *testing.T, tr *RTCTransport, key proto.TensorKey) {
	t.Helper()
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(time.Millisecond) {
		tr.box.mu.Lock()
		_, waiting := tr.box.waiting[key]
		tr.box.mu.Unlock()
		if waiting {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("no Recv of %v ever waited", key)
		}
	}
}

// containedTrio is a connected to b and to c, c its contained partner (RTCConfig.Contained: a
// stage's partner in outer steps); failed gets the peers a's OnPeerFailed reports.
func containedTrio(t *testing.T) (a, b, c *RTCTransport, failed chan string) {
	t.Helper()
	checkRTCGoroutines(t)
	failed = make(chan string, 4)
	cfg := RTCConfig{Loopback: true, OnPeerFailed: func(peer string, err error) { failed <- peer },
		Contained: func(peer string) bool { return peer == "c" }}
	r := newRTCRelay(t)
	a, b, c = r.add("a", cfg), r.add("b", RTCConfig{Loopback: true}), r.add("c", RTCConfig{Loopback: true})
	connectRTC(t, a, b)
	connectRTC(t, a, c)
	return a, b, c, failed
}

// TestRTCContainedFailure: a neighbour named by RTCConfig.Contained (a stage's partner in outer
// steps) that goes away fails only what waits on it — PeerDone, its sends, OnPeerFailed — not a
// Recv of another neighbour's tensor, pending or later (a pipeline's activations, an exchange
// among the others); Disconnect forgets it.
func TestRTCContainedFailure(t *testing.T) {
	rng := rtcSeed(t)
	a, b, c, failed := containedTrio(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	fromB := rtcTensor(rng, proto.KindActivation, 1, 64)
	pending := make(chan error, 1)
	go func() { _, err := a.Recv(ctx, fromB.Key); pending <- err }()
	done := a.PeerDone("c")
	if done == nil {
		t.Fatal("no PeerDone for a connected neighbour")
	}
	c.Close()
	select {
	case <-done:
	case <-ctx.Done():
		t.Fatal("PeerDone not closed after c went away")
	}
	if p := <-failed; p != "c" {
		t.Errorf("OnPeerFailed for %q, want c", p)
	}
	if err := a.Err(); err != nil {
		t.Errorf("a.Err() = %v after a contained failure, want nil", err)
	}
	if err := a.Send(ctx, "c", fromB); err == nil {
		t.Error("a sent to c after it went away")
	}
	if err := b.Send(ctx, "a", fromB); err != nil {
		t.Fatal(err)
	}
	if err := <-pending; err != nil {
		t.Errorf("a's pending Recv from b: %v", err)
	}
	later := rtcTensor(rng, proto.KindActivation, 2, 64)
	if err := b.Send(ctx, "a", later); err != nil {
		t.Fatal(err)
	}
	if _, err := a.Recv(ctx, later.Key); err != nil {
		t.Errorf("a's later Recv from b: %v", err)
	}
	a.Disconnect("c")
	if a.PeerDone("c") != nil {
		t.Error("PeerDone after Disconnect, want nil")
	}
}

// TestRTCPeerLeft: the coordinator's word that a neighbour left (proto.PeerLeft) fails the link
// to it at once, though the link itself still works — as it does for many seconds to a killed
// process: a contained partner's failure ends only what waits on it (PeerDone, OnPeerFailed), any
// other neighbour's fails the data plane (Err) with ErrPeerGone. A peer that is no neighbour is
// ignored.
func TestRTCPeerLeft(t *testing.T) {
	a, _, _, failed := containedTrio(t)
	a.PeerLeft("x") // no neighbour: nothing happens
	done := a.PeerDone("c")
	a.PeerLeft("c")
	select {
	case <-done:
	default:
		t.Fatal("PeerDone of c still open after PeerLeft")
	}
	if p := <-failed; p != "c" {
		t.Errorf("OnPeerFailed for %q, want c", p)
	}
	if err := a.Err(); err != nil {
		t.Errorf("a.Err() = %v after a contained partner left, want nil", err)
	}
	a.PeerLeft("b")
	if err := a.Err(); !errors.Is(err, ErrPeerGone) {
		t.Errorf("a.Err() = %v after neighbour b left, want ErrPeerGone", err)
	}
	if p := <-failed; p != "b" {
		t.Errorf("OnPeerFailed for %q, want b", p)
	}
	// Connecting to a neighbour that left fails at once, not at its ICE timeout: a plan whose
	// links open after the coordinator said so (a restore's plan, dropping a replica as it loads).
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := a.Connect(ctx, "c", true); !errors.Is(err, ErrPeerGone) {
		t.Errorf("Connect to c after it left: %v, want ErrPeerGone (c itself would answer: it is still there)", err)
	}
}
