package wgsl

import (
	"embed"
	"fmt"
	"sort"
)

//go:embed *.wgsl
var files embed.FS

// MaxInvocations is the most invocations any kernel's workgroup holds: the
// maxComputeInvocationsPerWorkgroup of a compatibility-mode adapter.
const MaxInvocations = 128

// MaxStorageBuffers is the most storage buffers any kernel binds (maxStorageBuffersPerShaderStage's
// default, in core and compatibility mode alike).
const MaxStorageBuffers = 8

// MaxWorkgroupMemory is the most workgroup memory, in bytes, any kernel declares
// (maxComputeWorkgroupStorageSize of a compatibility-mode device).
const MaxWorkgroupMemory = 16384

// ColumnChunk is how many rows each partial sum of a column reduction covers (bias_grad,
// layernorm_backward_params): a sum over N rows is ⌈N/ColumnChunk⌉ chunk sums in row order,
// then a pairwise tree over the chunks (colsum_tree).
const ColumnChunk = 32

// SumSquaresChunk is how many elements of x each partial sum of the sumsq kernel covers.
const SumSquaresChunk = 4096

// Elem is the element type of a storage buffer.
type Elem int

const (
	F32 Elem = iota
	I32
)

func (e Elem) String() string {
	if e == I32 {
		return "i32"
	}
	return "f32"
}

// Grid says how a kernel's launch is sized.
type Grid int

const (
	// Flat: one invocation per item of a count (elements, rows or columns, as the kernel's doc
	// says), 128 per workgroup. The workgroups are spread over x and y (x at most the adapter's
	// maxComputeWorkgroupsPerDimension) because one dimension holds at most 65535 of them.
	Flat Grid = iota
	// Tiled: a matmul's workgroup (x, y, z) computes the Tile[0]×Tile[1] tile at column
	// x·Tile[1] and row y·Tile[0] of matrix z of the batch.
	Tiled
	// Chunked: one workgroup per SumSquaresChunk elements, spread over x and y as for Flat.
	Chunked
	// Rows: LANES invocations per row (an override, 1 or 128: see reduce.wgsl), 128/LANES rows
	// per workgroup, the workgroups spread over x and y as for Flat.
	Rows
	// Single: one workgroup for the whole op (moe_stats: a few columns summed in a fixed order).
	Single
)

// Binding is one storage buffer of a kernel.
type Binding struct {
	Name string
	Elem Elem
	// Write: the kernel writes the buffer (read_write); otherwise it only reads it (read).
	Write bool
}

// Access is the binding's WGSL access mode, which the bind-group layout must match
// ("storage" or "read-only-storage" there).
func (b Binding) Access() string {
	if b.Write {
		return "read_write"
	}
	return "read"
}

// Kernel is one compute entry point and how to call it.
type Kernel struct {
	// Name is the entry point and the file name without .wgsl.
	Name string
	// Bindings are the storage buffers at @binding(1)…, in order.
	Bindings []Binding
	// Params are the uniform fields after the per-binding offsets, in order; each is 4 bytes.
	Params []string
	// Overrides are the pipeline-overridable constants the host must set.
	Overrides []string
	// Workgroup is the @workgroup_size.
	Workgroup [3]int
	Grid      Grid
	// Tile is the rows and columns of C one workgroup computes (Grid Tiled).
	Tile [2]int
	// Reduce: the module includes reduce.wgsl (row reductions in workgroup memory, and the
	// LANES override) after common.wgsl.
	Reduce bool
}

// ParamWords is the number of 4-byte words in the kernel's Params block.
func (k Kernel) ParamWords() int { return len(k.Bindings) + len(k.Params) }

// Helpers are the .wgsl files that are no kernel but are prepended to kernels: common.wgsl to
// every one, reduce.wgsl to those with Reduce.
var Helpers = []string{"common", "reduce"}

// Module returns the WGSL module for k: the shared helpers followed by the kernel.
func (k Kernel) Module() (string, error) {
	parts := []string{"common"}
	if k.Reduce {
		parts = append(parts, "reduce")
	}
	parts = append(parts, k.Name)
	var mod string
	for i, name := range parts {
		src, err := files.ReadFile(name + ".wgsl")
		if err != nil {
			return "", fmt.Errorf("wgsl: kernel %s: %w", k.Name, err)
		}
		if i > 0 {
			mod += "\n"
		}
		mod += string(src)
	}
	return mod, nil
}

// rw and ro are written and read-only float32 bindings; ri and wi read-only and written int32 ones.
func rw(name string) Binding { return Binding{name, F32, true} }
func ro(name string) Binding { return Binding{name, F32, false} }
func ri(name string) Binding { return Binding{name, I32, false} }
func wi(name string) Binding { return Binding{name, I32, true} }

func bind(b ...Binding) []Binding { return b }

var flat = [3]int{128, 1, 1}

// table lists every kernel; All hands out copies so that no caller can change it.
var table = []Kernel{
	// matmul (fallback adapters) and matmul_tiled (GPUs) take the same bindings and parameters:
	// the host picks one by the adapter and drives both alike.
	{Name: "matmul", Bindings: bind(rw("c"), ro("a"), ro("b"), ro("bias")),
		Params: matmulParams, Overrides: []string{"TRANS_A", "TRANS_B"}, Workgroup: [3]int{16, 8, 1}, Grid: Tiled, Tile: [2]int{32, 64}},
	{Name: "matmul_tiled", Bindings: bind(rw("c"), ro("a"), ro("b"), ro("bias")),
		Params: matmulParams, Overrides: []string{"TRANS_A", "TRANS_B"}, Workgroup: flat, Grid: Tiled, Tile: [2]int{64, 64}},
	{Name: "attention_softmax", Bindings: bind(rw("att")), Params: []string{"rows", "t", "scale"}, Workgroup: flat, Grid: Rows, Reduce: true, Overrides: lanes},
	{Name: "attention_softmax_backward", Bindings: bind(rw("ds"), ro("att")), Params: []string{"rows", "t", "scale"}, Workgroup: flat, Grid: Rows, Reduce: true, Overrides: lanes},
	{Name: "layernorm_forward", Bindings: bind(rw("out"), rw("mean"), rw("rstd"), ro("inp"), ro("w"), ro("b")), Params: []string{"rows", "c"}, Workgroup: flat, Grid: Rows, Reduce: true, Overrides: lanes},
	{Name: "layernorm_backward_input", Bindings: bind(rw("dinp"), ro("dout"), ro("inp"), ro("w"), ro("mean"), ro("rstd")), Params: []string{"rows", "c"}, Workgroup: flat, Grid: Rows, Reduce: true, Overrides: lanes},
	// Column sums over rows: a pass of chunk sums (one invocation per chunk and column), then
	// colsum_tree.
	{Name: "layernorm_backward_params", Bindings: bind(rw("partials"), ro("dout"), ro("inp"), ro("mean"), ro("rstd")), Params: []string{"rows", "c"}, Workgroup: flat},
	{Name: "bias_grad", Bindings: bind(rw("partials"), ro("dout")), Params: []string{"rows", "c"}, Workgroup: flat},
	{Name: "colsum_tree", Bindings: bind(rw("dst"), rw("partials")), Params: []string{"chunks", "c"}, Workgroup: flat},
	{Name: "gelu_forward", Bindings: bind(rw("out"), rw("th"), ro("inp")), Params: []string{"n"}, Workgroup: flat},
	{Name: "gelu_backward", Bindings: bind(rw("dinp"), ro("inp"), ro("th"), ro("dout")), Params: []string{"n"}, Workgroup: flat},
	{Name: "encoder_forward", Bindings: bind(rw("out"), ri("inp"), ro("wte"), ro("wpe")), Params: []string{"rows", "t", "c"}, Workgroup: flat},
	{Name: "encoder_links", Bindings: bind(wi("links"), ri("inp")), Params: []string{"rows"}, Workgroup: flat},
	{Name: "encoder_backward", Bindings: bind(rw("dwte"), rw("dwpe"), ro("dout"), ri("inp"), ri("links")), Params: []string{"rows", "t", "c"}, Workgroup: flat},
	{Name: "crossentropy_forward", Bindings: bind(rw("losses"), ro("logits"), ri("targets")), Params: []string{"rows", "v"}, Workgroup: flat, Grid: Rows, Reduce: true, Overrides: lanes},
	{Name: "crossentropy_backward", Bindings: bind(rw("logits"), ri("targets")), Params: []string{"rows", "v", "scale"}, Workgroup: flat, Grid: Rows, Reduce: true, Overrides: lanes},
	{Name: "softmax_rows", Bindings: bind(rw("x")), Params: []string{"rows", "e"}, Workgroup: flat, Grid: Rows, Reduce: true, Overrides: lanes},
	{Name: "adamw", Bindings: bind(rw("w"), ro("g"), rw("m"), rw("v")), Params: []string{"n", "decay", "step_size", "sqrt_bc2", "grad_scale"}, Workgroup: flat},
	{Name: "adamw_slab", Bindings: bind(rw("w"), ro("g"), rw("m"), rw("v"), ri("segs")), Params: []string{"n", "nsegs", "decay", "step_size", "sqrt_bc2", "grad_scale"}, Workgroup: flat},
	{Name: "add", Bindings: bind(rw("out"), ro("a"), ro("b")), Params: []string{"n"}, Workgroup: flat},
	{Name: "add_inplace", Bindings: bind(rw("dst"), ro("src")), Params: []string{"n"}, Workgroup: flat},
	{Name: "copy", Bindings: bind(rw("dst"), ro("src")), Params: []string{"n"}, Workgroup: flat},
	{Name: "fill", Bindings: bind(rw("dst")), Params: []string{"n", "value"}, Workgroup: flat},
	{Name: "bias_add", Bindings: bind(rw("out"), ro("bias")), Params: []string{"rows", "c"}, Workgroup: flat},
	{Name: "sumsq", Bindings: bind(rw("partials"), ro("x")), Params: []string{"n"}, Workgroup: flat, Grid: Chunked},
	// An MoE block's routing on the device (kernels/moe.go): rows of E experts, E small.
	{Name: "topk_gate", Bindings: bind(rw("gate"), rw("mask"), ro("probs")), Params: []string{"rows", "e", "k"}, Workgroup: flat},
	{Name: "gate_rows", Bindings: bind(rw("dst"), ro("src"), ro("gate")), Params: []string{"rows", "c", "expert", "experts", "acc"}, Workgroup: flat},
	{Name: "gate_grad", Bindings: bind(rw("dgate"), ro("dout"), ro("y"), ro("mask")), Params: []string{"rows", "c", "expert", "experts"}, Workgroup: flat},
	{Name: "moe_stats", Bindings: bind(rw("stats"), ro("mask"), ro("probs")), Params: []string{"rows", "e", "k"}, Workgroup: flat, Grid: Single},
	{Name: "aux_grad", Bindings: bind(rw("dgate"), ro("stats")), Params: []string{"rows", "e", "k", "scale"}, Workgroup: flat},
	{Name: "softmax_backward_rows", Bindings: bind(rw("dx"), ro("probs"), ro("dprobs")), Params: []string{"rows", "e"}, Workgroup: flat},
}

// lanes is the override of the row kernels (reduce.wgsl).
var lanes = []string{"LANES"}

var matmulParams = []string{"m", "k", "n", "ldc", "lda", "ldb", "acc", "has_bias", "batch_inner",
	"sc_outer", "sc_inner", "sa_outer", "sa_inner", "sb_outer", "sb_inner"}

// All returns every kernel, sorted by name.
func All() []Kernel {
	ks := make([]Kernel, len(table))
	for i, k := range table {
		k.Bindings = append([]Binding(nil), k.Bindings...)
		k.Params = append([]string(nil), k.Params...)
		k.Overrides = append([]string(nil), k.Overrides...)
		ks[i] = k
	}
	sort.Slice(ks, func(i, j int) bool { return ks[i].Name < ks[j].Name })
	return ks
}

// Lookup returns the kernel called name.
func Lookup(name string) (Kernel, bool) {
	for _, k := range All() {
		if k.Name == name {
			return k, true
		}
	}
	return Kernel{}, false
}
