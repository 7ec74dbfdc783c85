//go:build js && wasm

package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/url"
	"strconv"
	"strings"
	"syscall/js"
	"time"

	"github.com/shoal-ml/shoal/internal/devcheck"
	"github.com/shoal-ml/shoal/wasm/webgpu"
)

// Report is what the page receives, as JSON.
type Report struct {
	Adapter webgpu.AdapterInfo `json:"adapter"`
	// Kernels is the variants the device runs by default, "[gpu]" or "[fallback]" (query
	// kernels=gpu|fallback overrides the adapter's choice).
	Kernels string            `json:"kernels"`
	Seed    uint64            `json:"seed"`
	OpenMS  float64           `json:"open_ms"` // Open: adapter, device, and compiling every kernel
	RunMS   float64           `json:"run_ms"`
	Results []devcheck.Result `json:"results"`
	// Perturbed holds the same cases with a perturbed input (perturb=1): each must fail.
	Perturbed []devcheck.Result `json:"perturbed,omitempty"`
	// Bench holds the matmul timings of bench=… (bench/webgpu/index.html).
	Bench []Timing `json:"bench,omitempty"`
	// Stages holds the whole-stage training runs of stage=1: host vs WebGPU.
	Stages []StageCase `json:"stages,omitempty"`
	Error  string      `json:"error,omitempty"`
}

// Timing is one side-by-side comparison: milliseconds per m×k×n product, one per round, for
// Shoal's WGSL matmul — the variant the device picked (WGSL) and the other one (WGSLAlt) — and,
// when the page provides window.tfjsMatMul, TensorFlow.js's WebGPU backend in the same browser.
type Timing struct {
	M, K, N int
	WGSL    []float64 `json:"wgsl_ms"`
	WGSLAlt []float64 `json:"wgsl_alt_ms"`
	TFJS    []float64 `json:"tfjs_ms,omitempty"`
	Error   string    `json:"error,omitempty"`
}

func main() {
	q, _ := url.ParseQuery(strings.TrimPrefix(js.Global().Get("location").Get("search").String(), "?"))
	r := run(q)
	b, err := json.Marshal(r)
	if err != nil {
		b = []byte(fmt.Sprintf(`{"error": %q}`, err.Error()))
	}
	show(r)
	js.Global().Call("shoalKernelcheckDone", string(b))
	// Stay alive: the page may still deliver events (the device's lost promise settles after
	// Close), and a Go program that has exited throws on each.
	select {}
}

func run(q url.Values) Report {
	r := Report{Seed: 1}
	if s := q.Get("seed"); s != "" {
		seed, err := strconv.ParseUint(s, 10, 64)
		if err != nil {
			r.Error = "seed: " + err.Error()
			return r
		}
		r.Seed = seed
	}
	var only []string
	if o := q.Get("only"); o != "" {
		only = strings.Split(o, ",")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	t0 := time.Now()
	d, err := webgpu.OpenWith(ctx, webgpu.Options{Compatibility: q.Get("compat") == "1", Kernels: q.Get("kernels"),
		// Validation runs both variants of every kernel: compile them all up front, so that a
		// kernel that does not compile (under compatibility limits, say) fails the open.
		CompileAll: q.Get("bench") == "" && q.Get("stage") != "1"})
	if err != nil {
		r.Error = err.Error()
		return r
	}
	defer d.Close()
	r.Adapter = d.Adapter()
	r.Kernels = webgpu.VariantName(d.GPUKernels())
	r.OpenMS = ms(time.Since(t0))
	t0 = time.Now()
	if sizes := q.Get("bench"); sizes != "" {
		r.Bench = bench(ctx, d, sizes, atoi(q.Get("rounds"), 5), atoi(q.Get("reps"), 10))
		r.RunMS = ms(time.Since(t0))
		return r
	}
	if q.Get("stage") == "1" {
		r.Stages = stageCheck(d, q.Get("break") == "1")
		r.RunMS = ms(time.Since(t0))
		if err := d.Err(); err != nil {
			r.Error = err.Error()
		}
		return r
	}
	// repeat=N runs the validation for seeds seed, seed+1, …: a stress run of the tolerances.
	for i := 0; i < atoi(q.Get("repeat"), 1); i++ {
		r.Results = append(r.Results, webgpu.Validate(d, devcheck.Options{Seed: r.Seed + uint64(i), Only: only})...)
	}
	if q.Get("perturb") == "1" {
		r.Perturbed = webgpu.Validate(d, devcheck.Options{Seed: r.Seed, Only: only, Perturb: true})
	}
	r.RunMS = ms(time.Since(t0))
	if err := d.Err(); err != nil {
		r.Error = err.Error()
	}
	return r
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

func atoi(s string, def int) int {
	if n, err := strconv.Atoi(s); err == nil && n > 0 {
		return n
	}
	return def
}

// bench times square products of each size in sizes ("128,256"), alternating which side goes
// first every round so that neither always runs in the other's wake.
func bench(ctx context.Context, d *webgpu.Device, sizes string, rounds, reps int) []Timing {
	tfjs := js.Global().Get("tfjsMatMul")
	var out []Timing
	for _, f := range strings.Split(sizes, ",") {
		n, err := strconv.Atoi(f)
		if err != nil || n <= 0 {
			out = append(out, Timing{Error: fmt.Sprintf("size %q", f)})
			continue
		}
		t := Timing{M: n, K: n, N: n}
		for round := 0; round < rounds && t.Error == ""; round++ {
			picked := d.GPUKernels()
			sides := []func() error{
				func() error {
					dt, err := webgpu.TimeMatMul(d, n, n, n, reps)
					t.WGSL = append(t.WGSL, ms(dt))
					if err != nil {
						return err
					}
					d.SetGPUKernels(!picked) // the other kernel, right after, in the same wake
					defer d.SetGPUKernels(picked)
					dt, err = webgpu.TimeMatMul(d, n, n, n, reps)
					t.WGSLAlt = append(t.WGSLAlt, ms(dt))
					return err
				},
			}
			if tfjs.Type() == js.TypeFunction {
				sides = append(sides, func() error {
					v, err := webgpu.Await(ctx, tfjs.Invoke(n, n, n, reps))
					t.TFJS = append(t.TFJS, v.Float())
					return err
				})
				if round%2 == 1 {
					sides[0], sides[1] = sides[1], sides[0]
				}
			}
			for _, side := range sides {
				if err := side(); err != nil {
					t.Error = err.Error()
					break
				}
			}
		}
		out = append(out, t)
	}
	return out
}

// show writes the results into the page, for a person who opened it.
func show(r Report) {
	var b strings.Builder
	if r.Error != "" {
		fmt.Fprintf(&b, "error: %s\n", r.Error)
	}
	fmt.Fprintf(&b, "adapter: %s\nopen %.0f ms, run %.0f ms\n\n", r.Adapter, r.OpenMS, r.RunMS)
	fail := 0
	for _, x := range r.Results {
		status := "ok"
		if !x.Pass {
			status = "FAIL"
			fail++
		}
		fmt.Fprintf(&b, "%-4s %-20s %-44s %-22s rel %.2e  max %.2e  tol %.0e %s\n", status, x.Kernel, x.Shape, x.Output, x.RelErr, x.MaxAbs, x.Tol, x.Note)
	}
	fmt.Fprintf(&b, "\n%d results, %d failed\n", len(r.Results), fail)
	if el := js.Global().Get("document").Call("getElementById", "out"); el.Truthy() {
		el.Set("textContent", b.String())
	}
}
