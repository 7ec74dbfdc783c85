package model

import "testing"

// TestLargeConfig: the named large config is valid and at least the 100M parameters issue 17
// asks of a model bigger than any one peer.
func TestLargeConfig(t *testing.T) {
	c := LargeConfig()
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, s := range c.Specs() {
		n += s.Size()
	}
	if n < 100_000_000 {
		t.Fatalf("%d parameters, want at least 100M", n)
	}
	t.Logf("large config: %d parameters", n)
}
