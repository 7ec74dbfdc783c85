package coordinator

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"testing"
)

// TestDataDirLock: a second coordinator on a data directory in use is refused, naming the
// directory and the holder's pid, and takes it once the first has closed.
func TestDataDirLock(t *testing.T) {
	dir := t.TempDir()
	cfg := Config{DataDir: dir, AdminToken: servingAdmin, Logger: slog.New(slog.DiscardHandler)}
	s1, err := New(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	_, err = New(context.Background(), cfg)
	if err == nil {
		s1.Close()
		t.Fatal("a second coordinator opened the data directory in use")
	}
	for _, want := range []string{dir, fmt.Sprintf("pid %d", os.Getpid()), "in use"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("the refusal %q does not say %q", err, want)
		}
	}
	s1.Close()
	s2, err := New(context.Background(), cfg)
	if err != nil {
		t.Fatalf("after the first closed: %v", err)
	}
	s2.Close()
}
