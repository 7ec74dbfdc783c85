package coordinator

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/chromedp/chromedp"

	"github.com/shoal-ml/shoal/client"
	"github.com/shoal-ml/shoal/internal/browsertest"
	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/local"
)

// TestAuditSoak runs with SHOAL_AUDIT_SOAK=STEPS (and SHOAL_AUDIT_BACKEND=cpu|webgpu, the tab's
// backend: cpu is the pure-Go kernels in wasm), in the environment because the test re-runs itself
// in a loopback-only network namespace, which passes on the environment and not this package's
// flags:
//
//	SHOAL_AUDIT_SOAK=1000 go test ./coordinator -run TestAuditSoak -timeout 60m -v
func auditSoakConfig() (steps int, backend string) {
	steps, _ = strconv.Atoi(os.Getenv("SHOAL_AUDIT_SOAK"))
	backend = os.Getenv("SHOAL_AUDIT_BACKEND")
	if backend == "" {
		backend = "cpu"
	}
	return steps, backend
}

// TestAuditSoak: honest workers only — a native CPU worker and a browser tab — train the tiny job
// with every shard of every step audited (audit_rate 1). No audit may fail: the native stage is
// compared bit for bit, the tab (pure-Go or WebGPU arithmetic against the coordinator's
// AVX kernels) within audit's tolerances. It prints how many audits ran, their cost and the false
// alarms (which must be none). Behind SHOAL_AUDIT_SOAK: 1,000 steps take minutes.
func TestAuditSoak(t *testing.T) {
	soak, backend := auditSoakConfig()
	if soak <= 0 {
		t.Skip("SHOAL_AUDIT_SOAK=STEPS runs it")
	}
	if _, err := os.Stat(browsertest.ChromiumPath); err != nil {
		t.Skipf("no Chromium at %s: %v", browsertest.ChromiumPath, err)
	}
	if !browsertest.InLoopbackNamespace(t) {
		return
	}
	wasmDir := buildWasmDir(t)
	ctx, cancel := context.WithTimeout(context.Background(), 55*time.Minute)
	defer cancel()
	b := browsertest.Start(t, ctx, browsertest.Options{WebGPU: true, WebRTC: true})

	spec := tinyJob(t, soak)
	spec.AuditRate = 1
	spec.CheckpointEvery, spec.ValEvery = 100, 0
	spec.Data = fixedCorpus(t)
	// The tab ("w-…") takes the last stage, after the native "a-native-0".
	spec.Plan = &job.Plan{Stages: [][2]int{{0, 2}, {2, 4}}}
	// The job's log goes to a file (SHOAL_AUDIT_LOG, else the test's temporary directory) at
	// Info: a soak is read afterwards, and the namespace's copy of the test shows its output only
	// when it ends.
	logPath := os.Getenv("SHOAL_AUDIT_LOG")
	if logPath == "" {
		logPath = filepath.Join(t.TempDir(), "soak.log")
	}
	lf, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	defer lf.Close()
	log := slog.New(slog.NewTextHandler(lf, &slog.HandlerOptions{Level: slog.LevelInfo}))
	var mu sync.Mutex
	var failures []string
	steps := 0
	srv, err := New(ctx, Config{DataDir: t.TempDir(), Job: &spec, Loopback: true, MinWorkers: 2,
		Settle: 200 * time.Millisecond, OutDir: t.TempDir(), Logger: log, WasmDir: wasmDir, Recompute: recomputeHere,
		OnStep: func(r local.Report) {
			mu.Lock()
			defer mu.Unlock()
			if steps++; steps%100 == 0 {
				t.Logf("step %d: loss %.4f", r.Step, r.CE)
			}
		},
		OnEvent: func(kind, worker, detail string) {
			if kind == "peer.banned" || kind == "audit.error" || kind == "link.disputed" {
				mu.Lock()
				failures = append(failures, kind+" "+worker+" "+detail)
				mu.Unlock()
			}
		}})
	if err != nil {
		t.Fatal(err)
	}
	hs := newTestHTTP(srv.Handler())
	wctx, stopWorkers := context.WithCancel(ctx)
	var workers sync.WaitGroup
	defer func() {
		chromedp.Do(b.Ctx, chromedp.Navigate("about:blank"))
		stopWorkers()
		workers.Wait()
		hs.Close()
		srv.Close()
	}()
	workers.Go(func() {
		client.RunWorker(wctx, client.WorkerConfig{Coordinator: hs.URL, MemoryBytes: 1 << 30, Logger: log, Name: "native",
			WorkerID: "a-native-0", BackoffBase: 20 * time.Millisecond, BackoffMax: 200 * time.Millisecond})
	})
	if err := chromedp.Do(b.Ctx,
		chromedp.Navigate(hs.URL+"/?backend="+backend),
		chromedp.WaitEnabled(chromedp.ID("btn-start")),
		chromedp.Click(chromedp.ID("btn-start")),
	); err != nil {
		t.Fatal(err)
	}
	began := time.Now()
	if err := srv.Run(ctx); err != nil {
		t.Fatalf("job loop: %v", err)
	}
	wall := time.Since(began)
	a := srv.status.Load().Audit
	if a == nil {
		t.Fatal("no audit summary")
	}
	t.Logf("%d steps in %v with the tab on %s: %d audits (%d passed, %d failed), %.1f s recomputing (%.0f%% of the wall time), compute share %.2f",
		spec.Steps, wall.Round(time.Second), backend, a.Audits, a.Passed, a.Failed, a.RecomputeS, 100*a.RecomputeS/wall.Seconds(), a.ComputeShare)
	// An audited job's unverified work awaits its audit on the contributor page.
	awaiting := `document.getElementById('my-pending-label').textContent === 'Awaiting audit'`
	if _, err := chromedp.Run(b.Ctx, chromedp.Poll[bool](awaiting, chromedp.WithPollingTimeout(10*time.Second))); err != nil {
		t.Errorf("the page does not say the tab's work awaits an audit: %v", err)
	}
	mu.Lock()
	defer mu.Unlock()
	for _, f := range failures {
		t.Errorf("false alarm: %s", f)
	}
	if want := int64(2 * spec.Steps); a.Passed < want-2 || a.Failed != 0 {
		t.Errorf("%d audits passed and %d failed, want about %d passed (every shard of every step) and none failed", a.Passed, a.Failed, want)
	}
}
