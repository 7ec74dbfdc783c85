package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"time"
)

// A worker's resource policy: when a volunteer's machine may compute for the job (`shoal worker
// --pause-on-battery`, `--pause-when-busy`, `--schedule`). decide is the rule, a pure function of
// the time and what was read of the machine; sampler reads the machine; monitor runs the two and
// says when the verdict changes. A pause is a leave at the job's next step boundary (what the
// first SIGTERM does) and the worker stays away, disconnected, until the condition clears.

// workerPolicy is what the volunteer asked for. Its zero value never pauses.
type workerPolicy struct {
	onBattery bool     // pause while on battery power
	busyPct   float64  // pause while other processes use more than this share of the CPUs (0: never)
	schedule  schedule // run only within these windows of local time (nil: any time)
}

func (p workerPolicy) active() bool {
	return p.onBattery || p.busyPct > 0 || len(p.schedule) > 0
}

// readings is what the sampler read of the machine.
type readings struct {
	// OnBattery: the machine runs on battery (a battery discharging, or no mains supply online).
	OnBattery bool
	// Busy is the share of all CPUs, in percent, that other processes than this one used over
	// the sampler's window; < 0 when not known yet (the window has not filled).
	Busy float64
}

// verdict is decide's answer: run, or pause for reason.
type verdict struct {
	pause  bool
	reason string
}

func (v verdict) String() string {
	if !v.pause {
		return "run"
	}
	return "pause: " + v.reason
}

// decide says whether the worker may compute at now (local time) given r. The reasons are for
// the volunteer's log: they say which condition holds.
func (p workerPolicy) decide(now time.Time, r readings) verdict {
	var why []string
	if len(p.schedule) > 0 && !p.schedule.contains(now) {
		why = append(why, fmt.Sprintf("outside --schedule %s (now %s)", p.schedule, now.Format("15:04")))
	}
	if p.onBattery && r.OnBattery {
		why = append(why, "on battery power")
	}
	if p.busyPct > 0 && r.Busy >= 0 && r.Busy > p.busyPct {
		why = append(why, fmt.Sprintf("other processes use %.0f%% of the CPUs (--pause-when-busy %g)", r.Busy, p.busyPct))
	}
	if len(why) == 0 {
		return verdict{}
	}
	return verdict{pause: true, reason: strings.Join(why, "; ")}
}

// window is a span of local time of day, in minutes since midnight: [from, to), crossing
// midnight when to < from.
type window struct{ from, to int }

// schedule is the windows the worker may run in (--schedule 22:00-07:00,12:00-13:30).
type schedule []window

func (s schedule) contains(t time.Time) bool {
	m := t.Hour()*60 + t.Minute()
	for _, w := range s {
		if w.from < w.to && m >= w.from && m < w.to || w.from > w.to && (m >= w.from || m < w.to) {
			return true
		}
	}
	return false
}

func (s schedule) String() string {
	var b strings.Builder
	for i, w := range s {
		if i > 0 {
			b.WriteByte(',')
		}
		fmt.Fprintf(&b, "%02d:%02d-%02d:%02d", w.from/60, w.from%60, w.to/60, w.to%60)
	}
	return b.String()
}

// parseSchedule reads comma-separated windows HH:MM-HH:MM of local time ("22:00-07:00" runs from
// ten at night to seven in the morning). A window may end at 24:00; an empty one (from = to)
// is refused, as it says either nothing or all day.
func parseSchedule(s string) (schedule, error) {
	var out schedule
	for _, part := range strings.Split(s, ",") {
		part = strings.TrimSpace(part)
		a, b, ok := strings.Cut(part, "-")
		if !ok {
			return nil, fmt.Errorf("%q: want windows of local time such as 22:00-07:00 (several separated by commas)", s)
		}
		from, err := parseClock(a, false)
		if err != nil {
			return nil, fmt.Errorf("%q: %w", s, err)
		}
		to, err := parseClock(b, true)
		if err != nil {
			return nil, fmt.Errorf("%q: %w", s, err)
		}
		if from == to || from == 0 && to == 24*60 {
			return nil, fmt.Errorf("%q: the window %s is empty or the whole day (to run at any time, give no --schedule)", s, part)
		}
		out = append(out, window{from, to % (24 * 60)})
	}
	return out, nil
}

// parseClock reads HH:MM (24-hour; 24:00 only when end is set) as minutes since midnight.
func parseClock(s string, end bool) (int, error) {
	s = strings.TrimSpace(s)
	h, m, ok := strings.Cut(s, ":")
	hh, err1 := strconv.Atoi(h)
	mm, err2 := strconv.Atoi(m)
	switch {
	case !ok || err1 != nil || err2 != nil || len(m) != 2 || len(h) < 1 || len(h) > 2:
		return 0, fmt.Errorf("%q is not a time of day HH:MM", s)
	case hh == 24 && mm == 0 && end:
		return 24 * 60, nil
	case hh < 0 || hh > 23 || mm < 0 || mm > 59:
		return 0, fmt.Errorf("%q is not a time of day (00:00 to 23:59)", s)
	}
	return hh*60 + mm, nil
}

// scheduleFlag is --schedule as a flag.Value.
type scheduleFlag struct{ s schedule }

func (f *scheduleFlag) String() string {
	if f == nil {
		return ""
	}
	return f.s.String()
}

func (f *scheduleFlag) Set(v string) error {
	s, err := parseSchedule(v)
	if err != nil {
		return err
	}
	f.s = s
	return nil
}

// percentFlag is --pause-when-busy: a share of the CPUs in percent, (0, 100].
type percentFlag float64

func (p *percentFlag) String() string { return strconv.FormatFloat(float64(*p), 'g', -1, 64) }

func (p *percentFlag) Set(v string) error {
	f, err := strconv.ParseFloat(strings.TrimSuffix(strings.TrimSpace(v), "%"), 64)
	if err != nil || !(f > 0 && f < 100) {
		return fmt.Errorf("%q: want a percentage of all CPUs between 0 and 100, such as 50", v)
	}
	*p = percentFlag(f)
	return nil
}

// powerSupplyEnv names the directory of power supplies the battery check reads instead of
// /sys/class/power_supply: a machine whose supplies are elsewhere (a container with /sys mounted
// under another path), and tests, which write one.
const powerSupplyEnv = "SHOAL_POWER_SUPPLY_DIR"

// onBattery reads the Linux power supply class under dir: the machine is on battery when a
// battery says it is discharging, or when it has a battery and mains supplies none of which is
// online. A machine without a battery never is.
func onBattery(dir string) (bool, error) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return false, err
	}
	read := func(name, file string) string {
		b, _ := os.ReadFile(filepath.Join(dir, name, file))
		return string(bytes.TrimSpace(b))
	}
	battery, mains, online := false, false, false
	for _, e := range ents {
		switch read(e.Name(), "type") {
		case "Battery":
			battery = true
			if read(e.Name(), "status") == "Discharging" {
				return true, nil
			}
		case "Mains", "USB", "USB_C", "USB_PD":
			mains = true
			online = online || read(e.Name(), "online") == "1"
		}
	}
	return battery && mains && !online, nil
}

// cpuSample is one reading of /proc/stat's and /proc/self/stat's clock ticks.
type cpuSample struct {
	at          time.Time
	total, idle uint64 // all CPUs
	self        uint64 // this process, user and system
}

// readCPU reads the ticks of all CPUs (/proc/stat's cpu line: idle and iowait are idle) and of
// this process (/proc/self/stat's utime and stime), both in USER_HZ.
func readCPU(now time.Time) (cpuSample, error) {
	s := cpuSample{at: now}
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return s, err
	}
	line, _, _ := bytes.Cut(b, []byte("\n"))
	f := strings.Fields(string(line))
	if len(f) < 5 || f[0] != "cpu" {
		return s, errors.New("/proc/stat: no cpu line")
	}
	// user nice system idle iowait irq softirq steal; guest time is within user already.
	for i, v := range f[1:min(len(f), 9)] {
		n, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			return s, fmt.Errorf("/proc/stat: %w", err)
		}
		s.total += n
		if i == 3 || i == 4 {
			s.idle += n
		}
	}
	b, err = os.ReadFile("/proc/self/stat")
	if err != nil {
		return s, err
	}
	// pid (comm) state ...: comm may hold spaces; utime and stime are fields 14 and 15.
	g := strings.Fields(string(b[bytes.LastIndexByte(b, ')')+1:]))
	if len(g) < 13 {
		return s, errors.New("/proc/self/stat: too short")
	}
	for _, v := range g[11:13] {
		n, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			return s, fmt.Errorf("/proc/self/stat: %w", err)
		}
		s.self += n
	}
	return s, nil
}

// othersBusy is the percentage of all CPUs that processes other than this one used between a
// and b.
func othersBusy(a, b cpuSample) float64 {
	if b.total <= a.total {
		return -1
	}
	total := float64(b.total - a.total)
	busy := float64(b.total-a.total) - float64(b.idle-a.idle) - float64(b.self-a.self)
	return min(max(busy/total*100, 0), 100)
}

// busyWindow is how long the CPU is watched before it counts as busy or idle: long enough that a
// compile or a page load does not pause the worker (a pause costs the job a replan), short enough
// that a volunteer's game gets the machine soon.
const busyWindow = time.Minute

// sampler reads the machine for a policy.
type sampler struct {
	pol        workerPolicy
	powerDir   string
	readCPU    func(time.Time) (cpuSample, error)
	cpu        []cpuSample // within busyWindow, oldest first
	warnedOnce map[string]bool
	log        *slog.Logger
}

func newSampler(pol workerPolicy, log *slog.Logger) *sampler {
	dir := os.Getenv(powerSupplyEnv)
	if dir == "" {
		dir = "/sys/class/power_supply"
	}
	return &sampler{pol: pol, powerDir: dir, readCPU: readCPU, warnedOnce: map[string]bool{}, log: log}
}

// unsupported is the policy's conditions this OS cannot read, which the worker says and ignores.
func unsupported(pol workerPolicy) []string {
	if runtime.GOOS == "linux" {
		return nil
	}
	var out []string
	if pol.onBattery {
		out = append(out, "--pause-on-battery")
	}
	if pol.busyPct > 0 {
		out = append(out, "--pause-when-busy")
	}
	return out
}

func (s *sampler) warn(what string, err error) {
	if !s.warnedOnce[what] {
		s.warnedOnce[what] = true
		s.log.Warn("resource policy: cannot read "+what+"; that condition is ignored", "err", err)
	}
}

// read samples the machine at now; cpu says whether to take a CPU sample (the ticker's reads,
// evenly spaced; a step's nudge reuses the last).
func (s *sampler) read(now time.Time, cpu bool) readings {
	r := readings{Busy: -1}
	if runtime.GOOS != "linux" {
		return r
	}
	if s.pol.onBattery {
		b, err := onBattery(s.powerDir)
		if err != nil {
			s.warn(s.powerDir, err)
		}
		r.OnBattery = b
	}
	if s.pol.busyPct > 0 {
		if cpu {
			c, err := s.readCPU(now)
			if err != nil {
				s.warn("/proc/stat", err)
			} else {
				s.cpu = append(s.cpu, c)
				for len(s.cpu) > 2 && c.at.Sub(s.cpu[1].at) >= busyWindow {
					s.cpu = s.cpu[1:]
				}
			}
		}
		if n := len(s.cpu); n >= 2 && s.cpu[n-1].at.Sub(s.cpu[0].at) >= busyWindow/2 {
			r.Busy = othersBusy(s.cpu[0], s.cpu[n-1])
		}
	}
	return r
}

// policyEvery is how often the monitor reads the machine between steps.
const policyEvery = 2 * time.Second

// monitor evaluates a policy every policyEvery and whenever nudged (at each step the worker
// computes, so that a pause is noticed before the next one), and publishes the verdict.
type monitor struct {
	pol    workerPolicy
	s      *sampler
	nudges chan struct{}
	now    func() time.Time

	mu      sync.Mutex
	v       verdict
	changed chan struct{} // closed and replaced when v changes
}

// newMonitor reads the machine at once, so that the first verdict is known before the worker
// joins. now is the clock the schedule is read on (time.Now; a test's own).
func newMonitor(pol workerPolicy, log *slog.Logger, now func() time.Time) *monitor {
	m := &monitor{pol: pol, s: newSampler(pol, log), nudges: make(chan struct{}, 1), now: now, changed: make(chan struct{})}
	m.v = pol.decide(m.now(), m.s.read(m.now(), true))
	return m
}

// nudge asks for an evaluation now; it never blocks.
func (m *monitor) nudge() {
	select {
	case m.nudges <- struct{}{}:
	default:
	}
}

// current returns the verdict and a channel closed when it changes.
func (m *monitor) current() (verdict, <-chan struct{}) {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.v, m.changed
}

func (m *monitor) run(ctx context.Context) {
	tick := time.NewTicker(policyEvery)
	defer tick.Stop()
	for {
		cpu := false
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
			cpu = true
		case <-m.nudges:
		}
		now := m.now()
		v := m.pol.decide(now, m.s.read(now, cpu))
		m.mu.Lock()
		if v.pause != m.v.pause {
			m.v = v
			close(m.changed)
			m.changed = make(chan struct{})
		}
		m.mu.Unlock()
	}
}

// await waits until the verdict is want (pause or not) and returns it; ok is false when ctx
// ended first.
func (m *monitor) await(ctx context.Context, pause bool, also <-chan struct{}) (verdict, bool) {
	for {
		v, ch := m.current()
		if v.pause == pause {
			return v, true
		}
		select {
		case <-ctx.Done():
			return v, false
		case <-also:
			return v, false
		case <-ch:
		}
	}
}
