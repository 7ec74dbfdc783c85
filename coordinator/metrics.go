package coordinator

import (
	"math"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/shoal-ml/shoal/local"
	"github.com/shoal-ml/shoal/proto"
)

// metrics are the coordinator's Prometheus instruments, served at /metrics (issue 9 item 6).
//
// They live in a registry of their own rather than prometheus.DefaultRegisterer, so that several
// coordinators in one process (tests, `shoal train --workers`) never collide and nothing else in
// the binary leaks into the exposition. The job loop writes (observeStep, recovery,
// checkpointCompleted); scrapes read. Every instrument is safe for that, and what is derived at
// scrape time (peers, peer bytes, checkpoint age, validation loss) is read from atomics or from
// the workers func, so the job loop never waits on a scrape.
//
// Nothing here is secret — no tokens, ids or addresses, only counts and losses — which is why
// /metrics needs no admin token (issue 9 item 3).
type metrics struct {
	reg *prometheus.Registry
	// now is the clock checkpoint age is measured on; tests replace it.
	now func() time.Time

	step         prometheus.Gauge
	loss         prometheus.Gauge
	aux          prometheus.Gauge
	tokensPerS   prometheus.Gauge
	stepDuration prometheus.Histogram
	bytesSent    prometheus.Counter
	recoveries   prometheus.Counter
	checkpoints  prometheus.Counter

	// blobBytes counts the bytes of checkpoint blobs served at /blobs (restores, the admin's
	// downloads): what a replan moves out of the coordinator.
	blobBytes atomic.Int64
	// evidenceBytes counts the bytes of audit evidence received whole (POST /api/audits/ID): what
	// verification costs the workers' uplinks.
	evidenceBytes atomic.Int64

	// valLoss holds the bits of the last validation loss; NaN until the first one.
	valLoss atomic.Uint64
	// lastCheckpoint is the completion time of the newest checkpoint in Unix nanoseconds; 0 until
	// the first one.
	lastCheckpoint atomic.Int64
}

// Descriptions of the series computed at scrape time by scrapeCollector.
var (
	peersDesc = prometheus.NewDesc("shoal_peers",
		"Workers connected to the coordinator, by kind (native, browser) and compute backend (cpu, webgpu).",
		[]string{"kind", "backend"}, nil)
	peerBytesDesc = prometheus.NewDesc("shoal_peer_bytes_total",
		"Control-connection payload bytes exchanged with workers, seen from the coordinator: in is read from workers, out is written to them.",
		[]string{"direction"}, nil)
	checkpointAgeDesc = prometheus.NewDesc("shoal_checkpoint_age_seconds",
		"Seconds since the newest checkpoint completed; absent until one has.",
		nil, nil)
	valLossDesc = prometheus.NewDesc("shoal_validation_loss",
		"Cross-entropy on the validation split at the last evaluation; absent until the first.",
		nil, nil)
)

// newMetrics builds the instruments and their registry. workers is the hub's snapshot
// (Hub.Workers); it is called on every scrape, never in between.
func newMetrics(workers func() []WorkerInfo) *metrics {
	m := &metrics{
		reg: prometheus.NewRegistry(),
		now: time.Now,
		step: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "shoal_step", Help: "Training steps completed by the running job.",
		}),
		loss: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "shoal_loss", Help: "Training cross-entropy of the last step (without the auxiliary loss).",
		}),
		aux: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "shoal_aux_loss", Help: "Mixture-of-experts load-balancing loss of the last step (Switch Transformer, Fedus et al. 2021, eq. 4).",
		}),
		tokensPerS: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "shoal_tokens_per_second", Help: "Training throughput of the last step, in tokens per second.",
		}),
		stepDuration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "shoal_step_duration_seconds",
			Help: "Wall-clock time of a training step at the coordinator, tokens out to clip factor back.",
			// Steps range from tens of milliseconds (a tiny model on one machine) to minutes (a
			// pipeline of browsers over home links): 50 ms to about 7 min, doubling.
			Buckets: prometheus.ExponentialBuckets(0.05, 2, 14),
			// Scrapers that negotiate protobuf also get a native histogram, whose resolution
			// does not depend on guessing that range.
			NativeHistogramBucketFactor:    1.1,
			NativeHistogramMaxBucketNumber: 160,
		}),
		bytesSent: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "shoal_tensor_bytes_sent_total", Help: "Tensor payload bytes workers sent to each other (activations, gradients, expert traffic), as they report them.",
		}),
		recoveries: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "shoal_recoveries_total", Help: "Steps abandoned after a lost or failed peer and recovered from the newest complete checkpoint.",
		}),
		checkpoints: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "shoal_checkpoints_total", Help: "Checkpoints completed (every shard stored).",
		}),
	}
	m.valLoss.Store(math.Float64bits(math.NaN()))
	blobBytes := prometheus.NewCounterFunc(prometheus.CounterOpts{
		Name: "shoal_blob_bytes_served_total", Help: "Bytes of checkpoint blobs served at /blobs: the shards workers restore from, and the admin's downloads.",
	}, func() float64 { return float64(m.blobBytes.Load()) })
	evidenceBytes := prometheus.NewCounterFunc(prometheus.CounterOpts{
		Name: "shoal_audit_evidence_bytes_total", Help: "Bytes of audit evidence workers uploaded and the coordinator read whole.",
	}, func() float64 { return float64(m.evidenceBytes.Load()) })
	m.reg.MustRegister(
		m.step, m.loss, m.aux, m.tokensPerS, m.stepDuration, m.bytesSent, m.recoveries, m.checkpoints, blobBytes, evidenceBytes,
		&scrapeCollector{m: m, workers: workers},
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
	)
	return m
}

// handler serves the registry in the Prometheus exposition formats. One failing collector does
// not blank the page: the rest is served and the error counted in promhttp_metric_handler_errors_total.
func (m *metrics) handler() http.Handler {
	return promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{
		Registry:          m.reg,
		ErrorHandling:     promhttp.ContinueOnError,
		EnableOpenMetrics: true,
	})
}

// observeStep records a completed step; took is its wall-clock duration (step.go's dt). A NaN
// r.ValLoss (not evaluated this step) leaves the last validation loss in place; a non-positive
// took is not observed.
func (m *metrics) observeStep(r local.Report, took time.Duration) {
	m.step.Set(float64(r.Step + 1))
	m.loss.Set(r.CE)
	m.aux.Set(r.Aux)
	m.tokensPerS.Set(r.TokensPerS)
	if !math.IsNaN(r.ValLoss) {
		m.valLoss.Store(math.Float64bits(r.ValLoss))
	}
	if took > 0 {
		m.stepDuration.Observe(took.Seconds())
	}
	if r.BytesSent > 0 {
		m.bytesSent.Add(float64(r.BytesSent))
	}
}

// recovery counts a step abandoned and recovered from.
func (m *metrics) recovery() { m.recoveries.Inc() }

// checkpointCompleted counts a complete checkpoint and restarts the age clock at at. An older
// completion reported late does not make the newest checkpoint look older.
func (m *metrics) checkpointCompleted(at time.Time) {
	m.checkpoints.Inc()
	ns := at.UnixNano()
	for {
		old := m.lastCheckpoint.Load()
		if ns <= old || m.lastCheckpoint.CompareAndSwap(old, ns) {
			return
		}
	}
}

// scrapeCollector computes the series that are a function of the moment of the scrape: the
// connected peers (read from the hub on Collect, so the count is never stale), the checkpoint
// age, and the validation loss, which is absent rather than 0 until the first evaluation so that
// a chart does not start with a fake drop.
type scrapeCollector struct {
	m       *metrics
	workers func() []WorkerInfo

	// The hub's byte counts are per connection and die with it, so their plain sum would fall
	// whenever a worker leaves, and rate() would read the fall as a counter reset (a spike). To
	// keep shoal_peer_bytes_total monotonic the collector remembers each connection's counts at
	// the last scrape and, when the connection is gone, folds them into gone. Bytes a worker
	// moved between the last scrape and its departure are not counted.
	//
	// mu serialises Collect (two scrapers may overlap) from the snapshot on, so that snapshots
	// are folded in the order they were taken.
	mu   sync.Mutex
	seen map[peerConn][2]int64
	gone [2]int64 // in, out
}

// peerConn names one connection: a worker that reconnects under its old id starts new counts.
type peerConn struct {
	id     string
	joined int64 // Unix nanoseconds
}

func (c *scrapeCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- peersDesc
	ch <- peerBytesDesc
	ch <- checkpointAgeDesc
	ch <- valLossDesc
}

// peerKinds are reported even at zero, so that a dashboard shows "0 browsers", not a gap.
var peerKinds = [...][2]string{
	{string(proto.WorkerNative), string(proto.BackendCPU)},
	{string(proto.WorkerNative), string(proto.BackendWebGPU)},
	{string(proto.WorkerNative), string(proto.BackendVulkan)},
	{string(proto.WorkerBrowser), string(proto.BackendCPU)},
	{string(proto.WorkerBrowser), string(proto.BackendWebGPU)},
}

func (c *scrapeCollector) Collect(ch chan<- prometheus.Metric) {
	c.mu.Lock()
	ws := c.workers()
	in, out := c.peerBytes(ws)
	c.mu.Unlock()

	counts := make(map[[2]string]int, len(peerKinds))
	for _, k := range peerKinds {
		counts[k] = 0
	}
	for _, w := range ws {
		k := [2]string{"unknown", "unknown"}
		if w.Hello != nil {
			k = [2]string{string(w.Hello.Kind), string(w.Hello.Backend)}
		}
		counts[k]++
	}
	for k, n := range counts {
		ch <- prometheus.MustNewConstMetric(peersDesc, prometheus.GaugeValue, float64(n), k[0], k[1])
	}

	ch <- prometheus.MustNewConstMetric(peerBytesDesc, prometheus.CounterValue, float64(in), "in")
	ch <- prometheus.MustNewConstMetric(peerBytesDesc, prometheus.CounterValue, float64(out), "out")

	if ns := c.m.lastCheckpoint.Load(); ns != 0 {
		age := c.m.now().Sub(time.Unix(0, ns)).Seconds()
		ch <- prometheus.MustNewConstMetric(checkpointAgeDesc, prometheus.GaugeValue, max(age, 0))
	}
	if v := math.Float64frombits(c.m.valLoss.Load()); !math.IsNaN(v) {
		ch <- prometheus.MustNewConstMetric(valLossDesc, prometheus.GaugeValue, v)
	}
}

// peerBytes is the monotonic total of bytes read from and written to workers, connected or gone,
// given the hub's newest snapshot ws. c.mu is held.
func (c *scrapeCollector) peerBytes(ws []WorkerInfo) (in, out int64) {
	now := make(map[peerConn][2]int64, len(ws))
	for _, w := range ws {
		now[peerConn{w.ID, w.Joined.UnixNano()}] = [2]int64{w.BytesIn, w.BytesOut}
	}
	for k, b := range c.seen {
		if _, ok := now[k]; !ok {
			c.gone[0] += b[0]
			c.gone[1] += b[1]
		}
	}
	c.seen = now
	in, out = c.gone[0], c.gone[1]
	for _, b := range now {
		in += b[0]
		out += b[1]
	}
	return in, out
}

// addTURN exposes the embedded TURN server's figures: its open relays and the bytes they sent.
func (m *metrics) addTURN(t *turnServer) {
	m.reg.MustRegister(
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "shoal_turn_allocations",
			Help: "Relays open on the coordinator's TURN server (shoal serve --turn)."},
			func() float64 { return float64(t.allocations()) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "shoal_turn_relayed_bytes_total",
			Help: "Bytes the coordinator's TURN relays sent on to peers."},
			func() float64 { return float64(t.relayed.Load()) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "shoal_turn_refused_total",
			Help: "TURN requests refused for a bad, expired or revoked credential."},
			func() float64 { return float64(t.refused.Load()) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "shoal_turn_dropped_packets_total",
			Help: "Packets the TURN relays dropped past a worker's bandwidth allowance."},
			func() float64 { return float64(t.dropped.Load()) }),
	)
}
