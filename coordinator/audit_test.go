package coordinator

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/shoal-ml/shoal/audit"
	"github.com/shoal-ml/shoal/proto"
	"github.com/shoal-ml/shoal/storage"
)

// auditRig is an upload rig (two connected workers, a and b) with an audit asked of a.
func auditRig(t *testing.T) (*uploadRig, *pendingAudit) {
	t.Helper()
	r := newUploadRig(t, Config{Recompute: func(context.Context, *audit.Replay) (*audit.Outcome, error) {
		t.Error("evidence that fails its checks reached the recomputation")
		return nil, context.Canceled
	}})
	st := proto.StepSpec{Step: 3, PlanVersion: 1, MicroBatches: 4, Rows: 2}
	commit := &proto.Commit{State: strings.Repeat("A", proto.DigestLen)}
	pa := &pendingAudit{job: r.jobID.String(), worker: r.a.WorkerID, step: 3, maxBytes: 1 << 20, asked: time.Now(),
		rec:  &stepRecord{plan: 1, spec: st, reports: map[string]*proto.StepReport{r.a.WorkerID: {Step: 3, PlanVersion: 1, Commit: commit}}},
		next: strings.Repeat("B", proto.DigestLen)}
	r.srv.auditReg.add(pa)
	return r, pa
}

func (r *uploadRig) postAudit(t *testing.T, id int64, credential string, body []byte) (int, string) {
	t.Helper()
	return r.postTo(t, proto.AuditPath(id), credential, body)
}

// TestAuditUploadAttacks: the evidence endpoint takes a bundle only from the worker the audit was
// asked of, with its session credential, of the size the job allows, one upload at a time; and
// evidence that contradicts the worker's commitments — or is not a bundle at all — is a failed
// audit, never a recomputation.
func TestAuditUploadAttacks(t *testing.T) {
	r, pa := auditRig(t)
	honest := func(step uint64) []byte {
		var b bytes.Buffer
		if err := (&audit.Bundle{Step: step, PlanVersion: 1}).Write(&b); err != nil {
			t.Fatal(err)
		}
		return b.Bytes()
	}
	cases := []struct {
		name       string
		id         int64
		credential string
		body       []byte
		status     int
	}{
		{"no credential", pa.id, "", honest(3), http.StatusUnauthorized},
		{"a forged credential", pa.id, strings.Repeat("x", 43), honest(3), http.StatusUnauthorized},
		{"another worker's audit", pa.id, r.b.Session, honest(3), http.StatusConflict},
		{"an audit nobody asked for", pa.id + 100, r.a.Session, honest(3), http.StatusConflict},
		{"larger than the job allows", pa.id, r.a.Session, append(honest(3), make([]byte, 10<<20)...), http.StatusRequestEntityTooLarge},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			status, msg := r.postAudit(t, tc.id, tc.credential, tc.body)
			if status != tc.status {
				t.Fatalf("status %d (%s), want %d", status, msg, tc.status)
			}
		})
	}
	// Another worker's audit and one that does not exist get the same answer, word for word (the
	// id aside): a worker cannot learn whether, or whose, audits are pending.
	st1, theirs := r.postAudit(t, pa.id, r.b.Session, honest(3))
	st2, none := r.postAudit(t, pa.id+100, r.b.Session, honest(3))
	if st1 != st2 || strings.ReplaceAll(theirs, fmt.Sprint(pa.id), "ID") != strings.ReplaceAll(none, fmt.Sprint(pa.id+100), "ID") {
		t.Fatalf("another worker's audit: %d %q; none: %d %q — want the same answer", st1, theirs, st2, none)
	}
	select {
	case v := <-r.srv.auditResults:
		t.Fatalf("a refused upload produced a verdict: %+v", v)
	default:
	}
	// Garbage from the right worker is evidence against it.
	if status, msg := r.postAudit(t, pa.id, r.a.Session, []byte("<html>not a bundle</html>")); status != http.StatusBadRequest {
		t.Fatalf("garbage: status %d (%s), want 400", status, msg)
	}
	v := waitVerdict(t, r)
	if v.id != pa.id || !strings.Contains(v.reason, "malformed evidence") {
		t.Fatalf("verdict on garbage %+v, want a failure for malformed evidence", v)
	}
	// Neither the refused uploads nor the garbage keep room for evidence (Config.AuditMemory):
	// an attacker cannot starve honest uploads by failing its own.
	r.srv.evidence.mu.Lock()
	defer r.srv.evidence.mu.Unlock()
	if r.srv.evidence.used != 0 || r.srv.evidence.peak == 0 {
		t.Fatalf("evidence room used %d after every upload failed (peak %d)", r.srv.evidence.used, r.srv.evidence.peak)
	}
}

// TestAuditEvidenceMustMatchCommitments: a well-formed bundle whose start state is not the one
// committed to fails without a recomputation.
func TestAuditEvidenceMustMatchCommitments(t *testing.T) {
	r, pa := auditRig(t)
	var b bytes.Buffer
	if err := (&audit.Bundle{Step: 3, PlanVersion: 1}).Write(&b); err != nil {
		t.Fatal(err)
	}
	if status, msg := r.postAudit(t, pa.id, r.a.Session, b.Bytes()); status != http.StatusNoContent {
		t.Fatalf("status %d (%s), want 204", status, msg)
	}
	v := waitVerdict(t, r)
	if !strings.Contains(v.reason, "start state") {
		t.Fatalf("verdict %+v, want the start state named", v)
	}
	// The audit took its one upload: a second is refused.
	if status, _ := r.postAudit(t, pa.id, r.a.Session, b.Bytes()); status != http.StatusConflict {
		t.Fatalf("a second upload of the same evidence: status %d, want 409", status)
	}
}

// TestAuditLeanEvidence: lean evidence (no end state, nothing sent) is taken only by an audit
// that asked for it — one the coordinator recomputes bit for bit — and what it does carry is
// bound to the commitments as a whole bundle's is. Neither reaches the recomputation.
func TestAuditLeanEvidence(t *testing.T) {
	r, whole := auditRig(t)
	lean := &pendingAudit{job: whole.job, worker: whole.worker, step: whole.step, maxBytes: whole.maxBytes, asked: time.Now(),
		rec: whole.rec, next: whole.next, exact: true}
	r.srv.auditReg.add(lean)
	// An audit that asked for thin evidence (proto.Audit.Sample) takes only evidence sampled by
	// its seed.
	thin := &pendingAudit{job: whole.job, worker: whole.worker, step: whole.step, maxBytes: whole.maxBytes, asked: time.Now(),
		rec: whole.rec, next: whole.next, exact: true, sample: 99}
	r.srv.auditReg.add(thin)
	var b bytes.Buffer
	if err := (&audit.Bundle{Step: 3, PlanVersion: 1, Lean: true}).Write(&b); err != nil {
		t.Fatal(err)
	}
	before := r.srv.metrics.evidenceBytes.Load()
	cases := []struct {
		pa   *pendingAudit
		want string
	}{
		{whole, "lean evidence for an audit that asked for all of it"},
		{lean, "start state"},
		{thin, "seed"},
	}
	for _, tt := range cases {
		if status, msg := r.postAudit(t, tt.pa.id, r.a.Session, b.Bytes()); status != http.StatusNoContent {
			t.Fatalf("status %d (%s), want 204", status, msg)
		}
		if v := waitVerdict(t, r); v.id != tt.pa.id || !strings.Contains(v.reason, tt.want) {
			t.Fatalf("verdict %+v, want audit %d failed on %q", v, tt.pa.id, tt.want)
		}
	}
	// /metrics counts the evidence read whole.
	if got, want := r.srv.metrics.evidenceBytes.Load()-before, int64(len(cases)*b.Len()); got != want {
		t.Errorf("shoal_audit_evidence_bytes_total grew by %d, want %d", got, want)
	}
}

func waitVerdict(t *testing.T, r *uploadRig) auditResult {
	t.Helper()
	select {
	case v := <-r.srv.auditResults:
		return v
	case <-time.After(10 * time.Second):
		t.Fatal("no verdict")
	}
	return auditResult{}
}

// TestCrossCheckCommitments: what a participant commits to is checked against the coordinator's
// own tokens and the other participants' commitments before any clip goes out. A worker that
// denies what the coordinator sent, or claims to have received what nobody sent, or reports
// without a commitment, is banned; two workers that disagree about a tensor between them cannot be
// told apart, so the step fails and neither is banned.
func TestCrossCheckCommitments(t *testing.T) {
	ctx := context.Background()
	r := newUploadRig(t, Config{})
	a, b := r.a.WorkerID, r.b.WorkerID
	spec := r.spec
	M, T, C := spec.MicroBatches, spec.Model.BlockSize, spec.Model.NEmbd
	st := proto.StepSpec{Step: 2, PlanVersion: 1, MicroBatches: M, Rows: spec.BatchSize / M}
	n := st.Rows * T
	x, y := make([]int32, spec.BatchSize*T), make([]int32, spec.BatchSize*T)
	for i := range x {
		x[i], y[i] = int32(i%256), int32((i+1)%256)
	}
	// An honest step of two stages: tokens to a, targets to b, activations a → b, gradients b → a.
	honest := func() []*proto.StepReport {
		var recvA, recvB []proto.Tensor
		var sentA, sentB []audit.Sent
		sh, _ := proto.ShapeOf(st.Rows, T, C)
		for mb := 0; mb < M; mb++ {
			xt, yt, err := proto.TokenTensors(st, mb, T, x[mb*n:(mb+1)*n], y[mb*n:(mb+1)*n])
			if err != nil {
				t.Fatal(err)
			}
			act := proto.Tensor{Key: proto.TensorKey{Kind: proto.KindActivation, PlanVersion: 1, Step: 2, MicroBatch: uint32(mb), Block: 2, Expert: proto.NoExpert},
				DType: proto.F32, Shape: sh, Data: make([]byte, 4*n*C)}
			grad := act
			grad.Key.Kind = proto.KindActivationGrad
			recvA = append(recvA, xt, grad)
			recvB = append(recvB, yt, act)
			sentA = append(sentA, audit.Sent{To: b, T: act})
			sentB = append(sentB, audit.Sent{To: a, T: grad})
		}
		state := strings.Repeat("S", proto.DigestLen)
		return []*proto.StepReport{{Commit: audit.NewCommit(state, recvA, sentA)}, {Commit: audit.NewCommit(state, recvB, sentB)}}
	}
	tests := []struct {
		name   string
		tamper func(reps []*proto.StepReport)
		banned string // "" when nobody may be
	}{
		{"honest", func([]*proto.StepReport) {}, ""},
		{"no commitment", func(reps []*proto.StepReport) { reps[1].Commit = nil }, b},
		{"other tokens", func(reps []*proto.StepReport) {
			for i, d := range reps[0].Commit.Recv {
				if strings.HasPrefix(d.Key, strconv.Itoa(int(proto.KindTokens))+".") {
					reps[0].Commit.Recv[i].Digest = strings.Repeat("x", proto.DigestLen)
					return
				}
			}
			t.Fatal("no tokens in the commitment")
		}, a},
		{"received what nobody sent", func(reps []*proto.StepReport) {
			reps[1].Commit.Recv = append(reps[1].Commit.Recv, proto.KeyDigest{Key: "2.9.2.4294967295", Digest: strings.Repeat("y", proto.DigestLen)})
		}, b},
		{"sent to a stranger", func(reps []*proto.StepReport) { reps[0].Commit.Sent[0].To = "w-stranger" }, a},
		{"sender and receiver disagree", func(reps []*proto.StepReport) {
			for i, d := range reps[1].Commit.Recv {
				if strings.HasPrefix(d.Key, strconv.Itoa(int(proto.KindActivation))+".") {
					reps[1].Commit.Recv[i].Digest = strings.Repeat("z", proto.DigestLen)
					return
				}
			}
			t.Fatal("no activation in the commitment")
		}, ""},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			j := &jobRun{s: r.srv, rec: storage.Job{ID: r.jobID}, spec: spec, version: 1, audits: newAuditor(),
				stages: []placement{{peer: a, begin: 0, end: 2, n: spec.MicroBatches}, {peer: b, begin: 2, end: spec.Model.NLayer, n: spec.MicroBatches}}}
			j.reps = replicaRuns(j.stages)
			reps := honest()
			tc.tamper(reps)
			err := j.crossCheck(ctx, 2, st, reps, x, y)
			switch {
			case tc.name == "honest" && err != nil:
				t.Fatalf("honest commitments refused: %v", err)
			case tc.banned != "" && (!errors.Is(err, errBanned) || !j.audits.banned[tc.banned] || len(j.audits.banned) != 1):
				t.Fatalf("err %v, banned %v; want %s banned", err, j.audits.banned, tc.banned)
			case tc.banned == "" && tc.name != "honest" && (!errors.Is(err, errStep) || len(j.audits.banned) != 0):
				t.Fatalf("err %v, banned %v; want the step failed and nobody banned", err, j.audits.banned)
			}
		})
	}
}

// TestCrossCheckTakeover: the cross-check of a step whose second replica's last stage (lost) was
// taken over by the first replica's (taker). Its neighbour (b, the second replica's first stage)
// sent the lost stage its activations before the takeover reached it, and all of them to the
// taker; the taker sent it the gradients, of which it kept whichever copy came first. A neighbour
// whose two copies of one activation differ contradicts itself: banned. A gradient the neighbour
// kept from the lost stage that the taker sent otherwise is no link dispute between the two that
// stay (either the taker lied or the lost stage did): the step is disputed (errTakeoverCopies),
// nobody banned yet. Elsewhere a disagreement is a link's, as before.
func TestCrossCheckTakeover(t *testing.T) {
	ctx := context.Background()
	r := newUploadRig(t, Config{})
	a, b := r.a.WorkerID, r.b.WorkerID
	const taker, lost = "w-taker", "w-lost"
	spec := r.spec
	M, T, C := spec.MicroBatches, spec.Model.BlockSize, spec.Model.NEmbd
	if M != 4 {
		t.Fatalf("the rig's job has %d micro-batches, want 4", M)
	}
	L := spec.Model.NLayer
	st := proto.StepSpec{Step: 2, PlanVersion: 1, MicroBatches: M, Rows: spec.BatchSize / M}
	n := st.Rows * T
	x, y := make([]int32, spec.BatchSize*T), make([]int32, spec.BatchSize*T)
	for i := range x {
		x[i], y[i] = int32(i%256), int32((i+1)%256)
	}
	sh, _ := proto.ShapeOf(st.Rows, T, C)
	tensor := func(kind proto.Kind, mb int, fill byte) proto.Tensor {
		data := make([]byte, 4*n*C)
		data[0] = fill
		return proto.Tensor{Key: proto.TensorKey{Kind: kind, PlanVersion: 1, Step: 2, MicroBatch: uint32(mb), Block: 2, Expert: proto.NoExpert},
			DType: proto.F32, Shape: sh, Data: data}
	}
	// honest is the participants' commitments (a, taker, b, in plan order): replica 0 (a → taker)
	// computes micro-batches 0 and 1; replica 1's run, 2 and 3, goes from b to the taker, which
	// got their targets, and b sent its activations to the lost stage too. lostAct and takerGrad
	// are the first byte of b's copy of micro-batch 2's activation sent to the lost stage, and of
	// the taker's gradient of micro-batch 2 sent to b (0: as honest workers send them).
	honest := func(lostAct, takerGrad byte) []*proto.StepReport {
		var recvA, recvT, recvB []proto.Tensor
		var sentA, sentT, sentB []audit.Sent
		for mb := 0; mb < M; mb++ {
			xt, yt, err := proto.TokenTensors(st, mb, T, x[mb*n:(mb+1)*n], y[mb*n:(mb+1)*n])
			if err != nil {
				t.Fatal(err)
			}
			act, grad := tensor(proto.KindActivation, mb, 0), tensor(proto.KindActivationGrad, mb, 0)
			if mb < 2 {
				recvA, sentA = append(recvA, xt, grad), append(sentA, audit.Sent{To: taker, T: act})
				recvT, sentT = append(recvT, yt, act), append(sentT, audit.Sent{To: a, T: grad})
				continue
			}
			recvB = append(recvB, xt, grad)
			toLost, fromTaker := act, grad
			if mb == 2 {
				toLost, fromTaker = tensor(proto.KindActivation, mb, lostAct), tensor(proto.KindActivationGrad, mb, takerGrad)
			}
			sentB = append(sentB, audit.Sent{To: lost, T: toLost}, audit.Sent{To: taker, T: act})
			recvT, sentT = append(recvT, yt, act), append(sentT, audit.Sent{To: b, T: fromTaker})
		}
		state := strings.Repeat("S", proto.DigestLen)
		return []*proto.StepReport{{Commit: audit.NewCommit(state, recvA, sentA)}, {Commit: audit.NewCommit(state, recvT, sentT)},
			{Commit: audit.NewCommit(state, recvB, sentB)}}
	}
	for _, tc := range []struct {
		name              string
		lostAct, takerGrd byte
		banned            string
		disputed          bool
	}{
		{"honest", 0, 0, "", false},
		{"the neighbour sent the lost stage and the taker two activations", 1, 0, b, false},
		{"the taker's gradient differs from the copy the neighbour kept", 0, 1, "", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			j := &jobRun{s: r.srv, rec: storage.Job{ID: r.jobID}, spec: spec, version: 1, audits: newAuditor(),
				stages: []placement{{peer: a, begin: 0, end: 2, n: 2}, {peer: taker, begin: 2, end: L, n: 2},
					{peer: b, begin: 0, end: 2, replica: 1, first: 2, n: 2}}}
			j.reps = replicaRuns(j.stages)
			j.rerouted = &stepReroutes{step: 2, workers: map[string]bool{lost: true}, replicas: map[int]bool{1: true},
				takeover: &takeover{tk: proto.StageTakeover{Begin: 2, End: L, Replica: 1, Lost: lost, Taker: taker, Prev: b, First: 2, MicroBatches: 2}}}
			err := j.crossCheck(ctx, 2, st, honest(tc.lostAct, tc.takerGrd), x, y)
			switch {
			case tc.banned != "":
				if !errors.Is(err, errBanned) || !j.audits.banned[tc.banned] || len(j.audits.banned) != 1 {
					t.Fatalf("err %v, banned %v; want %s banned", err, j.audits.banned, tc.banned)
				}
			case tc.disputed:
				if !errors.Is(err, errTakeoverCopies) || len(j.audits.banned) != 0 {
					t.Fatalf("err %v, banned %v; want the step disputed, nobody banned", err, j.audits.banned)
				}
			case err != nil:
				t.Fatalf("honest commitments refused: %v", err)
			}
		})
	}
}
