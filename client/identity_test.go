package client

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestLoadIdentity: the first run makes a key in a file of mode 0600 (and its directory), the
// next reads the same key back; a file others may read, or that holds no key, is refused.
func TestLoadIdentity(t *testing.T) {
	path := filepath.Join(t.TempDir(), "cfg", "shoal", "identity")
	k1, created, err := LoadIdentity(path)
	if err != nil || !created {
		t.Fatalf("first load: created %v, %v", created, err)
	}
	if fi, err := os.Stat(path); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("identity file: %v, %v; want mode 0600", fi, err)
	}
	k2, created, err := LoadIdentity(path)
	if err != nil || created || !k1.Equal(k2) {
		t.Fatalf("second load: created %v, same key %v, %v", created, k1.Equal(k2), err)
	}
	os.Chmod(path, 0o644)
	if _, _, err := LoadIdentity(path); err == nil || !strings.Contains(err.Error(), "chmod 600") {
		t.Errorf("a readable key: %v, want refused", err)
	}
	os.WriteFile(path, []byte("shoal-identity-v1 bm90IGEga2V5\n"), 0o600)
	os.Chmod(path, 0o600)
	if _, _, err := LoadIdentity(path); err == nil {
		t.Error("a file without a key was taken")
	}
}
