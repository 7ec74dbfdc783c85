//go:build !js

package client

import (
	"testing"

	"github.com/shoal-ml/shoal/proto"
)

// TestSessionPeerLeft: a worker told by the coordinator that a neighbour left (proto.PeerLeft)
// fails its link to it at once and reports the data plane's failure naming that peer, as it would
// once the link timed out. The notice counts only for the plan the worker holds: one for another
// plan changes nothing, and a step runs over the link after it.
func TestSessionPeerLeft(t *testing.T) {
	h := newTestHub(t)
	h.join("w-0")
	h.join("w-1")
	spec := testJobSpec(37)
	p := twoStagePlan(t, spec, "w-0", "w-1", false)
	h.start(p)
	h.send("w-0", &proto.PeerLeft{PlanVersion: p.version + 1, Worker: "w-1"})
	x, y := testBatch(t, 0, spec.BatchSize, spec.Model.BlockSize)
	if _, err := h.trainStep(p, 0, x, y); err != nil {
		t.Fatalf("a step after a notice for another plan: %v", err)
	}
	h.send("w-0", &proto.PeerLeft{PlanVersion: p.version, Worker: "w-1"})
	for {
		m := h.next()
		if e, ok := m.m.(*proto.Error); ok && m.from == "w-0" {
			if e.Peer != "w-1" || e.PlanVersion != p.version {
				t.Fatalf("w-0 reported %+v, want the failure of its link to w-1 under plan %d", e, p.version)
			}
			return
		}
	}
}
