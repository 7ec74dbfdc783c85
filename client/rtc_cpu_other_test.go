//go:build !unix && !js

package client

import "time"

// processCPU is not measured here: the benchmarks then report 0 CPU per frame.
func processCPU() time.Duration { return 0 }
