//go:build js && wasm

package webgpu

import (
	"github.com/shoal-ml/shoal/internal/devcheck"
	"github.com/shoal-ml/shoal/kernels/wgsl"
	"github.com/shoal-ml/shoal/model"
)

// Validate runs the device validation suite (internal/devcheck: every op against its Go
// reference, with the tolerance table that Vulkan is held to as well) on d, through a
// ModelDevice — the ops as a shard calls them, AdamW's gathering of a slab's tensors into one
// dispatch included — and on the kernels those ops are built from. Cases of kernels with a GPU
// and a fallback variant run on both, whichever the adapter would pick: both are compiled on
// every adapter, and a GPU must not run a kernel that was never checked.
func Validate(d *Device, o devcheck.Options) []devcheck.Result {
	m := NewModelDevice(d)
	defer func() {
		if m.losses != nil {
			d.Release(m.losses)
		}
	}()
	return devcheck.Run(checkDevice{m}, o)
}

// checkDevice is a ModelDevice as the validation suite sees it: the model's ops, and besides them
// the products, the primitive kernels, both kernel variants and a lowered grid limit. Every
// method takes the device as an op of ModelDevice does, so that a pending AdamW run is recorded
// first.
type checkDevice struct{ *ModelDevice }

var (
	_ devcheck.Device      = checkDevice{}
	_ devcheck.Primitives  = checkDevice{}
	_ devcheck.Variants    = checkDevice{}
	_ devcheck.GridLimiter = checkDevice{}
)

func (c checkDevice) MatMulNN(cc, a, b model.Buf, m, k, n int, acc bool) {
	defer c.lock()()
	c.D.MatMulNN(t(cc), t(a), t(b), m, k, n, acc)
}

func (c checkDevice) MatMulNT(cc, a, b model.Buf, m, k, n int, acc bool) {
	defer c.lock()()
	c.D.MatMulNT(t(cc), t(a), t(b), m, k, n, acc)
}

func (c checkDevice) MatMulTN(cc, a, b model.Buf, m, k, n int, acc bool) {
	defer c.lock()()
	c.D.MatMulTN(t(cc), t(a), t(b), m, k, n, acc)
}

func (c checkDevice) AddOut(out, a, b model.Buf)    { defer c.lock()(); c.D.Add(t(out), t(a), t(b)) }
func (c checkDevice) Fill(dst model.Buf, v float32) { defer c.lock()(); c.D.Fill(t(dst), v) }

func (c checkDevice) BiasAdd(out, bias model.Buf, N, C int) {
	defer c.lock()()
	c.D.BiasAdd(t(out), t(bias), N, C)
}

func (c checkDevice) BiasGrad(db, dout model.Buf, N, C int) {
	defer c.lock()()
	c.D.BiasGrad(t(db), t(dout), N, C)
}

func (c checkDevice) GELUBackwardInPlace(dinout, inp, th model.Buf) {
	defer c.lock()()
	c.D.GELUBackward(t(dinout), t(inp), t(th), t(dinout))
}

// hasVariants lists the validation cases whose ops run a kernel with a GPU and a fallback
// variant: a matmul or a row kernel.
var hasVariants = map[string]bool{
	"MatMulNN": true, "MatMulNT": true, "MatMulTN": true, "AttentionForward": true, "AttentionBackward": true,
	"LinearForward": true, "LinearBackward": true, "LayerNormForward": true, "LayerNormBackward": true,
	"CrossEntropyForward": true, "CrossEntropyBackward": true, "SoftmaxRows": true, "2-D grid": true,
	"Deterministic": true,
}

func (c checkDevice) Variants(kernel string) []string {
	if hasVariants[kernel] {
		return []string{VariantName(false), VariantName(true)}
	}
	return nil
}

func (c checkDevice) UseVariant(name string) (restore func()) {
	defer c.lock()()
	was := c.D.gpuKernels
	c.D.gpuKernels = name == VariantName(true)
	return func() {
		defer c.lock()()
		c.D.gpuKernels = was
	}
}

func (c checkDevice) LimitGrid(groups int) (flat, sumSq int, restore func()) {
	defer c.lock()()
	was := c.D.maxGroups
	c.D.maxGroups = groups
	return wgsl.MaxInvocations, wgsl.SumSquaresChunk, func() {
		defer c.lock()()
		c.D.maxGroups = was
	}
}

// VariantName names the kernel variants, as in a validation case's shape: "[gpu]" (matmul_tiled,
// a workgroup per row) or "[fallback]" (matmul, an invocation per row).
func VariantName(gpu bool) string {
	if gpu {
		return "[gpu]"
	}
	return "[fallback]"
}
