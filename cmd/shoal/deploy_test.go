package main

import (
	"bufio"
	"context"
	"encoding/json"
	"encoding/xml"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestDeployCommandsJoin runs the commands the repository's service definitions start — the
// systemd system and user units' ExecStart, the launchd plist's ProgramArguments, and the compose
// file's coordinator and worker commands — with deploy/worker.conf as their config, and checks
// that each worker joins the coordinator the compose file starts, and that each leaves cleanly on
// the SIGTERM its service manager stops it with. Only the paths are rewritten (the binary is this
// test binary, the config a copy pointing at the coordinator, the compose file's 0.0.0.0 and
// service host name loopback): a flag renamed or dropped in the CLI that a deploy file still uses
// fails here. The service managers themselves (systemd, launchd, Windows' service control
// manager) and the container image are not run: none exists on the machines that run the tests.
func TestDeployCommandsJoin(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: starts a coordinator and four worker processes")
	}
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	home := filepath.Join(dir, "home")
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()

	coordCmd, workerCmd := composeCommands(t, "../../deploy/compose.yaml")
	addr := freeAddr(t)
	jobPath := tinyJob(t, dir, 100000)
	coordArgs := rewrite(coordCmd, map[string]string{
		"0.0.0.0:8470":        addr,
		"/var/lib/shoal/data": filepath.Join(dir, "data"),
		"/etc/shoal/job.json": jobPath,
	})
	coordArgs = append(coordArgs, "--admin-token", "deploy-test-admin-token")
	coord := exec.CommandContext(ctx, exe, coordArgs...)
	coord.Env = append(os.Environ(), "SHOAL_TEST_AS_MAIN=1")
	setParentDeathSignal(coord)
	coordLog := &watchWriter{want: "coordinator listening", seen: make(chan struct{})}
	coord.Stderr = coordLog
	if err := coord.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { coord.Process.Kill(); coord.Wait() })
	url := "http://" + addr

	// The config every service reads: the repository's, pointed at this coordinator.
	conf, err := os.ReadFile("../../deploy/worker.conf")
	if err != nil {
		t.Fatal(err)
	}
	coordLine := regexp.MustCompile(`(?m)^coordinator = .*$`)
	if !coordLine.Match(conf) {
		t.Fatal("deploy/worker.conf sets no coordinator")
	}
	conf = coordLine.ReplaceAll(conf, []byte("coordinator = "+url))
	// The launchd plist's home is /Users/YOU; systemd's user unit's is %h.
	services := map[string][]string{
		"systemd system unit": rewrite(execStart(t, "../../deploy/systemd/shoal-worker.service"), map[string]string{
			"/usr/local/bin/shoal": exe, "/etc/shoal/worker.conf": writeConf(t, filepath.Join(dir, "etc", "worker.conf"), conf)}),
		"systemd user unit": rewrite(execStart(t, "../../deploy/systemd/shoal-worker-user.service"), map[string]string{
			"%h/.local/bin/shoal": exe, "%h/.config/shoal/worker.conf": writeConf(t, filepath.Join(home, ".config", "shoal", "worker.conf"), conf)}),
		"launchd plist": rewrite(programArguments(t, "../../deploy/launchd/org.shoal.worker.plist"), map[string]string{
			"/Users/YOU/.local/bin/shoal": exe, "/Users/YOU/.config/shoal/worker.conf": writeConf(t, filepath.Join(dir, "Users", "worker.conf"), conf)}),
		"compose worker": append([]string{exe}, rewrite(workerCmd, map[string]string{"http://coordinator:8470": url})...),
	}
	type exit struct {
		name string
		err  error
	}
	exited := make(chan exit, len(services))
	logs := map[string]*watchWriter{}
	cmds := map[string]*exec.Cmd{}
	for name, args := range services {
		if args[0] != exe {
			t.Fatalf("%s starts %q: its binary path is not the one this test rewrites", name, args[0])
		}
		cmd := exec.CommandContext(ctx, exe, args[1:]...)
		// Each worker's own log says when it has joined (its id, from the coordinator's welcome).
		logs[name] = &watchWriter{want: "msg=joined", seen: make(chan struct{})}
		cmd.Stdout, cmd.Stderr = logs[name], logs[name]
		cmd.Env = append(os.Environ(), "SHOAL_TEST_AS_MAIN=1", "HOME="+home)
		setParentDeathSignal(cmd)
		if err := cmd.Start(); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		t.Cleanup(func() { cmd.Process.Kill() })
		cmds[name] = cmd
		go func() { exited <- exit{name, cmd.Wait()} }()
	}
	for name, l := range logs {
		select {
		case <-l.seen:
		case e := <-exited:
			t.Fatalf("%s exited (%v) before %s had joined:\n%s", e.name, e.err, name, logs[e.name])
		case <-ctx.Done():
			t.Fatalf("%s never joined: %v\n%s\ncoordinator:\n%s", name, ctx.Err(), l, coordLog)
		}
	}
	// systemctl stop, launchctl unload and docker compose stop all send SIGTERM: each worker
	// leaves and exits 0 within its unit's TimeoutStopSec (120 s).
	for name, cmd := range cmds {
		if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
	}
	for range services {
		select {
		case e := <-exited:
			if e.err != nil {
				t.Errorf("%s exited with %v after SIGTERM, want status 0:\n%s", e.name, e.err, logs[e.name])
			}
		case <-ctx.Done():
			t.Fatalf("a worker did not exit after SIGTERM: %v", ctx.Err())
		}
	}
}

// composeCommands returns the compose file's coordinator and worker commands (flow sequences of
// JSON strings, as the file writes them).
func composeCommands(t *testing.T, path string) (coord, worker []string) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var service string
	sc := bufio.NewScanner(strings.NewReader(string(b)))
	for sc.Scan() {
		line := sc.Text()
		if m := regexp.MustCompile(`^  ([a-z]+):\s*$`).FindStringSubmatch(line); m != nil {
			service = m[1]
		}
		rest, ok := strings.CutPrefix(strings.TrimSpace(line), "command:")
		if !ok {
			continue
		}
		var args []string
		if err := json.Unmarshal([]byte(strings.TrimSpace(rest)), &args); err != nil {
			t.Fatalf("%s: the %s service's command: %v", path, service, err)
		}
		switch service {
		case "coordinator":
			coord = args
		case "worker":
			worker = args
		}
	}
	if coord == nil || worker == nil {
		t.Fatalf("%s: no coordinator or worker command", path)
	}
	return coord, worker
}

// execStart returns a systemd unit's ExecStart, split at spaces (the units quote nothing).
func execStart(t *testing.T, path string) []string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, "ExecStart="); ok {
			return strings.Fields(rest)
		}
	}
	t.Fatalf("%s has no ExecStart", path)
	return nil
}

// programArguments returns a launchd plist's ProgramArguments.
func programArguments(t *testing.T, path string) []string {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	d := xml.NewDecoder(f)
	var args []string
	inArgs, lastKey := false, ""
	for {
		tok, err := d.Token()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatalf("%s: %v", path, err)
		}
		switch el := tok.(type) {
		case xml.StartElement:
			switch {
			case el.Name.Local == "key":
				var k string
				if err := d.DecodeElement(&k, &el); err != nil {
					t.Fatal(err)
				}
				lastKey = k
			case el.Name.Local == "array" && lastKey == "ProgramArguments":
				inArgs = true
			case el.Name.Local == "string" && inArgs:
				var s string
				if err := d.DecodeElement(&s, &el); err != nil {
					t.Fatal(err)
				}
				args = append(args, s)
			}
		case xml.EndElement:
			if el.Name.Local == "array" && inArgs {
				return args
			}
		}
	}
	t.Fatalf("%s has no ProgramArguments", path)
	return nil
}

// rewrite replaces each argument that is a key of subst, or contains one, with its value.
func rewrite(args []string, subst map[string]string) []string {
	out := make([]string, len(args))
	for i, a := range args {
		for from, to := range subst {
			a = strings.ReplaceAll(a, from, to)
		}
		out[i] = a
	}
	return out
}

func writeConf(t *testing.T, path string, conf []byte) string {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, conf, 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}
