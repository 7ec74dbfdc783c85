package client

import (
	"testing"
	"time"

	"github.com/shoal-ml/shoal/model"
)

func TestTimeDeviceStep(t *testing.T) {
	d, err := TimeDeviceStep(model.Host{})
	if err != nil {
		t.Fatal(err)
	}
	if d <= 0 || d > time.Minute {
		t.Fatalf("a step of two tiny blocks took %v", d)
	}
	t.Logf("step of two tiny blocks on the CPU kernels: %v", d)
}

func TestBrowserGFLOPS(t *testing.T) {
	ms := time.Millisecond
	for _, c := range []struct {
		cpu              float64
		cpuStep, devStep time.Duration
		use              bool
		want             float64
	}{
		{2, 100 * ms, 400 * ms, false, 2}, // SwiftShader: slower than the CPU, not used
		{2, 100 * ms, 10 * ms, true, 20},  // a real GPU ten times faster
		{2, 100 * ms, 100 * ms, false, 2}, // a tie keeps the CPU (no readbacks to pay)
		{2, 100 * ms, 0, false, 2},        // no second backend
	} {
		use, got := BrowserGFLOPS(c.cpu, c.cpuStep, c.devStep)
		if use != c.use || got != c.want {
			t.Errorf("BrowserGFLOPS(%v, %v, %v) = %v, %v; want %v, %v", c.cpu, c.cpuStep, c.devStep, use, got, c.use, c.want)
		}
	}
}

// TestTimeDeviceStepWithin: a rival's time the warm-up already exceeds stops the timing there,
// and otherwise at least one step is timed after the warm-up.
func TestTimeDeviceStepWithin(t *testing.T) {
	cfg := model.TinyConfig()
	cfg.NLayer = 2
	d, err := TimeDeviceStepWithin(model.Host{}, cfg, 1, 0, 0)
	if err != nil || d <= 0 {
		t.Fatalf("no budget: %v, %v; want one timed step", d, err)
	}
	// giveUp of a nanosecond: the warm-up is longer, and its time is returned.
	w, err := TimeDeviceStepWithin(model.Host{}, cfg, 1, time.Hour, time.Nanosecond)
	if err != nil || w <= 0 {
		t.Fatalf("giveUp: %v, %v", w, err)
	}
}
