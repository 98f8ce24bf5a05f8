#!/usr/bin/env python
"""Host launch census of the overlay's kernel entry points: what one call costs the host, and why.

Per entry point and shape, one row:

    aten     torch operators dispatched per call (a TorchDispatchMode count: on CUDA each is a kernel
             launch or an allocation; views and metadata-only ops count too)
    triton   Triton kernel launches per call (counted through Triton's launch-enter hook)
    py calls Python function calls per call (cProfile; C functions included)
    jit us   host wall time per call, every Triton launch through Triton's JIT entry
             (DSA_OVERLAY_DIRECT_LAUNCH=0 behaviour)
    direct us  the same with overlay/kernels/launch.py's direct launch of cached kernels (the default)

Host time is bench/timing.py's launch column: N back-to-back calls, no sync, wall time / N.

    python bench/launch_census.py --out $OUT/launch_census.md          # on the GPU (real shapes)
    python bench/launch_census.py --cpu --out /tmp/census.md           # here: no GPU

``--cpu`` runs the same wrappers on CPU tensors with a stand-in Triton driver (`fake_triton`): kernels are
bound, specialised, cached and "launched" by Triton's real JIT entry, but never compiled or run (a no-op
launcher), and the wrappers plan for an H200 (sm_90, 132 SMs). Its columns count exactly what the GPU run
counts (aten ops, launches, Python calls); its times are this CPU's host times without the CUDA driver's
own launch cost (a few us per launch) and with real CPU compute for the torch ops, so they rank the paths,
they do not predict the H200.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import os
import pstats
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    raise SystemExit("bench/launch_census.py times compiled-kernel launches: run it without TRITON_INTERPRET")

import torch  # noqa: E402
import triton  # noqa: E402

from bench.timing import launch_us_per_call  # noqa: E402
from tools.fake_triton_driver import fake_triton  # noqa: E402

# ------------------------------------------------------------------------------------------ census


class _AtenCounter(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket.__name__)
        self.ops[name] = self.ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def count_aten(fn) -> dict[str, int]:
    with _AtenCounter() as c:
        fn()
    return c.ops


def count_launches(fn) -> int:
    from triton import knobs

    seen = []

    def hook(metadata):
        seen.append(metadata)

    knobs.runtime.launch_enter_hook.add(hook)
    try:
        fn()
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    return len(seen)


def count_py_calls(fn, calls: int = 20) -> float:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    return pstats.Stats(prof).total_calls / calls


def set_direct(enabled: bool) -> None:
    """Switch every DirectLauncher of the kernel modules on or off (the env kill switch, per process)."""
    from overlay.kernels import fp8_workspace as W
    from overlay.kernels import indexer as IX
    from overlay.kernels import sparse_mla as SM
    from overlay.kernels.launch import reset_plans

    for mod in (SM, IX, W):
        for launcher in mod.LAUNCHERS:
            launcher.enabled = enabled and launcher.reason is None
    reset_plans()  # the kill switch also turns the launch plans off (they keep direct-launch entries)


def sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def host_us(fn, calls: int, cuda: bool, repeats: int = 5) -> float:
    """Best of `repeats` launch-column measurements (N back-to-back calls, wall time / N)."""
    best = None
    for _ in range(repeats):
        sync(cuda)
        us = launch_us_per_call(fn, calls, time.perf_counter)
        sync(cuda)
        best = us if best is None else min(best, us)
    return best


# ------------------------------------------------------------------------------------------- cases


def make_cases(device: str, small: bool):
    """[(entry point, shape label, zero-argument callable)]: the kernel APIs the benches time, and the
    backend's per-layer call with its index conversion."""
    from overlay import triton_mla_sparse_ops as ops
    from overlay.kernels import indexer as IX
    from overlay.kernels import sparse_mla as SM

    g = torch.Generator(device="cpu").manual_seed(0)
    slots = 16384 if small else 262144
    bs = 64
    topk = 2048
    cases = []
    kv_bf16 = torch.randn((slots // bs, bs, 576), generator=g).to(torch.bfloat16).to(device)
    kv_fp8 = torch.randint(0, 120, (slots // bs, bs, 656), generator=g, dtype=torch.uint8).to(device)
    for T in ((1, 8) if small else (1, 128, 1024)):
        q = torch.randn((T, 64, 576), generator=g).to(torch.bfloat16).to(device)
        idx = torch.randint(0, slots, (T, topk), generator=g, dtype=torch.int32).to(device)
        out = torch.empty((T, 64, 512), dtype=torch.bfloat16, device=device)
        cases.append(("sparse_mla_attention bf16", f"T={T} H=64",
                      lambda q=q, idx=idx: SM.sparse_mla_attention(q, kv_bf16, idx, 0.04, "bf16")))
        cases.append(("sparse_mla_attention bf16, out=", f"T={T} H=64",
                      lambda q=q, idx=idx, out=out: SM.sparse_mla_attention(q, kv_bf16, idx, 0.04, "bf16",
                                                                             out=out)))
        cases.append(("sparse_mla_attention fp8_ds_mla", f"T={T} H=64",
                      lambda q=q, idx=idx: SM.sparse_mla_attention(q, kv_fp8, idx, 0.04, "fp8_ds_mla")))
        # the backend's forward_mqa: q as (ql_nope, q_pe), request-local top-k, block table, no lse wanted
        reqs = max(1, T // 64) if T > 1 else 1
        block_table = torch.randperm(slots // bs, generator=g)[: reqs * 32].view(reqs, 32).to(torch.int32)
        block_table = block_table.to(device)
        req_id = torch.repeat_interleave(torch.arange(reqs, dtype=torch.int32),
                                         torch.full((reqs,), -(-T // reqs)))[:T].to(device)
        local = torch.randint(-1, 2048, (T, topk), generator=g, dtype=torch.int32).to(device)
        q_pair = (q[..., :512].clone(), q[..., 512:].clone())
        cases.append(("backend forward (ops.sparse_mla_forward)", f"T={T} H=64",
                      lambda qp=q_pair, local=local, req_id=req_id, bt=block_table:
                      ops.sparse_mla_forward(qp, kv_bf16, local, req_id, bt, bs, 0.04, "bf16", with_lse=False)))
        # 16 heads per GPU: DeepSeek-V3.2 (128 heads) at tensor parallel 8, GLM-5 (64) at 4
        q16 = (q_pair[0][:, :16].clone(), q_pair[1][:, :16].clone())
        cases.append(("backend forward (ops.sparse_mla_forward)", f"T={T} H=16",
                      lambda qp=q16, local=local, req_id=req_id, bt=block_table:
                      ops.sparse_mla_forward(qp, kv_bf16, local, req_id, bt, bs, 0.04, "bf16", with_lse=False)))
        # before the block-table lookup moved into the kernel: torch converts the indices, then the kernel
        cases.append(("backend forward, indices converted by torch (before)", f"T={T} H=64",
                      lambda qp=q_pair, local=local, req_id=req_id, bt=block_table:
                      ops.sparse_mla_forward(qp, kv_bf16, local, req_id, bt, bs, 0.04, "bf16",
                                             attention=SM.sparse_mla_attention)))
    # an fp8_ds_mla prefill step through the bf16 workspace (ops.plan_fp8_prefill): up-conversion + the bf16 tile
    P = 64 if small else 1024
    qw = torch.randn((2 * P, 64, 576), generator=g).to(torch.bfloat16).to(device)
    bt_ws = torch.randperm(slots // bs, generator=g)[: 2 * (P // bs)].view(2, P // bs).to(torch.int32).to(device)
    local_ws = torch.randint(-1, P, (2 * P, topk), generator=g, dtype=torch.int32).to(device)
    rid_ws = torch.repeat_interleave(torch.arange(2, dtype=torch.int32), P).to(device)
    plan = ops.plan_fp8_prefill(torch.tensor([0, P, 2 * P]), torch.tensor([P, P]), bs, 4 * P // bs, device)
    qw_pair = (qw[..., :512].clone(), qw[..., 512:].clone())
    cases.append(("backend forward fp8_ds_mla, prefill via workspace", f"2 x {P} tokens H=64",
                  lambda: ops.sparse_mla_forward(qw_pair, kv_fp8, local_ws, rid_ws, bt_ws, bs, 0.04, "fp8_ds_mla",
                                                 segments=plan)))
    # indexer: paged decode logits (B requests, context 4096), prefill logits (M x N)
    cache = torch.randint(0, 120, (slots // bs, bs, 1, 132), generator=g, dtype=torch.uint8).to(device)
    for B in ((1, 32) if small else (1, 128)):
        qi = torch.randn((B, 1, 64, 128), generator=g).to(torch.float8_e4m3fn).to(device)
        w = torch.randn((B, 64), generator=g).to(device)
        cl = torch.full((B,), 4096, dtype=torch.int32, device=device)
        bt = torch.randint(0, slots // bs, (B, 64), generator=g, dtype=torch.int32).to(device)
        cases.append(("indexer fp8_paged_mqa_logits", f"B={B} next_n=1 ctx=4096",
                      lambda qi=qi, w=w, cl=cl, bt=bt: IX.fp8_paged_mqa_logits(qi, cache, w, cl, bt, None, 4096,
                                                                               False)))
    M, N = (64, 4096) if small else (4096, 4096)
    qp = torch.randn((M, 64, 128), generator=g).to(torch.float8_e4m3fn).to(device)
    k = torch.randn((N, 128), generator=g).to(torch.float8_e4m3fn).to(device)
    ksc = torch.rand((N,), generator=g).to(device)
    wp = torch.randn((M, 64), generator=g).to(device)
    ks = torch.zeros((M,), dtype=torch.int32, device=device)
    ke = torch.arange(1, M + 1, dtype=torch.int32, device=device) * (N // M)
    cases.append(("indexer fp8_mqa_logits (prefill)", f"M={M} N={N}",
                  lambda: IX.fp8_mqa_logits(qp, (k, ksc), wp, ks, ke, False)))
    return cases


def census(cases, cuda: bool, calls: int):
    rows = []
    for name, shape, fn in cases:
        set_direct(False)
        fn()  # compile / warm the JIT cache
        sync(cuda)
        aten = count_aten(fn)
        launches = count_launches(fn)
        py = count_py_calls(fn)
        jit = host_us(fn, calls, cuda)
        set_direct(True)
        fn()
        fn()  # the first call after switching fills the direct cache
        py_direct = count_py_calls(fn)
        aten_direct = count_aten(fn)  # a repeat call: what a planned call still asks torch for
        direct = host_us(fn, calls, cuda)
        rows.append(dict(name=name, shape=shape, aten=sum(aten.values()), aten_ops=aten, triton=launches,
                         py=py, py_direct=py_direct, jit_us=jit, direct_us=direct,
                         aten_direct=sum(aten_direct.values()), aten_ops_direct=aten_direct))
        print(f"{name:44s} {shape:22s} aten {sum(aten.values()):3d}/{sum(aten_direct.values()):2d} triton {launches} "
              f"py {py:6.0f}/{py_direct:5.0f}"
              f" jit {jit:7.1f} us direct {direct:7.1f} us", file=sys.stderr, flush=True)
    return rows


def launcher_status() -> str:
    """Which kernels the direct launch covers here, or why not (overlay/kernels/launch.py)."""
    from overlay.kernels import fp8_workspace as W
    from overlay.kernels import indexer as IX
    from overlay.kernels import sparse_mla as SM

    parts = [f"{x.fn.__name__}: {'direct launch available' if x.reason is None else 'JIT only (' + x.reason + ')'}"
             for mod in (SM, IX, W) for x in mod.LAUNCHERS]
    return "; ".join(parts)


def report(rows, device_line: str, cpu: bool) -> str:
    out = [f"# Host launch census ({datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC)", "",
           f"Device: {device_line}. Commit: {_commit()}.", "", f"Launchers: {launcher_status()}.", ""]
    if cpu:
        out += ["CPU run (`--cpu`): stand-in Triton driver, no compile, no-op launcher, CPU tensors; counts as "
                "on the GPU, times are this CPU's (no CUDA launch cost, real CPU compute for torch ops).", ""]
    out += ["| entry point | shape | aten ops / call (JIT / direct) | Triton launches / call | Python calls / call "
            "(JIT / direct) | host us / call, JIT entry | host us / call, direct launch |",
            "|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['name']} | {r['shape']} | {r['aten']} / {r.get('aten_direct', '-')} | {r['triton']} | "
                   f"{r['py']:.0f} / {r['py_direct']:.0f} | {r['jit_us']:.1f} | {r['direct_us']:.1f} |")
    out += ["", "aten ops per call, by name (JIT entry; direct launch after the semicolon):", ""]
    for r in rows:
        ops = ", ".join(f"{k} {v}" for k, v in sorted(r["aten_ops"].items(), key=lambda kv: -kv[1]))
        direct = ", ".join(f"{k} {v}" for k, v in sorted(r.get("aten_ops_direct", {}).items(), key=lambda kv: -kv[1]))
        out.append(f"- {r['name']} ({r['shape']}): {ops or 'none'}; {direct or 'none'}")
    return "\n".join(out) + "\n"


def _commit() -> str:
    try:
        import subprocess

        return subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip() or "?"
    except Exception:  # noqa: BLE001
        return "?"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true", help="no GPU: stand-in Triton driver, CPU tensors, small shapes")
    ap.add_argument("--calls", type=int, default=100,
                    help="back-to-back calls per host-time measurement (few enough that the launch queue of the "
                         "longest case, T=1024, never fills: a full queue would add GPU time)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.cpu:
        from overlay.kernels import indexer as IX
        from overlay.kernels import sparse_mla as SM

        with fake_triton():
            saved = SM._device_info, IX._device_info
            SM._device_info = lambda device: ((9, 0), 132)
            IX._device_info = lambda device: ((9, 0), 132)
            try:
                rows = census(make_cases("cpu", small=True), False, args.calls)
            finally:
                SM._device_info, IX._device_info = saved
        device_line = f"CPU ({os.cpu_count()} cores), Triton {triton.__version__}, torch {torch.__version__}"
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: pass --cpu for the stand-in census")
        rows = census(make_cases("cuda", small=False), True, args.calls)
        device_line = (f"{torch.cuda.get_device_name()}, Triton {triton.__version__}, torch {torch.__version__}")
    text = report(rows, device_line, args.cpu)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
