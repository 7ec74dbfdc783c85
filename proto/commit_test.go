package proto

import (
	"strings"
	"testing"
)

// TestCommitSentToSeveral: a stage of one of three step-mode replicas sends each gradient node
// to both others — one key, two recipients — which a commitment must be able to say; the same
// key to one recipient twice is malformed.
func TestCommitSentToSeveral(t *testing.T) {
	d := strings.Repeat("A", DigestLen)
	key := KeyID(GradReduceKey{PlanVersion: 1, Step: 3, Tensor: 0, Replica: 0, Lo: 0, Hi: 2}.Key())
	c := Commit{State: d, Sent: []SentDigest{{To: "w1", Key: key, Digest: d}, {To: "w2", Key: key, Digest: d}}}
	if err := c.Validate(); err != nil {
		t.Fatalf("one node to two replicas: %v", err)
	}
	c.Sent = append(c.Sent, SentDigest{To: "w2", Key: key, Digest: d})
	if err := c.Validate(); err == nil || !strings.Contains(err.Error(), "twice") {
		t.Fatalf("one node to w2 twice: %v, want an error", err)
	}
}
