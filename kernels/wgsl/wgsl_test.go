package wgsl

import (
	"io/fs"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// The browser test (wasm/kernels_browser_test.go) runs the kernels; these checks hold the
// metadata the host relies on to what the WGSL declares, without a GPU, so that a renamed field
// or a reordered binding fails on every machine rather than as garbage in a browser.

var (
	reEntry     = regexp.MustCompile(`@compute @workgroup_size\((\d+), (\d+), (\d+)\)\s*\n\s*fn (\w+)\(`)
	reBinding   = regexp.MustCompile(`@group\((\d+)\) @binding\((\d+)\) var<(\w+)(?:, (\w+))?> (\w+): ([\w<>]+);`)
	reParams    = regexp.MustCompile(`(?s)struct Params \{(.*?)\n\}`)
	reField     = regexp.MustCompile(`(?m)^\s*(\w+): (u32|f32),`)
	reOverride  = regexp.MustCompile(`(?m)^override (\w+): (?:bool|u32)`)
	reWorkgroup = regexp.MustCompile(`var<workgroup> \w+: array<(f32|u32|i32|vec4<f32>), (\d+)>;`)
	reAnyWG     = regexp.MustCompile(`var<workgroup>`)
)

func TestKernelsMatchSources(t *testing.T) {
	for _, k := range All() {
		t.Run(k.Name, func(t *testing.T) {
			src, err := k.Module()
			if err != nil {
				t.Fatal(err)
			}
			entries := reEntry.FindAllStringSubmatch(src, -1)
			if len(entries) != 1 || entries[0][4] != k.Name {
				t.Fatalf("entry points %q, want exactly one called %s", entries, k.Name)
			}
			inv := 1
			for i := 0; i < 3; i++ {
				n, _ := strconv.Atoi(entries[0][1+i])
				if n != k.Workgroup[i] {
					t.Errorf("workgroup_size %v, metadata says %v", entries[0][1:4], k.Workgroup)
				}
				inv *= n
			}
			if inv > MaxInvocations {
				t.Errorf("%d invocations per workgroup, compatibility adapters allow %d", inv, MaxInvocations)
			}

			bs := reBinding.FindAllStringSubmatch(src, -1)
			if len(bs) != 1+len(k.Bindings) {
				t.Fatalf("%d bindings in the source, metadata has 1 + %d", len(bs), len(k.Bindings))
			}
			if bs[0][1] != "0" || bs[0][2] != "0" || bs[0][3] != "uniform" || bs[0][6] != "Params" {
				t.Errorf("binding 0 is %q, want the uniform Params", bs[0][0])
			}
			for i, b := range k.Bindings {
				got := bs[1+i]
				want := []string{"0", strconv.Itoa(1 + i), "storage", b.Access(), b.Name, "array<" + b.Elem.String() + ">"}
				if strings.Join(got[1:], " ") != strings.Join(want, " ") {
					t.Errorf("binding %d: source %q, metadata wants %q", 1+i, got[0], want)
				}
			}
			if len(k.Bindings) > MaxStorageBuffers {
				t.Errorf("%d storage buffers, at most %d", len(k.Bindings), MaxStorageBuffers)
			}

			pm := reParams.FindStringSubmatch(src)
			if pm == nil {
				t.Fatal("no struct Params")
			}
			var fields []string
			for _, f := range reField.FindAllStringSubmatch(pm[1], -1) {
				fields = append(fields, f[1])
			}
			var want []string
			for _, b := range k.Bindings {
				want = append(want, "off_"+b.Name)
			}
			want = append(want, k.Params...)
			if strings.Join(fields, ",") != strings.Join(want, ",") {
				t.Errorf("Params fields\n%v\nmetadata wants\n%v", fields, want)
			}
			if len(fields) != k.ParamWords() {
				t.Errorf("ParamWords %d, source has %d fields", k.ParamWords(), len(fields))
			}

			var ovs []string
			for _, o := range reOverride.FindAllStringSubmatch(src, -1) {
				ovs = append(ovs, o[1])
			}
			if strings.Join(ovs, ",") != strings.Join(k.Overrides, ",") {
				t.Errorf("overrides %v, metadata %v", ovs, k.Overrides)
			}

			mem := 0
			wgs := reWorkgroup.FindAllStringSubmatch(src, -1)
			for _, w := range wgs {
				n, _ := strconv.Atoi(w[2])
				size := 4
				if w[1] == "vec4<f32>" {
					size = 16
				}
				mem += size * n
			}
			if all := len(reAnyWG.FindAllString(src, -1)); all != len(wgs) {
				t.Errorf("%d workgroup variables, %d of them arrays this test can size", all, len(wgs))
			}
			if mem > MaxWorkgroupMemory {
				t.Errorf("%d bytes of workgroup memory, at most %d", mem, MaxWorkgroupMemory)
			}
		})
	}
}

// TestKernelShapes holds the launch metadata to what the host needs of it: a tile for tiled
// kernels, and reduce.wgsl for exactly the kernels that call its reductions (a row kernel
// without it does not compile; one with it and no call wastes workgroup memory).
func TestKernelShapes(t *testing.T) {
	for _, k := range All() {
		src, err := files.ReadFile(k.Name + ".wgsl")
		if err != nil {
			t.Fatal(err)
		}
		if (k.Grid == Tiled) != (k.Tile != [2]int{}) {
			t.Errorf("%s: grid %d with tile %v", k.Name, k.Grid, k.Tile)
		}
		calls := strings.Contains(string(src), "row_sum(") || strings.Contains(string(src), "row_max(")
		if calls != k.Reduce {
			t.Errorf("%s: calls the reductions: %v, Reduce: %v", k.Name, calls, k.Reduce)
		}
		if k.Grid == Rows && !k.Reduce {
			t.Errorf("%s: one workgroup per row without a workgroup reduction", k.Name)
		}
	}
}

// TestChunkConstants holds the chunk sizes the shaders declare to the Go constants the host
// sizes its launches and scratch buffers by.
func TestChunkConstants(t *testing.T) {
	for _, c := range []struct {
		kernel, name string
		want         int
	}{
		{"bias_grad", "COL_CHUNK", ColumnChunk},
		{"layernorm_backward_params", "COL_CHUNK", ColumnChunk},
		{"sumsq", "SUMSQ_CHUNK", SumSquaresChunk},
	} {
		src, err := files.ReadFile(c.kernel + ".wgsl")
		if err != nil {
			t.Fatal(err)
		}
		m := regexp.MustCompile(`const ` + c.name + `: u32 = (\d+)u;`).FindSubmatch(src)
		if m == nil {
			t.Errorf("%s declares no %s", c.kernel, c.name)
			continue
		}
		if n, _ := strconv.Atoi(string(m[1])); n != c.want {
			t.Errorf("%s: %s = %d, the host assumes %d", c.kernel, c.name, n, c.want)
		}
	}
}

// TestEveryFileIsAKernel keeps a shader from sitting in the package unused (and unvalidated).
func TestEveryFileIsAKernel(t *testing.T) {
	names, err := fs.Glob(files, "*.wgsl")
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range names {
		name := strings.TrimSuffix(f, ".wgsl")
		if _, ok := Lookup(name); !ok && !slices.Contains(Helpers, name) {
			t.Errorf("%s is not in the kernel table", f)
		}
	}
	if len(names) != len(All())+len(Helpers) {
		t.Errorf("%d .wgsl files for %d kernels and %d helpers", len(names), len(All()), len(Helpers))
	}
}
