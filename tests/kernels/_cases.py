"""Inputs and comparisons shared by the kernel tests (interpreter, GPU and mutation tests alike).

Inputs are drawn from a seed (every test id or failure message names it); every byte a kernel must not read
(cache padding, spare blocks, table entries past a request) holds NaN, and outputs are NaN-poisoned before a
run. The comparisons measure errors against the float64 references of `_refs.py`, assert them against a
named tolerance and return the measured values; `record` keeps the largest per tolerance so a run can print
them (`report_errors`).
"""

from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass

import torch

from tests.kernels._fp8_ds_mla import quantize_fp8_ds_mla
from tests.kernels._refs import (mqa_logits_ref64, paged_mqa_logits_ref64, sparse_mla_ref64, visible_len,
                                 write_indexer_cache)

NAN_BYTE = 0xFF  # NaN as float8_e4m3fn, as float32 (0xFFFFFFFF) and as bfloat16 (0xFFFF)
FP8 = torch.float8_e4m3fn
D = 128


# ------------------------------------------------------------------------------------------------
# Tolerances. Each value is a few times the largest error measured over every case of the tests that use
# it (the measured value is beside it). Each test module prints the largest errors of its run at its end;
# DSA_KERNEL_ERRORS=<file> appends every comparison's errors to that file.
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MlaTol:
    """Sparse-MLA: out error = max |out - ref| / max |kv_c| over the token's selected slots (per token);
    lse error = |lse - ref| / max(1, softmax_scale * max_j |q| . |kv_j|) (per row: absolute for small
    scores, relative to the largest possible score where rounding grows with it)."""
    name: str
    out: float
    lse: float


@dataclass(frozen=True)
class IndexerTol:
    """Indexer: error = max |logit - ref| / sum_h |w| |q| . |k| (the logit's own magnitude)."""
    name: str
    rel: float


# Interpreter, float32 dots, float32 output (`out=` a float32 tensor): measured out 5.0e-7, lse 1.4e-7 (the 26
# fixed cases and 40 fresh random draws).
MLA_INTERP_F32 = MlaTol("mla interpreter, fp32 out", out=2e-6, lse=5e-7)
# Interpreter, bfloat16 output: Triton's interpreter truncates float32 -> bfloat16 (round toward zero; the GPU
# rounds to nearest), so |err| < 1 ulp = 2^-7 |out|: measured 6.9e-3. The tolerance is that bound.
MLA_INTERP_BF16 = MlaTol("mla interpreter, bf16 out", out=2 ** -7, lse=5e-7)
# H200, compiled (Triton 3.6, torch 2.11), bf16 out, every case of gpu_checks.py. bf16 cache: products of bf16
# values are exact in the float32 dots, P is rounded to bf16 for P.V and out to bf16 (bound ~2^-7): measured
# out 1.8e-3, lse 1.5e-7. fp8_ds_mla: the dequantised tile is rounded to bf16 as well (a third rounding, and
# score errors): measured out 1.1e-2, lse 2.6e-4 (the sm_80/86 bit path, values up to 5x larger), otherwise
# out 3.7e-3, lse 1.2e-4.
MLA_GPU_BF16 = MlaTol("mla gpu bf16 cache", out=6e-3, lse=6e-7)
MLA_GPU_FP8 = MlaTol("mla gpu fp8_ds_mla cache", out=4e-2, lse=1e-3)
# Indexer, interpreter (fp32 dots over exact e4m3 products): measured 1.8e-8 (every case of test_indexer.py).
IDX_INTERP = IndexerTol("indexer interpreter", rel=1e-7)
# Indexer on the H200: DOT_FP8 (wgmma on fp8 operands; Hopper accumulates fp8 products with reduced precision,
# as DeepGEMM's kernels do): measured 7.1e-5. DOT_BF16 (the sm_80/86 e4m3 decoder: exact bf16 products, float32
# sums): measured 2.2e-8.
IDX_GPU_FP8 = IndexerTol("indexer gpu fp8 dots", rel=3e-4)
IDX_GPU_BF16 = IndexerTol("indexer gpu bf16 dots", rel=1e-7)

MEASURED: dict[str, dict[str, float]] = {}
ERRORS_FILE = os.environ.get("DSA_KERNEL_ERRORS")  # a path: every comparison's errors are appended there


def record(tol_name: str, what: str, errors: dict[str, float]) -> None:
    d = MEASURED.setdefault(tol_name, {})
    for key, value in errors.items():
        d[key] = max(d.get(key, 0.0), float(value))
    if ERRORS_FILE:
        with open(ERRORS_FILE, "a") as f:
            f.write(f"[{tol_name}] {what}: " + ", ".join(f"{k} {v:.3g}" for k, v in errors.items()) + "\n")


def report_errors(request) -> None:
    """Print the largest errors measured so far beside their tolerances (module teardown)."""
    tr = request.config.pluginmanager.getplugin("terminalreporter")
    if tr is None or not MEASURED:
        return
    tols = {t.name: t for t in (MLA_INTERP_F32, MLA_INTERP_BF16, MLA_GPU_BF16, MLA_GPU_FP8, IDX_INTERP,
                                IDX_GPU_FP8, IDX_GPU_BF16)}
    lines = ["", "largest measured errors (tolerance):"]
    for name, d in sorted(MEASURED.items()):
        t = tols.get(name)
        lines.append("  " + name + ": " + ", ".join(f"{k} {v:.3g} ({getattr(t, k, float('nan')):.3g})"
                                                   for k, v in sorted(d.items())))
    with request.config.pluginmanager.getplugin("capturemanager").global_and_fixture_disabled():
        for line in lines:
            tr.write_line(line)
    MEASURED.clear()


# ------------------------------------------------------------------------------------------------
# Sparse MLA inputs and comparison
# ------------------------------------------------------------------------------------------------
def mla_cache(g: torch.Generator, num_blocks: int, block_size: int, kv_format: str, *, pad: int = 0,
              scale: float = 1.0) -> torch.Tensor:
    """A paged cache [num_blocks, block_size, W], a strided view into a buffer whose padding rows (``pad`` per
    block) hold NaN, so a wrong address shows."""
    n = num_blocks * block_size
    vals = torch.randn(n, 576, generator=g) * scale
    if kv_format == "bf16":
        rows = vals.to(torch.bfloat16)
        buf = torch.full((num_blocks, block_size + pad, 576), float("nan"), dtype=torch.bfloat16)
    else:
        rows, _ = quantize_fp8_ds_mla(vals)
        buf = torch.full((num_blocks, block_size + pad, 656), NAN_BYTE, dtype=torch.uint8)
    buf[:, :block_size] = rows.view(num_blocks, block_size, -1)
    return buf[:, :block_size]


def draw_indices(r: random.Random, T: int, topk: int, num_slots: int, *, all_invalid_rows=()) -> torch.Tensor:
    """Random slot ids with duplicates, -1, other negatives, ids >= num_slots, and fully invalid rows."""
    idx = torch.empty(T, topk, dtype=torch.int32)
    for t in range(T):
        for j in range(topk):
            u = r.random()
            if t in all_invalid_rows:
                idx[t, j] = r.choice([-1, -r.randint(2, 1 << 30), num_slots, num_slots + r.randint(1, 999),
                                      (1 << 31) - 1])
            elif u < 0.06:
                idx[t, j] = -1
            elif u < 0.08:
                idx[t, j] = -r.randint(2, 1 << 30)
            elif u < 0.12:
                idx[t, j] = num_slots + r.randint(0, 50)
            elif u < 0.2 and j > 0:
                idx[t, j] = idx[t, r.randrange(j)]  # duplicate (may duplicate an invalid id too)
            else:
                idx[t, j] = r.randrange(num_slots)
    return idx


@dataclass
class MlaCase:
    q: torch.Tensor
    cache: torch.Tensor
    idx: torch.Tensor
    scale: float
    fmt: str
    what: str

    def ref(self):
        return sparse_mla_ref64(self.q, self.cache, self.idx, self.scale, self.fmt)

    def to(self, device) -> "MlaCase":
        return MlaCase(self.q.to(device), self.cache.to(device), self.idx.to(device), self.scale, self.fmt,
                       self.what)


def mla_case(seed: int, fmt: str, H: int, topk: int, T: int, block_size: int, *, num_blocks: int | None = None,
             invalid_row: bool = True, q_scale: float | None = None, softmax_scale: float | None = None,
             kv_scale: float = 1.0) -> MlaCase:
    """One seeded sparse-MLA input. Scores have a spread like a real model's (q, kv ~ N(0, 1), softmax scale
    1/sqrt(576)) unless q_scale / softmax_scale say otherwise; with T > 1 one token has no valid index."""
    r = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    num_blocks = num_blocks or r.randint(1, max(1, 200 // block_size))
    cache = mla_cache(g, num_blocks, block_size, fmt, pad=r.choice([0, 1, 3]), scale=kv_scale)
    q_scale = q_scale if q_scale is not None else r.choice([0.5, 1.0, 1.5])
    q = (torch.randn(T, H, 576, generator=g) * q_scale).to(torch.bfloat16)
    rows = (r.randrange(T),) if invalid_row and T > 1 else ()
    idx = draw_indices(r, T, topk, num_blocks * block_size, all_invalid_rows=rows)
    scale = softmax_scale if softmax_scale is not None else r.choice([576 ** -0.5, 0.05])
    what = f"seed={seed} {fmt} H={H} topk={topk} T={T} block_size={block_size} slots={num_blocks * block_size}"
    return MlaCase(q, cache, idx, scale, fmt, what)


def every_e4m3_code_case() -> tuple[MlaCase, torch.Tensor]:
    """Every one of the 256 e4m3 byte values but the two NaNs, both signs and the subnormals, in the nope columns of 4
    one-hot rows (token t attends only to slot t), with tile scales of at most 2 significant bits: the output equals
    the dequantised row itself, exactly in float32 (and in bf16 operands: 4-bit mantissas times 2-bit scales).
    Returns (case, the expected [4, 512] float64 rows)."""
    from tests.kernels._refs import mla_slots

    codes = torch.arange(256, dtype=torch.int32)
    codes = codes[(codes & 0x7F) != 0x7F].to(torch.uint8)  # drop the two NaN encodings
    n = 4
    rows = torch.zeros(n, 656, dtype=torch.uint8)
    vals = codes.repeat(-(-512 * n // codes.numel()))[: 512 * n]
    rows[:, :512] = vals.view(n, 512)
    rows[:, 512:528] = torch.tensor([1.0, 0.5, 2.0 ** -3, 3.0]).view(torch.uint8).repeat(n, 1)
    rows[:, 528:] = torch.randn(n, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16).view(torch.uint8)
    cache = rows.view(n, 1, 656)
    idx = torch.arange(n, dtype=torch.int32).view(n, 1)
    q = torch.randn(n, 1, 576, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    return MlaCase(q, cache, idx, 0.1, "fp8_ds_mla", "one-hot"), mla_slots(cache, "fp8_ds_mla")[:, :512]


def poisoned_mla_outputs(T: int, H: int, dtype=torch.bfloat16, device="cpu"):
    return (torch.full((T, H, 512), float("nan"), dtype=dtype, device=device),
            torch.full((T, H), float("nan"), dtype=torch.float32, device=device))


def check_mla(out: torch.Tensor, lse: torch.Tensor, ref, tol: MlaTol, what: str = "", *,
              measure: bool = True) -> tuple[float, float]:
    """Assert out/lse against ref = sparse_mla_ref64(...) within tol; return (out error, lse error).
    measure=False (mutation tests) keeps the errors out of the measured maxima."""
    ro, rl, vscale, sscale = ref
    out, lse = out.detach().cpu().double(), lse.detach().cpu().double()
    assert not torch.isnan(out).any(), f"{what}: NaN in out"
    assert not torch.isnan(lse).any(), f"{what}: NaN in lse"
    empty = torch.isinf(rl)
    assert torch.equal(torch.isinf(lse) & (lse < 0), empty), f"{what}: lse is -inf on other rows than the ref"
    assert (out[empty] == 0).all(), f"{what}: a row without a valid index must give out == 0"
    full = ~empty
    if not full.any():
        return 0.0, 0.0
    den = vscale[:, None].expand_as(rl)[full]
    out_err = ((out - ro).abs().amax(-1)[full] / den).max().item()
    lse_err = ((lse - rl).abs() / sscale.clamp_min(1.0))[full].max().item()
    if measure:
        record(tol.name, what, {"out": out_err, "lse": lse_err})
    assert out_err <= tol.out and lse_err <= tol.lse, (
        f"{what}: out error {out_err:.3g} (tolerance {tol.out:.3g}), lse error {lse_err:.3g} "
        f"(tolerance {tol.lse:.3g}) [{tol.name}]")
    return out_err, lse_err


# ------------------------------------------------------------------------------------------------
# Indexer inputs and comparison
# ------------------------------------------------------------------------------------------------
def quant_keys(k: torch.Tensor):
    """Per-token fp8 keys with ue8m0 scales (as vLLM quantises the indexer keys)."""
    scale = k.float().abs().amax(-1).clamp_min(1e-4) / 448.0
    scale = torch.exp2(torch.ceil(torch.log2(scale)))
    return (k.float() / scale[:, None]).clamp(-448, 448).to(FP8), scale


def queries(shape, g):
    return (torch.randn(shape, generator=g) * 2.0).clamp(-448, 448).to(FP8)


def head_weights(rows, heads, g):
    return torch.randn(rows, heads, generator=g) * 0.3   # signed, like vLLM's folded weights


@dataclass
class PrefillCase:
    q: torch.Tensor
    k: torch.Tensor
    k_scales: torch.Tensor
    w: torch.Tensor
    ks: torch.Tensor
    ke: torch.Tensor
    what: str

    def ref(self):
        return mqa_logits_ref64(self.q, self.k, self.k_scales, self.w, self.ks, self.ke)

    def to(self, device) -> "PrefillCase":
        return PrefillCase(*(getattr(self, f).to(device) for f in ("q", "k", "k_scales", "w", "ks", "ke")),
                           self.what)


def prefill_case(seed: int, M: int, N: int, H: int, *, empty_every: int = 5,
                 odd_ranges: bool = True) -> PrefillCase:
    """Random ranges incl. empty ones (ks == ke), the full row and the last key only; odd_ranges adds the
    ranges a caller may pass that the kernel must clip: ks > ke, ke > N, ks < 0."""
    g = torch.Generator().manual_seed(seed)
    q = queries((M, H, D), g)
    k, ksc = quant_keys(torch.randn(N, D, generator=g) * torch.rand(N, 1, generator=g) * 4)
    w = head_weights(M, H, g)
    start = torch.randint(0, N, (M,), generator=g)
    length = torch.randint(0, N + 1, (M,), generator=g)
    ks = start.to(torch.int32)
    ke = torch.minimum(start + length, torch.tensor(N)).to(torch.int32)
    ke[::empty_every] = ks[::empty_every]
    if M > 2:
        ks[1], ke[1] = 0, N
        ks[2], ke[2] = N - 1, N
    if odd_ranges and M > 6:
        ks[3], ke[3] = N // 2 + 1, N // 3              # ks > ke: nothing visible
        ks[4], ke[4] = N // 4, N + 17                   # ke > N: clipped to N
        ks[5], ke[5] = -5, N // 2                       # ks < 0: clipped to 0
    return PrefillCase(q, k, ksc, w, ks, ke, f"seed={seed} M={M} N={N} H={H}")


@dataclass
class PagedCase:
    q: torch.Tensor
    cache: torch.Tensor
    w: torch.Tensor
    cl: torch.Tensor
    tables: torch.Tensor
    max_model_len: int
    keys: list
    what: str

    def ref(self):
        return paged_mqa_logits_ref64(self.q, self.cache, self.w, self.cl, self.tables, self.max_model_len)

    def to(self, device) -> "PagedCase":
        return PagedCase(self.q.to(device), self.cache.to(device), self.w.to(device), self.cl.to(device),
                         self.tables.to(device), self.max_model_len, self.keys, self.what)


def paged_case(seed: int, B: int, next_n: int, H: int, block_size: int, lens, *, two_d=False, shuffle_2d=False,
               max_model_len: int | None = None, interleaved: bool = False) -> PagedCase:
    """Keys written in vLLM's block layout into shuffled physical blocks; every other byte (tails, spare
    blocks, the block that unused table entries point at) is 0xFF: NaN values and NaN scales.
    max_model_len defaults to max(lens) + 37; a smaller one makes contexts longer than it (clipped)."""
    g = torch.Generator().manual_seed(seed)
    per_req = [math.ceil(L / block_size) for L in lens]
    max_blocks = max(per_req + [1]) + 1
    num_blocks = sum(per_req) + 3
    cache = torch.full((num_blocks, block_size, D + 4), NAN_BYTE, dtype=torch.uint8)
    perm = torch.randperm(num_blocks, generator=g)
    poison = int(perm[-1])
    tables = torch.full((B, max_blocks), poison, dtype=torch.int32)
    used = 0
    keys = []
    for b, L in enumerate(lens):
        tables[b, :per_req[b]] = perm[used:used + per_req[b]].to(torch.int32)
        used += per_req[b]
        kb = (torch.randn(L, D, generator=g) * torch.rand(L, 1, generator=g) * 4).bfloat16()
        keys.append(kb)
        if L:
            pos = torch.arange(L)
            slots = tables[b, pos // block_size].long() * block_size + pos % block_size
            write_indexer_cache(kb, cache, slots, interleaved=interleaved)
    q = queries((B, next_n, H, D), g)
    w = head_weights(B * next_n, H, g)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    if two_d:
        j = torch.arange(next_n, dtype=torch.int32)
        cl = lens_t[:, None] - next_n + 1 + j[None, :]       # vLLM 0.23.0's per-token form
        if shuffle_2d:                                       # any per-token lengths <= L
            cl = (torch.rand(B, next_n, generator=g) * (lens_t[:, None] + 1)).to(torch.int32)
        cl = cl.clamp_min(0).contiguous()
    else:
        cl = lens_t
    mml = max_model_len if max_model_len is not None else max(lens) + 37
    what = f"seed={seed} B={B} next_n={next_n} H={H} bs={block_size} lens={lens} 2d={two_d} mml={mml}"
    return PagedCase(q, cache.unsqueeze(-2), w, cl, tables, mml, keys, what)


def poisoned(shape, device="cpu"):
    return torch.full(shape, float("nan"), dtype=torch.float32, device=device)


def check_logits(out: torch.Tensor, ref, tol: IndexerTol, clean: bool, what: str = "", *,
                 measure: bool = True) -> float:
    """Assert logits against ref = (logits, magnitude) from `_refs`: finite exactly where the reference is,
    within tol relative to each logit's magnitude, and (clean) exactly -inf elsewhere. Returns the error.
    measure=False (mutation tests) keeps the error out of the measured maxima."""
    r, mag = ref
    out = out.detach().cpu().double()
    fin = torch.isfinite(r)
    got = out[fin]
    assert torch.isfinite(got).all(), f"{what}: non-finite logits inside the visible range"
    err = (got - r[fin]).abs()
    rel = (err / mag[fin].clamp_min(1e-300)).max().item() if err.numel() else 0.0
    if measure:
        record(tol.name, what, {"rel": rel})
    assert rel <= tol.rel, f"{what}: error {rel:.3g} of the logit magnitude (tolerance {tol.rel:.3g}) [{tol.name}]"
    if clean:
        assert (out[~fin] == -math.inf).all(), f"{what}: positions outside the range are not exactly -inf"
    return rel


def assert_paged_visibility(case: PagedCase, ref_logits: torch.Tensor) -> None:
    """The reference's visible range per row is what vLLM's formula says (not what a kernel chose)."""
    B, next_n = case.q.shape[:2]
    for b in range(B):
        for j in range(next_n):
            vis = visible_len(case.cl, b, j, next_n, case.max_model_len)
            row = ref_logits[b * next_n + j]
            assert torch.isfinite(row[:vis]).all() and torch.isinf(row[vis:]).all(), (case.what, b, j)


# ------------------------------------------------------------------------------------------------
# A Gluon kernel that does not build (the heuristics' fallback tests)
# ------------------------------------------------------------------------------------------------

class BrokenLaunch:
    """Stands in for a Gluon kernel's launcher: every launch fails the way a Triton without the Gluon API the
    kernel uses fails (a CompilationError out of the front end), or with any other error; counts the tries."""

    def __init__(self, error):
        self.error, self.calls = error, 0

    def __call__(self, grid, *args, **kwargs):
        self.calls += 1
        raise self.error


def compilation_error(msg):
    import ast

    from triton.compiler.errors import CompilationError

    return CompilationError(None, ast.parse("gl.thread_barrier()").body[0], msg)
