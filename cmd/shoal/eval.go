package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/shoal-ml/shoal/data"
	"github.com/shoal-ml/shoal/model"
)

// runEval is the loss oracle's twin: the same batch and the same JSON as the anchor's eval command.
func (m *Main) runEval(ctx context.Context, args []string) error {
	fs := m.newFlagSet("eval", "--checkpoint F --data FILE [--windows N]")
	ckpt := fs.String("checkpoint", "", "checkpoint `F` (safetensors: a whole model)")
	dataPath := fs.String("data", "", "`FILE` whose first N windows of block_size+1 tokens form the batch")
	windows := fs.Int("windows", 16, "number of non-overlapping windows, evaluated as one batch (M = 1)")
	if err := parse(fs, args); err != nil {
		return err
	}
	if *ckpt == "" || *dataPath == "" {
		fs.Usage()
		return errors.Join(errUsage, errors.New("--checkpoint and --data are required"))
	}
	md, _, err := model.LoadModel(*ckpt)
	if err != nil {
		return err
	}
	c, err := data.Load(*dataPath, nil)
	if errors.Is(err, data.ErrNoData) {
		return fmt.Errorf("--data: %w", err)
	}
	if err != nil {
		return err
	}
	T := md.Cfg.BlockSize
	x, y, err := c.Windows(*windows, T)
	if err != nil {
		return err
	}
	ce, aux, err := md.Evaluate(x, y, *windows, T)
	if err != nil {
		return err
	}
	return json.NewEncoder(m.Stdout).Encode(map[string]float64{
		"loss": ce, "aux": aux, "total": ce + md.Cfg.AuxLossCoef*aux})
}
