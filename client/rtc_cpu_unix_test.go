//go:build unix && !js

package client

import (
	"syscall"
	"time"
)

// processCPU is the user and system CPU time this process has used. The RTC benchmarks report
// it per frame: on a shared 2-core machine it is steadier than wall-clock throughput.
func processCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
