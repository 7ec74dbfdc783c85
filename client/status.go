package client

import (
	"fmt"
	"maps"
	"sync"
	"time"

	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/proto"
)

// State is where a worker stands with its coordinator.
type State string

const (
	// StateMeasuring: benchmarking the backend before the first join.
	StateMeasuring State = "measuring"
	// StateConnecting: dialling the coordinator, the first time or again after a failed attempt.
	StateConnecting State = "connecting"
	// StateJoined: welcomed by the coordinator; Shard says whether a plan gave this worker work.
	StateJoined State = "joined"
	// StateReconnecting: the connection was lost or refused; the worker waits Backoff and dials
	// again. Err says why.
	StateReconnecting State = "reconnecting"
	// StateStopped: RunWorker has returned (stopped, drained, or an unrecoverable error in Err).
	StateStopped State = "stopped"
)

// Status is a snapshot of what a worker is doing, for a page or a log to show
// (WorkerConfig.OnStatus). It is plain data with JSON names, so that the browser entry can hand it
// to JavaScript as it is.
type Status struct {
	State State `json:"state"`
	// Err is why the worker is reconnecting or stopped ("" when all is well).
	Err         string `json:"error,omitempty"`
	Coordinator string `json:"coordinator"`
	WorkerID    string `json:"worker_id,omitempty"`
	// Identity is the fingerprint of this worker's key (proto.Fingerprint): the volunteer its
	// credit is kept under, across restarts and tabs.
	Identity string        `json:"identity,omitempty"`
	Backend  proto.Backend `json:"backend"`
	// GFLOPS is the throughput this worker reported in its Hello: what the planner weighs it by.
	GFLOPS float64 `json:"gflops"`
	// Job, JobSteps and Model describe the job of the last assignment ("" before any).
	Job      string `json:"job,omitempty"`
	JobSteps int    `json:"job_steps,omitempty"`
	Model    string `json:"model,omitempty"`
	// PlanVersion and Shard are the last assignment. A worker is not told when a later plan
	// leaves it out (it is then a standby and simply gets no steps): compare PlanVersion with the
	// coordinator's current plan to tell.
	PlanVersion uint32       `json:"plan_version,omitempty"`
	Shard       *ShardStatus `json:"shard,omitempty"`
	// Steps and MicroBatches count the training steps and micro-batches this worker computed its
	// part of since RunWorker started (as the coordinator counts them: M per step).
	Steps        int   `json:"steps"`
	MicroBatches int64 `json:"micro_batches"`
	// Evaluations counts the validation passes this worker computed its part of.
	Evaluations int `json:"evaluations,omitempty"`
	// LastStep is the most recent step this worker computed, nil before the first.
	LastStep *StepStatus `json:"last_step,omitempty"`
	// OuterSigned and OuterVerified count the Ed25519 signatures this worker made and checked in
	// outer steps' exchanges (package audit, "Outer commitments": one a batch a sender hands a
	// partner of a tensor at once), as its outer steps end.
	OuterSigned   int64 `json:"outer_signed,omitempty"`
	OuterVerified int64 `json:"outer_verified,omitempty"`
}

// ShardStatus is the shard a worker holds: exactly one of Stage and Experts is set.
type ShardStatus struct {
	Stage   *proto.StageShard  `json:"stage,omitempty"`
	Experts *proto.ExpertShard `json:"experts,omitempty"`
	// Replica places Stage in one of several pipeline replicas; nil in a plan of one pipeline.
	Replica *ReplicaStatus `json:"replica,omitempty"`
	// Text says it in words: "stage 2 of 3: blocks [1,3)", "experts [1 2] of block 1", or in a plan
	// of several pipelines "replica 2 of 2, stage 1 of 2: blocks [0,2), micro-batches [3,4) of
	// every step".
	Text string `json:"text"`
}

// ReplicaStatus is the pipeline replica of a stage shard (proto.ReplicaAssign, without the
// peers' ids): its index (0-based) among Count, the micro-batches [First, First+MicroBatches) of
// every step it computes, and how many stages of other replicas it reduces gradients with.
type ReplicaStatus struct {
	Index        int `json:"index"`
	Count        int `json:"count"`
	First        int `json:"first"`
	MicroBatches int `json:"micro_batches"`
	Peers        int `json:"peers"`
}

// StepStatus is where one step's time went on this worker.
type StepStatus struct {
	Step uint64 `json:"step"`
	// TotalMS is the step from StepOpen to the report; ComputeMS forward and backward, WaitMS
	// blocked on neighbours and the coordinator, TransferMS handing tensors to the network. An
	// expert host reports only its total.
	TotalMS    float64 `json:"total_ms"`
	ComputeMS  float64 `json:"compute_ms"`
	WaitMS     float64 `json:"wait_ms"`
	TransferMS float64 `json:"transfer_ms"`
	// TokensPerS is the step's tokens (all micro-batches, B·T) over TotalMS: the rate at which
	// this worker's part of the pipeline went through them.
	TokensPerS float64 `json:"tokens_per_s"`
	BytesSent  int64   `json:"bytes_sent"`
	// Links says how frames travelled to each neighbour when the step ended: "quic" (native
	// workers, on the path ICE selected), "datachannel" (WebRTC's, as with a browser tab),
	// "relay" (through the coordinator).
	Links map[string]string `json:"links,omitempty"`
}

// shardStatus describes an assignment.
func shardStatus(a *proto.Assign) *ShardStatus {
	switch {
	case a.Shard.Stage != nil && a.Replica != nil:
		st, r := *a.Shard.Stage, a.Replica
		rs := &ReplicaStatus{Index: r.Index, Count: r.Count, First: r.First, MicroBatches: r.MicroBatches, Peers: len(r.Peers)}
		return &ShardStatus{Stage: &st, Replica: rs, Text: fmt.Sprintf("replica %d of %d, stage %d of %d: blocks [%d,%d), micro-batches [%d,%d) of every step",
			r.Index+1, r.Count, st.Index+1, st.Count, st.Begin, st.End, r.First, r.First+r.MicroBatches)}
	case a.Shard.Stage != nil && a.Standby:
		st := *a.Shard.Stage
		return &ShardStatus{Text: fmt.Sprintf("standing by, having handed blocks [%d,%d) over", st.Begin, st.End)}
	case a.Shard.Stage != nil:
		st := *a.Shard.Stage
		return &ShardStatus{Stage: &st, Text: fmt.Sprintf("stage %d of %d: blocks [%d,%d)", st.Index+1, st.Count, st.Begin, st.End)}
	case a.Shard.Experts != nil:
		ex := *a.Shard.Experts
		ex.Experts = append([]int(nil), ex.Experts...)
		text := fmt.Sprintf("experts %v of block %d", ex.Experts, ex.Block)
		if n := len(a.Routers); n > 0 {
			text += fmt.Sprintf(", for the stages of %d pipeline replicas", n)
		}
		return &ShardStatus{Experts: &ex, Text: text}
	}
	return nil
}

// modelText is a job's model in a few words (the coordinator's /api/status says it the same way).
func modelText(s job.Spec) string {
	m := s.Model
	return fmt.Sprintf("GPT-MoE, %d blocks, %d channels, %d experts (top %d), batch %d×%d tokens",
		m.NLayer, m.NEmbd, m.NExpert, m.TopK, s.BatchSize, m.BlockSize)
}

// statusBoard holds a worker's Status and tells OnStatus of every change, one call at a time and
// in the order of the changes.
type statusBoard struct {
	mu sync.Mutex
	st Status
	on func(Status)
}

// update applies f to the status and reports the result.
func (b *statusBoard) update(f func(*Status)) {
	if b == nil || b.on == nil {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	f(&b.st)
	b.on(b.st.clone())
}

// clone copies s deeply enough that the receiver may keep it.
func (s Status) clone() Status {
	if s.Shard != nil {
		sh := *s.Shard
		if sh.Replica != nil {
			r := *sh.Replica
			sh.Replica = &r
		}
		s.Shard = &sh
	}
	if s.LastStep != nil {
		ls := *s.LastStep
		ls.Links = maps.Clone(ls.Links)
		s.LastStep = &ls
	}
	return s
}

// stepDone records a training step this worker computed its part of: n of its micro-batches of
// rows sequences, added more of them to a step reported already (a reroute's).
func (b *statusBoard) stepDone(step uint64, rows int, rep *proto.StepReport, spec job.Spec, n, added int, links map[string]string) {
	b.update(func(s *Status) {
		t := rep.Timings
		total := time.Duration(t.TotalNS)
		ls := &StepStatus{Step: step, TotalMS: ms(t.TotalNS), ComputeMS: ms(t.ForwardNS + t.BackwardNS),
			WaitMS: ms(t.WaitNS), TransferMS: ms(t.TransferNS), BytesSent: t.BytesSent, Links: links}
		if total > 0 {
			ls.TokensPerS = float64(rows*spec.Model.BlockSize*n) / total.Seconds()
		}
		if added == 0 {
			s.Steps++
			s.MicroBatches += int64(n)
		} else {
			s.MicroBatches += int64(added)
		}
		s.LastStep = ls
	})
}

// outerSignatures adds signatures made and checked in an outer step's exchange.
func (b *statusBoard) outerSignatures(signed, verified int64) {
	if signed == 0 && verified == 0 {
		return
	}
	b.update(func(s *Status) {
		s.OuterSigned += signed
		s.OuterVerified += verified
	})
}

func ms(ns int64) float64 { return float64(ns) / 1e6 }
