package main

import (
	"errors"
	"flag"
	"os"
	"regexp"
	"strings"
	"testing"
)

// TestServeFlagsMatchREADME: every flag `shoal serve --help` lists is in README's `shoal serve`
// usage lines, and every flag those lines name exists, so that the two cannot drift apart.
func TestServeFlagsMatchREADME(t *testing.T) {
	_, help, err := run(t, "serve", "--help")
	if !errors.Is(err, flag.ErrHelp) {
		t.Fatalf("serve --help: %v", err)
	}
	readme, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	// The serve lines: from "shoal serve" to the next command's line.
	_, rest, ok := strings.Cut(string(readme), "    shoal serve ")
	if !ok {
		t.Fatal("README has no `shoal serve` usage line")
	}
	usage, _, _ := strings.Cut(rest, "\n    shoal ")
	flagName := regexp.MustCompile(`--([a-z][a-z0-9-]*)`)
	inHelp := map[string]bool{}
	for _, m := range regexp.MustCompile(`(?m)^  -([a-z][a-z0-9-]*)`).FindAllStringSubmatch(help, -1) {
		inHelp[m[1]] = true
	}
	inREADME := map[string]bool{}
	for _, m := range flagName.FindAllStringSubmatch(usage, -1) {
		inREADME[m[1]] = true
	}
	if len(inHelp) < 10 {
		t.Fatalf("found %d flags in --help: the pattern is broken\n%s", len(inHelp), help)
	}
	for f := range inHelp {
		if !inREADME[f] {
			t.Errorf("--%s is in `shoal serve --help` but not in README's usage", f)
		}
	}
	for f := range inREADME {
		if !inHelp[f] {
			t.Errorf("README's `shoal serve` usage names --%s, which `shoal serve --help` does not list", f)
		}
	}
	for _, want := range []string{"-max-conns N", "(default 4096)", "-max-conns-per-ip N", "(default 256)"} {
		if !strings.Contains(help, want) {
			t.Errorf("serve --help lacks %q:\n%s", want, help)
		}
	}
}

// TestServeRejectsNegativeCaps: a cap is a count, or 0 for none.
func TestServeRejectsNegativeCaps(t *testing.T) {
	for _, f := range []string{"--max-conns=-1", "--max-conns-per-ip=-1"} {
		if _, _, err := run(t, "serve", "--data-dir", t.TempDir(), f); err == nil || !strings.Contains(err.Error(), "max-conns") {
			t.Errorf("serve %s: %v, want an error about the caps", f, err)
		}
	}
}
