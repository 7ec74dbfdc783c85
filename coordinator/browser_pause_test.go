package coordinator

import (
	"context"
	"log/slog"
	"net/http/httptest"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/cdproto/cdp"
	"github.com/chromedp/cdproto/page"
	"github.com/chromedp/chromedp"

	"github.com/shoal-ml/shoal/internal/browsertest"
)

// fakePower stands in for what a test cannot change in a headless browser: the Battery API's
// manager (Chromium's, faked so that the test can unplug it) and the page's visibility.
const fakePower = `(() => {
	const b = new EventTarget();
	b.charging = true;
	b.level = 1;
	window.fakeBattery = b;
	Object.defineProperty(Navigator.prototype, 'getBattery', { value: () => Promise.resolve(b), configurable: true });
	window.fakeHidden = false;
	Object.defineProperty(Document.prototype, 'visibilityState', { get: () => (window.fakeHidden ? 'hidden' : 'visible'), configurable: true });
})()`

// TestContribPausePolicy: on the contributor page the tab's pause choices are kept in the
// browser and honoured. With "while on battery" ticked, the tab unplugged leaves at the job's
// next step boundary (proto.Leaving, then its Bye, both saying it paused) and plugged in again
// joins by itself; with "while hidden" ticked, hiding the tab does
// the same. A Stop while paused stays stopped.
func TestContribPausePolicy(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: builds the wasm worker and starts Chromium")
	}
	if _, err := os.Stat(browsertest.ChromiumPath); err != nil {
		t.Skipf("no Chromium at %s (apt-get install chromium): %v", browsertest.ChromiumPath, err)
	}
	if !browsertest.InLoopbackNamespace(t) {
		return
	}
	wasmDir := buildWasmDir(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	b := browsertest.Start(t, ctx, browsertest.Options{WebRTC: true})
	spec := tinyJob(t, 4)
	tabEvents := make(chan string, 64)
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	// The job waits for a second worker that never comes: the tab joins and stays a standby.
	srv, err := New(ctx, Config{DataDir: t.TempDir(), Job: &spec, Loopback: true, MinWorkers: 2,
		Settle: 200 * time.Millisecond, OutDir: t.TempDir(), Logger: log, WasmDir: wasmDir,
		OnEvent: func(kind, worker, detail string) {
			if kind == "worker.joined" || kind == "worker.leaving" || kind == "worker.left" {
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
	defer func() {
		chromedp.Do(b.Ctx, chromedp.Navigate("about:blank"))
		hs.Close()
		srv.Close()
	}()
	go srv.Run(ctx)
	waitTab := func(kind string) string {
		t.Helper()
		for {
			select {
			case ev := <-tabEvents:
				if strings.HasPrefix(ev, kind+" ") {
					return ev
				}
			case <-ctx.Done():
				t.Fatalf("no %s from the tab: %v", kind, ctx.Err())
			}
		}
	}
	eval := func(js string) {
		t.Helper()
		if _, err := chromedp.Run(b.Ctx, chromedp.Evaluate[any](js)); err != nil {
			t.Fatalf("%s: %v", js, err)
		}
	}
	state := func(want string) {
		t.Helper()
		cond := `document.getElementById('state').dataset.state === ` + "'" + want + "'"
		if _, err := chromedp.Run(b.Ctx, chromedp.Poll[bool](cond, chromedp.WithPollingTimeout(time.Minute))); err != nil {
			got, _ := chromedp.Run(b.Ctx, chromedp.Text(chromedp.ID("state")))
			t.Fatalf("the page's state is %q, want %s: %v", got, want, err)
		}
	}
	if err := chromedp.Do(b.Ctx, chromedp.Func(func(ctx context.Context, tg *chromedp.Target) error {
		_, err := cdp.Call(ctx, tg, page.AddScriptToEvaluateOnNewDocument, page.AddScriptToEvaluateOnNewDocumentParams{Source: fakePower})
		return err
	})); err != nil {
		t.Fatal(err)
	}
	if err := chromedp.Do(b.Ctx, chromedp.Navigate(hs.URL+"/?backend=cpu"), chromedp.WaitEnabled(chromedp.ID("btn-start")),
		chromedp.WaitEnabled(chromedp.ID("pause-battery")), chromedp.Click(chromedp.ID("pause-battery")),
		chromedp.Click(chromedp.ID("btn-start"))); err != nil {
		t.Fatal(err)
	}
	t.Log(waitTab("worker.joined"))
	state("joined")

	eval(`fakeBattery.charging = false; fakeBattery.dispatchEvent(new Event('chargingchange'))`)
	// A pause is a leave at the job's next step boundary, not a Bye at once.
	if ev := waitTab("worker.leaving"); !strings.Contains(ev, "paused: on battery") {
		t.Errorf("the tab asked to leave with %q, want a pause on battery", ev)
	}
	if ev := waitTab("worker.left"); !strings.Contains(ev, "paused: on battery") {
		t.Errorf("the tab left with %q, want a pause on battery", ev)
	}
	state("paused")
	eval(`fakeBattery.charging = true; fakeBattery.dispatchEvent(new Event('chargingchange'))`)
	t.Log(waitTab("worker.joined"))
	state("joined")

	// The choice is kept: a reload shows it ticked, and "while hidden" joins it.
	if err := chromedp.Do(b.Ctx, chromedp.Reload(), chromedp.WaitEnabled(chromedp.ID("btn-start"))); err != nil {
		t.Fatal(err)
	}
	kept, err := chromedp.Run(b.Ctx, chromedp.Evaluate[bool](`document.getElementById('pause-battery').checked && !document.getElementById('pause-hidden').checked`))
	if err != nil {
		t.Fatal(err)
	}
	if !kept {
		t.Error("the pause choices were not kept across a reload")
	}
	waitTab("worker.left") // the reload's pagehide
	if err := chromedp.Do(b.Ctx, chromedp.Click(chromedp.ID("pause-hidden")), chromedp.Click(chromedp.ID("btn-start"))); err != nil {
		t.Fatal(err)
	}
	waitTab("worker.joined")
	state("joined")
	eval(`fakeHidden = true; document.dispatchEvent(new Event('visibilitychange'))`)
	if ev := waitTab("worker.leaving"); !strings.Contains(ev, "paused: the tab is hidden") {
		t.Errorf("the tab asked to leave with %q, want a pause while hidden", ev)
	}
	if ev := waitTab("worker.left"); !strings.Contains(ev, "paused: the tab is hidden") {
		t.Errorf("the tab left with %q, want a pause while hidden", ev)
	}
	state("paused")
	// Stop while paused: the tab stays stopped when it is shown again.
	if err := chromedp.Do(b.Ctx, chromedp.Click(chromedp.ID("btn-stop"))); err != nil {
		t.Fatal(err)
	}
	eval(`fakeHidden = false; document.dispatchEvent(new Event('visibilitychange'))`)
	state("stopped")
	select {
	case ev := <-tabEvents:
		if strings.HasPrefix(ev, "worker.joined ") {
			t.Errorf("a tab stopped while paused joined again: %s", ev)
		}
	default:
	}
	for _, e := range b.Errors() {
		t.Errorf("page: %s", e)
	}
}
