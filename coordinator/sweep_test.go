package coordinator

import (
	"bytes"
	"context"
	"crypto/rand"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/coder/websocket"

	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/local"
	"github.com/shoal-ml/shoal/proto"
	"github.com/shoal-ml/shoal/safetensors"
	"github.com/shoal-ml/shoal/storage"
)

// TestSweep is the malformed-input sweep of issue 14 against a running coordinator served as
// `shoal serve` serves it (NewHTTPServer, LimitListener): while two workers train, it opens 500
// WebSockets at once that ask to join, holds slow connections (half a header, no hello, an
// upload that stalls), and sends oversized, truncated and garbage messages and frames, forged
// and oversized uploads. The coordinator keeps serving /api/status, its memory stays bounded,
// the job trains to the single process's parameters, and the store holds nothing the attacks
// sent. `go test -run TestSweep -v ./coordinator/` prints the figures.
func TestSweep(t *testing.T) {
	spec := tinyJob(t, 60)
	spec.CheckpointEvery = 20
	spec.Plan = &job.Plan{Stages: [][2]int{{0, 2}, {2, 4}}}
	_, ref := localReports(t, spec)
	var lis *Listener
	newTestHTTP = func(h http.Handler) *httptest.Server {
		hs := httptest.NewUnstartedServer(nil)
		hs.Config = NewHTTPServer(h, HTTPLimits{ReadHeaderTimeout: time.Second})
		lis = LimitListener(hs.Listener, ConnLimits{Max: 1024, PerIP: 256})
		hs.Listener = lis
		hs.Start()
		return hs
	}
	clusterConfig = func(cfg *Config) { cfg.HelloTimeout = 2 * time.Second }
	defer func() { newTestHTTP, clusterConfig = httptest.NewServer, nil }()

	c := startCluster(t, spec, 2, false)
	addr := strings.TrimPrefix(c.http.URL, "http://")
	wsURL := "ws://" + addr + "/ws"
	var (
		joined, busy, refusedTCP, otherJoin atomic.Int64
		maxStatus                           atomic.Int64 // ns
		statusFails                         atomic.Int64
	)
	var ms runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&ms)
	heapBefore := ms.HeapInuse
	var heapPeak atomic.Uint64
	var peakWorkers atomic.Int64
	sample := func() {
		if n := int64(len(c.srv.hub.Workers())); n > peakWorkers.Load() {
			peakWorkers.Store(n)
		}
		var m runtime.MemStats
		runtime.ReadMemStats(&m)
		for {
			p := heapPeak.Load()
			if m.HeapInuse <= p || heapPeak.CompareAndSwap(p, m.HeapInuse) {
				return
			}
		}
	}

	hello := func(name string) []byte {
		b, _ := proto.EncodeMessage(&proto.Hello{Kind: proto.WorkerNative, Backend: proto.BackendCPU, GFLOPS: 1, MemoryBytes: 1, Threads: 1, Name: name})
		return b
	}
	dial := func(ctx context.Context) (*websocket.Conn, error) {
		ws, _, err := websocket.Dial(ctx, wsURL, nil)
		if err != nil {
			refusedTCP.Add(1)
		}
		return ws, err
	}
	// join sends a hello and sorts the answer.
	join := func(ctx context.Context, ws *websocket.Conn, name string) {
		if ws.Write(ctx, websocket.MessageText, hello(name)) != nil {
			refusedTCP.Add(1)
			return
		}
		_, b, err := ws.Read(ctx)
		if err != nil {
			refusedTCP.Add(1)
			return
		}
		switch m, _ := proto.DecodeMessage(b, proto.RoleWorker); m := m.(type) {
		case *proto.Welcome:
			joined.Add(1)
		case *proto.Error:
			if m.Code == proto.ErrCodeBusy {
				busy.Add(1)
			} else {
				otherJoin.Add(1)
			}
		default:
			otherJoin.Add(1)
		}
	}

	stop := make(chan struct{})
	var wg sync.WaitGroup
	// The dashboard's view of the job, polled throughout from another loopback address (an
	// admin is not the flood's address, whose connections the per-address cap refuses): it
	// must keep answering.
	admin := &http.Client{Transport: &http.Transport{DialContext: (&net.Dialer{
		LocalAddr: &net.TCPAddr{IP: net.IPv4(127, 0, 0, 2)}}).DialContext}}
	defer admin.CloseIdleConnections()
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			case <-time.After(20 * time.Millisecond):
			}
			sample()
			t0 := time.Now()
			resp, err := admin.Get(c.http.URL + "/api/status")
			if err != nil || resp.StatusCode != http.StatusOK {
				statusFails.Add(1)
				if resp != nil {
					resp.Body.Close()
				}
				continue
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if d := int64(time.Since(t0)); d > maxStatus.Load() {
				maxStatus.Store(d)
			}
		}
	}()

	var during, attacking atomic.Int64 // steps completed while the attack ran; whether it runs
	attack := func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		var aw sync.WaitGroup
		// sockets runs f on n WebSockets at once.
		sockets := func(n int, f func(ws *websocket.Conn, i int)) {
			for i := range n {
				aw.Add(1)
				go func() {
					defer aw.Done()
					ws, err := dial(ctx)
					if err != nil {
						return
					}
					defer ws.CloseNow()
					f(ws, i)
				}()
			}
		}
		// 500 WebSockets at once, each asking to join and holding on for a second — and, on a
		// machine slow enough that no step fits in that second, until one step has completed
		// under the flood (at most 20 s): the property is that training goes on while the flood
		// lasts, not that a step beats a second's flood on a loaded machine.
		sockets(500, func(ws *websocket.Conn, i int) {
			join(ctx, ws, fmt.Sprint("flood-", i))
			time.Sleep(time.Second)
			for wait := time.Now().Add(20 * time.Second); during.Load() == 0 && time.Now().Before(wait); {
				time.Sleep(50 * time.Millisecond)
			}
		})
		// Slow clients: half a request header; a WebSocket that never says hello; an upload
		// that stalls after its headers.
		sockets(50, func(ws *websocket.Conn, _ int) {
			ws.Read(ctx) // the hub closes it after HelloTimeout
		})
		for range 50 {
			aw.Add(2)
			go func() {
				defer aw.Done()
				nc, err := net.Dial("tcp", addr)
				if err != nil {
					return
				}
				defer nc.Close()
				nc.Write([]byte("GET /api/status HTTP/1.1\r\nHost: x\r\nX-Slow: "))
				nc.SetReadDeadline(time.Now().Add(10 * time.Second))
				io.Copy(io.Discard, nc) // returns when the server cuts it
			}()

			go func() {
				defer aw.Done()
				nc, err := net.Dial("tcp", addr)
				if err != nil {
					return
				}
				defer nc.Close()
				fmt.Fprintf(nc, "POST /api/checkpoints/1/shards/stage-0 HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000\r\n\r\n")
				nc.Write(make([]byte, 1000))
				nc.SetReadDeadline(time.Now().Add(10 * time.Second))
				io.Copy(io.Discard, nc)
			}()
		}
		// Malformed messages and frames from joined connections (each is dropped for it).
		st := c.srv.status.Load()
		target := ""
		if st.Plan != nil && len(st.Plan.Stages) > 1 {
			target = st.Plan.Stages[1].Peer
		}
		huge := proto.FrameHeader{TensorKey: proto.TensorKey{Kind: proto.KindActivation, PlanVersion: st.Plan.Version, Step: 99, Block: 2, Expert: proto.NoExpert},
			DType: proto.F32, Shape: proto.Shape{64 << 20, 1, 1, 1}, ChunkCount: 1024}
		hugeFrame, _ := proto.AppendFrame(nil, huge, make([]byte, proto.MaxChunkPayload), proto.Limits{MaxTensorBytes: 1 << 30})
		relayHuge, _ := proto.AppendRelay(nil, target, hugeFrame)
		junk := make([]byte, 4096)
		rand.Read(junk)
		bad := [][2]any{
			{websocket.MessageText, make([]byte, proto.MaxMessageSize+10)},
			{websocket.MessageText, []byte(`{"v":18,"type":"step_report","body":{"step":`)},
			{websocket.MessageText, junk},
			{websocket.MessageBinary, junk},
			{websocket.MessageBinary, relayHuge[:len(relayHuge)/2]},
			{websocket.MessageBinary, relayHuge},
			{websocket.MessageBinary, []byte{}},
		}
		sockets(140, func(ws *websocket.Conn, i int) {
			join(ctx, ws, "garbage")
			b := bad[i%len(bad)]
			ws.Write(ctx, b[0].(websocket.MessageType), b[1].([]byte))
			ws.Read(ctx)
		})
		// Uploads: anonymous, forged credential, HTML, oversized.
		for i, body := range [][]byte{[]byte("<html><script>alert(1)</script></html>"), bytes.Repeat([]byte{0}, 1<<20)} {
			for _, auth := range []string{"", "Bearer " + strings.Repeat("A", 43)} {
				req, _ := http.NewRequestWithContext(ctx, "POST", fmt.Sprintf("%s/api/checkpoints/%d/shards/stage-0", c.http.URL, i+1), bytes.NewReader(body))
				if auth != "" {
					req.Header.Set("Authorization", auth)
				}
				if resp, err := http.DefaultClient.Do(req); err == nil {
					if resp.StatusCode/100 == 2 {
						t.Errorf("upload %d with %q accepted: %s", i, auth, resp.Status)
					}
					resp.Body.Close()
				}
			}
		}
		aw.Wait()
	}
	var once sync.Once
	attacked := make(chan struct{})
	c.onStep = func(r local.Report) {
		if attacking.Load() == 1 {
			during.Add(1)
		}
		if r.Step == 1 {
			once.Do(func() {
				attacking.Store(1)
				go func() { attack(); attacking.Store(0); close(attacked) }()
			})
		}
	}
	t0 := time.Now()
	c.run(t)
	<-attacked
	close(stop)
	wg.Wait()
	sample()
	runtime.GC()
	runtime.ReadMemStats(&ms)
	assertFinalCheckpoint(t, c, ref)
	if err := c.srv.db.Check(context.Background()); err != nil {
		t.Fatalf("store after the sweep: %v", err)
	}
	for _, kind := range []string{"step.abandoned", "plan.failed"} {
		if evs, _ := c.srv.db.ListEvents(context.Background(), storage.EventFilter{Kind: kind}); len(evs) != 0 {
			t.Errorf("%d %s events: the sweep disturbed training: %s", len(evs), kind, evs[0].Message)
		}
	}
	// Every blob on disk is one a checkpoint references (or an assembled model file): none of the
	// uploads above left a byte.
	refd, err := c.srv.db.ReferencedBlobs(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	var stray []string
	filepath.Walk(c.srv.blobs.Dir(), func(p string, fi os.FileInfo, err error) error {
		if err != nil || fi.IsDir() || refd[fi.Name()] {
			return nil
		}
		// Not referenced by a checkpoint's shards: it must be an assembled whole-model file.
		b, _ := os.ReadFile(p)
		if _, meta, err := safetensors.Read(b); err != nil || meta["step"] == "" {
			stray = append(stray, fi.Name())
		}
		return nil
	})
	if len(stray) > 0 {
		t.Errorf("blobs nobody references: %v", stray)
	}
	workers, _ := c.srv.db.ListWorkers(context.Background())
	if statusFails.Load() > 0 {
		t.Errorf("/api/status failed %d times during the sweep", statusFails.Load())
	}
	if n := peakWorkers.Load(); n > 64 {
		t.Errorf("%d workers connected at once: the per-address cap is 64", n)
	}
	cs := lis.Stats()
	if during.Load() == 0 {
		t.Error("no step completed while the sweep ran")
	}
	t.Logf("sweep: job of %d steps done in %v, %d of them during the sweep; 500 joins at once: %d welcomed, %d refused busy, %d other; %d connections refused or cut at TCP; listener refused %d (total cap) + %d (per address)",
		spec.Steps, time.Since(t0).Round(time.Millisecond), during.Load(), joined.Load(), busy.Load(), otherJoin.Load(), refusedTCP.Load(), cs.RefusedTotal, cs.RefusedPerIP)
	t.Logf("sweep: at most %d workers connected at once (cap 64 per address)", peakWorkers.Load())
	t.Logf("sweep: /api/status slowest answer %v, %d failures; heap in use %d MiB before, peak %d MiB, %d MiB after GC; %d worker rows stored",
		time.Duration(maxStatus.Load()).Round(time.Millisecond), statusFails.Load(), heapBefore>>20, heapPeak.Load()>>20, ms.HeapInuse>>20, len(workers))
	if peak := heapPeak.Load(); peak > heapBefore+512<<20 {
		t.Errorf("heap peaked at %d MiB (from %d MiB): memory is not bounded", peak>>20, heapBefore>>20)
	}
}
