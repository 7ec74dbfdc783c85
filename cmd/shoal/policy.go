package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"time"
)

// A worker's resource policy: when a volunteer's machine may compute for the job (`shoal worker
// --pause-on-battery`, `--pause-when-busy`, `--pause-when-gpu-busy`, `--schedule`). decide is the
// rule, a pure function of the time, what was read of the machine and the state it returned last
// (the hysteresis); sampler reads the machine; monitor runs the two and says when the verdict
// changes. A pause is a leave at the job's next step boundary (what the first SIGTERM does) and
// the worker stays away, disconnected, until the condition has cleared for long enough that it
// will not leave again at once (minPause, resumeBelow).

// workerPolicy is what the volunteer asked for. Its zero value never pauses.
type workerPolicy struct {
	onBattery  bool     // pause while on battery power
	busyPct    float64  // pause while other processes use more than this share of the CPUs (0: never)
	gpuBusyPct float64  // pause while other work keeps the GPU busier than this, in percent (0: never)
	schedule   schedule // run only within these windows of local time (nil: any time)
}

func (p workerPolicy) active() bool {
	return p.onBattery || p.busyPct > 0 || p.gpuBusyPct > 0 || len(p.schedule) > 0
}

// readings is what the sampler read of the machine.
type readings struct {
	// OnBattery: the machine runs on battery (a battery discharging, or no mains supply online).
	OnBattery bool
	// Busy is the share of all CPUs, in percent, that other processes than this one used over
	// the sampler's window; < 0 when not known yet (the window has not filled).
	Busy float64
	// GPUBusy is the utilisation of the busiest GPU, in percent, averaged over the readings of
	// the sampler's window that were taken while this worker's own device was quiet (so it is
	// other work's); < 0 when not known.
	GPUBusy float64
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

// minPause is the shortest pause for any reason but the schedule. Each pause is a leave that
// costs the job a reshare or a checkpoint and each return a replan, so a condition that comes and
// goes (a laptop's charger plugged in and out, a load around the threshold) must not make the
// worker come and go as often. The schedule needs none: its windows are minutes long at least and
// say exactly when to return. (A var only so that the worker processes the tests start can
// shorten it: see policy_test.go's init.)
var minPause = 2 * time.Minute

// resumeBelow is the load under which a busy pause may end: 10 points under the threshold, or
// half the threshold when that is less (a threshold of 10 resumes under 5, not never). A load
// hovering around the threshold then pauses the worker once, rather than on every reading above
// it and back on every one below.
func resumeBelow(pct float64) float64 { return pct - min(10, pct/2) }

// busyLatch is one busy condition's hysteresis: on when the load goes over the threshold, off
// only when it has stayed under resumeBelow for a whole busyWindow.
type busyLatch struct {
	on        bool
	calmSince time.Time // since when the load has been under resumeBelow (zero: it is not)
}

// next is the latch after a reading of load (< 0: not known, which is not calm) at now.
func (l busyLatch) next(now time.Time, load, pct float64) busyLatch {
	switch {
	case pct <= 0:
		return busyLatch{}
	case load > pct:
		return busyLatch{on: true}
	case !l.on:
		return l
	case load < 0 || load >= resumeBelow(pct):
		return busyLatch{on: true}
	case l.calmSince.IsZero():
		return busyLatch{on: true, calmSince: now}
	case now.Sub(l.calmSince) >= busyWindow:
		return busyLatch{}
	}
	return l
}

// policyState is what decide remembers from one call to the next; its zero value is a worker
// that is running.
type policyState struct {
	paused   bool
	pausedAt time.Time // when the pause began
	minHold  bool      // a condition other than the schedule held during this pause: it lasts minPause
	cpu, gpu busyLatch
}

// decide says whether the worker may compute at now (local time) given r and the state the
// last call returned, and returns the state for the next. The reasons are for the volunteer's
// log: they say which condition holds.
func (p workerPolicy) decide(now time.Time, r readings, st policyState) (verdict, policyState) {
	var why []string
	outside := len(p.schedule) > 0 && !p.schedule.contains(now)
	if outside {
		why = append(why, fmt.Sprintf("outside --schedule %s (now %s)", p.schedule, now.Format("15:04")))
	}
	other := false
	if p.onBattery && r.OnBattery {
		why, other = append(why, "on battery power"), true
	}
	st.cpu = st.cpu.next(now, r.Busy, p.busyPct)
	if st.cpu.on {
		why, other = append(why, busyReason("other processes use %.0f%% of the CPUs (--pause-when-busy %g)", "other processes used more than %g%% of the CPUs (--pause-when-busy)", r.Busy, p.busyPct)), true
	}
	st.gpu = st.gpu.next(now, r.GPUBusy, p.gpuBusyPct)
	if st.gpu.on {
		why, other = append(why, busyReason("other work keeps the GPU %.0f%% busy (--pause-when-gpu-busy %g)", "other work kept the GPU more than %g%% busy (--pause-when-gpu-busy)", r.GPUBusy, p.gpuBusyPct)), true
	}
	switch {
	case len(why) > 0:
		if !st.paused {
			st.paused, st.pausedAt, st.minHold = true, now, false
		}
		st.minHold = st.minHold || other
		return verdict{pause: true, reason: strings.Join(why, "; ")}, st
	case st.paused && st.minHold && now.Sub(st.pausedAt) < minPause:
		return verdict{pause: true, reason: fmt.Sprintf("the conditions cleared; staying paused for the minimum pause of %v", minPause)}, st
	}
	st.paused, st.pausedAt, st.minHold = false, time.Time{}, false
	return verdict{}, st
}

// busyReason says why a busy latch holds: the load over the threshold (over, with the load and
// the threshold), or not yet calm for long enough to resume (held, with the threshold).
func busyReason(over, held string, load, pct float64) string {
	if load > pct {
		return fmt.Sprintf(over, load, pct)
	}
	return fmt.Sprintf(held, pct) + fmt.Sprintf("; resuming once under %g%% for %v", resumeBelow(pct), busyWindow)
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

// percentFlag is --pause-when-busy: a share of the CPUs in percent, (0, 100).
type percentFlag float64

func (p *percentFlag) String() string { return strconv.FormatFloat(float64(*p), 'g', -1, 64) }

func (p *percentFlag) Set(v string) error {
	f, err := parsePercent(v, "all CPUs")
	if err != nil {
		return err
	}
	*p = percentFlag(f)
	return nil
}

// gpuPercentFlag is --pause-when-gpu-busy: the GPU's utilisation in percent, (0, 100).
type gpuPercentFlag float64

func (p *gpuPercentFlag) String() string { return strconv.FormatFloat(float64(*p), 'g', -1, 64) }

func (p *gpuPercentFlag) Set(v string) error {
	f, err := parsePercent(v, "the GPU's time")
	if err != nil {
		return err
	}
	*p = gpuPercentFlag(f)
	return nil
}

// parsePercent reads a threshold such as 50 or 50%: 0 would pause at any load and 100 never.
func parsePercent(v, of string) (float64, error) {
	f, err := strconv.ParseFloat(strings.TrimSuffix(strings.TrimSpace(v), "%"), 64)
	if err != nil || !(f > 0 && f < 100) {
		return 0, fmt.Errorf("%q: want a percentage of %s between 0 and 100, such as 50", v, of)
	}
	return f, nil
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

// gpuBusyFile is where Linux's DRM drivers that measure it (amdgpu; others where present) show
// a GPU's utilisation in percent, under the sysfs root, for each card*.
const gpuBusyFile = "device/gpu_busy_percent"

// nvidiaSMITimeout bounds one nvidia-smi run: it answers in well under a second, but a driver
// in trouble can make it hang, and the monitor must go on.
const nvidiaSMITimeout = 2 * time.Second

// gpuQuiet is how long this worker's own device must have had no work before and during a GPU
// reading for the reading to count as other work's: longer than what nvidia-smi's utilisation
// averages over (a sample period of 1/6 s to 1 s) and amdgpu's gpu_busy_percent (shorter).
const gpuQuiet = time.Second

// gpuSources lists where GPU utilisation can be read on this machine: each card's gpu_busy_percent
// under sysfs, and nvidia-smi when smi (its path) is set. None: --pause-when-gpu-busy cannot work.
func gpuSources(sysfs, smi string) []string {
	var out []string
	for _, f := range gpuBusyFiles(sysfs) {
		if _, err := os.Stat(f); err == nil {
			out = append(out, f)
		}
	}
	if smi != "" {
		out = append(out, smi)
	}
	return out
}

// gpuBusyFiles is each DRM card's gpu_busy_percent under sysfs: card0, card1 and so on, not their
// connectors (card0-DP-1), which are the same GPU.
func gpuBusyFiles(sysfs string) []string {
	ents, _ := os.ReadDir(filepath.Join(sysfs, "class", "drm"))
	var out []string
	for _, e := range ents {
		n, ok := strings.CutPrefix(e.Name(), "card")
		if _, err := strconv.ParseUint(n, 10, 32); ok && err == nil {
			out = append(out, filepath.Join(sysfs, "class", "drm", e.Name(), gpuBusyFile))
		}
	}
	return out
}

// readGPUBusy reads the utilisation of the busiest GPU in percent: each card's gpu_busy_percent
// under sysfs and, when smi is set, each of nvidia-smi's GPUs. Which of several GPUs is the
// worker's own cannot be told without cgo (Vulkan's device index follows neither DRM's card
// numbers nor nvidia-smi's order), so the busiest stands for it: a GPU the volunteer uses pauses
// the worker whichever GPU it computes on. The result is < 0 when no GPU answered; err says what
// failed, and may come with a reading from another source.
func readGPUBusy(sysfs, smi string, timeout time.Duration) (float64, error) {
	busiest := -1.0
	var errs []error
	for _, f := range gpuBusyFiles(sysfs) {
		b, err := os.ReadFile(f)
		if errors.Is(err, os.ErrNotExist) {
			continue // a card whose driver does not measure it
		}
		v, perr := parseGPUPercent(string(b))
		if err != nil || perr != nil {
			errs = append(errs, fmt.Errorf("%s: %w", f, errors.Join(err, perr)))
			continue
		}
		busiest = max(busiest, v)
	}
	if smi != "" {
		vs, err := nvidiaSMIBusy(smi, timeout)
		if err != nil {
			errs = append(errs, err)
		}
		for _, v := range vs {
			busiest = max(busiest, v)
		}
	}
	if busiest < 0 && len(errs) == 0 {
		errs = append(errs, fmt.Errorf("no GPU shows its utilisation (%s under %s, nvidia-smi on PATH)", gpuBusyFile, filepath.Join(sysfs, "class", "drm", "card*")))
	}
	return busiest, errors.Join(errs...)
}

func parseGPUPercent(s string) (float64, error) {
	v, err := strconv.ParseFloat(strings.TrimSpace(s), 64)
	if err != nil || !(v >= 0 && v <= 100) {
		return 0, fmt.Errorf("%q is not a utilisation in percent", strings.TrimSpace(s))
	}
	return v, nil
}

// nvidiaSMIBusy runs nvidia-smi for each NVIDIA GPU's utilisation ("the percent of time over the
// past sample period during which one or more kernels was executing"). A GPU that does not say
// ("[N/A]", "[Not Supported]") is left out. The output is bounded before it is read.
func nvidiaSMIBusy(smi string, timeout time.Duration) ([]float64, error) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, smi, "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits")
	out := &cappedBuffer{max: 64 << 10}
	cmd.Stdout = out
	// A child it left holding the pipe must not hold the monitor past the timeout.
	cmd.WaitDelay = timeout / 4
	if err := cmd.Run(); err != nil {
		if ctx.Err() != nil {
			err = fmt.Errorf("no answer in %v", timeout)
		}
		return nil, fmt.Errorf("nvidia-smi: %w", err)
	}
	if out.over {
		return nil, fmt.Errorf("nvidia-smi: an answer of more than %d bytes", out.max)
	}
	var vs []float64
	for _, line := range strings.Split(out.b.String(), "\n") {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "[") {
			continue
		}
		v, err := parseGPUPercent(line)
		if err != nil {
			return vs, fmt.Errorf("nvidia-smi: %w", err)
		}
		vs = append(vs, v)
	}
	if len(vs) == 0 {
		return nil, errors.New("nvidia-smi: no GPU reports its utilisation")
	}
	return vs, nil
}

// cappedBuffer keeps the first max bytes written to it and drops the rest, saying so.
type cappedBuffer struct {
	b    bytes.Buffer
	max  int
	over bool
}

func (c *cappedBuffer) Write(p []byte) (int, error) {
	room := c.max - c.b.Len()
	c.b.Write(p[:min(len(p), room)])
	c.over = c.over || len(p) > room
	return len(p), nil
}

// gpuSample is one GPU reading taken while this worker's device was quiet.
type gpuSample struct {
	at  time.Time
	pct float64
}

// sampler reads the machine for a policy.
type sampler struct {
	pol        workerPolicy
	powerDir   string
	readCPU    func(time.Time) (cpuSample, error)
	cpu        []cpuSample // within busyWindow, oldest first
	warnedOnce map[string]bool
	log        *slog.Logger

	// The GPU: sysfs is the sysfs root (/sys) and smi nvidia-smi's path ("" when it is not on
	// PATH); tests give their own. gpuWork counts the submissions this worker's own device has
	// made (vulkan.Device.Waits, which waits for one in progress; nil: no device of its own).
	sysfs, smi string
	smiTimeout time.Duration
	gpuWork    func() uint64
	work       uint64    // gpuWork's last answer
	quietSince time.Time // since when gpuWork has not changed (zero: not read yet)
	gpu        []gpuSample
}

func newSampler(pol workerPolicy, log *slog.Logger) *sampler {
	dir := os.Getenv(powerSupplyEnv)
	if dir == "" {
		dir = "/sys/class/power_supply"
	}
	sysfs, smi := defaultGPUSources()
	return &sampler{pol: pol, powerDir: dir, readCPU: readCPU, warnedOnce: map[string]bool{}, log: log,
		sysfs: sysfs, smi: smi, smiTimeout: nvidiaSMITimeout}
}

// defaultGPUSources is the sysfs root and nvidia-smi's path on PATH ("" when it is not there).
func defaultGPUSources() (sysfs, smi string) {
	smi, _ = exec.LookPath("nvidia-smi")
	return "/sys", smi
}

// unsupported is the policy's conditions this OS cannot read, which the worker says and ignores.
// (--pause-when-gpu-busy reads nvidia-smi, which Windows has too: gpuSources says whether it can
// work on this machine.)
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

// read samples the machine at now; tick says whether to take a CPU and a GPU sample (the ticker's
// reads, evenly spaced; a step's nudge reuses the last).
func (s *sampler) read(now time.Time, tick bool) readings {
	r := readings{Busy: -1, GPUBusy: -1}
	if s.pol.gpuBusyPct > 0 {
		if tick {
			s.sampleGPU(now)
		}
		for len(s.gpu) > 0 && now.Sub(s.gpu[0].at) > busyWindow {
			s.gpu = s.gpu[1:]
		}
		if n := len(s.gpu); n >= 2 && s.gpu[n-1].at.Sub(s.gpu[0].at) >= busyWindow/2 {
			sum := 0.0
			for _, g := range s.gpu {
				sum += g.pct
			}
			r.GPUBusy = sum / float64(n)
		}
	}
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
		if tick {
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

// sampleGPU takes a GPU reading if this worker's own device has been quiet for gpuQuiet and
// stays quiet through the reading. The rule that keeps the worker's own load out: the OS gives
// the GPU's utilisation as a whole (no cgo, no per-process counters that every driver has), so
// the reading is taken only when this worker contributes nothing to it — always while it is
// paused or standing by, and in the gaps between its steps while it computes (waiting for another
// stage, the network, the coordinator). A worker that computes without such a gap takes no
// reading, and the check then does not pause it: it never counts the worker's own work as
// another's. The busyWindow's average is of the readings it took.
func (s *sampler) sampleGPU(now time.Time) {
	if s.gpuWork != nil {
		w := s.gpuWork()
		if s.quietSince.IsZero() || w != s.work {
			s.work, s.quietSince = w, now
			return
		}
		if now.Sub(s.quietSince) < gpuQuiet {
			return
		}
	}
	pct, err := readGPUBusy(s.sysfs, s.smi, s.smiTimeout)
	if err != nil {
		s.warn("the GPU's utilisation", err)
	}
	if pct < 0 {
		return
	}
	if s.gpuWork != nil {
		if w := s.gpuWork(); w != s.work {
			s.work, s.quietSince = w, now // this worker's own work began during the reading
			return
		}
	}
	s.gpu = append(s.gpu, gpuSample{at: now, pct: pct})
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
	st      policyState   // decide's, for its next call
	changed chan struct{} // closed and replaced when v changes
}

// newMonitor reads the machine at once, so that the first verdict is known before the worker
// joins. now is the clock the schedule is read on (time.Now; a test's own); gpuWork counts the
// worker's own GPU submissions (sampler.gpuWork; nil without a GPU).
func newMonitor(pol workerPolicy, log *slog.Logger, now func() time.Time, gpuWork func() uint64) *monitor {
	s := newSampler(pol, log)
	s.gpuWork = gpuWork
	m := &monitor{pol: pol, s: s, nudges: make(chan struct{}, 1), now: now, changed: make(chan struct{})}
	t := m.now()
	m.v, m.st = pol.decide(t, m.s.read(t, true), policyState{})
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
		sample := false
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
			sample = true
		case <-m.nudges:
		}
		now := m.now()
		r := m.s.read(now, sample)
		m.mu.Lock()
		var v verdict
		v, m.st = m.pol.decide(now, r, m.st)
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
