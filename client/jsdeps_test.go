//go:build !js

package client

import (
	"os/exec"
	"strings"
	"testing"
)

// TestWasmDependencies keeps what cannot or must not run in a browser out of the worker's wasm
// build (in the manner of tailscale's tstest/jsdeps): SQLite, the coordinator and its store, and
// debugging endpoints. It lists the browser entry (wasm/worker), which includes this package. A
// new import that drags one in fails here, not in a browser.
func TestWasmDependencies(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: runs go list")
	}
	cmd := exec.Command("go", "list", "-deps", ".", "../wasm/worker")
	cmd.Env = append(cmd.Environ(), "GOOS=js", "GOARCH=wasm")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("GOOS=js GOARCH=wasm go list -deps: %v\n%s", err, out)
	}
	deps := strings.Fields(string(out))
	// Whole module trees, and single packages (database/sql/driver is fine: uuid implements
	// its interfaces; database/sql itself is the door to SQLite).
	trees := []string{"modernc.org/sqlite", "github.com/shoal-ml/shoal/storage", "github.com/shoal-ml/shoal/coordinator"}
	exact := []string{"database/sql", "net/http/pprof", "os/exec"}
	for _, d := range deps {
		for _, f := range trees {
			if d == f || strings.HasPrefix(d, f+"/") {
				t.Errorf("the wasm worker imports %s", d)
			}
		}
		for _, f := range exact {
			if d == f {
				t.Errorf("the wasm worker imports %s", d)
			}
		}
	}
	if len(deps) < 10 {
		t.Fatalf("go list found only %d packages: %q", len(deps), deps)
	}
}
