package coordinator

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/pion/transport/v5"

	"github.com/shoal-ml/shoal/client"
	"github.com/shoal-ml/shoal/internal/wan"
	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/local"
	"github.com/shoal-ml/shoal/model"
)

// TestWANBench is "a WAN on one machine" (issue 17, item 4): a 2-stage pipeline of two in-process
// workers whose WebRTC link is a simulated WAN (internal/wan: each worker's ingress limited to the
// rate, each packet delayed RTT/2), run with float32 boundaries and with int8 ones (or the
// formats SHOAL_WAN_WIRES names), alternating rounds so that every format sees the same machine
// noise. It prints, per format, the median step time, each stage's median network wait, and the
// payload per token crossing the boundary; and the ratio of each median step time to the first
// format's. Then, when the link was shaped, the same on
// an unshaped one (no rate, no delay) for comparison.
//
// Skipped unless SHOAL_WAN=1 (`make bench-wan`); settings from the environment:
//
//	SHOAL_WAN_RATE    bits/s of each worker's ingress (200e6); 0 leaves it unlimited
//	SHOAL_WAN_RTT     round-trip time between the workers (50ms)
//	SHOAL_WAN_LOSS    fraction of packets dropped (0)
//	SHOAL_WAN_STEPS   steps per run (8), the first 2 of which are warm-up and not counted
//	SHOAL_WAN_MODEL   default, tiny or large (model.Configs)
//	SHOAL_WAN_ROUNDS  runs per format (2)
//	SHOAL_WAN_WIRES   the formats, both ways, the first the baseline (f32,int8; e.g. int8,int4)
//
// It fails only when a run does (a step failing, the job not finishing): never on timing. The
// job keeps the default audit_rate, but the test coordinator has no Recompute (startCluster), so
// the workers commit to their results and nothing is recomputed: no audit competes with the
// pipeline for the CPUs.
func TestWANBench(t *testing.T) {
	if os.Getenv("SHOAL_WAN") != "1" {
		t.Skip("set SHOAL_WAN=1 to run the WAN bench (make bench-wan)")
	}
	env := func(name, def string) string {
		if v := os.Getenv(name); v != "" {
			return v
		}
		return def
	}
	num := func(name, def string) float64 {
		v, err := strconv.ParseFloat(env(name, def), 64)
		if err != nil || v < 0 {
			t.Fatalf("%s=%q: want a number ≥ 0", name, env(name, def))
		}
		return v
	}
	rtt, err := time.ParseDuration(env("SHOAL_WAN_RTT", "50ms"))
	if err != nil {
		t.Fatalf("SHOAL_WAN_RTT: %v", err)
	}
	link := wan.Link{RateBitsPerS: int64(num("SHOAL_WAN_RATE", "200e6")), RTT: rtt, Loss: num("SHOAL_WAN_LOSS", "0")}
	steps, rounds := int(num("SHOAL_WAN_STEPS", "8")), int(num("SHOAL_WAN_ROUNDS", "2"))
	const warmup = 2
	if steps <= warmup || rounds < 1 {
		t.Fatalf("SHOAL_WAN_STEPS=%d must be more than the %d warm-up steps, SHOAL_WAN_ROUNDS=%d at least 1", steps, warmup, rounds)
	}
	// SHOAL_WAN_DEPTH pins the micro-batches in flight beyond 1F1B (job.Plan.Depth); unset, the
	// coordinator keeps as many as memory allows (M−1 here), which is what hides the latency.
	var depth *int
	if v := os.Getenv("SHOAL_WAN_DEPTH"); v != "" {
		d, err := strconv.Atoi(v)
		if err != nil || d < 0 {
			t.Fatalf("SHOAL_WAN_DEPTH=%q: want an integer ≥ 0", v)
		}
		depth = &d
	}
	name := env("SHOAL_WAN_MODEL", "default")
	cfgOf, ok := model.Configs[name]
	if !ok {
		t.Fatalf("SHOAL_WAN_MODEL=%q: not one of model.Configs", name)
	}

	type format struct {
		name string
		wire model.Wire
	}
	var formats []format
	for _, n := range strings.Split(env("SHOAL_WAN_WIRES", "f32,int8"), ",") {
		f, err := model.ParseFormat(strings.TrimSpace(n))
		if err != nil {
			t.Fatalf("SHOAL_WAN_WIRES: %v", err)
		}
		formats = append(formats, format{f.String(), model.Wire{Activations: f, Gradients: f}})
	}
	if len(formats) < 2 {
		t.Fatalf("SHOAL_WAN_WIRES=%q: want two formats or more, the first the baseline", os.Getenv("SHOAL_WAN_WIRES"))
	}
	names := make([]string, len(formats))
	for i, f := range formats {
		names[i] = f.name
	}
	bench := func(link wan.Link) {
		results := make([][]local.Report, len(formats))
		var tokens int
		for r := range rounds {
			for f, format := range formats {
				spec := tinyJob(t, steps)
				spec.Model = cfgOf()
				// The default job's batch; validation and checkpoints (other than the last) off:
				// the steps measured are training steps only.
				spec.BatchSize, spec.MicroBatches = 16, 4
				spec.ValEvery, spec.CheckpointEvery = 0, 0
				spec.Wire = format.wire
				// Two stages of half the blocks each, pinned so that both formats cut the model
				// alike whatever the planner would choose.
				L := spec.Model.NLayer
				spec.Plan = &job.Plan{Stages: [][2]int{{0, L / 2}, {L / 2, L}}, Depth: depth}
				tokens = spec.BatchSize * spec.Model.BlockSize
				reps := runOnWAN(t, spec, link)
				if depth != nil {
					t.Logf("depth pinned at %d", *depth)
				}
				t.Logf("round %d, %s: %d steps, median step %v", r+1, format.name, len(reps), median(stepTimes(reps[warmup:], tokens)).Round(time.Millisecond))
				results[f] = append(results[f], reps[warmup:]...)
			}
		}
		printWANTable(name, link, tokens, names, results)
	}
	bench(link)
	if link.RateBitsPerS != 0 || link.RTT != 0 || link.Loss != 0 {
		bench(wan.Link{})
	}
}

// runOnWAN trains spec on a coordinator and two workers whose WebRTC connections run on a fresh
// simulated network of link, and returns the coordinator's step reports.
func runOnWAN(t *testing.T, spec job.Spec, link wan.Link) []local.Report {
	t.Helper()
	n, err := wan.New(link)
	if err != nil {
		t.Fatal(err)
	}
	hosts := make([]transport.Net, 2)
	for i := range hosts {
		if hosts[i], err = n.Host(); err != nil {
			t.Fatal(err)
		}
	}
	// Warnings and errors only, in -v too: the table is what the bench is read for.
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	clusterConfig = func(cfg *Config) { cfg.Logger = log }
	defer func() { clusterConfig = nil }()
	c := startCluster(t, spec, 2, false, func(i int, cfg *client.WorkerConfig) {
		cfg.Network, cfg.Logger = hosts[i], log
		// Room for the large model's stages (4.5 GB of training state over two).
		cfg.MemoryBytes = max(cfg.MemoryBytes, 8<<30)
	})
	// Generous: the large model on a small machine takes minutes a step. A slow step only takes
	// longer; a failed one is either the job's error or, abandoned and replayed from the last
	// checkpoint, more reports than steps (below).
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Minute)
	defer cancel()
	if err := c.srv.Run(ctx); err != nil {
		t.Fatalf("the job on the WAN failed: %v", err)
	}
	// The workers before the network: a connection closing sends its goodbye through it. (The
	// coordinator's server closes at the test's end, startCluster's cleanup.)
	c.cancel()
	c.workers.Wait()
	n.Close()
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.reports) != spec.Steps {
		t.Fatalf("%d step reports, want %d", len(c.reports), spec.Steps)
	}
	if c.relayed != 0 {
		t.Fatalf("%d bytes went through the coordinator's relay: the WAN was not used", c.relayed)
	}
	return slices.Clone(c.reports)
}

// stepTimes are the reports' step times: B·T tokens over the step's tokens/s.
func stepTimes(reps []local.Report, tokens int) []time.Duration {
	var out []time.Duration
	for _, r := range reps {
		out = append(out, time.Duration(float64(tokens)/r.TokensPerS*float64(time.Second)))
	}
	return out
}

func median(d []time.Duration) time.Duration {
	if len(d) == 0 {
		return 0
	}
	s := slices.Clone(d)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// printWANTable prints the bench's table: one row per wire format, and each one's median step
// over the first's.
func printWANTable(modelName string, link wan.Link, tokens int, names []string, results [][]local.Report) {
	var sb strings.Builder
	shaped := "unshaped (no rate limit, no delay)"
	if link.RateBitsPerS != 0 || link.RTT != 0 || link.Loss != 0 {
		shaped = fmt.Sprintf("ingress %g Mb/s, RTT %v, loss %g", float64(link.RateBitsPerS)/1e6, link.RTT, link.Loss)
		if link.RateBitsPerS == 0 {
			shaped = fmt.Sprintf("no rate limit, RTT %v, loss %g", link.RTT, link.Loss)
		}
	}
	fmt.Fprintf(&sb, "\nWAN bench: %s model, 2 stages, %d tokens a step; %s\n", modelName, tokens, shaped)
	fmt.Fprintf(&sb, "%-6s %6s %12s %22s %18s\n", "wire", "steps", "median step", "median wait s0 / s1", "bytes/token/dir")
	meds := make([]time.Duration, len(results))
	for f, reps := range results {
		name := names[f]
		meds[f] = median(stepTimes(reps, tokens))
		var w0, w1 []time.Duration
		var sent int64
		for _, r := range reps {
			if len(r.StageWait) == 2 {
				w0, w1 = append(w0, r.StageWait[0]), append(w1, r.StageWait[1])
			}
			sent += r.BytesSent
		}
		// BytesSent is the payload both workers sent in a step: stage 0's activations forward
		// and stage 1's gradients back over the one boundary. Per token of the step and per
		// direction: the mean over the counted steps, halved.
		perTok := float64(sent) / float64(len(reps)) / float64(tokens) / 2
		fmt.Fprintf(&sb, "%-6s %6d %12v %10v / %-9v %18.1f\n", name, len(reps), meds[f].Round(time.Millisecond),
			median(w0).Round(time.Millisecond), median(w1).Round(time.Millisecond), perTok)
	}
	for f := 1; f < len(meds) && meds[0] > 0; f++ {
		fmt.Fprintf(&sb, "median step %s / %s: %.3f\n", names[f], names[0], float64(meds[f])/float64(meds[0]))
	}
	sb.WriteString("(step: B·T tokens over the step's tokens/s; wait: each stage's time waiting on the network —\n" +
		"neighbour and coordinator — in a step; bytes/token/dir: the tensor payload both workers sent in a\n" +
		"step, mean over the steps counted, ÷ B·T ÷ 2 directions — frame headers not counted)\n")
	fmt.Print(sb.String())
}
