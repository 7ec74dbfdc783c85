//go:build unix

package main

import "syscall"

// stop SIGSTOPs the process: it keeps its sockets open and says nothing, a machine that vanished.
func (p *proc) stop() {
	p.cmd.Process.Signal(syscall.SIGSTOP)
}
