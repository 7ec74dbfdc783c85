package main

import (
	"context"
	"errors"
	"fmt"

	"github.com/shoal-ml/shoal/local"
	"github.com/shoal-ml/shoal/model"
)

func (m *Main) runSample(ctx context.Context, args []string) error {
	fs := m.newFlagSet("sample", "--checkpoint F [--prompt TEXT] [flags]")
	ckpt := fs.String("checkpoint", "", "checkpoint `F` (a whole-model safetensors file, or a directory: its newest)")
	prompt := fs.String("prompt", "func ", "text to continue")
	n := fs.Int("tokens", 256, "tokens to generate")
	temp := fs.Float64("temperature", 0.8, "softmax temperature; 0 picks the most likely token")
	topK := fs.Int("top-k", 40, "sample among the k most likely tokens; 0 for all")
	seed := fs.Uint64("seed", 1, "sampling seed")
	if err := parse(fs, args); err != nil {
		return err
	}
	if *ckpt == "" {
		fs.Usage()
		return errors.Join(errUsage, errors.New("--checkpoint is required"))
	}
	path, err := local.ResolveCheckpoint(*ckpt)
	if err != nil {
		return err
	}
	md, ck, err := model.LoadModel(path)
	if err != nil {
		return err
	}
	out, err := md.Sample(ctx, []byte(*prompt), model.SampleOptions{Tokens: *n, Temperature: *temp, TopK: *topK, Seed: *seed})
	if err != nil {
		return err
	}
	fmt.Fprintf(m.Stderr, "--- sample after step %d (temperature %.2g, top-k %d) ---\n", ck.Step, *temp, *topK)
	fmt.Fprintf(m.Stdout, "%s%s\n", *prompt, out)
	return nil
}
