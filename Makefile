# Shoal. `make demo` trains the default job and samples from it; `make test` is what CI runs.
GO      ?= go
BIN     := bin/shoal
WASM    := bin/shoal.wasm
DEMO    := out/demo
# Packages whose code runs goroutines: checked with the race detector in `make test`.
RACE_PKGS := ./kernels/ ./model/ ./local/ ./storage/ ./client/ ./coordinator/ ./vulkan/

.PHONY: build test test-race demo bench scale lint clean
.PHONY: bench-wan churn

# The browser worker beside the binary, where `shoal serve` and `shoal train --workers` look for
# it (--wasm-dir): the wasm, and the wasm_exec.js of the Go release that built it — the two must
# match, so the glue is copied from this toolchain, never checked in.
build:
	$(GO) build -o $(BIN) ./cmd/shoal
	GOOS=js GOARCH=wasm $(GO) build -trimpath -o $(WASM) ./wasm/worker
	cp "$$($(GO) env GOROOT)/lib/wasm/wasm_exec.js" bin/wasm_exec.js

# -timeout: the default 10 minutes a package is not enough on a loaded machine (CI may share
# its cores): each test keeps deadlines of its own, sized for that.
test: lint
	$(GO) test -count=1 -timeout 40m ./...
	$(MAKE) test-race

# -short keeps the race run to the concurrency under test (PyTorch comparisons and the standard
# library corpus are skipped there; the plain run above covers them).
test-race:
	$(GO) test -count=1 -timeout 30m -race -short $(RACE_PKGS)
	$(GO) test -count=1 -timeout 30m -race -run '$(RACE_OUTER)' ./coordinator/

# -short skips the cluster runs, and with them outer mode: these outer-mode cluster tests — a
# delayed outer step overlapping training, a replica lost mid-exchange (delayed and not, each
# redone without it: the delayed redo runs beside training), a dropped replica refilled
# from its peers, the synchronous warm-up's switch to outer mode, a worker gone silent before a
# round's end (the hub's quick timeout), a round cut for an admin command — and step mode's reroutes and stage takeovers mid-step and a holder handing its stage to a joiner before it stands by run under the race
# detector too (about a minute of test time), so coordinator/round.go, grow.go, takeover.go and
# client/outer.go, handover.go, takeover.go are seen by it.
RACE_OUTER := TestOuterReplicaLostMidExchange|TestOuterReplicaLostInExchange|TestOuterReplicaLostInDelayedExchange|TestOuterReplicasRunFree/delay|TestOuterReplicaRefilled/plain|TestStepReplicaReshared/(whole|pipelines)|TestStageTakeover/(mid-step_last|mid-step_middle)|TestOuterWarmup/own|TestOuterVanishedAtRoundEnd|TestOuterRoundCutForCommand|TestJoinHandsBack/plain

# A few minutes of the default job: a coordinator and four worker processes on loopback, moving
# activations over WebRTC — the planner says whether it runs them as pipeline replicas and why —
# then a sample from the final assembled checkpoint.
demo: build
	rm -rf $(DEMO)
	$(BIN) train --workers 4 --steps 300 --out $(DEMO)
	$(BIN) sample --checkpoint $(DEMO) --prompt "func " --tokens 300

bench:
	GO=$(GO) ./scripts/bench.sh
	./scripts/bench_pipeline.sh
	GO=$(GO) ./scripts/bench_replicas.sh
	./scripts/bench_experts.sh
	GO=$(GO) ./scripts/bench_audit.sh
	MODE=outer GO=$(GO) ./scripts/bench_audit.sh
	GO=$(GO) ./scripts/bench_webgpu.sh
	GO=$(GO) ./scripts/bench_vulkan.sh

# The coordinator at scale (issue 13): 10,000 WebSocket workers on loopback heartbeating, joining
# and leaving; prints heartbeat latency, memory per peer and SQLite writes. Not part of `make test`.
scale:
	$(GO) test -count=1 -run '^TestScale$$' -v -timeout 20m ./coordinator/ -scale.peers=10000

# A WAN on one machine (issue 17, item 4): a 2-stage pipeline over a simulated 200 Mb/s, 50 ms link
# with f32 and int8 boundaries (in-process workers on internal/wan; SHOAL_WAN_* settings), then
# real worker processes with lo rate-limited by tc in a network namespace. Not part of `make test`.
bench-wan:
	SHOAL_WAN=1 $(GO) test -count=1 -run '^TestWANBench$$' -v -timeout 30m ./coordinator/
	GO=$(GO) ./scripts/bench_wan_tc.sh

# The churn soak (issue 30): the default job on 8 worker processes with a random worker SIGKILLed
# and a fresh one started every 10 s for 5 minutes, in step mode and in outer mode, each beside a
# run without churn; prints the checkpoint restores, tokens/s under churn ÷ without, and whether the
# final state is one process's bit for bit (docs/benchmarks.md, "Churn"). SHOAL_CHURN_DURATION=60s
# (and the other SHOAL_CHURN_* settings) shorten it. Not part of `make test`.
churn:
	SHOAL_CHURN=1 $(GO) test -count=1 -run '^TestChurnSoak$$' -v -timeout 90m ./cmd/shoal/

# gofmt, go vet (also for js/wasm), and the Windows and macOS builds: no cgo anywhere (the Vulkan
# loader is purego), so the worker builds for both from this tree.
lint:
	@out=$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go')); \
	if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...
	GOOS=js GOARCH=wasm $(GO) vet ./client/ ./wasm/worker/ ./wasm/webgpu/ ./wasm/kernelcheck/ ./internal/devcheck/ ./internal/stagecheck/
	CGO_ENABLED=0 GOOS=windows $(GO) vet ./vulkan/
	CGO_ENABLED=0 GOOS=darwin $(GO) vet ./vulkan/
	CGO_ENABLED=0 GOOS=windows $(GO) build -o /dev/null ./cmd/shoal
	CGO_ENABLED=0 GOOS=windows $(GO) vet ./cmd/shoal/
	CGO_ENABLED=0 GOOS=darwin $(GO) build -o /dev/null ./cmd/shoal

clean:
	rm -rf bin out
