package coordinator

import (
	"context"
	"log/slog"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/chromedp/chromedp"

	"github.com/shoal-ml/shoal/client"
	"github.com/shoal-ml/shoal/internal/browsertest"
	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/kernels"
	"github.com/shoal-ml/shoal/local"
)

// pairRecorder wraps the page's RTCPeerConnection so that every connection the tab makes
// records, once connected, the configuration it was given and the candidate pair its transport
// selected (RTCPeerConnection.getStats: the transport's selectedCandidatePairId and the pair's
// local and remote candidates).
const pairRecorder = `(() => {
	window.turnPairs = [];
	const PC = window.RTCPeerConnection;
	window.RTCPeerConnection = function (config) {
		const pc = new PC(config);
		let done = false;
		pc.addEventListener('connectionstatechange', async () => {
			if (done || pc.connectionState !== 'connected') return;
			done = true;
			const stats = await pc.getStats();
			let pair = null;
			stats.forEach((s) => { if (s.type === 'transport' && s.selectedCandidatePairId) pair = stats.get(s.selectedCandidatePairId); });
			const cand = (id) => { const c = id && stats.get(id); return c ? { type: c.candidateType, address: c.address, url: c.url || '', protocol: c.protocol } : null; };
			window.turnPairs.push({
				policy: (config && config.iceTransportPolicy) || 'all',
				servers: ((config && config.iceServers) || []).flatMap((s) => [].concat(s.urls)),
				local: pair && cand(pair.localCandidateId), remote: pair && cand(pair.remoteCandidateId),
				bytes: pair ? pair.bytesSent + pair.bytesReceived : 0,
			});
		});
		return pc;
	};
	window.RTCPeerConnection.prototype = PC.prototype;
	return true;
})()`

// TestBrowserWorkerTURN: a tab whose direct ICE is impossible — the coordinator hands out
// relay-only ICE, so neither the tab nor its native neighbours offer a host candidate — holds
// the middle of three stages, and its data links go through the coordinator's own TURN server
// (on loopback) rather than the WebSocket relay: both its connections selected a pair of relayed
// candidates from that server, the TURN relays carried the job's tensors, no frame went through
// the hub, and the losses and the final checkpoint equal the single process's bit for bit.
// Without the TURN server (or with the old loopback mode, which dropped every ICE server) the
// links cannot connect and fall back to the WebSocket relay.
func TestBrowserWorkerTURN(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: builds the wasm worker, starts Chromium and trains a job")
	}
	if _, err := os.Stat(browsertest.ChromiumPath); err != nil {
		t.Skipf("no Chromium at %s (apt-get install chromium): %v", browsertest.ChromiumPath, err)
	}
	if !browsertest.InLoopbackNamespace(t) {
		return
	}
	wasmDir := buildWasmDir(t)
	deadline := time.Now().Add(10 * time.Minute)
	if d, ok := t.Deadline(); ok {
		deadline = d.Add(-10 * time.Second)
	}
	ctx, cancel := context.WithDeadline(context.Background(), deadline)
	defer cancel()
	b := browsertest.Start(t, ctx, browsertest.Options{WebRTC: true})

	// The tab computes with the pure-Go kernels: so do the natives and the reference here.
	was := kernels.ISA()
	if err := kernels.SetISA(kernels.PureGo); err != nil {
		t.Fatal(err)
	}
	defer kernels.SetISA(was)
	natives := []string{"a-native-0", "z-native-2"}
	spec := tinyJob(t, 4)
	spec.Plan = &job.Plan{Stages: [][2]int{{0, 1}, {1, 3}, {3, 4}}}
	spec.Data = fixedCorpus(t)
	want, ref := localReports(t, spec)

	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	var mu sync.Mutex
	var reports []local.Report
	outDir := t.TempDir()
	srv, err := New(ctx, Config{DataDir: t.TempDir(), Job: &spec, Loopback: true, MinWorkers: len(natives) + 1,
		TURN: &TURNConfig{Listen: "127.0.0.1:0"}, ICERelayOnly: true,
		Settle: 200 * time.Millisecond, OutDir: outDir, Logger: log, WasmDir: wasmDir,
		OnStep: func(r local.Report) {
			mu.Lock()
			defer mu.Unlock()
			reports = append(reports, r)
		}})
	if err != nil {
		t.Fatal(err)
	}
	hs := httptest.NewServer(srv.Handler())
	wctx, stopWorkers := context.WithCancel(ctx)
	var workers sync.WaitGroup
	defer func() {
		chromedp.Do(b.Ctx, chromedp.Navigate("about:blank"))
		stopWorkers()
		workers.Wait()
		hs.Close()
		srv.Close()
	}()
	for _, id := range natives {
		workers.Go(func() {
			client.RunWorker(wctx, client.WorkerConfig{Coordinator: hs.URL, MemoryBytes: 1 << 30, Logger: log, Name: id,
				WorkerID: id, BackoffBase: 20 * time.Millisecond, BackoffMax: 200 * time.Millisecond, ICETimeout: time.Minute})
		})
	}
	runErr := make(chan error, 1)
	go func() { runErr <- srv.Run(ctx) }()
	if err := chromedp.Do(b.Ctx, chromedp.Navigate(hs.URL+"/?backend=cpu"), chromedp.WaitEnabled(chromedp.ID("btn-start"))); err != nil {
		t.Fatal(err)
	}
	if _, err := chromedp.Run(b.Ctx, chromedp.Evaluate[bool](pairRecorder)); err != nil {
		t.Fatal(err)
	}
	if err := chromedp.Do(b.Ctx, chromedp.Click(chromedp.ID("btn-start"))); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-runErr:
		if err != nil {
			t.Fatalf("job loop: %v", err)
		}
	case <-ctx.Done():
		t.Fatalf("the job did not finish: %v", ctx.Err())
	}

	mu.Lock()
	got := append([]local.Report(nil), reports...)
	mu.Unlock()
	sameReports(t, got, want)
	assertModelFile(t, outDirCheckpoint(outDir, ref.Step), ref)

	var relayed int64
	tab := ""
	for _, w := range srv.hub.Workers() {
		relayed += w.RelaySent
		if w.Hello != nil && w.Hello.Name != natives[0] && w.Hello.Name != natives[1] {
			tab = w.ID
		}
	}
	if tab == "" || !stageHeldBy(srv, 1, tab) {
		t.Fatalf("the tab (%q) does not hold stage 1 in plan %+v", tab, srv.status.Load().Plan)
	}
	if relayed != 0 {
		t.Errorf("%d bytes went through the WebSocket relay; the links should go through TURN", relayed)
	}
	if n := srv.TURNRelayedBytes(); n < 1<<16 {
		t.Errorf("the TURN relays sent %d bytes", n)
	} else {
		t.Logf("the TURN relays sent %d bytes on", n)
	}

	type candidate struct{ Type, Address, URL, Protocol string }
	type pair struct {
		Policy        string
		Servers       []string
		Local, Remote *candidate
		Bytes         float64
	}
	pairs, err := chromedp.Run(b.Ctx, chromedp.Evaluate[[]pair](`window.turnPairs`))
	if err != nil {
		t.Fatal(err)
	}
	turnURL := strings.TrimSuffix(srv.turn.URL(), "?transport=udp")
	if len(pairs) != 2 {
		t.Errorf("the tab connected %d times (%+v), want its 2 neighbours", len(pairs), pairs)
	}
	for i, p := range pairs {
		t.Logf("connection %d: policy %s, servers %q, local %+v, remote %+v, %.0f bytes", i, p.Policy, p.Servers, p.Local, p.Remote, p.Bytes)
		if p.Policy != "relay" || len(p.Servers) != 1 || !strings.HasPrefix(p.Servers[0], turnURL) {
			t.Errorf("connection %d was configured with policy %q and servers %q; want relay through %s", i, p.Policy, p.Servers, turnURL)
		}
		if p.Local == nil || p.Remote == nil || p.Local.Type != "relay" || p.Remote.Type != "relay" ||
			p.Local.Address != "127.0.0.1" || !strings.HasPrefix(p.Local.URL, turnURL) {
			t.Errorf("connection %d selected %+v → %+v; want relayed candidates from %s on both ends", i, p.Local, p.Remote, turnURL)
		}
	}
}

// outDirCheckpoint is where Config.OutDir receives the whole-model file of step's checkpoint.
func outDirCheckpoint(dir string, step int) string {
	return filepath.Join(dir, local.CheckpointName(step))
}

// stageHeldBy reports whether worker id holds stage i of the plan that ran.
func stageHeldBy(s *Server, i int, id string) bool {
	p := s.status.Load().Plan
	return p != nil && len(p.Stages) > i && p.Stages[i].Peer == id
}
