package coordinator

import (
	"bytes"
	"compress/gzip"
	"context"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/shoal-ml/shoal/web"
)

func newContribServer(t *testing.T, wasmDir string) *httptest.Server {
	t.Helper()
	srv, err := New(context.Background(), Config{DataDir: t.TempDir(), WasmDir: wasmDir, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close() })
	hs := httptest.NewServer(srv.Handler())
	t.Cleanup(hs.Close)
	return hs
}

func get(t *testing.T, method, url string, header map[string]string) (*http.Response, []byte) {
	t.Helper()
	req, err := http.NewRequest(method, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	for k, v := range header {
		req.Header.Set(k, v)
	}
	// A transport that leaves Accept-Encoding and the body alone: the test checks both.
	resp, err := (&http.Transport{DisableCompression: true}).RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp, b
}

// TestContribServing: the page at / with its policy, its assets under /contrib/, and the browser
// worker compressed once, with an ETag per representation, revalidated with 304.
func TestContribServing(t *testing.T) {
	dir := t.TempDir()
	wasm := bytes.Repeat([]byte("\x00asm not really, but compressible "), 4096)
	glue := []byte("// wasm_exec.js of the Go that built it\n")
	if err := os.WriteFile(filepath.Join(dir, WasmFile), wasm, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, WasmExecFile), glue, 0o644); err != nil {
		t.Fatal(err)
	}
	hs := newContribServer(t, dir)

	resp, body := get(t, "GET", hs.URL+"/?join=abc", nil)
	if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != "text/html; charset=utf-8" ||
		resp.Header.Get("Content-Security-Policy") != web.ContribCSP || !bytes.Contains(body, []byte(`id="btn-start"`)) {
		t.Errorf("GET /: %s %q csp %q, %d bytes", resp.Status, resp.Header.Get("Content-Type"), resp.Header.Get("Content-Security-Policy"), len(body))
	}
	for _, f := range []string{"contrib.js", "contrib.css"} {
		if resp, _ := get(t, "GET", hs.URL+"/contrib/"+f, nil); resp.StatusCode != 200 {
			t.Errorf("GET /contrib/%s: %s", f, resp.Status)
		}
	}
	if resp, _ := get(t, "GET", hs.URL+"/contrib/nothing.js", nil); resp.StatusCode != 404 {
		t.Errorf("GET /contrib/nothing.js: %s, want 404", resp.Status)
	}

	gz := map[string]string{"Accept-Encoding": "gzip, deflate, br"}
	resp, body = get(t, "GET", hs.URL+"/shoal.wasm", gz)
	if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != "application/wasm" || resp.Header.Get("Content-Encoding") != "gzip" {
		t.Fatalf("GET /shoal.wasm (gzip): %s %q %q", resp.Status, resp.Header.Get("Content-Type"), resp.Header.Get("Content-Encoding"))
	}
	zr, err := gzip.NewReader(bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if got, err := io.ReadAll(zr); err != nil || !bytes.Equal(got, wasm) {
		t.Fatalf("the gzip body does not decompress to shoal.wasm (%v)", err)
	}
	if len(body) >= len(wasm) || resp.Header.Get("Content-Length") != strconv.Itoa(len(body)) {
		t.Errorf("gzip body %d bytes (Content-Length %q), raw %d", len(body), resp.Header.Get("Content-Length"), len(wasm))
	}
	gzTag := resp.Header.Get("ETag")
	resp, body = get(t, "GET", hs.URL+"/shoal.wasm", nil)
	rawTag := resp.Header.Get("ETag")
	if resp.StatusCode != 200 || resp.Header.Get("Content-Encoding") != "" || !bytes.Equal(body, wasm) {
		t.Errorf("GET /shoal.wasm (identity): %s %q, %d bytes", resp.Status, resp.Header.Get("Content-Encoding"), len(body))
	}
	if gzTag == "" || rawTag == "" || gzTag == rawTag || strings.HasPrefix(gzTag, "W/") {
		t.Errorf("ETags %q (gzip) and %q (identity): want two different strong tags", gzTag, rawTag)
	}
	if !strings.Contains(resp.Header.Get("Vary"), "Accept-Encoding") {
		t.Errorf("Vary %q lacks Accept-Encoding", resp.Header.Get("Vary"))
	}
	if resp, body := get(t, "GET", hs.URL+"/shoal.wasm", map[string]string{"Accept-Encoding": "gzip", "If-None-Match": gzTag}); resp.StatusCode != 304 || len(body) != 0 {
		t.Errorf("revalidation: %s with %d bytes, want 304 and none", resp.Status, len(body))
	}
	if resp, _ := get(t, "GET", hs.URL+"/shoal.wasm", map[string]string{"Accept-Encoding": "gzip", "If-None-Match": rawTag}); resp.StatusCode != 200 {
		t.Errorf("revalidating the gzip body with the identity tag: %s, want 200", resp.Status)
	}
	if resp, body := get(t, "HEAD", hs.URL+"/shoal.wasm", gz); resp.StatusCode != 200 || len(body) != 0 {
		t.Errorf("HEAD /shoal.wasm: %s, %d bytes", resp.Status, len(body))
	}
	resp, body = get(t, "GET", hs.URL+"/wasm_exec.js", nil)
	if resp.StatusCode != 200 || !bytes.Equal(body, glue) || resp.Header.Get("Content-Type") != "text/javascript; charset=utf-8" {
		t.Errorf("GET /wasm_exec.js: %s %q", resp.Status, resp.Header.Get("Content-Type"))
	}
}

// TestContribWithoutWasm: a coordinator with no browser worker still serves the page, and says
// why there is no worker; a worker without its wasm_exec.js is refused at start.
func TestContribWithoutWasm(t *testing.T) {
	hs := newContribServer(t, t.TempDir())
	if resp, _ := get(t, "GET", hs.URL+"/", nil); resp.StatusCode != 200 {
		t.Errorf("GET /: %s", resp.Status)
	}
	for _, f := range []string{"/shoal.wasm", "/wasm_exec.js"} {
		resp, body := get(t, "GET", hs.URL+f, nil)
		if resp.StatusCode != 404 || !bytes.Contains(body, []byte("make build")) {
			t.Errorf("GET %s: %s %q, want 404 saying how to build it", f, resp.Status, body)
		}
	}
	dir := t.TempDir()
	os.WriteFile(filepath.Join(dir, WasmFile), []byte("\x00asm"), 0o644)
	_, err := New(context.Background(), Config{DataDir: t.TempDir(), WasmDir: dir, Logger: slog.New(slog.DiscardHandler)})
	if err == nil || !strings.Contains(err.Error(), WasmExecFile) {
		t.Errorf("New with shoal.wasm but no wasm_exec.js: %v, want an error naming %s", err, WasmExecFile)
	}
}

func TestAcceptsGzip(t *testing.T) {
	tests := []struct {
		header string
		want   bool
	}{
		{"", false},
		{"gzip", true},
		{"deflate, gzip;q=1.0, *;q=0.5", true},
		{"br, GZIP", true},
		{"gzip;q=0", false},
		{"gzip; q=0.000", false},
		{"*", true},
		{"identity", false},
		{"x-gzip", true},
		{"gzipped", false},
		{"*;q=0.5, gzip;q=0", false},
		{"gzip;q=0, *", false},
		{"br, *;q=0", false},
	}
	for _, tt := range tests {
		if got := acceptsGzip(tt.header); got != tt.want {
			t.Errorf("acceptsGzip(%q) = %v, want %v", tt.header, got, tt.want)
		}
	}
}
