"""H200 benchmark: dsa-overlay's Triton indexer logits vs DeepGEMM (through vLLM's wrappers) and
vLLM 0.17.1's torch fallback, on GLM-5 indexer shapes (32 heads, D = 128).

One process, unattended, under 4 minutes.  Needs a CUDA GPU, torch, triton and an importable vLLM
(0.23.0 staged on PYTHONPATH: `vllm.utils.deep_gemm` gives DeepGEMM, `vllm._custom_ops` writes the
paged cache the way serving does).  Every upstream failure is printed in the table and the run goes on.

    PYTHONPATH=<staged vllm 0.23.0>:. python bench/bench_indexer.py \\
        --fallback-src .stage/vllm0171_deep_gemm.py --out "$OUT/bench_indexer.md"

--fallback-src: vLLM 0.17.1's `vllm/utils/deep_gemm.py` (or the 0.17.1 wheel); only the functions
`fp8_mqa_logits_torch` and `fp8_paged_mqa_logits_torch` are taken from it (parsed with `ast`, run
with torch), never stored in this repository.  Without it the torch column is skipped.

Per row: correctness first (max |ours - DeepGEMM| over the visible positions relative to max |DG|,
each kernel's max error vs a float64 torch reference on a sample of rows, and the overlap of the
top-2048 sets of ours and DeepGEMM), then timing by bench/timing.py: graph (GPU time by CUDA-graph
replay), eager (one plain call) and launch (host time per call) for ours and DeepGEMM, L2 flushed
before every graph and eager call.  `--mma-sync` adds our kernel built for mma.sync (a child run
with DISABLE_MMA_V3=1, its own TRITON_CACHE_DIR, the Triton kernel where sm_90 picks its Gluon one); with --focus
the child also times the sm_89/120 and sm_80/86 launch tables' own picks (MMA_FAMILIES, FAMILY_VARIANTS), a table
of their own against our wgmma default.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import math
import os
import pathlib
import sys
import time
import traceback
import zipfile
from dataclasses import replace

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# --cpu-smoke: exercise this script on a CPU (Triton interpreter, tiny shapes, wall-clock timing,
# no DeepGEMM) before spending GPU time on it.
CPU_SMOKE = "--cpu-smoke" in sys.argv
DEV = "cpu" if CPU_SMOKE else "cuda"
if CPU_SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

from bench.timing import (Timer, Timing, add_timing_args, mma_sync_column, rank_us,  # noqa: E402
                          write_child_json)
from overlay.kernels import indexer as ours  # noqa: E402

if CPU_SMOKE:  # Triton <= 3.6 interpreter vs numpy >= 2.4 (triton-lang/triton#9171)
    from tools.triton_interp import numpy24_fix

    numpy24_fix()

D = 128
HEADS = 32
BLOCK_SIZE = 64
TOPK = 2048
FP8 = torch.float8_e4m3fn


# ------------------------------------------------------------------------------------------------
# Upstream implementations
# ------------------------------------------------------------------------------------------------


class _Upstream:
    """DeepGEMM through vllm.utils.deep_gemm (0.23.0 fp8_fp4_* names, else 0.16.0 names)."""

    @classmethod
    def standin(cls):
        """--cpu-smoke: our own kernels in DeepGEMM's place, so every code path of a row runs."""
        self = cls.__new__(cls)
        self.error, self.version, self.ops, self.fp4_names = None, "n/a (stand-in)", None, True

        class _DG:
            fp8_fp4_mqa_logits = staticmethod(ours.fp8_fp4_mqa_logits)
            fp8_fp4_paged_mqa_logits = staticmethod(ours.fp8_fp4_paged_mqa_logits)
            get_paged_mqa_logits_metadata = staticmethod(ours.get_paged_mqa_logits_metadata)

        self.dg = _DG
        return self

    def __init__(self):
        self.error = None
        self.version = "?"
        try:
            import vllm
            import vllm.utils.deep_gemm as dg

            self.version = getattr(vllm, "__version__", "?")
            self.dg = dg
            self.fp4_names = hasattr(dg, "fp8_fp4_mqa_logits")
        except Exception as e:  # noqa: BLE001 - reported in the table
            self.error = f"import vllm.utils.deep_gemm: {type(e).__name__}: {e}"
        try:
            from vllm import _custom_ops as ops

            self.ops = ops if hasattr(ops, "indexer_k_quant_and_cache") else None
        except Exception:  # noqa: BLE001
            self.ops = None

    def prefill(self, q, kv, w, ks, ke):
        if self.error:
            raise RuntimeError(self.error)
        if self.fp4_names:
            return self.dg.fp8_fp4_mqa_logits((q, None), kv, w, ks, ke, clean_logits=False)
        return self.dg.fp8_mqa_logits(q, kv, w, ks, ke, clean_logits=False)

    def metadata(self, cl):
        if self.error:
            raise RuntimeError(self.error)
        sms = _num_sms()
        return self.dg.get_paged_mqa_logits_metadata(cl, BLOCK_SIZE, sms)

    def decode(self, q, cache, w, cl, tables, meta, max_model_len):
        if self.error:
            raise RuntimeError(self.error)
        if self.fp4_names:
            return self.dg.fp8_fp4_paged_mqa_logits((q, None), cache, w, cl, tables, meta,
                                                    max_model_len, clean_logits=False)
        return self.dg.fp8_paged_mqa_logits(q, cache, w, cl, tables, meta, max_model_len,
                                            clean_logits=False)


def _num_sms():
    return 4 if CPU_SMOKE else torch.cuda.get_device_properties(0).multi_processor_count


def _empty_cache():
    if not CPU_SMOKE:
        torch.cuda.empty_cache()


class _Platform:
    @staticmethod
    def fp8_dtype():
        return FP8


def load_torch_fallback(path: str | None):
    """(fp8_mqa_logits_torch, fp8_paged_mqa_logits_torch, note) from vLLM 0.17.1's deep_gemm.py."""
    if not path:
        return None, None, "no --fallback-src given"
    try:
        if path.endswith(".whl"):
            with zipfile.ZipFile(path) as z:
                src = z.read("vllm/utils/deep_gemm.py").decode()
        else:
            src = pathlib.Path(path).read_text()
        tree = ast.parse(src)
        wanted = {"fp8_mqa_logits_torch", "fp8_paged_mqa_logits_torch"}
        funcs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in wanted]
        if {f.name for f in funcs} != wanted:
            return None, None, f"{path} lacks {wanted - {f.name for f in funcs}}"
        ns = {"torch": torch, "current_platform": _Platform(),
              "cdiv": lambda a, b: -(-a // b)}
        exec(compile(ast.Module(body=funcs, type_ignores=[]), path, "exec"), ns)  # noqa: S102
        return ns["fp8_mqa_logits_torch"], ns["fp8_paged_mqa_logits_torch"], path
    except Exception as e:  # noqa: BLE001
        return None, None, f"{path}: {type(e).__name__}: {e}"


# ------------------------------------------------------------------------------------------------
# Inputs
# ------------------------------------------------------------------------------------------------


def _quant_tokens(k):
    scale = k.float().abs().amax(-1).clamp_min(1e-4) / 448.0
    scale = torch.exp2(torch.ceil(torch.log2(scale)))
    return (k.float() / scale[:, None]).clamp(-448, 448).to(FP8), scale.contiguous()


def prefill_inputs(M, N, g):
    """The last M tokens of an N-token causal sequence: query i sees keys [0, N - M + i]."""
    q = (torch.randn(M, HEADS, D, device=DEV, generator=g) * 2).to(FP8)
    k, sc = _quant_tokens(torch.randn(N, D, device=DEV, generator=g).bfloat16())
    w = torch.randn(M, HEADS, device=DEV, generator=g) * HEADS ** -0.5
    ks = torch.zeros(M, dtype=torch.int32, device=DEV)
    ke = (N - M + 1 + torch.arange(M, device=DEV)).to(torch.int32)
    return q, (k, sc), w, ks, ke


def decode_inputs(B, ctx, next_n, g, upstream):
    blocks = math.ceil(ctx / BLOCK_SIZE)
    nb = B * blocks
    cache = torch.zeros(nb, BLOCK_SIZE, D + 4, dtype=torch.uint8, device=DEV)
    tables = torch.randperm(nb, device=DEV, generator=g).to(torch.int32).reshape(B, blocks)
    pos = torch.arange(ctx, device=DEV)
    writer = "vllm ops.indexer_k_quant_and_cache"
    for b in range(B):
        keys = torch.randn(ctx, D, device=DEV, generator=g).bfloat16()
        slots = tables[b, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE
        if upstream.ops is not None:
            upstream.ops.indexer_k_quant_and_cache(keys, cache, slots, D, "ue8m0")
        else:
            writer = "overlay.kernels.indexer.indexer_k_quant_and_cache_ref"
            ours.indexer_k_quant_and_cache_ref(keys, cache, slots, D, "ue8m0")
    q = (torch.randn(B, next_n, HEADS, D, device=DEV, generator=g) * 2).to(FP8)
    w = torch.randn(B * next_n, HEADS, device=DEV, generator=g) * HEADS ** -0.5
    j = torch.arange(next_n, device=DEV, dtype=torch.int32)
    cl = (ctx - next_n + 1 + j)[None, :].repeat(B, 1).contiguous()    # vLLM 0.23.0: [B, next_n]
    return q, cache.unsqueeze(-2), w, cl, tables, writer


# ------------------------------------------------------------------------------------------------
# Measuring
# ------------------------------------------------------------------------------------------------

def _err(e: BaseException) -> str:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {msg[:90]}".replace("|", "/")


def _visible_mask_prefill(ks, ke, N):
    n = torch.arange(N, device=DEV)
    return (n[None, :] >= ks[:, None]) & (n[None, :] < ke[:, None])


def _visible_mask_decode(cl, max_model_len):
    n = torch.arange(max_model_len, device=DEV)
    return n[None, :] < cl.reshape(-1)[:, None]


def compare(a, b, mask):
    """(max |a - b| / max |b| over mask, mean top-k overlap over rows with > TOPK visible)."""
    va = torch.where(mask, a, float("-inf"))
    vb = torch.where(mask, b, float("-inf"))
    diff = (va - vb).abs()[mask]
    rel = (diff.max() / vb[mask].abs().max().clamp_min(1e-30)).item() if diff.numel() else 0.0
    if not math.isfinite(rel):
        rel = float("nan")
    rows = mask.sum(1) > TOPK
    if rows.any():
        ia = va[rows].topk(TOPK, dim=1).indices.sort(1).values
        ib = vb[rows].topk(TOPK, dim=1).indices.sort(1).values
        hits = torch.zeros(ia.shape[0], device=DEV)
        for r in range(ia.shape[0]):   # rows sampled below keep this loop short
            hits[r] = torch.isin(ia[r], ib[r]).float().mean()
        overlap = hits.mean().item()
    else:
        overlap = float("nan")
    return rel, overlap


def fp64_rows_prefill(q, kv, w, ks, ke, rows):
    k, sc = kv
    kd = k.double() * sc.double()[:, None]
    s = torch.einsum("mhd,nd->mhn", q[rows].double(), kd).clamp_min(0)
    ref = (s * w[rows].double()[:, :, None]).sum(1)
    return ref, _visible_mask_prefill(ks[rows], ke[rows], k.shape[0])


def fp64_rows_decode(q, cache, w, cl, tables, rows, max_model_len):
    vals, scales = ours._read_paged_cache(cache)
    B, next_n = q.shape[:2]
    out = torch.zeros(len(rows), max_model_len, dtype=torch.float64, device=DEV)
    pos = torch.arange(max_model_len, device=DEV)
    for i, r in enumerate(rows):
        b, j = divmod(r, next_n)
        blk = tables[b, (pos // BLOCK_SIZE).clamp_max(tables.shape[1] - 1)].long()
        k = vals[blk, pos % BLOCK_SIZE].double() * scales[blk, pos % BLOCK_SIZE].double()[:, None]
        s = (q[b, j].double() @ k.T).clamp_min(0)
        out[i] = (s * w[r].double()[:, None]).sum(0)
    return out, _visible_mask_decode(cl, max_model_len)[rows]


def max_rel_err(got, ref, mask):
    g = got[mask].double()
    if torch.isnan(g).any():
        return f"NaN ({torch.isnan(g).float().mean().item():.0%})"
    d = (g - ref[mask]).abs().max()
    return (d / ref[mask].abs().max().clamp_min(1e-30)).item()


def fmt(x, unit=""):
    if isinstance(x, str):
        return x
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    if unit == "us":
        return f"{x:.1f}" if x < 1000 else f"{x:.0f}"
    if unit == "x":
        return f"{x:.2f}x"
    if unit == "e":
        return f"{x:.1e}"
    if unit == "%":
        return f"{100 * x:.1f}%"
    return str(x)


# ------------------------------------------------------------------------------------------------
# Rows
# ------------------------------------------------------------------------------------------------


def _fmt_us(x):
    return fmt(x, "us")


def run_prefill(M, N, upstream, fb_prefill, timer, g, child=False):
    row = {"case": f"prefill M={M} N={N}"}
    q, kv, w, ks, ke = prefill_inputs(M, N, g)
    call = lambda: ours.fp8_mqa_logits(q, kv, w, ks, ke, False)  # noqa: E731
    if child:   # the mma.sync build: our time only
        row["ours"] = timer.measure(call, eager=not timer.cuda, launch=False)
        return row
    sample = torch.linspace(0, M - 1, 12, device=DEV).long()
    mask = _visible_mask_prefill(ks, ke, N)
    a = ours.fp8_mqa_logits(q, kv, w, ks, ke, False)
    ref, rmask = fp64_rows_prefill(q, kv, w, ks, ke, sample)
    row["err_ours"] = max_rel_err(a[sample], ref, rmask)
    try:
        b = upstream.prefill(q, kv, w, ks, ke)
        b = b[:, :N] if b.shape[1] != N else b
        row["err_dg"] = max_rel_err(b[sample], ref, rmask)
        rows = torch.linspace(0, M - 1, 64, device=DEV).long()
        row["diff"], row["overlap"] = compare(a[rows], b[rows], mask[rows])
        del b
        row["dg"] = timer.measure(lambda: upstream.prefill(q, kv, w, ks, ke))
    except Exception as e:  # noqa: BLE001
        row["dg"] = f"DeepGEMM failed: {_err(e)}"
    del a
    row["ours"] = timer.measure(call)
    if fb_prefill is None:
        row["torch_us"] = "skipped"
    else:
        need = 3 * HEADS * M * N * 4
        if need > 60e9:
            row["torch_us"] = f"skipped (needs ~{need / 1e9:.0f} GB)"
        else:
            try:
                c = fb_prefill(q, kv, w, ks, ke)
                row["err_torch"] = max_rel_err(c[sample], ref, rmask)
                del c
                row["torch_us"] = timer.eager_us(lambda: fb_prefill(q, kv, w, ks, ke), 2)
            except Exception as e:  # noqa: BLE001
                row["torch_us"] = f"failed: {_err(e)}"
            _empty_cache()
    return row


def run_decode(B, ctx, next_n, upstream, fb_decode, timer, g, child=False):
    row = {"case": f"decode B={B} ctx={ctx // 1024}K next_n={next_n}"}
    q, cache, w, cl, tables, row["writer"] = decode_inputs(B, ctx, next_n, g, upstream)
    mml = ctx
    meta_ours = ours.get_paged_mqa_logits_metadata(cl, BLOCK_SIZE, 132)
    call = lambda: ours.fp8_paged_mqa_logits(q, cache, w, cl, tables, meta_ours, mml, False)  # noqa: E731
    if child:   # the mma.sync build: our time only
        row["ours"] = timer.measure(call, eager=not timer.cuda, launch=False)
        return row
    mask = _visible_mask_decode(cl, mml)
    a = call()
    sample = sorted(set(torch.linspace(0, B * next_n - 1, 8).long().tolist()))
    ref, rmask = fp64_rows_decode(q, cache, w, cl, tables, sample, mml)
    row["err_ours"] = max_rel_err(a[sample], ref, rmask)
    try:
        meta = upstream.metadata(cl)
        b = upstream.decode(q, cache, w, cl, tables, meta, mml)[:, :mml]
        row["err_dg"] = max_rel_err(b[sample], ref, rmask)
        rows = sample
        row["diff"], row["overlap"] = compare(a[rows], b[rows], mask[rows])
        del b
        row["dg"] = timer.measure(lambda: upstream.decode(q, cache, w, cl, tables, meta, mml))
    except Exception as e:  # noqa: BLE001
        row["dg"] = f"DeepGEMM failed: {_err(e)}"
    row["ours"] = timer.measure(call)
    if fb_decode is None:
        row["torch_us"] = "skipped"
    else:
        iters = B * math.ceil(ctx / BLOCK_SIZE)
        if iters > 4096:
            row["torch_us"] = f"skipped ({iters} python block iterations)"
        else:
            try:
                cl1 = cl[:, -1].contiguous()   # 0.17.1's fallback takes [B] context lengths
                t0 = time.perf_counter()
                c = fb_decode(q, cache, w, cl1, tables, mml)
                timer.sync()
                first = (time.perf_counter() - t0) * 1e6
                row["err_torch"] = max_rel_err(c[sample], ref, rmask)
                row["torch_us"] = (timer.eager_us(lambda: fb_decode(q, cache, w, cl1, tables, mml), 1)
                                   if first < 2e6 else first)
            except Exception as e:  # noqa: BLE001
                row["torch_us"] = f"failed: {_err(e)}"
    del cache
    _empty_cache()
    return row


# ------------------------------------------------------------------------------------------------
# Config sweep (for choosing the defaults; spends whatever time is left)
# ------------------------------------------------------------------------------------------------

PREFILL_SWEEP = [
    dict(),   # the shipped default
    dict(BLOCK_N=128, BT=8, num_warps=8, num_stages=3),
    dict(BLOCK_N=128, BT=8, num_warps=8, num_stages=4),
    dict(BLOCK_N=128, BT=8, num_warps=8, num_stages=2),
    dict(BLOCK_N=128, BT=4, num_warps=8, num_stages=3),
    dict(BLOCK_N=128, BT=4, num_warps=4, num_stages=4),
    dict(BLOCK_N=64, BT=8, num_warps=4, num_stages=4),
    dict(BLOCK_N=256, BT=4, num_warps=8, num_stages=3),
]
DECODE_SWEEP = [
    dict(),   # the shipped default for each shape
    dict(BLOCK_N=64, num_warps=4, num_stages=3, per_sm=4),
    dict(BLOCK_N=64, num_warps=4, num_stages=4, per_sm=4),
    dict(BLOCK_N=64, num_warps=4, num_stages=3, per_sm=8),
    dict(BLOCK_N=64, num_warps=4, num_stages=3, per_sm=2),
    dict(BLOCK_N=128, num_warps=4, num_stages=3, per_sm=4),
    dict(BLOCK_N=128, num_warps=8, num_stages=3, per_sm=2),
    dict(BLOCK_N=64, num_warps=2, num_stages=4, per_sm=8),
]


def run_sweep(deadline, reps, g, upstream, lines, timer):
    sms = _num_sms()
    lines += ["", "### Config sweep (ours only, graph us; first row = default)", "",
              "| kernel | config | case | us |", "|---|---|---|---|"]

    def graph_us(fn):
        try:
            return _fmt_us(rank_us(timer.measure(fn, reps, eager=not timer.cuda, launch=False)))
        except Exception as e:  # noqa: BLE001
            return _err(e)

    cases = [(4096, 16384)]
    for cfg in PREFILL_SWEEP:
        for M, N in cases:
            if time.time() > deadline:
                lines.append("| prefill | (time budget spent) | | |")
                return
            q, kv, w, ks, ke = prefill_inputs(M, N, g)
            res = graph_us(lambda: ours.fp8_mqa_logits(q, kv, w, ks, ke, False, _config=cfg))
            lines.append(f"| prefill | {cfg} | M={M} N={N} | {res} |")
    dcases = [(1, 4096), (32, 16384), (128, 65536)]
    inputs = {c: decode_inputs(c[0], c[1], 1, g, upstream) for c in dcases}
    for cfg in DECODE_SWEEP:
        c2 = dict(cfg)
        if "per_sm" in c2:
            c2["programs"] = c2.pop("per_sm") * sms
        for (B, ctx), (q, cache, w, cl, tables, _) in inputs.items():
            if time.time() > deadline:
                lines.append("| decode | (time budget spent) | | |")
                return
            res = graph_us(lambda: ours.fp8_paged_mqa_logits(q, cache, w, cl, tables, None, ctx, False,
                                                             _config=c2))
            lines.append(f"| decode | {cfg} | B={B} ctx={ctx // 1024}K | {res} |")


# ------------------------------------------------------------------------------------------------
# --focus: the shapes that missed 0.7x DeepGEMM in the first H200 run (+ two small ones), each
# kernel variant timed against DeepGEMM and checked against it (one call, < 90 s)
# ------------------------------------------------------------------------------------------------

# Below target in bench/results/h200-indexer-run1.md (their speeds: bench/RESULTS.md), then two small
# decode controls.
FOCUS_PREFILL = [(4096, 4096), (4096, 16384)]
FOCUS_DECODE = [(128, 4096, 1), (32, 16384, 1), (128, 16384, 1), (8, 65536, 1), (32, 65536, 1),
                (128, 65536, 1), (32, 16384, 2), (128, 16384, 2),
                (1, 4096, 1), (8, 4096, 1)]   # the small controls
# name -> _config override ({} = the shipped default for this shape).  "run1" is the tile the
# first run used (on today's kernel structure: per-request inner loop, q/weights hoisted).
FOCUS_PREFILL_VARIANTS = [
    ("default", {}),
    ("run1 default BN128 BT8 w8 s3", dict(BLOCK_N=128, BT=8, num_warps=8, num_stages=3)),
    ("BN64 BT8 w4 s3", dict(BLOCK_N=64, BT=8, num_warps=4, num_stages=3)),
    ("BN128 BT4 w4 s4", dict(BLOCK_N=128, BT=4, num_warps=4, num_stages=4)),
    ("BN64 BT4 w4 s4", dict(BLOCK_N=64, BT=4, num_warps=4, num_stages=4)),
    ("BN128 BT8 w8 s4", dict(BLOCK_N=128, BT=8, num_warps=8, num_stages=4)),
]
# The mma.sync GPU families (overlay/kernels/indexer.py _family) whose launch-table picks the mma.sync child times too.
MMA_FAMILIES = [("sm_89/120", (8, 9)), ("sm_80/86", (8, 0))]
_FLAT = dict(NESTED=False, HOIST_Q=False, SCALES_AHEAD=False)
# each family's pick (the block size compiled in on both; sm_80/86 decode their key tiles ahead: K_AHEAD), the
# per-request walk without K_AHEAD (sm_80/86's pick from 32 heads until stop 48), the flat walk (their pick at 16
# heads until then; both at 8 warps and 4 programs per SM, as then), the pick at 8 warps, 2 programs per SM, and the
# pick with its query decoded opaquely (Q_OPAQUE: 16-bit MMA operand layouts; not the default until timed)
_WAS = dict(num_warps=8, per_sm=4, K_AHEAD=False)
FAMILY_VARIANTS = {"sm_89/120": [("pick", {})],
                   "sm_80/86": [("pick", {}), ("nested, not ahead",
                                               dict(_WAS, NESTED=True, HOIST_Q=True, SCALES_AHEAD=False)),
                                ("flat", dict(_WAS, **_FLAT)), ("pick w8", dict(num_warps=8, per_sm=2)),
                                ("pick, q opaque", dict(Q_OPAQUE=True))]}
_GL = dict(GLUON=True, BLOCK_N=64, num_warps=4, num_stages=4, per_sm=2, SCALES_AHEAD=False)
FOCUS_DECODE_VARIANTS = [
    ("default", {}),
    # the Triton kernel's own pick ("gluon": the decode_config switch; on sm_90 the default at two tokens x <= 64
    # heads and at batch 1 is the Gluon kernel, indexer_sm90.py), then the Gluon kernel at other buffer counts,
    # tiles, occupancy
    ("triton pick", {"gluon": False}),
    # both picks with the cache block size read at run time (CONST_BS=False: before 2026-12-05)
    ("default, runtime block size", {"gluon": True, "CONST_BS": False}),
    ("triton pick, runtime block size", {"gluon": False, "CONST_BS": False}),
    ("gluon BN64 nb3 ps3", dict(_GL, num_stages=3, per_sm=3)),
    ("gluon BN64 nb4 ps3", dict(_GL, per_sm=3)),
    # ptxas's register cap (maxnreg): 162 / 151 registers without spills at 64 columns, three programs resident
    ("gluon BN64 nb3 ps3 r168", dict(_GL, num_stages=3, per_sm=3, maxnreg=168)),
    ("gluon BN64 nb4 ps3 r168", dict(_GL, per_sm=3, maxnreg=168)),
    ("gluon BN64 nb3 ps4 r168", dict(_GL, num_stages=3, per_sm=4, maxnreg=168)),
    ("gluon BN64 nb4 ps2", _GL),
    # the Triton tile at two tokens x 64 heads (253 registers) capped so that three are resident
    ("BN64 ps3 r168", dict(BLOCK_N=64, num_warps=4, num_stages=3, per_sm=3, maxnreg=168)),
    ("run1 tile BN64 ps4", dict(BLOCK_N=64, num_warps=4, num_stages=3, per_sm=4)),
    ("run1 flat loop BN128 ps4", dict(BLOCK_N=128, num_warps=4, num_stages=3, per_sm=4,
                                      NESTED=False, HOIST_Q=False)),
    ("BN64 ps4 ahead", dict(BLOCK_N=64, num_warps=4, num_stages=3, per_sm=4, SCALES_AHEAD=True)),
    ("BN128 ps4", dict(BLOCK_N=128, num_warps=4, num_stages=3, per_sm=4)),
    ("BN128 ps4 ahead", dict(BLOCK_N=128, num_warps=4, num_stages=3, per_sm=4, SCALES_AHEAD=True)),
    ("BN128 ps4 s4", dict(BLOCK_N=128, num_warps=4, num_stages=4, per_sm=4)),
    ("BN128 ps2", dict(BLOCK_N=128, num_warps=4, num_stages=3, per_sm=2)),
    ("BN128 ps8", dict(BLOCK_N=128, num_warps=4, num_stages=3, per_sm=8)),
    # next_n=2 (T=2) at BLOCK_N 128 compiles to 253 registers on sm_90 (2 programs resident per SM), BLOCK_N 64
    # to 168 (3 per SM): the two below; measured 31-45% slower at T=2 (bench/RESULTS.md, stop 28)
    ("BN64 ps8", dict(BLOCK_N=64, num_warps=4, num_stages=3, per_sm=8)),
    ("BN64 ps8 ahead", dict(BLOCK_N=64, num_warps=4, num_stages=3, per_sm=8, SCALES_AHEAD=True)),
    ("BN256 w8 ps2", dict(BLOCK_N=256, num_warps=8, num_stages=3, per_sm=2)),
    ("BN256 w8 ps4 ahead", dict(BLOCK_N=256, num_warps=8, num_stages=3, per_sm=4,
                                SCALES_AHEAD=True)),
]



def _focus_cell(call, ref_rows, rows, mask, timer, reps, full):
    """(Timing or why not, diff vs DeepGEMM): graph time (every column when `full`)."""
    try:
        out = call()
        diff = None
        if ref_rows is not None:
            diff, _ = compare(out[rows], ref_rows, mask[rows])
        del out
        return timer.measure(call, reps, eager=full or not timer.cuda, launch=full), diff
    except Exception as e:  # noqa: BLE001
        return _err(e), None


def _decode_label(case) -> str:
    """A --focus decode case's row label (and the mma.sync child's key for it)."""
    B, ctx, nn = case
    return f"decode B={B} ctx={ctx} next_n={nn}"


def run_focus(args, upstream, g, lines, timer, mma, child_times):
    """One table per kernel: rows = shapes, columns = DeepGEMM (graph, eager, launch) then every
    variant as 'graph us / speed vs DeepGEMM', then the default's eager and launch times; '!' marks
    a variant whose result differs from DeepGEMM by more than 1e-3 relative (a wrong variant; never
    pick it). In the mma.sync child (child_times is a dict) only the default is timed."""
    child = child_times is not None
    reps = max(5, min(args.reps, 10))
    t0 = time.time()
    sms = _num_sms()
    prefill_cases, decode_cases = FOCUS_PREFILL, FOCUS_DECODE
    if CPU_SMOKE:
        prefill_cases, decode_cases, reps = [(24, 700)], [(3, 300, 1), (2, 260, 2)], 1

    ours_default = {}   # case label -> our default's graph us (this build), for the mma.sync family table

    def table(kind, variants, cases, make_calls, child_extra=None):
        mma_head = " default mma.sync us |" if args.mma_sync else ""
        head = ("| case | DeepGEMM graph us | DeepGEMM eager us | DeepGEMM launch us | "
                + " | ".join(n for n, _ in variants) + f" | default eager us | default launch us |{mma_head} best |")
        ncols = len(variants) + 7 + bool(args.mma_sync)
        lines.extend(["", f"### {kind}: graph us (speed = DeepGEMM / ours; >= 0.70x is the target)", "",
                      head, "|---" * ncols + "|"])
        for case in cases:
            if time.time() - t0 > args.budget_s:
                lines.append(f"| {case} | (time budget spent) |" + " |" * (ncols - 2))
                continue
            try:
                label, dg_call, our_call, rows, mask = make_calls(case)
            except Exception as e:  # noqa: BLE001
                lines.append(f"| {case} | inputs failed: {_err(e)} |" + " |" * (ncols - 2))
                continue
            if child:   # the default under `label`, child_extra's configs under "label :: name"
                extra = [(f"{label} :: {n}", c) for n, c in (child_extra(case) if child_extra else [])]
                for key, cfg in [(label, {})] + extra:
                    try:
                        child_times[key] = rank_us(timer.measure(lambda c=cfg: our_call(c), reps,
                                                                 eager=not timer.cuda, launch=False))
                    except Exception as e:  # noqa: BLE001
                        print(f"{key}: {_err(e)}", file=sys.stderr)
                _empty_cache()
                continue
            ref_rows, dg = None, None
            try:
                b = dg_call()
                ref_rows = b[rows]
                del b
                dg = timer.measure(dg_call, reps)
            except Exception as e:  # noqa: BLE001
                dg = f"failed: {_err(e)}"
            dg_us = rank_us(dg) if isinstance(dg, Timing) else None
            cells, best, default = [], None, None
            for name, cfg in variants:
                t, diff = _focus_cell(lambda c=cfg: our_call(c), ref_rows, rows, mask, timer, reps,
                                      full=name == "default")
                bad = diff is not None and not (diff <= 1e-3)
                us = rank_us(t) if isinstance(t, Timing) else None
                if name == "default" and isinstance(t, Timing):
                    default = t
                    ours_default[label] = us
                if us is not None:
                    sp = f" / {dg_us / us:.2f}x" if dg_us else ""
                    cells.append(f"{_fmt_us(us)}{sp}{' !' if bad else ''}")
                    if not bad and (best is None or us < best[0]):
                        best = (us, name)
                else:
                    cells.append(t if isinstance(t, str) else t.note or "n/a")
            best_s = "n/a" if best is None else (
                f"{best[1]} ({dg_us / best[0]:.2f}x)" if dg_us else best[1])
            dg_cells = dg.cells(_fmt_us) if isinstance(dg, Timing) else [dg, "", ""]
            tail = [_fmt_us(default.eager_us if default else None),
                    _fmt_us(default.launch_us if default else None)]
            if args.mma_sync:
                tail.append(_fmt_us(mma.get(label)))
            lines.append(f"| {label} | " + " | ".join(dg_cells + cells + tail) + f" | {best_s} |")
            print(lines[-1], flush=True)
            _empty_cache()

    def prefill_calls(case):
        M, N = case
        q, kv, w, ks, ke = prefill_inputs(M, N, g)
        rows = torch.linspace(0, M - 1, 16, device=DEV).long()
        mask = _visible_mask_prefill(ks, ke, N)
        return (f"prefill M={M} N={N}",
                lambda: upstream.prefill(q, kv, w, ks, ke)[:, :N],
                lambda cfg: ours.fp8_mqa_logits(q, kv, w, ks, ke, False, _config=cfg or None),
                rows, mask)

    def decode_calls(case):
        B, ctx, nn = case
        q, cache, w, cl, tables, _ = decode_inputs(B, ctx, nn, g, upstream)
        mask = _visible_mask_decode(cl, ctx)
        rows = sorted(set(torch.linspace(0, B * nn - 1, 8).long().tolist()))
        meta = upstream.metadata(cl) if not upstream.error and not child else None

        def our_call(cfg):
            cfg = dict(cfg)
            if "per_sm" in cfg:
                cfg["programs"] = cfg.pop("per_sm") * sms
            if "gluon" in cfg:   # a whole config: decode_config's pick with the Gluon switch as given
                base = ours.decode_config(ours._device_info(q.device)[0], q.shape[2], nn, B, ctx, sms,
                                          gluon=cfg.pop("gluon"))
                cfg = replace(base, **cfg)
            elif cfg and "GLUON" not in cfg:   # the Triton variants below name the Triton kernel
                cfg["GLUON"] = False
            # the default as vLLM calls it (no _config: the launch plan; a _config call is never planned)
            return ours.fp8_paged_mqa_logits(q, cache, w, cl, tables, None, ctx, False,
                                             _config=cfg or None)
        return (_decode_label(case),
                lambda: upstream.decode(q, cache, w, cl, tables, meta, ctx)[:, :ctx],
                our_call, rows, mask)

    def family_picks(case):
        """What the mma.sync GPUs' own launch tables pick for this decode case (their block size at run time and
        compiled in), timed in the mma.sync child only."""
        B, ctx, nn = case
        for fam, cap in MMA_FAMILIES:
            cfg = ours.decode_config(cap, HEADS, nn, B, ctx, sms, gluon=False)
            for what, over in FAMILY_VARIANTS[fam]:
                yield f"{fam} {what}", dict(vars(cfg), **over)

    table("prefill", FOCUS_PREFILL_VARIANTS, prefill_cases, prefill_calls)
    table("decode", FOCUS_DECODE_VARIANTS, decode_cases, decode_calls, family_picks)
    if args.mma_sync and not child:
        fams = [f"{fam} {what}" for fam, _ in MMA_FAMILIES for what, _ in FAMILY_VARIANTS[fam]]
        lines.extend(["", "### decode on the mma.sync build, by GPU family: graph us / x our wgmma default (target "
                      "<= 1.3x)", "", "each family's own launch-table pick (decode_config of its capability, "
                      "programs per SM as there, this GPU's SM count), built with DISABLE_MMA_V3=1; 'nested, not "
                      "ahead': the per-request walk with the query hoisted (NESTED, HOIST_Q), each key tile decoded "
                      "in the iteration that loads it (K_AHEAD off), and 'flat', one item per iteration: both at 8 "
                      "warps, 4 programs per SM; 'w8': the pick at 8 warps, 2 programs per SM; 'q opaque': Q_OPAQUE",
                      "",
                      "| case | our wgmma default us | hopper pick mma.sync us | " + " | ".join(fams) + " |",
                      "|---" * (3 + len(fams)) + "|"])
        for case in decode_cases:
            label = _decode_label(case)
            base = ours_default.get(label)
            cells = [_fmt_us(base), _fmt_us(mma.get(label))]
            for f in fams:
                us = mma.get(f"{label} :: {f}")
                cells.append(_fmt_us(us) + (f" / {us / base:.2f}x" if us and base else ""))
            lines.append(f"| {label} | " + " | ".join(cells) + " |")


# ------------------------------------------------------------------------------------------------


def _write_report(lines: list[str], t_start: float, out: str) -> None:
    """Append the total wall time, write the markdown report and echo it."""
    lines.append(f"\nTotal {time.time() - t_start:.0f} s.")
    text = "\n".join(lines) + "\n"
    pathlib.Path(out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(out).write_text(text)
    print(text)


def main():
    global HEADS
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fallback-src", help="vLLM 0.17.1 vllm/utils/deep_gemm.py or its wheel")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "bench_indexer.md"))
    add_timing_args(ap, reps=15)
    ap.add_argument("--budget-s", type=float, default=200.0,
                    help="wall-clock budget; the config sweep uses what the table leaves")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--quick", action="store_true", help="one prefill and two decode rows")
    ap.add_argument("--heads", type=int, default=HEADS,
                    help="index heads (GLM-5: 32, the default; DeepSeek-V3.2: 64)")
    ap.add_argument("--focus", action="store_true",
                    help="only the shapes below 0.7x DeepGEMM in run 1 (+2 small), every kernel "
                         "variant vs DeepGEMM (< 90 s on an H200)")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="tiny shapes on the CPU under the Triton interpreter (tests this script)")
    args = ap.parse_args()
    HEADS = args.heads
    child = args.mma_sync_child is not None
    if child:   # the mma.sync build stands for sm_80-sm_120, which have no Gluon kernel (its wgmma is explicit and
        ours.GLUON_DEFAULT = False   # ignores DISABLE_MMA_V3): the child times the Triton kernel sm_90 would run
    mma, mma_note = mma_sync_column(args, __file__)
    t_start = time.time()
    deadline = t_start + args.budget_s

    assert CPU_SMOKE or torch.cuda.is_available(), "bench_indexer needs a CUDA GPU"
    if CPU_SMOKE:   # one call per column: the interpreter takes seconds per call
        args.reps, args.replays, args.launch_calls = 1, 1, 1
    timer = Timer(DEV, args.reps, args.replays, args.launch_calls)
    g = torch.Generator(device=DEV).manual_seed(0)
    upstream = _Upstream() if not CPU_SMOKE else _Upstream.standin()
    fb_prefill, fb_decode, fb_note = load_torch_fallback(None if child else args.fallback_src)
    import triton

    if CPU_SMOKE:
        cap, name, sms = None, "CPU (Triton interpreter smoke run)", 4
    else:
        cap = torch.cuda.get_device_capability()
        props = torch.cuda.get_device_properties(0)
        name, sms = props.name, props.multi_processor_count
    mma_col = " ours mma.sync us |" if args.mma_sync else ""
    lines = [
        f"## Indexer logits: dsa-overlay Triton vs DeepGEMM vs vLLM 0.17.1 torch fallback",
        "",
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {name} "
        f"({sms} SMs), torch {torch.__version__}, triton "
        f"{triton.__version__}, vLLM {upstream.version}; index heads {HEADS} (GLM-5: 32, DeepSeek-V3.2: 64), D={D}, "
        f"block size {BLOCK_SIZE}, clean_logits=False (as vLLM calls it).  Torch fallback: "
        f"{fb_note}.  Ours config: prefill {ours.prefill_config(cap, HEADS)}, "
        f"decode {ours.decode_config(cap, HEADS, 1)}."
        + (f"  {mma_note}." if args.mma_sync else ""),
        "",
        f"Timing by bench/timing.py ({args.reps} calls per graph, median of {args.replays} replays, "
        f"launch = {args.launch_calls} back-to-back calls): graph us = GPU time per call by CUDA-graph "
        "replay (what serving under CUDA graphs sees); eager us = one plain call (host launch + GPU, "
        "what calls outside vLLM's graphs pay); launch us = host time to launch one call"
        + ("; mma.sync = our default Triton kernel built for mma.sync (DISABLE_MMA_V3=1), graph time"
           if args.mma_sync else "")
        + ".  speed = DeepGEMM graph time / ours (>= 0.7 is the target); vs torch = torch time / ours "
        "(>= 10 is the target; the torch fallback runs eagerly).  err = max |x - fp64 reference| / max "
        "|reference| on sampled rows; diff = the same between ours and DeepGEMM over visible positions; "
        "overlap = top-2048 set overlap of ours and DeepGEMM.",
        "",
        f"| case | ours graph us | ours eager us | ours launch us |{mma_col} DeepGEMM graph us | "
        "DeepGEMM eager us | DeepGEMM launch us | speed | torch-0.17.1 us | vs torch | "
        "err ours | err DG | err torch | diff ours-DG | top-2048 overlap |",
        "|---" * (15 + bool(args.mma_sync)) + "|",
    ]
    ncols = 15 + bool(args.mma_sync)
    if upstream.error:
        lines.insert(4, f"DeepGEMM unavailable: {upstream.error}")

    child_times: dict = {}
    if args.focus:
        lines = lines[:4] + [
            "--focus: only the shapes below 0.7x DeepGEMM in the first H200 run, plus two small "
            "decode controls; every kernel variant is checked against DeepGEMM (sampled rows, "
            "visible positions; '!' = differs by > 1e-3 relative, i.e. wrong) and timed by "
            "CUDA-graph replay with L2 flushed; the default and DeepGEMM also eagerly and by host "
            "launch time.  'default' is what the launcher "
            "picks today; the 'best' column names the fastest correct variant.  To change a "
            "default, edit _PREFILL_TABLE / _DECODE_TABLE (hopper rows) in "
            "overlay/kernels/indexer.py.  Decode variants: BN = key tile, ps = programs "
            "per SM, w = warps, s = pipeline stages, ahead = per-key scales prefetched a tile "
            "ahead (SCALES_AHEAD)."]
        if upstream.error:
            lines.append(f"DeepGEMM unavailable: {upstream.error}")
        try:
            run_focus(args, upstream, g, lines, timer, mma, child_times if child else None)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            lines.append(f"focus failed: {_err(e)}")
        if child:
            write_child_json(args.mma_sync_child, child_times)
            return
        _write_report(lines, t_start, args.out)
        return

    prefill_cases = [(4096, 4096), (4096, 16384), (4096, 65536)]
    decode_cases = [(B, c, 1) for c in (4096, 16384, 65536) for B in (1, 8, 32, 128)]
    decode_cases += [(32, 16384, 2), (128, 16384, 2)]
    if args.quick:
        prefill_cases, decode_cases = prefill_cases[:1], [(1, 4096, 1), (32, 16384, 2)]
    if CPU_SMOKE:
        prefill_cases, decode_cases = [(24, 2100)], [(2, 2176, 1), (3, 300, 2)]

    def emit(row):
        if child:
            child_times[row["case"]] = rank_us(row["ours"])
            return
        o, d, t = row["ours"], row.get("dg"), row.get("torch_us")
        o_us, d_us = rank_us(o), rank_us(d) if isinstance(d, Timing) else None
        speed = d_us / o_us if d_us and o_us else None
        vs_t = t / o_us if isinstance(t, float) and o_us else None
        cells = o.cells(_fmt_us) + ([_fmt_us(mma.get(row["case"]))] if args.mma_sync else [])
        cells += d.cells(_fmt_us) if isinstance(d, Timing) else [fmt(d), "", ""]
        cells += [fmt(speed, "x"), _fmt_us(t), fmt(vs_t, "x"), fmt(row.get("err_ours"), "e"),
                  fmt(row.get("err_dg"), "e"), fmt(row.get("err_torch"), "e"), fmt(row.get("diff"), "e"),
                  fmt(row.get("overlap"), "%")]
        lines.append(f"| {row['case']} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)

    def blank(case, why):
        lines.append(f"| {case} | {why} |" + " |" * (ncols - 2))

    writer = None
    for M, N in prefill_cases:
        if time.time() > deadline:
            blank(f"prefill M={M} N={N}", "skipped: --budget-s spent")
            continue
        try:
            emit(run_prefill(M, N, upstream, fb_prefill, timer, g, child))
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            blank(f"prefill M={M} N={N}", f"failed: {_err(e)}")
        _empty_cache()
    for B, ctx, nn in decode_cases:
        if time.time() > deadline:
            blank(_decode_label((B, ctx, nn)), "skipped: --budget-s spent")
            continue
        try:
            row = run_decode(B, ctx, nn, upstream, fb_decode, timer, g, child)
            writer = row.get("writer", writer)
            emit(row)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            blank(_decode_label((B, ctx, nn)), f"failed: {_err(e)}")
        _empty_cache()
    if child:
        write_child_json(args.mma_sync_child, child_times)
        return
    lines += ["", f"Paged cache written by {writer}.  Table took {time.time() - t_start:.0f} s."]

    if not args.no_sweep and not args.quick and not CPU_SMOKE:
        try:
            run_sweep(deadline, max(5, args.reps // 2), g, upstream, lines, timer)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            lines.append(f"sweep failed: {_err(e)}")
    _write_report(lines, t_start, args.out)


if __name__ == "__main__":
    main()
