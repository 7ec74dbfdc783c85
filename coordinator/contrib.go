package coordinator

// Serving the contributor page and the browser worker it loads.
//
// The page (web.Contrib) is embedded in the binary. The worker is not: shoal.wasm is built from
// this module (GOOS=js GOARCH=wasm ./wasm/worker) after the binary that serves it, so embedding it
// would make `go build ./...` on a clean clone depend on an artefact that does not exist yet, or
// on a checked-in binary that goes stale. The coordinator reads it, and the wasm_exec.js of the Go
// release that built it (the glue must match the binary), from Config.WasmDir at start — `make
// build` puts both in bin/ beside bin/shoal, which is where `shoal serve` looks by default — and
// serves them compressed once, with strong ETags, so that a returning contributor revalidates a
// 3 MB download with a 304.

import (
	"bytes"
	"compress/gzip"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"net/http"
	"os"
	"path"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/shoal-ml/shoal/web"
)

// The browser worker's files in Config.WasmDir, served under these names at the root.
const (
	WasmFile     = "shoal.wasm"
	WasmExecFile = "wasm_exec.js"
)

// asset is a file served from memory: compressed once when it is loaded, with a strong ETag per
// representation (RFC 9110, section 8.8.3: the gzip bytes are another representation, so they get
// another tag).
type asset struct {
	name        string
	contentType string
	raw, gz     []byte // gz is nil when compressing does not pay
	etag, gzTag string
}

func newAsset(name string, b []byte) (*asset, error) {
	sum := sha256.Sum256(b)
	tag := hex.EncodeToString(sum[:16])
	a := &asset{name: name, contentType: contentType(name), raw: b, etag: `"` + tag + `"`, gzTag: `"` + tag + `-gz"`}
	var buf bytes.Buffer
	zw, err := gzip.NewWriterLevel(&buf, gzip.BestCompression)
	if err != nil {
		return nil, err
	}
	if _, err := zw.Write(b); err != nil {
		return nil, err
	}
	if err := zw.Close(); err != nil {
		return nil, err
	}
	if buf.Len() < len(b) {
		a.gz = buf.Bytes()
	}
	return a, nil
}

func contentType(name string) string {
	switch path.Ext(name) {
	case ".html":
		return "text/html; charset=utf-8"
	case ".js":
		return "text/javascript; charset=utf-8"
	case ".css":
		return "text/css; charset=utf-8"
	case ".wasm":
		return "application/wasm" // WebAssembly.instantiateStreaming insists on it
	}
	return "application/octet-stream"
}

// ServeHTTP serves the gzip representation to clients that accept it, and answers
// If-None-Match, HEAD and ranges (http.ServeContent). Cache-Control no-cache makes browsers
// revalidate every time, so that a rebuilt worker is picked up at once, at the cost of a 304.
func (a *asset) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	h := w.Header()
	h.Set("Content-Type", a.contentType)
	h.Set("Cache-Control", "no-cache")
	h.Set("X-Content-Type-Options", "nosniff")
	h.Add("Vary", "Accept-Encoding")
	body, tag := a.raw, a.etag
	if a.gz != nil && acceptsGzip(r.Header.Get("Accept-Encoding")) {
		body, tag = a.gz, a.gzTag
		h.Set("Content-Encoding", "gzip")
		// ServeContent leaves the length of an encoded body unset (it would chunk it) and would
		// cut ranges of the compressed bytes, which no client of ours asks for: the whole body,
		// with its length, so that a browser can show the download's progress.
		r.Header.Del("Range")
		h.Set("Content-Length", strconv.Itoa(len(body)))
	}
	h.Set("ETag", tag)
	http.ServeContent(w, r, a.name, time.Time{}, bytes.NewReader(body))
}

// acceptsGzip reports whether an Accept-Encoding header value admits gzip: listed with a q-value
// that is not zero, or not listed and admitted by "*" (RFC 9110, section 12.5.3).
func acceptsGzip(header string) bool {
	gzip, star := -1.0, -1.0 // q-values; -1: not listed
	for _, part := range strings.Split(header, ",") {
		coding, params, _ := strings.Cut(strings.TrimSpace(part), ";")
		q := 1.0
		for _, p := range strings.Split(params, ";") {
			if k, v, ok := strings.Cut(strings.TrimSpace(p), "="); ok && strings.EqualFold(strings.TrimSpace(k), "q") {
				if f, err := strconv.ParseFloat(strings.TrimSpace(v), 64); err == nil {
					q = f
				}
			}
		}
		switch strings.ToLower(strings.TrimSpace(coding)) {
		case "gzip", "x-gzip":
			gzip = q
		case "*":
			star = q
		}
	}
	if gzip >= 0 {
		return gzip > 0
	}
	return star > 0
}

// contribSite is the contributor page and, when one is on offer, the browser worker.
type contribSite struct {
	page   map[string]*asset // web.Contrib's files by name
	wasm   *asset            // nil: no browser worker on offer
	wasmJS *asset
}

// loadContrib compresses the embedded page and reads the worker from wasmDir. A directory without
// shoal.wasm offers no browser worker (the page says how to build one); shoal.wasm without its
// wasm_exec.js is an error, since the page could not run it.
func loadContrib(wasmDir string) (*contribSite, error) {
	site := &contribSite{page: map[string]*asset{}}
	err := fs.WalkDir(web.Contrib(), ".", func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		b, err := fs.ReadFile(web.Contrib(), p)
		if err != nil {
			return err
		}
		a, err := newAsset(p, b)
		site.page[p] = a
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("contributor page: %w", err)
	}
	if wasmDir == "" {
		return site, nil
	}
	b, err := os.ReadFile(filepath.Join(wasmDir, WasmFile))
	if errors.Is(err, fs.ErrNotExist) {
		return site, nil
	}
	if err != nil {
		return nil, fmt.Errorf("browser worker: %w", err)
	}
	glue, err := os.ReadFile(filepath.Join(wasmDir, WasmExecFile))
	if err != nil {
		return nil, fmt.Errorf("browser worker: %s is there but not its %s (copy $(go env GOROOT)/lib/wasm/%s of the Go that built it, or run make build): %w",
			filepath.Join(wasmDir, WasmFile), WasmExecFile, WasmExecFile, err)
	}
	if site.wasm, err = newAsset(WasmFile, b); err != nil {
		return nil, err
	}
	if site.wasmJS, err = newAsset(WasmExecFile, glue); err != nil {
		return nil, err
	}
	return site, nil
}

// register adds the page and the worker to mux: the page at / (a join link is /?join=TOKEN), its
// script and style under /contrib/, the worker at /shoal.wasm and /wasm_exec.js.
func (c *contribSite) register(mux *http.ServeMux) {
	page := func(a *asset) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Security-Policy", web.ContribCSP)
			w.Header().Set("Referrer-Policy", "no-referrer")
			a.ServeHTTP(w, r)
		})
	}
	mux.Handle("GET /{$}", page(c.page["index.html"]))
	mux.HandleFunc("GET /contrib/{file}", func(w http.ResponseWriter, r *http.Request) {
		a := c.page[r.PathValue("file")]
		if a == nil || a.name == "index.html" {
			http.NotFound(w, r)
			return
		}
		page(a).ServeHTTP(w, r)
	})
	for name, a := range map[string]*asset{WasmFile: c.wasm, WasmExecFile: c.wasmJS} {
		if a != nil {
			mux.Handle("GET /"+name, a)
			continue
		}
		mux.HandleFunc("GET /"+name, func(w http.ResponseWriter, r *http.Request) {
			http.Error(w, "this coordinator offers no browser worker: build "+WasmFile+" (make build) and serve with --wasm-dir",
				http.StatusNotFound)
		})
	}
}

// WasmSize is the browser worker's size as served, raw and gzip-compressed; zeros when the
// coordinator offers none.
func (s *Server) WasmSize() (raw, gz int) {
	if s.contrib.wasm == nil {
		return 0, 0
	}
	return len(s.contrib.wasm.raw), len(s.contrib.wasm.gz)
}
