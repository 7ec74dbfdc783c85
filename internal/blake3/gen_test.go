package blake3

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

// TestGenerated runs gen_amd64.go and compares what it writes with compress16_amd64.s, so that
// the assembly is never edited by hand nor left behind its generator.
func TestGenerated(t *testing.T) {
	if testing.Short() {
		t.Skip("runs the generator with go run")
	}
	dir := t.TempDir()
	src, err := os.ReadFile("gen_amd64.go")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "gen_amd64.go"), src, 0o644); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("go", "run", "gen_amd64.go")
	cmd.Dir = dir
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go run gen_amd64.go: %v\n%s", err, out)
	}
	got, err := os.ReadFile(filepath.Join(dir, "compress16_amd64.s"))
	if err != nil {
		t.Fatal(err)
	}
	want, err := os.ReadFile("compress16_amd64.s")
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Fatal("compress16_amd64.s differs from what gen_amd64.go writes: run go generate in internal/blake3")
	}
}
