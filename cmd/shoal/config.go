package main

import (
	"bufio"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
)

// A config file holds a command's flags for a service to start it with one argument: a line is
// `name = value` (or `name value`) with the flag's name without dashes, `#` starts a comment, and
// a boolean flag may stand alone. Flags given on the command line win over the file's.
//
//	# /etc/shoal/worker.conf
//	coordinator = https://shoal.example.org
//	memory = 8GiB
//	threads = 4

// maxConfigBytes bounds a config file: a few flags, never megabytes.
const maxConfigBytes = 64 << 10

// applyConfig sets fs's flags from the config file at path, except those set on the command line
// (fs has been parsed). A flag the command does not have, or a value it refuses, is an error that
// names the file and the line.
func applyConfig(fs *flag.FlagSet, path string) error {
	f, err := os.Open(path)
	if err != nil {
		return fmt.Errorf("config file: %w", err)
	}
	defer f.Close()
	set := map[string]bool{}
	fs.Visit(func(fl *flag.Flag) { set[fl.Name] = true })
	sc := bufio.NewScanner(io.LimitReader(f, maxConfigBytes+1))
	read, n := 0, 0
	for sc.Scan() {
		n++
		read += len(sc.Bytes()) + 1
		if read > maxConfigBytes {
			return fmt.Errorf("%s: longer than %d bytes", path, maxConfigBytes)
		}
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		name, value, hasValue := strings.Cut(line, "=")
		if !hasValue {
			name, value, hasValue = strings.Cut(line, " ")
		}
		name, value = strings.TrimSpace(strings.TrimLeft(strings.TrimSpace(name), "-")), strings.TrimSpace(value)
		fl := fs.Lookup(name)
		switch {
		case fl == nil:
			return fmt.Errorf("%s:%d: %q is not a flag of %s", path, n, name, fs.Name())
		case name == "config":
			return fmt.Errorf("%s:%d: a config file does not name another", path, n)
		case set[name]:
			continue // the command line wins
		case !hasValue:
			if b, ok := fl.Value.(interface{ IsBoolFlag() bool }); !ok || !b.IsBoolFlag() {
				return fmt.Errorf("%s:%d: %s needs a value", path, n, name)
			}
			value = "true"
		}
		if err := fs.Set(name, value); err != nil {
			return fmt.Errorf("%s:%d: %s: %w", path, n, name, err)
		}
	}
	if err := sc.Err(); err != nil {
		if errors.Is(err, bufio.ErrTooLong) {
			return fmt.Errorf("%s: a line longer than %d bytes", path, bufio.MaxScanTokenSize)
		}
		return fmt.Errorf("%s: %w", path, err)
	}
	return nil
}
