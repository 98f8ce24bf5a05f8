#!/usr/bin/env python
"""Sparse-MLA attention on one GPU: our Triton kernel (heuristic config and a config sweep) beside
FlashMLA sparse from the installed vLLM, a plain torch gather reference and the device copy bandwidth.

One process, one GPU, unattended; writes a markdown report to --out (default: stdout).

    python bench/bench_sparse_mla.py --out $OUT/sparse_mla.md            # every shape + full sweep
    python bench/bench_sparse_mla.py --focus --out $OUT/sparse_mla_focus.md  # < 150 s: shapes that missed
        # a target in run 1 (+ T=1), heuristic vs the variants in sparse_mla.FOCUS_TILES, FlashMLA beside
    python bench/bench_sparse_mla.py --focus --mma-sync --out ...   # + our kernel built for mma.sync

Timing: bench/timing.py (graph = GPU time by CUDA-graph replay, eager = one plain call, launch = host time
per call; L2 flushed before every graph and eager call). TB/s, TFLOP/s and "vs FlashMLA" use graph time.
Effective TB/s counts gathered bytes only: T x topk x (1152 B bf16 | 656 B fp8_ds_mla), duplicates counted.
TFLOP/s counts 2 x T x H x topk x (576 + 512). "vs FlashMLA" = FlashMLA time / our time (> 1: faster).
"""

from __future__ import annotations

import argparse
import datetime
import io
import math
import os
import re
import statistics
import sys
import time
import traceback
from dataclasses import replace

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# --cpu-smoke: run the whole script on the CPU through Triton's interpreter with tiny shapes, to check
# its plumbing (tables, sweep, error rows) without a GPU. Numbers from it mean nothing.
SMOKE = "--cpu-smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"
DEVICE = "cpu" if SMOKE else "cuda"

from bench.timing import (Timer, Timing, add_timing_args, mma_sync_column, rank_us,  # noqa: E402
                          write_child_json)
from overlay.kernels import sparse_mla as SM  # noqa: E402
from overlay.kernels.launch import reset_plans  # noqa: E402
from tools.fp8_ds_mla_codec import quantize_fp8_ds_mla  # noqa: E402

BYTES_PER_TOKEN = {"bf16": 1152, "fp8_ds_mla": 656}
NUM_SLOTS = 262144
BLOCK_SIZE = 64
TOPK = 2048
FLUSH_BYTES = 256 << 20

# Sweep candidates per format (block_h, block_n, num_warps, num_stages); splits are swept separately.
SWEEP_TILES = {
    "bf16": [(16, 32, 4, 2), (16, 64, 8, 2), (16, 64, 8, 3), (16, 64, 4, 2), (32, 32, 8, 2), (32, 64, 8, 2),
             (64, 16, 8, 2), (64, 32, 8, 2), (64, 64, 8, 3)],
    "fp8_ds_mla": [(16, 32, 8, 2), (16, 64, 8, 2), (16, 32, 4, 2), (32, 32, 8, 2), (32, 64, 8, 2),
                   (64, 16, 8, 2), (64, 32, 8, 2), (64, 64, 8, 3)],
}
SPLITS = (1, 2, 4, 8, 16, 32, 64)

# --focus: the shapes that missed a target in the first H200 run (bench/results/h200-sparse_mla-run1.md)
# plus T = 1 at H = 64; (fmt, T, H, prefill). Each config's time in that run comes from the report itself
# (--baseline), never from numbers kept here.
FOCUS_SHAPES = [("bf16", 128, 128, False), ("fp8_ds_mla", 128, 128, False), ("bf16", 4096, 64, True),
                ("bf16", 128, 64, False),
                ("fp8_ds_mla", 128, 64, False), ("bf16", 1, 64, False), ("fp8_ds_mla", 1, 64, False),
                ("fp8_ds_mla", 1, 8, False), ("bf16", 32, 64, False), ("bf16", 128, 16, False),
                ("fp8_ds_mla", 32, 16, False), ("fp8_ds_mla", 128, 16, False),
                ("bf16", 8, 64, False), ("bf16", 128, 8, False), ("fp8_ds_mla", 32, 64, False),
                ("fp8_ds_mla", 8, 64, False), ("fp8_ds_mla", 128, 32, False), ("fp8_ds_mla", 32, 32, False)]
BASELINE = os.path.join(ROOT, "bench", "results", "h200-sparse_mla-run1.md")


def load_baseline(path: str) -> dict[str, dict[str, float]]:
    """{shape label: {config string: us}} from the sweep table of an earlier report of this script
    (rows `| <label> | <config>: <us>, ... |`); {} when the file is missing."""
    if not path or not os.path.exists(path):
        return {}
    out: dict[str, dict[str, float]] = {}
    in_sweep = False
    for line in open(path):
        if line.startswith("## "):
            in_sweep = line.startswith("## Sweep")
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        found = re.findall(r"(h\d+n\d+s\d+w\d+p\d+(?:d\d+)?f?): ([0-9.]+)", cells[-1]) if in_sweep else []
        if len(cells) == 2 and found:
            out[cells[0]] = {cfg: float(us) for cfg, us in found}
    return out


MMA_COLUMN_NOTE = ("; mma.sync us = our heuristic (its Triton tile where sm_90 picks the Gluon one) built for "
                   "mma.sync (DISABLE_MMA_V3=1), graph time")


def describe(cfg) -> str:
    """One phrase per config for the --focus table."""
    parts = [f"{cfg.block_h} heads x {cfg.block_n} rows/iter, {cfg.num_warps} warps, {cfg.num_stages} stages"]
    if cfg.num_splits > 1:
        parts.append(f"top-k in {cfg.num_splits} splits + lse merge")
    if cfg.dv_split == 2:
        parts.append("value dim split: 2 programs x 256 cols")
    if cfg.fp8_post_scale:
        parts.append("fp8 scales after the dots")
    if cfg.fp8_prefetch == 2:
        parts.append("next block's fp8 tiles gathered and decoded one iteration ahead")
    elif cfg.fp8_prefetch:
        parts.append("next block's raw fp8 prefetched into registers")
    if cfg.ws:
        parts.append("warp-specialised Gluon sm_90 kernel (a producer warpgroup and 2 math warpgroups)")
    elif cfg.gluon:
        parts.append("Gluon sm_90 kernel (scores split over the 2 warpgroups by keys)")
    return "; ".join(parts)


def focus_configs(fmt, T, H, topk, sm_count, heuristic, prefill):
    """The heuristic, then every sm_90 table tile and sparse_mla.FOCUS_TILES entry with the heuristic's
    head block, each with the heuristic's split rule (programs per SM: 2 for 4-warp tiles, else 1)."""
    tiles = list(dict.fromkeys(SM.candidate_tiles((9, 0), fmt) + SM.FOCUS_TILES.get(fmt, [])))
    out = [heuristic]
    for tile in tiles:
        bh = tile[0]
        if bh != heuristic.block_h and not (bh == 128 and H > 64):
            continue  # run 1 already showed the other head blocks losing on these shapes (128: new, H > 64 only)
        per_sm = 2 if tile[2] == 4 else 1
        s = 1 if prefill else SM.split_count(T, H, topk, tile, per_sm, sm_count)
        c = SM.SparseMLAConfig.from_tile(tile, s)
        if c not in out:
            out.append(c)
    return out


# What the mma.sync targets themselves launch (sm_80 and the sm_86/89/120 family: their own table tiles, not
# sm_90's), timed in the mma.sync child beside sm_90's pick; for fp8_ds_mla also with the tile scales applied
# after the dots (`f`: the raw e4m3 tile goes to shared memory once as bytes instead of twice dequantised, see
# the sm_8x tables in overlay/kernels/sparse_mla.py); on the H200's mma.sync build `f` measured 6-46% slower
# than each pick (bench/RESULTS.md, stop 28).
MMA_SYNC_CAPABILITIES = ((8, 0), (8, 9))

# Tiles no mma.sync table picks, timed beside the picks: where bench/sass_mix.py (a cross-compile, no GPU) finds a
# loop issuing far more instructions per KV row than another tile's, only a time decides. Stop 44 pointed at the
# 64-head bf16 pick h64n16w8 (449 warp instructions per row on sm_89 against h32n32w4's 231): stop 45 timed
# h32n32w4 2.4x faster on the mma.sync build, and it became the sm_80 / sm_86-89-120 64-head bf16 pick (its few
# spilled bytes checked by tests/kernels/test_sparse_mla_xcompile.py). What stays here was faster on that build
# but spills hundreds of bytes on sm_80-sm_120 (the H100 standing in has twice their L1 for it): bf16 h32n64w4
# (219 against 260 us at T=128 x 64 heads), fp8_ds_mla h32n32w4 (463 against the pick's 628); a real sm_8x card
# decides. Keyed by (cache format, heads); tags name what the tile is.
MMA_SYNC_LEADS = {
    ("bf16", 64): (("spills", "h32n64s1w4p2"),),
    ("bf16", 128): (("spills", "h32n64s1w4p2"),),
    ("fp8_ds_mla", 16): (("sm8x lead", "h16n32s1w4p2"), ("prefetch w4", "h16n32s1w4p2r"),
                         ("prefetch n64", "h16n64s1w8p2r")),
    ("fp8_ds_mla", 64): (("spills", "h32n32s1w4p2"), ("prefetch h64", "h64n16s1w8p2r"),
                         ("prefetch w4", "h32n16s1w4p2r"), ("sm80 prefetch h64", "h64n32s1w8p2r")),
    ("fp8_ds_mla", 128): (("spills", "h32n32s1w4p2"), ("prefetch h64", "h64n16s1w8p2r"),
                          ("prefetch w4", "h32n16s1w4p2r"), ("sm80 prefetch h64", "h64n32s1w8p2r")),
}


def mma_tile_configs(fmt, T, H, topk, sm_count) -> list[tuple[str, "SM.SparseMLAConfig"]]:
    """(tag, config): each mma.sync family's pick ("sm80 pick", "sm89 pick"), and for fp8_ds_mla its twin
    with the other fp8_post_scale ("sm80 alt"), with the raw-tile prefetch ("sm80 prefetch") and with the tiles decoded
    one iteration ahead ("sm80 ahead"); then MMA_SYNC_LEADS
    for this format and head count, each split by the heuristic's rule for its own tile ("sm8x lead"); a config timed
    under one tag is not timed again under another (a pick two families share is tagged with both: "sm80/sm89 pick")."""
    out, seen = [], set()
    for cap in MMA_SYNC_CAPABILITIES:
        c = SM.choose_config(T, H, topk, fmt, sm_count=sm_count, capability=cap)
        fam = f"sm{cap[0]}{cap[1]}"
        pairs = [(f"{fam} pick", c)]
        if fmt == "fp8_ds_mla":
            pairs.append((f"{fam} alt", replace(c, fp8_post_scale=not c.fp8_post_scale)))
            pairs.append((f"{fam} prefetch", replace(c, fp8_prefetch=1)))
            pairs.append((f"{fam} ahead", replace(c, fp8_prefetch=2)))
        if cap == MMA_SYNC_CAPABILITIES[-1]:
            for tag, tile in MMA_SYNC_LEADS.get((fmt, H), ()):
                lead = SM.SparseMLAConfig.from_string(tile)
                pairs.append((tag, replace(lead, num_splits=SM.split_count(T, H, topk, lead, 1, sm_count))))
        for tag, cfg in pairs:
            if cfg not in seen:
                seen.add(cfg)
                out.append((tag, cfg))
            elif tag.endswith(" pick"):
                i = next(i for i, (t, c) in enumerate(out) if c == cfg)
                if out[i][0].endswith(" pick"):
                    out[i] = (f"{out[i][0].split()[0]}/{tag}", cfg)
    return out


def mma_tile_rows(mma: dict) -> list[str]:
    """Report rows of the child's per-tile times (keys "label | tag | config"): shape, tag, config, us, and for
    fp8_ds_mla the ratio to the same family's bf16 pick on the same shape (the target: <= 1.2x)."""
    rows, bf16_pick = [], {}
    parsed = [(k.split(" | "), us) for k, us in mma.items() if k.count(" | ") == 2]
    for (label, tag, cfg), us in parsed:
        if label.startswith("bf16") and tag.endswith("pick"):
            for fam in tag.split()[0].split("/"):
                bf16_pick[(label[len("bf16"):], fam)] = us
    for (label, tag, cfg), us in parsed:
        ratio = "-"
        if label.startswith("fp8_ds_mla"):
            base = bf16_pick.get((label[len("fp8_ds_mla"):], tag.split()[0]))
            ratio = f"{us / base:.2f}x" if base and us else "-"
        rows.append(f"| {label} | {tag} | {cfg} | {fmt_us(us)} | {ratio} |")
    return rows


# ----------------------------------------------------------------------------------------------------
# copy bandwidth (the yardstick of the memory-bound targets)
# ----------------------------------------------------------------------------------------------------
def copy_bandwidth_tbps() -> float:
    if SMOKE:
        return float("nan")
    n = 1 << 30  # 1 GiB
    src = torch.empty(n, dtype=torch.uint8, device=DEVICE).fill_(3)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000.0)
    t = statistics.median(times)
    del src, dst
    return 2 * n / t / 1e12  # read + write


# ----------------------------------------------------------------------------------------------------
# data
# ----------------------------------------------------------------------------------------------------
def make_pools(seed: int):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    bf16 = torch.empty(NUM_SLOTS, 576, dtype=torch.bfloat16, device=DEVICE)
    fp8 = torch.empty(NUM_SLOTS, 656, dtype=torch.uint8, device=DEVICE)
    step = min(32768, NUM_SLOTS)
    for i in range(0, NUM_SLOTS, step):
        x = torch.randn(step, 576, generator=g, device=DEVICE)
        bf16[i:i + step] = x.to(torch.bfloat16)
        fp8[i:i + step] = quantize_fp8_ds_mla(x)[0]
    nb = NUM_SLOTS // BLOCK_SIZE
    return {"bf16": bf16.view(nb, BLOCK_SIZE, 576), "fp8_ds_mla": fp8.view(nb, BLOCK_SIZE, 656)}


# ----------------------------------------------------------------------------------------------------
# implementations
# ----------------------------------------------------------------------------------------------------
def load_flashmla():
    try:
        from vllm.v1.attention.ops import flashmla as F

        ok, why = F.is_flashmla_sparse_supported()
        if not ok:
            return None, f"FlashMLA sparse unsupported: {why}"
        return F, None
    except Exception as e:  # noqa: BLE001
        return None, f"import failed: {type(e).__name__}: {e}"


def flashmla_call(F, fmt, q, cache, idx, scale, one_sequence=False):
    """A zero-argument callable running FlashMLA sparse the way vLLM 0.23.0's FLASHMLA_SPARSE backend
    does (heads zero-padded to 64, or 128 above 64), returning a function that yields out [T, H, 512]."""
    T, H, _ = q.shape
    hp = 64 if H <= 64 else 128
    qp = q.new_zeros(T, hp, 576)
    qp[:, :H] = q
    topk = idx.shape[1]
    if fmt == "bf16":
        kv = cache.view(-1, 1, 576)
        ind = idx.view(T, 1, topk)

        def run():
            return F.flash_mla_sparse_fwd(qp, kv, ind, scale)[0][:, :H]
    else:
        kc = cache.view(torch.uint8).unsqueeze(-2)  # [num_blocks, block_size, 1, 656]
        # decode: T sequences of one query token; prefill-like: one sequence of T query tokens (vLLM's
        # mixed fp8 path)
        b, sq = (1, T) if one_sequence else (T, 1)
        q4 = qp.view(b, sq, hp, 576)
        ind = idx.view(b, sq, topk)
        sched, _ = F.get_mla_metadata()
        block_table = torch.zeros(b, 1, dtype=torch.int32, device=q.device)
        seqlens = torch.full((b,), NUM_SLOTS, dtype=torch.int32, device=q.device)

        def run():
            out, _ = F.flash_mla_with_kvcache(q=q4, k_cache=kc, block_table=block_table, cache_seqlens=seqlens,
                                              head_dim_v=512, tile_scheduler_metadata=sched,
                                              softmax_scale=scale, is_fp8_kvcache=True, indices=ind)
            return out.view(T, hp, 512)[:, :H]
    return run


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    o = out.float()
    if torch.isnan(o).any():
        return float("nan")
    return ((o - ref).abs().max() / ref.abs().max()).item()


# ----------------------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------------------
def sweep_configs(fmt, T, H, topk, sm_count, heuristic, prefill):
    seen, out = set(), []
    need = 16 if H <= 16 else (32 if H <= 32 else 64)
    for (bh, bn, nw, ns) in SWEEP_TILES[fmt]:
        if bh > need:
            continue  # more padded heads than real ones
        n_tiles = -(-topk // bn)
        groups = -(-H // bh)
        for s in (1,) if prefill else SPLITS:
            if s > n_tiles or (s > 1 and T * groups * s > 4 * sm_count):
                continue
            c = SM.SparseMLAConfig(block_h=bh, block_n=bn, num_splits=s, num_warps=nw, num_stages=ns)
            if c not in seen:
                seen.add(c)
                out.append(c)
    if heuristic not in seen:
        out.append(heuristic)
    return out


def fmt_us(x):
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.1f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="-", help="markdown report path (default: stdout)")
    ap.add_argument("--formats", default="bf16,fp8_ds_mla")
    ap.add_argument("--heads", default="8,16,64,128")
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--topk", type=int, default=TOPK)
    ap.add_argument("--sweep", choices=["none", "full"], default="full",
                    help="also time every candidate config per shape (default: full)")
    ap.add_argument("--no-prefill", action="store_true", help="skip the prefill-like shape")
    ap.add_argument("--prefill-tokens", type=int, default=4096, help="T of the prefill-like shape (H=64)")
    add_timing_args(ap, reps=20)
    ap.add_argument("--budget-s", type=float, default=None,
                    help="stop sweeping (keep heuristic + FlashMLA rows) once this much time has passed")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--focus", action="store_true",
                    help="only the shapes that missed a target in run 1 (+ T=1), timing the heuristic and the "
                         "kernel variants under evaluation (sparse_mla.FOCUS_TILES); < 150 s on an H200")
    ap.add_argument("--baseline", default=None,
                    help="an earlier full report of this script; --focus shows each config's time there "
                         "(default: bench/results/h200-sparse_mla-run1.md)")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="tiny shapes on the CPU via TRITON_INTERPRET=1 (checks the script, not the GPU)")
    args = ap.parse_args()
    if args.budget_s is None:
        args.budget_s = 120.0 if args.focus else 300.0
    child = args.mma_sync_child is not None

    mma, mma_note = mma_sync_column(args, __file__)

    t_start = time.time()
    global NUM_SLOTS, FLUSH_BYTES
    if SMOKE:
        from tools.triton_interp import numpy24_fix

        numpy24_fix()
        NUM_SLOTS, FLUSH_BYTES = 1024, 1 << 20
        # one call per column: the interpreter takes seconds per call
        args.reps, args.replays, args.launch_calls, args.topk = 1, 1, 1, min(args.topk, 256)
        dev_name, cap, sm_count, mem_gib = "CPU (Triton interpreter smoke run)", (9, 0), 132, 0
    else:
        assert torch.cuda.is_available(), "needs a CUDA GPU (or --cpu-smoke)"
        dev = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(dev)
        cap = torch.cuda.get_device_capability(dev)
        sm_count = props.multi_processor_count
        dev_name, mem_gib = props.name, props.total_memory / 2**30
    import triton

    F, flash_err = (None, "not timed in the mma.sync child") if child else load_flashmla()
    try:
        import vllm

        vllm_ver = vllm.__version__
    except Exception:  # noqa: BLE001
        vllm_ver = "not importable"

    bw = float("nan") if child else copy_bandwidth_tbps()
    pools = make_pools(args.seed)
    timer = Timer(DEVICE, args.reps, args.replays, args.launch_calls, flush_bytes=FLUSH_BYTES)
    formats = args.formats.split(",")
    heads = [int(x) for x in args.heads.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    shapes = [(fmt, T, H, False) for fmt in formats for H in heads for T in batches]
    if not args.no_prefill:
        shapes += [(fmt, args.prefill_tokens, 64, True) for fmt in formats]
    if args.focus:
        shapes = [(f, (args.prefill_tokens if p else T), H, p) for f, T, H, p in FOCUS_SHAPES if f in formats]
        if SMOKE:
            shapes = [(f, min(T, 4), H, p) for f, T, H, p in shapes]
    baseline_path = args.baseline or (BASELINE if args.focus else None)
    baseline = load_baseline(baseline_path) if args.focus else {}

    focus_rows, main_rows, sweep_rows, child_times = [], [], [], {}
    g = torch.Generator(device=DEVICE).manual_seed(args.seed + 1)
    for fmt, T, H, prefill in shapes:
        topk = args.topk
        cache = pools[fmt]
        q = (torch.randn(T, H, 576, generator=g, device=DEVICE)).to(torch.bfloat16)
        idx = torch.randint(0, NUM_SLOTS, (T, topk), generator=g, device=DEVICE, dtype=torch.int32)
        scale = 576 ** -0.5
        gathered = T * topk * BYTES_PER_TOKEN[fmt]
        flops = 2.0 * T * H * topk * (576 + 512)
        reps = max(2, args.reps // 8) if prefill else args.reps
        label = f"{fmt} T={T} H={H}{' (prefill)' if prefill else ''}"
        out = torch.empty(T, H, 512, dtype=torch.bfloat16, device=DEVICE)
        lse = torch.empty(T, H, dtype=torch.float32, device=DEVICE)

        def ours(cfg):
            return lambda: SM.sparse_mla_attention(q, cache, idx, scale, fmt, out=out, lse=lse, config=cfg)

        # As the TRITON_MLA_SPARSE backend calls it: q as vLLM's (q_nope, q_pe) pair of views, request-local
        # positions through a block table (one request whose table maps position p to slot p: the same rows)
        table = torch.arange(NUM_SLOTS // BLOCK_SIZE, dtype=torch.int32, device=DEVICE).view(1, -1)
        req = torch.zeros(T, dtype=torch.int32, device=DEVICE)

        def backend_call(cfg):
            return lambda: SM.sparse_mla_attention((q[..., :512], q[..., 512:]), cache, idx, scale, fmt, out=out,
                                                   lse=lse, config=cfg, block_table=table, req_id=req)

        # the mma.sync build stands for sm_80-sm_120, which never get the sm_90 Gluon tile: the child times the
        # Triton tile sm_90 would run without it (a Gluon kernel ignores DISABLE_MMA_V3: its wgmma is explicit)
        heur = SM.choose_config(T, H, topk, fmt, sm_count=sm_count, capability=cap, gluon=False if child else None)
        if child:  # the mma.sync build: our heuristic's time, then the mma.sync targets' own tiles
            for key, cfg in [(label, heur)] + [(f"{label} | {tag} | {c}", c)
                                               for tag, c in mma_tile_configs(fmt, T, H, topk, sm_count)]:
                try:
                    child_times[key] = rank_us(timer.measure(ours(cfg), reps, eager=not timer.cuda, launch=False))
                except Exception as e:  # noqa: BLE001
                    print(f"{key}: {type(e).__name__}: {e}", file=sys.stderr)
            del q, idx, out, lse
            continue

        nref = min(T, 256)
        ref_o, _ = SM.sparse_mla_reference(q[:nref], cache, idx[:nref], scale, fmt)

        def perf(us):
            if us is None or us <= 0:
                return "-", "-"
            return f"{gathered / us / 1e6:.2f}", f"{flops / us / 1e6:.1f}"

        # FlashMLA
        flash, flash_note = Timing(), ""
        if F is not None:
            try:
                run = flashmla_call(F, fmt, q, cache, idx, scale, one_sequence=prefill)
                err = rel_err(run()[:nref], ref_o)
                flash = timer.measure(run, reps)
                flash_note = f"{err:.1e}"
            except Exception as e:  # noqa: BLE001
                flash_note = f"ERROR {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
        else:
            flash_note = f"ERROR {flash_err}"
        flash_us = rank_us(flash)

        def measure(cfg, full=False):
            """(Timing, err, note): every column when `full`, else the ranking time only."""
            try:
                out.fill_(float("nan"))
                ours(cfg)()
                err = rel_err(out[:nref], ref_o)
                t = timer.measure(ours(cfg), reps, eager=full or not timer.cuda, launch=full)
                return t, err, t.note
            except Exception as e:  # noqa: BLE001
                return Timing(), float("nan"), f"ERROR {type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"

        h_t, h_err, h_note = measure(heur, full=True)
        results = [(heur, h_t, h_err, h_note)]
        backend = {}  # inline conversion where the kernel module picks it (latency regime), and the conversion launch
        for inline in (True, False):
            SM.INLINE_PAGED = inline
            reset_plans()
            try:
                out.fill_(float("nan"))
                backend_call(heur)()
                err, t = rel_err(out[:nref], ref_o), timer.measure(backend_call(heur), reps, eager=True, launch=True)
                backend[inline] = (t, err, t.note)
            except Exception as e:  # noqa: BLE001
                backend[inline] = (Timing(), float("nan"), f"ERROR {type(e).__name__}: {str(e)[:100]}")
        SM.INLINE_PAGED = True
        reset_plans()
        if (args.sweep == "full" or args.focus) and time.time() - t_start < args.budget_s:
            cands = (focus_configs(fmt, T, H, topk, sm_count, heur, prefill) if args.focus
                     else sweep_configs(fmt, T, H, topk, sm_count, heur, prefill))
            for cfg in cands:
                if cfg == heur:
                    continue
                if time.time() - t_start > args.budget_s:
                    results.append((cfg, Timing(), float("nan"), "skipped: time budget"))
                    break
                results.append((cfg, *measure(cfg)))
        timed = [r for r in results if rank_us(r[1]) is not None and not math.isnan(r[2]) and r[2] < 2e-2]
        best = min(timed, key=lambda r: rank_us(r[1])) if timed else None
        if best is not None and best[0] != heur:  # the eager and launch columns of the winner too
            try:
                more = timer.measure(ours(best[0]), reps, graph=False)
                best = (best[0], Timing(best[1].graph_us, more.eager_us, more.launch_us, best[1].note), *best[2:])
            except Exception:  # noqa: BLE001 - its graph time stands alone
                pass

        # torch gather reference (eager, informative only)
        ref_t = Timing()
        if not prefill and not args.focus:
            try:
                ref_t = Timing(eager_us=timer.eager_us(lambda: SM.sparse_mla_reference(q, cache, idx, scale, fmt), 3))
            except Exception:  # noqa: BLE001
                pass

        def verdict(us):
            if us is None:
                return "-"
            notes = []
            ratio = flash_us / us if flash_us else None

            def vs(limit):
                return "? (no FlashMLA time)" if ratio is None else ("yes" if ratio >= limit else "NO")

            if prefill:
                notes.append(vs(0.6) + " (>=0.6x FlashMLA)")
            elif H <= 64:
                notes.append(vs(1.0) + " (<= FlashMLA)")
                if T == 1:
                    notes.append(("yes" if us < 15 else "NO") + " (<15 us)")
                if gathered >= 64e6:
                    eff = gathered / us / 1e6
                    notes.append(("yes" if eff >= 0.8 * bw else "NO") + f" ({eff / bw * 100:.0f}% of copy BW)")
            elif H == 128 and T == 128:
                notes.append(vs(0.7) + " (>=0.7x FlashMLA)")
            return ", ".join(notes) if notes else "-"

        def err_cell(err, note):
            return note or (f"{err:.1e}" if err == err else "-")

        def row(impl, cfg, t: Timing, mma_us, err_or_note):
            us = rank_us(t)
            tb, tf = perf(us)
            ratio = f"{flash_us / us:.2f}" if flash_us and us else "-"
            cols = t.cells(fmt_us) + ([fmt_us(mma_us)] if args.mma_sync else [])
            main_rows.append(f"| {label} | {impl} | {cfg} | {' | '.join(cols)} | {tb} | {tf} | {ratio} | "
                             f"{err_or_note} | {verdict(us) if impl.startswith('ours') else '-'} |")

        row("ours (heuristic)", str(heur), h_t, mma.get(label), err_cell(h_err, h_note))
        for inline, what in ((True, "as shipped"), (False, "conversion launch")):
            t, err, note = backend[inline]
            row(f"ours (heuristic, backend call: q pair, request-local indices, {what})", str(heur), t, None,
                err_cell(err, note))
        if best is not None:
            row("ours (best of sweep)", str(best[0]), best[1], None, err_cell(best[2], ""))
        row("FlashMLA", (f"{'decode fp8' if fmt != 'bf16' else 'sparse_fwd'} (heads padded to "
                         f"{64 if H <= 64 else 128})") if flash_us else "-", flash, None, flash_note)
        if not prefill and not args.focus:
            row("torch reference (fp32)", "-", ref_t, None, "0")
        ordered = sorted(results, key=lambda r: (rank_us(r[1]) is None, rank_us(r[1]) or 0))
        sweep_rows.append(f"| {label} | " + ", ".join(
            f"{c}: {fmt_us(rank_us(t))}{'' if (rank_us(t) is None or (err == err and err < 2e-2)) else f' (err {err:.1e})'}"
            f"{' ' + note if note and rank_us(t) is None else ''}" for c, t, err, note in ordered) + " |")
        if args.focus:
            base = baseline.get(label, {})
            base_best = min(base.values()) if base else None
            for c, t, err, note in ordered:
                us = rank_us(t)
                tb, tf = perf(us)
                ratio = f"{flash_us / us:.2f}" if flash_us and us else "-"
                b = base.get(str(c))
                was = "-" if b is None else f"{b:.1f}{' (best there)' if b == base_best else ''}"
                focus_rows.append(
                    f"| {label} | {c}{' **(heuristic)**' if c == heur else ''} | {describe(c)} | "
                    f"{' | '.join(t.cells(fmt_us))} | {tb} | {tf} | {ratio} | {fmt_us(flash_us)} | {was} | "
                    f"{err_cell(err, note)} | {verdict(us) if us else '-'} |")
        print(f"[{time.time() - t_start:6.1f}s] {label}: ours graph/eager/launch "
              f"{'/'.join(h_t.cells(fmt_us))} us (best {fmt_us(rank_us(best[1]) if best else None)}"
              f" {best[0] if best else ''}), FlashMLA {'/'.join(flash.cells(fmt_us))} us "
              f"{flash_note if not flash_us else ''}", file=sys.stderr, flush=True)
        del q, idx, out, lse, ref_o
        if not SMOKE:
            torch.cuda.empty_cache()

    if child:
        write_child_json(args.mma_sync_child, child_times)
        return
    rep = io.StringIO()
    w = rep.write
    w("# Sparse MLA attention benchmark\n\n")
    w(f"- date: {datetime.datetime.now().isoformat(timespec='minutes')}\n")
    w(f"- device: {dev_name}, sm_{cap[0]}{cap[1]}, {sm_count} SMs, {mem_gib:.0f} GiB\n")
    w(f"- torch {torch.__version__}, triton {triton.__version__}, vLLM {vllm_ver}"
      f"{'' if F else f' (FlashMLA: {flash_err})'}\n")
    w(f"- KV pool {NUM_SLOTS} slots (block size {BLOCK_SIZE}), topk {args.topk}, random slot ids (duplicates "
      f"possible, none removed); timing by bench/timing.py: L2 flushed by a {FLUSH_BYTES >> 20} MB write "
      f"before every graph and eager call, {args.reps} calls per graph (prefill: {max(2, args.reps // 8)}), "
      f"median of {args.replays} replays; launch = {args.launch_calls} back-to-back calls\n")
    w(f"- device copy bandwidth (1 GiB copy, read+write): **{bw:.2f} TB/s**\n")
    if args.mma_sync:
        w(f"- {mma_note}\n")
    w(f"- command: `{' '.join([os.path.basename(sys.executable)] + sys.argv)}`\n\n")
    w("Columns: graph us = GPU time per call by CUDA-graph replay; eager us = one plain call (host launch "
      "+ GPU, what calls outside vLLM's graphs pay); launch us = host time to launch one call"
      f"{MMA_COLUMN_NOTE if args.mma_sync else ''}"
      "; TB/s = gathered bytes / graph time; vs FlashMLA = FlashMLA graph time / ours "
      "(> 1 means faster); err = max|out - ref| / max|ref| against the float32 torch reference.\n"
      "Targets (issue 3): decode H <= 64: ours <= FlashMLA in the same format, and T = 1 under 15 us; "
      "memory-bound shapes (H <= 64, gathered >= 64 MB): >= 80% of the copy bandwidth; H = 128, T = 128: "
      ">= 0.7x FlashMLA; prefill T = 4096, H = 64: >= 0.6x FlashMLA sparse prefill.\n\n")
    if args.focus:
        w("## Focus: kernel variants on the shapes that missed a target in run 1\n\n"
          "Every row is one launch configuration of our kernel on one shape, fastest first within a shape. "
          "`(heuristic)` marks what `choose_config` picks now; its eager and launch columns are measured, "
          "the variants' only by graph. Config string: "
          "h<heads per program>n<KV rows per iteration>s<top-k splits>w<warps>p<pipeline stages>, then "
          "`d2` = the 512 value columns split over 2 programs (each recomputes the scores, half the fp32 "
          "accumulator), `f` = fp8 tile scales applied to the scores/P after/before the dots instead of "
          "dequantising the tile, `g` = the sm_90 Gluon kernel, `r` = the next block's raw fp8 tiles prefetched "
          "into registers, `a` = the next block's fp8 tiles gathered and decoded one iteration ahead. "
          f"baseline us = the same config's time in "
          f"{os.path.relpath(baseline_path, ROOT) if baseline_path else 'no baseline'} "
          f"({'not found' if not baseline else 'if it was timed there'}). "
          "vs FlashMLA = FlashMLA us / ours (> 1: ours faster). A variant that "
          "beats the heuristic by > 3% on a shape class should replace that table entry in "
          "overlay/kernels/sparse_mla.py (_TILE_TABLE / _LATENCY_TILE); every FOCUS_TILES entry is "
          "already cross-compiled for sm_90 without spills by the CPU tests.\n\n"
          "| shape | config | what | graph us | eager us | launch us | TB/s | TFLOP/s | vs FlashMLA | "
          "FlashMLA us | baseline us | err | target met? |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
        w("\n".join(focus_rows) + "\n\n")
    mma_head = " mma.sync us |" if args.mma_sync else ""
    w(f"## Results\n\n| shape | impl | config | graph us | eager us | launch us |{mma_head} TB/s | TFLOP/s | "
      "vs FlashMLA | err | target met? |\n")
    w("|---" * (11 + bool(args.mma_sync)) + "|\n")
    w("\n".join(main_rows) + "\n\n")
    if args.mma_sync and mma_tile_rows(mma):
        w("## The mma.sync build by tile (DISABLE_MMA_V3=1: the sm_80 and sm_86/89/120 tables' own picks, graph "
          "us; pick = what choose_config launches for that family, alt = the same tile with the other fp8 scale "
          "placement; fp8 vs bf16 = this time / the family's bf16 pick on the same T and H)\n\n"
          "| shape | family | config | mma.sync us | fp8 vs bf16 |\n|---|---|---|---|---|\n")
        w("\n".join(mma_tile_rows(mma)) + "\n\n")
    w("## Sweep (every candidate config per shape, fastest first, graph us; config = "
      "h<block_h>n<block_n>s<num_splits>w<num_warps>p<num_stages>)\n\n| shape | config: us |\n|---|---|\n")
    w("\n".join(sweep_rows) + "\n\n")
    w(f"Total benchmark wall time: {time.time() - t_start:.0f} s\n")
    text = rep.getvalue()
    if args.out == "-":
        sys.stdout.write(text)
    else:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)
        print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    try:
        main()
    except Exception:
        traceback.print_exc()
        sys.exit(1)
