// Command estimate prints the planner's memory estimate for a worker holding the whole model of
// each job file named, as one stage (sched.StageShardMemory) and, in outer mode, as one replica
// (sched.ReplicaShardMemory), at depths 0 and 1: what scripts/rss_replica.sh measures against.
//
//	go run ./scripts/estimate JOB.json...
package main

import (
	"fmt"
	"os"

	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/sched"
)

func main() {
	for _, f := range os.Args[1:] {
		b, err := os.ReadFile(f)
		if err == nil {
			err = estimate(f, b)
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, "estimate:", err)
			os.Exit(1)
		}
	}
}

func estimate(name string, b []byte) error {
	spec, err := job.Parse(b)
	if err != nil {
		return fmt.Errorf("%s: %w", name, err)
	}
	cfg, M := spec.Model, spec.MicroBatches
	for depth := range min(2, M) {
		need, err := sched.StageShardMemory(cfg, spec.BatchSize/M, M, 0, cfg.NLayer, 0, 1, 0, depth, spec.ShardJob())
		if err != nil {
			return fmt.Errorf("%s: %w", name, err)
		}
		fmt.Printf("%s depth %d: one stage %.0f B", name, depth, need)
		if spec.Outer() {
			r, err := sched.ReplicaShardMemory(cfg, spec.BatchSize/M, 0, cfg.NLayer, 0, 1, 0, M, depth, spec.ShardJob(), spec.ReplicaOptions())
			if err != nil {
				return fmt.Errorf("%s: %w", name, err)
			}
			fmt.Printf(", one replica %.0f B", r)
		}
		fmt.Println()
	}
	return nil
}
