package web

import (
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

func readContrib(t *testing.T, name string) string {
	t.Helper()
	b, err := fs.ReadFile(Contrib(), name)
	if err != nil {
		t.Fatalf("read contributor asset: %v", err)
	}
	return string(b)
}

// TestContribAssets checks that the contributor page carries what the coordinator's browser test,
// the worker's API (wasm/worker) and the serving scheme depend on.
func TestContribAssets(t *testing.T) {
	tests := []struct {
		name string
		file string
		want []string
	}{
		{"the page has every fact", "index.html", []string{
			`id="btn-start"`, `id="btn-stop"`, `id="state"`, `id="job"`, `id="progress"`, `id="gpu"`, `id="compute"`,
			`id="gflops"`, `id="shard"`, `id="mbs"`, `id="last-step"`, `id="tps"`, `id="problem"`, `id="worker-id"`,
		}},
		{"the page reads on a phone", "index.html", []string{`name="viewport"`, `width=device-width`}},
		{"assets are absolute, because the page is served at /", "index.html", []string{
			`src="/contrib/contrib.js"`, `href="/contrib/contrib.css"`,
		}},
		{"the page makes the worker's thread only on Start", "contrib.js", []string{
			"function start()", "new Worker('/contrib/worker.js')", "method: 'HEAD'",
		}},
		{"the worker's thread loads the wasm", "worker.js", []string{
			"importScripts('/wasm_exec.js'", "instantiateStreaming(fetch('/shoal.wasm')",
		}},
		{"the worker's thread drives the worker's API", "worker.js", []string{
			"self.shoal.start(", "self.shoal.stop(", "self.shoal.running()", "onStatus",
		}},
		{"the page passes the join token", "contrib.js", []string{"join: joinToken", "params.get('join')"}},
		{"a Stop ends the worker's thread", "contrib.js", []string{"type: 'stop'", "w.terminate()"}},
		{"closing the tab is a departure", "contrib.js", []string{"'pagehide'", "'tab closed'"}},
		{"the page carries the worker's peer connections", "rtcpage.js", []string{"new RTCPeerConnection(", "createDataChannel("}},
		{"the worker bridges RTCPeerConnection where it has none", "rtcbridge.js", []string{"self.RTCPeerConnection = BridgePC"}},
		{"WebGPU is detected, and ?backend= forces what the tab computes on", "contrib.js", []string{
			"navigator.gpu.requestAdapter()", "params.get('backend')", "backend: backendWanted",
		}},
		{"the script reads the public status", "contrib.js", []string{"'/api/status'"}},
		{"the script shows a private job's status to those with its link", "contrib.js", []string{"'X-Shoal-Join': joinToken"}},
		{"the page shows the tab's own credit and ban", "index.html", []string{
			`id="my-verified"`, `id="my-pending"`, `id="my-rejected"`, `id="my-banned"`,
		}},
		{"the page says how many pipeline replicas the plan runs", "index.html", []string{`id="pipeline-row"`, `id="pipeline"`}},
		{"the script reads the plan's replicas", "contrib.js", []string{"plan.replicas", "plan.sync", "w.shard.text"}},
		{"the script asks the status for the tab's own line", "contrib.js", []string{
			"'?worker=' + encodeURIComponent(id)", "c.credits", "c.bans",
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := readContrib(t, tt.file)
			for _, w := range tt.want {
				if !strings.Contains(got, w) {
					t.Errorf("%s lacks %q", tt.file, w)
				}
			}
		})
	}
}

// TestContribScript keeps server strings out of the HTML parser and every element the script
// looks up on the page.
func TestContribScript(t *testing.T) {
	js, page := readContrib(t, "contrib.js"), readContrib(t, "index.html")
	for _, bad := range []string{"innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"} {
		if strings.Contains(js, bad) {
			t.Errorf("contrib.js uses %s", bad)
		}
	}
	ids := regexp.MustCompile(`\$\('([a-z0-9-]+)'\)|text\('([a-z0-9-]+)'`).FindAllStringSubmatch(js, -1)
	if len(ids) < 10 {
		t.Fatalf("found only %d element lookups in contrib.js: the pattern is broken", len(ids))
	}
	for _, m := range ids {
		id := m[1] + m[2]
		if !strings.Contains(page, `id="`+id+`"`) {
			t.Errorf("contrib.js looks up #%s, which index.html lacks", id)
		}
	}
	for _, bad := range []string{"://", "'//", `"//`, "`//"} {
		if strings.Contains(js, bad) {
			t.Errorf("contrib.js contains %q: an absolute URL", bad)
		}
	}
	checkMarkup(t, "contrib/index.html", page)
}

// TestContribSameOrigin: nothing the page loads comes from another origin, and every file it
// names under /contrib/ is embedded.
func TestContribSameOrigin(t *testing.T) {
	page := readContrib(t, "index.html")
	refs := urlAttr.FindAllStringSubmatch(page, -1)
	if len(refs) == 0 {
		t.Fatal("index.html references nothing: the URL pattern is broken")
	}
	for _, m := range refs {
		u := m[1]
		if foreign(u) {
			t.Errorf("index.html loads %q from another origin", u)
			continue
		}
		if f, ok := strings.CutPrefix(u, "/contrib/"); ok {
			if _, err := fs.Stat(Contrib(), f); err != nil {
				t.Errorf("index.html names %q, which is not embedded: %v", u, err)
			}
		}
	}
	css := readContrib(t, "contrib.css")
	if strings.Contains(strings.ToLower(css), "@import") {
		t.Error("contrib.css imports another stylesheet")
	}
	for _, m := range cssURL.FindAllStringSubmatch(css, -1) {
		if foreign(m[1]) {
			t.Errorf("contrib.css loads %q from another origin", m[1])
		}
	}
	if strings.Contains(ContribCSP, "unsafe-inline") || strings.Contains(ContribCSP, " 'unsafe-eval'") || strings.Contains(ContribCSP, "*") {
		t.Errorf("ContribCSP = %q allows inline code, eval or any origin", ContribCSP)
	}
	if !strings.Contains(ContribCSP, "'wasm-unsafe-eval'") {
		t.Errorf("ContribCSP = %q does not let the page compile shoal.wasm", ContribCSP)
	}
}

// TestContribScriptParses compiles the page's scripts with Node when it is installed: there is no build
// step to catch a syntax error, which would otherwise show as a dead Start button.
func TestContribScriptParses(t *testing.T) {
	node, err := exec.LookPath("node")
	if err != nil {
		t.Skip("node is not installed; the coordinator's browser test covers the script")
	}
	for _, name := range []string{"contrib.js", "worker.js", "rtcbridge.js", "rtcpage.js"} {
		f := filepath.Join(t.TempDir(), name)
		if err := os.WriteFile(f, []byte(readContrib(t, name)), 0o644); err != nil {
			t.Fatal(err)
		}
		if out, err := exec.Command(node, "--check", f).CombinedOutput(); err != nil {
			t.Errorf("%s does not parse: %v\n%s", name, err, out)
		}
	}
}
