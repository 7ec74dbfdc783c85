package coordinator

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"

	"github.com/shoal-ml/shoal/local"
	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/safetensors"
	"github.com/shoal-ml/shoal/storage"
)

// checkShard reads an uploaded shard back from the blob store and refuses it unless it is a
// checkpoint file of the checkpoint's step: a worker cannot complete a checkpoint with junk.
func (s *Server) checkShard(sha string, id int64) error {
	ck, err := s.db.Checkpoint(context.Background(), id)
	if err != nil {
		return fmt.Errorf("checkpoint %d: %w", id, err)
	}
	b, err := s.readBlob(sha)
	if err != nil {
		return err
	}
	_, meta, err := safetensors.Read(b)
	if err != nil {
		return fmt.Errorf("shard of checkpoint %d: %w", id, err)
	}
	if step, err := strconv.Atoi(meta["step"]); err != nil || int64(step) != int64(ck.Step) {
		return fmt.Errorf("shard of checkpoint %d says step %q, the checkpoint is after step %d", id, meta["step"], ck.Step)
	}
	return nil
}

func (s *Server) readBlob(sha string) ([]byte, error) {
	f, err := s.blobs.Open(sha)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return io.ReadAll(f)
}

// assemble builds the whole-model checkpoint file of a complete checkpoint — the union of its
// shards' tensors and optimizer state — stores it as a blob (the file workers restore from) and,
// when OutDir is set, writes it there as ckpt-NNNNNN.safetensors.
func (s *Server) assemble(ctx context.Context, ck storage.Checkpoint) (sha string, err error) {
	var m *model.Model
	for _, sh := range ck.Shards {
		b, err := s.readBlob(sh.SHA256)
		if err != nil {
			return "", fmt.Errorf("assemble checkpoint %d: shard %s: %w", ck.ID, sh.Name, err)
		}
		ts, meta, err := safetensors.Read(b)
		if err != nil {
			return "", fmt.Errorf("assemble checkpoint %d: shard %s: %w", ck.ID, sh.Name, err)
		}
		if m == nil {
			cfg, err := model.ParseConfig([]byte(meta["config"]))
			if err != nil {
				return "", fmt.Errorf("assemble checkpoint %d: shard %s: %w", ck.ID, sh.Name, err)
			}
			if m, err = model.NewModel(cfg); err != nil {
				return "", err
			}
			m.Step = int(ck.Step)
		}
		names := map[string][]float32{}
		for _, t := range ts {
			names[t.Name] = t.Data
		}
		for _, set := range []*model.Params{m.P, m.Opt.M, m.Opt.V} {
			prefix := map[*model.Params]string{m.P: "", m.Opt.M: "optim.m.", m.Opt.V: "optim.v."}[set]
			for _, t := range set.Tensors {
				if d, ok := names[prefix+t.Name]; ok {
					if len(d) != len(t.Data) {
						return "", fmt.Errorf("assemble checkpoint %d: %s%s has %d values, want %d", ck.ID, prefix, t.Name, len(d), len(t.Data))
					}
					copy(t.Data, d)
					delete(names, prefix+t.Name)
				}
			}
		}
	}
	if m == nil {
		return "", fmt.Errorf("assemble checkpoint %d: no shards", ck.ID)
	}
	var buf bytes.Buffer
	if err := safetensors.Write(&buf, model.CheckpointTensors(m.P, m.Opt), model.CheckpointMeta(m.Cfg, m.Step)); err != nil {
		return "", err
	}
	sha, _, err = s.blobs.Put(ctx, bytes.NewReader(buf.Bytes()))
	if err != nil {
		return "", err
	}
	if s.cfg.OutDir != "" {
		if err := os.MkdirAll(s.cfg.OutDir, 0o755); err != nil {
			return "", err
		}
		p := filepath.Join(s.cfg.OutDir, local.CheckpointName(m.Step))
		if err := model.SaveCheckpoint(p, m.Cfg, m.Step, m.P, m.Opt); err != nil {
			return "", err
		}
	}
	return sha, nil
}
