"""The compiled kernels on a CUDA GPU against the independent float64 references of tests/kernels/_refs.py.

What the interpreter tests cannot run: the bf16 tensor-core dots of the sparse-MLA kernel (the interpreter
takes float32 dots, DOT_F32), its fp8_ds_mla dequantisation into bf16 operands (native e4m3 conversion and
the sm_80/86 bit path), the fp8 (DOT_FP8) and bf16-decoded (DOT_BF16) dots of both indexer kernels, the
heuristic's launch tables, top-k 2048, 128 heads, index heads beyond 64. Inputs are the same seeded cases
as the interpreter tests (tests/kernels/_cases.py); tolerances were measured on an H200 (see _cases.py).

Not collected by the suite (no test_ prefix): Triton fixes interpreted or compiled mode for the whole process
when `triton.language` is first imported, so tests/kernels/test_gpu_kernels.py runs this file in a fresh
pytest process without TRITON_INTERPRET (and skips without CUDA). Run it directly on a GPU machine:
``python -m pytest --noconftest tests/kernels/gpu_checks.py`` (tests/conftest.py sets TRITON_INTERPRET=1).
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):  # pragma: no cover - a misuse, said plainly
    raise RuntimeError("tests/kernels/gpu_checks.py needs compiled kernels: run it without TRITON_INTERPRET")

from overlay.kernels import indexer as IX  # noqa: E402
from overlay.kernels import sparse_mla as SM  # noqa: E402
from overlay.kernels.launch import reset_plans  # noqa: E402
from tests.kernels import _cases as C  # noqa: E402
from tests.kernels import _refs as R  # noqa: E402

assert type(SM._sparse_mla_fwd_kernel).__name__ == "JITFunction" and not IX.INTERPRETED
pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def _print_measured_errors(request):
    yield
    C.report_errors(request)


# ------------------------------------------------------------------------------------------------
# Sparse MLA
# ------------------------------------------------------------------------------------------------
def _mla_tol(fmt):
    return C.MLA_GPU_BF16 if fmt == "bf16" else C.MLA_GPU_FP8


def _run_mla(case: C.MlaCase, **kw):
    T, H, _ = case.q.shape
    out, lse = C.poisoned_mla_outputs(T, H, torch.bfloat16, "cuda")
    assert not SM._interpreting()
    SM.sparse_mla_attention(case.q, case.cache, case.idx, case.scale, case.fmt, out=out, lse=lse, **kw)
    torch.cuda.synchronize()
    return out, lse


MLA = [
    # (seed, fmt, H, topk, T, block_size, num_blocks): the heuristic picks the launch
    (401, "bf16", 128, 2048, 4, 64, 40),      # 128 heads x top-k 2048, split (sm_90: the bf16 Gluon tile, 8 rows)
    (402, "fp8_ds_mla", 128, 2048, 4, 64, 40),
    (403, "bf16", 16, 2048, 1, 64, 40),       # batch-1 decode: latency tile, 32 splits
    (404, "fp8_ds_mla", 64, 2048, 1, 64, 40),
    (405, "bf16", 64, 512, 33, 64, 12),       # GLM-5 heads, prefill-like T
    (406, "fp8_ds_mla", 64, 512, 33, 64, 12),
    (407, "bf16", 8, 300, 7, 16, 30),         # 8 heads per rank (GLM-5 at TP 8), odd top-k
    (408, "fp8_ds_mla", 32, 130, 9, 1, 400),  # block_size 1
    (409, "bf16", 5, 7, 3, 16, 3),            # odd sizes
    (410, "fp8_ds_mla", 100, 97, 2, 64, 4),
    # sm_90 with >= GLUON_MIN_ROWS[format] (token, 64-head) rows: the Gluon tile (sparse_mla_sm90.py) by default
    (411, "bf16", 128, 2048, 20, 64, 40),     # 128 heads (two head groups), top-k 2048 in splits
    (412, "bf16", 100, 301, 17, 1, 400),      # a half-empty second head group, odd top-k, block_size 1
    (413, "fp8_ds_mla", 128, 2048, 20, 64, 40),  # the same two on an fp8_ds_mla cache (its Gluon tile)
    (414, "fp8_ds_mla", 100, 301, 17, 1, 400),
    # sm_90 small batches (bench/small_batch.py): bf16 Gluon from 5 rows (here 128 heads x 3 tokens); fp8 the
    # warp-specialised tile from 3 rows (where Triton has no warp_specialize: the 64-head Triton tile, and the
    # 8-warp Gluon tile from 10)
    (415, "bf16", 128, 2048, 3, 64, 40),
    (416, "fp8_ds_mla", 64, 2048, 3, 64, 40),
    (417, "fp8_ds_mla", 64, 2048, 10, 64, 40),
]


@pytest.mark.parametrize("c", MLA, ids=lambda c: f"seed={c[0]}-{c[1]}-H{c[2]}-k{c[3]}-T{c[4]}-bs{c[5]}")
def test_sparse_mla_heuristic_launch(c):
    seed, fmt, H, topk, T, bs, nb = c
    case = C.mla_case(seed, fmt, H, topk, T, bs, num_blocks=nb)
    out, lse = _run_mla(case.to("cuda"))
    C.check_mla(out, lse, case.ref(), _mla_tol(fmt), case.what)


SM90_TILES = sorted({(f, t) for f in SM.KV_FORMATS for t in SM.candidate_tiles((9, 0), f)}
                    | {(f, t) for f, ts in SM.FOCUS_TILES.items() for t in ts})


@pytest.mark.parametrize("i", range(len(SM90_TILES)),
                         ids=[f"{f}-{SM.SparseMLAConfig.from_tile(t)}" for f, t in SM90_TILES])
def test_sparse_mla_every_sm90_tile(i):
    """Every tile the sm_90 tables and the benchmark's focus list hold, with and without splits."""
    _check_tile(420 + i, *SM90_TILES[i])


def _check_tile(seed: int, fmt: str, tile: tuple) -> None:
    """One table tile on 70 heads x top-k 300 x 3 tokens, unsplit and in 3 splits, against the reference."""
    case = C.mla_case(seed, fmt, 70, 300, 3, 64, num_blocks=8)
    for splits in (1, 3):
        config = SM.SparseMLAConfig.from_tile(tile, splits)
        case.what = f"seed={seed} {fmt} config={config}"
        out, lse = _run_mla(case.to("cuda"), config=config)
        C.check_mla(out, lse, case.ref(), _mla_tol(fmt), case.what)


MMA_SYNC_TILES = sorted({(f, t) for cap in ((8, 0), (8, 6), (8, 9), (12, 0)) for f in SM.KV_FORMATS
                         for t in SM.candidate_tiles(cap, f)})


@pytest.mark.parametrize("i", range(len(MMA_SYNC_TILES)),
                         ids=[f"{f}-{SM.SparseMLAConfig.from_tile(t)}" for f, t in MMA_SYNC_TILES])
def test_sparse_mla_every_mma_sync_tile(i):
    """Every tile the sm_80 / sm_86-89-120 tables hold, on this GPU; test_gpu_kernels.py runs it with
    DISABLE_MMA_V3=1 and its own TRITON_CACHE_DIR for the mma.sync code those GPUs get; with and without splits (the
    e4m3 bit decode of sm_80/86: test_sparse_mla_fp8_bit_path_on_gpu)."""
    _check_tile(470 + i, *MMA_SYNC_TILES[i])


# fp8_ds_mla tiles with the next block's tiles prefetched (fp8_prefetch 1: raw, 2: decoded ahead): every non-Gluon fp8
# table tile of every family so built, and the benchmark's leads (bench_sparse_mla.MMA_SYNC_LEADS, FOCUS_CONFIGS)
PREFETCH_TILES = sorted({t[:7] + (mode,) for cap in ((8, 0), (8, 6), (8, 9), (9, 0), (12, 0))
                         for t in SM.candidate_tiles(cap, "fp8_ds_mla") if not t[6] for mode in (1, 2)}
                        | {SM.SparseMLAConfig.from_string(s + mode).tile for s in (
                            "h64n16s1w8p2", "h32n16s1w4p2", "h64n32s1w8p2", "h16n32s1w4p2", "h16n64s1w8p2")
                           for mode in "ra"})


@pytest.mark.parametrize("i", range(len(PREFETCH_TILES)),
                         ids=[str(SM.SparseMLAConfig.from_tile(t)) for t in PREFETCH_TILES])
def test_sparse_mla_fp8_prefetch_tile(i):
    """The fp8_ds_mla tiles that load the next block's tiles one iteration ahead (raw, or decoded: on the bit path of
    sm_80/86 that is the PTX decoder, test_sparse_mla_fp8_bit_path_on_gpu), against the reference (with
    DISABLE_MMA_V3=1 in test_gpu_kernels.py for the mma.sync code), unsplit and in 3 splits; then as the backend
    calls them (request-local positions through a block table), bit for bit the slot-id result."""
    _check_tile(520 + i, "fp8_ds_mla", PREFETCH_TILES[i])
    _check_request_local(560 + i, "fp8_ds_mla", PREFETCH_TILES[i])


def _check_request_local(seed: int, fmt: str, tile: tuple) -> None:
    """Request-local top-k positions (3 requests, a shuffled block table with an unallocated entry, invalid and
    out-of-range positions, the (q_nope, q_pe) pair) give exactly what the same rows as slot ids give, unsplit and
    in 3 splits: the block-table walk of the kernel (inline, or the conversion launch of wide head blocks)."""
    from overlay.triton_mla_sparse_ops import convert_req_index_to_global

    g = torch.Generator().manual_seed(seed)
    bs, nb, T, H, topk = 64, 24, 11, 70, 300
    cache = C.mla_cache(g, nb, bs, fmt).cuda()
    table = torch.randperm(nb, generator=g)[:21].view(3, 7).to(torch.int32)
    table[1, 6] = -1
    req = torch.randint(0, 3, (T,), generator=g, dtype=torch.int32)
    local = torch.randint(-2, 7 * bs + 20, (T, topk), generator=g, dtype=torch.int32)
    local[3] = -1  # a token with no position at all
    q = (torch.randn(T, H, 576, generator=g) * 0.7).to(torch.bfloat16).cuda()
    table, req, local = table.cuda(), req.cuda(), local.cuda()
    slots = convert_req_index_to_global(req, table, local, bs)
    for splits in (1, 3):
        config = SM.SparseMLAConfig.from_tile(tile, splits)
        want_o, want_l = C.poisoned_mla_outputs(T, H, torch.bfloat16, "cuda")
        SM.sparse_mla_attention(q, cache, slots, 0.05, fmt, out=want_o, lse=want_l, config=config)
        got_o, got_l = C.poisoned_mla_outputs(T, H, torch.bfloat16, "cuda")
        SM.sparse_mla_attention((q[..., :512], q[..., 512:]), cache, local, 0.05, fmt, out=got_o, lse=got_l,
                                config=config, block_table=table, req_id=req)
        torch.cuda.synchronize()
        assert not torch.isnan(want_o).any() and torch.isinf(want_l[3]).all(), config
        assert torch.equal(got_o, want_o) and torch.equal(got_l, want_l), f"{fmt} {config}: request-local differs"


GLUON_TILES = [(f, t) for f in SM.KV_FORMATS for t in dict.fromkeys(SM.candidate_tiles((9, 0), f) + SM.FOCUS_TILES[f])
               if SM.SparseMLAConfig.from_tile(t).gluon]


@pytest.mark.parametrize("fmt,tile", GLUON_TILES,
                         ids=[f"{f}-{SM.SparseMLAConfig.from_tile(t)}" for f, t in GLUON_TILES])
def test_sparse_mla_gluon_long_lists(fmt, tile):
    """The Gluon tiles over many blocks (their gather buffers wrap several times; bf16: block i + NUM_BUF - 1 is
    gathered while block i computes; fp8_ds_mla: block i + 1 is dequantised while block i's P.V runs): top-k 2048
    with invalid and repeated slots, unsplit and in 5 splits, and a batch whose every index is invalid (no valid
    key: zeros, lse -inf)."""
    case = C.mla_case(450, fmt, 64, 2048, 5, 64, num_blocks=40)
    for splits in (1, 5):
        config = SM.SparseMLAConfig.from_tile(tile, splits)
        case.what = f"seed=450 {fmt} config={config}"
        out, lse = _run_mla(case.to("cuda"), config=config)
        C.check_mla(out, lse, case.ref(), _mla_tol(fmt), case.what)
    empty = C.MlaCase(case.q, case.cache, torch.full_like(case.idx, -1), case.scale, fmt, "all invalid")
    out, lse = _run_mla(empty.to("cuda"), config=SM.SparseMLAConfig.from_tile(tile, 2))
    assert torch.all(out == 0) and torch.all(torch.isneginf(lse)), (out.abs().max(), lse)


@pytest.mark.parametrize("post", [False, True], ids=["scale-tile", "scale-after-dot"])
def test_sparse_mla_fp8_bit_path_on_gpu(post):
    """The sm_80/86 e4m3 decoders (no native conversion; the Triton form and the PTX block of decoded-ahead tiles)
    and the scale-after-dot variant, compiled."""
    case = C.mla_case(430, "fp8_ds_mla", 64, 1024, 3, 64, num_blocks=20, kv_scale=5.0)
    for prefetch in (0, 2):  # 2: decoded ahead, with the PTX decoder
        out, lse = _run_mla(case.to("cuda"), _fp8_native=False,
                            config=SM.SparseMLAConfig(16, 32, 4, 4, 2, 1, post, fp8_prefetch=prefetch))
        C.check_mla(out, lse, case.ref(), C.MLA_GPU_FP8, f"{case.what} prefetch={prefetch}")


@pytest.mark.parametrize("native", [True, False], ids=["cvt-e4m3", "bit-path"])
def test_every_e4m3_code_decodes_exactly_on_gpu(native):
    """All 254 non-NaN e4m3 codes (signs and subnormals) through each compiled decoder: the native conversion, the
    Triton bit path, and the PTX block of decoded-ahead tiles on the bit path (sm_80/86, e4m3.e4m3_as_f16_bits), exact;
    unprefetched, raw tiles carried, decoded tiles carried."""
    case, expect = C.every_e4m3_code_case()
    case = case.to("cuda")
    for prefetch in (0, 1, 2):
        out, lse = C.poisoned_mla_outputs(4, 1, torch.float32, "cuda")
        SM.sparse_mla_attention(case.q, case.cache, case.idx, case.scale, case.fmt, out=out, lse=lse,
                                config=SM.SparseMLAConfig(16, 16, 1, 4, 2, fp8_prefetch=prefetch), _fp8_native=native)
        torch.cuda.synchronize()
        assert torch.equal(out[:, 0].double().cpu(), expect), (native, prefetch)


def _heaviest_valid_position(case: C.MlaCase, t: int) -> int:
    """Position in indices[t] of the valid slot with the largest softmax weight summed over the heads."""
    rows = R.mla_slots(case.cache, case.fmt)
    idx = case.idx[t].long()
    pos = ((idx >= 0) & (idx < rows.shape[0])).nonzero()[:, 0]
    s = (case.q[t].double() @ rows[idx[pos]].T) * case.scale
    return int(pos[torch.softmax(s, dim=1).sum(0).argmax()])


DROPS = [("bf16", "heaviest", 128, 2048), ("bf16", "random", 16, 64),
         ("fp8_ds_mla", "heaviest", 64, 512), ("fp8_ds_mla", "random", 16, 64)]


@pytest.mark.parametrize("fmt,drop,H,topk", DROPS, ids=[f"{f}-{d}-of-{k}" for f, d, _, k in DROPS])
def test_gpu_tolerance_catches_a_dropped_key(fmt, drop, H, topk):
    """The GPU tolerances bite too: one valid key per token dropped makes the comparison fail. The reference's
    own effect of the drop (normalised lse): heaviest of 2048 keys 3.7e-4, of 512 1.7e-3, a random one of 64
    8e-3. The bf16 tolerance (6e-7) sees all of them; the fp8_ds_mla one (1e-3, set by its rounding of the
    dequantised tile to bf16) not the heaviest of 2048, hence 512 there."""
    case = C.mla_case(440, fmt, H, topk, 3, 64, num_blocks=40, invalid_row=False)
    mut = case.idx.clone()
    g = torch.Generator().manual_seed(440)
    for t in range(mut.shape[0]):
        if drop == "heaviest":
            j = _heaviest_valid_position(case, t)
        else:
            valid = ((mut[t] >= 0) & (mut[t] < 40 * 64)).nonzero()[:, 0]
            j = int(valid[torch.randint(len(valid), (1,), generator=g)])
        mut[t, j] = -1
    broken = C.MlaCase(case.q, case.cache, mut, case.scale, fmt, case.what)
    out, lse = _run_mla(broken.to("cuda"))
    with pytest.raises(AssertionError):
        C.check_mla(out, lse, case.ref(), _mla_tol(fmt), case.what, measure=False)


def test_gpu_tolerance_catches_a_mis_scaled_fp8_tile():
    """One 128-wide tile of the heaviest slot of token 0 dequantised with 1.25x its scale."""
    case = C.mla_case(441, "fp8_ds_mla", 64, 512, 2, 64, num_blocks=10, invalid_row=False)
    slot = int(case.idx[0, _heaviest_valid_position(case, 0)])
    cache = case.cache.clone()
    cache[slot // 64, slot % 64, 512:528].view(torch.float32)[1] *= 1.25
    out, lse = _run_mla(C.MlaCase(case.q, cache, case.idx, case.scale, case.fmt, case.what).to("cuda"))
    with pytest.raises(AssertionError):
        C.check_mla(out, lse, case.ref(), C.MLA_GPU_FP8, case.what, measure=False)


# ------------------------------------------------------------------------------------------------
# Indexer
# ------------------------------------------------------------------------------------------------
PREFILL = [(501, 160, 1500, 64), (502, 96, 900, 32), (503, 64, 700, 128), (504, 40, 513, 100),
           (505, 33, 300, 5)]   # (seed, M, N, H)


@pytest.mark.parametrize("mode", ["DOT_FP8", "DOT_BF16", "sm80-pick-bf16", "q-opaque-bf16"])
@pytest.mark.parametrize("p", PREFILL, ids=lambda p: f"seed={p[0]}-M{p[1]}-N{p[2]}-H{p[3]}")
def test_indexer_prefill(p, mode):
    """The device's own config (DOT_FP8 on sm_89+), the sm_80/86 decoder path (DOT_BF16) and sm_80's own pick (its
    key tiles decoded ahead by the PTX block; also with Q_OPAQUE), with empty, reversed (ks > ke), clipped (ke > N, ks < 0) and full
    ranges."""
    case = C.prefill_case(*p)
    g = case.to("cuda")
    cfg = {"DOT_FP8": None, "DOT_BF16": dict(DOT_MODE=IX.DOT_BF16),
           "sm80-pick-bf16": IX.prefill_config((8, 0), p[3]),
           "q-opaque-bf16": replace(IX.prefill_config((8, 0), p[3]), Q_OPAQUE=True)}[mode]
    if mode == "DOT_FP8":
        assert IX.dot_mode_for_capability(torch.cuda.get_device_capability()) == IX.DOT_FP8
    out = IX.fp8_mqa_logits(g.q, (g.k, g.k_scales), g.w, g.ks, g.ke, True, _config=cfg,
                            _out=C.poisoned((p[1], p[2]), "cuda"))
    torch.cuda.synchronize()
    tol = C.IDX_GPU_FP8 if mode == "DOT_FP8" else C.IDX_GPU_BF16
    C.check_logits(out, case.ref(), tol, True, f"{case.what} {mode}")


PAGED = [
    # (seed, next_n, H, block_size, lens, two_d, max_model_len or None)
    (511, 1, 64, 64, [2000, 0, 1, 64, 129, 777, 1500, 3], False, None),
    (512, 2, 64, 64, [1800, 2, 1, 67, 900], True, None),
    (513, 1, 32, 64, [3000, 100, 40] * 4, False, None),
    (514, 2, 128, 64, [600, 33], True, None),          # index heads beyond 64
    (515, 1, 100, 64, [500, 7], False, None),
    (516, 2, 64, 64, [1200, 300, 90], False, 700),      # contexts longer than max_model_len
    (517, 2, 32, 64, [1500, 5, 64, 1, 0, 900], True, None),   # GLM-5 with MTP: sm_90's Gluon kernel by default
    (518, 2, 32, 16, [700, 3, 17, 0, 250], False, None),      # cache blocks smaller than the Gluon kernel's tile
    (519, 1, 64, 128, [900, 1, 128, 129], True, None),        # ... and larger: two tiles per block
    (520, 1, 32, 64, [2500], False, None),                    # batch 1: sm_90's Gluon kernel by default
]


@pytest.mark.parametrize("walk", ["default", "triton", "gluon", "gluon-nb2", "gluon-runtime-bs", "flat", "flat-bf16",
                                  "nested-bf16", "sm80-pick-bf16", "ahead-w8-bf16",
                                  "q-opaque-bf16"])
@pytest.mark.parametrize("p", PAGED, ids=lambda p: f"seed={p[0]}-n{p[1]}-H{p[2]}")
def test_indexer_paged(p, walk):
    """The device's own config (on sm_90: the Gluon kernel at two tokens x <= 64 heads or batch 1, else the
    per-request walk, scales prefetched for the large tile), the Triton kernel's own pick (``triton``), the sm_90
    Gluon kernel forced at every shape it takes (4 and 2 key buffers: the ring wraps every 2 tiles; the block size
    read at run time, not compiled in), the flat walk of the other targets, the sm_80/86 decoder path in both
    walks, and sm_80's own pick (key tiles decoded ahead by the PTX block), also at 8 warps on 7 programs and with its
    query decoded by the impure PTX block (Q_OPAQUE: 16-bit operand layouts)."""
    seed, next_n, H, bs, lens, two_d, mml = p
    case = C.paged_case(seed, len(lens), next_n, H, bs, lens, two_d=two_d, max_model_len=mml)
    g = case.to("cuda")
    cap = torch.cuda.get_device_capability()
    if walk.startswith("gluon"):
        if cap[0] != 9 or min(next_n, 2) * IX._padded_heads(H) > 128:
            pytest.skip("the Gluon decode kernel: sm_90, T x padded heads <= 128")
        gl_cfg = dict(GLUON=True, BLOCK_N=64, num_warps=4, num_stages=4 if walk == "gluon" else 2, per_sm=2,
                      NESTED=True, HOIST_Q=True, SCALES_AHEAD=False, DOT_MODE=IX.DOT_FP8)
    cfg = {"default": None, "triton": lambda: IX.decode_config(cap, H, next_n, gluon=False),
           "gluon": lambda: gl_cfg, "gluon-nb2": lambda: gl_cfg,
           "gluon-runtime-bs": lambda: dict(gl_cfg, CONST_BS=False),
           "flat": lambda: replace(IX.decode_config(cap, H, next_n, gluon=False), NESTED=False, HOIST_Q=False,
                                   SCALES_AHEAD=False),
           "flat-bf16": lambda: replace(IX.decode_config(cap, H, next_n, gluon=False), NESTED=False, HOIST_Q=False,
                                        SCALES_AHEAD=False, DOT_MODE=IX.DOT_BF16, BLOCK_N=32),
           "nested-bf16": lambda: replace(IX.decode_config(cap, H, next_n, gluon=False), NESTED=True, HOIST_Q=True,
                                          SCALES_AHEAD=False, DOT_MODE=IX.DOT_BF16, BLOCK_N=64, num_warps=8),
           "sm80-pick-bf16": lambda: IX.decode_config((8, 0), H, next_n),
           "ahead-w8-bf16": lambda: replace(IX.decode_config((8, 0), H, next_n), num_warps=8, programs=7),
           "q-opaque-bf16": lambda: replace(IX.decode_config((8, 0), H, next_n), Q_OPAQUE=True)}[walk]
    cfg = cfg() if callable(cfg) else cfg
    if walk == "triton":
        assert not cfg.GLUON
    out = IX.fp8_paged_mqa_logits(g.q, g.cache, g.w, g.cl, g.tables, None, case.max_model_len, True,
                                  _config=cfg, _out=C.poisoned((len(lens) * next_n, case.max_model_len), "cuda"))
    torch.cuda.synchronize()
    ref = case.ref()
    C.assert_paged_visibility(case, ref[0])
    tol = C.IDX_GPU_BF16 if walk.endswith("-bf16") else C.IDX_GPU_FP8
    C.check_logits(out, ref, tol, True, f"{case.what} {walk}")


def test_gpu_indexer_tolerance_catches_a_dropped_head():
    case = C.prefill_case(520, 64, 700, 64)
    g = case.to("cuda")
    w = g.w.clone()
    w[:, 17] = 0
    out = IX.fp8_mqa_logits(g.q, (g.k, g.k_scales), w, g.ks, g.ke, True)
    with pytest.raises(AssertionError):
        C.check_logits(out, case.ref(), C.IDX_GPU_FP8, True, case.what, measure=False)


# ------------------------------------------------------------------------------------------------
# Host launch cost: direct launch (overlay/kernels/launch.py) and the index conversion launch
# ------------------------------------------------------------------------------------------------
def _jit_and_direct(run):
    """run() with every launcher of both modules on Triton's JIT entry and no launch plans, then twice through
    direct launch and the plans (the first plans the call and keeps its entries, the second launches them): the
    three results."""
    mods = (SM, IX)
    for m in mods:
        for launcher in m.LAUNCHERS:
            assert launcher.reason is None, launcher.reason
            launcher.enabled = False
    reset_plans()  # no launcher launches directly: no plans
    try:
        via_jit = run()
    finally:
        for m in mods:
            for launcher in m.LAUNCHERS:
                launcher.enabled = True
        reset_plans()
    before = sum(x.direct_calls for m in mods for x in m.LAUNCHERS)
    first, second = run(), run()
    assert sum(x.direct_calls for m in mods for x in m.LAUNCHERS) > before, "no direct launch happened"
    return via_jit, first, second


def test_direct_launch_is_bit_identical_to_the_jit_entry():
    """Every kernel (split and unsplit attention, bf16 and fp8_ds_mla, indexer prefill and paged decode)
    gives the same bits through the direct launch as through Triton's JIT entry."""
    for fmt, T, H in (("bf16", 1, 64), ("fp8_ds_mla", 1, 64), ("bf16", 200, 64), ("fp8_ds_mla", 64, 128)):
        case = C.mla_case(610 + T, fmt, H=H, topk=2048, T=T, block_size=64, num_blocks=40)
        q, cache, idx = case.q.cuda(), case.cache.cuda(), case.idx.cuda()

        def run():
            out, lse = C.poisoned_mla_outputs(T, H, torch.bfloat16, "cuda")
            SM.sparse_mla_attention(q, cache, idx, case.scale, fmt, out=out, lse=lse)
            torch.cuda.synchronize()
            return out, lse

        (o0, l0), (o1, l1), (o2, l2) = _jit_and_direct(run)
        assert torch.equal(o0, o1) and torch.equal(o0, o2) and torch.equal(l0, l1) and torch.equal(l0, l2), case.what
    pc = C.prefill_case(620, 300, 1500, 64).to("cuda")
    res = _jit_and_direct(lambda: IX.fp8_mqa_logits(pc.q, (pc.k, pc.k_scales), pc.w, pc.ks, pc.ke, True))
    assert torch.equal(res[0], res[1]) and torch.equal(res[0], res[2])
    for seed, next_n, H in ((621, 2, 64), (622, 2, 32), (623, 1, 64)):   # on sm_90 the last two: the Gluon kernel
        case = C.paged_case(seed, 5, next_n, H, 64, [1, 700, 64, 0, 3000], max_model_len=3072)
        g = case.to("cuda")
        res = _jit_and_direct(lambda: IX.fp8_paged_mqa_logits(g.q, g.cache, g.w, g.cl, g.tables, None,
                                                              case.max_model_len, True))
        assert torch.equal(res[0], res[1]) and torch.equal(res[0], res[2]), case.what


def test_pdl_launches_compute_what_ordinary_ones_do(monkeypatch):
    """DSA_OVERLAY_PDL=1 (sm_90 and later): every kernel, launched with programmatic dependent launch right after a
    torch kernel that rewrites its input (NaN first, then the values: a launch that read before its
    griddepcontrol.wait would see NaN or half a copy), gives bit for bit what ordinary launches give, eager and
    replayed from a CUDA graph. Attention on slot ids (bf16 and fp8_ds_mla at a decode batch: sm_90's Gluon tiles;
    a split) and on request-local indices (conversion, attention, merge: three launches in a row); the indexer's
    prefill and paged logits (next_n=2: sm_90's Gluon decode kernel). Before sm_90 the switch must change nothing."""
    from overlay import triton_mla_sparse_ops as ops

    calls = []

    def rewritten(x):
        """A buffer the call reads, rewritten by two torch kernels right before it."""
        buf = torch.empty_like(x)

        def fill():
            buf.view(torch.uint8).fill_(0xFF)
            buf.copy_(x)
            return buf
        return fill

    for fmt, T, H in (("bf16", 32, 64), ("fp8_ds_mla", 32, 64), ("bf16", 4, 16)):
        case = C.mla_case(640 + T + H, fmt, H=H, topk=2048, T=T, block_size=64, num_blocks=40)
        q, cache, idx = rewritten(case.q.cuda()), case.cache.cuda(), rewritten(case.idx.cuda())
        calls.append(lambda q=q, cache=cache, idx=idx, case=case: SM.sparse_mla_attention(
            q(), cache, idx(), case.scale, case.fmt))
    g = torch.Generator().manual_seed(650)
    bs, nb, T, H, topk = 64, 48, 37, 16, 2048
    cache = C.mla_cache(g, nb, bs, "bf16").cuda()
    bt = torch.randperm(nb, generator=g)[:45].view(3, 15).to(torch.int32).cuda()
    rid = torch.tensor([0] * 10 + [1] * 20 + [2] * 7, dtype=torch.int32).cuda()
    loc = rewritten(torch.randint(-2, 15 * bs + 40, (T, topk), generator=g, dtype=torch.int32).cuda())
    qq = rewritten((torch.randn(T, H, 576, generator=g) * 0.7).to(torch.bfloat16).cuda())
    calls.append(lambda: ops.sparse_mla_forward(qq(), cache, loc(), rid, bt, bs, 0.05, "bf16"))
    pc = C.prefill_case(651, 300, 1500, 32).to("cuda")
    pq = rewritten(pc.q)
    calls.append(lambda: IX.fp8_mqa_logits(pq(), (pc.k, pc.k_scales), pc.w, pc.ks, pc.ke, True))
    for seed, next_n, H in ((652, 2, 32), (653, 1, 64)):
        case = C.paged_case(seed, 5, next_n, H, 64, [1, 700, 64, 0, 3000], max_model_len=3072).to("cuda")
        iq = rewritten(case.q)
        calls.append(lambda case=case, iq=iq: IX.fp8_paged_mqa_logits(iq(), case.cache, case.w, case.cl, case.tables,
                                                                      None, case.max_model_len, True))

    def outputs(pdl: str):
        monkeypatch.setenv("DSA_OVERLAY_PDL", pdl)
        reset_plans()

        def flat(res):
            return [t for t in (res if isinstance(res, tuple) else (res,)) if t is not None]

        eager = [[t.clone() for t in flat(f())] for f in calls]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):   # plans made outside the capture
            for f in calls:
                f()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = [flat(f()) for f in calls]
        for o in outs:
            for t in o:
                t.view(torch.uint8).fill_(0xFF)
        graph.replay()
        torch.cuda.synchronize()
        return eager, [[t.clone() for t in o] for o in outs]

    plain, plain_graph = outputs("0")
    pdl, pdl_graph = outputs("1")
    expect = torch.cuda.get_device_capability() >= (9, 0)
    assert SM._PLANS.on and next(iter(SM._PLANS.plans.values())).fwd_kw.get("launch_pdl", False) is expect
    for i, (a, b, c, d) in enumerate(zip(plain, plain_graph, pdl, pdl_graph)):
        for w, x, y, z in zip(a, b, c, d):
            assert torch.equal(w, x) and torch.equal(w, y) and torch.equal(w, z), i
    reset_plans()


def test_backend_forward_with_request_local_indices():
    """The backend's per-layer call (the (q_nope, q_pe) pair read in place, request-local top-k converted inside the
    attention kernel) equals converting the indices with the backend's torch conversion first and passing the
    concatenated q, bit for bit, for both cache formats; without an lse too (the backend's call), eager and replayed
    from a CUDA graph after the eager scratch was freed."""
    from overlay import triton_mla_sparse_ops as ops

    for fmt in ("bf16", "fp8_ds_mla"):
        g = torch.Generator().manual_seed(630)
        bs, nb, T, H, topk = 64, 48, 37, 64, 2048
        cache = C.mla_cache(g, nb, bs, fmt).cuda()
        block_table = torch.randperm(nb, generator=g)[:45].view(3, 15).to(torch.int32)
        block_table[2, 14] = -1
        req_id = torch.tensor([0] * 10 + [1] * 20 + [2] * 7 + [0] * 5, dtype=torch.int32)
        local = torch.randint(-2, 15 * bs + 40, (T + 5, topk), generator=g, dtype=torch.int32)
        q = (torch.randn(T, H, 576, generator=g) * 0.7).to(torch.bfloat16)
        bt, rid, loc, qc = block_table.cuda(), req_id.cuda(), local.cuda(), q.cuda()
        out, lse = ops.sparse_mla_forward((qc[..., :512], qc[..., 512:]), cache, loc, rid, bt, bs, 0.05, fmt)
        slots = ops.convert_req_index_to_global(rid[:T], bt, loc[:T], bs)
        want_o, want_l = SM.sparse_mla_attention(qc, cache, slots, 0.05, fmt)
        torch.cuda.synchronize()
        assert torch.equal(out, want_o) and torch.equal(lse, want_l), fmt

        def no_lse():  # as the backend calls it: no lse wanted, the kernel writes it into the stream's scratch
            return ops.sparse_mla_forward((qc[..., :512], qc[..., 512:]), cache, loc, rid, bt, bs, 0.05, fmt,
                                          with_lse=False)

        o2, none = no_lse()
        torch.cuda.synchronize()
        assert none is None and torch.equal(o2, want_o), fmt
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            no_lse()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):   # captured: scratch from the graph's pool, not the eager workspace
            o3, _ = no_lse()
        SM._PARTIALS.bufs.clear()       # every eager workspace freed and a new one made: the graph kept none of them
        no_lse()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(o3, want_o), fmt


def test_fp8_prefill_workspace_on_gpu():
    """The fp8_ds_mla prefill through the bf16 workspace, compiled: the up-conversion (native e4m3 and the
    sm_80/86 bit path) equals the reference decoder rounded to bf16 bit for bit, and a mixed step (decodes, two
    prompts that take the workspace, a continuation against a long context that reads fp8) equals float64 sparse
    attention over the dequantised rows; its fp8 segments equal the direct call bit for bit."""
    from overlay import triton_mla_sparse_ops as ops
    from overlay.kernels.fp8_workspace import upconvert_blocks

    g = torch.Generator().manual_seed(640)
    bs, nb, H, topk, scale = 64, 200, 64, 2048, 0.06
    cache = C.mla_cache(g, nb, bs, "fp8_ds_mla").cuda()
    want = SM.dequantize_fp8_ds_mla(cache)
    src = torch.randperm(nb, generator=g)[:24].view(3, 8).to(torch.int32)
    src[2, 5] = -1
    dst = torch.tensor([[4, 0, 1, -1, 2, 3, 5, 6], [7, 8, 9, 10, 11, 12, 13, 14]], dtype=torch.int32)
    for native in (True, False):
        ws = torch.full((16, bs, 576), float("nan"), dtype=torch.bfloat16, device="cuda")
        upconvert_blocks(cache, src.cuda(), 1, dst.cuda(), ws, fp8_native=native)
        torch.cuda.synchronize()
        for i in range(2):
            for b in range(8):
                d, s = int(dst[i, b]), int(src[1 + i, b])
                if d >= 0:
                    expect = want[s].to(torch.bfloat16) if s >= 0 else torch.zeros_like(ws[d])
                    assert torch.equal(ws[d], expect), (native, i, b)
        assert ws[15].isnan().all()

    reqs = [(3000, 1), (700, 700), (5000, 5), (300, 300), (2100, 1)]   # (seq_len, query_len)
    width = max(-(-s // bs) for s, _ in reqs)
    perm = torch.randperm(nb, generator=g)
    bt = torch.zeros(len(reqs), width, dtype=torch.int32)
    for r, (s, _) in enumerate(reqs):
        n = -(-s // bs)
        bt[r, :n] = perm[torch.randint(0, nb, (n,), generator=g)].to(torch.int32)  # blocks may repeat: fine here
    order = sorted(range(len(reqs)), key=lambda r: reqs[r][1] > 1)  # vLLM's order: decodes first
    reqs = [reqs[r] for r in order]
    bt = bt[order].contiguous()
    pos, req = [], []
    for r, (s, q) in enumerate(reqs):
        pos += list(range(s - q, s))
        req += [r] * q
    T = len(pos)
    local = torch.full((T, topk), -1, dtype=torch.int32)
    for t, p in enumerate(pos):
        n = min(p + 1, topk)
        local[t, :n] = torch.randperm(p + 1, generator=g)[:n].to(torch.int32)
    req_id = torch.tensor(req, dtype=torch.int32)
    q = (torch.randn(T, H, 576, generator=g) * 0.5).to(torch.bfloat16)
    qsl = torch.tensor([0] + torch.tensor([qq for _, qq in reqs]).cumsum(0).tolist(), dtype=torch.int32)
    plan = ops.plan_fp8_prefill(qsl, torch.tensor([s for s, _ in reqs]), bs, capacity_blocks=64, device="cuda")
    assert [(s.tok_start, s.tok_end, s.ws_blocks) for s in plan] == [(0, 2, 0), (2, 702, 11), (702, 707, 0),
                                                                   (707, 1007, 5)]
    ops._WORKSPACES.clear()
    ops.fp8_workspace(64, bs, "cuda").fill_(float("nan"))
    args = (local.cuda(), req_id.cuda(), bt.cuda(), bs, scale, "fp8_ds_mla")
    qc = q.cuda()
    out, lse = ops.sparse_mla_forward((qc[..., :512], qc[..., 512:]), cache, *args, segments=plan)
    torch.cuda.synchronize()
    for a, b in ((0, 2), (702, 707)):   # the segments read from fp8: a direct call on the same tokens (same launch)
        direct, dlse = ops.sparse_mla_forward((qc[a:b, :, :512], qc[a:b, :, 512:]), cache, local[a:b].cuda(),
                                              req_id[a:b].cuda(), *args[2:])
        assert torch.equal(out[a:b], direct) and torch.equal(lse[a:b], dlse), (a, b)
    dense = want.double().view(-1, 576)
    worst = 0.0
    for t in list(range(0, T, 37)) + [T - 1]:
        sel = local[t][local[t] >= 0].long()
        rows = dense[bt[req[t], sel // bs].long() * bs + sel % bs]
        s = q[t].double().cuda() @ rows.T * scale
        ref = torch.softmax(s, -1) @ rows[:, :512]
        worst = max(worst, ((out[t].double() - ref).abs().max() / ref.abs().max()).item())
        assert (lse[t].double() - torch.logsumexp(s, -1)).abs().max() < 1e-2, t
    assert worst < 2e-2, worst


def test_sm90_indexer_default_is_the_gluon_kernel_where_the_table_says():
    """On sm_90 with Gluon available, vLLM's calls at two tokens x 32 or 64 index heads and one token at batch 1 run
    the Gluon decode kernel (the paged cases above check its results), the others the Triton kernel."""
    cap = torch.cuda.get_device_capability()
    if cap[0] != 9 or not IX.GLUON_DEFAULT:
        pytest.skip("sm_90 with Gluon and DSA_OVERLAY_GLUON unset")
    assert IX.decode_config(cap, 32, 2).GLUON and IX.decode_config(cap, 64, 2).GLUON
    assert IX.decode_config(cap, 64, 1, 1).GLUON and IX.decode_config(cap, 32, 1, 1).GLUON
    assert not IX.decode_config(cap, 64, 1, 8).GLUON and not IX.decode_config(cap, 32, 1).GLUON
    assert not IX.decode_config(cap, 128, 2).GLUON
