package client

import (
	"bytes"
	"context"
	"io"
	"testing"
	"time"
)

// TestUplinkPaces: an Uplink lets a burst through at once and the rest at its rate, whether the
// bytes are frames (wait) or an upload's body (reader); a nil Uplink does not pace. Only lower
// bounds on the time taken are checked: a loaded machine may take longer, never shorter.
func TestUplinkPaces(t *testing.T) {
	if NewUplink(0) != nil || NewUplink(-1) != nil {
		t.Fatal("a cap of 0 or less is no cap")
	}
	var none *Uplink
	if err := none.wait(context.Background(), 1<<30); err != nil {
		t.Fatal(err)
	}
	const rate = 1 << 20 // bytes/s
	u := NewUplink(rate)
	burst := u.lim.Burst()
	start := time.Now()
	for sent := 0; sent < rate/2+burst; sent += 64 << 10 {
		if err := u.wait(context.Background(), 64<<10); err != nil {
			t.Fatal(err)
		}
	}
	if d := time.Since(start); d < 400*time.Millisecond {
		t.Errorf("half a second's bytes past the burst went in %v", d)
	} else {
		t.Logf("frames: %d bytes in %v under a cap of %d bytes/s (burst %d)", rate/2+burst, d.Round(time.Millisecond), rate, burst)
	}

	u = NewUplink(rate)
	body := bytes.Repeat([]byte{7}, rate/2+burst)
	start = time.Now()
	got, err := io.ReadAll(u.reader(context.Background(), bytes.NewReader(body)))
	if err != nil || !bytes.Equal(got, body) {
		t.Fatalf("paced read: %d bytes, %v", len(got), err)
	}
	if d := time.Since(start); d < 400*time.Millisecond {
		t.Errorf("half a second's upload past the burst read in %v", d)
	} else {
		t.Logf("upload: %d bytes in %v", len(body), d.Round(time.Millisecond))
	}

	// A cancelled wait ends at once with the context's error.
	u = NewUplink(2048)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := u.wait(ctx, 1<<20); err == nil {
		t.Error("a wait under a cancelled context went on")
	}
}
