package vulkan

import (
	"fmt"
	"math"
	"testing"

	"github.com/shoal-ml/shoal/internal/devcheck"
	"github.com/shoal-ml/shoal/internal/stagecheck"
	"github.com/shoal-ml/shoal/model"
)

// The whole-stage check (wasm/kernelcheck's, natively): a stage trained for a few steps on the
// CPU (model.Host) and on the Vulkan device from the same parameters and data, the kernels
// composed by the model exactly as a worker composes them — MoE routing and local experts
// included.
//
// Tolerances are the browser's (wasm/kernels_browser_test.go): every kernel agrees with its Go
// reference to ≤ 2e-5 relative (most to ~1e-7); over a stage's ~100 ops and three steps, and
// through the router's top-k (a near-tie flipped by a rounding difference routes a token
// elsewhere), differences grow. The bounds sit far below what one wrong term gives (a dropped
// weight decay: ~1e-2 in Δθ, which TestStageCanFail shows).
const (
	stageCETol     = 1e-4 // |Δ CE| / CE per step
	stageActTol    = 1e-3 // activations sent forward, input gradients sent back
	stageNormTol   = 1e-3 // global gradient norm per step
	stageUpdateTol = 5e-3 // ‖Δθ_vk − Δθ_host‖/‖Δθ_host‖, worst tensor
	stageUpdateAll = 1e-3 // the same over all parameters as one vector
)

// The shared check's settings (internal/stagecheck), and its number of steps here.
const (
	stageLR    = stagecheck.LR
	stageWD    = stagecheck.WD
	stageSteps = 3
	stageMicro = stagecheck.Micro
)

// stageRun is one stage's training on one device (the shared check's run).
type stageRun = stagecheck.Run

// trainStage trains blocks [lo, hi) with their experts local for steps steps on dev: the
// whole-stage check's run (internal/stagecheck), which the browser's check trains too.
func trainStage(t testing.TB, cfg model.Config, dev model.Device, lo, hi, steps int) *stageRun {
	t.Helper()
	run, err := stagecheck.Train(cfg, dev, lo, hi, steps, stagecheck.Hooks{})
	if err != nil {
		t.Fatal(err)
	}
	return run
}

// compareStages returns the first disagreement beyond the tolerances, or "".
func compareStages(t *testing.T, name string, host, vk *stageRun) string {
	for i := range host.CE {
		if d := math.Abs(vk.CE[i]-host.CE[i]) / host.CE[i]; !(d <= stageCETol) {
			return fmt.Sprintf("step %d: CE %v on Vulkan, %v on the CPU (relative %.2g > %.0e)", i, vk.CE[i], host.CE[i], d, stageCETol)
		}
	}
	for what, pair := range map[string][2][][]float32{"activation": {vk.Out, host.Out}, "input gradient": {vk.DX, host.DX}} {
		for i := range pair[1] {
			if r := devcheck.RelErr(pair[0][i], pair[1][i]); !(r <= stageActTol) {
				return fmt.Sprintf("%s %d: relative error %.2g > %.0e", what, i, r, stageActTol)
			}
		}
	}
	for i := range host.Norms {
		if r := math.Abs(vk.Norms[i]-host.Norms[i]) / host.Norms[i]; !(r <= stageNormTol) {
			return fmt.Sprintf("step %d: gradient norm relative error %.2g > %.0e", i, r, stageNormTol)
		}
	}
	var allH, allV []float32
	worst, worstName := 0.0, ""
	for i, ht := range host.Shard.P.Tensors {
		vt, h0 := vk.Shard.P.Tensors[i], host.Initial.Tensors[i]
		dh, dv := make([]float32, len(ht.Data)), make([]float32, len(ht.Data))
		for j := range ht.Data {
			dh[j], dv[j] = ht.Data[j]-h0.Data[j], vt.Data[j]-h0.Data[j]
		}
		if r := devcheck.RelErr(dv, dh); r > worst || math.IsNaN(r) {
			worst, worstName = r, ht.Name
		}
		allH, allV = append(allH, dh...), append(allV, dv...)
	}
	all := devcheck.RelErr(allV, allH)
	t.Logf("%s: CE host %v vulkan %v; Δθ rel %.2g overall, %.2g worst (%s)", name, host.CE, vk.CE, all, worst, worstName)
	if !(all <= stageUpdateAll) {
		return fmt.Sprintf("Δθ differs by %.2g relative over all parameters (> %.0e)", all, stageUpdateAll)
	}
	if !(worst <= stageUpdateTol) {
		return fmt.Sprintf("Δθ of %s differs by %.2g relative (> %.0e)", worstName, worst, stageUpdateTol)
	}
	return ""
}

var stageCases = []struct {
	name   string
	lo, hi int // hi < 0: the last block
}{{"whole model", 0, -1}, {"middle stage", 1, 3}}

// TestStage trains the tiny config (with MoE blocks) as one whole-model stage and as a middle
// stage on Host and on the Vulkan device, and compares losses, what the stage sends, gradient
// norms and the parameter updates.
func TestStage(t *testing.T) {
	d := device(t)
	cfg := model.TinyConfig()
	for _, c := range stageCases {
		hi := c.hi
		if hi < 0 {
			hi = cfg.NLayer
		}
		host := trainStage(t, cfg, model.Host{}, c.lo, hi, stageSteps)
		vk := trainStage(t, cfg, d, c.lo, hi, stageSteps)
		if err := d.Err(); err != nil {
			t.Fatal(err)
		}
		if msg := compareStages(t, c.name, host, vk); msg != "" {
			t.Errorf("%s: %s", c.name, msg)
		}
	}
}

// noDecay is a deliberately wrong device: AdamW without weight decay.
type noDecay struct{ *Device }

func (n noDecay) AdamW(w, g, m, v model.Buf, decay, stepSize float32, sqrtBC2 float64, gradScale float32) {
	n.Device.AdamW(w, g, m, v, 1, stepSize, sqrtBC2, gradScale)
}

// TestStageCanFail shows the whole-stage comparison catches one missing term: the same run
// with AdamW's weight decay dropped on the device must fail it.
func TestStageCanFail(t *testing.T) {
	d := device(t)
	cfg := model.TinyConfig()
	host := trainStage(t, cfg, model.Host{}, 0, cfg.NLayer, stageSteps)
	vk := trainStage(t, cfg, noDecay{d}, 0, cfg.NLayer, stageSteps)
	if msg := compareStages(t, "no weight decay", host, vk); msg == "" {
		t.Fatal("a Vulkan run without weight decay passed the whole-stage comparison")
	} else {
		t.Logf("without weight decay, as it must: %s", msg)
	}
}

// counting counts the calls that return host values, each of which must cost the device exactly
// one wait; no other op may wait.
type counting struct {
	*Device
	calls int
}

func (c *counting) Read(dst []float32, src model.Buf) { c.calls++; c.Device.Read(dst, src) }
func (c *counting) CrossEntropyForward(l, t model.Buf, N, V int) float64 {
	c.calls++
	return c.Device.CrossEntropyForward(l, t, N, V)
}
func (c *counting) SquaredNorms(bufs []model.Buf) []float64 {
	c.calls++
	return c.Device.SquaredNorms(bufs)
}
func (c *counting) SquaredNormsWith(bufs []model.Buf, also model.Buf, alsoDst []float32) []float64 {
	c.calls++
	return c.Device.SquaredNormsWith(bufs, also, alsoDst)
}

// TestStepWaits trains a whole-model stage and checks that the device waited once per call that
// returns host values (routing reads, losses, norms, the pulls) and at no other op: the
// training step's ops are batched between them.
func TestStepWaits(t *testing.T) {
	d := device(t)
	cfg := model.TinyConfig()
	c := &counting{Device: d}
	before := d.Waits()
	trainStage(t, cfg, c, 0, cfg.NLayer, 2)
	waits := d.Waits() - before
	t.Logf("2 steps: %d waits for %d host-value calls", waits, c.calls)
	if waits != c.calls {
		t.Fatalf("%d waits for %d calls that return host values", waits, c.calls)
	}
}
