//go:build !js

package client

import (
	"context"
	"encoding/json"
	"math"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/proto"
)

// TestRerouteEqualsModel: three step-mode replicas — two stages, one, two — share a step 2:1:1;
// the middle one is lost and the two beside it take its micro-batch (proto.StepReroute). The
// survivors end the step with the single process's loss and parameters, bit for bit, whether the
// reroute reaches them before their step, while they wait for the lost replica's gradient nodes
// (it never ran), or after they reported the step with its nodes (it ran, then left before the
// clip: they take the reroute up again, StageRunner.Reroute); and a recomputation of a rerouted stage's step from
// what it received (proto.StepSpec.Reroutes) sends and reports what it did.
func TestRerouteEqualsModel(t *testing.T) {
	for _, when := range []string{"before the step", "while it waits", "after the report"} {
		t.Run(when, func(t *testing.T) { testReroute(t, when) })
	}
}

func testReroute(t *testing.T, when string) {
	spec := testJobSpec(43)
	spec.BatchSize, spec.MicroBatches = 8, 4
	raw, err := json.Marshal(spec)
	if err != nil {
		t.Fatal(err)
	}
	cfg, B, M, T := spec.Model, spec.BatchSize, spec.MicroBatches, spec.Model.BlockSize
	g := newReplicaRig(t, raw, M, cfg, spec.Seed, [][][2]int{{{0, 2}, {2, 4}}, {{0, 4}}, {{0, 1}, {1, 4}}}, []int{2, 1, 1})
	defer g.net.Close()
	ref, err := model.NewModel(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ref.Init(spec.Seed)
	x, y := testBatch(t, 0, B, T)
	want, err := ref.TrainStep(x, y, B, model.Hyper{MicroBatches: M, LR: 1e-2, WeightDecay: spec.WeightDecay, Clip: 1})
	if err != nil {
		t.Fatal(err)
	}

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	st := proto.StepSpec{Step: 0, PlanVersion: 1, MicroBatches: M, Rows: B / M}
	n := st.Rows * T
	inputs := func(r int, lo, hi int) {
		for j := lo; j < hi; j++ {
			xt, yt, err := proto.TokenTensors(st, j, T, x[j*n:(j+1)*n], y[j*n:(j+1)*n])
			if err != nil {
				t.Fatal(err)
			}
			if err := g.driver.Send(ctx, g.ids[g.reps[r][0]], xt); err != nil {
				t.Fatal(err)
			}
			if err := g.driver.Send(ctx, g.ids[g.reps[r][1]-1], yt); err != nil {
				t.Fatal(err)
			}
		}
	}
	// The survivors: replicas 0 and 2, whose stages are runners 0, 1 and 3, 4.
	survivors := []int{0, 1, 3, 4}
	lost := 2
	m := &proto.StepReroute{Step: 0, PlanVersion: 1, Attempt: 1,
		Shares: []proto.ReplicaShare{{Replica: 0, First: 0, MicroBatches: 3}, {Replica: 2, First: 3, MicroBatches: 1}}}
	for _, i := range survivors {
		g.runners[i].reroutes = newRerouteBox(1)
		g.runners[i].reroutes.begin(0)
	}
	// Recorded as a worker records a step's traffic when its job audits (stepNet).
	recs := map[int]*stepNet{}
	for _, i := range survivors {
		recs[i] = &stepNet{inner: g.runners[i].Net}
		g.runners[i].setNet(recs[i])
		recs[i].begin()
	}
	inputs(0, 0, 2)
	inputs(2, 3, 4)
	reports := make([]*proto.StepReport, len(g.runners))
	run := func(idx []int, f func(i int) (*proto.StepReport, error)) {
		errs := make([]error, len(g.runners))
		var wg sync.WaitGroup
		for _, i := range idx {
			wg.Add(1)
			go func() {
				defer wg.Done()
				reports[i], errs[i] = f(i)
			}()
		}
		wg.Wait()
		for i, err := range errs {
			if err != nil {
				t.Fatalf("%s: %v", g.ids[i], err)
			}
		}
	}
	if when == "after the report" {
		inputs(1, 2, 3)
		run(append(survivors, lost), func(i int) (*proto.StepReport, error) { return g.runners[i].RunStep(ctx, st) })
		for _, i := range survivors {
			if reports[i].Reroutes != 0 {
				t.Fatalf("%s reported %d reroutes before any", g.ids[i], reports[i].Reroutes)
			}
			g.runners[i].reroutes.end()
		}
		inputs(0, 2, 3)
		run(survivors, func(i int) (*proto.StepReport, error) { return g.runners[i].Reroute(ctx, m) })
	} else {
		inputs(0, 2, 3)
		offer := func() {
			for _, i := range survivors {
				if !g.runners[i].reroutes.offer(m) {
					t.Errorf("%s's step took no reroute", g.ids[i])
				}
			}
		}
		if when == "before the step" {
			offer()
		} else {
			// Most likely while the survivors wait for the lost replica's nodes (it never
			// runs); wherever it lands, the step must come out the same.
			go func() {
				time.Sleep(100 * time.Millisecond)
				offer()
			}()
		}
		run(survivors, func(i int) (*proto.StepReport, error) { return g.runners[i].RunStep(ctx, st) })
	}
	var ces []float64
	var out []*proto.StepReport
	for _, i := range survivors {
		rep := reports[i]
		if rep.Reroutes != 1 {
			t.Errorf("%s reported %d reroutes, want 1", g.ids[i], rep.Reroutes)
		}
		ces = append(ces, rep.CE...)
		out = append(out, &proto.StepReport{GradSq: rep.GradSq})
	}
	ce, _, norm, err := proto.StepTotals(append(out, &proto.StepReport{CE: ces}), M)
	if err != nil {
		t.Fatal(err)
	}
	if ce != want.CE {
		t.Fatalf("loss %v, one process %v", ce, want.CE)
	}
	// What a recomputation of a survivor's step does from what it received: the same sends, the
	// same report.
	for _, i := range survivors {
		recv, sent := recs[i].end()
		b, err := buildShard(model.Host{}, spec, g.assigns[i], g.ids[i])
		if err != nil {
			t.Fatal(err)
		}
		b.sh.Init(spec.Seed)
		net := newReplayNet(recv)
		b.runner.setNet(net)
		rst := st
		rst.Reroutes = [][]proto.ReplicaShare{m.Shares}
		rep, err := b.runner.RunStep(ctx, rst)
		if err != nil {
			t.Fatalf("%s recomputed: %v", g.ids[i], err)
		}
		if len(net.sent) != len(sent) {
			t.Fatalf("%s: the recomputation sent %d tensors, the stage %d", g.ids[i], len(net.sent), len(sent))
		}
		have := map[[2]string]bool{}
		for _, s := range sent {
			have[[2]string{s.To, proto.KeyID(s.T.Key) + proto.TensorDigest(s.T)}] = true
		}
		for _, s := range net.sent {
			if !have[[2]string{s.To, proto.KeyID(s.T.Key) + proto.TensorDigest(s.T)}] {
				t.Fatalf("%s: the recomputation sent %v to %s, which the stage did not", g.ids[i], s.T.Key, s.To)
			}
		}
		if rep.Reroutes != 1 || len(rep.CE) != len(reports[i].CE) {
			t.Fatalf("%s: recomputed report %+v, the stage's %+v", g.ids[i], rep, reports[i])
		}
	}
	f := model.ClipFactor(norm, 1)
	for _, i := range survivors {
		g.runners[i].Apply(0, 1e-2, f)
		for _, tt := range g.runners[i].Shard.P.Tensors {
			w := ref.P.Get(tt.Name)
			for k := range w {
				if math.Float32bits(tt.Data[k]) != math.Float32bits(w[k]) {
					t.Fatalf("%s: %s[%d] = %v, one process %v", g.ids[i], tt.Name, k, tt.Data[k], w[k])
				}
			}
		}
	}
}

// TestRerouteRefused: a reroute the coordinator could not have meant — one that takes micro-batches
// away from this stage's replica, leaves it out, or skips an attempt — fails the step here with
// what was wrong, rather than computing something no other stage computes.
func TestRerouteRefused(t *testing.T) {
	spec := testJobSpec(43)
	spec.BatchSize, spec.MicroBatches = 8, 4
	raw, err := json.Marshal(spec)
	if err != nil {
		t.Fatal(err)
	}
	cfg, B, M, T := spec.Model, spec.BatchSize, spec.MicroBatches, spec.Model.BlockSize
	share := func(r, first, n int) proto.ReplicaShare {
		return proto.ReplicaShare{Replica: r, First: first, MicroBatches: n}
	}
	for _, tc := range []struct {
		name    string
		attempt int
		shares  []proto.ReplicaShare
		want    string
	}{
		{"takes micro-batches away", 1, []proto.ReplicaShare{share(0, 0, 1), share(2, 1, 3)}, "fewer than its"},
		{"leaves the replica out", 1, []proto.ReplicaShare{share(2, 0, 4)}, "leaves this stage's replica 0 out"},
		{"skips an attempt", 2, []proto.ReplicaShare{share(0, 0, 3), share(2, 3, 1)}, "reroute 2 after 0"},
		{"tiles another step", 1, []proto.ReplicaShare{share(0, 0, 3), share(2, 3, 2)}, "end at 5"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := newReplicaRig(t, raw, M, cfg, spec.Seed, [][][2]int{{{0, 2}, {2, 4}}, {{0, 4}}, {{0, 1}, {1, 4}}}, []int{2, 1, 1})
			defer g.net.Close()
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			st := proto.StepSpec{Step: 0, PlanVersion: 1, MicroBatches: M, Rows: B / M}
			x, y := testBatch(t, 0, B, T)
			n := st.Rows * T
			for j := range 2 {
				xt, yt, err := proto.TokenTensors(st, j, T, x[j*n:(j+1)*n], y[j*n:(j+1)*n])
				if err != nil {
					t.Fatal(err)
				}
				g.driver.Send(ctx, g.ids[0], xt)
				g.driver.Send(ctx, g.ids[1], yt)
			}
			m := &proto.StepReroute{Step: 0, PlanVersion: 1, Attempt: tc.attempt, Shares: tc.shares}
			errs := make([]error, 2)
			var wg sync.WaitGroup
			for i := range 2 {
				r := g.runners[i]
				r.reroutes = newRerouteBox(1)
				r.reroutes.begin(0)
				r.reroutes.offer(m)
				wg.Add(1)
				go func() {
					defer wg.Done()
					_, errs[i] = r.RunStep(ctx, st)
				}()
			}
			wg.Wait()
			for i, err := range errs {
				if err == nil || !strings.Contains(err.Error(), tc.want) {
					t.Errorf("%s: %v, want an error saying %q", g.ids[i], err, tc.want)
				}
			}
		})
	}
}

// TestRerouteTwice: four replicas share a step 1:1:1:1 and the two in the middle are lost one
// after the other: the survivors take the first reroute's widened runs, then the second's, each
// after the legs the one before added (attempts 1 and 2), and end the step with the single
// process's loss and parameters, bit for bit.
func TestRerouteTwice(t *testing.T) {
	spec := testJobSpec(47)
	spec.BatchSize, spec.MicroBatches = 8, 4
	raw, err := json.Marshal(spec)
	if err != nil {
		t.Fatal(err)
	}
	cfg, B, M, T := spec.Model, spec.BatchSize, spec.MicroBatches, spec.Model.BlockSize
	g := newReplicaRig(t, raw, M, cfg, spec.Seed, [][][2]int{{{0, 2}, {2, 4}}, {{0, 4}}, {{0, 4}}, {{0, 3}, {3, 4}}}, []int{1, 1, 1, 1})
	defer g.net.Close()
	ref, err := model.NewModel(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ref.Init(spec.Seed)
	x, y := testBatch(t, 0, B, T)
	want, err := ref.TrainStep(x, y, B, model.Hyper{MicroBatches: M, LR: 1e-2, WeightDecay: spec.WeightDecay, Clip: 1})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	st := proto.StepSpec{Step: 0, PlanVersion: 1, MicroBatches: M, Rows: B / M}
	n := st.Rows * T
	inputs := func(r int, lo, hi int) {
		for j := lo; j < hi; j++ {
			xt, yt, err := proto.TokenTensors(st, j, T, x[j*n:(j+1)*n], y[j*n:(j+1)*n])
			if err != nil {
				t.Fatal(err)
			}
			g.driver.Send(ctx, g.ids[g.reps[r][0]], xt)
			g.driver.Send(ctx, g.ids[g.reps[r][1]-1], yt)
		}
	}
	share := func(r, first, n int) proto.ReplicaShare {
		return proto.ReplicaShare{Replica: r, First: first, MicroBatches: n}
	}
	// Replica 1 goes first: its micro-batch goes to replica 0 (its only surviving neighbour at
	// equal runs takes it: the split rounds to the left); then replica 2, whose runs go to 3.
	first := &proto.StepReroute{Step: 0, PlanVersion: 1, Attempt: 1, Shares: []proto.ReplicaShare{share(0, 0, 2), share(2, 2, 1), share(3, 3, 1)}}
	second := &proto.StepReroute{Step: 0, PlanVersion: 1, Attempt: 2, Shares: []proto.ReplicaShare{share(0, 0, 2), share(3, 2, 2)}}
	survivors := []int{0, 1, 4, 5} // replica 0's two stages, replica 3's two
	for _, i := range survivors {
		g.runners[i].reroutes = newRerouteBox(1)
		g.runners[i].reroutes.begin(0)
		g.runners[i].reroutes.offer(first)
		g.runners[i].reroutes.offer(second)
	}
	inputs(0, 0, 2)
	inputs(3, 2, 4)
	reports := make([]*proto.StepReport, len(g.runners))
	errs := make([]error, len(g.runners))
	var wg sync.WaitGroup
	for _, i := range survivors {
		wg.Add(1)
		go func() {
			defer wg.Done()
			reports[i], errs[i] = g.runners[i].RunStep(ctx, st)
		}()
	}
	wg.Wait()
	var ces []float64
	var out []*proto.StepReport
	for _, i := range survivors {
		if errs[i] != nil {
			t.Fatalf("%s: %v", g.ids[i], errs[i])
		}
		if reports[i].Reroutes != 2 {
			t.Errorf("%s reported %d reroutes, want 2", g.ids[i], reports[i].Reroutes)
		}
		ces = append(ces, reports[i].CE...)
		out = append(out, &proto.StepReport{GradSq: reports[i].GradSq})
	}
	ce, _, norm, err := proto.StepTotals(append(out, &proto.StepReport{CE: ces}), M)
	if err != nil {
		t.Fatal(err)
	}
	if ce != want.CE {
		t.Fatalf("loss %v, one process %v", ce, want.CE)
	}
	f := model.ClipFactor(norm, 1)
	for _, i := range survivors {
		g.runners[i].Apply(0, 1e-2, f)
		for _, tt := range g.runners[i].Shard.P.Tensors {
			w := ref.P.Get(tt.Name)
			for k := range w {
				if math.Float32bits(tt.Data[k]) != math.Float32bits(w[k]) {
					t.Fatalf("%s: %s[%d] = %v, one process %v", g.ids[i], tt.Name, k, tt.Data[k], w[k])
				}
			}
		}
	}
}
