#!/usr/bin/env bash
# Shoal's WGSL matmul beside TensorFlow.js's WebGPU backend, in the same headless Chromium (issue 8,
# item 7): median GFLOP/s of each on square products and their ratio, for both of Shoal's matmul
# kernels (matmul, for fallback adapters; matmul_tiled, for GPUs: issue 15), the adapter's pick
# first. Then a whole training step (the tiny model as one stage, and a middle stage) on WebGPU
# beside the tab's CPU kernels, on the adapter's kernel variants and on the others, with the
# waits for the GPU per step and per micro-batch and the dispatches per step. On a machine
# without a GPU the adapter is SwiftShader (a CPU), at 0.1–2 GFLOP/s.
#
#   scripts/bench_webgpu.sh                      (sizes 128,256; 5 rounds of 10 products)
#   SHOAL_BENCH_SIZES=64,128,256 SHOAL_BENCH_ROUNDS=7 scripts/bench_webgpu.sh
#
# npm ci fetches TensorFlow.js (bench/webgpu/package-lock.json) before the run; the benchmark
# itself runs in a network namespace with only the loopback interface (root and unshare needed),
# like the browser tests.
set -euo pipefail
cd "$(dirname "$0")/.."
GO=${GO:-go}
(cd bench/webgpu && npm ci --no-audit --no-fund --loglevel=error)
# Download modules and build the wasm once outside the namespace, where the network is.
$GO mod download
GOOS=js GOARCH=wasm $GO build -o /dev/null ./wasm/kernelcheck
exec unshare -n sh -c 'ip link set lo up && exec "$0" test -count=1 -run "^$" -bench "^BenchmarkWebGPUMatMulVsTFJS$" -benchtime 1x ./wasm/' "$GO"
