package coordinator

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"math"
	"slices"
	"strings"

	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/sched"
)

// Why a job waits (issue 33): a job that cannot plan says so in its status (JobStatus.Waiting,
// the dashboard's banner, `shoal status`) and with a job.waiting event, in the sizes an admin can
// act on, rather than showing "running" with nothing happening.

// specProfile is the cost profile a job's shards are planned and checked with (jobRun.profiles).
func specProfile(spec job.Spec) (sched.Profile, error) {
	prof, _, err := spec.ShardJob().Profiles(spec.Model, spec.BatchSize/spec.MicroBatches, spec.MicroBatches)
	if err != nil {
		return prof, err
	}
	return prof.WithWire(spec.Wire), nil
}

// wholeModelBytes is the memory one worker holding the whole model needs.
func wholeModelBytes(spec job.Spec) (float64, bool) {
	prof, err := specProfile(spec)
	if err != nil {
		return 0, false
	}
	return prof.StageMemory(0, prof.NumBlocks(), 0, 1, spec.MicroBatches), true
}

// waitReason says why a job with n plannable workers of the need it waits for cannot plan yet;
// "" when it is not short of workers.
func (j *jobRun) waitReason(need, n int) string {
	if n >= need {
		return ""
	}
	connected := len(j.peers)
	var tooSmall int
	for _, p := range j.peers {
		if p.noMemory {
			tooSmall++
		}
	}
	have := fmt.Sprintf("%d connected", connected)
	if tooSmall > 0 {
		have += fmt.Sprintf(", %d of them refused a shard for lack of memory", tooSmall)
	}
	if p := j.spec.Plan; p != nil && len(p.Stages) > 0 && n < len(p.Stages) {
		// The pinned stages go to the workers in id order: the first stage past the usable
		// workers is the one without a worker.
		a, b := p.Stages[n][0], p.Stages[n][1]
		msg := fmt.Sprintf("stage %d of %d (blocks [%d,%d)) has no worker", n+1, len(p.Stages), a, b)
		if prof, err := specProfile(j.spec); err == nil {
			msg += fmt.Sprintf(": waiting for one with ≥ %s", fmtGiB(prof.StageMemory(a, b, n, len(p.Stages), j.spec.MicroBatches)))
		} else {
			msg += ": waiting for one"
		}
		return fmt.Sprintf("%s (the pinned plan needs %d workers; %s)", msg, need, have)
	}
	if j.spec.Plan != nil {
		return fmt.Sprintf("the pinned plan needs %d workers: waiting for %d more (%s)", need, need-n, have)
	}
	if need == 1 {
		msg := "no worker: waiting for one"
		if whole, ok := wholeModelBytes(j.spec); ok {
			msg += fmt.Sprintf(" (one alone needs ≥ %s for the whole model; several share it)", fmtGiB(whole))
		}
		if connected > 0 {
			msg += " — " + have
		}
		return msg
	}
	// No count of those connected: the text would change, and the status be published again, at
	// every join of a wave of thousands (make scale); the peers list has them.
	return fmt.Sprintf("waiting for %d workers to start with (--min-workers)", need)
}

// setWaiting publishes why the job waits ("" when it no longer does), with a job.waiting event
// when it starts to wait: not at every join while it waits, which at scale would be thousands.
func (j *jobRun) setWaiting(reason string) {
	if reason == j.waiting {
		return
	}
	was := j.waiting
	j.waiting = reason
	if reason != "" && was == "" {
		j.s.log.Warn("the job waits for workers", "reason", reason)
		j.s.event(j.rec.ID, "job.waiting", "", map[string]any{"reason": reason})
	}
	j.publish()
}

// awaitJoin waits, after no plan fit the connected workers (why), until another worker plans may
// use joins. Until then nothing is planned again: the same workers would get the same answer.
func (j *jobRun) awaitJoin(ctx context.Context, why error) error {
	msg := why.Error()
	if i := strings.Index(msg, sched.ErrNoPlan.Error()+": "); i >= 0 {
		msg = msg[i+len(sched.ErrNoPlan.Error())+2:]
	}
	j.setWaiting("no plan fits the connected workers, waiting for more: " + msg)
	defer j.setWaiting("")
	n := j.plannable()
	for {
		woke, _, err := j.await(ctx, listen{commands: true, stopping: true, idle: true})
		switch {
		case err != nil:
			return err
		case woke == wokeStopping:
			return j.stopAtBoundary(ctx)
		case woke == wokeCommand && j.hold == holdCancelled:
			return errCancelled
		case woke == wokeEvent:
			m := j.plannable()
			if m > n {
				return nil
			}
			n = m
		}
	}
}

// fmtGiB writes a byte count for people, in GiB (MiB below one GiB).
func fmtGiB(b float64) string {
	if b < 1<<30 {
		return fmt.Sprintf("%.0f MiB", b/(1<<20))
	}
	return fmt.Sprintf("%.1f GiB", b/(1<<30))
}

// memoryFit says how spec's model fails to fit the memory offered (worker id → bytes), or ""
// when a plan fits: what POST /api/jobs warns of. The planner's answer depends on memory alone
// when speeds are equal and links free, which is all that is asked here.
func memoryFit(spec job.Spec, offers map[string]int64) string {
	prof, err := specProfile(spec)
	if err != nil {
		return ""
	}
	M := spec.MicroBatches
	if len(offers) == 0 {
		return fmt.Sprintf("no worker is connected: one alone needs ≥ %s for the whole model, or several share it", fmtGiB(prof.StageMemory(0, prof.NumBlocks(), 0, 1, M)))
	}
	ids := slices.Sorted(maps.Keys(offers))
	if p := spec.Plan; p != nil {
		need := len(p.Stages) + pinnedHostCount(p.Experts)
		for _, r := range p.Replicas {
			need += len(r.Stages)
		}
		if need > len(ids) {
			return fmt.Sprintf("the pinned plan needs %d workers, %d are connected", need, len(ids))
		}
		// The pinned stages go to the workers in id order (jobRun.plan).
		for i, st := range p.Stages {
			if b := prof.StageMemory(st[0], st[1], i, len(p.Stages), M); float64(offers[ids[i]]) < b {
				return fmt.Sprintf("stage %d of %d (blocks [%d,%d)) needs ≥ %s; worker %s, which the pinned plan would give it, offers %s",
					i+1, len(p.Stages), st[0], st[1], fmtGiB(b), ids[i], fmtGiB(float64(offers[ids[i]])))
			}
		}
		return ""
	}
	peers := make([]sched.Peer, 0, len(ids))
	for _, id := range ids {
		peers = append(peers, sched.Peer{ID: id, GFLOPS: 1, MemoryBytes: max(offers[id], 1), LinkBytesPerS: math.Inf(1)})
	}
	if _, err := sched.Partition(prof, peers, sched.Options{MicroBatches: M}); errors.Is(err, sched.ErrNoPlan) {
		msg := err.Error()
		if i := strings.Index(msg, sched.ErrNoPlan.Error()+": "); i >= 0 {
			msg = msg[i+len(sched.ErrNoPlan.Error())+2:]
		}
		return fmt.Sprintf("no plan fits the %d connected workers: %s", len(ids), msg)
	}
	return ""
}
