//go:build !js

package wasm_test

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/shoal-ml/shoal/internal/browsertest"
)

// BenchmarkWebGPUMatMulVsTFJS times Shoal's WGSL matmul (webgpu.TimeMatMul) and TensorFlow.js's
// WebGPU backend (tf.matMul, from bench/webgpu/node_modules) side by side in one headless
// Chromium — both of Shoal's matmul kernels, the one the device picks for the adapter and the
// other — on square products of each size in SHOAL_BENCH_SIZES (default 128,256), alternating
// which goes first each of SHOAL_BENCH_ROUNDS rounds (default 5), SHOAL_BENCH_REPS products per
// timing (default 10). It prints a table of median GFLOP/s and their ratio, and reports them as
// metrics; then a whole-stage training step on WebGPU against the tab's CPU kernels, with the
// number of waits for the GPU per step and per micro-batch. Run it with scripts/bench_webgpu.sh, which installs TensorFlow.js and runs this inside
// a loopback-only network namespace; elsewhere it skips.
func BenchmarkWebGPUMatMulVsTFJS(b *testing.B) {
	if !onlyLoopback() {
		b.Skip("needs a loopback-only network namespace: run scripts/bench_webgpu.sh")
	}
	nodeModules, err := filepath.Abs("../bench/webgpu/node_modules")
	if err != nil {
		b.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(nodeModules, "@tensorflow/tfjs-backend-webgpu")); err != nil {
		b.Skip("no TensorFlow.js: run (cd bench/webgpu && npm ci) or scripts/bench_webgpu.sh")
	}
	wasmFile := browsertest.BuildWasm(b, "github.com/shoal-ml/shoal/wasm/kernelcheck")
	wasmExec, err := browsertest.WasmExecJS()
	if err != nil {
		b.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/{$}", func(w http.ResponseWriter, r *http.Request) { http.ServeFile(w, r, "../bench/webgpu/index.html") })
	mux.HandleFunc("/wasm_exec.js", func(w http.ResponseWriter, r *http.Request) { http.ServeFile(w, r, wasmExec) })
	mux.HandleFunc("/kernelcheck.wasm", func(w http.ResponseWriter, r *http.Request) { http.ServeFile(w, r, wasmFile) })
	// Only the two packages' bundles, not the whole of node_modules.
	for _, pkg := range []string{"tfjs-core", "tfjs-backend-webgpu"} {
		prefix := "/node_modules/@tensorflow/" + pkg + "/dist/"
		mux.Handle(prefix, http.StripPrefix(prefix, http.FileServer(http.Dir(filepath.Join(nodeModules, "@tensorflow", pkg, "dist")))))
	}
	srv := httptest.NewServer(mux)
	defer srv.Close()

	sizes := env("SHOAL_BENCH_SIZES", "128,256")
	query := fmt.Sprintf("?bench=%s&rounds=%s&reps=%s", sizes, env("SHOAL_BENCH_ROUNDS", "5"), env("SHOAL_BENCH_REPS", "10"))
	for i := 0; i < b.N; i++ {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
		br := browsertest.Start(b, ctx, browsertest.Options{WebGPU: true})
		r := kernelcheck(b, br, srv.URL+"/"+query)
		// A whole training step in the same browser: the tiny model as one stage and a middle
		// stage on WebGPU, converted to GFLOP/s by the planner's cost model.
		stages := kernelcheck(b, br, srv.URL+"/?stage=1").Stages
		// And on the other variants (the GPU ones on a fallback adapter): what the adapter's
		// choice is worth on a whole step.
		picked, alt, altKernels := "matmul", "matmul_tiled", "gpu"
		if r.Kernels == "[gpu]" {
			picked, alt, altKernels = alt, picked, "fallback"
		}
		altStages := kernelcheck(b, br, srv.URL+"/?stage=1&kernels="+altKernels).Stages
		cancel()
		var tab strings.Builder
		fmt.Fprintf(&tab, "adapter %v, isFallbackAdapter %v: the device runs the %s kernels\n%-13s %12s %12s %12s %8s %8s   %s\n",
			r.Adapter["architecture"], r.Adapter["is_fallback_adapter"], r.Kernels, "m×k×n", picked, alt, "tfjs", "ratio", "alt/tfjs", "per-round ms ("+picked+" | "+alt+" | tfjs)")
		for _, t := range r.Bench {
			if t.Error != "" {
				b.Fatalf("%d×%d×%d: %s", t.M, t.K, t.N, t.Error)
			}
			flop := 2 * float64(t.M) * float64(t.K) * float64(t.N)
			w, wa, f := flop/median(t.WGSL)/1e6, flop/median(t.WGSLAlt)/1e6, flop/median(t.TFJS)/1e6
			fmt.Fprintf(&tab, "%-13s %12.3f %12.3f %12.3f %7.2f× %7.2f×   %s | %s | %s\n", fmt.Sprintf("%d×%d×%d", t.M, t.K, t.N), w, wa, f, w/f, wa/f, msList(t.WGSL), msList(t.WGSLAlt), msList(t.TFJS))
			b.ReportMetric(w, fmt.Sprintf("wgsl-GFLOP/s-%d", t.M))
			b.ReportMetric(wa, fmt.Sprintf("wgsl-alt-GFLOP/s-%d", t.M))
			b.ReportMetric(f, fmt.Sprintf("tfjs-GFLOP/s-%d", t.M))
			b.ReportMetric(w/f, fmt.Sprintf("ratio-%d", t.M))
		}
		if n := len(r.Bench); n > 0 {
			last := r.Bench[n-1]
			tfjs := 2 * float64(last.M) * float64(last.K) * float64(last.N) / median(last.TFJS) / 1e6
			for i, c := range stages {
				if c.Error != "" {
					b.Fatalf("stage %s: %s", c.Name, c.Error)
				}
				g := c.StepGFLOP / c.GPUStepMS * 1e3
				fmt.Fprintf(&tab, "training step, %-14s %6.3f GFLOP/s on WebGPU (%.0f ms; the CPU kernels: %.0f ms, %.2f× faster): %.2f× tfjs's %d³ matmul; %.0f waits for the GPU per step, %.1f per micro-batch; %.0f dispatches per step, %.0f for AdamW and the gradient clear\n",
					c.Name, g, c.GPUStepMS, c.HostStepMS, c.GPUStepMS/c.HostStepMS, g/tfjs, last.M, c.GPUReads, c.MicroReads, c.Dispatches, c.OptDisp)
				b.ReportMetric(g/tfjs, fmt.Sprintf("stage%d-vs-tfjs", i))
				b.ReportMetric(c.MicroReads, fmt.Sprintf("stage%d-waits/micro-batch", i))
				if i < len(altStages) && altStages[i].Error == "" {
					a := altStages[i]
					fmt.Fprintf(&tab, "  the same on the %s kernels: %.0f ms (%.2f× the %s kernels' step)\n", altKernels, a.GPUStepMS, a.GPUStepMS/c.GPUStepMS, r.Kernels)
				}
			}
		}
		b.Logf("medians of %s\n%s", query, tab.String())
		for _, e := range br.Errors() {
			b.Errorf("page: %s", e)
		}
	}
}

func msList(x []float64) string {
	s := make([]string, len(x))
	for i, v := range x {
		s[i] = fmt.Sprintf("%.1f", v)
	}
	return strings.Join(s, " ")
}

func env(k, def string) string {
	if v := os.Getenv(k); v != "" {
		return v
	}
	return def
}

func median(x []float64) float64 {
	if len(x) == 0 {
		return 0
	}
	s := slices.Clone(x)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// onlyLoopback reports whether every network interface is a loopback one.
func onlyLoopback() bool {
	ifs, err := net.Interfaces()
	if err != nil {
		return false
	}
	for _, i := range ifs {
		if i.Flags&net.FlagLoopback == 0 {
			return false
		}
	}
	return true
}
