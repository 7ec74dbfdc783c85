package client

import (
	"os"
	"testing"
)

// TestPeakRSS: on Linux the peak resident memory is read, and covers a buffer just touched.
func TestPeakRSS(t *testing.T) {
	if _, err := os.Stat("/proc/self/status"); err != nil {
		if peakRSS() != 0 {
			t.Fatal("a peak without /proc")
		}
		t.Skip("no /proc/self/status here")
	}
	b := make([]byte, 64<<20)
	for i := range b {
		b[i] = 1
	}
	if got := peakRSS(); got < int64(len(b)) {
		t.Fatalf("peak RSS %d B after touching %d B", got, len(b))
	}
}
