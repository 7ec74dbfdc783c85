package model

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"sort"
)

// SampleOptions control generation.
type SampleOptions struct {
	Tokens      int
	Temperature float64 // 0: greedy
	TopK        int     // 0: the whole vocabulary
	Seed        uint64
}

// Sample continues prompt (byte tokens) by opt.Tokens tokens, running the model on the last
// block_size tokens each time (no KV cache: sampling is for looking at, not for serving).
func (m *Model) Sample(ctx context.Context, prompt []byte, opt SampleOptions) ([]byte, error) {
	if len(prompt) == 0 {
		prompt = []byte{'\n'}
	}
	V := m.Cfg.VocabSize
	ctxTok := make([]int32, 0, len(prompt)+opt.Tokens)
	for _, b := range prompt {
		if int(b) >= V {
			return nil, fmt.Errorf("prompt byte %d outside vocab_size %d", b, V)
		}
		ctxTok = append(ctxTok, int32(b))
	}
	r := rand.New(rand.NewPCG(opt.Seed, 0x53414d50)) // "SAMP"
	var out []byte
	probs := make([]float64, V)
	order := make([]int, V)
	for i := 0; i < opt.Tokens; i++ {
		if err := ctx.Err(); err != nil {
			return out, err
		}
		win := ctxTok
		if len(win) > m.Cfg.BlockSize {
			win = win[len(win)-m.Cfg.BlockSize:]
		}
		T := len(win)
		if _, err := m.Stage.Forward(0, StageInput{B: 1, T: T, Tokens: win}); err != nil {
			return out, err
		}
		logits := m.Stage.Logits(0)[(T-1)*V : T*V]
		next := pick(logits, probs, order, opt, r)
		m.Stage.Release(0)
		m.Experts.Reset()
		ctxTok = append(ctxTok, int32(next))
		out = append(out, byte(next))
	}
	return out, nil
}

func pick(logits []float32, probs []float64, order []int, opt SampleOptions, r *rand.Rand) int {
	for i := range order {
		order[i] = i
	}
	sort.SliceStable(order, func(a, b int) bool { return logits[order[a]] > logits[order[b]] })
	if opt.Temperature <= 0 {
		return order[0]
	}
	k := len(order)
	if opt.TopK > 0 && opt.TopK < k {
		k = opt.TopK
	}
	maxL := float64(logits[order[0]])
	var sum float64
	for _, i := range order[:k] {
		probs[i] = math.Exp((float64(logits[i]) - maxL) / opt.Temperature)
		sum += probs[i]
	}
	u := r.Float64() * sum
	for _, i := range order[:k] {
		u -= probs[i]
		if u <= 0 {
			return i
		}
	}
	return order[k-1]
}
