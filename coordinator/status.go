package coordinator

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"time"

	"github.com/google/uuid"

	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/storage"
)

// Status is GET /api/status: the job, its recent steps, the plan and the peers.
type Status struct {
	Job   *JobStatus   `json:"job"`
	Steps []StepStatus `json:"steps"` // the most recent, oldest first
	Plan  *PlanStatus  `json:"plan"`
	Peers []PeerStatus `json:"peers"`
	// Router is the last step's token assignments per expert, by MoE block.
	Router map[int][]int `json:"router"`
	// Events are the job's most recent events, oldest first.
	Events []EventStatus `json:"events"`
	// Now is the coordinator's clock, so that a page can judge last_heard without trusting its own.
	Now time.Time `json:"now"`
}

// EventStatus is one entry of the events log.
type EventStatus struct {
	ID     int64           `json:"id"`
	Time   time.Time       `json:"time"`
	Kind   string          `json:"kind"`
	Worker string          `json:"worker,omitempty"`
	Detail json.RawMessage `json:"detail"`
}

// statusEvents is how many events /api/status carries.
const statusEvents = 30

// JobStatus describes the running job.
type JobStatus struct {
	ID    string `json:"id"`
	State string `json:"state"`
	Step  int    `json:"step"` // steps completed
	Steps int    `json:"steps"`
	// Model is the job's model and batch in a few words, for the contributor page.
	Model string `json:"model"`
}

// StepStatus is one recorded step.
type StepStatus struct {
	Step       int      `json:"step"`
	Loss       float64  `json:"loss"`
	Aux        float64  `json:"aux"`
	ValLoss    *float64 `json:"val_loss,omitempty"`
	TokensPerS float64  `json:"tokens_per_s"`
	// Stages splits the step's time per participant (stages, then expert hosts).
	Stages []StageTiming `json:"stages,omitempty"`
}

// StageTiming is where one participant's step time went.
type StageTiming struct {
	Peer       string  `json:"peer"`
	ComputeMS  float64 `json:"compute_ms"`  // forward and backward
	WaitMS     float64 `json:"wait_ms"`     // blocked on neighbours and the coordinator
	TransferMS float64 `json:"transfer_ms"` // handing tensors to the network
}

// PlanStatus is the active plan.
type PlanStatus struct {
	Version     uint32         `json:"version"`
	Stages      []StageStatus  `json:"stages"`
	ExpertHosts []ExpertStatus `json:"expert_hosts"`
	Standby     []string       `json:"standby"`
}

// ExpertStatus is an expert host of the plan.
type ExpertStatus struct {
	Block    int    `json:"block"`
	Experts  []int  `json:"experts"`
	Peer     string `json:"peer"`
	PeerName string `json:"peer_name,omitempty"`
}

// StageStatus is one stage of the plan and the peer holding it.
type StageStatus struct {
	Blocks   [2]int `json:"blocks"`
	Peer     string `json:"peer"`
	PeerName string `json:"peer_name,omitempty"`
}

// PeerStatus is a connected worker.
type PeerStatus struct {
	ID        string    `json:"id"`
	Name      string    `json:"name,omitempty"`
	Kind      string    `json:"kind"`
	Backend   string    `json:"backend"`
	GFLOPS    float64   `json:"gflops"`
	Joined    time.Time `json:"joined"`
	LastHeard time.Time `json:"last_heard"`
	BytesIn   int64     `json:"bytes_in"`
	BytesOut  int64     `json:"bytes_out"`
	// MicroBatches and BytesSent count what the peer computed and sent to other peers in this
	// job's steps.
	MicroBatches int64 `json:"micro_batches"`
	BytesSent    int64 `json:"bytes_sent"`
}

// describeModel says what a job trains, as client.Status.Model says it to a worker's page.
func describeModel(s job.Spec) string {
	m := s.Model
	return fmt.Sprintf("GPT-MoE, %d blocks, %d channels, %d experts (top %d), batch %d×%d tokens",
		m.NLayer, m.NEmbd, m.NExpert, m.TopK, s.BatchSize, m.BlockSize)
}

// maxHistory is how many steps /api/status shows.
const maxHistory = 200

// publish snapshots the job loop's state for the status handler: the loop owns the state, the
// handler reads an immutable copy.
func (j *jobRun) publish() {
	st := &Status{
		Job:    &JobStatus{ID: j.rec.ID.String(), State: j.state, Step: j.step, Steps: j.spec.Steps, Model: describeModel(j.spec)},
		Steps:  append([]StepStatus(nil), j.history...),
		Router: map[int][]int{},
	}
	for b, t := range j.routed {
		st.Router[b] = append([]int(nil), t...)
	}
	if j.version != 0 {
		ps := &PlanStatus{Version: j.version, Standby: append([]string{}, j.standby...)}
		for _, p := range j.stages {
			ss := StageStatus{Blocks: [2]int{p.begin, p.end}, Peer: p.peer}
			if pr := j.peers[p.peer]; pr != nil && pr.hello != nil {
				ss.PeerName = pr.hello.Name
			}
			ps.Stages = append(ps.Stages, ss)
		}
		ps.ExpertHosts = []ExpertStatus{}
		for _, h := range j.hosts {
			es := ExpertStatus{Block: h.block, Experts: h.experts, Peer: h.peer}
			if pr := j.peers[h.peer]; pr != nil && pr.hello != nil {
				es.PeerName = pr.hello.Name
			}
			ps.ExpertHosts = append(ps.ExpertHosts, es)
		}
		st.Plan = ps
	}
	j.s.status.Store(st)
	counts := maps.Clone(j.counts)
	j.s.peerCounts.Store(&counts)
	j.s.notify()
}

func (s *Server) recentEvents(ctx context.Context, st *Status) []EventStatus {
	out := []EventStatus{}
	if st.Job == nil {
		return out
	}
	id, err := uuid.Parse(st.Job.ID)
	if err != nil {
		return out
	}
	evs, err := s.db.ListEvents(ctx, storage.EventFilter{JobID: id, Limit: statusEvents, Newest: true})
	if err != nil {
		return out
	}
	for _, e := range evs { // the newest ones, in id order
		out = append(out, EventStatus{ID: e.ID, Time: e.Time, Kind: e.Kind, Worker: e.WorkerID, Detail: e.Message})
	}
	return out
}

func (s *Server) peerStatus() []PeerStatus {
	out := []PeerStatus{}
	for _, w := range s.hub.Workers() {
		ps := PeerStatus{ID: w.ID, Joined: w.Joined, LastHeard: w.LastHeard, BytesIn: w.BytesIn, BytesOut: w.BytesOut}
		if counts := s.peerCounts.Load(); counts != nil {
			if c, ok := (*counts)[w.ID]; ok {
				ps.MicroBatches, ps.BytesSent = c.microBatches, c.bytesSent
			}
		}
		if w.Hello != nil {
			ps.Name, ps.Kind, ps.Backend, ps.GFLOPS = w.Hello.Name, string(w.Hello.Kind), string(w.Hello.Backend), w.Hello.GFLOPS
		}
		out = append(out, ps)
	}
	return out
}

// peerCount is what a peer did for the job: micro-batches computed, tensor bytes sent.
type peerCount struct {
	microBatches, bytesSent int64
}
