//go:build js && wasm

package main

import (
	"context"
	"crypto/ed25519"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"syscall/js"

	"github.com/shoal-ml/shoal/client"
	"github.com/shoal-ml/shoal/proto"
)

// defaultMemoryBytes is what a tab offers for its shard when the page does not say: a quarter of
// what Go's 32-bit wasm heap can reach, leaving room for the runtime, the page and the copies
// that cross into JavaScript.
const defaultMemoryBytes = 1 << 30

func main() {
	t := &tab{log: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo}))}
	js.Global().Set("shoal", t.api())
	// The worker's script calls in from here on; the runtime waits for its events, never deadlocks.
	select {}
}

// tab is the one worker this page may run.
type tab struct {
	log *slog.Logger

	mu     sync.Mutex
	cancel context.CancelCauseFunc // nil while no worker runs
	done   chan struct{}           // closed when the running worker has returned
	// leave asks the running worker to leave at the job's next step boundary (client.WorkerConfig.Leave),
	// for leaveReason; nil once asked.
	leave       chan struct{}
	leaveReason string
}

// api is the `shoal` object of the worker's script (web/contrib/worker.js). Its functions live as long as the page: they are never
// released.
func (t *tab) api() js.Value {
	o := js.Global().Get("Object").New()
	o.Set("start", js.FuncOf(func(_ js.Value, args []js.Value) any {
		var opts js.Value
		if len(args) > 0 {
			opts = args[0]
		}
		return t.start(opts)
	}))
	o.Set("stop", js.FuncOf(func(_ js.Value, args []js.Value) any {
		reason := "stopped by the contributor"
		if len(args) > 0 && args[0].Type() == js.TypeString && args[0].String() != "" {
			reason = args[0].String()
		}
		if len(args) > 1 && args[1].Truthy() {
			return t.leaveAtBoundary(reason)
		}
		return t.stop(reason)
	}))
	o.Set("running", js.FuncOf(func(js.Value, []js.Value) any {
		t.mu.Lock()
		defer t.mu.Unlock()
		return t.cancel != nil
	}))
	return o
}

// start joins the page's coordinator as a browser worker, unless one runs already (false). opts
// is {join, name, memoryBytes, backend, identity, onStatus}, every field optional; backend is
// "cpu" or "webgpu" to force one, "" to let the tab measure both and take the faster; identity
// is the volunteer key's 32-byte seed in base64, which the page keeps in IndexedDB ("" or
// malformed: a key for this run alone).
func (t *tab) start(opts js.Value) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.cancel != nil {
		return false
	}
	cfg := client.WorkerConfig{
		Coordinator: js.Global().Get("location").Get("origin").String(),
		Kind:        proto.WorkerBrowser,
		Threads:     1, // Go's wasm runs one thread: the kernels' pool has nobody to hand work to
		MemoryBytes: defaultMemoryBytes,
		Name:        "browser",
		Logger:      t.log,
	}
	var (
		onStatus    js.Value
		want        string
		modelConfig string
	)
	if opts.Type() == js.TypeObject {
		cfg.JoinToken = stringField(opts, "join")
		if n := stringField(opts, "name"); n != "" {
			cfg.Name = n
		}
		if m := opts.Get("memoryBytes"); m.Type() == js.TypeNumber && m.Float() >= 1<<20 {
			cfg.MemoryBytes = int64(m.Float())
		}
		onStatus = opts.Get("onStatus")
		if seed, err := base64.StdEncoding.DecodeString(stringField(opts, "identity")); err == nil && len(seed) == ed25519.SeedSize {
			cfg.Identity = ed25519.NewKeyFromSeed(seed)
		}
		want = stringField(opts, "backend")
		modelConfig = stringField(opts, "modelConfig")
	}
	var (
		bmu sync.Mutex
		b   = backend{kind: proto.BackendCPU, describe: "measuring…"}
	)
	cur := func() backend { bmu.Lock(); defer bmu.Unlock(); return b }
	emit := func(st client.Status) { t.emit(onStatus, st, cur()) }
	cfg.OnStatus = emit
	ctx, cancel := context.WithCancelCause(context.Background())
	done := make(chan struct{})
	leave := make(chan struct{})
	t.cancel, t.done, t.leave, t.leaveReason = cancel, done, leave, ""
	cfg.Leave = leave
	cfg.LeaveReason = func() string {
		t.mu.Lock()
		defer t.mu.Unlock()
		return t.leaveReason
	}
	go func() {
		defer func() {
			if c := cur().close; c != nil {
				c()
			}
			t.mu.Lock()
			t.cancel, t.done, t.leave = nil, nil, nil
			t.mu.Unlock()
			close(done)
		}()
		emit(client.Status{State: client.StateMeasuring, Coordinator: cfg.Coordinator})
		chosen := chooseBackend(ctx, want, modelConfig)
		bmu.Lock()
		b = chosen
		bmu.Unlock()
		t.log.Info("backend chosen", "backend", chosen.kind, "gflops", fmt.Sprintf("%.2f", chosen.gflops), "why", chosen.describe)
		for {
			cfg.Backend, cfg.GFLOPS, cfg.Device = chosen.kind, chosen.gflops, chosen.device
			if ctx.Err() != nil {
				emit(client.Status{State: client.StateStopped, Coordinator: cfg.Coordinator, Backend: chosen.kind, GFLOPS: chosen.gflops})
				return
			}
			err := runUntilLost(ctx, cfg, chosen.lost)
			if !errors.Is(err, errDeviceLost) {
				if err != nil {
					t.log.Error("worker stopped", "err", err)
				}
				return
			}
			// The GPU is gone (a driver reset, the GPU process ended): the worker has left
			// with a Bye that says so, and joins again on the CPU kernels, which the
			// planner gives the CPU's share.
			why := "the GPU device was lost"
			if e, ok := chosen.device.(interface{ Err() error }); ok && e.Err() != nil {
				why = e.Err().Error()
			}
			t.log.Warn("computing on the CPU from now on", "why", why)
			cpu := backend{kind: proto.BackendCPU, gflops: chosen.cpuGFLOPS, cpuGFLOPS: chosen.cpuGFLOPS,
				describe: "CPU (pure-Go kernels, one thread): fell back from WebGPU, whose device was lost (" + why + ")"}
			chosen.close()
			bmu.Lock()
			b = cpu
			bmu.Unlock()
			chosen = cpu
		}
	}()
	return true
}

// errDeviceLost is runUntilLost's error when the GPU device was lost under the worker.
var errDeviceLost = errors.New("the WebGPU device was lost")

// runUntilLost runs the worker until ctx ends, or until lost (when not nil) is closed: then the
// worker says Bye with errDeviceLost as its reason and runUntilLost returns errDeviceLost.
func runUntilLost(ctx context.Context, cfg client.WorkerConfig, lost <-chan struct{}) error {
	rctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	if lost != nil {
		go func() {
			select {
			case <-lost:
				cancel(errDeviceLost)
			case <-rctx.Done():
			}
		}()
		// RunWorker's last status says it stopped. After a lost device the tab has not: it
		// joins again on the CPU at once, and the next RunWorker says so. Passed on, that
		// "stopped" made the page take the tab for stopped — Start enabled, Stop disabled —
		// while it went on computing (TestBrowserWorkerThread/gpu-lost).
		if on := cfg.OnStatus; on != nil {
			cfg.OnStatus = func(s client.Status) {
				if s.State == client.StateStopped && ctx.Err() == nil && errors.Is(context.Cause(rctx), errDeviceLost) {
					return
				}
				on(s)
			}
		}
	}
	err := client.RunWorker(rctx, cfg)
	if ctx.Err() == nil && errors.Is(context.Cause(rctx), errDeviceLost) {
		return errDeviceLost
	}
	return err
}

// stop makes the running worker say Bye with reason and leave. It returns a Promise that resolves
// once the worker has returned. The Bye itself is on the socket before the call returns:
// cancelling wakes the worker's goroutines, and the runtime runs them until they wait for the
// browser, which writing to a WebSocket does not. That is what lets the page's pagehide handler
// ask for a stop and the worker still leave cleanly, when the worker is not in the middle of a
// step.
func (t *tab) stop(reason string) js.Value {
	t.mu.Lock()
	cancel, done := t.cancel, t.done
	t.mu.Unlock()
	if cancel != nil {
		cancel(errors.New(reason))
	}
	return promise(func() error {
		if done != nil {
			<-done
		}
		return nil
	})
}

// leaveAtBoundary asks the running worker to leave at the job's next step boundary, as `shoal
// worker` does at its first SIGTERM: it tells the coordinator why (reason), computes on until the
// coordinator lets it go — after a checkpoint of what it holds — and returns. The page's pauses
// use it, so that a pause loses no step. It returns a Promise that resolves once the worker has
// returned; a stop meanwhile still ends it at once.
func (t *tab) leaveAtBoundary(reason string) js.Value {
	t.mu.Lock()
	leave, done := t.leave, t.done
	if leave != nil {
		t.leave, t.leaveReason = nil, reason
		close(leave)
	}
	t.mu.Unlock()
	return promise(func() error {
		if done != nil {
			<-done
		}
		return nil
	})
}

// emit hands st to the page's onStatus as a plain object, with what the tab computes on.
func (t *tab) emit(onStatus js.Value, st client.Status, b backend) {
	if onStatus.Type() != js.TypeFunction {
		return
	}
	raw, err := json.Marshal(st)
	if err != nil {
		t.log.Error("status", "err", err)
		return
	}
	obj := js.Global().Get("JSON").Call("parse", string(raw))
	obj.Set("compute", b.describe)
	defer func() {
		// A page whose callback throws must not take the worker down with it.
		if r := recover(); r != nil {
			t.log.Error("the page's onStatus threw", "err", fmt.Sprint(r))
		}
	}()
	onStatus.Invoke(obj)
}

// promise returns a JavaScript Promise settled by f, which runs on a goroutine of its own: it may
// block, which a js.Func must not.
func promise(f func() error) js.Value {
	exec := js.FuncOf(func(_ js.Value, args []js.Value) any {
		resolve, reject := args[0], args[1]
		go func() {
			if err := f(); err != nil {
				reject.Invoke(js.Global().Get("Error").New(err.Error()))
				return
			}
			resolve.Invoke()
		}()
		return nil
	})
	defer exec.Release() // the Promise constructor has run it by the time New returns
	return js.Global().Get("Promise").New(exec)
}

func stringField(o js.Value, name string) string {
	if v := o.Get(name); v.Type() == js.TypeString {
		return v.String()
	}
	return ""
}
