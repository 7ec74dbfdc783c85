package main

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/shoal-ml/shoal/client"
)

// TestWorkerNotACoordinator: `shoal worker --coordinator host:port` takes the address without a
// scheme, as `shoal status` does, and a server there that answers 404 ends the worker with
// "this is not a Shoal coordinator" instead of being retried as unreachable for ever.
func TestWorkerNotACoordinator(t *testing.T) {
	hs := httptest.NewServer(http.NotFoundHandler())
	defer hs.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	m := &Main{Stdout: io.Discard, Stderr: io.Discard}
	err := m.Run(ctx, []string{"worker", "--coordinator", strings.TrimPrefix(hs.URL, "http://"), "--device", "cpu", "--threads", "1"})
	if !errors.Is(err, client.ErrNotCoordinator) || !strings.Contains(err.Error(), "this is not a Shoal coordinator") {
		t.Fatalf("worker against a 404 server: %v, want ErrNotCoordinator", err)
	}
	if ctx.Err() != nil {
		t.Fatal("the worker went on retrying until the deadline")
	}
}
