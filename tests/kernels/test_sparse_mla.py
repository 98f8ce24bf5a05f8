"""Sparse-MLA attention kernel vs float32/float64 references, under Triton's CPU interpreter.

The kernel module is loaded as a private copy with TRITON_INTERPRET=1 set, whatever else this pytest
process imported before (the cross-compile test needs the compiled, non-interpreted kernels and runs in
a subprocess). Shapes are small and drawn fresh from a seeded generator per test case.
"""

from __future__ import annotations

import math
import os
import pathlib
import random

from tests.kernels._interp import load_interpreted  # sets TRITON_INTERPRET=1 before triton is imported
from tests.kernels._fp8_ds_mla import quantize_fp8_ds_mla

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
KERNEL_FILE = ROOT / "dsa_installer" / "kernels" / "sparse_mla.py"


M = load_interpreted(KERNEL_FILE, "_sparse_mla_interpreted")
assert type(M._sparse_mla_fwd_kernel).__name__ == "InterpretedFunction"

NAN_BYTE = 0xFF  # NaN as float8_e4m3fn, as float32 (0xFFFFFFFF) and as bfloat16 (0xFFFF)


# ------------------------------------------------------------------------------------------------
# Test-side fp8_ds_mla codec, written from the layout description (not from the kernel module)
# ------------------------------------------------------------------------------------------------
def make_cache(rng: torch.Generator, num_blocks: int, block_size: int, kv_format: str, *, pad: int = 0,
               scale: float = 1.0):
    """A paged cache [num_blocks, block_size, W] that is a strided view into a buffer whose padding rows
    (``pad`` per block) hold NaN, so a wrong address shows. Returns (cache view, float64 [slots, 576])."""
    n = num_blocks * block_size
    vals = torch.randn(n, 576, generator=rng) * scale
    if kv_format == "bf16":
        rows = vals.to(torch.bfloat16)
        exact = rows.double()
        buf = torch.full((num_blocks, block_size + pad, 576), float("nan"), dtype=torch.bfloat16)
    else:
        rows, exact = quantize_fp8_ds_mla(vals)
        buf = torch.full((num_blocks, block_size + pad, 656), NAN_BYTE, dtype=torch.uint8)
    buf[:, :block_size] = rows.view(num_blocks, block_size, -1)
    return buf[:, :block_size], exact


def loop_reference_f64(q: torch.Tensor, exact_kv: torch.Tensor, indices: torch.Tensor, scale: float):
    """Dumb per-(token, head) float64 loop: the definition, nothing clever."""
    T, H, _ = q.shape
    n = exact_kv.shape[0]
    out = torch.zeros(T, H, 512, dtype=torch.float64)
    lse = torch.full((T, H), float("-inf"), dtype=torch.float64)
    for t in range(T):
        sel = [int(i) for i in indices[t] if 0 <= int(i) < n]
        if not sel:
            continue
        rows = exact_kv[sel]
        for h in range(H):
            s = [scale * float(q[t, h].double() @ rows[j]) for j in range(len(sel))]
            m = max(s)
            w = [math.exp(v - m) for v in s]
            z = sum(w)
            lse[t, h] = m + math.log(z)
            out[t, h] = sum(w[j] * rows[j, :512] for j in range(len(sel))) / z
    return out, lse


def draw_indices(rng: random.Random, T: int, topk: int, num_slots: int, *, all_invalid_rows=()):
    """Random slot ids with duplicates, negatives, ids >= num_slots, and fully invalid rows."""
    idx = torch.empty(T, topk, dtype=torch.int32)
    for t in range(T):
        for j in range(topk):
            u = rng.random()
            if t in all_invalid_rows:
                idx[t, j] = rng.choice([-1, -rng.randint(2, 1 << 30), num_slots, num_slots + rng.randint(1, 999),
                                        (1 << 31) - 1])
            elif u < 0.08:
                idx[t, j] = -1
            elif u < 0.12:
                idx[t, j] = num_slots + rng.randint(0, 50)
            elif u < 0.2 and j > 0:
                idx[t, j] = idx[t, rng.randrange(j)]  # duplicate (may duplicate an invalid id too)
            else:
                idx[t, j] = rng.randrange(num_slots)
    return idx


def rel_err_per_token(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """max |out - ref| / max |ref| over (head, dim), per token (honest: no epsilon in the denominator)."""
    diff = (out.double() - ref.double()).abs().flatten(1).amax(1)
    den = ref.double().abs().flatten(1).amax(1)
    return diff / den


def check_against(out, lse, ref_o, ref_l, *, tol=1e-2, lse_tol=1e-3):
    assert not torch.isnan(out).any(), "NaN in out"
    assert not torch.isnan(lse).any(), "NaN in lse"
    empty = torch.isinf(ref_l) & (ref_l < 0)
    assert torch.equal(torch.isinf(lse) & (lse < 0), empty), "lse -inf pattern differs from reference"
    assert (out.float()[empty] == 0).all(), "row without valid index must give out == 0"
    tokens = ~empty.all(dim=1)
    if tokens.any():
        err = rel_err_per_token(out[tokens], ref_o[tokens])
        assert err.max().item() < tol, f"relative error {err.max().item():.3e} >= {tol}"
        fin = ~empty
        lerr = (lse.double()[fin] - ref_l.double()[fin]).abs().max().item()
        assert lerr < lse_tol, f"lse error {lerr:.3e}"


def run_poisoned(q, cache, idx, scale, fmt, **kw):
    T, H, _ = q.shape
    out = torch.full((T, H, 512), float("nan"), dtype=torch.bfloat16)
    lse = torch.full((T, H), float("nan"), dtype=torch.float32)
    o, l = M.sparse_mla_attention(q, cache, idx, scale, fmt, out=out, lse=lse, **kw)
    assert o.data_ptr() == out.data_ptr() and l.data_ptr() == lse.data_ptr()
    return o, l


# ------------------------------------------------------------------------------------------------
# The reference itself
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", M.KV_FORMATS)
def test_reference_matches_float64_loop(fmt):
    g = torch.Generator().manual_seed(11)
    r = random.Random(11)
    cache, exact = make_cache(g, num_blocks=3, block_size=4, kv_format=fmt, pad=1)
    T, H, topk = 4, 3, 9
    q = torch.randn(T, H, 576, generator=g).to(torch.bfloat16)
    idx = draw_indices(r, T, topk, 12, all_invalid_rows=(2,))
    scale = 0.09
    ro, rl = M.sparse_mla_reference(q, cache, idx, scale, fmt)
    lo, ll = loop_reference_f64(q, exact, idx, scale)
    assert torch.isinf(rl[2]).all() and (rl[2] < 0).all() and (ro[2] == 0).all()
    fin = torch.isfinite(ll)
    assert torch.equal(fin, torch.isfinite(rl))
    assert (ro.double() - lo).abs().max().item() < 1e-5 * lo.abs().max().item()
    assert (rl.double()[fin] - ll[fin]).abs().max().item() < 1e-5


def test_fp8_codec_agrees_with_module_dequantiser():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(20, 576, generator=g) * torch.logspace(-3, 3, 20)[:, None]
    x[5, :128] = 0  # an all-zero tile
    packed, exact = quantize_fp8_ds_mla(x)
    assert packed.shape == (20, M.FP8_DS_MLA_BYTES)
    deq = M.dequantize_fp8_ds_mla(packed)
    # float32 product of an e4m3 value (4 significant bits) and a float32 scale: one float32 rounding
    assert torch.allclose(deq.double(), exact, rtol=2.0 ** -23, atol=0)
    # e4m3 with a per-tile amax scale keeps ~2^-4 relative precision of each tile's largest value
    tile_err = (exact[:, :512] - x[:, :512].double()).abs().view(20, 4, 128).amax(-1)
    tile_max = x[:, :512].double().abs().view(20, 4, 128).amax(-1)
    assert (tile_err <= tile_max * 2.0 ** -4 + 1e-30).all()


# ------------------------------------------------------------------------------------------------
# The kernel
# ------------------------------------------------------------------------------------------------
CASES = [
    # (seed, fmt, H, topk, T, block_size, config string or None)
    (1, "bf16", 1, 1, 3, 16, None),
    (2, "bf16", 3, 7, 2, 1, None),
    (3, "bf16", 5, 37, 3, 64, "h16n16s3w4p2"),
    (4, "bf16", 16, 130, 2, 16, None),
    (5, "bf16", 17, 37, 2, 64, "h32n32s1w8p2"),
    (6, "bf16", 70, 19, 1, 16, "h64n16s2w8p2"),
    (7, "fp8_ds_mla", 1, 7, 3, 64, None),
    (8, "fp8_ds_mla", 5, 130, 2, 16, "h16n32s4w4p2"),
    (9, "fp8_ds_mla", 16, 37, 2, 1, None),
    (10, "fp8_ds_mla", 33, 64, 1, 64, "h32n16s2w8p2"),
    (11, "bf16", 3, 200, 2, 16, "h16n16s13w4p2"),  # the 16-wide merge bucket
    (18, "bf16", 2, 700, 2, 16, "h16n16s40w4p2"),  # more splits than one merge chunk (32)
    (19, "bf16", 4, 150, 2, 16, "h16n16s6w4p2"),  # the 8-wide merge bucket (see _COMBINE_BUCKETS)
    (12, "fp8_ds_mla", 2, 300, 1, 64, "h16n16s19w4p2"),
    # value-dimension split (two programs per row) and fp8 scales applied after the dots
    (13, "bf16", 19, 70, 2, 16, "h16n32s2w4p2d2"),
    (14, "bf16", 64, 33, 1, 64, "h64n16s1w8p2d2"),
    (15, "fp8_ds_mla", 7, 130, 2, 16, "h16n32s3w4p2f"),
    (16, "fp8_ds_mla", 40, 37, 2, 1, "h32n16s1w8p2d2f"),
    (17, "fp8_ds_mla", 3, 90, 3, 64, "h16n32s1w4p2d2"),
    # per-rank head counts under tensor parallelism, with the shipped heuristic: GLM-5 (64 heads) at
    # TP 8 / 2, DeepSeek-V3.2 (128 heads) at TP 8 -> 8 / 32 / 16 heads per GPU
    (20, "bf16", 8, 64, 2, 64, None),
    (21, "fp8_ds_mla", 8, 130, 1, 64, None),
    (22, "bf16", 32, 50, 2, 64, None),
]


@pytest.mark.parametrize("seed,fmt,H,topk,T,block_size,cfg", CASES,
                         ids=[f"{c[1]}-H{c[2]}-k{c[3]}-T{c[4]}-bs{c[5]}-{c[6]}" for c in CASES])
def test_kernel_matches_reference(seed, fmt, H, topk, T, block_size, cfg):
    r = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    num_blocks = r.randint(1, max(1, 200 // block_size))
    num_slots = num_blocks * block_size
    cache, exact = make_cache(g, num_blocks, block_size, fmt, pad=r.choice([0, 1, 3]))
    q = (torch.randn(T, H, 576, generator=g) * r.choice([0.5, 1.0, 3.0])).to(torch.bfloat16)
    invalid_rows = (r.randrange(T),) if T > 1 else ()
    idx = draw_indices(r, T, topk, num_slots, all_invalid_rows=invalid_rows)
    scale = r.choice([576 ** -0.5, 0.1, 0.2])
    config = M.SparseMLAConfig.from_string(cfg) if cfg else None
    out, lse = run_poisoned(q, cache, idx, scale, fmt, config=config)
    ro, rl = M.sparse_mla_reference(q, cache, idx, scale, fmt)
    check_against(out, lse, ro, rl)
    # The reference agrees with the definition on the test's own decoding of the cache.
    lo, ll = loop_reference_f64(q[:1, :2], exact, idx[:1], scale)
    assert (ro[:1, :2].double() - lo).abs().max().item() <= 1e-5 * max(1.0, lo.abs().max().item())


FRESH_SEED = int(os.environ.get("SPARSE_MLA_SEED", random.SystemRandom().randrange(1 << 30)))


@pytest.mark.parametrize("draw", range(6))
def test_kernel_fresh_random_shapes(draw):
    """Shapes, data, indices and launch configuration drawn fresh each run (the seed is in the failure
    message; rerun with SPARSE_MLA_SEED=<seed> to reproduce)."""
    seed = FRESH_SEED + draw
    r = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    fmt = r.choice(M.KV_FORMATS)
    H = r.choice([1, 2, 3, 5, 7, 8, 11, 16, 19, 31, 32, 33, 64, 65, 100, 128])
    topk = r.choice([1, 2, 7, 16, 37, 64, 97, 130, 200])
    T = r.randint(1, 3 if H <= 32 else 1)
    block_size = r.choice([1, 2, 16, 64])
    num_blocks = r.randint(1, max(1, 300 // block_size))
    cache, _ = make_cache(g, num_blocks, block_size, fmt, pad=r.choice([0, 2]), scale=r.choice([0.3, 1.0, 4.0]))
    q = (torch.randn(T, H, 576, generator=g) * r.choice([0.3, 1.0, 2.0])).to(torch.bfloat16)
    idx = draw_indices(r, T, topk, num_blocks * block_size,
                      all_invalid_rows=(r.randrange(T),) if r.random() < 0.3 else ())
    tiles = sorted({t for cap in [(8, 0), (8, 6), (9, 0)] for f in M.KV_FORMATS for t in M.candidate_tiles(cap, f)})
    if r.random() < 0.3:
        config = None
    else:
        bh, bn, nw, ns, dv, post = r.choice(tiles)
        config = M.SparseMLAConfig(bh, bn, r.randint(1, 6), nw, ns, r.choice([1, dv, 2]), r.choice([post, True]))
    scale = r.choice([576 ** -0.5, 0.1])
    what = f"seed={seed} fmt={fmt} H={H} topk={topk} T={T} block_size={block_size} config={config}"
    out, lse = run_poisoned(q, cache, idx, scale, fmt, config=config)
    ro, rl = M.sparse_mla_reference(q, cache, idx, scale, fmt)
    try:
        check_against(out, lse, ro, rl)
    except AssertionError as e:
        raise AssertionError(f"{what}: {e}") from None


@pytest.mark.parametrize("post", [False, True], ids=["scale-tile", "scale-after-dot"])
@pytest.mark.parametrize("native", [True, False], ids=["cvt-e4m3", "bit-trick-sm80"])
def test_fp8_both_conversion_paths(native, post):
    r = random.Random(21)
    g = torch.Generator().manual_seed(21)
    cache, exact = make_cache(g, 4, 16, "fp8_ds_mla", scale=7.0)
    # make some values subnormal in e4m3 (tiny relative to the tile max) and some negative zeros
    T, H, topk = 2, 4, 40
    q = torch.randn(T, H, 576, generator=g).to(torch.bfloat16)
    idx = draw_indices(r, T, topk, 64)
    config = M.SparseMLAConfig(16, 16, 2, 4, 2, 1, post)
    out, lse = run_poisoned(q, cache, idx, 0.05, "fp8_ds_mla", _fp8_native=native, config=config)
    ro, rl = M.sparse_mla_reference(q, cache, idx, 0.05, "fp8_ds_mla")
    check_against(out, lse, ro, rl)


def test_fp8_subnormals_and_signs_decode_exactly():
    """Every one of the 256 e4m3 byte values (except NaN) decodes right in both conversion paths:
    one-hot rows make the output equal to the dequantised row itself."""
    codes = torch.arange(256, dtype=torch.int32)
    codes = codes[(codes & 0x7F) != 0x7F].to(torch.uint8)  # drop the two NaN encodings
    n = 4
    rows = torch.zeros(n, 656, dtype=torch.uint8)
    vals = codes.repeat(-(-512 * n // codes.numel()))[: 512 * n]
    rows[:, :512] = vals.view(n, 512)
    rows[:, 512:528] = torch.tensor([1.0, 0.5, 2.0 ** -3, 3.0]).view(torch.uint8).repeat(n, 1)
    rows[:, 528:] = torch.randn(n, 64).to(torch.bfloat16).view(torch.uint8)
    cache = rows.view(n, 1, 656)
    idx = torch.arange(n, dtype=torch.int32).view(n, 1)  # token t attends only to slot t
    q = torch.randn(n, 1, 576).to(torch.bfloat16)
    expect = M.dequantize_fp8_ds_mla(rows)[:, :512]
    for native in (True, False):
        out, lse = run_poisoned(q, cache, idx, 0.1, "fp8_ds_mla", _fp8_native=native)
        # softmax over a single key is exactly 1: out is the row (rounded to bf16 in the interpreter)
        assert torch.allclose(out[:, 0].float(), expect, rtol=2 ** -7, atol=0), native


@pytest.mark.parametrize("fmt", M.KV_FORMATS)
def test_splits_without_any_valid_index_are_ignored(fmt):
    r = random.Random(8)
    g = torch.Generator().manual_seed(8)
    cache, _ = make_cache(g, 2, 64, fmt)
    T, H, topk = 2, 4, 96
    q = torch.randn(T, H, 576, generator=g).to(torch.bfloat16)
    idx = draw_indices(r, T, topk, 128)
    idx[0, :16] = -1  # split 0 of token 0 is empty
    idx[0, 48:80] = 128  # splits 3 and 4 of token 0 point past the cache
    idx[1, 16:] = -7  # token 1: only split 0 has work
    out, lse = run_poisoned(q, cache, idx, 0.1, fmt, config=M.SparseMLAConfig(16, 16, 6, 4, 2))
    ro, rl = M.sparse_mla_reference(q, cache, idx, 0.1, fmt)
    check_against(out, lse, ro, rl)


def test_strided_inputs_and_flashmla_shaped_views():
    r = random.Random(5)
    g = torch.Generator().manual_seed(5)
    T, H, topk = 3, 6, 21
    cache, _ = make_cache(g, 5, 8, "bf16")
    big_q = torch.randn(T, H + 2, 600, generator=g).to(torch.bfloat16)
    q = big_q[:, 1:H + 1, 10:586]  # strided T and H, contiguous last dim
    idx_big = draw_indices(r, T, topk + 3, 40)
    idx = idx_big[:, 2:2 + topk]  # strided rows
    lse_t = torch.full((H, T), float("nan"))  # FlashMLA-style [H, T] storage, passed as a [T, H] view
    out = torch.full((T, H, 512), float("nan"), dtype=torch.bfloat16)
    o, l = M.sparse_mla_attention(q, cache.unsqueeze(2), idx.unsqueeze(1), 0.1, out=out, lse=lse_t.T,
                                  config=M.SparseMLAConfig(16, 16, 2, 4, 2))
    ro, rl = M.sparse_mla_reference(q.contiguous(), cache, idx.contiguous(), 0.1)
    check_against(o, lse_t.T, ro, rl)
    # [num_slots, 1, W] view of the same cache gives the same answer
    flat = cache.contiguous().view(-1, 1, 576)
    o2, l2 = run_poisoned(q, flat, idx, 0.1, "bf16", config=M.SparseMLAConfig(16, 16, 2, 4, 2))
    assert torch.equal(o2, o) and torch.equal(l2, lse_t.T)


def test_zero_tokens_and_bad_inputs():
    cache = torch.zeros(2, 4, 576, dtype=torch.bfloat16)
    q0 = torch.zeros(0, 4, 576, dtype=torch.bfloat16)
    o, l = M.sparse_mla_attention(q0, cache, torch.zeros(0, 3, dtype=torch.int32), 0.1)
    assert o.shape == (0, 4, 512) and l.shape == (0, 4)
    q = torch.zeros(1, 4, 576, dtype=torch.bfloat16)
    idx = torch.zeros(1, 3, dtype=torch.int32)
    bad = [
        dict(kv_format="fp8"),
        dict(q=torch.zeros(1, 4, 512, dtype=torch.bfloat16)),
        dict(q=torch.zeros(1, 129, 576, dtype=torch.bfloat16)),
        dict(q=q.float()),
        dict(indices=idx.long()),
        dict(indices=torch.zeros(2, 3, dtype=torch.int32)),
        dict(indices=torch.zeros(1, 0, dtype=torch.int32)),
        dict(kv_cache=torch.zeros(2, 4, 656, dtype=torch.uint8)),  # fp8 bytes with kv_format bf16
        dict(kv_cache=cache, kv_format="fp8_ds_mla"),
    ]
    for b in bad:
        args = dict(q=q, kv_cache=cache, indices=idx, softmax_scale=0.1, kv_format="bf16")
        args.update(b)
        with pytest.raises(ValueError, match="sparse_mla_attention"):
            M.sparse_mla_attention(**args)


# ------------------------------------------------------------------------------------------------
# The launch heuristic
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("capability", [(8, 0), (8, 6), (8, 9), (9, 0), (12, 0)])
@pytest.mark.parametrize("fmt", M.KV_FORMATS)
def test_heuristic_emits_only_table_tiles_and_no_empty_split(capability, fmt):
    tiles = set(M.candidate_tiles(capability, fmt))
    assert tiles
    for T in (1, 2, 7, 8, 32, 128, 4096):
        for H in (1, 5, 8, 16, 17, 32, 64, 100, 128):
            for topk in (1, 7, 130, 2048):
                for sms in (30, 132, 188):
                    c = M.choose_config(T, H, topk, fmt, sm_count=sms, capability=capability)
                    assert c.tile in tiles
                    assert c.block_h >= min(H, 16) and c.num_splits >= 1
                    split_len = -(-topk // c.num_splits)
                    split_len = -(-split_len // c.block_n) * c.block_n
                    assert (c.num_splits - 1) * split_len < topk  # the last split has work


def test_config_strings_round_trip():
    for cap in [(8, 0), (8, 6), (9, 0), (12, 0)]:
        for fmt in M.KV_FORMATS:
            for tile in M.candidate_tiles(cap, fmt) + M.FOCUS_TILES[fmt]:
                c = M.SparseMLAConfig.from_tile(tile, 7)
                assert M.SparseMLAConfig.from_string(str(c)) == c
    assert str(M.SparseMLAConfig(64, 64, 1, 8, 3, 2, True)) == "h64n64s1w8p3d2f"
    with pytest.raises(ValueError):
        M.SparseMLAConfig.from_string("h64n64s1w8")


@pytest.mark.parametrize("fmt", M.KV_FORMATS)
def test_merge_when_a_whole_first_chunk_of_splits_is_empty(fmt):
    """The split merge runs an online max over chunks of 32 splits: chunk 0 all empty, work after it."""
    r = random.Random(9)
    g = torch.Generator().manual_seed(9)
    cache, _ = make_cache(g, 3, 64, fmt)
    T, H, topk = 2, 3, 16 * 40
    q = torch.randn(T, H, 576, generator=g).to(torch.bfloat16)
    idx = draw_indices(r, T, topk, 192)
    idx[0, :16 * 33] = -1  # token 0: splits 0..32 empty (all of chunk 0 and one of chunk 1)
    idx[1, 16 * 32:] = 10 ** 6  # token 1: only chunk 0 has work
    out, lse = run_poisoned(q, cache, idx, 0.1, fmt, config=M.SparseMLAConfig(16, 16, 40, 4, 2))
    ro, rl = M.sparse_mla_reference(q, cache, idx, 0.1, fmt)
    check_against(out, lse, ro, rl)


def test_kernel_cases_cover_every_merge_bucket():
    """Every split-merge launch bucket (CHUNK_S, BLOCK_D) is run by at least one CASES entry, and the
    bucket holds its split count in one chunk except for the last (any count, several chunks)."""
    hit = set()
    for _, _, _, topk, _, _, cfg in CASES:
        if cfg is None:
            continue
        c = M.SparseMLAConfig.from_string(cfg)
        s = max(1, min(c.num_splits, -(-topk // c.block_n)))
        split_len = -(-(-(-topk // s)) // c.block_n) * c.block_n
        s = -(-topk // split_len)  # as the launcher re-derives it
        if s > 1:
            chunk, block_d = M._combine_bucket(s)
            assert 512 % block_d == 0
            assert s <= chunk or (chunk, block_d) == M._COMBINE_BUCKETS[-1][1:]
            hit.add((chunk, block_d))
    assert hit == {b[1:] for b in M._COMBINE_BUCKETS}, f"buckets not exercised: {hit}"
