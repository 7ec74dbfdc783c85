// Package browsertest starts headless Chromium for Shoal's browser tests, builds the wasm they
// load, and runs a test inside a network namespace that holds only the loopback interface. Its
// flags are the ones that give headless Chromium WebGPU on SwiftShader and loopback WebRTC.
package browsertest

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"strings"
	"sync"
	"testing"

	"github.com/chromedp/cdproto/log"
	cdpruntime "github.com/chromedp/cdproto/runtime"
	"github.com/chromedp/chromedp"
)

// ChromiumPath is Debian's Chromium binary (package chromium); /usr/bin/chromium is a wrapper
// script that adds flags of its own.
const ChromiumPath = "/usr/lib/chromium/chromium"

// netnsEnv marks a test process that runs inside the loopback-only namespace.
const netnsEnv = "SHOAL_TEST_NETNS"

// Options selects what the browser must be able to do.
type Options struct {
	// WebGPU enables navigator.gpu (--enable-unsafe-webgpu); on a machine without a GPU the
	// adapter is SwiftShader's, a correct but CPU-emulated fallback adapter.
	WebGPU bool
	// WebRTC lets RTCPeerConnection gather loopback candidates; without the fake media
	// permission Chromium enumerates only the default route's interface.
	WebRTC bool
	// Width and Height size the window (default 1280×900).
	Width, Height int
}

// Browser is one headless Chromium with a fresh profile. Ctx is its chromedp context (one tab).
type Browser struct {
	Ctx context.Context

	mu      sync.Mutex
	errs    []string // uncaught exceptions, console.error and log errors
	console []string // every console line, for the test log
}

// Start launches Chromium for t, skipping t when it is not installed, and closes it in t's
// cleanup. The browser lives until ctx ends or the test ends.
func Start(t testing.TB, ctx context.Context, o Options) *Browser {
	t.Helper()
	if _, err := os.Stat(ChromiumPath); err != nil {
		t.Skipf("no Chromium at %s (apt-get install chromium): %v", ChromiumPath, err)
	}
	w, h := o.Width, o.Height
	if w == 0 || h == 0 {
		w, h = 1280, 900
	}
	opts := append(chromedp.DefaultExecAllocatorOptions[:],
		chromedp.ExecPath(ChromiumPath),
		chromedp.NoSandbox,
		chromedp.Flag("disable-background-networking", true),
		chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true),
		chromedp.Flag("disable-quic", true),
		chromedp.UserDataDir(t.TempDir()),
		chromedp.WindowSize(w, h),
	)
	if o.WebGPU {
		opts = append(opts, chromedp.Flag("enable-unsafe-webgpu", true))
	} else {
		opts = append(opts, chromedp.Flag("disable-gpu", true))
	}
	if o.WebRTC {
		opts = append(opts,
			chromedp.Flag("allow-loopback-in-peer-connection", true),
			chromedp.Flag("use-fake-ui-for-media-stream", true))
	}
	actx, acancel := chromedp.NewExecAllocator(ctx, opts...)
	bctx, bcancel := chromedp.NewContext(actx)
	b := &Browser{Ctx: bctx}
	t.Cleanup(func() {
		bcancel()
		acancel()
		b.mu.Lock()
		defer b.mu.Unlock()
		if t.Failed() {
			for _, l := range b.console {
				t.Logf("browser: %s", l)
			}
		}
	})
	if err := chromedp.Listen(bctx, b.listen); err != nil {
		t.Fatalf("start Chromium: %v", err)
	}
	return b
}

func (b *Browser) listen(ev any) {
	var msg string
	isErr := false
	switch ev := ev.(type) {
	case *cdpruntime.EventExceptionThrown:
		d := ev.ExceptionDetails
		msg = fmt.Sprintf("uncaught exception at %s:%d: %s", d.URL, d.LineNumber+1, d.Text)
		if d.Exception != nil && d.Exception.Description != "" {
			msg += " " + d.Exception.Description
		}
		isErr = true
	case *cdpruntime.EventConsoleAPICalled:
		var args []string
		for _, a := range ev.Args {
			if a.Description != "" {
				args = append(args, a.Description)
			} else {
				args = append(args, strings.Trim(string(a.Value), `"`))
			}
		}
		msg = fmt.Sprintf("console.%s: %s", ev.Type, strings.Join(args, " "))
		isErr = ev.Type == cdpruntime.ConsoleAPICalledTypeError
	case *log.EventEntryAdded:
		msg = fmt.Sprintf("%s %s: %s (%s)", ev.Entry.Source, ev.Entry.Level, ev.Entry.Text, ev.Entry.URL)
		isErr = ev.Entry.Level == log.EntryLevelError
	default:
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.console = append(b.console, msg)
	if isErr {
		b.errs = append(b.errs, msg)
	}
}

// Errors returns the page's uncaught exceptions and console/log errors so far.
func (b *Browser) Errors() []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return append([]string(nil), b.errs...)
}

// Console returns every console and log line so far.
func (b *Browser) Console() []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return append([]string(nil), b.console...)
}

// BuildWasm builds the main package pkg (an import path or ./dir) for GOOS=js GOARCH=wasm into a
// file under t's temporary directory and returns its path. A cold build takes about 30 s.
func BuildWasm(t testing.TB, pkg string) string {
	t.Helper()
	out := filepath.Join(t.TempDir(), "shoal.wasm")
	cmd := exec.Command(goTool(), "build", "-trimpath", "-o", out, pkg)
	cmd.Env = append(os.Environ(), "GOOS=js", "GOARCH=wasm")
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("build %s for js/wasm: %v\n%s", pkg, err, b)
	}
	return out
}

// WasmExecJS is the wasm_exec.js of the Go toolchain that builds the tests (and so the wasm):
// the glue must come from the same Go release as the binary.
func WasmExecJS() (string, error) {
	out, err := exec.Command(goTool(), "env", "GOROOT").Output()
	if err != nil {
		return "", fmt.Errorf("go env GOROOT: %w", err)
	}
	p := filepath.Join(strings.TrimSpace(string(out)), "lib", "wasm", "wasm_exec.js")
	if _, err := os.Stat(p); err != nil {
		return "", err
	}
	return p, nil
}

// goTool is the go command of the toolchain running the tests.
func goTool() string {
	if p := filepath.Join(runtime.GOROOT(), "bin", "go"); fileExists(p) {
		return p
	}
	return "go"
}

func fileExists(p string) bool { _, err := os.Stat(p); return err == nil }

// InLoopbackNamespace makes the rest of test t run in a network namespace that holds only `lo`,
// so that neither Chromium nor pion can reach any address but loopback. Called at the top of a
// top-level test, it returns true in the process that should run the test's body — the copy of
// the test binary started under `unshare -n` — and false in the outer process, which has then
// run that copy and reported its result as t's. Without root or unshare the test is skipped: a
// browser test with WebRTC must not run where Chromium can see other interfaces. Do anything
// that needs the network (building the wasm needs only the module cache) before or inside.
func InLoopbackNamespace(t *testing.T) bool {
	t.Helper()
	if os.Getenv(netnsEnv) == "1" {
		ifs, err := net.Interfaces()
		if err != nil {
			t.Fatalf("list interfaces: %v", err)
		}
		for _, i := range ifs {
			if i.Flags&net.FlagLoopback == 0 {
				t.Fatalf("inside the test namespace, interface %s is not loopback", i.Name)
			}
		}
		return true
	}
	if os.Geteuid() != 0 {
		t.Skip("needs root to create a loopback-only network namespace (unshare -n)")
	}
	for _, tool := range []string{"unshare", "ip"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("needs %s for a loopback-only network namespace: %v", tool, err)
		}
	}
	args := []string{"-n", "sh", "-c", `ip link set lo up && exec "$0" "$@"`, os.Args[0],
		"-test.run", "^" + regexp.QuoteMeta(t.Name()) + "$", "-test.v", "-test.count=1"}
	ctx := context.Background()
	if d, ok := t.Deadline(); ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithDeadline(ctx, d)
		defer cancel()
	}
	cmd := exec.CommandContext(ctx, "unshare", args...)
	cmd.Env = append(os.Environ(), netnsEnv+"=1")
	if a := os.Getenv("SHOAL_ARTIFACTS"); a != "" {
		cmd.Env = append(cmd.Env, "SHOAL_ARTIFACTS="+a)
	}
	out, err := cmd.CombinedOutput()
	for _, l := range strings.Split(strings.TrimRight(string(out), "\n"), "\n") {
		t.Log(l)
	}
	switch {
	case err != nil:
		t.Fatalf("the test failed in its loopback-only namespace: %v", err)
	case strings.Contains(string(out), "--- SKIP: "+t.Name()):
		t.Skip("skipped in its loopback-only namespace")
	}
	return false
}
