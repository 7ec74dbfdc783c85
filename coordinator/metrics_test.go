package coordinator

import (
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil/promlint"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/shoal-ml/shoal/local"
	"github.com/shoal-ml/shoal/proto"
)

// fakeHub stands in for Hub.Workers: the test sets the connected workers between scrapes.
type fakeHub struct {
	mu sync.Mutex
	ws []WorkerInfo
}

func (h *fakeHub) set(ws ...WorkerInfo) {
	h.mu.Lock()
	h.ws = ws
	h.mu.Unlock()
}

func (h *fakeHub) workers() []WorkerInfo {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]WorkerInfo(nil), h.ws...)
}

// scrape GETs /metrics in the text format and returns the body and its parsed families.
func scrape(t *testing.T, h http.Handler) (string, map[string]*dto.MetricFamily) {
	t.Helper()
	srv := httptest.NewServer(h)
	defer srv.Close()
	res, err := http.Get(srv.URL + "/metrics")
	if err != nil {
		t.Fatalf("GET /metrics: %v", err)
	}
	defer res.Body.Close()
	if res.StatusCode != http.StatusOK {
		t.Fatalf("GET /metrics: status %d, want 200", res.StatusCode)
	}
	if ct := res.Header.Get("Content-Type"); !strings.HasPrefix(ct, "text/plain") {
		t.Fatalf("GET /metrics: Content-Type %q, want text/plain", ct)
	}
	var body strings.Builder
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(io.TeeReader(res.Body, &body))
	if err != nil {
		t.Fatalf("parse exposition: %v\n%s", err, body.String())
	}
	return body.String(), fams
}

// value is the value of the series of family name whose labels are exactly labels
// ("k=v" pairs); ok is false when there is no such series.
func value(fams map[string]*dto.MetricFamily, name string, labels ...string) (v float64, ok bool) {
	mf := fams[name]
	if mf == nil {
		return 0, false
	}
	for _, m := range mf.GetMetric() {
		if len(m.GetLabel()) != len(labels) {
			continue
		}
		match := true
		for i, lp := range m.GetLabel() {
			if lp.GetName()+"="+lp.GetValue() != labels[i] {
				match = false
			}
		}
		if !match {
			continue
		}
		switch {
		case m.Gauge != nil:
			return m.Gauge.GetValue(), true
		case m.Counter != nil:
			return m.Counter.GetValue(), true
		case m.Untyped != nil:
			return m.Untyped.GetValue(), true
		}
	}
	return 0, false
}

type series struct {
	name   string
	labels []string
	want   float64 // NaN: the series must be absent
}

func checkSeries(t *testing.T, body string, fams map[string]*dto.MetricFamily, want []series) {
	t.Helper()
	for _, s := range want {
		got, ok := value(fams, s.name, s.labels...)
		switch {
		case math.IsNaN(s.want) && ok:
			t.Errorf("%s%v = %v, want absent", s.name, s.labels, got)
		case !math.IsNaN(s.want) && !ok:
			t.Errorf("%s%v absent, want %v\n%s", s.name, s.labels, s.want, body)
		case !math.IsNaN(s.want) && math.Abs(got-s.want) > 1e-9:
			t.Errorf("%s%v = %v, want %v", s.name, s.labels, got, s.want)
		}
	}
}

func TestMetrics(t *testing.T) {
	t0 := time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)
	now := t0
	hub := &fakeHub{}
	m := newMetrics(hub.workers)
	m.now = func() time.Time { return now }
	h := m.handler()
	absent := math.NaN()

	// Before the first step: counters and peers at zero, nothing made up for what is not known.
	body, fams := scrape(t, h)
	checkSeries(t, body, fams, []series{
		{"shoal_step", nil, 0},
		{"shoal_recoveries_total", nil, 0},
		{"shoal_checkpoints_total", nil, 0},
		{"shoal_tensor_bytes_sent_total", nil, 0},
		{"shoal_peers", []string{"backend=cpu", "kind=native"}, 0},
		{"shoal_peers", []string{"backend=webgpu", "kind=browser"}, 0},
		{"shoal_peer_bytes_total", []string{"direction=in"}, 0},
		{"shoal_validation_loss", nil, absent},
		{"shoal_checkpoint_age_seconds", nil, absent},
	})
	for _, name := range []string{"shoal_step", "shoal_loss", "shoal_aux_loss", "shoal_tokens_per_second",
		"shoal_step_duration_seconds", "shoal_tensor_bytes_sent_total", "shoal_recoveries_total",
		"shoal_checkpoints_total", "shoal_peers", "shoal_peer_bytes_total"} {
		if !strings.Contains(body, "# HELP "+name+" ") || !strings.Contains(body, "# TYPE "+name+" ") {
			t.Errorf("%s has no HELP or TYPE line", name)
		}
	}

	// Two steps, the first evaluated; a recovery between them; a checkpoint.
	m.observeStep(local.Report{Step: 9, Steps: 100, CE: 4.5, Aux: 0.02, ValLoss: 4.75, TokensPerS: 1200, BytesSent: 1 << 20}, 250*time.Millisecond)
	m.recovery()
	m.observeStep(local.Report{Step: 10, Steps: 100, CE: 4.25, Aux: 0.015, ValLoss: math.NaN(), TokensPerS: 1500, BytesSent: 1 << 19}, 1500*time.Millisecond)
	m.checkpointCompleted(t0.Add(-90 * time.Second))
	m.checkpointCompleted(t0.Add(-200 * time.Second)) // reported late: counted, but not the newest

	w1 := WorkerInfo{ID: "w-1f3a", Hello: &proto.Hello{Kind: proto.WorkerNative, Backend: proto.BackendCPU}, Joined: t0.Add(-time.Hour), BytesIn: 100, BytesOut: 1000}
	w2 := WorkerInfo{ID: "w-77c0", Hello: &proto.Hello{Kind: proto.WorkerNative, Backend: proto.BackendCPU}, Joined: t0.Add(-time.Minute), BytesIn: 20, BytesOut: 200}
	w3 := WorkerInfo{ID: "w-b10e", Hello: &proto.Hello{Kind: proto.WorkerBrowser, Backend: proto.BackendWebGPU}, Joined: t0.Add(-time.Second), BytesIn: 3, BytesOut: 30}
	hub.set(w1, w2, w3)

	body, fams = scrape(t, h)
	checkSeries(t, body, fams, []series{
		{"shoal_step", nil, 11},
		{"shoal_loss", nil, 4.25},
		{"shoal_aux_loss", nil, 0.015},
		{"shoal_validation_loss", nil, 4.75}, // kept across the step that did not evaluate
		{"shoal_tokens_per_second", nil, 1500},
		{"shoal_tensor_bytes_sent_total", nil, 1<<20 + 1<<19},
		{"shoal_recoveries_total", nil, 1},
		{"shoal_checkpoints_total", nil, 2},
		{"shoal_checkpoint_age_seconds", nil, 90},
		{"shoal_peers", []string{"backend=cpu", "kind=native"}, 2},
		{"shoal_peers", []string{"backend=webgpu", "kind=native"}, 0},
		{"shoal_peers", []string{"backend=cpu", "kind=browser"}, 0},
		{"shoal_peers", []string{"backend=webgpu", "kind=browser"}, 1},
		{"shoal_peer_bytes_total", []string{"direction=in"}, 123},
		{"shoal_peer_bytes_total", []string{"direction=out"}, 1230},
	})
	hist := fams["shoal_step_duration_seconds"].GetMetric()[0].GetHistogram()
	if got, want := hist.GetSampleCount(), uint64(2); got != want {
		t.Errorf("shoal_step_duration_seconds count = %d, want %d", got, want)
	}
	if got, want := hist.GetSampleSum(), 1.75; math.Abs(got-want) > 1e-9 {
		t.Errorf("shoal_step_duration_seconds sum = %v, want %v", got, want)
	}
	for _, w := range []WorkerInfo{w1, w2, w3} { // /metrics is open: no worker ids
		if strings.Contains(body, w.ID) {
			t.Errorf("exposition names worker %s", w.ID)
		}
	}
	t.Logf("exposition:\n%s", shoalLines(body))

	// The clock moves; w2 leaves and w1 reconnects under its old id with fresh counts. The byte
	// totals must not fall (rate() would read a fall as a counter reset).
	now = t0.Add(time.Minute)
	w1b := w1
	w1b.Joined, w1b.BytesIn, w1b.BytesOut = t0, 5, 50
	w3.BytesIn, w3.BytesOut = 4, 40
	hub.set(w1b, w3)
	body, fams = scrape(t, h)
	checkSeries(t, body, fams, []series{
		{"shoal_checkpoint_age_seconds", nil, 150},
		{"shoal_peers", []string{"backend=cpu", "kind=native"}, 1},
		{"shoal_peers", []string{"backend=webgpu", "kind=browser"}, 1},
		{"shoal_peer_bytes_total", []string{"direction=in"}, 100 + 20 + 5 + 4},
		{"shoal_peer_bytes_total", []string{"direction=out"}, 1000 + 200 + 50 + 40},
	})

	// Everyone gone: the totals stay.
	hub.set()
	body, fams = scrape(t, h)
	checkSeries(t, body, fams, []series{
		{"shoal_peers", []string{"backend=cpu", "kind=native"}, 0},
		{"shoal_peer_bytes_total", []string{"direction=in"}, 129},
		{"shoal_peer_bytes_total", []string{"direction=out"}, 1290},
	})
}

// TestMetricsLint holds the shoal_ series to the Prometheus naming conventions (units in names,
// _total on counters, help on everything) with promlint.
func TestMetricsLint(t *testing.T) {
	m := newMetrics(func() []WorkerInfo { return nil })
	m.observeStep(local.Report{Step: 0, ValLoss: 3}, time.Second)
	m.checkpointCompleted(time.Now())
	mfs, err := m.reg.Gather()
	if err != nil {
		t.Fatalf("gather: %v", err)
	}
	var ours []*dto.MetricFamily
	for _, mf := range mfs {
		if strings.HasPrefix(mf.GetName(), "shoal_") {
			ours = append(ours, mf)
		}
	}
	if len(ours) != 14 {
		t.Errorf("%d shoal_ families, want 14", len(ours))
	}
	problems, err := promlint.NewWithMetricFamilies(ours).Lint()
	if err != nil {
		t.Fatalf("lint: %v", err)
	}
	for _, p := range problems {
		t.Errorf("%s: %s", p.Metric, p.Text)
	}
}

// TestMetricsConcurrent scrapes while the job loop writes; run with -race.
func TestMetricsConcurrent(t *testing.T) {
	hub := &fakeHub{}
	m := newMetrics(hub.workers)
	h := m.handler()
	var wg sync.WaitGroup
	for i := range 4 {
		wg.Go(func() {
			for range 20 {
				rec := httptest.NewRecorder()
				h.ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
				if rec.Code != http.StatusOK {
					t.Errorf("scraper %d: status %d", i, rec.Code)
				}
			}
		})
	}
	for s := range 200 {
		m.observeStep(local.Report{Step: s, CE: 1, ValLoss: math.NaN(), BytesSent: 1}, time.Millisecond)
		hub.set(WorkerInfo{ID: "w", Joined: time.Unix(int64(s/10), 0), BytesIn: int64(s % 10)})
		if s%50 == 0 {
			m.recovery()
			m.checkpointCompleted(time.Now())
		}
	}
	wg.Wait()
	_, fams := scrape(t, h)
	if got, _ := value(fams, "shoal_step"); got != 200 {
		t.Errorf("shoal_step = %v, want 200", got)
	}
}

// shoalLines is the shoal_ part of an exposition, for the test log.
func shoalLines(body string) string {
	var b strings.Builder
	for line := range strings.Lines(body) {
		if strings.Contains(line, "shoal_") {
			b.WriteString(line)
		}
	}
	return b.String()
}
