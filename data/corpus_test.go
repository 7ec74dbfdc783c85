package data

import (
	"encoding/binary"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

func write(t *testing.T, root, rel, body string) {
	t.Helper()
	p := filepath.Join(root, rel)
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, []byte(body), 0o644); err != nil {
		t.Fatal(err)
	}
}

func TestLoadDirectory(t *testing.T) {
	root := t.TempDir()
	write(t, root, "b.go", "B")
	write(t, root, "a/z.go", "AZ")
	write(t, root, "a.go", "A")         // "a.go" < "a/z.go" in byte order ('.' < '/')
	write(t, root, "A.go", "upper")     // upper case sorts first
	write(t, root, ".hidden/x.go", "H") // hidden directory: skipped
	write(t, root, "c/.x.go", "H")      // hidden file: skipped
	write(t, root, "notes.txt", "T")    // other extension: skipped
	if err := os.Symlink(filepath.Join(root, "b.go"), filepath.Join(root, "link.go")); err != nil {
		t.Fatal(err)
	}
	c, err := Load(root, []string{".go"})
	if err != nil {
		t.Fatal(err)
	}
	if got, want := string(c.tok8), "upperAAZB"; got != want {
		t.Fatalf("corpus %q, want %q", got, want)
	}
	if c.Files != 4 {
		t.Errorf("%d files, want 4", c.Files)
	}
}

// TestLoadErrorsNameThePath: Load's errors name the path and no flag: the coordinator loads a
// job's data too, and `shoal serve` has no --data (the commands that do add the hint).
func TestLoadErrorsNameThePath(t *testing.T) {
	root := t.TempDir()
	write(t, root, "x.txt", "nothing to see")
	for _, p := range []string{root, filepath.Join(root, "missing")} {
		_, err := Load(p, []string{".go"})
		if !errors.Is(err, ErrNoData) {
			t.Fatalf("%s: %v, want ErrNoData", p, err)
		}
		if !strings.Contains(err.Error(), p) || strings.Contains(err.Error(), "--") {
			t.Errorf("error %q should name %s and no flag", err, p)
		}
	}
}

// TestCheck: Check refuses what Load would refuse, naming the path and why, and passes what Load
// reads.
func TestCheck(t *testing.T) {
	root := t.TempDir()
	write(t, root, "a/x.go", "package x")
	write(t, root, "b/x.txt", "text")
	write(t, root, "empty.txt", "")
	write(t, root, "c/.hidden/y.go", "package y")
	for _, tc := range []struct {
		path string
		exts []string
		err  string // "" passes
	}{
		{path: filepath.Join(root, "a"), exts: []string{".go"}},
		{path: filepath.Join(root, "b", "x.txt")},
		{path: root, exts: []string{".go"}},
		{path: filepath.Join(root, "missing.txt"), err: "does not exist"},
		{path: filepath.Join(root, "b"), exts: []string{".go"}, err: "holds no files ending in"},
		{path: filepath.Join(root, "c"), exts: []string{".go"}, err: "holds no files ending in"},
		{path: filepath.Join(root, "empty.txt"), err: "is empty"},
	} {
		err := Check(tc.path, tc.exts)
		if tc.err == "" {
			if err != nil {
				t.Errorf("Check(%s, %q): %v", tc.path, tc.exts, err)
			} else if _, err := Load(tc.path, tc.exts); err != nil {
				t.Errorf("Check passed %s, Load: %v", tc.path, err)
			}
			continue
		}
		if !errors.Is(err, ErrNoData) || !strings.Contains(err.Error(), tc.err) || !strings.Contains(err.Error(), tc.path) {
			t.Errorf("Check(%s, %q) = %v, want ErrNoData naming the path and saying %q", tc.path, tc.exts, err, tc.err)
		}
		if _, lerr := Load(tc.path, tc.exts); lerr == nil {
			t.Errorf("Check refused %s, which Load reads", tc.path)
		}
	}
}

func TestLoadBin(t *testing.T) {
	p := filepath.Join(t.TempDir(), "train.bin")
	var b []byte
	for _, v := range []uint16{1, 500, 65535, 7} {
		b = binary.LittleEndian.AppendUint16(b, v)
	}
	os.WriteFile(p, b, 0o644)
	c, err := Load(p, nil)
	if err != nil {
		t.Fatal(err)
	}
	if c.Len() != 4 || c.at(1) != 500 || c.MaxToken() != 65535 {
		t.Fatalf("len %d, at(1) %d, max %d", c.Len(), c.at(1), c.MaxToken())
	}
	os.WriteFile(p, b[:3], 0o644)
	if _, err := Load(p, nil); err == nil {
		t.Fatal("odd-length .bin accepted")
	}
}

func TestSplitAndValidationWindows(t *testing.T) {
	b := make([]byte, 10000)
	for i := range b {
		b[i] = byte(i * 7)
	}
	c := FromBytes(b)
	if c.TrainLen() != 9900 || c.ValLen() != 100 {
		t.Fatalf("split %d/%d", c.TrainLen(), c.ValLen())
	}
	const T = 8
	x, y, err := c.Validation(T)
	if err != nil {
		t.Fatal(err)
	}
	// The anchor: offset_i = i*(len(val)-T-1)//31 into the held-out part.
	for i := 0; i < ValWindows; i++ {
		off := 9900 + i*(100-T-1)/31
		for j := 0; j < T; j++ {
			if x[i*T+j] != int32(b[off+j]) || y[i*T+j] != int32(b[off+j+1]) {
				t.Fatalf("window %d differs from the anchor's placement at offset %d", i, off)
			}
		}
	}
}

func TestBatchIsAFunctionOfSeedAndStep(t *testing.T) {
	b := make([]byte, 50000)
	for i := range b {
		b[i] = byte(i ^ (i >> 8))
	}
	c := FromBytes(b)
	x1, y1, _ := c.Batch(3, 10, 4, 16)
	c.Batch(3, 11, 4, 16) // drawing other batches in between changes nothing
	x2, y2, _ := c.Batch(3, 10, 4, 16)
	if !slices.Equal(x1, x2) || !slices.Equal(y1, y2) {
		t.Fatal("same (seed, step) gave different batches")
	}
	x3, _, _ := c.Batch(3, 12, 4, 16)
	x4, _, _ := c.Batch(4, 10, 4, 16)
	if slices.Equal(x1, x3) || slices.Equal(x1, x4) {
		t.Fatal("different step or seed gave the same batch")
	}
	for r := 0; r < 4; r++ {
		for j := 0; j+1 < 16; j++ {
			if y1[r*16+j] != x1[r*16+j+1] {
				t.Fatal("targets are not the inputs shifted by one")
			}
		}
	}
}

func TestWindows(t *testing.T) {
	c := FromBytes([]byte("abcdefghij"))
	x, y, err := c.Windows(3, 2)
	if err != nil {
		t.Fatal(err)
	}
	if string(bytesOf(x)) != "abdegh" || string(bytesOf(y)) != "bcefhi" {
		t.Fatalf("x %q y %q", bytesOf(x), bytesOf(y))
	}
	if _, _, err := c.Windows(4, 2); err == nil {
		t.Fatal("windows past the end accepted")
	}
}

func bytesOf(v []int32) []byte {
	out := make([]byte, len(v))
	for i, t := range v {
		out[i] = byte(t)
	}
	return out
}

func TestGoRootCorpus(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: reads the whole Go standard library")
	}
	c, err := Load(GoRootSource, []string{".go"})
	if err != nil {
		t.Fatal(err)
	}
	if c.Files < 1000 || c.ValLen() < 10000 {
		t.Fatalf("%d files, %d held-out tokens: not the standard library", c.Files, c.ValLen())
	}
}
