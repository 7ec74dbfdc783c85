//go:build !js

package data

import (
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strings"
)

// GoRoot finds the Go installation: $GOROOT, then `go env GOROOT`, then the GOROOT this binary was
// built with.
func GoRoot() (string, error) {
	if r := os.Getenv("GOROOT"); r != "" {
		return r, nil
	}
	if out, err := exec.Command("go", "env", "GOROOT").Output(); err == nil {
		if r := strings.TrimSpace(string(out)); r != "" {
			return r, nil
		}
	}
	//lint:ignore SA1019 the last resort for a binary copied away from its toolchain
	if r := runtime.GOROOT(); r != "" {
		return r, nil
	}
	return "", fmt.Errorf("%w: cannot find the Go installation for the default corpus", ErrNoData)
}
