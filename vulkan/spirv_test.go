package vulkan

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestSPIRVCurrent regenerates the SPIR-V from vulkan/shaders into a temporary directory and
// fails if any checked-in vulkan/spv/*.spv differs, is missing, or is left over: the device
// embeds the .spv files, so a shader edited without `go generate ./vulkan/` would otherwise ship
// its old code.
func TestSPIRVCurrent(t *testing.T) {
	if _, err := exec.LookPath("glslangValidator"); err != nil {
		t.Skip("glslangValidator not installed (apt-get install glslang-tools): cannot regenerate the SPIR-V to compare")
	}
	dir := t.TempDir()
	cmd := exec.Command("sh", filepath.Join("..", "scripts", "gen_spirv.sh"), dir)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("gen_spirv.sh: %v\n%s", err, out)
	}
	fresh, err := filepath.Glob(filepath.Join(dir, "*.spv"))
	if err != nil || len(fresh) == 0 {
		t.Fatalf("gen_spirv.sh produced no SPIR-V (%v)", err)
	}
	for _, f := range fresh {
		name := filepath.Base(f)
		want, _ := os.ReadFile(f)
		got, err := os.ReadFile(filepath.Join("spv", name))
		if err != nil {
			t.Errorf("spv/%s is missing: run go generate ./vulkan/", name)
			continue
		}
		if !bytes.Equal(got, want) {
			t.Errorf("spv/%s is stale: run go generate ./vulkan/", name)
		}
		if _, ok := kernelBindings[strings.TrimSuffix(name, ".spv")]; !ok {
			t.Errorf("kernel %s has no entry in kernelBindings", name)
		}
	}
	old, _ := filepath.Glob(filepath.Join("spv", "*.spv"))
	if len(old) != len(fresh) {
		t.Errorf("spv/ holds %d files, the shaders make %d: remove the stale ones", len(old), len(fresh))
	}
}
