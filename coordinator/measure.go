package coordinator

// Measured, not claimed (issue 14: peers are untrusted). A worker's Hello says how fast it is; the
// planner believes it only until the worker's first steps are timed. Each step, a participant's
// delivered speed is its share of the step's FLOPs (the coordinator's count, from the plan and
// the router's statistics) over its compute time — its report's forward and backward time,
// clamped to the coordinator's own clock from opening the step to the report, which no report can
// shorten. Delivered over claimed is a peer's efficiency; honest peers of one job sit at similar
// efficiencies (the kernels are the ones their claim timed), so a peer far below the others —
// or, alone, below an absolute floor — claimed more than it has: it is flagged, planned with what
// it delivered, and the job replans at the next step boundary.
//
// A peer that lies in its timings as well as its Hello is not caught here: its report says it
// computed quickly. Verifying what peers report is the next issue's (audits by recomputation).

import (
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/proto"
	"github.com/shoal-ml/shoal/sched"
)

const (
	// warmupSteps are the first steps of a plan, which are not timed: they pay for connections,
	// allocation and cold caches.
	warmupSteps = 1
	// overclaimFactor is how far below the efficiency (delivered over claimed speed) of the other
	// participants of its kind and backend — whose claims were timed the same way — a peer must
	// fall to be flagged, and overclaimFloor the efficiency below which a peer is flagged
	// whatever the others do (a single-stage plan has no others). Honest native peers deliver a
	// few percent of their GEMM benchmark on the tiny test model (1.4% to 8% seen, before a
	// stage's wait for remote experts was moved out of its compute time), browser tabs about
	// their claim (they time a whole step); so the bounds are loose on purpose: they catch the
	// 10⁶ GFLOP/s claim, not a peer that is a little slower than it thought.
	overclaimFactor = 16
	overclaimFloor  = 1.0 / 1000
)

// speed is what the coordinator has measured of a peer in the current job.
type speed struct {
	// ratios are the last steps' delivered GFLOP/s over claimed GFLOP/s; ratio() their median.
	ratios []float64
	// flagged is set when the peer delivered far below its claim; gflops then replaces the
	// claim for planning.
	flagged bool
	gflops  float64
}

func (sp *speed) ratio() float64 {
	if len(sp.ratios) == 0 {
		return math.NaN()
	}
	r := slices.Clone(sp.ratios)
	slices.Sort(r)
	return r[len(r)/2]
}

// effectiveGFLOPS is the speed the planner uses for peer id: its claim, unless measurement
// flagged it as over-claiming.
func (j *jobRun) effectiveGFLOPS(id string) float64 {
	p := j.peers[id]
	if p == nil {
		return 0.1
	}
	if sp := j.speeds[id]; sp != nil && sp.flagged {
		return max(sp.gflops, 0.01)
	}
	return max(p.hello.GFLOPS, 0.1)
}

// shareFLOPs is the FLOPs participant i of the active plan computed in a step of M micro-batches
// whose routing was routed (tokens per expert by block): a stage's blocks (its MoE blocks as if
// their experts were local, which over-counts a stage with hosted experts and so errs in its
// favour), an expert host's routed tokens.
func (j *jobRun) shareFLOPs(i int, routed map[int][]int) float64 {
	M := j.spec.MicroBatches
	if i < len(j.stages) {
		prof, err := sched.NewProfile(j.spec.Model, j.spec.BatchSize/M)
		if err != nil {
			return 0
		}
		st := j.stages[i]
		return float64(st.n) * prof.StageFLOPs(st.begin, st.end)
	}
	prof, err := sched.NewExpertProfile(j.spec.Model, j.spec.BatchSize/M, M)
	if err != nil {
		return 0
	}
	h := j.hosts[i-len(j.stages)]
	replicas := j.replicas()
	var tokens float64
	for _, e := range h.experts {
		if r := routed[h.block]; e < len(r) {
			tokens += float64(r[e]) / float64(max(len(replicas[[2]int{h.block, e}]), 1))
		}
	}
	return tokens * prof.FLOPsPerToken
}

// measure records a step's timings — reports[i] participant i's, elapsed[i] the coordinator's
// clock from opening the step to that report — and flags peers that delivered far below their
// claims. It returns the peers newly flagged.
func (j *jobRun) measure(reports []*proto.StepReport, elapsed []time.Duration, routed map[int][]int) []string {
	j.planSteps++
	if j.planSteps <= warmupSteps {
		return nil
	}
	parts := j.participants()
	for i, id := range parts {
		p := j.peers[id]
		if p == nil || i >= len(elapsed) || i >= len(reports) || elapsed[i] <= 0 {
			continue
		}
		flops := j.shareFLOPs(i, routed)
		if flops <= 0 {
			continue
		}
		compute := time.Duration(reports[i].Timings.ForwardNS + reports[i].Timings.BackwardNS)
		compute = min(max(compute, time.Microsecond), elapsed[i])
		lb := flops / float64(compute.Nanoseconds()) // GFLOP/s: FLOPs per ns
		sp := j.speeds[id]
		if sp == nil {
			sp = &speed{}
			j.speeds[id] = sp
		}
		sp.ratios = append(sp.ratios, lb/max(p.hello.GFLOPS, 0.1))
		if len(sp.ratios) > 8 {
			sp.ratios = sp.ratios[1:]
		}
		if sp.flagged {
			sp.gflops = lb
		}
	}
	var flagged []string
	for _, id := range parts {
		sp := j.speeds[id]
		if sp == nil || sp.flagged {
			continue
		}
		// The reference is the median ratio of the other unflagged participants.
		me := j.peers[id].hello
		var others []float64
		for _, o := range parts {
			so, po := j.speeds[o], j.peers[o]
			if o != id && so != nil && !so.flagged && po != nil && po.hello.Kind == me.Kind && po.hello.Backend == me.Backend {
				others = append(others, so.ratio())
			}
		}
		limit := overclaimFloor
		if len(others) > 0 {
			slices.Sort(others)
			limit = max(limit, others[len(others)/2]/overclaimFactor)
		}
		if r := sp.ratio(); r < limit {
			sp.flagged = true
			sp.gflops = r * max(j.peers[id].hello.GFLOPS, 0.1)
			if len(others) > 0 {
				// On the others' scale: what an honest peer delivering this would have claimed.
				sp.gflops /= others[len(others)/2]
			}
			flagged = append(flagged, id)
			claim := j.peers[id].hello.GFLOPS
			j.s.log.Warn("worker delivers far below its claimed speed: flagged and re-planned",
				"worker", id, "claimed_gflops", claim, "measured_ratio", r, "limit", limit, "planned_gflops", sp.gflops)
			j.s.event(j.rec.ID, "worker.overclaimed", id, map[string]any{"claimed_gflops": claim,
				"planned_gflops": sp.gflops, "detail": fmt.Sprintf("delivered %.3g of its claim, others %.3g", r, limit*overclaimFactor)})
		}
	}
	return flagged
}

// plannedMemory is the memory peer p offers the planner, at least 1 byte: what it said
// (Hello.MemoryBytes), less, in outer mode, what its outer state takes where it keeps it on its
// heap — a browser tab, or a worker that says so (Hello.OuterOnHeap: a Windows worker) —
// (sched.HeapOuterOffer; a native worker on Linux or macOS maps it from a file). Every check of a shard
// against a peer's memory — the planner's peers, the pipeline's depth, a refill's or a takeover's
// worker — goes through it, so that they agree with each other and with the worker's own check.
func (j *jobRun) plannedMemory(p *peer) int64 {
	if p == nil || p.hello == nil {
		return 1
	}
	return max(plannedOffer(p.hello, j.spec), 1)
}

// plannedOffer is what a worker that said h offers the planner of job spec (plannedMemory):
// also the submit's warning of a model too large for the workers connected (memoryFit).
func plannedOffer(h *proto.Hello, spec job.Spec) int64 {
	if h.Kind == proto.WorkerBrowser || h.OuterOnHeap {
		return sched.HeapOuterOffer(h.MemoryBytes, spec.ReplicaOptions())
	}
	return h.MemoryBytes
}
