//go:build !linux

package main

import "os/exec"

// setParentDeathSignal has no portable equivalent outside Linux: workers are stopped by the
// parent's cleanup only.
func setParentDeathSignal(*exec.Cmd) {}
