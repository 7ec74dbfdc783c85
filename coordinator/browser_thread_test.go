package coordinator

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http/httptest"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/chromedp/cdproto/browser"
	"github.com/chromedp/cdproto/cdp"
	"github.com/chromedp/chromedp"

	"github.com/shoal-ml/shoal/client"
	"github.com/shoal-ml/shoal/internal/browsertest"
	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/local"
)

// TestBrowserWorkerThread checks that the browser worker computes off the page's main thread and
// that Stop and Start work any number of times without a reload. The tab holds the middle of
// three stages, on each backend, while the page records its long tasks (the Long Tasks API: any
// task of the page's thread over 50 ms): there must be none, from Start — the backend benchmark
// included — to the job's last step. Then, on WebGPU, the tab is stopped and started three times
// mid-job: each Start must rejoin and the job, which needs the tab, must finish.
func TestBrowserWorkerThread(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: builds the wasm worker, starts Chromium and trains three jobs")
	}
	if _, err := os.Stat(browsertest.ChromiumPath); err != nil {
		t.Skipf("no Chromium at %s (apt-get install chromium): %v", browsertest.ChromiumPath, err)
	}
	if !browsertest.InLoopbackNamespace(t) {
		return
	}
	wasmDir := buildWasmDir(t)
	deadline := time.Now().Add(20 * time.Minute)
	if d, ok := t.Deadline(); ok {
		deadline = d.Add(-10 * time.Second)
	}
	ctx, cancel := context.WithDeadline(context.Background(), deadline)
	defer cancel()
	b := browsertest.Start(t, ctx, browsertest.Options{WebGPU: true, WebRTC: true})
	// "" is the tab's own choice: on Chromium's software adapter (SwiftShader), the CPU.
	for _, backend := range []string{"cpu", "webgpu", ""} {
		t.Run("long-tasks-"+cmp.Or(backend, "auto"), func(t *testing.T) {
			caseCtx, cancel := context.WithTimeout(ctx, browserCaseTimeout)
			defer cancel()
			tasks, busy := runThreadCase(t, caseCtx, b, wasmDir, backend, 0, false)
			// A page task stretched past 50 ms by a starved CPU says nothing about the page: on a
			// machine with other work running, the bar is the share of the time the page's
			// thread was held (the worker on the page's thread held it 23–64%). The threshold is
			// half the cores busy, not all of them: the load average trails a burst, and with this
			// test alone running (Chromium, the coordinator, two workers) a 61 ms task handling
			// a peer connection message failed at 0.9% of the time.
			if load, ok := loadPerCPU(); ok && load >= 0.5 {
				t.Logf("load %.1f per CPU: long tasks are not held to 50 ms; the page's thread was held %.1f%% of the time", load, 100*busy)
				if busy > 0.1 {
					t.Errorf("the page's thread was held %.1f%% of the time while the tab computed on %q (long tasks: %q); want under 10%%",
						100*busy, backend, tasks)
				}
			} else if len(tasks) > 0 {
				t.Errorf("the page's thread had %d long tasks while the tab computed on %q: %q; want none over 50 ms",
					len(tasks), backend, tasks)
			}
		})
	}
	t.Run("restart-webgpu", func(t *testing.T) {
		caseCtx, cancel := context.WithTimeout(ctx, browserCaseTimeout)
		defer cancel()
		runThreadCase(t, caseCtx, b, wasmDir, "webgpu", 3, false)
	})
	// Last, since it crashes the browser's GPU process: a tab computing on WebGPU whose device
	// is lost mid-job (Browser.crashGpuProcess, what a driver reset or a GPU process crash does
	// to a contributor's tab) leaves, joins again on the CPU kernels, and the job finishes.
	t.Run("gpu-lost", func(t *testing.T) {
		caseCtx, cancel := context.WithTimeout(ctx, browserCaseTimeout)
		defer cancel()
		runThreadCase(t, caseCtx, b, wasmDir, "webgpu", 0, true)
	})
	for _, e := range b.Errors() {
		t.Errorf("page: %s", e)
	}
}

// longTaskObserver records the duration of every long task of the page's thread from now on.
// It also notes when each message from the worker's thread arrived, so that a failure can say
// what the page was handling.
const longTaskObserver = `(() => {
	window.longTasks = [];
	window.longTaskMS = 0;
	window.observedSince = performance.now();
	window.workerMessages = [];
	new PerformanceObserver((l) => {
		for (const e of l.getEntries()) {
			window.longTaskMS += e.duration;
			const during = window.workerMessages.filter(([t]) => t >= e.startTime - 1 && t <= e.startTime + e.duration).map(([, k]) => k);
			window.longTasks.push(Math.round(e.duration) + ' ms at ' + Math.round(e.startTime) + ' (' + during.join(' ') + ')');
		}
	}).observe({ type: 'longtask' });
	const W = window.Worker;
	window.Worker = function (url, opts) {
		const w = new W(url, opts);
		w.addEventListener('message', (e) => window.workerMessages.push([performance.now(), e.data.type || e.data.op]));
		return w;
	};
	return true;
})()`

// runThreadCase runs a job whose middle stage is the tab's, computed on backend; restarts > 0
// stops the tab and starts it again that many times, two steps apart; loseGPU crashes the
// browser's GPU process two steps in, and the tab must leave for it and join again on the CPU.
// It returns the page's long tasks from the first Start to the tab's last step, and the share of
// that time they took.
func runThreadCase(t *testing.T, ctx context.Context, b *browsertest.Browser, wasmDir, backend string, restarts int, loseGPU bool) ([]string, float64) {
	natives := []string{"a-native-0", "z-native-2"}
	spec := tinyJob(t, 4)
	if loseGPU {
		spec = tinyJob(t, 8)
		spec.CheckpointEvery = 2
	}
	if restarts > 0 {
		spec = tinyJob(t, 2*restarts+4)
		spec.CheckpointEvery = 2
	}
	spec.Plan = &job.Plan{Stages: [][2]int{{0, 1}, {1, 3}, {3, 4}}}
	spec.Data = fixedCorpus(t)
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	var mu sync.Mutex
	steps := 0
	stepped := make(chan int, 256)
	tabEvents := make(chan string, 64) // "worker.joined ID" and "worker.left ID detail" of the tab
	srv, err := New(ctx, Config{DataDir: t.TempDir(), Job: &spec, Loopback: true, MinWorkers: len(natives) + 1,
		Settle: 200 * time.Millisecond, OutDir: t.TempDir(), Logger: log, WasmDir: wasmDir,
		OnStep: func(local.Report) {
			mu.Lock()
			steps++
			n := steps
			mu.Unlock()
			select {
			case stepped <- n:
			default:
			}
		},
		OnEvent: func(kind, worker, detail string) {
			if (kind == "worker.joined" || kind == "worker.left") && !slices.Contains(natives, worker) {
				select {
				case tabEvents <- kind + " " + worker + " " + detail:
				default:
				}
			}
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
				WorkerID: id, BackoffBase: 20 * time.Millisecond, BackoffMax: 200 * time.Millisecond})
		})
	}
	// The job runs (and waits for the tab) before the page loads, so that the page's status
	// carries the job's model, which the tab's benchmark times.
	runErr := make(chan error, 1)
	go func() { runErr <- srv.Run(ctx) }()
	if err := chromedp.Do(b.Ctx, chromedp.Navigate(hs.URL+"/?backend="+backend), chromedp.WaitEnabled(chromedp.ID("btn-start"))); err != nil {
		t.Fatal(err)
	}
	if _, err := chromedp.Run(b.Ctx, chromedp.Poll[bool](`!!(window.shoalPage.coord && window.shoalPage.coord.job)`, chromedp.WithPollingTimeout(time.Minute))); err != nil {
		t.Fatal(err)
	}
	if _, err := chromedp.Run(b.Ctx, chromedp.Evaluate[bool](longTaskObserver)); err != nil {
		t.Fatal(err)
	}
	if err := chromedp.Do(b.Ctx, chromedp.Click(chromedp.ID("btn-start"))); err != nil {
		t.Fatal(err)
	}
	waitTab := func(kind string) string {
		t.Helper()
		for {
			select {
			case ev := <-tabEvents:
				if strings.HasPrefix(ev, kind+" ") {
					return ev
				}
			case err := <-runErr:
				t.Fatalf("the job ended (%v) while waiting for the tab's %s", err, kind)
			case <-ctx.Done():
				t.Fatalf("no %s from the tab: %v", kind, ctx.Err())
			}
		}
	}
	waitTab("worker.joined")
	for i := range restarts {
		for n := 0; n < 2*(i+1); {
			select {
			case n = <-stepped:
			case err := <-runErr:
				t.Fatalf("the job ended (%v) before restart %d", err, i+1)
			case <-ctx.Done():
				t.Fatalf("restart %d: %v", i+1, ctx.Err())
			}
		}
		if err := chromedp.Do(b.Ctx, chromedp.Click(chromedp.ID("btn-stop"))); err != nil {
			t.Fatal(err)
		}
		if ev := waitTab("worker.left"); !strings.Contains(ev, "stopped by the contributor") {
			t.Errorf("restart %d: the tab left with %q, want its Bye", i+1, ev)
		}
		if err := chromedp.Do(b.Ctx, chromedp.WaitEnabled(chromedp.ID("btn-start")), chromedp.Click(chromedp.ID("btn-start"))); err != nil {
			t.Fatal(err)
		}
		t.Logf("restart %d: %s", i+1, waitTab("worker.joined"))
	}
	if loseGPU {
		for n := 0; n < 2; {
			select {
			case n = <-stepped:
			case err := <-runErr:
				t.Fatalf("the job ended (%v) before the GPU was lost", err)
			case <-ctx.Done():
				t.Fatalf("before the GPU was lost: %v", ctx.Err())
			}
		}
		if _, err := chromedp.CallBrowser(b.Ctx, browser.CrashGPUProcess, cdp.Empty{}); err != nil {
			t.Fatalf("Browser.crashGpuProcess: %v", err)
		}
		if ev := waitTab("worker.left"); !strings.Contains(ev, "lost") {
			t.Errorf("the tab left with %q after its GPU process crashed, want the device loss as its reason", ev)
		}
		t.Logf("after the GPU process crashed: %s", waitTab("worker.joined"))
		// The page must show the tab as running, so that the contributor can stop it: the
		// first session's "stopped" once disabled Stop while the tab computed on.
		running := `!document.getElementById('btn-stop').disabled && document.getElementById('btn-start').disabled`
		if _, err := chromedp.Run(b.Ctx, chromedp.Poll[bool](running, chromedp.WithPollingTimeout(30*time.Second))); err != nil {
			state, _ := chromedp.Run(b.Ctx, chromedp.Text(chromedp.ID("state")))
			t.Fatalf("after the fallback the page shows the tab as %q, Stop not enabled: %v", state, err)
		}
	}
	if err := <-runErr; err != nil {
		t.Fatalf("job loop: %v", err)
	}
	done := fmt.Sprintf(`window.shoalPage.worker && window.shoalPage.worker.last_step && window.shoalPage.worker.last_step.step === %d`, spec.Steps-1)
	if _, err := chromedp.Run(b.Ctx, chromedp.Poll[bool](done, chromedp.WithPollingTimeout(30*time.Second))); err != nil {
		t.Fatalf("the page never showed the tab's last step: %v", err)
	}
	tasks, err := chromedp.Run(b.Ctx, chromedp.Evaluate[[]string](`window.longTasks`))
	if err != nil {
		t.Fatal(err)
	}
	busy, err := chromedp.Run(b.Ctx, chromedp.Evaluate[float64](`window.longTaskMS / (performance.now() - window.observedSince)`))
	if err != nil {
		t.Fatal(err)
	}
	compute, _ := chromedp.Run(b.Ctx, chromedp.Text(chromedp.ID("compute")))
	// On Chromium's software adapter the tab's own choice is the CPU: SwiftShader runs the job's
	// layers slower than the CPU kernels do.
	if backend == "" && strings.Contains(compute, "software fallback") && !strings.HasPrefix(compute, "CPU") {
		t.Errorf("the tab chose %q on a software adapter; want the CPU", compute)
	}
	if loseGPU && (!strings.HasPrefix(compute, "CPU") || !strings.Contains(compute, "lost")) {
		t.Errorf("after the GPU was lost the page says the tab computes on %q; want the CPU, and why", compute)
	}
	problem, _ := chromedp.Run(b.Ctx, chromedp.Evaluate[string](`window.shoalPage.problem`))
	if problem != "" {
		t.Errorf("the page shows a problem: %s", problem)
	}
	t.Logf("computing on %q: %d long tasks on the page, %.1f%% of the time: %q", compute, len(tasks), 100*busy, tasks)
	// The job is over, and its loop with it: the hub hears the last departure.
	if err := chromedp.Do(b.Ctx, chromedp.Click(chromedp.ID("btn-stop"))); err != nil {
		t.Fatal(err)
	}
	for {
		select {
		case ev := <-srv.hub.Events():
			if ev.Kind != EventLeft || slices.Contains(natives, ev.Worker) {
				continue
			}
			if !errors.Is(ev.Err, ErrWorkerLeft) || !strings.Contains(ev.Err.Error(), "stopped by the contributor") {
				t.Errorf("the tab left with %v; want its Bye", ev.Err)
			}
			return tasks, busy
		case <-ctx.Done():
			t.Fatalf("the coordinator heard no departure after the last Stop: %v", ctx.Err())
		}
	}
}

// loadPerCPU is the one-minute load average per CPU, where /proc/loadavg says it.
func loadPerCPU() (float64, bool) {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return 0, false
	}
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return 0, false
	}
	l, err := strconv.ParseFloat(f[0], 64)
	if err != nil {
		return 0, false
	}
	return l / float64(runtime.NumCPU()), true
}
