package main

import (
	"os"
	"path/filepath"
	"testing"
)

// TestStartCPUProfile: --cpuprofile writes a profile (gzip, as go tool pprof reads it) once
// stopped, and a path it cannot create is an error before anything runs.
func TestStartCPUProfile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "cpu.prof")
	stop, err := startCPUProfile(path)
	if err != nil {
		t.Fatal(err)
	}
	stop()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if len(b) < 2 || b[0] != 0x1f || b[1] != 0x8b {
		t.Fatalf("the profile is %d bytes, not gzip", len(b))
	}
	if _, err := startCPUProfile(filepath.Join(t.TempDir(), "no", "such", "dir", "cpu.prof")); err == nil {
		t.Fatal("a profile under a missing directory was not refused")
	}
}
