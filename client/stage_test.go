package client

import (
	"context"
	"fmt"
	"math"
	"os"
	"slices"
	"testing"
	"time"

	"github.com/shoal-ml/shoal/data"
	"github.com/shoal-ml/shoal/local"
	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/proto"
	"github.com/shoal-ml/shoal/sched"
)

// testBatch cuts B windows of T+1 bytes from this package's sources, a different slice per step.
func testBatch(t *testing.T, step, B, T int) (x, y []int32) {
	t.Helper()
	var text []byte
	for _, f := range []string{"stage.go", "experts.go", "transport.go", "worker.go"} {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		text = append(text, b...)
	}
	x, y = make([]int32, B*T), make([]int32, B*T)
	off := step * 977
	for b := 0; b < B; b++ {
		for j := 0; j < T; j++ {
			i := (off + b*(T+1) + j) % (len(text) - 1)
			x[b*T+j], y[b*T+j] = int32(text[i]), int32(text[i+1])
		}
	}
	return x, y
}

// TestPipelineEqualsSingleProcess is the equivalence test of the stages issue: the tiny model as
// one process, as 2 stages and as 4 stages — each stage a StageRunner on its own goroutine running
// 1F1B over the in-memory transport — gives bitwise-identical losses and parameters after several
// steps at lr 1e-2 without warm-up, for top-1 and top-2 routing.
func TestPipelineEqualsSingleProcess(t *testing.T) {
	for _, k := range []int{1, 2} {
		for _, cuts := range [][]int{{2}, {1, 2, 3}} {
			t.Run(fmt.Sprintf("top%d/%d-stages", k, len(cuts)+1), func(t *testing.T) {
				cfg := model.TinyConfig()
				cfg.TopK = k
				p, err := NewLocalPipeline(cfg, 21, cuts, trainWD)
				if err != nil {
					t.Fatal(err)
				}
				defer p.Close()
				trainAlongside(t, cfg, 21, p)
			})
		}
	}
}

// TestPipelineDepthEqualsSingleProcess: with extra micro-batches in flight (sched.OneFOneBDepth;
// issue 17, item 5) the stages run their forwards further ahead of their backwards, but the
// backwards stay in micro-batch order, so 3 stages, and 2 stages with expert hosts following the
// same depth, still end bitwise equal to one process at every depth up to M−1.
func TestPipelineDepthEqualsSingleProcess(t *testing.T) {
	type ref = ExpertRef
	for _, tc := range []struct {
		name  string
		cuts  []int
		hosts [][]ExpertRef
		depth int
	}{
		{"3-stages/depth-1", []int{1, 3}, nil, 1},
		{"3-stages/depth-3", []int{1, 3}, nil, trainM - 1},
		{"2-stages-expert-hosts/depth-2", []int{2}, [][]ExpertRef{{ref{1, 0}, ref{1, 1}}, {ref{3, 2}, ref{3, 3}, ref{3, 1}}, {ref{3, 1}}}, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := model.TinyConfig()
			cfg.TopK = 2
			p, err := NewLocalExpertPipeline(cfg, 21, tc.cuts, trainWD, tc.hosts)
			if err != nil {
				t.Fatal(err)
			}
			defer p.Close()
			for _, r := range p.Runners {
				r.Depth = tc.depth
			}
			for _, h := range p.Hosts {
				h.Depth = tc.depth
			}
			first := &orderNet{Transport: p.Runners[0].Net}
			p.Runners[0].Net = first
			trainAlongside(t, cfg, 21, p)
			// The first stage ran the depth's schedule: its activations went out and its
			// gradients were taken in the order OneFOneBDepth gives (equal results alone would
			// not show it: the order of the forwards changes no number).
			var want []string
			for _, in := range sched.OneFOneBDepth(0, len(p.Runners), trainM, tc.depth) {
				if in.Op == sched.OpSendAct || in.Op == sched.OpRecvGrad {
					want = append(want, in.String())
				}
			}
			if got := first.ops[:len(want)]; !slices.Equal(got, want) {
				t.Errorf("stage 0's first step: %v, want %v", got, want)
			}
		})
	}
}

// orderNet records the boundary tensors a stage sends and asks for, as sched's instructions.
type orderNet struct {
	Transport
	ops []string
}

func (n *orderNet) Send(ctx context.Context, to string, t proto.Tensor) error {
	if t.Key.Kind == proto.KindActivation {
		n.ops = append(n.ops, sched.SendAct(int(t.Key.MicroBatch)).String())
	}
	return n.Transport.Send(ctx, to, t)
}

func (n *orderNet) Recv(ctx context.Context, key proto.TensorKey) (proto.Tensor, error) {
	if key.Kind == proto.KindActivationGrad {
		n.ops = append(n.ops, sched.RecvGrad(int(key.MicroBatch)).String())
	}
	return n.Transport.Recv(ctx, key)
}

// The equivalence tests' step: lr 1e-2 without warm-up (a tiny learning rate could not tell a
// missing weight decay from noise), 3 steps of 8 rows in 4 micro-batches.
const (
	trainB, trainM, trainSteps  = 8, 4, 3
	trainLR, trainWD, trainClip = 1e-2, 0.1, 1.0
)

// trainAlongside trains p and a single-process model initialised from seed on the same batches
// and checks, bit for bit, every step's loss, aux and gradient norm, a validation loss through the
// pipeline, and the final parameters.
func trainAlongside(t *testing.T, cfg model.Config, seed uint64, p *LocalPipeline) {
	t.Helper()
	ref, err := model.NewModel(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ref.Init(seed)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for s := 0; s < trainSteps; s++ {
		x, y := testBatch(t, s, trainB, cfg.BlockSize)
		r, err := ref.TrainStep(x, y, trainB, model.Hyper{MicroBatches: trainM, LR: trainLR, WeightDecay: trainWD, Clip: trainClip})
		if err != nil {
			t.Fatal(err)
		}
		ce, aux, norm, err := p.Step(ctx, uint64(s), x, y, trainB, trainM, trainLR, trainClip)
		if err != nil {
			t.Fatal(err)
		}
		if ce != r.CE || aux != r.Aux || norm != r.GradNorm {
			t.Fatalf("step %d: pipeline ce %v aux %v norm %v; single process %v %v %v", s, ce, aux, norm, r.CE, r.Aux, r.GradNorm)
		}
	}
	vx, vy := testBatch(t, 99, 32, cfg.BlockSize)
	want, err := local.ValidationLoss(ref, vx, vy, data.ValRows)
	if err != nil {
		t.Fatal(err)
	}
	if val, err := p.Eval(ctx, trainSteps-1, vx, vy); err != nil || val != want {
		t.Fatalf("validation loss through the pipeline %v (%v), single process %v", val, err, want)
	}
	got := p.Params()
	for _, tt := range ref.P.Tensors {
		g := got[tt.Name]
		if len(g) != len(tt.Data) {
			t.Fatalf("%s: pipeline has %d values, want %d", tt.Name, len(g), len(tt.Data))
		}
		for i := range g {
			if math.Float32bits(g[i]) != math.Float32bits(tt.Data[i]) {
				t.Fatalf("%s[%d]: pipeline %v, single process %v", tt.Name, i, g[i], tt.Data[i])
			}
		}
	}
}

// TestPipelineMicroBatchesAuxOff: M = 4 against M = 1 through the pipeline with the balancing loss
// off — the updates θ_T − θ_0 agree per tensor to rounding amplified by Adam, within 5e-4
// relative (model's TestMicroBatchesOnlyRound says why: c_attn's key bias is rounding noise).
func TestPipelineMicroBatchesAuxOff(t *testing.T) {
	cfg := model.TinyConfig()
	cfg.AuxLossCoef = 0
	run := func(M int) (map[string][]float32, map[string][]float32) {
		p, err := NewLocalPipeline(cfg, 5, []int{2}, 0.1)
		if err != nil {
			t.Fatal(err)
		}
		defer p.Close()
		theta0 := map[string][]float32{}
		for n, v := range p.Params() {
			theta0[n] = append([]float32(nil), v...)
		}
		for s := 0; s < 3; s++ {
			x, y := testBatch(t, s, 8, cfg.BlockSize)
			if _, _, _, err := p.Step(context.Background(), uint64(s), x, y, 8, M, 1e-2, 1); err != nil {
				t.Fatal(err)
			}
		}
		return p.Params(), theta0
	}
	p4, theta0 := run(4)
	p1, _ := run(1)
	for name, v1 := range p1 {
		var d, n float64
		for i := range v1 {
			u1 := float64(v1[i]) - float64(theta0[name][i])
			u4 := float64(p4[name][i]) - float64(theta0[name][i])
			d += (u4 - u1) * (u4 - u1)
			n += u1 * u1
		}
		if e := math.Sqrt(d / n); e > 5e-4 {
			t.Errorf("%s: ‖Δθ(M=4) − Δθ(M=1)‖/‖Δθ(M=1)‖ = %.3g", name, e)
		}
	}
}

// TestStageRunnerAbandonsStep: a stage whose neighbour never answers gives up at the context's
// deadline, drops its activations and leaves no gradient behind.
func TestStageRunnerAbandonsStep(t *testing.T) {
	cfg := model.TinyConfig()
	p, err := NewLocalPipeline(cfg, 1, []int{2}, 0.1)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	r := p.Runners[1] // the last stage: waits for activations that never come
	if _, err := r.RunStep(ctx, proto.StepSpec{Step: 0, PlanVersion: 1, MicroBatches: 2, Rows: 2}); err == nil {
		t.Fatal("step without input succeeded")
	}
	if r.Shard.Stage.InFlight() != 0 {
		t.Fatal("activations left in flight")
	}
	if model.GlobalNorm(model.SquaredNorms(r.Shard.G)) != 0 {
		t.Fatal("gradients left behind")
	}
}
