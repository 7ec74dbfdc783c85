#!/usr/bin/python3
"""torch.matmul GFLOP/s on the shapes and layouts of Shoal's BenchmarkGEMM (kernels/gemm_test.go).

  bench_matmul.py [--threads 2] [--seconds 1] [--layouts NN,NT,TN] SHAPE...   (SHAPE is MxKxN)

Prints one line per layout and shape, "<layout> <MxKxN> <GFLOP/s>", in the order asked. Run with
Debian's python and OpenBLAS's OpenMP build, as the anchor (model/testdata/torch_gpt_moe.py):
LD_LIBRARY_PATH=/usr/lib/x86_64-linux-gnu/openblas-openmp OMP_NUM_THREADS=2 /usr/bin/python3 ...

The operands are stored as Shoal stores them, contiguous: NN is C = A·B with A (M,K) and B (K,N);
NT is A·Bᵀ with B stored (N,K); TN is Aᵀ·B with A stored (K,M). The transposes are views, so
BLAS gets a transpose flag rather than a copy, as Shoal's kernels read the stored layout directly.
C is preallocated (out=) because Shoal writes into a caller's slice: no allocation is timed.
"""
import argparse, time

import torch


def operands(layout, m, k, n):
    if layout == "NN":
        a, b = torch.randn(m, k), torch.randn(k, n)
        return a, b
    if layout == "NT":
        a, b = torch.randn(m, k), torch.randn(n, k)
        return a, b.T
    if layout == "TN":
        a, b = torch.randn(k, m), torch.randn(k, n)
        return a.T, b
    raise SystemExit(f"unknown layout {layout!r}: want NN, NT or TN")


def gflops(layout, m, k, n, seconds):
    a, b = operands(layout, m, k, n)
    c = torch.empty(m, n)
    # Warm-up: OpenMP's thread team, OpenBLAS's buffers and the caches start cold on the first calls.
    for _ in range(3):
        torch.matmul(a, b, out=c)
    # Size the timed run to about SECONDS, like go test's -benchtime, from one timed call.
    t0 = time.perf_counter()
    torch.matmul(a, b, out=c)
    once = time.perf_counter() - t0
    reps = max(3, int(seconds / max(once, 1e-6)))
    t0 = time.perf_counter()
    for _ in range(reps):
        torch.matmul(a, b, out=c)
    dt = time.perf_counter() - t0
    return 2 * m * k * n * reps / dt / 1e9


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seconds", type=float, default=1.0)
    p.add_argument("--layouts", default="NN,NT,TN")
    p.add_argument("shapes", nargs="+")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    for layout in a.layouts.split(","):
        for s in a.shapes:
            m, k, n = map(int, s.split("x"))
            print(f"{layout} {s} {gflops(layout, m, k, n, a.seconds):.2f}", flush=True)


if __name__ == "__main__":
    main()
