"""Indexer logits kernels (prefill and paged decode) vs the independent float64 references of
tests/kernels/_refs.py, on the CPU under Triton's interpreter.

The kernel file is loaded as a private module with TRITON_INTERPRET=1 set, whatever this pytest
process imported before (the cross-compile and GPU tests need compiled kernels). Inputs are fresh
seeded random tensors (seed in the ids); outputs are NaN-poisoned before every kernel run; the paged
cache is written by the test's own writer in vLLM's block layout, and every byte no request may
read (the tail of a last block, unused blocks, unused block-table entries) holds NaN. Errors are
measured relative to each logit's magnitude (sum_h |w| |q| . |k|); the tolerance and the error
measured when it was set are in tests/kernels/_cases.py.
"""

from __future__ import annotations

import pathlib

from tests.kernels._interp import load_interpreted  # sets TRITON_INTERPRET=1 before triton is imported
from tests.kernels import _cases as C
from tests.kernels import _refs as R

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
KERNEL_FILE = ROOT / "overlay" / "kernels" / "indexer.py"
D = 128
FP8 = torch.float8_e4m3fn
TOL = C.IDX_INTERP


ix = load_interpreted(KERNEL_FILE, "_indexer_interpreted")
MODES = [ix.DOT_FP32, ix.DOT_BYTES_FP32]  # fp8 loads upcast / e4m3 bytes decoded (sm_80/86 path)


@pytest.fixture(scope="module", autouse=True)
def _print_measured_errors(request):
    yield
    C.report_errors(request)


def test_kernels_are_interpreted():
    assert ix.INTERPRETED
    assert type(ix._paged_mqa_logits_kernel).__name__ == "InterpretedFunction"


def _prefill(case: C.PrefillCase, clean: bool, **kw):
    M, N = case.q.shape[0], case.k.shape[0]
    return ix.fp8_mqa_logits(case.q, (case.k, case.k_scales), case.w, case.ks, case.ke, clean,
                             _out=C.poisoned((M, N)), **kw)


def _paged(case: C.PagedCase, clean: bool, **kw):
    B, next_n = case.q.shape[:2]
    return ix.fp8_paged_mqa_logits(case.q, case.cache, case.w, case.cl, case.tables, None, case.max_model_len,
                                   clean, _out=C.poisoned((B * next_n, case.max_model_len)), **kw)


# ------------------------------------------------------------------------------------------------
# The module's own references (public: tests and benchmarks use them) against the independent ones
# ------------------------------------------------------------------------------------------------
def test_module_references_match_independent_references():
    pc = C.prefill_case(91, 9, 60, 5)
    ref, mag = pc.ref()
    mod = ix.fp8_mqa_logits_ref(pc.q, (pc.k, pc.k_scales), pc.w, pc.ks, pc.ke).double()
    fin = torch.isfinite(ref)
    assert torch.equal(fin, torch.isfinite(mod))
    assert ((mod - ref).abs()[fin] / mag[fin].clamp_min(1e-300)).max() < 1e-6   # float32 result
    for two_d in (False, True):
        case = C.paged_case(92, 3, 2, 5, 16, [40, 1, 23], two_d=two_d, max_model_len=30)
        ref, mag = case.ref()
        mod = ix.fp8_paged_mqa_logits_ref(case.q, case.cache, case.w, case.cl, case.tables, 30).double()
        fin = torch.isfinite(ref)
        assert torch.equal(fin, torch.isfinite(mod))
        assert ((mod - ref).abs()[fin] / mag[fin].clamp_min(1e-300)).max() < 1e-6


@pytest.mark.parametrize("fmt", ["ue8m0", None])
def test_module_cache_writer_writes_the_same_bytes(fmt):
    g = torch.Generator().manual_seed(61)
    keys = (torch.randn(9, D, generator=g) * 3).bfloat16()
    keys[4] = 0
    slots = torch.tensor([0, 17, 31, 5, 33, -1, 79, 48, 2], dtype=torch.int64)
    mine = torch.randint(0, 256, (5, 16, 1, D + 4), generator=g, dtype=torch.uint8)
    theirs = mine.clone()
    R.write_indexer_cache(keys, mine, slots, ue8m0=fmt == "ue8m0")
    ix.indexer_k_quant_and_cache_ref(keys, theirs, slots, D, fmt)
    assert torch.equal(mine, theirs)


# ------------------------------------------------------------------------------------------------
# Prefill
# ------------------------------------------------------------------------------------------------
PREFILL = [(1, 9, 77, 1), (4, 21, 300, 2), (32, 13, 190, 3), (64, 6, 129, 4), (5, 17, 64, 5),
           (100, 8, 70, 6), (128, 7, 50, 7)]   # index heads beyond 64 (padded to 128)


@pytest.mark.parametrize("H,M,N,seed", PREFILL, ids=[f"H{h}-M{m}-N{n}-seed={s}" for h, m, n, s in PREFILL])
@pytest.mark.parametrize("clean", [True, False])
def test_prefill_matches_reference(H, M, N, seed, clean):
    """Includes empty ranges, ks > ke, ke > N and ks < 0 (rows 3-5 when M > 6; see _cases.prefill_case)."""
    case = C.prefill_case(seed, M, N, H)
    out = _prefill(case, clean)
    C.check_logits(out, case.ref(), TOL, clean, f"prefill {case.what} clean={clean}")
    if clean:
        assert not torch.isnan(out).any()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cfg", [dict(splits=1), dict(splits=7), dict(BT=1, BLOCK_N=16),
                                 dict(BT=4, BLOCK_N=32, splits=3), dict(K_AHEAD=True, splits=3),
                                 dict(K_AHEAD=True, BT=1, BLOCK_N=16, splits=7),
                                 dict(K_AHEAD=True, Q_OPAQUE=True, splits=2)])
def test_prefill_tiles_splits_and_dot_modes(mode, cfg):
    """Whole and split key ranges, small tiles, and the key tiles decoded ahead (sm_80/86's K_AHEAD: the first tile
    of a split loaded before its loop, the prefetch past its last tile masked)."""
    case = C.prefill_case(11, 19, 250, 4)
    out = _prefill(case, True, _config=dict(cfg, DOT_MODE=mode))
    C.check_logits(out, case.ref(), TOL, True, f"prefill {case.what} {cfg} mode={mode}")


def _compress_ref(case: C.PrefillCase, width: int):
    """DeepGEMM's row-compressed layout (vLLM 0.33.0) made from the full reference: row m holds keys
    [ks, ke) (clipped to [0, N)) from column 0; NaN where the kernel must not write."""
    full, mag = case.ref()
    M, N = full.shape
    ref = torch.full((M, width), float("nan"), dtype=full.dtype)
    rmag = torch.ones((M, width), dtype=mag.dtype)
    for m in range(M):
        lo, hi = max(int(case.ks[m]), 0), min(int(case.ke[m]), N)
        n = max(0, min(hi - lo, width))
        ref[m, :n], rmag[m, :n] = full[m, lo:lo + n], mag[m, lo:lo + n]
    return ref, rmag


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("H,M,N,seed,extra,cfg", [
    (4, 19, 250, 21, 0, dict(splits=7)),          # width = the longest range exactly, split over the keys
    (32, 9, 130, 22, 37, dict()),                  # a wider buffer than needed: the tail stays untouched
    (1, 13, 77, 23, 0, dict(BT=1, BLOCK_N=16)),
    (64, 6, 300, 24, -40, dict(BT=2, splits=3)),   # narrower than the longest range: ranges are cut
])
def test_prefill_compressed_rows(mode, H, M, N, seed, extra, cfg):
    """vLLM 0.33.0's `fp8_fp4_mqa_logits(..., max_seqlen_k)`: [M, max_seqlen_k] rows, row m holding keys
    [ks[m], ke[m]) from column 0; nothing written past each row's range (the NaN poison stays), empty and
    odd ranges included."""
    case = C.prefill_case(seed, M, N, H)
    lens = (torch.minimum(case.ke, torch.tensor(N)) - torch.clamp(case.ks, min=0)).clamp(min=0)
    width = int(lens.max()) + extra
    assert width > 0
    out = ix.fp8_fp4_mqa_logits((case.q, None), (case.k, case.k_scales), case.w, case.ks, case.ke,
                                max_seqlen_k=width)
    assert out.shape == (M, width) and out.dtype == torch.float32
    ref = _compress_ref(case, width)
    out = ix.fp8_mqa_logits(case.q, (case.k, case.k_scales), case.w, case.ks, case.ke, False,
                            max_seqlen_k=width, _out=C.poisoned((M, width)), _config=dict(cfg, DOT_MODE=mode))
    C.check_logits(out, ref, TOL, False, f"compressed {case.what} width={width} {cfg} mode={mode}")
    assert torch.equal(torch.isnan(out), torch.isnan(ref[0])), "written outside the rows' ranges"


def test_prefill_compressed_refuses_clean_logits():
    case = C.prefill_case(25, 3, 20, 2)
    with pytest.raises(ValueError, match="clean_logits=True"):
        ix.fp8_mqa_logits(case.q, (case.k, case.k_scales), case.w, case.ks, case.ke, True, max_seqlen_k=20)


def test_prefill_strided_keys_and_scale_shape():
    """vLLM hands k as a slice of a workspace and the scales as a [N, 1]-shaped view."""
    case = C.prefill_case(12, 7, 90, 32)
    big = torch.zeros(90, 2 * D, dtype=torch.uint8).view(FP8)
    big[:, :D] = case.k
    out = ix.fp8_mqa_logits(case.q, (big[:, :D], case.k_scales[:, None]), case.w, case.ks, case.ke, True,
                            _out=C.poisoned((7, 90)))
    C.check_logits(out, case.ref(), TOL, True, "strided")


def test_prefill_topk_matches_reference_where_no_near_ties():
    case = C.prefill_case(13, 24, 400, 32, empty_every=10**6, odd_ranges=False)
    case.ks[:], case.ke[:] = 0, 400
    case.ks[5:], case.ke[5:] = 37, 320
    _assert_topk(_prefill(case, False), case.ref(), k=64)


def _assert_topk(out, ref, k):
    """Top-k index sets agree on every row whose k-th and (k+1)-th reference values are further
    apart than twice the row's largest tolerated error (a near tie could legitimately swap); at least
    half the rows must qualify, so the check cannot pass vacuously."""
    ref, mag = ref
    checked = 0
    for r in range(ref.shape[0]):
        fin = torch.isfinite(ref[r])
        if fin.sum() <= k:
            continue
        vals, idx = ref[r].sort(descending=True)
        gap = (vals[k - 1] - vals[k]).item()
        if gap <= 2 * TOL.rel * mag[r][fin].max().item():
            continue
        got = torch.where(fin, out[r], torch.tensor(float("-inf")))
        assert set(got.topk(k).indices.tolist()) == set(idx[:k].tolist()), f"row {r}"
        checked += 1
    assert checked >= ref.shape[0] // 2, f"only {checked} of {ref.shape[0]} rows were tie-free"


# ------------------------------------------------------------------------------------------------
# Paged decode
# ------------------------------------------------------------------------------------------------

# Context lengths: 0 (CUDA-graph padding), shorter than next_n, inside one block, exact multiples,
# multi-block and not a multiple of the block size.
PAGED_CASES = [
    # H, next_n, block_size, lens, two_d
    (1, 1, 64, [70, 0, 1, 64, 129], False),
    (4, 2, 16, [33, 1, 0, 48, 100, 2], False),
    (32, 1, 64, [200, 5, 64], False),
    (32, 2, 64, [130, 2, 1, 67], True),
    (64, 2, 32, [95, 0, 40], False),
    (64, 1, 16, [17, 3], True),
    (4, 3, 16, [50, 2, 20], False),
    (100, 1, 16, [40, 3], False),      # index heads beyond 64
    (128, 2, 64, [70, 1], True),
]


@pytest.mark.parametrize("H,next_n,block_size,lens,two_d", PAGED_CASES)
@pytest.mark.parametrize("clean", [True, False])
def test_paged_matches_reference(H, next_n, block_size, lens, two_d, clean):
    seed = 100 + H + 7 * next_n + block_size
    case = C.paged_case(seed, len(lens), next_n, H, block_size, lens, two_d=two_d)
    ref = case.ref()
    C.assert_paged_visibility(case, ref[0])
    C.check_logits(_paged(case, clean), ref, TOL, clean, f"paged {case.what} clean={clean}")


@pytest.mark.parametrize("two_d", [False, True])
@pytest.mark.parametrize("clean", [True, False])
def test_paged_context_longer_than_max_model_len(two_d, clean):
    """Contexts past max_model_len see only its first max_model_len keys (the logits have no more
    columns); the block table holds the whole context."""
    lens = [100, 30, 64, 51]
    case = C.paged_case(77, 4, 2, 8, 16, lens, two_d=two_d, max_model_len=50)
    ref = case.ref()
    C.assert_paged_visibility(case, ref[0])
    assert torch.isfinite(ref[0][0]).all()             # request 0 sees every column
    C.check_logits(_paged(case, clean), ref, TOL, clean, f"paged {case.what} clean={clean}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cfg", [dict(programs=1), dict(programs=53), dict(BLOCK_B=16),
                                 dict(BLOCK_N=16, programs=5), dict(T=1),
                                 dict(SCALES_AHEAD=True, BLOCK_N=16, programs=7),
                                 dict(SCALES_AHEAD=True, BLOCK_N=32, programs=1),
                                 dict(HOIST_Q=False, programs=3),
                                 dict(K_AHEAD=True, BLOCK_N=16, programs=7),
                                 dict(K_AHEAD=True, SCALES_AHEAD=True, programs=1),
                                 dict(K_AHEAD=True, HOIST_Q=False, T=1, programs=53),
                                 dict(K_AHEAD=True, Q_OPAQUE=True, programs=5),
                                 dict(NESTED=False, BLOCK_N=16, programs=5),
                                 dict(NESTED=False, programs=53)])
def test_paged_work_split_and_dot_modes(mode, cfg):
    """One program doing everything, more programs than work items, the request count walked in
    chunks smaller than the batch, small tiles, next_n split over launches, the scales
    prefetched a tile ahead (programs whose items span several requests), the query reloaded per
    tile, the key tiles decoded a tile ahead (sm_80/86's: a program's first tile of each request loaded before its
    loop, the last iteration's prefetch past the request's keys masked), and the flat one-item-per-iteration walk."""
    lens = [45, 0, 3, 130, 64, 1, 77, 16, 2, 0, 90, 33, 18, 61, 8, 49, 20]
    case = C.paged_case(21, len(lens), 2, 4, 16, lens, max_model_len=140)
    out = _paged(case, True, _config=dict(cfg, DOT_MODE=mode))
    C.check_logits(out, case.ref(), TOL, True, f"paged {case.what} {cfg} {mode}")


def test_paged_two_d_lengths_are_per_token():
    """[B, next_n] context_lens: token j sees exactly context_lens[b, j] keys, whatever they are."""
    case = C.paged_case(31, 3, 2, 8, 16, [90, 40, 7], two_d=True, shuffle_2d=True, max_model_len=96)
    ref = case.ref()
    C.check_logits(_paged(case, True), ref, TOL, True, "2-D lengths")
    for r in range(6):
        assert torch.isfinite(ref[0][r]).sum().item() == int(case.cl.reshape(-1)[r])


def test_paged_one_and_two_d_lengths_agree():
    lens = [70, 3, 33]
    c1 = C.paged_case(41, 3, 2, 32, 16, lens, max_model_len=80)
    c2 = C.paged_case(41, 3, 2, 32, 16, lens, two_d=True, max_model_len=80)
    a = ix.fp8_paged_mqa_logits(c1.q, c1.cache, c1.w, c1.cl, c1.tables, None, 80, True)
    b = ix.fp8_paged_mqa_logits(c1.q, c1.cache, c1.w, c2.cl, c1.tables, None, 80, True)
    assert torch.equal(a, b)


def test_paged_topk_matches_reference_where_no_near_ties():
    case = C.paged_case(51, 4, 2, 32, 64, [300, 257, 190, 400], max_model_len=400)
    _assert_topk(_paged(case, False), case.ref(), k=64)


# ------------------------------------------------------------------------------------------------
# e4m3 decoding, API surface
# ------------------------------------------------------------------------------------------------


@ix.triton.jit
def _decode_bytes_kernel(x_ptr, o_ptr):
    r = ix.tl.arange(0, 256)
    ix.tl.store(o_ptr + r, ix._e4m3_bytes_to_f16(ix.tl.load(x_ptr + r)).to(ix.tl.float32))


def test_e4m3_byte_decoder_is_exact_for_every_code():
    """sm_80/86's decoder: float16 of every e4m3 value (subnormals, zeros, the largest) x E4M3_SCALED, exactly."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    out = torch.empty(256, dtype=torch.float32)
    _decode_bytes_kernel[(1,)](codes, out)
    want = R.e4m3(codes)
    finite = ~torch.isnan(want)
    assert finite.sum() == 254
    assert torch.equal(out[finite].double() / ix.E4M3_SCALED, want[finite])


def test_fp8_fp4_names_are_the_fp8_path_and_reject_fp4():
    pc = C.prefill_case(71, 5, 40, 4)
    q, kv, w, ks, ke = pc.q, (pc.k, pc.k_scales), pc.w, pc.ks, pc.ke
    a = ix.fp8_mqa_logits(q, kv, w, ks, ke, True)
    assert torch.equal(ix.fp8_fp4_mqa_logits((q, None), kv, w, ks, ke, True), a)
    with pytest.raises(NotImplementedError, match="MXFP4"):
        ix.fp8_fp4_mqa_logits((q.view(torch.uint8), torch.ones(5, 4)), kv, w, ks, ke, True)
    with pytest.raises(NotImplementedError, match="MXFP4"):
        ix.fp8_fp4_mqa_logits((q, None), (kv[0].view(torch.int8), kv[1]), w, ks, ke, True)

    c = C.paged_case(72, 2, 1, 4, 16, [20, 9], max_model_len=32)
    a = ix.fp8_paged_mqa_logits(c.q, c.cache, c.w, c.cl, c.tables, None, 32, True)
    b = ix.fp8_fp4_paged_mqa_logits((c.q, None), c.cache, c.w, c.cl[:, None].contiguous(), c.tables,
                                    None, 32, True)
    assert torch.equal(a, b)
    fp4_cache = torch.zeros(4, 16, 1, D // 2 + D // 32, dtype=torch.uint8)
    with pytest.raises(NotImplementedError, match="MXFP4"):
        ix.fp8_fp4_paged_mqa_logits((c.q, None), fp4_cache, c.w, c.cl, c.tables, None, 32, True)


def test_metadata_has_vllms_buffer_shape():
    meta = ix.get_paged_mqa_logits_metadata(torch.tensor([5, 9], dtype=torch.int32), 64, 132)
    assert meta.shape == (133, 2) and meta.dtype == torch.int32


@pytest.mark.parametrize("bad,match", [
    (dict(q_dtype=torch.bfloat16), "q must be torch.float8_e4m3fn"),
    (dict(heads=200), "1..128 index heads"),
    (dict(w_rows=3), "weights must be"),
    (dict(ke_len=2), "cu_seqlen_ks/cu_seqlen_ke"),
])
def test_prefill_bad_input_names_the_tensor(bad, match):
    H = bad.get("heads", 4)
    q = torch.zeros(5, H, D, dtype=bad.get("q_dtype", FP8))
    k = torch.zeros(8, D, dtype=FP8)
    w = torch.zeros(bad.get("w_rows", 5), H)
    ke = torch.zeros(bad.get("ke_len", 5), dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        ix.fp8_mqa_logits(q, (k, torch.ones(8)), w, torch.zeros(5, dtype=torch.int32), ke, True)


def test_paged_bad_input_names_the_tensor():
    c = C.paged_case(81, 2, 2, 4, 16, [20, 9])
    q, cache, w, cl, tables = c.q, c.cache, c.w, c.cl, c.tables
    with pytest.raises(ValueError, match="kv_cache last dim"):
        ix.fp8_paged_mqa_logits(q, cache[..., :D + 2], w, cl, tables, None, 32, True)
    with pytest.raises(ValueError, match="context_lens must be"):
        ix.fp8_paged_mqa_logits(q, cache, w, cl[:1], tables, None, 32, True)
    with pytest.raises(ValueError, match="context_lens must be int32"):
        ix.fp8_paged_mqa_logits(q, cache, w, cl.long(), tables, None, 32, True)
    with pytest.raises(ValueError, match="weights must be"):
        ix.fp8_paged_mqa_logits(q, cache, w[:2], cl, tables, None, 32, True)


def test_a_tensor_on_another_device_is_a_one_line_error_naming_it():
    """Every tensor must be on q's device: the launch would read another device's pointer (garbage or a fault)."""
    q, k, w = torch.zeros(5, 4, D, dtype=FP8), torch.zeros(8, D, dtype=FP8), torch.zeros(5, 4)
    ks, ke = torch.zeros(5, dtype=torch.int32), torch.full((5,), 8, dtype=torch.int32)
    meta = torch.device("meta")
    for i, name in enumerate(("k", "k_scales", "weights", "cu_seqlen_ks", "cu_seqlen_ke")):
        args = [k, torch.ones(8), w, ks, ke]
        args[i] = args[i].to(meta)
        with pytest.raises(ValueError, match=f"indexer: {name} is on meta, not cpu .q's device."):
            ix.fp8_mqa_logits(q, tuple(args[:2]), *args[2:], False)
    with pytest.raises(ValueError, match="out is on meta"):
        ix.fp8_mqa_logits(q, (k, torch.ones(8)), w, ks, ke, False, _out=torch.empty(5, 8, device=meta))
    c = C.paged_case(83, 2, 2, 4, 16, [20, 9])
    for i, name in enumerate(("kv_cache", "weights", "context_lens", "block_tables")):
        args = [c.cache, c.w, c.cl, c.tables]
        args[i] = args[i].to(meta)
        with pytest.raises(ValueError, match=f"indexer: {name} is on meta, not cpu .q_fp8's device."):
            ix.fp8_paged_mqa_logits(c.q, *args, None, 32, True)


def test_sm90_gluon_decode_config_is_picked_only_where_it_has_one():
    """The Gluon decode kernel's config on sm_90 at two query tokens x 32 or 64 padded heads at any batch, one token
    x 32 or 64 at batch 1, when allowed; the Triton kernel's everywhere else (larger one-token batches, other T,
    heads, GPU families), and always with gluon=False."""
    for (n, h, batch) in ((2, 32, 32), (2, 64, 128), (3, 17, None), (2, 33, 1), (1, 32, 1), (1, 64, 1)):
        on = ix.decode_config((9, 0), h, n, batch, 16384, 132, gluon=True)   # next_n 3: T = 2; 17 heads pad to 32
        assert on.GLUON and (on.T, on.HP, on.DOT_MODE, on.num_warps) == (min(n, 2), ix._padded_heads(h),
                                                                         ix.DOT_FP8, 4), (n, h)
        assert on.constexprs() == dict(HP=on.HP, T=on.T, BLOCK_N=on.BLOCK_N, BLOCK_B=on.BLOCK_B,
                                       NUM_BUF=on.num_stages)
    for args in (((9, 0), 64, 1, 8), ((9, 0), 32, 1, None), ((9, 0), 128, 2, 1), ((9, 0), 16, 2, 1),
                 ((9, 0), 128, 1, 1), ((8, 9), 32, 2, 1), ((12, 0), 64, 1, 1), ((10, 0), 32, 2, 1),
                 ((8, 0), 64, 1, 1)):
        assert not ix.decode_config(*args, gluon=True).GLUON, args
    off = ix.decode_config((9, 0), 32, 2, 32, 16384, 132, gluon=False)
    assert not off.GLUON and "NUM_BUF" not in off.constexprs()
    # the interpreter never picks it (no Gluon on the CPU)
    assert not ix.GLUON_DEFAULT and not ix.decode_config((9, 0), 32, 2).GLUON


def test_sm90_triton_decode_keeps_two_programs_per_sm_at_128_mma_columns():
    """T x HP = 128 compiles to 253 registers on sm_90 (two programs resident): the launch asks for two per SM;
    at 64 columns the table's own count stands."""
    tune = ix.DECODE_TUNING["hopper"]
    assert ix.decode_config((9, 0), 64, 2, gluon=False).per_sm == 2
    assert ix.decode_config((9, 0), 128, 1, gluon=False).per_sm == 2
    assert ix.decode_config((9, 0), 32, 2, gluon=False).per_sm == tune.programs_per_sm_t2
    assert ix.decode_config((9, 0), 32, 1, gluon=False).per_sm == tune.programs_per_sm
    assert ix.decode_config((8, 9), 64, 2).per_sm == ix.DECODE_TUNING["fp8"].programs_per_sm_t2


def test_gluon_decode_override_off_sm90_is_a_one_line_error():
    c = C.paged_case(82, 2, 2, 64, 16, [20, 9])
    with pytest.raises(ValueError, match="the Gluon decode kernel runs on sm_90"):
        ix.fp8_paged_mqa_logits(c.q, c.cache, c.w, c.cl, c.tables, None, 32, True, _config=dict(GLUON=True))


@pytest.fixture
def GI(monkeypatch):
    """The kernel module, loaded for the interpreter, planning as on an H100/H200 while its Gluon decode kernel is
    the default (DECODE_GLUON's config, past the sm_90 check) and as in the interpreter once it is not."""
    mod = load_interpreted(KERNEL_FILE, "_indexer_gluon_fallback")
    monkeypatch.setattr(mod, "_GLUON", True)
    monkeypatch.setattr(mod, "INTERPRETED", False)
    monkeypatch.setattr(mod, "GLUON_DEFAULT", True)
    monkeypatch.setattr(mod, "_device_info", lambda device: ((9, 0), 4) if mod.GLUON_DEFAULT else (None, 4))
    mod.decode_config.cache_clear()
    yield mod
    mod.decode_config.cache_clear()
    mod._PAGED_PLANS.reset()


def test_a_gluon_decode_kernel_that_does_not_build_falls_back_to_the_triton_kernel_once(GI, monkeypatch, caplog):
    broken = C.BrokenLaunch(C.compilation_error("module 'gluon.language' has no attribute 'thread_barrier'"))
    monkeypatch.setattr(GI, "_decode_gluon_launch", broken)
    c = C.paged_case(83, 3, 2, 32, 16, [40, 0, 17])   # two tokens x 32 heads: the Gluon kernel's shapes
    assert GI.decode_config((9, 0), 32, 2, 3, c.max_model_len, 4).GLUON  # what the first call plans
    with caplog.at_level("WARNING"):
        for _ in range(2):
            out = GI.fp8_paged_mqa_logits(c.q, c.cache, c.w, c.cl, c.tables, None, c.max_model_len, True,
                                          _out=C.poisoned((6, c.max_model_len)))
            C.check_logits(out, c.ref(), TOL, True, f"paged {c.what} after a failed Gluon build")
    assert broken.calls == 1  # tried once; the second call planned the Triton kernel straight away
    warnings = [r.getMessage() for r in caplog.records if "Gluon indexer kernel did not build" in r.getMessage()]
    assert len(warnings) == 1 and "DSA_OVERLAY_GLUON=0" in warnings[0]
    assert "\n" not in warnings[0] and "no attribute 'thread_barrier'" in warnings[0]
    assert not GI.GLUON_DEFAULT


def test_gluon_decode_errors_other_than_a_build_failure_and_caller_configs_still_raise(GI, monkeypatch):
    from triton.compiler.errors import CompilationError

    c = C.paged_case(84, 2, 2, 64, 16, [33, 5])       # two tokens x 64 heads
    monkeypatch.setattr(GI, "_decode_gluon_launch", C.BrokenLaunch(ValueError("not a build failure")))
    with pytest.raises(ValueError, match="not a build failure"):
        GI.fp8_paged_mqa_logits(c.q, c.cache, c.w, c.cl, c.tables, None, c.max_model_len, True)
    assert GI.GLUON_DEFAULT
    GI._PAGED_PLANS.reset()
    monkeypatch.setattr(GI, "_decode_gluon_launch", C.BrokenLaunch(C.compilation_error("no Gluon here")))
    cfg = dict(T=1, HP=64, BLOCK_N=64, DOT_MODE=GI.DOT_FP8, num_warps=4, num_stages=3, GLUON=True)
    with pytest.raises(CompilationError):            # a config the caller names is not replaced
        GI.fp8_paged_mqa_logits(c.q, c.cache, c.w, c.cl, c.tables, None, c.max_model_len, True, _config=cfg)
    assert GI.GLUON_DEFAULT


@pytest.mark.parametrize("block_size,cfg", [
    (16, dict(BLOCK_N=16)), (16, dict(BLOCK_N=64)), (64, dict(BLOCK_N=32)), (32, dict(BLOCK_N=128)),
    (32, dict(BLOCK_N=32, NESTED=False, HOIST_Q=False)), (16, dict(BLOCK_N=32, NESTED=False, HOIST_Q=False)),
    (16, dict(BLOCK_N=32, SCALES_AHEAD=True)), (64, dict(BLOCK_N=32, SCALES_AHEAD=True)),
    (64, dict(BLOCK_N=64, K_AHEAD=True)), (16, dict(BLOCK_N=32, K_AHEAD=True))])
def test_paged_block_size_compiled_in_matches_reference(block_size, cfg):
    """CONST_BS (the block size a constant of the kernel): tiles smaller than a cache block (one block-table entry per
    tile), equal to it and spanning several blocks (an entry per key row), both walks, the scales read a tile ahead;
    the same logits as the reference."""
    lens = [70, 0, 1, 64, 129, 33]
    case = C.paged_case(90 + block_size, len(lens), 2, 8, block_size, lens)
    out = _paged(case, True, _config=dict(cfg, CONST_BS=True, programs=5))
    C.check_logits(out, case.ref(), TOL, True, f"paged {case.what} CONST_BS {cfg}")


def test_only_sm80_and_sm86_decode_the_prefill_key_tiles_ahead():
    """K_AHEAD halves the sm_80/86 loop (the e4m3 decode) but only adds conversions where the MMA takes fp8; at 128
    heads it spills (cross-compiled)."""
    for cap in ((8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0), None):
        for h in (16, 32, 64, 128):
            assert ix.prefill_config(cap, h).K_AHEAD == (cap in ((8, 0), (8, 6)) and h <= 64), (cap, h)


def test_where_the_block_size_is_compiled_in_and_the_walk_is_nested():
    """CONST_BS on sm_90's per-request walk and on every mma.sync target; the fp8 mma.sync targets (sm_89, sm_10x,
    sm_12x) walk request by request from 64 MMA columns (T x padded heads) to 128, sm_80/86 from 32 padded heads, one
    item per iteration elsewhere (bench/RESULTS.md, stop 37); sm_80/86 at every head count since their key tiles are
    decoded ahead (K_AHEAD, there only: stop 48)."""
    assert all(ix.decode_config((9, 0), h, n, gluon=g).CONST_BS for h in (32, 64, 128) for n in (1, 2)
               for g in (True, False) if h * n <= 128)
    # the flat walk at 256 MMA columns (128 heads x 2 tokens) spills 24 B with it (cross-compiled, sm_90)
    assert not ix.decode_config((9, 0), 128, 2).CONST_BS
    for cap in ((8, 9), (10, 0), (12, 0), (12, 1)):
        for h, n in ((16, 1), (32, 1), (32, 2), (64, 1), (64, 2), (128, 1), (128, 2)):
            cfg = ix.decode_config(cap, h, n)
            assert cfg.CONST_BS and cfg.NESTED == cfg.HOIST_Q == (64 <= cfg.T * cfg.HP <= 128), (cap, h, n, cfg)
            assert not cfg.K_AHEAD
    for cap in ((8, 0), (8, 6)):
        for h, n in ((16, 1), (16, 2), (32, 1), (32, 2), (64, 1), (64, 2), (128, 1)):
            cfg = ix.decode_config(cap, h, n)
            assert cfg.CONST_BS and cfg.NESTED and cfg.HOIST_Q and cfg.K_AHEAD, (cap, h, n, cfg)
    assert not any(ix.decode_config((9, 0), h, n, gluon=False).K_AHEAD for h in (16, 32, 64, 128) for n in (1, 2))
