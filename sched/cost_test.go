package sched

import (
	"errors"
	"testing"

	"github.com/shoal-ml/shoal/model"
)

// anchorParams counts parameters from the tensor list of the PyTorch anchor's docstring
// (model/testdata/torch_gpt_moe.py), independently of NewProfile's formulas.
func anchorParams(cfg model.Config) (embed, head int64, blocks []int64) {
	V, T, C, F, E := int64(cfg.VocabSize), int64(cfg.BlockSize), int64(cfg.NEmbd), int64(cfg.Hidden()), int64(cfg.NExpert)
	embed = V*C + T*C  // wte, wpe
	head = C + C + V*C // ln_f weight, bias; lm_head
	for i := 0; i < cfg.NLayer; i++ {
		n := C + C + // ln_1
			3*C*C + 3*C + // attn.c_attn
			C*C + C + // attn.c_proj
			C + C // ln_2
		expert := F*C + F + C*F + C // c_fc, c_proj
		if cfg.IsMoE(i) {
			n += E*C + E*expert // router, experts
		} else {
			n += expert
		}
		blocks = append(blocks, n)
	}
	return embed, head, blocks
}

func TestProfileParams(t *testing.T) {
	tests := []struct {
		name string
		cfg  model.Config
	}{
		{"tiny", model.TinyConfig()},
		{"default", model.DefaultConfig()},
		{"dense", func() model.Config { c := model.TinyConfig(); c.MoEEvery = 0; return c }()},
		{"all-moe", func() model.Config { c := model.TinyConfig(); c.MoEEvery = 1; c.NExpert = 8; c.TopK = 1; return c }()},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, err := NewProfile(tt.cfg, 2)
			if err != nil {
				t.Fatal(err)
			}
			embed, head, blocks := anchorParams(tt.cfg)
			if p.Embed.Params != embed || p.Head.Params != head {
				t.Errorf("embed %d head %d, want %d %d", p.Embed.Params, p.Head.Params, embed, head)
			}
			for i, b := range p.Blocks {
				if b.Params != blocks[i] {
					t.Errorf("block %d: %d params, want %d", i, b.Params, blocks[i])
				}
			}
			total := embed + head
			for _, b := range blocks {
				total += b
			}
			if got := p.StageParams(0, p.NumBlocks()); got != total {
				t.Errorf("StageParams(0, L) = %d, want %d", got, total)
			}
		})
	}
	// The tiny model, counted by hand once: 18432 + 2·49984 + 2·149504 + 16512.
	p, _ := NewProfile(model.TinyConfig(), 1)
	if got := p.StageParams(0, 4); got != 433920 {
		t.Errorf("tiny model: %d params, want 433920", got)
	}
}

func TestProfileFLOPs(t *testing.T) {
	// TinyConfig with micro-batches of 2 sequences: N = 64 tokens, C 64, F 256, T 32, E 4, top 2.
	p, err := NewProfile(model.TinyConfig(), 2)
	if err != nil {
		t.Fatal(err)
	}
	const N, C, F, T, E, K, V = 64.0, 64.0, 256.0, 32.0, 4.0, 2.0, 256.0
	attn := 2*N*C*3*C + 2*N*T*C + 2*N*T*C + 2*N*C*C
	tests := []struct {
		name string
		got  float64
		want float64
	}{
		{"dense-block", p.Blocks[0].FLOPs, 3 * (attn + 2*N*C*F + 2*N*F*C)},
		{"moe-block", p.Blocks[1].FLOPs, 3 * (attn + 2*N*C*E + K*(2*N*C*F+2*N*F*C))},
		{"head", p.Head.FLOPs, 3 * 2 * N * C * V},
		{"dense-block-by-hand", p.Blocks[2].FLOPs, 20447232},
		{"moe-block-by-hand", p.Blocks[3].FLOPs, 33128448},
		{"first-stage", p.StageFLOPs(0, 2), p.Embed.FLOPs + p.Blocks[0].FLOPs + p.Blocks[1].FLOPs},
		{"middle-stage", p.StageFLOPs(1, 3), p.Blocks[1].FLOPs + p.Blocks[2].FLOPs},
		{"last-stage", p.StageFLOPs(3, 4), p.Blocks[3].FLOPs + p.Head.FLOPs},
		{"boundary", p.BoundaryBytes, 4 * N * C},
		{"send-first", p.SendBytes(0, 2), 4 * N * C},
		{"send-middle", p.SendBytes(1, 3), 2 * 4 * N * C},
		{"send-last", p.SendBytes(2, 4), 4 * N * C},
		{"send-whole", p.SendBytes(0, 4), 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if tt.got != tt.want {
				t.Errorf("got %v, want %v", tt.got, tt.want)
			}
		})
	}
}

func TestStageMemory(t *testing.T) {
	p, err := NewProfile(model.TinyConfig(), 2)
	if err != nil {
		t.Fatal(err)
	}
	params := p.stageCost(1, 3).StateBytes
	// Block 1 is an MoE block: its experts' parameters cost what every parameter does.
	if want := StateBytesPerParam * float64(p.StageParams(1, 3)); params != want {
		t.Fatalf("state of blocks [1,3): %v bytes, want %v", params, want)
	}
	// The gradient tree of M = 4 adds two gradient-sized node buffers.
	if got, want := p.StageMemory(1, 3, 0, 1, 4)-p.StageMemory(1, 3, 0, 1, 1), 8*float64(p.StageParams(1, 3)); got != want {
		t.Fatalf("memory of M = 4 over M = 1: %v bytes, want %v", got, want)
	}
	audited := p.Audited().stageCost(1, 3).StateBytes
	if want := params + EvidenceBytesPerParam*float64(p.StageParams(1, 3)); audited != want {
		t.Fatalf("audited state of blocks [1,3): %v bytes, want %v", audited, want)
	}
	act := p.Blocks[1].ActBytes + p.Blocks[2].ActBytes
	tests := []struct {
		name             string
		index, S, M      int
		wantMicroBatches float64
	}{
		{"stage-0-of-4", 0, 4, 8, 4},
		{"stage-1-of-4", 1, 4, 8, 3},
		{"last-of-4", 3, 4, 8, 1},
		{"fewer-micro-batches-than-stages", 0, 4, 2, 2},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tree := TreeBytesPerParam(tt.M, 0, tt.M) * float64(p.StageParams(1, 3))
			if got, want := p.StageMemory(1, 3, tt.index, tt.S, tt.M), params+tree+tt.wantMicroBatches*act; got != want {
				t.Errorf("StageMemory = %v, want %v", got, want)
			}
		})
	}
	// Activations grow with the micro-batch, parameters do not.
	p4, _ := NewProfile(model.TinyConfig(), 4)
	if p4.Blocks[0].ActBytes != 2*p.Blocks[0].ActBytes || p4.Blocks[0].Params != p.Blocks[0].Params {
		t.Errorf("activations %v→%v, params %d→%d for a micro-batch twice as large",
			p.Blocks[0].ActBytes, p4.Blocks[0].ActBytes, p.Blocks[0].Params, p4.Blocks[0].Params)
	}
}

func TestNewProfileErrors(t *testing.T) {
	bad := model.TinyConfig()
	bad.NHead = 3
	for _, tt := range []struct {
		name string
		cfg  model.Config
		mb   int
	}{
		{"invalid-config", bad, 1},
		{"zero-micro-batch", model.TinyConfig(), 0},
	} {
		t.Run(tt.name, func(t *testing.T) {
			if _, err := NewProfile(tt.cfg, tt.mb); !errors.Is(err, ErrBadInput) {
				t.Errorf("NewProfile = %v, want ErrBadInput", err)
			}
		})
	}
}

// TestProfileWithWire: a job's wire formats set what a stage and an expert host send (forward
// and backward separately), and with it the planner's transfer time; float32 changes nothing.
func TestProfileWithWire(t *testing.T) {
	cfg := model.DefaultConfig()
	p, err := NewProfile(cfg, 4)
	if err != nil {
		t.Fatal(err)
	}
	ep, err := NewExpertProfile(cfg, 4, 4)
	if err != nil {
		t.Fatal(err)
	}
	N, C := p.Tokens, cfg.NEmbd
	if f32 := p.WithWire(model.Wire{}); f32.SendBytes(1, 3) != p.SendBytes(1, 3) || ep.WithWire(model.Wire{}).SendBytesPerToken != ep.SendBytesPerToken {
		t.Fatal("float32 wire changed the profile")
	}
	w := model.Wire{Activations: model.Int8, Gradients: model.BF16}
	q := p.WithWire(w)
	if got, want := q.SendBytes(1, 3), float64(N*(C+4)+2*N*C); got != want {
		t.Errorf("a middle stage sends %v bytes per micro-batch with int8/bf16, want %v", got, want)
	}
	if got, want := q.SendBytes(0, 3), float64(N*(C+4)); got != want {
		t.Errorf("the first stage sends %v, want %v (activations only)", got, want)
	}
	if got, want := q.SendBytes(1, cfg.NLayer), float64(2*N*C); got != want {
		t.Errorf("the last stage sends %v, want %v (gradients only)", got, want)
	}
	if got, want := ep.WithWire(w).SendBytesPerToken, float64(C+4+2*C); got != want {
		t.Errorf("an expert host sends %v bytes per routed token, want %v", got, want)
	}
	peer := Peer{ID: "a", GFLOPS: 100, MemoryBytes: 1 << 40, LinkBytesPerS: 25e6}
	_, x32 := p.StageSeconds(peer, 1, 3)
	_, x8 := q.StageSeconds(peer, 1, 3)
	if !(x8 < x32/2) {
		t.Errorf("transfer %v s with int8/bf16, %v s with float32: want under half", x8, x32)
	}
}
