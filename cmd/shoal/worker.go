package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net/http"
	"os"
	"os/signal"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/shoal-ml/shoal/client"
	"github.com/shoal-ml/shoal/coordinator"
	"github.com/shoal-ml/shoal/kernels"
	"github.com/shoal-ml/shoal/model"
	"github.com/shoal-ml/shoal/proto"
	"github.com/shoal-ml/shoal/vulkan"
)

func (m *Main) runWorker(ctx context.Context, args []string) error {
	fs := m.newFlagSet("worker", "--coordinator URL [flags]")
	coord := fs.String("coordinator", "", "coordinator `URL` (http://host:port, https://host:port, or host:port for http)")
	threads := fs.Int("threads", 0, "CPU threads for the kernels (default: all)")
	memory := bytesFlag(fs, "memory", 8<<30, "`BYTES` of memory this worker offers for its shard: 8GiB, 512MB, 1.5GB or plain bytes (in outer mode the replica's outer state, 12-36 bytes a parameter, is kept beside it in a removed file under ~/.cache/shoal)")
	name := fs.String("name", "", "a name for this worker in the coordinator's peer list")
	join := fs.String("join", "", "a private job's join `TOKEN` (from its join link)")
	logJSON := fs.Bool("log-json", false, "log as JSON instead of text")
	identity := fs.String("identity", "", "`FILE` holding this volunteer's key, made on first run, so that credit accumulates across restarts (default: shoal/identity in the user's config directory)")
	config := fs.String("config", "", "`FILE` of flags, a `name = value` line each (for a service); flags given here win over the file's")
	deviceFlag := fs.String("device", "auto", "the `DEVICE` the shard computes on: cpu, vulkan (the first Vulkan device), vulkan:N, or auto (times a training step of the job's model on the CPU and on each Vulkan GPU, and takes the faster)")
	gpuMemory := bytesFlag(fs, "gpu-memory", 0, "`BYTES` of GPU memory the shard may take when it computes on a GPU (--device vulkan): a cap on the device's allocations, and the most this worker offers the planner (default: no cap beyond --memory)")
	var maxUpload rateFlag
	fs.Var(&maxUpload, "max-upload", "cap what this worker sends (data-plane frames, checkpoint and audit uploads) at `RATE`: 10Mbit, 2MB/s; reported to the coordinator as the worker's link speed (default: no cap)")
	pauseOnBattery := fs.Bool("pause-on-battery", false, "leave the job at a step boundary while the machine runs on battery, and come back on mains power (Linux)")
	var busy percentFlag
	fs.Var(&busy, "pause-when-busy", "leave the job at a step boundary while other processes use more than `PCT` percent of all CPUs over a minute, and come back when they use less (Linux)")
	var gpuBusy gpuPercentFlag
	fs.Var(&gpuBusy, "pause-when-gpu-busy", "on a GPU (--device vulkan), leave the job at a step boundary while other work keeps the GPU more than `PCT` percent busy over a minute (read only while this worker's own GPU is idle, so that its own work does not count), and come back when it is idle (amdgpu's gpu_busy_percent in sysfs, or nvidia-smi)")
	cpuProfile := fs.String("cpuprofile", "", "write a CPU profile of this worker's run to `FILE` (go tool pprof), for developers")
	var sched scheduleFlag
	fs.Var(&sched, "schedule", "compute only within these `WINDOWS` of local time, such as 22:00-07:00 or 12:00-13:30,22:00-07:00; outside them leave at a step boundary and come back at the next")
	flagsUsage := fs.Usage
	fs.Usage = func() {
		flagsUsage()
		fmt.Fprintf(m.Stderr, `
Environment:
  SHOAL_FAULT=KIND
    	make this worker misbehave ON PURPOSE on every training step, to show that
    	the coordinator's audits catch it (never on a worker whose work should count);
    	KIND is one of %s
  %s=DIR
    	read the power supplies (--pause-on-battery) under DIR instead of
    	/sys/class/power_supply
`, strings.Join(client.FaultKinds(), ", "), powerSupplyEnv)
	}
	err := parse(fs, args)
	if err != nil {
		return err
	}
	if *config != "" {
		if err := applyConfig(fs, *config); err != nil {
			return err
		}
	}
	if *coord == "" {
		fs.Usage()
		return errors.Join(errUsage, errors.New("--coordinator is required"))
	}
	stopProfile := func() {}
	if *cpuProfile != "" {
		stop, err := startCPUProfile(*cpuProfile)
		if err != nil {
			return err
		}
		var once sync.Once
		stopProfile = func() { once.Do(stop) }
		defer stopProfile()
	}
	*coord = client.CoordinatorURL(*coord)
	if *threads > 0 {
		// One more P than compute threads: the data plane's goroutines (pion's SCTP and DTLS
		// loops, the frame readers) then run as packets arrive instead of waiting for the
		// compute goroutine to be preempted, which on a one-thread worker left a pipeline's
		// stages waiting on each other's acknowledgements. The kernels keep to --threads.
		runtime.GOMAXPROCS(*threads + 1)
		kernels.SetThreads(*threads)
	}
	// The offer is a promise to the planner, which budgets the shard to fit it: the collector is
	// told to keep the heap under it (unless GOMEMLIMIT says otherwise), where by default it would
	// let the heap grow to twice what is live before collecting — a process twice its offer,
	// which is what gets a worker killed by the OS.
	if os.Getenv("GOMEMLIMIT") == "" {
		debug.SetMemoryLimit(int64(*memory))
	}
	if *identity == "" {
		if *identity, err = client.DefaultIdentityPath(); err != nil {
			return err
		}
	}
	key, created, err := client.LoadIdentity(*identity)
	if err != nil {
		return err
	}
	if created {
		fmt.Fprintf(m.Stderr, "identity: a new key in %s (keep it to keep this volunteer's credit)\n", *identity)
	}
	pol := workerPolicy{onBattery: *pauseOnBattery, busyPct: float64(busy), gpuBusyPct: float64(gpuBusy), schedule: sched.s}
	log := m.logger(*logJSON)
	if u := unsupported(pol); len(u) > 0 {
		log.Warn("resource policy: "+strings.Join(u, " and ")+" cannot be read on "+runtime.GOOS+"; ignored", "unsupported", strings.Join(u, ","))
		pol.onBattery, pol.busyPct = false, 0
	}
	dev, err := chooseDevice(ctx, *deviceFlag, *coord, *join)
	if err != nil {
		return err
	}
	defer dev.close()
	fmt.Fprintf(m.Stderr, "device: %s\n", dev.describe)
	offer := int64(*memory)
	if *gpuMemory > 0 {
		if vd, ok := dev.device.(*vulkan.Device); ok {
			// The shard lives in the GPU's memory: the cap is the device's, and the planner is
			// offered no more than it.
			vd.SetMemoryLimit(int64(*gpuMemory))
			offer = min(offer, int64(*gpuMemory))
			fmt.Fprintf(m.Stderr, "gpu memory: at most %s for the shard\n", formatBytes(int64(*gpuMemory)))
			if have := vd.Info().MemoryBytes; have > 0 && uint64(*gpuMemory) > have {
				fmt.Fprintf(m.Stderr, "gpu memory: --gpu-memory %s is more than the device's %s of local memory\n", formatBytes(int64(*gpuMemory)), formatBytes(int64(have)))
			}
		} else {
			fmt.Fprintln(m.Stderr, "gpu memory: the shard computes on the CPU; --gpu-memory does not apply")
		}
	}
	// The first SIGTERM (or Ctrl-C: ctx ends) asks the worker to leave at the job's next step
	// boundary, once the coordinator has a checkpoint of what it holds; a second signal, or
	// leaveWait without being let go, stops it at once.
	signals := make(chan os.Signal, 2)
	signal.Notify(signals, os.Interrupt, syscall.SIGTERM)
	defer signal.Stop(signals)
	wctx, hardStop := context.WithCancel(context.WithoutCancel(ctx))
	defer hardStop()
	go func() {
		select {
		case <-ctx.Done():
		case <-wctx.Done():
			return
		}
		// The profile ends at the request: a worker left waiting for a step boundary that never
		// comes (its job over) is killed, and a profile stopped later would be lost with it.
		stopProfile()
		fmt.Fprintln(m.Stderr, "stopping at the job's next step boundary (signal again to stop at once)")
		wait := time.NewTimer(leaveWait)
		defer wait.Stop()
		for seen := 0; ; {
			select {
			case <-signals:
				if seen++; seen < 2 { // the first is the one that ended ctx
					continue
				}
			case <-wait.C:
			case <-wctx.Done():
				return
			}
			hardStop()
			return
		}
	}()
	cfg := client.WorkerConfig{Coordinator: *coord, Threads: kernels.Threads(),
		MemoryBytes: offer, Name: *name, JoinToken: *join, Logger: log, Fault: os.Getenv("SHOAL_FAULT"),
		Backend: dev.backend, Device: dev.device, DeviceName: dev.name, GFLOPS: dev.gflops, Identity: key,
		MaxUploadBytesPerS: maxUpload.bps}
	if pol.gpuBusyPct > 0 {
		if _, ok := dev.device.(*vulkan.Device); !ok {
			fmt.Fprintln(m.Stderr, "gpu busy: the shard computes on the CPU; --pause-when-gpu-busy does not apply")
			pol.gpuBusyPct = 0
		} else if src := gpuSources(defaultGPUSources()); len(src) == 0 {
			log.Warn("resource policy: --pause-when-gpu-busy: no GPU utilisation to read on this machine (neither /sys/class/drm/card*/"+gpuBusyFile+" nor nvidia-smi on PATH); ignored", "unsupported", "--pause-when-gpu-busy")
			pol.gpuBusyPct = 0
		} else {
			fmt.Fprintf(m.Stderr, "gpu busy: reading %s\n", strings.Join(src, ", "))
		}
	}
	if maxUpload.bps > 0 {
		fmt.Fprintf(m.Stderr, "upload: at most %s (%.0f bytes/s), reported as this worker's link speed\n", maxUpload.text, maxUpload.bps)
	}
	if !pol.active() {
		cfg.Leave = ctx.Done()
		// RunWorker refuses an unknown kind, naming the kinds, before it joins.
		return client.RunWorker(wctx, cfg)
	}
	return runPolicy(ctx, wctx, cfg, pol, log)
}

// runPolicy runs the worker under its resource policy: it joins while the policy lets it run,
// leaves at the job's next step boundary when it says pause (as at the first SIGTERM: the
// coordinator checkpoints the boundary and lets it go), stays away — disconnected, so that the
// coordinator plans without it and the machine keeps no connection awake — and joins again when
// the condition clears. Each join is a new session under the same identity (its credit
// accumulates); a new worker id, as a restart has, since the coordinator never takes back a
// worker it let go. ctx ending (the first signal) stops it; wctx, everything at once.
func runPolicy(ctx, wctx context.Context, cfg client.WorkerConfig, pol workerPolicy, log *slog.Logger) error {
	var gpuWork func() uint64
	if d, ok := cfg.Device.(interface{ Waits() int }); ok {
		gpuWork = func() uint64 { return uint64(d.Waits()) }
	}
	mon := newMonitor(pol, log, time.Now, gpuWork)
	go mon.run(wctx)
	// Every step computed is a moment to look again, so that a pause is noticed before the next.
	var steps atomic.Int64
	var gflops atomic.Uint64 // measured at the first join, reported again at the next
	onStatus := func(s client.Status) {
		if int64(s.Steps) != steps.Swap(int64(s.Steps)) {
			mon.nudge()
		}
		if s.GFLOPS > 0 {
			gflops.Store(math.Float64bits(s.GFLOPS))
		}
	}
	log.Info("resource policy", "pause_on_battery", pol.onBattery, "pause_when_busy", pol.busyPct, "pause_when_gpu_busy", pol.gpuBusyPct, "schedule", pol.schedule.String())
	var left *verdict // the pause the worker last left for
	for {
		if v, _ := mon.current(); left != nil || v.pause {
			if left == nil {
				left = &v
			}
			log.Info("paused", "reason", left.reason)
			if _, ok := mon.await(ctx, false, nil); !ok {
				return nil
			}
			log.Info("resuming: the pause's condition cleared", "was", left.reason)
			left = nil
		}
		leave := make(chan struct{})
		done := make(chan struct{})
		paused := make(chan verdict, 1)
		var pausing atomic.Pointer[verdict] // what paused carries, for the Leaving message
		rctx, cancelRun := context.WithCancel(wctx)
		go func() {
			v, ok := mon.await(ctx, true, done)
			if ok {
				pausing.Store(&v)
				paused <- v
				log.Info("pausing: leaving the job at its next step boundary", "reason", v.reason)
			}
			close(leave)
			if !ok {
				return // ctx ended (leave as asked), or the worker returned
			}
			select {
			case <-time.After(leaveWait):
				cancelRun() // not let go in time: leave now
			case <-done:
			case <-wctx.Done():
			}
		}()
		run := cfg
		run.Leave, run.OnStatus = leave, onStatus
		run.LeaveReason = func() string {
			if v := pausing.Load(); v != nil {
				return "paused: " + v.reason
			}
			return ""
		}
		if g := math.Float64frombits(gflops.Load()); g > 0 {
			run.GFLOPS = g
		}
		err := client.RunWorker(rctx, run)
		close(done)
		cancelRun()
		if err != nil || ctx.Err() != nil {
			return err
		}
		select {
		case v := <-paused:
			left = &v
		default:
			return nil // let go for another reason than a pause: drained by the admin
		}
	}
}

// leaveWait bounds how long a stopping worker waits for the coordinator to let it go.
const leaveWait = 2 * time.Minute

// workerDevice is what a native worker computes its shard on.
type workerDevice struct {
	backend  proto.Backend
	device   model.Device // nil: the CPU kernels
	name     string       // the GPU's name, for the coordinator's dashboards
	gflops   float64      // on the planner's scale (client.BrowserGFLOPS); 0: client measures the CPU
	describe string       // for the terminal: what was chosen and why
	close    func()
}

// probeConfig is the model a device choice times a training step of: two blocks (one MoE) of the
// job's own model, which the coordinator's status gives (job.model_config), or of the default
// job's when it cannot be had — a stage-sized piece of what the worker will hold: the tiny model
// would time a GPU's dispatch latency alone, the whole job would take long on a slow device. It
// says which.
func probeConfig(ctx context.Context, coord, join string) (model.Config, int, string) {
	cfg, err := jobModel(ctx, coord, join)
	what := "the job's model"
	if err != nil {
		cfg, what = model.DefaultConfig(), fmt.Sprintf("the default model (the job's: %v)", err)
	}
	cfg.NLayer = min(cfg.NLayer, 2)
	return cfg, 4, what
}

// jobModel is the model config of the job the coordinator runs, from its status (with the
// private job's join token, when given). The coordinator is the one this worker joins; still, its
// answer is bounded and validated before anything is allocated for it.
func jobModel(ctx context.Context, coord, join string) (model.Config, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, strings.TrimSuffix(coord, "/")+"/api/status", nil)
	if err != nil {
		return model.Config{}, err
	}
	if join != "" {
		req.Header.Set(coordinator.JoinHeader, join)
	}
	hc, err := client.CoordinatorClient(coord)
	if err != nil {
		return model.Config{}, err
	}
	resp, err := hc.Do(req)
	if err != nil {
		return model.Config{}, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return model.Config{}, fmt.Errorf("status: %s", resp.Status)
	}
	var st struct {
		Job *struct {
			ModelConfig json.RawMessage `json:"model_config"`
		} `json:"job"`
	}
	if err := json.NewDecoder(io.LimitReader(resp.Body, 16<<20)).Decode(&st); err != nil {
		return model.Config{}, fmt.Errorf("status: %w", err)
	}
	if st.Job == nil || len(st.Job.ModelConfig) == 0 {
		return model.Config{}, errors.New("no job runs yet")
	}
	cfg, err := model.ParseConfig(st.Job.ModelConfig)
	if err != nil {
		return model.Config{}, err
	}
	// The probe, two blocks with the embeddings and the head, is bounded whatever the job: a
	// hostile answer could ask for any size.
	probe := cfg
	probe.NLayer = min(probe.NLayer, 2)
	var n int64
	for _, sp := range probe.Specs() {
		n += int64(sp.Size())
	}
	if n > 1<<28 {
		return model.Config{}, fmt.Errorf("two blocks with the embeddings: %d parameters, too many to time", n)
	}
	return cfg, nil
}

// chooseDevice opens what --device names. auto considers every Vulkan device that is a GPU
// (discrete, integrated or virtual: a software rasterizer such as lavapipe is never faster than
// the CPU kernels) and keeps the one whose training step beats the CPU's by most; vulkan and
// vulkan:N use that device whatever its speed. A device's GFLOP/s is put on the planner's scale
// as a browser tab's is: the CPU's large-multiply GFLOP/s times the ratio of the two step times.
func chooseDevice(ctx context.Context, flag, coord, join string) (workerDevice, error) {
	cpu := workerDevice{backend: proto.BackendCPU, describe: fmt.Sprintf("CPU (%s kernels, %d threads)", kernels.ISA(), kernels.Threads()), close: func() {}}
	want := -1 // auto
	switch {
	case flag == "cpu":
		return cpu, nil
	case flag == "auto":
	case flag == "vulkan":
		want = 0
	case strings.HasPrefix(flag, "vulkan:"):
		n, err := strconv.Atoi(strings.TrimPrefix(flag, "vulkan:"))
		if err != nil || n < 0 {
			return cpu, errors.Join(errUsage, fmt.Errorf("--device %q: want cpu, auto, vulkan or vulkan:N (N a device index)", flag))
		}
		want = n
	default:
		return cpu, errors.Join(errUsage, fmt.Errorf("--device %q: want cpu, auto, vulkan or vulkan:N", flag))
	}
	infos, err := vulkan.Devices()
	if err != nil {
		if want >= 0 {
			return cpu, fmt.Errorf("--device %s: %w", flag, err)
		}
		cpu.describe += fmt.Sprintf(": no Vulkan (%v)", err)
		return cpu, nil
	}
	var cands []vulkan.Info
	for _, in := range infos {
		if want >= 0 && in.Index == want || want < 0 && in.Type != "cpu" && in.Type != "other" {
			cands = append(cands, in)
		}
	}
	if want >= 0 && len(cands) == 0 {
		return cpu, fmt.Errorf("--device %s: no Vulkan device %d (%d found)", flag, want, len(infos))
	}
	if len(cands) == 0 {
		cpu.describe += fmt.Sprintf(": no Vulkan GPU (%d software devices skipped)", len(infos))
		return cpu, nil
	}
	cfg, rows, what := probeConfig(ctx, coord, join)
	cpuStep, err := client.TimeDeviceStepOf(model.Host{}, cfg, rows)
	if err != nil {
		return cpu, fmt.Errorf("time a step on the CPU: %w", err)
	}
	cpuGFLOPS := client.MeasureGFLOPS()
	best := cpu
	bestStep := cpuStep
	for _, in := range cands {
		d, err := vulkan.Open(in.Index)
		if err != nil {
			if want >= 0 {
				return cpu, fmt.Errorf("--device %s: %w", flag, err)
			}
			cpu.describe += fmt.Sprintf("; %s: %v", in.Name, err)
			continue
		}
		step, err := client.TimeDeviceStepOf(d, cfg, rows)
		if err == nil {
			err = d.Err()
		}
		if err != nil {
			d.Close()
			if want >= 0 {
				return cpu, fmt.Errorf("--device %s: a benchmark step failed: %w", flag, err)
			}
			cpu.describe += fmt.Sprintf("; %s failed its benchmark step: %v", in.Name, err)
			continue
		}
		if want < 0 && step >= bestStep {
			d.Close()
			cpu.describe += fmt.Sprintf("; %s (%s) takes %v a step, the CPU %v", in.Name, in.Type, step.Round(time.Millisecond), cpuStep.Round(time.Millisecond))
			continue
		}
		best.close()
		dd := d
		best = workerDevice{backend: proto.BackendVulkan, device: d, name: in.Name,
			gflops: cpuGFLOPS * cpuStep.Seconds() / step.Seconds(),
			describe: fmt.Sprintf("vulkan:%d %s (%s): a step of two blocks of %s takes %v, on the CPU %v", in.Index, in.Name, in.Type,
				what, step.Round(time.Microsecond), cpuStep.Round(time.Microsecond)),
			close: func() { dd.Close() }}
		bestStep = step
	}
	if best.backend == proto.BackendCPU {
		return cpu, nil
	}
	best.describe += fmt.Sprintf(": %.0f GFLOP/s on the planner's scale", best.gflops)
	return best, nil
}
