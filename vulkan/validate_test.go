package vulkan

import (
	"flag"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/shoal-ml/shoal/internal/devcheck"
)

var seed = flag.Uint64("vulkan.seed", 1, "seed of the kernel validation inputs")

// The Vulkan device is what the validation suite checks, as it is: model.NormDevice and the
// products.
var _ devcheck.Device = (*Device)(nil)

// TestOps checks every op against its Go reference within the tolerance table of
// internal/devcheck (the browser's WebGPU check runs the same cases), that no op writes outside
// its views, and logs the worst error of each kernel.
func TestOps(t *testing.T) {
	d := device(t)
	t.Logf("seed %d (-vulkan.seed)", *seed)
	res := devcheck.Run(d, devcheck.Options{Seed: *seed})
	cases := map[string]bool{}
	for _, r := range res {
		cases[r.Case()] = true
		if !r.Pass {
			t.Errorf("%s, %s: relative error %.3g, tolerance %.3g %s", r.Case(), r.Output, r.RelErr, r.Tol, r.Note)
		}
	}
	if len(cases) < 300 {
		t.Errorf("only %d validation cases ran", len(cases))
	}
	logWorst(t, res)
}

// logWorst logs a row per kernel: its cases, and its output that came closest to its tolerance.
func logWorst(t *testing.T, res []devcheck.Result) {
	type row struct {
		cases  map[string]bool
		worst  devcheck.Result
		margin float64 // worst's RelErr/Tol (RelErr where Tol is 0)
	}
	rows := map[string]*row{}
	for _, r := range res {
		w := rows[r.Kernel]
		if w == nil {
			w = &row{cases: map[string]bool{}, margin: -1}
			rows[r.Kernel] = w
		}
		w.cases[r.Shape] = true
		m := r.RelErr
		if r.Tol > 0 {
			m /= r.Tol
		}
		if m > w.margin {
			w.worst, w.margin = r, m
		}
	}
	kernels := make([]string, 0, len(rows))
	for k := range rows {
		kernels = append(kernels, k)
	}
	slices.Sort(kernels)
	t.Logf("%-20s %5s %9s %8s  %s", "kernel", "cases", "worst rel", "tol", "at")
	for _, k := range kernels {
		w := rows[k]
		at := strings.TrimSpace(fmt.Sprintf("%s, %s", w.worst.Shape, w.worst.Output))
		if w.margin == 0 {
			at = "every output exact"
		}
		t.Logf("%-20s %5d %9.2e %8.1e  %s", k, len(w.cases), w.worst.RelErr, w.worst.Tol, at)
	}
}

// TestOpsPerturbed shows that every comparison of TestOps can fail, and that each tolerance is
// far below the effect of a 1% error in one input: with one input of each case moved by ±1% of
// its RMS on the device side, every case must fail its comparison.
func TestOpsPerturbed(t *testing.T) {
	d := device(t)
	all, failed := map[string]bool{}, map[string]bool{}
	for _, r := range devcheck.Run(d, devcheck.Options{Seed: *seed, Perturb: true}) {
		all[r.Case()] = true
		if !r.Pass && r.Note == "" { // a failed comparison, not a device error or a panic
			failed[r.Case()] = true
		}
	}
	for c := range all {
		if !failed[c] {
			t.Errorf("%s: passes with an input perturbed by 1%%: its comparison cannot fail", c)
		}
	}
}

// TestDeterminism runs every case twice from the same inputs: the device's outputs must be the
// same bits, since every reduction has a fixed order and nothing uses atomics.
func TestDeterminism(t *testing.T) {
	d := device(t)
	n := 0
	for _, r := range devcheck.Run(d, devcheck.Options{Seed: *seed + 1, Twice: true}) {
		if !r.Pass {
			t.Errorf("%s, %s: relative error %.3g, tolerance %.3g %s", r.Case(), r.Output, r.RelErr, r.Tol, r.Note)
		}
		n++
	}
	if n == 0 {
		t.Fatal("no results")
	}
}
