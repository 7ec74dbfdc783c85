package main

import (
	"errors"
	"flag"
	"strings"
	"testing"
)

func TestParseBytes(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want int64  // 0: refused
		err  string // part of the refusal
	}{
		{in: "8GiB", want: 8 << 30},
		{in: "8gib", want: 8 << 30},
		{in: "512MB", want: 512e6},
		{in: "512MiB", want: 512 << 20},
		{in: "1.5GB", want: 1.5e9},
		{in: "1.5 GiB", want: 3 << 29},
		{in: "8000000000", want: 8e9},
		{in: "100B", want: 100},
		{in: "2kb", want: 2000},
		{in: "1TiB", want: 1 << 40},
		{in: " 4KiB ", want: 4096},
		{in: "-5", err: "must be positive"},
		{in: "-5GiB", err: "must be positive"},
		{in: "0", err: "must be positive"},
		{in: "0GiB", err: "must be positive"},
		{in: "", err: "want a byte count"},
		{in: "GiB", err: "want a byte count"},
		{in: "eight", err: "want a byte count"},
		{in: "8 gigs", err: "want a byte count"},
		{in: "8G", err: "want a byte count"},
		{in: "1.2.3GB", err: "is not a number"},
		{in: "1.5B", err: "whole number of bytes"},
		{in: "1e9", err: "want a byte count"},
		{in: "NaN", err: "want a byte count"},
		{in: "99999999TiB", err: "too large"},
	} {
		got, err := parseBytes(tc.in)
		switch {
		case tc.want != 0 && (err != nil || got != tc.want):
			t.Errorf("parseBytes(%q) = %d, %v; want %d", tc.in, got, err, tc.want)
		case tc.want == 0 && (err == nil || !strings.Contains(err.Error(), tc.err)):
			t.Errorf("parseBytes(%q) = %d, %v; want an error saying %q", tc.in, got, err, tc.err)
		}
	}
	for _, n := range []int64{1, 1000, 1024, 8 << 30, 3 << 29, 512e6} {
		if got, err := parseBytes(formatBytes(n)); err != nil || got != n {
			t.Errorf("formatBytes(%d) = %q reads back as %d, %v", n, formatBytes(n), got, err)
		}
	}
}

// TestMemoryFlagsTakeUnits: the commands' byte-count flags take human units and refuse zero,
// negatives and nonsense with a message naming the flag. --help after the flag stops the command
// once the flag has parsed.
func TestMemoryFlagsTakeUnits(t *testing.T) {
	for _, c := range [][2]string{{"worker", "--memory"}, {"train", "--worker-memory"}, {"serve", "--audit-memory"}} {
		for _, v := range []string{"8GiB", "512MB", "1.5GB", "8000000000"} {
			if _, stderr, err := run(t, c[0], c[1], v, "--help"); !errors.Is(err, flag.ErrHelp) {
				t.Errorf("shoal %s %s %s: %v\n%s", c[0], c[1], v, err, stderr)
			}
		}
		for _, v := range []string{"-5", "0", "lots"} {
			_, stderr, err := run(t, c[0], c[1], v, "--help")
			if !errors.Is(err, errUsage) || !strings.Contains(stderr, c[1][1:]) {
				t.Errorf("shoal %s %s %s: %v, want a usage error naming the flag\n%s", c[0], c[1], v, err, stderr)
			}
		}
	}
}
