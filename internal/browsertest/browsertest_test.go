package browsertest

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
)

// TestChromiumInNamespace checks the recipe the browser tests stand on: inside the loopback-only
// namespace, Chromium loads a page from 127.0.0.1, finds a WebGPU adapter, and gathers a
// loopback ICE candidate.
func TestChromiumInNamespace(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: starts Chromium")
	}
	if !InLoopbackNamespace(t) {
		return
	}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/html")
		w.Write([]byte("<!doctype html><title>ok</title>"))
	}))
	defer srv.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	b := Start(t, ctx, Options{WebGPU: true, WebRTC: true})
	if err := chromedp.Do(b.Ctx, chromedp.Navigate(srv.URL)); err != nil {
		t.Fatal(err)
	}
	adapter, err := chromedp.Run(b.Ctx, chromedp.Evaluate[string](`(async () => {
		const a = await navigator.gpu?.requestAdapter();
		return a ? (a.info?.architecture || 'unknown') + (a.info?.isFallbackAdapter ? ' (fallback)' : '') : 'none';
	})()`, chromedp.EvalAwaitPromise))
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("WebGPU adapter: %s", adapter)
	if adapter == "none" {
		t.Error("no WebGPU adapter with --enable-unsafe-webgpu")
	}
	cand, err := chromedp.Run(b.Ctx, chromedp.Evaluate[string](`new Promise((resolve) => {
		const pc = new RTCPeerConnection();
		pc.createDataChannel('x');
		const found = [];
		pc.onicecandidate = (e) => { if (e.candidate) found.push(e.candidate.address); else resolve(found.join(',')); };
		pc.createOffer().then((o) => pc.setLocalDescription(o));
	})`, chromedp.EvalAwaitPromise))
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("ICE candidates: %s", cand)
	if cand == "" {
		t.Error("Chromium gathered no ICE candidate on loopback")
	}
	for _, e := range b.Errors() {
		t.Errorf("page: %s", e)
	}
}
