package main

import (
	"os/exec"
	"syscall"
)

// setParentDeathSignal makes the kernel kill a worker whose parent dies, so that a killed
// `shoal train --workers` leaves no process behind.
func setParentDeathSignal(cmd *exec.Cmd) {
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
