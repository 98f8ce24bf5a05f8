#!/usr/bin/env python3
"""What the mma.sync column can reach at all on this GPU: a plain dense Triton GEMM built as usual (wgmma on
sm_90) and built for mma.sync (DISABLE_MMA_V3=1, own TRITON_CACHE_DIR: what sm_80/86/89/120 compile to), bf16
and fp8 e4m3, same tile and launch options in both builds, with cuBLAS (torch.matmul) beside it.

The kernel tables' mma.sync column runs our kernels that way on the H200; its ratio to the wgmma build mixes
what the kernel does with what Hopper's mma.sync path can do. This bench measures the second alone: a kernel
whose only work is the MMA (no gather, no softmax) shows the hardware ratio that no kernel change can beat.

    python3 bench/mma_ceiling.py --out $OUT/mma_ceiling.md          # GPU; the child runs itself
    TRITON_INTERPRET=1 python3 bench/mma_ceiling.py --cpu-smoke      # the kernel's arithmetic on the CPU
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# (M, N, K): compute-bound GEMMs (a K = 128 GEMM like the indexer's would time its fp32 stores, not the MMA)
SHAPES = ((4096, 4096, 4096), (8192, 8192, 4096))
TILES = {"bf16": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),
         "fp8": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3)}


@triton.jit
def _gemm_kernel(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_bn, stride_cm,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """C[M, N] (fp32) = A[M, K] . B[N, K]^T, both operands K-contiguous (as the indexer's keys and queries)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptr + rm[:, None].to(tl.int64) * stride_am + (k0 + rk)[None, :],
                    mask=(rm[:, None] < M) & ((k0 + rk)[None, :] < K), other=0.0)
        b = tl.load(b_ptr + rn[:, None].to(tl.int64) * stride_bn + (k0 + rk)[None, :],
                    mask=(rn[:, None] < N) & ((k0 + rk)[None, :] < K), other=0.0)
        acc = tl.dot(a, tl.trans(b), acc)
    tl.store(c_ptr + rm[:, None].to(tl.int64) * stride_cm + rn[None, :], acc,
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def gemm(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, tile: dict) -> torch.Tensor:
    M, K = a.shape
    N = b.shape[0]
    grid = (triton.cdiv(M, tile["BLOCK_M"]), triton.cdiv(N, tile["BLOCK_N"]))
    _gemm_kernel[grid](a, b, c, M, N, K, a.stride(0), b.stride(0), c.stride(0), **tile)
    return c


def operands(dtype: str, M: int, N: int, K: int, device: str, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    a = torch.randn(M, K, generator=g, device=device) * 0.5
    b = torch.randn(N, K, generator=g, device=device) * 0.5
    if dtype == "fp8":
        a, b = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    elif dtype == "bf16":
        a, b = a.to(torch.bfloat16), b.to(torch.bfloat16)
    return a, b


def cpu_smoke() -> float:
    """Max relative error of the kernel (interpreter, float32 operands, odd sizes) against float64."""
    from tools.triton_interp import numpy24_fix

    numpy24_fix()
    a, b = operands("fp32", 50, 70, 90, "cpu")
    c = torch.full((50, 70), float("nan"))
    tile = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32)
    gemm(a, b, c, tile)
    ref = a.double() @ b.double().T
    return float((c.double() - ref).abs().max() / ref.abs().max())


def measure(args) -> dict:
    from bench.timing import Timer

    timer = Timer("cuda", args.reps, args.replays, 10)
    times = {}
    for dtype in ("bf16", "fp8"):
        for M, N, K in SHAPES:
            a, b = operands(dtype, M, N, K, "cuda")
            c = torch.empty(M, N, dtype=torch.float32, device="cuda")
            key = f"{dtype} {M}x{N}x{K}"
            times[key] = timer.measure(lambda: gemm(a, b, c, TILES[dtype]), eager=False, launch=False).graph_us
            if args.mma_sync_child is None:
                ref = a.float() @ b.float().T
                times[key + " err"] = float((c - ref).abs().max() / ref.abs().max())
                if dtype == "bf16":
                    times[key + " cublas"] = timer.measure(lambda: a @ b.T, eager=False, launch=False).graph_us
            del a, b, c
            torch.cuda.empty_cache()
    return times


def report(own: dict, mma: dict, note: str, device: str) -> str:
    lines = ["# mma.sync ceiling: a plain Triton GEMM, wgmma build vs mma.sync build", "",
             f"- device: {device}; torch {torch.__version__}, triton {triton.__version__}",
             f"- {note}", f"- tiles: {json.dumps(TILES)}", "",
             "| GEMM (M x N x K) | wgmma build us (TFLOP/s) | mma.sync build us (TFLOP/s) | mma.sync / wgmma | "
             "cuBLAS bf16 us | err |", "|---|---|---|---|---|---|"]
    for dtype in ("bf16", "fp8"):
        for M, N, K in SHAPES:
            key = f"{dtype} {M}x{N}x{K}"
            fl = 2.0 * M * N * K
            own_us, mma_us = own.get(key), mma.get(key)
            cell = lambda us: f"{us:.1f} ({fl / us / 1e6:.0f})" if us else "-"  # noqa: E731
            ratio = f"{mma_us / own_us:.2f}x" if own_us and mma_us else "-"
            cub = own.get(key + " cublas")
            lines.append(f"| {key} | {cell(own_us)} | {cell(mma_us)} | {ratio} | "
                         f"{f'{cub:.1f}' if cub else '-'} | {own.get(key + ' err', float('nan')):.1e} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    from bench.timing import add_timing_args, mma_sync_column, write_child_json

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="-")
    ap.add_argument("--cpu-smoke", action="store_true")
    add_timing_args(ap, reps=10)
    args = ap.parse_args()
    if args.cpu_smoke:
        err = cpu_smoke()
        print(f"interpreter GEMM max rel err vs float64: {err:.2e}")
        return 0 if err < 1e-5 else 1
    args.mma_sync = True
    if args.mma_sync_child is not None:
        write_child_json(args.mma_sync_child, measure(args))
        return 0
    mma, note = mma_sync_column(args, __file__)
    own = measure(args)
    text = report(own, mma, note, torch.cuda.get_device_name())
    if args.out == "-":
        sys.stdout.write(text)
    else:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
