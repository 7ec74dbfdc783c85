package main

import (
	"bytes"
	"context"
	"encoding/json"
	"strings"
	"testing"

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
}

// The 1b preset is about a billion parameters, as model counts them.
func TestSimulateConfig1B(t *testing.T) {
	n := 0
	for _, s := range Config1B().Specs() {
		n += s.Size()
	}
	if n < 0.95e9 || n > 1.05e9 {
		t.Errorf("1b has %d parameters", n)
	}
	if err := Config1B().Validate(); err != nil {
		t.Error(err)
	}
}
