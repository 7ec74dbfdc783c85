package client

// Which tensors a worker accepts, from whom, and how large (docs/design.md, "Trust": peers are
// untrusted, and every message is accepted only from the peer that holds what it names). A
// tensor's key says nothing about its sender, and the mailbox matches on the key alone, so the
// sender is checked here, at the frame header, before the reassembler allocates anything: under
// the current plan each tensor has exactly one peer that sends it.

import (
	"fmt"

	"github.com/shoal-ml/shoal/data"
	"github.com/shoal-ml/shoal/job"
	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/proto"
)

// admission is what the plan of a worker's assignment lets each peer send it. It is built once
// per Assign and read-only afterwards, so the data channels' goroutines and the control
// connection's reader share it without locks.
type admission struct {
	plan       uint32
	neighbours map[string]bool

	// A stage shard: blocks [lo, hi), its neighbouring stages, and its experts held by others
	// (their hosts in replica order).
	stage       bool
	first, last bool
	lo, hi      int
	prev, next  string
	hosts       map[ExpertRef][]string
	// prevPool and nextPool, in step mode, are the other replicas' stages beside this one's
	// blocks (proto.ReplicaAssign.PrevPool, NextPool): a stage takeover's taker, or the lost
	// stage's neighbours when this stage is the taker, send the boundary tensors its own
	// neighbours would (reroute.go). The coordinator relays their frames only once it names them.
	prevPool, nextPool map[string]bool

	// An expert shard: the stage that routes to it, the experts held (replica 0 or 1, or -1 for
	// a whole expert), the other replica of each replicated one, and the size of its partial
	// gradient in bytes.
	router   string
	routers  []proto.ExpertRouter // in a plan of pipeline replicas: each replica's stage, its micro-batches
	held     map[ExpertRef]int
	siblings map[ExpertRef]string
	partial  map[ExpertRef]int

	// A stage of one of several pipeline replicas: by peer, what the stages of the other
	// replicas send it (reduceLink): their replica, the tensors both hold by their index in the
	// model (the tensor's size in bytes), and the gradient-tree nodes of their micro-batches.
	reduce map[string]reduceAdmit
	// reroutable: a step-mode replica's stage, whose reduce peers may send any node of the tree
	// over the step's microBatches once a reroute widens their runs.
	reroutable   bool
	microBatches int
	own          [2]int // the stage's own micro-batches, which no other replica ever computes
	// segments bounds an outer step's segments (proto.OuterDeltaKey.Segment): a few a
	// participant at the first attempt (model.OuterOwners), the plan's replicas at most.
	segments int

	// A stage taking up its state from other workers (Assign.From): the step of the handover,
	// and by each state tensor's number on the wire (proto.StateKey) its giver and its size in
	// bytes (handover.go).
	giverStep uint64
	state     map[int]stateFrom

	// The largest tensors the assignment can legitimately bring: rows of activations and an
	// expert's rows (max(B/M, a validation pass's)·T rows of C) in the job's activations format
	// (actBytes), their gradients in its gradients format (gradBytes), the larger of the two
	// (rowBytes); tokens and targets (the same rows of T int32).
	actBytes, gradBytes, rowBytes, tokenBytes int

	// lim bounds what one sender can make this worker hold; its Budget is shared by every
	// sender's reassembler, so that all of them together are bounded per worker.
	lim proto.Limits
	// mailboxBytes bounds the whole tensors waiting for the worker to ask for them.
	mailboxBytes int
}

type reduceAdmit struct {
	replica int
	bytes   map[int]int // by the tensor's index in the model
	nodes   map[[2]int]bool
}

// Reassembly bounds: a sender following the schedule has about one tensor in flight at a time (the
// relay sends tensor after tensor; a data channel delivers in order natively, and a browser's
// out-of-order message goroutines only overlap neighbouring tensors), so perSenderTensors of the
// largest leaves room to spare; the mailbox holds at most about one step's tensors, since the
// coordinator opens a step only after every report of the last one.
const (
	perSenderTensors = 4
	mailboxSteps     = 4
)

// newAdmission builds the admission of Assign a for worker me, holding shard sh, with its
// neighbours, the hosts of its stage's remote experts (hosted), the other replicas of its own
// replicated experts (siblings) and, for a stage of a replicated plan, its reduce links.
func newAdmission(me string, a *proto.Assign, spec job.Spec, sh *model.Shard, neighbours []string,
	hosted map[ExpertRef][]string, siblings map[ExpertRef]string, links []reduceLink) *admission {
	cfg := spec.Model
	pass := spec.ValPassRows() // a validation pass's rows: no more than a micro-batch's
	rows := max(spec.BatchSize/max(spec.MicroBatches, 1), pass)
	// A stage of an own-batch replica (outer mode) may train more micro-batches than M.
	microBatches := max(spec.MicroBatches, stepMicroBatches(spec, a), data.ValWindows/pass)
	ad := &admission{plan: a.PlanVersion, neighbours: map[string]bool{},
		actBytes:   spec.Wire.Activations.Bytes(rows*cfg.BlockSize, cfg.NEmbd),
		gradBytes:  spec.Wire.Gradients.Bytes(rows*cfg.BlockSize, cfg.NEmbd),
		tokenBytes: 4 * rows * cfg.BlockSize}
	ad.rowBytes = max(ad.actBytes, ad.gradBytes)
	for _, p := range neighbours {
		if p != me {
			ad.neighbours[p] = true
		}
	}
	maxTensor := ad.rowBytes
	// perStep is what one step (training or evaluation) can bring: for every micro-batch an
	// activation and its gradient, and each MoE block's expert rows both ways, at most top_k rows
	// per token in all.
	var perStep int
	if st := a.Shard.Stage; st != nil {
		ad.stage, ad.first, ad.last = true, st.First, st.Last
		ad.lo, ad.hi = st.Begin, st.End
		ad.prev, ad.next, ad.hosts = a.Prev, a.Next, hosted
		if st.First || st.Last {
			maxTensor = max(maxTensor, ad.tokenBytes)
		}
		remoteBlocks := map[int]bool{}
		for ref := range hosted {
			remoteBlocks[ref.Block] = true
		}
		perStep = microBatches * ad.rowBytes * (2 + 2*cfg.TopK*len(remoteBlocks))
		// The other replicas' gradient nodes: every one of them arrives in a step.
		ad.reduce = map[string]reduceAdmit{}
		for _, l := range links {
			ra := reduceAdmit{replica: l.peer.Replica, bytes: map[int]int{}, nodes: map[[2]int]bool{}}
			for _, n := range l.nodes {
				ra.nodes[n] = true
			}
			for _, t := range l.tensors {
				ra.bytes[t.global] = 4 * t.size
				maxTensor = max(maxTensor, 4*t.size)
				perStep += 4 * t.size * len(l.nodes)
			}
			ad.reduce[l.peer.Worker] = ra
		}
		if r := a.Replica; r != nil && !spec.Outer() && len(hosted) == 0 {
			ad.reroutable, ad.microBatches, ad.own = true, spec.MicroBatches, [2]int{r.First, r.First + r.MicroBatches}
			ad.prevPool, ad.nextPool = poolSet(me, r.PrevPool), poolSet(me, r.NextPool)
			for p := range ad.prevPool {
				ad.neighbours[p] = true
			}
			for p := range ad.nextPool {
				ad.neighbours[p] = true
			}
		}
		replicas := map[int]bool{}
		for _, l := range links {
			replicas[l.peer.Replica] = true
		}
		ad.segments = min(model.OuterSegmentsPerReplica*(len(replicas)+1), proto.MaxReplicas)
		if len(a.From) > 0 {
			ad.giverStep, ad.state = a.From[0].Step, map[int]stateFrom{}
			// A shard that is not the model's admits no state: expectState refuses it.
			if nums, blocks, err := handoverNumbers(spec, sh); err == nil {
				for i, n := range handoverSizes(spec, sh) {
					if f := giverOf(a.From, blocks[i]); f != nil {
						ad.state[nums[i]] = stateFrom{f.Worker, 4 * n}
						maxTensor = max(maxTensor, 4*n)
					}
				}
			}
		}
		if len(a.Give) > 0 {
			// What this stage sends its takers: a standby giver sends nothing else, so nothing
			// else sizes its frames.
			for _, n := range handoverSizes(spec, sh) {
				maxTensor = max(maxTensor, 4*n)
			}
		}
	} else {
		ad.router, ad.routers, ad.siblings = a.Router, a.Routers, siblings
		ad.held, ad.partial = map[ExpertRef]int{}, map[ExpertRef]int{}
		for _, x := range sh.Experts.All() {
			ref := ExpertRef{x.Block, x.Index}
			ad.held[ref] = x.Replica
			if x.Replica >= 0 {
				ad.partial[ref] = 4 * x.G.NumElements()
				maxTensor = max(maxTensor, ad.partial[ref])
				perStep += ad.partial[ref]
			}
		}
		perStep += microBatches * ad.rowBytes * 2 * cfg.TopK
	}
	// proto's defaults cap what any job may make a worker hold, unless one legitimate tensor
	// needs more.
	def := proto.DefaultLimits()
	perSender := min(perSenderTensors*maxTensor, max(def.MaxInFlightBytes, maxTensor))
	budget := min(perSender*(len(ad.neighbours)+1), max(def.MaxInFlightBytes, perSender)) // +1: the coordinator
	ad.lim = proto.Limits{MaxTensorBytes: maxTensor, MaxInFlightBytes: perSender, Budget: proto.NewBudget(budget)}
	ad.mailboxBytes = min(max(mailboxSteps*perStep, maxTensor), def.MaxInFlightBytes)
	return ad
}

// stateFrom is a state tensor's giver and its size in bytes (admission.state).
type stateFrom struct {
	giver string
	bytes int
}

// neighbour reports whether peer is a neighbour under this plan: anyone else's frames and signals
// are dropped unread (an error caused by a message from outside the plan drops that message,
// never the step).
func (ad *admission) neighbour(peer string) bool { return ad.neighbours[peer] }

// check says whether from may send the tensor of header h under this plan: nil if it may; an
// error wrapping ErrNotNeighbour if from is not a neighbour at all (the frame is to be dropped);
// else an error wrapping ErrUnexpectedTensor or proto.ErrTensorTooLarge, which means from broke
// the protocol. from is "" for the coordinator, which sends only tokens and targets. h is from
// DecodeFrame, and not of an older plan (those are dropped before).
func (ad *admission) check(from string, h proto.FrameHeader) error {
	if from != "" && !ad.neighbours[from] {
		return fmt.Errorf("%v from %s: %w", h.TensorKey, from, ErrNotNeighbour)
	}
	if h.PlanVersion != ad.plan {
		return fmt.Errorf("%w: %v from %s, under plan %d", ErrUnexpectedTensor, h.TensorKey, senderName(from), ad.plan)
	}
	limit, ok := ad.sender(from, h)
	if !ok {
		return fmt.Errorf("%w: %v from %s", ErrUnexpectedTensor, h.TensorKey, senderName(from))
	}
	if n := h.TensorBytes(); n > limit {
		return fmt.Errorf("%w: %v from %s is %d bytes, at most %d in this job", proto.ErrTensorTooLarge, h.TensorKey, senderName(from), n, limit)
	}
	return nil
}

func senderName(from string) string {
	if from == "" {
		return "the coordinator"
	}
	return from
}

// sender reports whether from is the peer the plan has send the tensor of header h to this
// worker, and if so the largest such tensor in bytes.
func (ad *admission) sender(from string, h proto.FrameHeader) (int, bool) {
	// DecodeFrame accepts no header its kind's parser refuses: a parser's error here is a
	// tensor nobody may send.
	switch h.Kind {
	case proto.KindTokens, proto.KindTargets:
		if _, err := proto.ParseTokenKey(h.TensorKey); err != nil {
			return 0, false
		}
		if h.Kind == proto.KindTokens {
			return ad.tokenBytes, from == "" && ad.stage && ad.first
		}
		return ad.tokenBytes, from == "" && ad.stage && ad.last
	}
	if from == "" {
		return 0, false // the coordinator sends no activations or expert rows
	}
	switch h.Kind {
	case proto.KindGradReduce:
		// A node of a tensor both hold, from the sender's replica: of its micro-batches, or in
		// step mode of any others but this stage's own (a reroute widens a replica's run
		// mid-step into the runs of replicas lost, never into a survivor's: reroute.go).
		k, err := proto.ParseGradReduceKey(h.TensorKey)
		ra, ok := ad.reduce[from]
		n, held := ra.bytes[k.Tensor]
		node := ra.nodes[[2]int{k.Lo, k.Hi}] ||
			ad.reroutable && model.IsTreeNode(ad.microBatches, k.Lo, k.Hi) && (k.Hi <= ad.own[0] || k.Lo >= ad.own[1])
		return n, err == nil && ok && held && k.Replica == ra.replica && node
	case proto.KindOuterDelta:
		// At an outer step: a tensor both hold, from the sender's replica, in one of its two parts
		// (never more than the float32 tensor: int8 with its scales is less).
		k, err := proto.ParseOuterDeltaKey(h.TensorKey)
		ra, ok := ad.reduce[from]
		n, held := ra.bytes[k.Tensor]
		return n, err == nil && ok && held && k.Replica == ra.replica && k.Segment < ad.segments
	case proto.KindState:
		// A tensor of the state this stage takes up, from the worker handing it over, at the
		// handover's step.
		k, err := proto.ParseStateKey(h.TensorKey)
		st, ok := ad.state[k.Tensor]
		if err != nil || !ok || from != st.giver || k.Step != ad.giverStep {
			return 0, false
		}
		return st.bytes, true
	case proto.KindOuterSig:
		// The signature of such a tensor, from its sender only.
		k, err := proto.ParseOuterSigKey(h.TensorKey)
		ra, ok := ad.reduce[from]
		n, held := ra.bytes[k.Tensor]
		size := 4 * proto.OuterSigEntryWords
		if k.Batch {
			// A leaf a segment of the tensor at most: no more segments than the plan has, nor
			// than the tensor has chunks (model.OuterSegment).
			size = 4 * (16 + 8*min(ad.segments, model.OuterLayout{N: n / 4}.Chunks()))
		}
		return size, err == nil && ok && held && k.Replica == ra.replica && k.Segment < ad.segments
	case proto.KindActivation, proto.KindActivationGrad:
		k, err := proto.ParseStageKey(h.TensorKey)
		if err != nil {
			return 0, false
		}
		// From the plan's neighbour, or in a stage takeover from a stage beside this one's blocks
		// in another replica (the taker of a lost neighbour, or the lost stage's neighbour when
		// this stage took it over): a first stage may take over a lost first stage, whose
		// activations come from nobody, so the pools are checked by blocks alone.
		if k.Kind == proto.KindActivation {
			return ad.actBytes, ad.stage && k.Block == ad.lo && (!ad.first && from == ad.prev || ad.prevPool[from])
		}
		return ad.gradBytes, ad.stage && k.Block == ad.hi && (!ad.last && from == ad.next || ad.nextPool[from])
	case proto.KindExpertIn, proto.KindExpertOut, proto.KindExpertGradIn, proto.KindExpertGradOut:
		k, err := proto.ParseExpertKey(h.TensorKey)
		if err != nil {
			return 0, false
		}
		ref := ExpertRef{k.Block, k.Expert}
		switch {
		case k.Partial:
			// A replica's partial gradient (partialKey): from the other replica, of its group.
			r, held := ad.held[ref]
			return ad.partial[ref], !ad.stage && held && r >= 0 && from == ad.siblings[ref] && k.Group == 1-r
		case k.Kind == proto.KindExpertIn || k.Kind == proto.KindExpertGradIn:
			// The router sends a whole expert both token groups, replica r only group r.
			r, held := ad.held[ref]
			return ad.rows(k.Kind), !ad.stage && held && from == ad.routerOf(k) && (r < 0 || k.Group == r)
		}
		// Group g's rows come back from the host the stage sent them to (ExpertDispatch.exchange).
		hosts := ad.hosts[ref]
		if !ad.stage || len(hosts) == 0 {
			return 0, false
		}
		return ad.rows(k.Kind), from == hosts[min(k.Group, len(hosts)-1)]
	}
	return 0, false
}

// routerOf is the stage that sends an expert host the rows of key: the one stage of a plan of
// one pipeline; with pipeline replicas, the stage of the replica computing the key's
// micro-batch — the first replica's for an evaluation, which runs through it alone.
func (ad *admission) routerOf(key proto.ExpertKey) string {
	if len(ad.routers) == 0 {
		return ad.router
	}
	if proto.TrainingStep(key.Step) != key.Step {
		return ad.routers[0].Worker
	}
	for _, rt := range ad.routers {
		if key.MicroBatch >= rt.First && key.MicroBatch < rt.First+rt.MicroBatches {
			return rt.Worker
		}
	}
	return ""
}

// rows is the size bound of an expert's rows of kind k: in the activations format forward, the
// gradients format backward.
func (ad *admission) rows(k proto.Kind) int {
	if k == proto.KindExpertGradIn || k == proto.KindExpertGradOut {
		return ad.gradBytes
	}
	return ad.actBytes
}

// poolSet is ids as a set, less me.
func poolSet(me string, ids []string) map[string]bool {
	if len(ids) == 0 {
		return nil
	}
	out := make(map[string]bool, len(ids))
	for _, id := range ids {
		if id != me {
			out[id] = true
		}
	}
	return out
}

// pooled reports whether from sends this stage boundary tensors only in a stage takeover: a
// copy of one held or taken already is then no error (Mailbox.DeliverOnce).
func (ad *admission) pooled(from string) bool {
	return from != "" && from != ad.prev && from != ad.next && (ad.prevPool[from] || ad.nextPool[from])
}
