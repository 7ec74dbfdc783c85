package main

import (
	"context"
	"errors"
	"fmt"

	"github.com/shoal-ml/shoal/coordinator"
)

func (m *Main) runExport(ctx context.Context, args []string) error {
	fs := m.newFlagSet("export", "--data-dir DIR [--checkpoint ID] --out model.safetensors")
	dataDir := fs.String("data-dir", "", "the coordinator's data `DIR`")
	id := fs.Int64("checkpoint", 0, "checkpoint `ID` (default: the newest complete one of the newest job)")
	out := fs.String("out", "", "whole-model safetensors `FILE` to write")
	if err := parse(fs, args); err != nil {
		return err
	}
	if *dataDir == "" || *out == "" {
		fs.Usage()
		return errors.Join(errUsage, errors.New("--data-dir and --out are required"))
	}
	ck, err := coordinator.Export(ctx, *dataDir, *id, *out)
	if err != nil {
		return err
	}
	fmt.Fprintf(m.Stderr, "checkpoint %d (after step %d) written to %s\n", ck.ID, ck.Step, *out)
	return nil
}
