package coordinator

import (
	"bytes"
	"context"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/shoal-ml/shoal/audit"
	"github.com/shoal-ml/shoal/proto"
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
	req, err := http.NewRequest(http.MethodPost, r.url+proto.AuditPath(id), bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if credential != "" {
		req.Header.Set("Authorization", "Bearer "+credential)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var b bytes.Buffer
	b.ReadFrom(resp.Body)
	return resp.StatusCode, b.String()
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
		{"another worker's audit", pa.id, r.b.Session, honest(3), http.StatusForbidden},
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
