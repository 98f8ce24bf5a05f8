"""Proof that the kernel comparisons bite: every test here feeds a kernel a deliberately broken input, the
stand-in for a broken kernel, and asserts that the comparison the real tests use (tests/kernels/_cases.py:
`check_mla`, `check_logits`, with the same tolerances) FAILS against the reference of the unbroken input.

Mutations (each on several seeded cases, under Triton's interpreter):
  mla-drop-key         one valid selected index per token set to -1 (first, last or a random one): a kernel
                       that skips a key per token, e.g. an off-by-one at a tile or split edge;
  mla-drop-key-bf16out the same with the shipped bfloat16 output (lse catches it);
  mla-fp8-tile-scale   one 128-wide fp8 scale of one selected slot times 1.25: a mis-scaled tile;
  mla-fp8-scale-shift  every slot's tile-3 scale replaced by its tile-2 scale: a kernel reading the
                       neighbouring scale;
  mla-oob-as-valid     ids >= num_slots clamped to the last slot: out-of-range ids read instead of skipped;
  mla-minus1-as-slot0  -1 read as slot 0 (also turns an all-invalid row into a valid one);
  idx-drop-head        one index head's weight set to 0 (prefill and paged decode);
  idx-key-scale        one key's fp32 scale times 1.01 (prefill scales, paged cache bytes);
  idx-paged-layout     the paged cache written per token (128 values then the scale: the reading that gives
                       NaN on a real vLLM cache) instead of vLLM's block layout;
  idx-range-off-by-one ke + 1 passed to the prefill kernel (one key too many per row).
"""

from __future__ import annotations

import pathlib
import random
import sys

from tests.kernels._interp import load_interpreted  # sets TRITON_INTERPRET=1 before triton is imported
from tests.kernels import _cases as C
from tests.kernels import _refs as R

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
M = sys.modules.get("_sparse_mla_interpreted") or load_interpreted(
    ROOT / "overlay" / "kernels" / "sparse_mla.py", "_sparse_mla_interpreted")
ix = sys.modules.get("_indexer_interpreted") or load_interpreted(
    ROOT / "overlay" / "kernels" / "indexer.py", "_indexer_interpreted")


def must_fail(check, *args, **kw) -> str:
    """The comparison must raise AssertionError; returns its message (shown with -rA for the record)."""
    with pytest.raises(AssertionError) as e:
        check(*args, measure=False, **kw)
    return str(e.value).splitlines()[0]


# ------------------------------------------------------------------------------------------------
# Sparse MLA
# ------------------------------------------------------------------------------------------------
MLA = [
    # (seed, fmt, H, topk, T, block_size, config or None): split and unsplit, both formats, d2, f
    (201, "bf16", 4, 37, 3, 16, None),
    (202, "fp8_ds_mla", 16, 64, 2, 64, "h16n32s2w4p2"),
    (203, "bf16", 33, 130, 2, 1, "h32n32s3w8p2"),
    (204, "fp8_ds_mla", 5, 90, 2, 16, "h16n32s1w4p2d2f"),
    (205, "bf16", 128, 20, 1, 64, None),
    (206, "fp8_ds_mla", 2, 2048, 1, 64, None),
]


def _mla_id(c):
    return f"seed={c[0]}-{c[1]}-H{c[2]}-k{c[3]}-{c[6]}"


def _run_mla(case: C.MlaCase, idx=None, cache=None, out_dtype=torch.float32, cfg=None):
    T, H, _ = case.q.shape
    out, lse = C.poisoned_mla_outputs(T, H, out_dtype)
    config = M.SparseMLAConfig.from_string(cfg) if cfg else None
    M.sparse_mla_attention(case.q, case.cache if cache is None else cache, case.idx if idx is None else idx,
                           case.scale, case.fmt, out=out, lse=lse, config=config)
    return out, lse


def _tol(out_dtype):
    return C.MLA_INTERP_F32 if out_dtype == torch.float32 else C.MLA_INTERP_BF16


def _drop_one_key(idx: torch.Tensor, num_slots: int, which: str, seed: int) -> torch.Tensor:
    r = random.Random(seed)
    mut = idx.clone()
    dropped = 0
    for t in range(idx.shape[0]):
        pos = [j for j in range(idx.shape[1]) if 0 <= int(idx[t, j]) < num_slots]
        if pos:
            j = pos[0] if which == "first" else pos[-1] if which == "last" else r.choice(pos)
            mut[t, j] = -1
            dropped += 1
    assert dropped, "no token with a valid index: nothing to drop"
    return mut


@pytest.mark.parametrize("which", ["first", "last", "random"])
@pytest.mark.parametrize("c", MLA, ids=_mla_id)
def test_mla_drop_key(c, which):
    case = C.mla_case(*c[:6])
    ref = case.ref()
    C.check_mla(*_run_mla(case, cfg=c[6]), ref, C.MLA_INTERP_F32, case.what)   # unmutated: passes
    n = R.mla_slots(case.cache, case.fmt).shape[0]
    mut = _drop_one_key(case.idx, n, which, c[0])
    must_fail(C.check_mla, *_run_mla(case, idx=mut, cfg=c[6]), ref, C.MLA_INTERP_F32, case.what)


@pytest.mark.parametrize("c", MLA[:3], ids=_mla_id)
def test_mla_drop_key_bf16_out(c):
    case = C.mla_case(*c[:6])
    n = R.mla_slots(case.cache, case.fmt).shape[0]
    mut = _drop_one_key(case.idx, n, "random", c[0])
    out_dtype = torch.bfloat16
    must_fail(C.check_mla, *_run_mla(case, idx=mut, out_dtype=out_dtype, cfg=c[6]), case.ref(), _tol(out_dtype),
              case.what)


def _scale_bytes(cache: torch.Tensor, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(a copy of the cache, the float32 view of its 4 scales at `slot`), slot = block * bs + offset."""
    mut = cache.clone()
    bs = mut.shape[1]
    return mut, mut[slot // bs, slot % bs, 512:528].view(torch.float32)


FP8 = [c for c in MLA if c[1] == "fp8_ds_mla"] + [(207, "fp8_ds_mla", 7, 130, 2, 16, "h16n32s3w4p2f")]


@pytest.mark.parametrize("c", FP8, ids=_mla_id)
def test_mla_fp8_tile_scale(c):
    """One 128-wide tile of one selected slot dequantised with 1.25x its scale."""
    case = C.mla_case(*c[:6])
    n = R.mla_slots(case.cache, case.fmt).shape[0]
    slot = next(int(i) for i in case.idx.flatten() if 0 <= int(i) < n)
    mut, scales = _scale_bytes(case.cache, slot)
    scales[c[0] % 4] *= 1.25
    must_fail(C.check_mla, *_run_mla(case, cache=mut, cfg=c[6]), case.ref(), C.MLA_INTERP_F32, case.what)


@pytest.mark.parametrize("c", FP8, ids=_mla_id)
def test_mla_fp8_scale_shift(c):
    """Every slot's last tile dequantised with its third tile's scale."""
    case = C.mla_case(*c[:6])
    mut = case.cache.clone()
    sc = mut[..., 512:528].clone().view(torch.float32)
    sc[..., 3] = sc[..., 2]
    mut[..., 512:528] = sc.view(torch.uint8)
    must_fail(C.check_mla, *_run_mla(case, cache=mut, cfg=c[6]), case.ref(), C.MLA_INTERP_F32, case.what)


@pytest.mark.parametrize("c", MLA[:4], ids=_mla_id)
def test_mla_out_of_range_ids_read_as_valid(c):
    """Without an all-invalid token, so that the numbers, not the -inf pattern, must show it."""
    case = C.mla_case(*c[:6], invalid_row=False)
    n = R.mla_slots(case.cache, case.fmt).shape[0]
    assert (case.idx >= n).any()
    mut = torch.where(case.idx >= n, n - 1, case.idx)
    must_fail(C.check_mla, *_run_mla(case, idx=mut, cfg=c[6]), case.ref(), C.MLA_INTERP_F32, case.what)


@pytest.mark.parametrize("c", MLA[:4], ids=_mla_id)
def test_mla_minus_one_read_as_slot_zero(c):
    case = C.mla_case(*c[:6], invalid_row=False)
    assert (case.idx == -1).any()
    mut = torch.where(case.idx == -1, 0, case.idx)
    must_fail(C.check_mla, *_run_mla(case, idx=mut, cfg=c[6]), case.ref(), C.MLA_INTERP_F32, case.what)


# ------------------------------------------------------------------------------------------------
# Indexer
# ------------------------------------------------------------------------------------------------
PREFILL = [(301, 9, 70, 4), (302, 7, 50, 64), (303, 8, 40, 100)]     # (seed, M, N, H)
# (seed, next_n, block_size, lens, H)
PAGED = [(311, 2, 16, [45, 3, 70], 4), (312, 1, 64, [100, 1], 32), (313, 2, 16, [30, 9], 128)]


def _prefill(case: C.PrefillCase, w=None, k_scales=None, ke=None):
    M_, N = case.q.shape[0], case.k.shape[0]
    return ix.fp8_mqa_logits(case.q, (case.k, case.k_scales if k_scales is None else k_scales),
                             case.w if w is None else w, case.ks, case.ke if ke is None else ke, True,
                             _out=C.poisoned((M_, N)))


def _paged(case: C.PagedCase, w=None, cache=None):
    B, next_n = case.q.shape[:2]
    return ix.fp8_paged_mqa_logits(case.q, case.cache if cache is None else cache, case.w if w is None else w,
                                   case.cl, case.tables, None, case.max_model_len, True,
                                   _out=C.poisoned((B * next_n, case.max_model_len)))


def _paged_case(p):
    seed, next_n, bs, lens, H = p
    return C.paged_case(seed, len(lens), next_n, H, bs, lens)


@pytest.mark.parametrize("p", PREFILL, ids=lambda p: f"seed={p[0]}-H{p[3]}")
def test_idx_prefill_drop_head(p):
    case = C.prefill_case(p[0], p[1], p[2], p[3])
    w = case.w.clone()
    w[:, p[0] % p[3]] = 0
    must_fail(C.check_logits, _prefill(case, w=w), case.ref(), C.IDX_INTERP, True, case.what)


@pytest.mark.parametrize("p", PAGED, ids=lambda p: f"seed={p[0]}-H{p[4]}")
def test_idx_paged_drop_head(p):
    case = _paged_case(p)
    w = case.w.clone()
    w[:, p[0] % p[4]] = 0
    must_fail(C.check_logits, _paged(case, w=w), case.ref(), C.IDX_INTERP, True, case.what)


@pytest.mark.parametrize("p", PREFILL, ids=lambda p: f"seed={p[0]}-H{p[3]}")
def test_idx_prefill_key_scale(p):
    case = C.prefill_case(p[0], p[1], p[2], p[3])
    ks = case.k_scales.clone()
    ks[int(case.ks[1]) + p[0] % 7] *= 1.01        # row 1 sees every key
    must_fail(C.check_logits, _prefill(case, k_scales=ks), case.ref(), C.IDX_INTERP, True, case.what)


@pytest.mark.parametrize("p", PAGED, ids=lambda p: f"seed={p[0]}-H{p[4]}")
def test_idx_paged_key_scale(p):
    case = _paged_case(p)
    cache = case.cache.clone()
    bs = cache.shape[1]
    blk = int(case.tables[0, 0])                      # request 0's first block, token 1
    flat = cache[blk].reshape(-1)
    at = slice(bs * 128 + 4, bs * 128 + 8)
    flat[at] = (flat[at].view(torch.float32) * 1.01).view(torch.uint8)
    must_fail(C.check_logits, _paged(case, cache=cache), case.ref(), C.IDX_INTERP, True, case.what)


@pytest.mark.parametrize("p", PAGED, ids=lambda p: f"seed={p[0]}-H{p[4]}")
def test_idx_paged_cache_in_per_token_layout(p):
    seed, next_n, bs, lens, H = p
    wrong = C.paged_case(seed, len(lens), next_n, H, bs, lens, interleaved=True)
    right = _paged_case(p)
    assert torch.equal(wrong.q, right.q) and torch.equal(wrong.tables, right.tables)
    must_fail(C.check_logits, _paged(right, cache=wrong.cache), right.ref(), C.IDX_INTERP, True, right.what)


@pytest.mark.parametrize("p", PREFILL, ids=lambda p: f"seed={p[0]}-H{p[3]}")
def test_idx_prefill_range_off_by_one(p):
    case = C.prefill_case(p[0], p[1], p[2], p[3])
    must_fail(C.check_logits, _prefill(case, ke=case.ke + 1), case.ref(), C.IDX_INTERP, True, case.what)
