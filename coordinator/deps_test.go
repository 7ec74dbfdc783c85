package coordinator

import (
	"os/exec"
	"strings"
	"testing"
)

// TestDependencies enforces doc.go and docs/design.md ("Packages"): the coordinator sits beside the worker
// runtime, not above it. What both need (step specs, token tensors, step totals) lives in proto;
// importing client would drag WebRTC and the worker's compute into the server and let the two
// sides' code grow into each other. Tests may still import client: they run real workers.
func TestDependencies(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: runs go list")
	}
	out, err := exec.Command("go", "list", "-deps", ".").CombinedOutput()
	if err != nil {
		t.Fatalf("go list -deps: %v\n%s", err, out)
	}
	deps := strings.Fields(string(out))
	const forbidden = "github.com/shoal-ml/shoal/client"
	for _, d := range deps {
		if d == forbidden || strings.HasPrefix(d, forbidden+"/") {
			t.Errorf("the coordinator imports %s", d)
		}
	}
	if len(deps) < 10 {
		t.Fatalf("go list found only %d packages: %q", len(deps), deps)
	}
}
