package coordinator

import (
	"sync"
	"time"
)

// How long a worker is given to upload an audit's evidence. Evidence is as large as two copies of
// the shard's state (82–156 MB per audit on the default job), and volunteers' uplinks go down to
// 10 Mb/s, where one upload takes minutes: a fixed wait would judge slow links as cheaters. So the
// coordinator times the bytes it receives from each worker — its checkpoint shards and its
// earlier evidence, read by paceReader — and gives the evidence evidenceSafety times what the
// slowest of the last uplinkSamples uploads says it takes, never less than evidenceFloor and never
// more than evidenceCeiling. A worker's Hello may claim a bandwidth (proto.Hello.LinkBytesPerS),
// but a claim is not a measurement, and this sets a deadline: a worker that slows its uploads on
// purpose stretches only its own wait, up to the ceiling.
const (
	evidenceSafety  = 4
	evidenceFloor   = 2 * time.Minute
	evidenceCeiling = 30 * time.Minute
	// assumedUplink is the rate, in bytes/s, of a worker not timed yet: the slowest uplink of the
	// fleet mix the scheduler is simulated on (sched/simulate.go, 10 Mb/s).
	assumedUplink = 10e6 / 8
	// uplinkSamples is how many of a worker's uploads are remembered, and minTimedBytes the
	// least an upload must carry to be timed: a short one measures the connection's latency.
	uplinkSamples = 4
	minTimedBytes = 256 << 10
	// maxUplinks bounds the workers remembered; past it the longest unheard is forgotten.
	maxUplinks = 4096
)

// uplinkMeter is what the coordinator measured of each worker's uplink.
type uplinkMeter struct {
	mu sync.Mutex
	by map[string]*uplink
}

type uplink struct {
	rates [uplinkSamples]float64 // bytes/s, a ring
	n     int                    // uploads timed
	at    time.Time              // the last one
}

// record times an upload of n bytes from worker whose bytes took d to arrive.
func (m *uplinkMeter) record(worker string, n int64, d time.Duration) {
	if n < minTimedBytes || d <= 0 {
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.by == nil {
		m.by = map[string]*uplink{}
	}
	u := m.by[worker]
	if u == nil {
		if len(m.by) >= maxUplinks {
			oldest := ""
			for w, o := range m.by {
				if oldest == "" || o.at.Before(m.by[oldest].at) {
					oldest = w
				}
			}
			delete(m.by, oldest)
		}
		u = &uplink{}
		m.by[worker] = u
	}
	u.rates[u.n%uplinkSamples] = float64(n) / d.Seconds()
	u.n++
	u.at = time.Now()
}

// rate is the slowest of worker's last uploads in bytes/s, 0 when none was timed.
func (m *uplinkMeter) rate(worker string) float64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	u := m.by[worker]
	if u == nil {
		return 0
	}
	r := 0.0
	for i := range min(u.n, uplinkSamples) {
		if r == 0 || u.rates[i] < r {
			r = u.rates[i]
		}
	}
	return r
}

// evidenceWait is how long worker is given to upload evidence of up to bytes.
func (s *Server) evidenceWait(worker string, bytes int64) time.Duration {
	rate := s.uplinks.rate(worker)
	if rate <= 0 {
		rate = assumedUplink
	}
	d := time.Duration(evidenceSafety * float64(bytes) / rate * float64(time.Second))
	return min(max(d, evidenceFloor), evidenceCeiling)
}

// How long a plan's workers are given to get Ready: each moves what it loads — its restore's
// blobs from the coordinator, or the state it takes from or gives to its peers — over its link.
// A fixed three minutes held on the default job's loopback tests, but not on a volunteer fleet:
// a stage of the 1B job reads 14 GB from a checkpoint in outer mode (sched.StateBytesPerParam),
// hours over a 10 Mb/s link, and the plan failed at three minutes every time, where the
// simulator charged the load and went on. So the wait is loadSafety times the slowest worker's
// bytes over its measured uplink, never less than loadFloor nor more than loadCeiling. Unlike an
// evidence upload's wait, this one holds every worker of the plan, and a worker's measured rate
// is its own doing (it may have slowed its uploads on purpose): so no rate is taken below the
// fleet mix's slowest (assumedUplink), which is also the rate of a worker not timed yet. A
// worker that stalls is cut by its own transfer's stall timeout (client: download, 2 minutes
// without a byte), and one that vanishes by the heartbeat; this bounds only a load that trickles.
const (
	loadSafety  = 4
	loadFloor   = 3 * time.Minute
	loadCeiling = 12 * time.Hour
)

// loadWait is how long a plan whose workers load bytes (by worker) may take to get Ready.
func (s *Server) loadWait(bytes map[string]int64) time.Duration {
	return s.transferWait(bytes, loadFloor)
}

// transferWait is loadSafety times the longest a worker takes to move its bytes over its uplink
// (measured, and never below assumedUplink), within floor and loadCeiling.
func (s *Server) transferWait(bytes map[string]int64, floor time.Duration) time.Duration {
	d := floor
	for w, n := range bytes {
		rate := max(s.uplinks.rate(w), assumedUplink)
		d = max(d, time.Duration(loadSafety*float64(n)/rate*float64(time.Second)))
	}
	return min(d, loadCeiling)
}
