package model

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
)

// Config is the architecture of a GPT-MoE model: exactly the keys of the PyTorch anchor's DEFAULT
// dict that describe the network (testdata's copy, testdata/torch_gpt_moe.py). The anchor also keeps
// batch_size there; in Shoal the batch belongs to the job (JobSpec.BatchSize), not to the model, so
// a checkpoint's config never disagrees with the job that resumes it.
//
// Shapes use llm.c's letters: V vocab, T block size (sequence), C channels, L layers, H heads,
// F = MLPRatio·C hidden width, E experts.
type Config struct {
	VocabSize   int     `json:"vocab_size"`    // V
	BlockSize   int     `json:"block_size"`    // T
	NLayer      int     `json:"n_layer"`       // L
	NHead       int     `json:"n_head"`        // H
	NEmbd       int     `json:"n_embd"`        // C
	MLPRatio    int     `json:"mlp_ratio"`     // F = MLPRatio·C
	MoEEvery    int     `json:"moe_every"`     // block i is MoE when MoEEvery > 0 and (i+1) % MoEEvery == 0
	NExpert     int     `json:"n_expert"`      // E
	TopK        int     `json:"top_k"`         // experts per token
	AuxLossCoef float64 `json:"aux_loss_coef"` // weight of the Switch balancing loss
}

// DefaultConfig is the anchor's DEFAULT model: the model of the default job.
func DefaultConfig() Config {
	return Config{VocabSize: 256, BlockSize: 128, NLayer: 4, NHead: 4, NEmbd: 256, MLPRatio: 4,
		MoEEvery: 2, NExpert: 4, TopK: 2, AuxLossCoef: 0.01}
}

// LargeConfig is the model bigger than any one volunteer (issue 17): 12 blocks of 768 channels
// and 12 heads over 256 bytes of context, every second block a mixture of 8 experts (top-2) —
// about 284M parameters, 4.5 GB of training state (parameters, gradients and Adam's two moments
// in float32), to be cut into stages and expert shards over memory-capped peers.
func LargeConfig() Config {
	return Config{VocabSize: 256, BlockSize: 256, NLayer: 12, NHead: 12, NEmbd: 768, MLPRatio: 4,
		MoEEvery: 2, NExpert: 8, TopK: 2, AuxLossCoef: 0.01}
}

// Config1B is the ≈1B-parameter GPT-MoE (issue 13): 24 blocks of 1,024 channels and 16 heads over
// 512 bytes of context, every second block a mixture of 8 experts (top-2): 1,008,531,456
// parameters, 16 GB of training state. `shoal simulate --model 1b` plans it over a fleet; `shoal
// train --model 1b` trains it, on a machine with the memory for it.
func Config1B() Config {
	return Config{VocabSize: 256, BlockSize: 512, NLayer: 24, NHead: 16, NEmbd: 1024, MLPRatio: 4,
		MoEEvery: 2, NExpert: 8, TopK: 2, AuxLossCoef: 0.01}
}

// Configs are the named model configs, as `shoal train --model` takes them.
var Configs = map[string]func() Config{"default": DefaultConfig, "tiny": TinyConfig, "large": LargeConfig, "1b": Config1B}

// TinyConfig is the small model the unit tests train: the default's shape, scaled down.
func TinyConfig() Config {
	return Config{VocabSize: 256, BlockSize: 32, NLayer: 4, NHead: 4, NEmbd: 64, MLPRatio: 4,
		MoEEvery: 2, NExpert: 4, TopK: 2, AuxLossCoef: 0.01}
}

// ErrConfig is wrapped by every validation error of a Config.
var ErrConfig = errors.New("invalid model config")

// Validate reports the first problem with c, naming the key as it is spelled in JSON.
func (c Config) Validate() error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: %s", ErrConfig, fmt.Sprintf(format, args...))
	}
	switch {
	case c.VocabSize < 1 || c.VocabSize > 1<<20:
		return bad("vocab_size %d must be in [1, 2^20]", c.VocabSize)
	case c.BlockSize < 1 || c.BlockSize > 1<<16:
		return bad("block_size %d must be in [1, 65536]", c.BlockSize)
	case c.NLayer < 1 || c.NLayer > 1024:
		return bad("n_layer %d must be in [1, 1024]", c.NLayer)
	case c.NEmbd < 1 || c.NEmbd > 1<<16:
		return bad("n_embd %d must be in [1, 65536]", c.NEmbd)
	case c.NHead < 1 || c.NEmbd%c.NHead != 0:
		return bad("n_head %d must be positive and divide n_embd %d", c.NHead, c.NEmbd)
	case c.MLPRatio < 1 || c.MLPRatio > 64:
		return bad("mlp_ratio %d must be in [1, 64]", c.MLPRatio)
	case c.MoEEvery < 0:
		return bad("moe_every %d must be >= 0 (0 means no MoE blocks)", c.MoEEvery)
	case c.AuxLossCoef < 0 || c.AuxLossCoef != c.AuxLossCoef:
		return bad("aux_loss_coef %v must be a non-negative number", c.AuxLossCoef)
	}
	if c.NumMoE() > 0 {
		switch {
		case c.NExpert < 1 || c.NExpert > 1024:
			return bad("n_expert %d must be in [1, 1024] when there are MoE blocks", c.NExpert)
		case c.TopK < 1 || c.TopK > c.NExpert:
			return bad("top_k %d must be in [1, n_expert=%d]", c.TopK, c.NExpert)
		}
	}
	return nil
}

// IsMoE reports whether block i is a mixture-of-experts block.
func (c Config) IsMoE(i int) bool { return c.MoEEvery > 0 && (i+1)%c.MoEEvery == 0 }

// NumMoE is the number of MoE blocks.
func (c Config) NumMoE() int {
	n := 0
	for i := 0; i < c.NLayer; i++ {
		if c.IsMoE(i) {
			n++
		}
	}
	return n
}

// Hidden is F, the width of an MLP's hidden layer.
func (c Config) Hidden() int { return c.MLPRatio * c.NEmbd }

// HeadSize is C/H.
func (c Config) HeadSize() int { return c.NEmbd / c.NHead }

// MarshalJSON writes every key, always, in the anchor's order: a checkpoint's config must be
// complete so that no reader fills a gap with its own default.
func (c Config) MarshalJSON() ([]byte, error) {
	type plain Config
	return json.Marshal(plain(c))
}

// ParseConfig decodes a config that names every key exactly once and nothing else.
func ParseConfig(b []byte) (Config, error) {
	var c Config
	if err := strictJSON(b, &c, configKeys); err != nil {
		return Config{}, fmt.Errorf("%w: %v", ErrConfig, err)
	}
	return c, c.Validate()
}

var configKeys = []string{"vocab_size", "block_size", "n_layer", "n_head", "n_embd", "mlp_ratio",
	"moe_every", "n_expert", "top_k", "aux_loss_coef"}

// strictJSON decodes b into v, refusing unknown keys and reporting every key of want that is missing.
func strictJSON(b []byte, v any, want []string) error {
	var raw map[string]json.RawMessage
	if err := json.Unmarshal(b, &raw); err != nil {
		return err
	}
	var missing []string
	for _, k := range want {
		if _, ok := raw[k]; !ok {
			missing = append(missing, k)
		}
	}
	if len(missing) > 0 {
		return fmt.Errorf("missing keys %q (every key must be written out)", missing)
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	return dec.Decode(v)
}
