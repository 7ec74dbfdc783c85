package main

import (
	"errors"
	"flag"
	"os"
	"regexp"
	"strings"
	"testing"
)

// TestREADMESynopsisMatchesHelp: README's synopsis of every command names exactly the flags its
// `--help` lists, and README lists every command with the summary `shoal --help` gives it, so
// that the front page cannot drift from the binary.
func TestREADMESynopsisMatchesHelp(t *testing.T) {
	b, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	readme := string(b)
	flagName := regexp.MustCompile(`--([a-z][a-z0-9-]*)`)
	helpFlag := regexp.MustCompile(`(?m)^  -([a-z][a-z0-9-]*)`)
	for _, c := range commands {
		t.Run(c.name, func(t *testing.T) {
			if want := "- **" + c.name + "**: " + c.summary + "\n"; !strings.Contains(readme, want) {
				t.Errorf("README lacks the summary `shoal --help` gives:\n%s", want)
			}
			_, help, err := run(t, c.name, "--help")
			if !errors.Is(err, flag.ErrHelp) {
				t.Fatalf("%s --help: %v", c.name, err)
			}
			// The command's synopsis: from its "shoal NAME" line to the next command's line or the
			// end of the indented block.
			_, rest, ok := strings.Cut(readme, "\n    shoal "+c.name+" ")
			if !ok {
				t.Fatalf("README has no `shoal %s` synopsis line", c.name)
			}
			usage, _, _ := strings.Cut(rest, "\n    shoal ")
			usage, _, _ = strings.Cut(usage, "\n\n")
			inHelp, inREADME := map[string]bool{}, map[string]bool{}
			for _, m := range helpFlag.FindAllStringSubmatch(help, -1) {
				inHelp[m[1]] = true
			}
			for _, m := range flagName.FindAllStringSubmatch(usage, -1) {
				inREADME[m[1]] = true
			}
			if len(inHelp) == 0 {
				t.Fatalf("found no flags in %s --help: the pattern is broken\n%s", c.name, help)
			}
			for f := range inHelp {
				if !inREADME[f] {
					t.Errorf("--%s is in `shoal %s --help` but not in README's synopsis", f, c.name)
				}
			}
			for f := range inREADME {
				if !inHelp[f] {
					t.Errorf("README's `shoal %s` synopsis names --%s, which its --help does not list", c.name, f)
				}
			}
		})
	}
}
