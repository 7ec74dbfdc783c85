//go:build !unix

package main

// stop kills the process where no signal stops one (SHOAL_CHURN_VANISH is a unix soak).
func (p *proc) stop() {
	p.kill()
}
