package main

import (
	"fmt"
	"os"
	"runtime/pprof"
)

// startCPUProfile writes a CPU profile of this process (for `go tool pprof`) to path until the
// returned stop is called: --cpuprofile of shoal train and shoal worker, for developers finding
// where a worker's time goes (docs/benchmarks.md measures with it). The command's own return
// stops it, which a SIGTERM reaches too (the context is cancelled); main's os.Exit would skip a
// deferred stop of its own.
func startCPUProfile(path string) (stop func(), err error) {
	f, err := os.Create(path)
	if err != nil {
		return nil, fmt.Errorf("--cpuprofile: %w", err)
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		f.Close()
		return nil, fmt.Errorf("--cpuprofile: %w", err)
	}
	return func() {
		pprof.StopCPUProfile()
		f.Close()
	}, nil
}
