package main

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/shoal-ml/shoal/job"
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

// TestServeRefusesADataDirInUse: a second `shoal serve` process on a data directory another one
// runs on exits at once with an error naming the directory and the holder's pid; once the holder
// is killed (SIGKILL: nothing is cleaned up) a new one starts on it.
func TestServeRefusesADataDirInUse(t *testing.T) {
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(t.TempDir(), "data")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	serve := func() *exec.Cmd {
		cmd := exec.CommandContext(ctx, exe, "serve", "--data-dir", dir, "--listen", "127.0.0.1:0", "--admin-token", "serve-test-admin-token")
		cmd.Env = append(os.Environ(), "SHOAL_TEST_AS_MAIN=1")
		setParentDeathSignal(cmd)
		return cmd
	}
	// started runs a serve and waits for it to say it listens: by then it holds the lock.
	started := func() *exec.Cmd {
		cmd := serve()
		out, err := cmd.StderrPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
		sc := bufio.NewScanner(out)
		var seen []string
		for sc.Scan() {
			seen = append(seen, sc.Text())
			if strings.Contains(sc.Text(), "coordinator listening") {
				go io.Copy(io.Discard, out)
				return cmd
			}
		}
		t.Fatalf("serve exited before it listened:\n%s", strings.Join(seen, "\n"))
		return nil
	}
	first := started()
	// A second serve that started would run until the deadline kills it.
	second := serve()
	out, err := second.CombinedOutput()
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.ExitCode() != 1 {
		t.Fatalf("the second serve on %s: %v, want exit status 1\n%s", dir, err, out)
	}
	for _, want := range []string{"shoal: the data directory " + dir + " is in use", fmt.Sprintf("pid %d", first.Process.Pid)} {
		if !strings.Contains(string(out), want) {
			t.Errorf("the second serve's error lacks %q:\n%s", want, out)
		}
	}
	first.Process.Kill()
	first.Wait()
	started()
}

// watchWriter collects what is written to it and closes seen once it holds want.
type watchWriter struct {
	mu   sync.Mutex
	b    strings.Builder
	want string
	seen chan struct{}
}

func (w *watchWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	had := strings.Contains(w.b.String(), w.want)
	w.b.Write(p)
	if !had && strings.Contains(w.b.String(), w.want) {
		close(w.seen)
	}
	return len(p), nil
}

func (w *watchWriter) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.String()
}

// TestServeJob: `shoal serve --job` refuses at start a job whose data it cannot read, naming the
// path; `--job default` runs the default job.
func TestServeJob(t *testing.T) {
	dir := t.TempDir()
	p := tinyJob(t, dir, 4)
	missing := filepath.Join(dir, "gone.txt")
	editJob(t, p, func(s *job.Spec) { s.Data = missing })
	// A serve that started would run until the deadline.
	ctx1, cancel1 := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel1()
	err := (&Main{Stdout: io.Discard, Stderr: io.Discard}).Run(ctx1, []string{"serve", "--data-dir", filepath.Join(dir, "d1"), "--listen", "127.0.0.1:0", "--admin-token", "serve-test-admin-token", "--job", p})
	if err == nil || !strings.Contains(err.Error(), missing) || !strings.Contains(err.Error(), "does not exist") {
		t.Errorf("serve --job with missing data: %v, want an error naming %s", err, missing)
	}

	want := "msg=job id="
	w := &watchWriter{want: want, seen: make(chan struct{})}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() {
		m := &Main{Stdout: io.Discard, Stderr: w}
		done <- m.Run(ctx, []string{"serve", "--data-dir", filepath.Join(dir, "d2"), "--listen", "127.0.0.1:0", "--admin-token", "serve-test-admin-token", "--job", "default"})
	}()
	select {
	case <-w.seen:
	case err := <-done:
		t.Fatalf("serve --job default ended: %v\n%s", err, w)
	case <-time.After(2 * time.Minute):
		t.Fatalf("serve --job default started no job within 2 minutes:\n%s", w)
	}
	line := w.String()[strings.Index(w.String(), want):]
	line, _, _ = strings.Cut(line, "\n")
	if def := job.Default(); !strings.Contains(line, fmt.Sprintf("steps=%d", def.Steps)) {
		t.Errorf("the job started is not the default one: %s", line)
	}
	// Stopped while the job waits for workers, serve returns at once: no plan, nothing to
	// checkpoint.
	cancel()
	select {
	case <-done:
	case <-time.After(time.Minute):
		t.Fatalf("serve did not stop within a minute of its signal while the job waited for workers:\n%s", w)
	}
}
