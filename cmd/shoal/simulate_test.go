package main

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/sched"
)

func TestSimulateSmallFleet(t *testing.T) {
	for _, tc := range []struct {
		name string
		args []string
		want []string
	}{
		{"step", []string{"--peers", "200", "--hours", "0.25", "--seed", "3"}, []string{"sync step", "goodput", "replicas: mean", "planner: first plan"}},
		{"outer", []string{"--peers", "200", "--hours", "0.25", "--sync", "outer", "--every", "10"}, []string{"sync outer, every 10 steps", "per event"}},
		{"own-batches", []string{"--peers", "200", "--hours", "0.1", "--sync", "outer", "--every", "500", "--int8", "--own-batches"}, []string{"sync outer, every 500 steps, own batches", "replicas: mean"}},
		// The 1B job's step-mode replicas, a departure reaching a plan whose replicas no longer
		// covered the step (its shares nil, waiting for the tick's replan): it indexed past them.
		{"1b-step", []string{"--peers", "1000", "--hours", "2", "--model", "1b", "--sync", "step"}, []string{"sync step", "goodput"}},
		{"delay", []string{"--peers", "200", "--hours", "0.1", "--sync", "outer", "--every", "20", "--int8", "--own-batches", "--delay", "19"}, []string{"sync outer, every 20 steps, own batches, delay 19 steps", "hidden behind the delay"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var out, errs bytes.Buffer
			m := &Main{Stdout: &out, Stderr: &errs}
			if err := m.Run(context.Background(), append([]string{"simulate"}, tc.args...)); err != nil {
				t.Fatalf("simulate: %v\n%s", err, errs.String())
			}
			for _, w := range tc.want {
				if !strings.Contains(out.String(), w) {
					t.Errorf("output lacks %q:\n%s", w, out.String())
				}
			}
		})
	}
	var out bytes.Buffer
	m := &Main{Stdout: &out, Stderr: &bytes.Buffer{}}
	if err := m.Run(context.Background(), []string{"simulate", "--peers", "100", "--hours", "0.1", "--json"}); err != nil {
		t.Fatal(err)
	}
	var res sched.SimResult
	if err := json.Unmarshal(out.Bytes(), &res); err != nil {
		t.Fatalf("--json: %v", err)
	}
	if res.Peers != 100 || res.Sync != "step" || res.M != 4 || res.Steps <= 0 {
		t.Errorf("--json: %+v", res)
	}
	if err := m.Run(context.Background(), []string{"simulate", "--sync", "sideways"}); err == nil {
		t.Errorf("--sync sideways: no error")
	}
	if err := m.Run(context.Background(), []string{"simulate", "--peers", "50", "--own-batches"}); err == nil {
		t.Errorf("--own-batches in step mode: no error")
	}
	if err := m.Run(context.Background(), []string{"simulate", "--peers", "50", "--delay", "1"}); err == nil {
		t.Errorf("--delay in step mode: no error")
	}
	if err := m.Run(context.Background(), []string{"simulate", "--peers", "50", "--sync", "outer", "--every", "20", "--delay", "20"}); err == nil {
		t.Errorf("--delay 20 of --every 20: no error")
	}
	// Outer flags beside an explicit --sync step are refused, not dropped (flags are visited in
	// alphabetical order, "sync" after them).
	for _, f := range [][]string{{"--int8"}, {"--delay", "1"}, {"--every", "5"}} {
		if err := m.Run(context.Background(), append([]string{"simulate", "--peers", "50", "--sync", "step"}, f...)); err == nil || !strings.Contains(err.Error(), "belong to --sync outer") {
			t.Errorf("--sync step %v: %v", f, err)
		}
	}
}

// A job file's sync.batches "own" and sync.delay reach the simulator (job.Spec.ReplicaOptions);
// --sync step turns them off with the rest of outer mode.
func TestSimulateJobOwnBatches(t *testing.T) {
	spec := job.Default()
	spec.Sync = &job.Sync{Mode: job.SyncOuter, Every: 500, OuterLR: 0.7, OuterMomentum: 0.9, Compress: "int8", Batches: job.BatchesOwn, Delay: 100}
	b, err := json.Marshal(spec)
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "job.json")
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	m := &Main{Stdout: &out, Stderr: &bytes.Buffer{}}
	if err := m.Run(context.Background(), []string{"simulate", "--job", path, "--peers", "200", "--hours", "0.1", "--json"}); err != nil {
		t.Fatal(err)
	}
	var res sched.SimResult
	if err := json.Unmarshal(out.Bytes(), &res); err != nil {
		t.Fatal(err)
	}
	if res.Sync != "outer" || res.Every != 500 || !res.OwnBatches || res.Delay != 100 {
		t.Errorf("job with own batches and a delay of 100: sync %q every %d, own batches %v, delay %d", res.Sync, res.Every, res.OwnBatches, res.Delay)
	}
	out.Reset()
	if err := m.Run(context.Background(), []string{"simulate", "--job", path, "--peers", "100", "--hours", "0.05", "--sync", "step"}); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out.String(), "sync step;") {
		t.Errorf("--sync step over a job of own batches:\n%s", out.String())
	}
}

// The 1b preset is about a billion parameters, as model counts them.
func TestSimulateConfig1B(t *testing.T) {
	n := 0
	for _, s := range model.Config1B().Specs() {
		n += s.Size()
	}
	if n < 0.95e9 || n > 1.05e9 {
		t.Errorf("1b has %d parameters", n)
	}
	if err := model.Config1B().Validate(); err != nil {
		t.Error(err)
	}
}
