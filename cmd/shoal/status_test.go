package main

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/shoal-ml/shoal/coordinator"
)

// cannedStatus is GET /api/status of a 4-block job (MoE blocks 1 and 3, 8 experts) twelve steps
// in: two pipeline stages, block 3's experts 4-7 on an expert host, one browser peer.
const cannedStatus = `{
  "job": {"id": "0f6c2e1a-7b3d-4c59-9e21-5a8d0b7c4e13", "state": "running", "step": 12, "steps": 200},
  "steps": [
    {"step": 0, "loss": 5.5451, "aux": 0.0132, "tokens_per_s": 1804},
    {"step": 1, "loss": 5.4012, "aux": 0.0129, "tokens_per_s": 1911},
    {"step": 2, "loss": 5.2177, "aux": 0.0127, "tokens_per_s": 1893},
    {"step": 3, "loss": 5.0441, "aux": 0.0121, "tokens_per_s": 1950},
    {"step": 4, "loss": 4.8890, "aux": 0.0118, "tokens_per_s": 1874},
    {"step": 5, "loss": 4.7522, "aux": 0.0117, "tokens_per_s": 1932},
    {"step": 6, "loss": 4.6310, "aux": 0.0115, "tokens_per_s": 1322},
    {"step": 7, "loss": 4.5208, "aux": 0.0114, "tokens_per_s": 1906},
    {"step": 8, "loss": 4.4371, "aux": 0.0112, "tokens_per_s": 1921},
    {"step": 9, "loss": 4.3619, "aux": 0.0111, "val_loss": 4.4873, "tokens_per_s": 1888},
    {"step": 10, "loss": 4.2954, "aux": 0.0110, "tokens_per_s": 1940},
    {"step": 11, "loss": 4.2306, "aux": 0.0109, "tokens_per_s": 1897}
  ],
  "plan": {
    "version": 2,
    "stages": [
      {"blocks": [0, 2], "peer": "w-5c0e8a1f3b72", "peer_name": "lab-a"},
      {"blocks": [2, 4], "peer": "w-9d41b7e02c6a", "peer_name": "Chrome 131 (macOS)"}
    ],
    "expert_hosts": [
      {"block": 3, "experts": [4, 5, 6, 7], "peer": "w-e27f40c9a815", "peer_name": "lab-b"}
    ],
    "standby": [],
    "from_step": 11,
    "kept_from": 1
  },
  "peers": [
    {"id": "w-5c0e8a1f3b72", "kind": "native", "backend": "cpu", "gflops": 212.4,
     "joined": "2026-03-02T10:01:12Z", "last_heard": "2026-03-02T10:15:28Z", "bytes_in": 48234496, "bytes_out": 51380224},
    {"id": "w-9d41b7e02c6a", "kind": "browser", "backend": "webgpu", "gflops": 1630.8,
     "joined": "2026-03-02T10:01:15Z", "last_heard": "2026-03-02T10:15:29Z", "bytes_in": 50331648, "bytes_out": 47185920},
    {"id": "w-e27f40c9a815", "kind": "native", "backend": "vulkan", "device": "NVIDIA H200", "gflops": 180.2, "flagged": true, "planned_gflops": 3.5,
     "joined": "2026-03-02T10:01:13Z", "last_heard": "2026-03-02T10:15:01Z", "bytes_in": 6291456, "bytes_out": 6029312}
  ],
  "router": {
    "1": [1210, 980, 1432, 1101, 1020, 1388, 877, 1184],
    "3": [802, 1650, 1170, 1003, 1215, 1090, 1208, 1054]
  },
  "events": [
    {"id": 1, "time": "2026-03-02T10:00:58Z", "kind": "job.submitted", "detail": {}},
    {"id": 2, "time": "2026-03-02T10:01:12Z", "kind": "worker.joined", "worker": "w-5c0e8a1f3b72",
     "detail": {"name": "lab-a", "kind": "native", "backend": "cpu", "gflops": 212.4}},
    {"id": 3, "time": "2026-03-02T10:01:13Z", "kind": "worker.joined", "worker": "w-e27f40c9a815",
     "detail": {"name": "lab-b", "kind": "native", "backend": "cpu", "gflops": 180.2}},
    {"id": 4, "time": "2026-03-02T10:01:15Z", "kind": "worker.joined", "worker": "w-9d41b7e02c6a",
     "detail": {"name": "Chrome 131 (macOS)", "kind": "browser", "backend": "webgpu", "gflops": 1630.8}},
    {"id": 5, "time": "2026-03-02T10:01:16Z", "kind": "plan",
     "detail": {"version": 2, "from_step": 0, "standby": [],
                "stages": [{"peer": "w-5c0e8a1f3b72", "blocks": [0, 2]}, {"peer": "w-9d41b7e02c6a", "blocks": [2, 4]}]}}
  ]
}`

// cannedNow is the coordinator's clock when it served cannedStatus.
var cannedNow = time.Date(2026, 3, 2, 10, 15, 30, 0, time.UTC)

// serveStatus serves body as /api/status with code, the Date header set to cannedNow.
func serveStatus(t *testing.T, code int, body string) *httptest.Server {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/api/status" {
			http.NotFound(w, r)
			return
		}
		w.Header().Set("Date", cannedNow.Format(http.TimeFormat))
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(code)
		io.WriteString(w, body)
	}))
	t.Cleanup(srv.Close)
	return srv
}

func TestStatusPrintsJob(t *testing.T) {
	srv := serveStatus(t, http.StatusOK, cannedStatus)
	out, _, err := run(t, "status", "--coordinator", srv.URL+"/")
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("output:\n%s", out)
	for _, want := range []string{
		"0f6c2e1a-7b3d-4c59-9e21-5a8d0b7c4e13", "running",
		"step 12/200", "loss 4.2306", "aux 0.0109", "val 4.4873 (step 10)",
		"tokens/s 1897 last step, 1902 median of the last 12 steps",
		"plan v2: 2 stages, 1 expert host, 0 standby",
		"from step 12, keeping the shards of plan v1 where they were",
		"[0,2)", "[2,4)",
		"w-5c0e8a1f3b72", "w-9d41b7e02c6a", "w-e27f40c9a815",
		"lab-a", "Chrome 131 (macOS)",
		"2s ago", "29s ago", "46.0 MiB",
		"peers: 3 connected",
		"3.5 (claimed 180.2)!", // measured far below its claim
		"vulkan (NVIDIA H200)", // the device a GPU worker computes on
		"e2 15.6% (even 12.5%)", "e1 18.0% (even 12.5%)",
		"job.submitted", "worker.joined",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q", want)
		}
	}
	// One line per plan entry, with its peer: the expert host's line holds its block, experts and peer.
	for _, want := range [][]string{
		{"0", "[0,2)", "w-5c0e8a1f3b72", "lab-a"},
		{"1", "[2,4)", "w-9d41b7e02c6a", "Chrome", "131", "(macOS)"},
		{"0", "3", "4-7", "w-e27f40c9a815", "lab-b"},
	} {
		if !hasLine(out, want) {
			t.Errorf("no line with fields %q", want)
		}
	}
}

// hasLine reports whether some line of out has exactly fields (whitespace-separated).
func hasLine(out string, fields []string) bool {
	for l := range strings.Lines(out) {
		if reflect.DeepEqual(strings.Fields(l), fields) {
			return true
		}
	}
	return false
}

func TestStatusNoJob(t *testing.T) {
	srv := serveStatus(t, http.StatusOK, `{"job": null, "steps": null, "plan": null, "peers": [], "router": null, "events": []}`)
	out, _, err := run(t, "status", "--coordinator", srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out, "no job yet") || !strings.Contains(out, "peers: 0 connected") {
		t.Errorf("got:\n%s\nwant it to say there is no job and no peer", out)
	}
}

// TestStatusRealCoordinator reads a real coordinator's status before any job is submitted.
func TestStatusRealCoordinator(t *testing.T) {
	ctx := context.Background()
	s, err := coordinator.New(ctx, coordinator.Config{DataDir: t.TempDir(), Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	srv := httptest.NewServer(s.Handler())
	t.Cleanup(srv.Close)
	out, _, err := run(t, "status", "--coordinator", strings.TrimPrefix(srv.URL, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out, "no job yet") {
		t.Errorf("got:\n%s\nwant it to say there is no job", out)
	}
}

func TestStatusErrors(t *testing.T) {
	down := httptest.NewServer(http.NotFoundHandler())
	down.Close()
	broken := serveStatus(t, http.StatusInternalServerError, "database is locked\n")
	locked := serveStatus(t, http.StatusUnauthorized, "unauthorized\n")
	notJSON := serveStatus(t, http.StatusOK, "<html>hello</html>")
	for _, tc := range []struct {
		name string
		url  string
		want []string
	}{
		{"unreachable", down.URL, []string{down.URL, "unreachable"}},
		{"500", broken.URL, []string{broken.URL + "/api/status", "500", "database is locked"}},
		{"401", locked.URL, []string{locked.URL + "/api/status", "--admin-token"}},
		{"not JSON", notJSON.URL, []string{notJSON.URL, "Shoal coordinator"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out, _, err := run(t, "status", "--coordinator", tc.url)
			if err == nil {
				t.Fatalf("got no error, output:\n%s", out)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("got error %q, want it to mention %q", err, w)
				}
			}
		})
	}
}

func TestStatusJSON(t *testing.T) {
	srv := serveStatus(t, http.StatusOK, cannedStatus)
	out, _, err := run(t, "status", "--coordinator", srv.URL, "--json")
	if err != nil {
		t.Fatal(err)
	}
	var got, want any
	if err := json.Unmarshal([]byte(out), &got); err != nil {
		t.Fatalf("--json output is not JSON: %v\n%s", err, out)
	}
	if err := json.Unmarshal([]byte(cannedStatus), &want); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("--json output differs from what the coordinator sent:\n%s", out)
	}
	if !strings.Contains(out, "\n  \"job\": {") {
		t.Errorf("--json output is not indented:\n%s", out)
	}
}

// TestStatusMirrorsCoordinator checks that the CLI's copy of the status types knows every field
// coordinator.Status puts on the wire: when this fails, add the field to status.go (and show it).
func TestStatusMirrorsCoordinator(t *testing.T) {
	val := 4.5
	at := cannedNow.Add(-time.Minute)
	st := coordinator.Status{
		Job: &coordinator.JobStatus{ID: "j", State: "running", Step: 1, Steps: 2, Model: "GPT-MoE, 4 blocks",
			Waiting: "stage 2 of 2 (blocks [2,4)) has no worker"},
		Steps: []coordinator.StepStatus{{Step: 0, Loss: 5, Aux: 0.01, ValLoss: &val, TokensPerS: 100}},
		Plan: &coordinator.PlanStatus{Version: 1,
			Stages:      []coordinator.StageStatus{{Blocks: [2]int{0, 2}, Peer: "w-1", PeerName: "a"}},
			ExpertHosts: []coordinator.ExpertStatus{{Block: 1, Experts: []int{0, 1}, Peer: "w-2", PeerName: "b"}},
			Standby:     []string{"w-3"},
			Pools:       []coordinator.PoolStatus{{Blocks: [2]int{0, 2}, Members: []string{"w-1", "w-4"}}},
			TookFrom:    map[string]string{"w-4": "w-1"}},
		Peers: []coordinator.PeerStatus{{ID: "w-1", Kind: "native", Backend: "cpu", GFLOPS: 1,
			Joined: at, LastHeard: at, BytesIn: 1, BytesOut: 2}},
		Router: map[int][]int{1: {3, 4}},
		Events: []coordinator.EventStatus{{ID: 1, Time: at, Kind: "plan", Worker: "w-1", Detail: json.RawMessage(`{"version":1}`)}},
	}
	b, err := json.Marshal(st)
	if err != nil {
		t.Fatal(err)
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	var got statusJSON
	if err := dec.Decode(&got); err != nil {
		t.Fatalf("cmd/shoal/status.go does not mirror coordinator.Status: %v", err)
	}
	var out bytes.Buffer
	if err := writeStatus(&out, &got, cannedNow); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"step 1/2", "model GPT-MoE, 4 blocks", "val 4.5000", "standby: w-3", "1m0s ago", "WAITING: stage 2 of 2 (blocks [2,4)) has no worker",
		"pool of blocks [0,2): w-1, w-4", "w-4 took its stage's state from w-1"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("output lacks %q:\n%s", want, out.String())
		}
	}
}

func TestStatusFormatting(t *testing.T) {
	for _, tc := range []struct {
		name, got, want string
	}{
		{"bytes", humanBytes(512), "512 B"},
		{"KiB", humanBytes(1536), "1.5 KiB"},
		{"GiB", humanBytes(3 << 30), "3.0 GiB"},
		{"ranges", intRanges([]int{8, 0, 1, 2, 3, 6, 9}), "0-3,6,8-9"},
		{"no experts", intRanges(nil), "-"},
		{"busiest", busiest([]int{1, 3}), "e1 75.0% (even 50.0%)"},
		{"no tokens", busiest([]int{0, 0}), "-"},
		{"detail", eventDetail(json.RawMessage(`{"reason":"heartbeat timeout","step":7}`)), `reason="heartbeat timeout" step=7`},
		{"empty detail", eventDetail(json.RawMessage(`{}`)), "-"},
		{"long detail", eventDetail(json.RawMessage(`{"error":"` + strings.Repeat("x", 100) + `"}`)), "error=" + strings.Repeat("x", statusDetailWidth-7) + "…"},
	} {
		if tc.got != tc.want {
			t.Errorf("%s: got %q, want %q", tc.name, tc.got, tc.want)
		}
	}
}

// statusWithPlan is what `shoal status` prints of the canned status with its plan's stages and
// expert hosts replaced by plan (JSON members).
func statusWithPlan(t *testing.T, plan string) string {
	t.Helper()
	body := strings.Replace(cannedStatus, `"stages": [
      {"blocks": [0, 2], "peer": "w-5c0e8a1f3b72", "peer_name": "lab-a"},
      {"blocks": [2, 4], "peer": "w-9d41b7e02c6a", "peer_name": "Chrome 131 (macOS)"}
    ],
    "expert_hosts": [
      {"block": 3, "experts": [4, 5, 6, 7], "peer": "w-e27f40c9a815", "peer_name": "lab-b"}
    ],`, plan, 1)
	if body == cannedStatus {
		t.Fatal("the canned plan did not change")
	}
	srv := serveStatus(t, http.StatusOK, body)
	out, _, err := run(t, "status", "--coordinator", srv.URL+"/")
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// TestStatusPrintsReplicas: a plan of pipeline replicas is shown replica by replica, each stage
// with its replica's micro-batches, and the sync mode.
func TestStatusPrintsReplicas(t *testing.T) {
	out := statusWithPlan(t, `"replicas": 2, "sync": "outer",
    "choice": "2 replicas, outer sync: estimated 14925 tokens/s (44% of it synchronising) against 9717 for one pipeline",
    "stages": [
      {"blocks": [0, 2], "peer": "w-5c0e8a1f3b72", "peer_name": "lab-a", "replica": 0, "micro_batches": [0, 3]},
      {"blocks": [2, 4], "peer": "w-9d41b7e02c6a", "peer_name": "Chrome 131 (macOS)", "replica": 0, "micro_batches": [0, 3]},
      {"blocks": [0, 4], "peer": "w-e27f40c9a815", "peer_name": "lab-b", "replica": 1, "micro_batches": [3, 4]}
    ],
    "expert_hosts": [],`)
	if !strings.Contains(out, "2 pipeline replicas, outer sync") {
		t.Errorf("output lacks the replicas:\n%s", out)
	}
	if !strings.Contains(out, "planner: 2 replicas, outer sync: estimated 14925 tokens/s") {
		t.Errorf("output lacks the planner's choice:\n%s", out)
	}
	for _, want := range [][]string{
		{"0", "[0,3)", "0", "[0,2)", "w-5c0e8a1f3b72", "lab-a"},
		{"0", "[0,3)", "1", "[2,4)", "w-9d41b7e02c6a", "Chrome", "131", "(macOS)"},
		{"1", "[3,4)", "0", "[0,4)", "w-e27f40c9a815", "lab-b"},
	} {
		if !hasLine(out, want) {
			t.Errorf("no line with fields %q:\n%s", want, out)
		}
	}
}

// TestStatusPrintsOwnBatches: outer mode's own batches are said, not left to be guessed from
// micro-batches that overlap.
func TestStatusPrintsOwnBatches(t *testing.T) {
	out := statusWithPlan(t, `"replicas": 2, "sync": "outer", "own_batches": true,
    "stages": [
      {"blocks": [0, 4], "peer": "w-5c0e8a1f3b72", "peer_name": "lab-a", "replica": 0, "micro_batches": [0, 4]},
      {"blocks": [0, 4], "peer": "w-e27f40c9a815", "peer_name": "lab-b", "replica": 1, "micro_batches": [0, 4]}
    ],
    "expert_hosts": [],`)
	if !strings.Contains(out, "2 pipeline replicas, outer sync, a batch of its own for each") {
		t.Errorf("output does not say the replicas train batches of their own:\n%s", out)
	}
	// And an outer step overlapping training (sync.delay) says so.
	out = statusWithPlan(t, `"replicas": 2, "sync": "outer", "delay": 10, "replica_steps": [56, 53],
    "stages": [
      {"blocks": [0, 4], "peer": "w-5c0e8a1f3b72", "peer_name": "lab-a", "replica": 0, "micro_batches": [0, 2]},
      {"blocks": [0, 4], "peer": "w-e27f40c9a815", "peer_name": "lab-b", "replica": 1, "micro_batches": [2, 4]}
    ],
    "expert_hosts": [],`)
	if !strings.Contains(out, "2 pipeline replicas, outer sync, every outer step overlapping 10 inner steps") {
		t.Errorf("output does not say the outer step overlaps training:\n%s", out)
	}
	if !strings.Contains(out, "replicas at step 57, 54") {
		t.Errorf("output does not say where each replica is:\n%s", out)
	}
}

// TestStatusPrintsWarmup: the plan of an outer-mode job's synchronous warm-up says that it runs in
// step mode and from which step outer mode takes over.
func TestStatusPrintsWarmup(t *testing.T) {
	out := statusWithPlan(t, `"replicas": 2, "sync": "step", "warmup_until": 200,
    "stages": [
      {"blocks": [0, 4], "peer": "w-5c0e8a1f3b72", "peer_name": "lab-a", "replica": 0, "micro_batches": [0, 2]},
      {"blocks": [0, 4], "peer": "w-e27f40c9a815", "peer_name": "lab-b", "replica": 1, "micro_batches": [2, 4]}
    ],
    "expert_hosts": [],`)
	if !strings.Contains(out, "2 pipeline replicas, step sync (the synchronous warm-up: outer mode from step 201)") {
		t.Errorf("output does not say the plan is the warm-up:\n%s", out)
	}
}
