package main

import (
	"flag"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestApplyConfig: a service's config file sets a command's flags by name; the command line wins;
// a flag the command lacks, a value it refuses, or a non-boolean flag without a value is an error
// naming the file and line.
func TestApplyConfig(t *testing.T) {
	newFS := func() (*flag.FlagSet, *string, *int, *bool, *byteSize) {
		fs := flag.NewFlagSet("shoal worker", flag.ContinueOnError)
		fs.SetOutput(io.Discard)
		coord := fs.String("coordinator", "", "")
		threads := fs.Int("threads", 0, "")
		logJSON := fs.Bool("log-json", false, "")
		memory := bytesFlag(fs, "memory", 8<<30, "")
		fs.String("config", "", "")
		return fs, coord, threads, logJSON, memory
	}
	write := func(body string) string {
		p := filepath.Join(t.TempDir(), "worker.conf")
		if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	conf := write("# a volunteer's worker\ncoordinator = http://127.0.0.1:8470\n--threads 3\nmemory=4GiB\nlog-json\n\n")
	fs, coord, threads, logJSON, memory := newFS()
	if err := fs.Parse([]string{"--threads", "2"}); err != nil {
		t.Fatal(err)
	}
	if err := applyConfig(fs, conf); err != nil {
		t.Fatal(err)
	}
	if *coord != "http://127.0.0.1:8470" || *threads != 2 || !*logJSON || int64(*memory) != 4<<30 {
		t.Fatalf("coordinator %q threads %d log-json %v memory %d: want the file's, threads from the command line", *coord, *threads, *logJSON, *memory)
	}
	for _, tc := range []struct{ body, want string }{
		{"gpu-memory = 1GiB\n", `:1: "gpu-memory" is not a flag`},
		{"# fine\nmemory = -5\n", ":2: memory:"},
		{"threads\n", ":1: threads needs a value"},
		{"config = other.conf\n", "does not name another"},
		{strings.Repeat("#", 70<<10) + "\n", "longer than"},
	} {
		fs, _, _, _, _ := newFS()
		fs.Parse(nil)
		if err := applyConfig(fs, write(tc.body)); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("config %.40q: %v, want an error with %q", tc.body, err, tc.want)
		}
	}
}
