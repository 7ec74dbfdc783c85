package main

import (
	"context"
	"errors"
	"fmt"
	"text/tabwriter"

	"github.com/google/uuid"

	"github.com/shoal-ml/shoal/coordinator"
)

func (m *Main) runExport(ctx context.Context, args []string) error {
	fs := m.newFlagSet("export", "--data-dir DIR [--checkpoint ID | --job ID] --out model.safetensors, or --data-dir DIR --list")
	dataDir := fs.String("data-dir", "", "the coordinator's data `DIR`")
	id := fs.Int64("checkpoint", 0, "checkpoint `ID`, of any job (--list shows them; default: the newest complete one of the newest job)")
	jobID := fs.String("job", "", "the newest complete checkpoint of job `ID` instead")
	out := fs.String("out", "", "whole-model safetensors `FILE` to write")
	list := fs.Bool("list", false, "list every job's checkpoints (id, job, step, state) instead of exporting one")
	if err := parse(fs, args); err != nil {
		return err
	}
	if *dataDir == "" || *out == "" && !*list {
		fs.Usage()
		return errors.Join(errUsage, errors.New("--data-dir and --out (or --list) are required"))
	}
	if *list {
		cks, err := coordinator.Checkpoints(ctx, *dataDir)
		if err != nil {
			return err
		}
		if len(cks) == 0 {
			fmt.Fprintf(m.Stdout, "no checkpoints in %s\n", *dataDir)
			return nil
		}
		tw := tabwriter.NewWriter(m.Stdout, 0, 0, 2, ' ', 0)
		fmt.Fprintln(tw, "CHECKPOINT\tJOB\tJOB STATE\tSTEP\tSTATE\tTAKEN")
		for _, ck := range cks {
			at := ck.Created
			if ck.Completed != nil {
				at = *ck.Completed
			}
			fmt.Fprintf(tw, "%d\t%s\t%s\t%d\t%s\t%s\n", ck.ID, ck.Job, ck.JobState, ck.Step, ck.State, at.Local().Format("2006-01-02 15:04:05"))
		}
		return tw.Flush()
	}
	var job uuid.UUID
	if *jobID != "" {
		var err error
		if job, err = uuid.Parse(*jobID); err != nil {
			return fmt.Errorf("--job %q: not a job id (--list shows them)", *jobID)
		}
	}
	ck, err := coordinator.ExportJob(ctx, *dataDir, *id, job, *out)
	if err != nil {
		return err
	}
	fmt.Fprintf(m.Stderr, "checkpoint %d (after step %d) written to %s\n", ck.ID, ck.Step, *out)
	return nil
}
