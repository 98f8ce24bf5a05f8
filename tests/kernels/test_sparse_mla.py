"""Sparse-MLA attention kernel vs the independent float64 reference of tests/kernels/_refs.py, under Triton's
CPU interpreter.

The kernel module is loaded as a private copy with TRITON_INTERPRET=1 set, whatever else this pytest process
imported before (the cross-compile and GPU tests need the compiled kernels). Every case compares every token
and head; the interpreter's dots are float32 (DOT_F32), so most cases ask for a float32 ``out`` and are held
to float32-rounding tolerances, and the cases in BF16_OUT run again with the shipped bfloat16 output. The
tolerances, with the errors measured when they were set, are in tests/kernels/_cases.py; test_mutations.py
proves they catch a dropped key or a mis-scaled fp8 tile. Seeds are in the test ids.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import random

from tests.kernels._interp import load_interpreted  # sets TRITON_INTERPRET=1 before triton is imported
from tests.kernels import _cases as C
from tests.kernels._fp8_ds_mla import quantize_fp8_ds_mla
from tests.kernels._refs import mla_slots, sparse_mla_ref64

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
KERNEL_FILE = ROOT / "overlay" / "kernels" / "sparse_mla.py"


M = load_interpreted(KERNEL_FILE, "_sparse_mla_interpreted")
assert type(M._sparse_mla_fwd_kernel).__name__ == "InterpretedFunction"


@pytest.fixture(scope="module", autouse=True)
def _print_measured_errors(request):
    yield
    C.report_errors(request)


def run_poisoned(case: C.MlaCase, out_dtype=torch.float32, **kw):
    """The kernel into NaN-filled out/lse buffers (which it must fill completely)."""
    T, H, _ = case.q.shape
    out, lse = C.poisoned_mla_outputs(T, H, out_dtype)
    o, l = M.sparse_mla_attention(case.q, case.cache, case.idx, case.scale, case.fmt, out=out, lse=lse, **kw)
    assert o.data_ptr() == out.data_ptr() and l.data_ptr() == lse.data_ptr()
    return o, l


def check_case(case: C.MlaCase, out_dtype=torch.float32, ref=None, **kw):
    o, l = run_poisoned(case, out_dtype, **kw)
    tol = C.MLA_INTERP_F32 if out_dtype == torch.float32 else C.MLA_INTERP_BF16
    return C.check_mla(o, l, ref if ref is not None else case.ref(), tol, f"{case.what} out={out_dtype}")


# ------------------------------------------------------------------------------------------------
# The module's own float32 reference (public: the benchmark uses it) against the independent one
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [11, 12])
@pytest.mark.parametrize("fmt", M.KV_FORMATS)
def test_module_reference_matches_independent_reference(fmt, seed):
    case = C.mla_case(seed, fmt, H=5, topk=37, T=4, block_size=4, num_blocks=7)
    ro, rl, vscale, sscale = case.ref()
    mo, ml = M.sparse_mla_reference(case.q, case.cache, case.idx, case.scale, fmt)
    fin = torch.isfinite(rl)
    assert torch.equal(fin, torch.isfinite(ml)) and (mo[~fin] == 0).all()
    # float32 math over 576-term dots: measured 1.2e-7 (out, relative) and 4.8e-7 (lse)
    assert ((mo.double() - ro).abs().amax(-1)[fin] / vscale[:, None].expand_as(rl)[fin]).max() < 1e-6
    assert ((ml.double() - rl).abs() / sscale.clamp_min(1))[fin].max() < 2e-6


def test_fp8_codec_round_trips_through_the_independent_decoder():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(20, 576, generator=g) * torch.logspace(-3, 3, 20)[:, None]
    x[5, :128] = 0  # an all-zero tile
    packed, exact = quantize_fp8_ds_mla(x)
    assert packed.shape == (20, M.FP8_DS_MLA_BYTES)
    assert torch.equal(mla_slots(packed, "fp8_ds_mla"), exact)
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
    # the 128-head d2 focus tiles (one warpgroup per 64 heads), with masked heads
    (27, "bf16", 100, 70, 2, 16, "h128n32s2w8p2d2"),
    (28, "fp8_ds_mla", 128, 45, 1, 64, "h128n32s1w8p2d2"),
    # per-rank head counts under tensor parallelism, with the shipped heuristic: GLM-5 (64 heads) at
    # TP 8 / 2, DeepSeek-V3.2 (128 heads) at TP 8 -> 8 / 32 / 16 heads per GPU
    (20, "bf16", 8, 64, 2, 64, None),
    (21, "fp8_ds_mla", 8, 130, 1, 64, None),
    (22, "bf16", 32, 50, 2, 64, None),
    # the largest head count (DeepSeek-V3.2 on one GPU) and the largest top-k (2048, 32 latency splits)
    (23, "bf16", 128, 40, 2, 64, None),
    (24, "fp8_ds_mla", 128, 33, 1, 16, "h64n32s2w8p2"),
    (25, "bf16", 3, 2048, 1, 64, None),
    (26, "fp8_ds_mla", 2, 2048, 1, 64, None),
]
# Cases run a second time with the shipped bfloat16 output (split and unsplit, both formats, d2, f).
BF16_OUT = {2, 5, 8, 12, 13, 15, 21, 23, 25}


def _case_id(c):
    return f"seed={c[0]}-{c[1]}-H{c[2]}-k{c[3]}-T{c[4]}-bs{c[5]}-{c[6]}"


@pytest.mark.parametrize("seed,fmt,H,topk,T,block_size,cfg", CASES, ids=[_case_id(c) for c in CASES])
def test_kernel_matches_reference(seed, fmt, H, topk, T, block_size, cfg):
    case = C.mla_case(seed, fmt, H, topk, T, block_size)
    config = M.SparseMLAConfig.from_string(cfg) if cfg else None
    ref = case.ref()
    check_case(case, torch.float32, ref, config=config)
    if seed in BF16_OUT:
        check_case(case, torch.bfloat16, ref, config=config)


def _fresh_seed() -> int:
    """SPARSE_MLA_SEED if set; else one per pytest run (the same in every pytest-xdist worker of the run, so
    they collect the same ids); else fresh."""
    if os.environ.get("SPARSE_MLA_SEED"):
        return int(os.environ["SPARSE_MLA_SEED"])
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run:
        return int(hashlib.sha256(run.encode()).hexdigest(), 16) % (1 << 30)
    return random.SystemRandom().randrange(1 << 30)


FRESH_SEED = _fresh_seed()


@pytest.mark.parametrize("seed", [FRESH_SEED + i for i in range(6)], ids=lambda s: f"seed={s}")
def test_kernel_fresh_random_shapes(seed):
    """Shapes, data, indices and launch configuration drawn fresh each run (the seed is in the test id;
    rerun with SPARSE_MLA_SEED=<first seed of the run> to reproduce)."""
    r = random.Random(seed)
    fmt = r.choice(M.KV_FORMATS)
    H = r.choice([1, 2, 3, 5, 7, 8, 11, 16, 19, 31, 32, 33, 64, 65, 100, 128])
    topk = r.choice([1, 2, 7, 16, 37, 64, 97, 130, 200])
    T = r.randint(1, 3 if H <= 32 else 1)
    block_size = r.choice([1, 2, 16, 64])
    case = C.mla_case(seed, fmt, H, topk, T, block_size, num_blocks=r.randint(1, max(1, 300 // block_size)),
                      invalid_row=r.random() < 0.3, kv_scale=r.choice([0.3, 1.0, 4.0]))
    tiles = sorted({t for cap in [(8, 0), (8, 6), (9, 0)] for f in M.KV_FORMATS
                    for t in M.candidate_tiles(cap, f) if not t[6]})  # Gluon tiles do not interpret (GPU checks)
    if r.random() < 0.3:
        config = None
    else:
        bh, bn, nw, ns, dv, post, _, prefetch = r.choice(tiles)
        config = M.SparseMLAConfig(bh, bn, r.randint(1, 6), nw, ns, r.choice([1, dv, 2]), r.choice([post, True]),
                                   fp8_prefetch=r.choice([prefetch, 1, 2]))
    case.what += f" config={config}"
    check_case(case, r.choice([torch.float32, torch.bfloat16]), config=config)


@pytest.mark.parametrize("post", [False, True], ids=["scale-tile", "scale-after-dot"])
@pytest.mark.parametrize("native", [True, False], ids=["cvt-e4m3", "bit-trick-sm80"])
def test_fp8_both_conversion_paths(native, post):
    case = C.mla_case(21, "fp8_ds_mla", H=4, topk=40, T=2, block_size=16, num_blocks=4, kv_scale=7.0)
    outs = []
    for prefetch in (0, 1, 2):  # no prefetch, the next block's raw tiles carried, or its decoded tiles carried
        config = M.SparseMLAConfig(16, 16, 2, 4, 2, 1, post, fp8_prefetch=prefetch)
        check_case(case, _fp8_native=native, config=config)
        outs.append(run_poisoned(case, torch.float32, _fp8_native=native, config=config))
    for o, l in outs[1:]:  # only the schedule differs: the interpreter's results are the same bits
        assert torch.equal(o, outs[0][0]) and torch.equal(l, outs[0][1])


def test_fp8_subnormals_and_signs_decode_exactly():
    """Every one of the 256 e4m3 byte values (except NaN) decodes right in both conversion paths:
    one-hot rows make the output equal to the dequantised row itself (exact in float32: 4-bit
    mantissas times scales of at most 2 significant bits)."""
    case, expect = C.every_e4m3_code_case()
    for native in (True, False):
        for prefetch in (0, 2):
            config = M.SparseMLAConfig(16, 16, 1, 4, 2, fp8_prefetch=prefetch)
            out, lse = run_poisoned(case, torch.float32, _fp8_native=native, config=config)
            assert torch.equal(out[:, 0].double(), expect), (native, prefetch)


@pytest.mark.parametrize("fmt", M.KV_FORMATS)
def test_splits_without_any_valid_index_are_ignored(fmt):
    case = C.mla_case(8, fmt, H=4, topk=96, T=2, block_size=64, num_blocks=2, invalid_row=False)
    case.idx[0, :16] = -1  # split 0 of token 0 is empty
    case.idx[0, 48:80] = 128  # splits 3 and 4 of token 0 point past the cache
    case.idx[1, 16:] = -7  # token 1: only split 0 has work
    check_case(case, config=M.SparseMLAConfig(16, 16, 6, 4, 2))


@pytest.mark.parametrize("fmt", M.KV_FORMATS)
def test_split_partials_workspace_is_reused_poisoned_and_grown(fmt):
    """The split partials live in a grow-only per-(device, stream) workspace that every split call shares: a
    call is right whatever an earlier one left there (NaN here, empty splits included), a repeat call of the
    same plan reuses the views, and a larger call grows the buffer (which a smaller plan then re-slices)."""
    small = C.mla_case(21, fmt, H=4, topk=96, T=2, block_size=64, num_blocks=2, invalid_row=True)
    small.idx[1, 16:] = -1  # token 1: splits 1.. of it empty
    big = C.mla_case(22, fmt, H=5, topk=160, T=7, block_size=64, num_blocks=3, invalid_row=False)
    cfg = M.SparseMLAConfig(16, 16, 6, 4, 2)
    M._PARTIALS.bufs.clear()  # a fresh workspace (earlier tests grew it)
    plan = M._Plan(small.q, small.cache, small.idx, fmt, None, None, cfg, None, None, None)
    assert plan.split and plan.num_splits == 6
    po, plse = plan._scratch(small.q.device)[:2]
    po.fill_(float("nan")), plse.fill_(float("nan"))
    again = plan._scratch(small.q.device)
    assert again[0] is po and again[1] is plse                      # a repeat call: the kept views
    check_case(small, config=cfg)
    gen = M._PARTIALS.gen
    base = po.untyped_storage().data_ptr()
    grown = M._Plan(big.q, big.cache, big.idx, fmt, None, None, cfg, None, None, None)._scratch(big.q.device)
    assert M._PARTIALS.gen == gen + 1 and grown[0].untyped_storage().data_ptr() != base  # outgrew it
    grown[0].fill_(float("nan")), grown[1].fill_(float("nan"))
    check_case(big, config=cfg)
    resliced = plan._scratch(small.q.device)
    assert resliced[0].untyped_storage().data_ptr() == grown[0].untyped_storage().data_ptr()
    check_case(small, config=cfg)                                     # after the big one, in its buffer


@pytest.mark.parametrize("fmt", M.KV_FORMATS)
def test_without_lse_the_stream_scratch_takes_it_and_out_is_unchanged(fmt):
    """with_lse=False (the backend's call: vLLM reads no lse): None comes back instead of an lse tensor, the kernel
    writes the lse into the stream's scratch (found NaN-poisoned here) and out is the with-lse call's, bit for bit,
    split and unsplit."""
    case = C.mla_case(31, fmt, H=5, topk=96, T=3, block_size=64, num_blocks=2)
    T, H = case.q.shape[:2]
    for cfg in (M.SparseMLAConfig(16, 16, 6, 4, 2), M.SparseMLAConfig(16, 16, 1, 4, 2)):
        want_o, want_l = C.poisoned_mla_outputs(T, H, torch.float32)
        M.sparse_mla_attention(case.q, case.cache, case.idx, case.scale, fmt, out=want_o, lse=want_l, config=cfg)
        plan = M._Plan(case.q, case.cache, case.idx, fmt, want_o, None, cfg, None, None, None, False)
        assert plan.split == (cfg.num_splits > 1) and not plan.with_lse
        parts = plan._scratch(case.q.device)
        assert (parts[0] is not None) == plan.split and parts[2].shape == (T, H) and parts[3] is None
        for part in parts[:3]:
            if part is not None:
                part.fill_(float("nan"))
        got_o, _ = C.poisoned_mla_outputs(T, H, torch.float32)
        o, lse = M.sparse_mla_attention(case.q, case.cache, case.idx, case.scale, fmt, out=got_o, config=cfg,
                                        with_lse=False)
        assert o is got_o and lse is None and torch.equal(got_o, want_o), cfg
        assert torch.equal(parts[2], want_l), cfg   # the same scratch: the call's plan sliced the same buffer
    with_l = M.sparse_mla_attention(case.q, case.cache, case.idx, case.scale, fmt, lse=want_l, with_lse=False)[1]
    assert with_l is want_l  # an lse given is an lse wanted


def test_strided_inputs_and_flashmla_shaped_views():
    r = random.Random(5)
    g = torch.Generator().manual_seed(5)
    T, H, topk = 3, 6, 21
    cache = C.mla_cache(g, 5, 8, "bf16")
    big_q = torch.randn(T, H + 2, 600, generator=g).to(torch.bfloat16)
    q = big_q[:, 1:H + 1, 10:586]  # strided T and H, contiguous last dim
    idx_big = C.draw_indices(r, T, topk + 3, 40)
    idx = idx_big[:, 2:2 + topk]  # strided rows
    lse_t = torch.full((H, T), float("nan"))  # FlashMLA-style [H, T] storage, passed as a [T, H] view
    out = torch.full((T, H, 512), float("nan"), dtype=torch.float32)
    o, l = M.sparse_mla_attention(q, cache.unsqueeze(2), idx.unsqueeze(1), 0.1, out=out, lse=lse_t.T,
                                  config=M.SparseMLAConfig(16, 16, 2, 4, 2))
    ref = sparse_mla_ref64(q, cache, idx, 0.1)
    C.check_mla(o, lse_t.T, ref, C.MLA_INTERP_F32, "strided")
    # [num_slots, 1, W] view of the same cache gives the same answer
    flat = C.MlaCase(q, cache.contiguous().view(-1, 1, 576), idx, 0.1, "bf16", "flat")
    o2, l2 = run_poisoned(flat, torch.float32, config=M.SparseMLAConfig(16, 16, 2, 4, 2))
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


def test_a_tensor_on_another_device_is_a_one_line_error_naming_it():
    q = torch.zeros(2, 4, 576, dtype=torch.bfloat16)
    cache = torch.zeros(3, 4, 576, dtype=torch.bfloat16)
    idx = torch.zeros(2, 3, dtype=torch.int32)
    meta = torch.device("meta")
    for name, b in (("kv_cache", dict(kv_cache=cache.to(meta))), ("indices", dict(indices=idx.to(meta))),
                    ("out", dict(out=torch.empty(2, 4, 512, device=meta))),
                    ("lse", dict(lse=torch.empty(2, 4, device=meta))),
                    ("block_table", dict(block_table=torch.zeros(2, 1, dtype=torch.int32, device=meta),
                                         req_id=torch.zeros(2, dtype=torch.int32))),
                    ("req_id", dict(block_table=torch.zeros(2, 1, dtype=torch.int32),
                                    req_id=torch.zeros(2, dtype=torch.int32, device=meta)))):
        args = dict(q=q, kv_cache=cache, indices=idx, softmax_scale=0.1, kv_format="bf16")
        args.update(b)
        with pytest.raises(ValueError, match=f"sparse_mla_attention: {name} is on meta, not cpu .q's device."):
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
                    split_len = -(-split_len // c.split_unit) * c.split_unit
                    assert (c.num_splits - 1) * split_len < topk  # the last split has work


def test_config_strings_round_trip():
    for cap in [(8, 0), (8, 6), (9, 0), (12, 0)]:
        for fmt in M.KV_FORMATS:
            for tile in M.candidate_tiles(cap, fmt) + M.FOCUS_TILES[fmt]:
                c = M.SparseMLAConfig.from_tile(tile, 7)
                assert M.SparseMLAConfig.from_string(str(c)) == c
    assert str(M.SparseMLAConfig(64, 64, 1, 8, 3, 2, True)) == "h64n64s1w8p3d2f"
    assert M.SparseMLAConfig.from_string("h16n64s1w8p2r") == M.SparseMLAConfig(16, 64, 1, 8, 2, fp8_prefetch=True)
    assert M.SparseMLAConfig.from_string("h16n64s1w8p2a") == M.SparseMLAConfig(16, 64, 1, 8, 2, fp8_prefetch=2)
    assert str(M.SparseMLAConfig.from_tile((32, 32, 8, 2, 1, False, False, 2), 3)) == "h32n32s3w8p2a"
    for bad in ("h64n64s1w8", "h16n64s1w8p2ra", "h16n64s1w8p2b"):
        with pytest.raises(ValueError):
            M.SparseMLAConfig.from_string(bad)
    with pytest.raises(ValueError, match="fp8_prefetch must be 0, 1"):
        M.SparseMLAConfig(16, 16, 1, 4, 2, fp8_prefetch=3)


@pytest.mark.parametrize("fmt", M.KV_FORMATS)
def test_merge_when_a_whole_first_chunk_of_splits_is_empty(fmt):
    """The split merge runs an online max over chunks of 32 splits: chunk 0 all empty, work after it."""
    case = C.mla_case(9, fmt, H=3, topk=16 * 40, T=2, block_size=64, num_blocks=3, invalid_row=False)
    case.idx[0, :16 * 33] = -1  # token 0: splits 0..32 empty (all of chunk 0 and one of chunk 1)
    case.idx[1, 16 * 32:] = 10 ** 6  # token 1: only chunk 0 has work
    check_case(case, config=M.SparseMLAConfig(16, 16, 40, 4, 2))


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


@pytest.mark.parametrize("fmt", M.KV_FORMATS)
def test_request_local_indices_equal_converted_slot_ids(fmt):
    """block_table / req_id (the kernel converts request-local positions itself, as the backend calls it)
    give bit for bit the result of converting first with the backend's torch conversion, on every kind of
    invalid position: -1, other negatives, a block past the table's width, a -1 table entry; with an index
    buffer and a req_id buffer longer than the batch (rows past T unread: NaN-free garbage there)."""
    from overlay.triton_mla_sparse_ops import convert_req_index_to_global

    g = torch.Generator().manual_seed(31)
    r = random.Random(31)
    block_size, num_blocks, T, H, topk = 8, 9, 5, 3, 19
    cache = C.mla_cache(g, num_blocks, block_size, fmt)
    block_table = torch.randperm(num_blocks, generator=g)[:8].view(2, 4).to(torch.int32)
    block_table[1, 3] = -1  # an unallocated entry
    block_table[0, 2] = num_blocks + 2  # a block past the cache's end
    req_id = torch.tensor([0, 0, 1, 1, 1, 0, 1], dtype=torch.int32)  # 2 rows past T
    local = torch.tensor([[r.randrange(-3, 4 * block_size + 6) for _ in range(topk)] for _ in range(T + 3)],
                         dtype=torch.int32)
    local[T:] = 123456  # past T: never read
    local[1, :] = -1  # a token without any position
    q = (torch.randn(T, H, 576, generator=g) * 0.5).to(torch.bfloat16)
    slots = convert_req_index_to_global(req_id[:T], block_table, local[:T], block_size)
    assert (slots < 0).any() and (slots >= 0).any()
    assert (slots >= num_blocks * block_size).any()  # the past-the-end block is hit
    # inline conversion (16 heads) and the separate conversion launch of the 64-head tiles
    assert 16 <= M.INLINE_PAGED_MAX_BLOCK_H < 64
    for cfg in (M.SparseMLAConfig(16, 16, 3, 4, 2), M.SparseMLAConfig(64, 16, 2, 4, 2),
                M.SparseMLAConfig(16, 16, 3, 4, 2, fp8_prefetch=True), M.SparseMLAConfig(16, 16, 3, 4, 2, fp8_prefetch=2),
                M.SparseMLAConfig(64, 16, 2, 4, 2, fp8_prefetch=2)):
        want_o, want_l = C.poisoned_mla_outputs(T, H, torch.float32)
        M.sparse_mla_attention(q, cache, slots, 0.1, fmt, out=want_o, lse=want_l, config=cfg)
        got_o, got_l = C.poisoned_mla_outputs(T, H, torch.float32)
        M.sparse_mla_attention(q, cache, local, 0.1, fmt, out=got_o, lse=got_l, config=cfg,
                               block_table=block_table, req_id=req_id)
        assert torch.equal(got_o, want_o) and torch.equal(got_l, want_l), cfg
        assert torch.isinf(got_l[1]).all() and (got_o[1] == 0).all()
        got_o, got_l = C.poisoned_mla_outputs(T, H, torch.float32)  # as the backend calls it: the (q_nope, q_pe) pair
        M.sparse_mla_attention((q[..., :512], q[..., 512:]), cache, local, 0.1, fmt, out=got_o, lse=got_l,
                               config=cfg, block_table=block_table, req_id=req_id)
        assert torch.equal(got_o, want_o) and torch.equal(got_l, want_l), cfg
        got_o, _ = C.poisoned_mla_outputs(T, H, torch.float32)  # and without an lse, as the backend asks
        o, lse = M.sparse_mla_attention((q[..., :512], q[..., 512:]), cache, local, 0.1, fmt, out=got_o, config=cfg,
                                        block_table=block_table, req_id=req_id, with_lse=False)
        assert o is got_o and lse is None and torch.equal(got_o, want_o), cfg
    with pytest.raises(ValueError, match="block_table and req_id go together"):
        M.sparse_mla_attention(q, cache, local, 0.1, fmt, block_table=block_table)
    with pytest.raises(ValueError, match="req_id must be"):
        M.sparse_mla_attention(q, cache, local, 0.1, fmt, block_table=block_table, req_id=req_id[:2])


@pytest.mark.parametrize("fmt", M.KV_FORMATS)
def test_q_pair_is_read_in_place(fmt):
    """q as vLLM's (q_nope [T, H, 512], q_pe [T, H, 64]) pair, each a strided view of a wider buffer with its own
    strides, gives bit for bit the result of the concatenated [T, H, 576] q; both split and unsplit launches; the
    reference takes the pair too. Malformed pairs are refused by name."""
    g = torch.Generator().manual_seed(77)
    T, H, topk, bs = 6, 20, 70, 16
    cache = C.mla_cache(g, 7, bs, fmt)
    idx = torch.randint(-2, 7 * bs + 3, (T, topk), generator=g, dtype=torch.int32)
    nope_buf = (torch.randn(H, T, 600, generator=g) * 0.5).to(torch.bfloat16)  # head-major, like vLLM's bmm output
    pe_buf = (torch.randn(T, H, 96, generator=g) * 0.5).to(torch.bfloat16)
    q_nope, q_pe = nope_buf[..., 40:552].transpose(0, 1), pe_buf[..., 16:80]
    q = torch.cat([q_nope, q_pe], dim=-1)
    for cfg in (M.SparseMLAConfig(16, 16, 1, 4, 2), M.SparseMLAConfig(32, 32, 3, 4, 2)):
        want_o, want_l = C.poisoned_mla_outputs(T, H, torch.float32)
        M.sparse_mla_attention(q, cache, idx, 0.08, fmt, out=want_o, lse=want_l, config=cfg)
        got_o, got_l = C.poisoned_mla_outputs(T, H, torch.float32)
        M.sparse_mla_attention((q_nope, q_pe), cache, idx, 0.08, fmt, out=got_o, lse=got_l, config=cfg)
        assert torch.equal(got_o, want_o) and torch.equal(got_l, want_l), cfg
    ref_o, ref_l = M.sparse_mla_reference((q_nope, q_pe), cache, idx, 0.08, fmt)
    assert torch.equal(ref_o, M.sparse_mla_reference(q, cache, idx, 0.08, fmt)[0])
    assert (ref_o - want_o).abs().max() < 2e-2 * ref_o.abs().max()
    with pytest.raises(ValueError, match="pair"):
        M.sparse_mla_attention((q_nope, q_pe[..., :32]), cache, idx, 0.08, fmt)
    with pytest.raises(ValueError, match="pair"):
        M.sparse_mla_attention((q_nope[:3], q_pe), cache, idx, 0.08, fmt)
    with pytest.raises(ValueError, match="pair"):
        M.sparse_mla_attention((q_nope, q_pe, q_pe), cache, idx, 0.08, fmt)
    with pytest.raises(ValueError, match="differ in dtype"):
        M.sparse_mla_attention((q_nope, q_pe.float()), cache, idx, 0.08, fmt)


@pytest.mark.parametrize("fmt,paged", [("bf16", False), ("fp8_ds_mla", False), ("fp8_ds_mla", True)],
                         ids=["bf16-slot-ids", "fp8-slot-ids", "fp8-request-local"])
def test_a_trailing_invalid_tail_is_skipped_bit_for_bit(fmt, paged, monkeypatch):
    """Index lists padded with invalid ids at the end (a prompt's first tokens, a context shorter than top-k) end
    each split's loop at its last valid index (SKIP_TAIL): splits wholly in the tail do no work, and the result is
    the reference's and bit-identical to walking the whole list (a skipped block would only have multiplied by 1
    and added 0)."""
    r = random.Random(451)
    T, H, topk = 6, 5, 300
    case = C.mla_case(451, fmt, H, topk, T, 16, num_blocks=9, invalid_row=False)
    nslots = case.cache.shape[0] * case.cache.shape[1]
    # valid heads of 0, 1, 37, 64, 200 and 300 entries, the tails of every kind of invalid id (and an invalid id
    # or two inside the valid head)
    for t, n in enumerate((0, 1, 37, 64, 200, 300)):
        case.idx[t, n:] = torch.tensor([r.choice([-1, -7, nslots, nslots + 5]) for _ in range(topk - n)],
                                       dtype=torch.int32)
    case.idx[4, 10] = -1
    kw = {}
    if paged:  # request-local positions of one request whose table maps position p to slot p (the same rows)
        kw = dict(block_table=torch.arange(case.cache.shape[0], dtype=torch.int32).view(1, -1),
                  req_id=torch.zeros(T, dtype=torch.int32))
        case.idx = torch.where(case.idx >= nslots, -3, case.idx)  # request-local: past the table = negative here
    ref = case.ref()
    results = {}
    # dv 2: two programs per row, one of which stores the lse (the scan once reused that choice's variable)
    runs = [(splits, dv) for splits in (1, 4) for dv in (1, 2)]
    for skip in (True, False):
        monkeypatch.setattr(M, "SKIP_TAIL", skip)
        for splits, dv in runs:  # 4 splits of 80: the last ones wholly in the tail for most tokens
            config = M.SparseMLAConfig(16, 16, splits, 4, 2, dv)
            o, l = run_poisoned(case, torch.float32, config=config, **kw)
            C.check_mla(o, l, ref, C.MLA_INTERP_F32, f"{case.what} skip={skip} config={config}")
            results[(skip, splits, dv)] = (o, l)
    for key in runs:
        assert torch.equal(results[(True, *key)][0], results[(False, *key)][0])
        assert torch.equal(results[(True, *key)][1], results[(False, *key)][1])


def test_the_tail_scan_runs_only_where_splits_hold_several_blocks(monkeypatch):
    """SKIP_TAIL's scan is a dependent load before the loop: splits of fewer than SKIP_TAIL_MIN_BLOCKS blocks (the
    batch-1 latency tile: 32 splits of one block) walk their few blocks instead; and SKIP_TAIL=False turns it off."""
    case = C.mla_case(452, "bf16", 64, 2048, 1, 64, num_blocks=40)

    def scans(config):
        plan = M._Plan(case.q, case.cache, case.idx, "bf16", None, None, config, None, None, None)
        return plan.fwd_kw["SKIP_TAIL"]

    assert not scans(M.SparseMLAConfig(16, 64, 32, 8, 2))  # split_len 64 = 1 block
    assert not scans(M.SparseMLAConfig(16, 64, 16, 8, 2))  # 2 blocks
    assert scans(M.SparseMLAConfig(16, 64, 8, 8, 2))       # 4 blocks
    assert scans(M.SparseMLAConfig(64, 64, 1, 8, 3))       # 32 blocks
    monkeypatch.setattr(M, "SKIP_TAIL", False)
    assert not scans(M.SparseMLAConfig(64, 64, 1, 8, 3))
