"""Indexer logits kernels (prefill and paged decode) vs float64 torch references, on the CPU under
Triton's interpreter.

The kernel file is loaded as a private module with TRITON_INTERPRET=1 set, whatever this pytest
process imported before (the cross-compile test needs compiled kernels and runs in a subprocess).
Inputs are fresh seeded random tensors; outputs are NaN-poisoned before every kernel run; the paged
cache is written the way vLLM's `indexer_k_quant_and_cache` writes it, and every byte no request may
read (the tail of a last block, unused blocks, unused block-table entries) holds NaN.
"""

from __future__ import annotations

import math
import pathlib

from tests.kernels._interp import load_interpreted  # sets TRITON_INTERPRET=1 before triton is imported

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
KERNEL_FILE = ROOT / "dsa_installer" / "kernels" / "indexer.py"
D = 128
FP8 = torch.float8_e4m3fn


ix = load_interpreted(KERNEL_FILE, "_indexer_interpreted")
MODES = [ix.DOT_FP32, ix.DOT_BYTES_FP32]  # fp8 loads upcast / e4m3 bytes decoded (sm_80/86 path)


def test_kernels_are_interpreted():
    assert ix.INTERPRETED
    assert type(ix._paged_mqa_logits_kernel).__name__ == "InterpretedFunction"


# ------------------------------------------------------------------------------------------------
# Inputs
# ------------------------------------------------------------------------------------------------


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _quant_tokens(k: torch.Tensor):
    """Per-token fp8 quantisation the way vLLM's indexer cache does it (ue8m0 scales)."""
    scale = k.float().abs().amax(-1).clamp_min(1e-4) / 448.0
    scale = torch.exp2(torch.ceil(torch.log2(scale)))
    return (k.float() / scale[:, None]).clamp(-448, 448).to(FP8), scale


def _queries(shape, g):
    return (torch.randn(shape, generator=g) * 2.0).clamp(-448, 448).to(FP8)


def _weights(rows, heads, g):
    return torch.randn(rows, heads, generator=g) * 0.3   # signed, like vLLM's folded weights


def _error_bound(q, k_deq, weights):
    """|kernel - exact| bound per logit: fp32 rounding over a 128-term dot, the head sum and the
    scale, relative to the sum of absolute terms (fp8 products are exact in fp32)."""
    mag = torch.einsum("mhd,nd->mhn", q.to(torch.float64).abs(), k_deq.abs())
    mag = (mag * weights.to(torch.float64).abs()[:, :, None]).sum(1)
    return 4e-6 * mag + 1e-30


def _prefill_case(seed, M, N, H, empty_every=5):
    g = _gen(seed)
    q = _queries((M, H, D), g)
    k, ks_scale = _quant_tokens(torch.randn(N, D, generator=g) * torch.rand(N, 1, generator=g) * 4)
    w = _weights(M, H, g)
    start = torch.randint(0, N, (M,), generator=g)
    length = torch.randint(0, N + 1, (M,), generator=g)
    ks = start.to(torch.int32)
    ke = torch.minimum(start + length, torch.tensor(N)).to(torch.int32)
    ke[::empty_every] = ks[::empty_every]                  # empty ranges
    if M > 2:
        ks[1], ke[1] = 0, N                                 # the full row
        ks[2], ke[2] = N - 1, N                             # the last key only
    return q, (k, ks_scale), w, ks, ke


def _paged_case(seed, B, next_n, H, block_size, lens, two_d=False, shuffle_2d=False):
    """Cache written by `indexer_k_quant_and_cache_ref` into shuffled physical blocks; every other
    byte (tails, spare blocks, the block unused table entries point at) is 0xFF: NaN values and
    NaN scales."""
    g = _gen(seed)
    per_req = [math.ceil(L / block_size) for L in lens]
    max_blocks = max(per_req + [1]) + 1
    num_blocks = sum(per_req) + 3
    cache = torch.full((num_blocks, block_size, D + 4), 0xFF, dtype=torch.uint8)
    perm = torch.randperm(num_blocks, generator=g)
    poison = int(perm[-1])
    tables = torch.full((B, max_blocks), poison, dtype=torch.int32)
    used = 0
    for b, L in enumerate(lens):
        tables[b, :per_req[b]] = perm[used:used + per_req[b]].to(torch.int32)
        used += per_req[b]
        if L:
            keys = (torch.randn(L, D, generator=g) * torch.rand(L, 1, generator=g) * 4).bfloat16()
            pos = torch.arange(L)
            slots = tables[b, pos // block_size].long() * block_size + pos % block_size
            ix.indexer_k_quant_and_cache_ref(keys, cache, slots, D, "ue8m0")
    q = _queries((B, next_n, H, D), g)
    w = _weights(B * next_n, H, g)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    if two_d:
        j = torch.arange(next_n, dtype=torch.int32)
        cl = lens_t[:, None] - next_n + 1 + j[None, :]       # vLLM 0.23.0's per-token form
        if shuffle_2d:                                       # any per-token lengths <= L
            cl = (torch.rand(B, next_n, generator=g) * (lens_t[:, None] + 1)).to(torch.int32)
        cl = cl.clamp_min(0).contiguous()
    else:
        cl = lens_t
    return q, cache.unsqueeze(-2), w, cl, tables


def _poisoned(shape):
    return torch.full(shape, float("nan"), dtype=torch.float32)


def _check_logits(out, ref, bound, clean, what):
    finite = torch.isfinite(ref)
    assert not torch.isnan(ref).any()
    got = out[finite]
    assert torch.isfinite(got).all(), f"{what}: non-finite logits inside the visible range"
    err = (got.double() - ref[finite].double()).abs()
    lim = bound[finite]
    worst = (err / lim).max().item() if err.numel() else 0.0
    assert worst <= 1.0, f"{what}: error {err.max().item():.3g} exceeds bound (ratio {worst:.2f})"
    if clean:
        assert torch.equal(out[~finite], torch.full_like(out[~finite], float("-inf"))), \
            f"{what}: positions outside the range are not exactly -inf"


# ------------------------------------------------------------------------------------------------
# Prefill
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("H,M,N,seed", [(1, 9, 77, 1), (4, 21, 300, 2), (32, 13, 190, 3),
                                        (64, 6, 129, 4), (5, 17, 64, 5)])
@pytest.mark.parametrize("clean", [True, False])
def test_prefill_matches_reference(H, M, N, seed, clean):
    q, kv, w, ks, ke = _prefill_case(seed, M, N, H)
    ref = ix.fp8_mqa_logits_ref(q, kv, w, ks, ke)
    out = ix.fp8_mqa_logits(q, kv, w, ks, ke, clean, _out=_poisoned((M, N)))
    bound = _error_bound(q, kv[0].double() * kv[1].double()[:, None], w)
    _check_logits(out, ref, bound, clean, f"prefill H={H} M={M} N={N} clean={clean}")
    if clean:
        assert not torch.isnan(out).any()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cfg", [dict(splits=1), dict(splits=7), dict(BT=1, BLOCK_N=16),
                                 dict(BT=4, BLOCK_N=32, splits=3)])
def test_prefill_tiles_splits_and_dot_modes(mode, cfg):
    q, kv, w, ks, ke = _prefill_case(11, 19, 250, 4)
    ref = ix.fp8_mqa_logits_ref(q, kv, w, ks, ke)
    out = ix.fp8_mqa_logits(q, kv, w, ks, ke, True, _out=_poisoned((19, 250)),
                            _config=dict(cfg, DOT_MODE=mode))
    bound = _error_bound(q, kv[0].double() * kv[1].double()[:, None], w)
    _check_logits(out, ref, bound, True, f"prefill {cfg} mode={mode}")


def test_prefill_strided_keys_and_scale_shape():
    """vLLM hands k as a slice of a workspace and the scales as a [N, 1]-shaped view."""
    q, (k, sc), w, ks, ke = _prefill_case(12, 7, 90, 32)
    big = torch.zeros(90, 2 * D, dtype=torch.uint8).view(FP8)
    big[:, :D] = k
    out = ix.fp8_mqa_logits(q, (big[:, :D], sc[:, None]), w, ks, ke, True, _out=_poisoned((7, 90)))
    ref = ix.fp8_mqa_logits_ref(q, (k, sc), w, ks, ke)
    _check_logits(out, ref, _error_bound(q, k.double() * sc.double()[:, None], w), True, "strided")


def test_prefill_topk_matches_reference_where_no_near_ties():
    q, kv, w, ks, ke = _prefill_case(13, 24, 400, 32, empty_every=10**6)
    ks[:], ke[:] = 0, 400
    ks[5:], ke[5:] = 37, 320
    ref = ix.fp8_mqa_logits_ref(q, kv, w, ks, ke)
    out = ix.fp8_mqa_logits(q, kv, w, ks, ke, False, _out=_poisoned((24, 400)))
    bound = _error_bound(q, kv[0].double() * kv[1].double()[:, None], w)
    _assert_topk(out, ref, bound, k=64)


def _assert_topk(out, ref, bound, k):
    """Top-k index sets agree on every row whose k-th and (k+1)-th reference values are further
    apart than twice the row's largest error bound (a near tie could legitimately swap); at least
    half the rows must qualify, so the check cannot pass vacuously."""
    checked = 0
    for r in range(ref.shape[0]):
        fin = torch.isfinite(ref[r])
        if fin.sum() <= k:
            continue
        vals, idx = ref[r].double().sort(descending=True)
        gap = (vals[k - 1] - vals[k]).item()
        if gap <= 2 * bound[r][fin].max().item():
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
]


@pytest.mark.parametrize("H,next_n,block_size,lens,two_d", PAGED_CASES)
@pytest.mark.parametrize("clean", [True, False])
def test_paged_matches_reference(H, next_n, block_size, lens, two_d, clean):
    seed = 100 + H + 7 * next_n + block_size
    q, cache, w, cl, tables = _paged_case(seed, len(lens), next_n, H, block_size, lens, two_d)
    max_model_len = max(lens) + 37
    ref = ix.fp8_paged_mqa_logits_ref(q, cache, w, cl, tables, max_model_len)
    out = ix.fp8_paged_mqa_logits(q, cache, w, cl, tables, None, max_model_len, clean,
                                  _out=_poisoned(ref.shape))
    bound = _paged_bound(q, cache, w, tables, max_model_len)
    _check_logits(out, ref, bound, clean, f"paged H={H} next_n={next_n} bs={block_size} "
                  f"lens={lens} 2d={two_d} clean={clean}")
    # The visible range per row is what vLLM's formula says, not what the kernel chose.
    for b, L in enumerate(lens):
        for j in range(next_n):
            vis = max(0, L - next_n + j + 1)
            assert torch.isfinite(ref[b * next_n + j, :vis]).all()
            assert torch.isinf(ref[b * next_n + j, vis:]).all()


def _paged_bound(q, cache, w, tables, max_model_len):
    """Error bound of every (row, column): the same formula as prefill, on the keys each request's
    block table maps (NaN-poisoned slots count as 0; they are never visible)."""
    vals, scales = ix._read_paged_cache(cache)
    B, next_n, H, _ = q.shape
    bs = vals.shape[1]
    pos = torch.arange(max_model_len)
    out = torch.zeros(B * next_n, max_model_len, dtype=torch.float64)
    for b in range(B):
        blk = tables[b, (pos // bs).clamp_max(tables.shape[1] - 1)].long()
        k = vals[blk, pos % bs].double() * scales[blk, pos % bs].double()[:, None]
        k = torch.nan_to_num(k, nan=0.0)
        out[b * next_n:(b + 1) * next_n] = _error_bound(q[b], k, w[b * next_n:(b + 1) * next_n])
    return out


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cfg", [dict(programs=1), dict(programs=53), dict(BLOCK_B=16),
                                 dict(BLOCK_N=16, programs=5), dict(T=1),
                                 dict(SCALES_AHEAD=True, BLOCK_N=16, programs=7),
                                 dict(SCALES_AHEAD=True, BLOCK_N=32, programs=1),
                                 dict(HOIST_Q=False, programs=3),
                                 dict(NESTED=False, BLOCK_N=16, programs=5),
                                 dict(NESTED=False, programs=53)])
def test_paged_work_split_and_dot_modes(mode, cfg):
    """One program doing everything, more programs than work items, the request count walked in
    chunks smaller than the batch, small tiles, next_n split over launches, the scales
    prefetched a tile ahead (programs whose items span several requests), the query reloaded per
    tile, and the flat one-item-per-iteration walk (sm_80/86/89/120's)."""
    lens = [45, 0, 3, 130, 64, 1, 77, 16, 2, 0, 90, 33, 18, 61, 8, 49, 20]
    q, cache, w, cl, tables = _paged_case(21, len(lens), 2, 4, 16, lens)
    ref = ix.fp8_paged_mqa_logits_ref(q, cache, w, cl, tables, 140)
    out = ix.fp8_paged_mqa_logits(q, cache, w, cl, tables, None, 140, True,
                                  _out=_poisoned(ref.shape), _config=dict(cfg, DOT_MODE=mode))
    _check_logits(out, ref, _paged_bound(q, cache, w, tables, 140), True, f"paged {cfg} {mode}")


def test_paged_two_d_lengths_are_per_token():
    """[B, next_n] context_lens: token j sees exactly context_lens[b, j] keys, whatever they are."""
    lens = [90, 40, 7]
    q, cache, w, cl, tables = _paged_case(31, 3, 2, 8, 16, lens, two_d=True, shuffle_2d=True)
    ref = ix.fp8_paged_mqa_logits_ref(q, cache, w, cl, tables, 96)
    out = ix.fp8_paged_mqa_logits(q, cache, w, cl, tables, None, 96, True,
                                  _out=_poisoned(ref.shape))
    _check_logits(out, ref, _paged_bound(q, cache, w, tables, 96), True, "2-D lengths")
    for r in range(6):
        assert torch.isfinite(ref[r]).sum().item() == int(cl.reshape(-1)[r])


def test_paged_one_and_two_d_lengths_agree():
    lens = [70, 3, 33]
    q, cache, w, cl1, tables = _paged_case(41, 3, 2, 32, 16, lens)
    _, _, _, cl2, _ = _paged_case(41, 3, 2, 32, 16, lens, two_d=True)
    a = ix.fp8_paged_mqa_logits(q, cache, w, cl1, tables, None, 80, True)
    b = ix.fp8_paged_mqa_logits(q, cache, w, cl2, tables, None, 80, True)
    assert torch.equal(a, b)


def test_paged_topk_matches_reference_where_no_near_ties():
    lens = [300, 257, 190, 400]
    q, cache, w, cl, tables = _paged_case(51, 4, 2, 32, 64, lens)
    ref = ix.fp8_paged_mqa_logits_ref(q, cache, w, cl, tables, 400)
    out = ix.fp8_paged_mqa_logits(q, cache, w, cl, tables, None, 400, False,
                                  _out=_poisoned(ref.shape))
    _assert_topk(out, ref, _paged_bound(q, cache, w, tables, 400), k=64)


# ------------------------------------------------------------------------------------------------
# Cache writer, e4m3 decoding, API surface
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["ue8m0", None])
def test_cache_writer_layout_and_quantisation(fmt):
    g = _gen(61)
    bs, nb = 16, 5
    cache = torch.randint(0, 256, (nb, bs, D + 4), generator=g, dtype=torch.uint8)
    before = cache.clone()
    keys = (torch.randn(9, D, generator=g) * 3).bfloat16()
    keys[4] = 0                                              # amax below the 1e-4 floor
    slots = torch.tensor([0, 17, 31, 5, 33, -1, 79, 48, 2], dtype=torch.int64)
    ix.indexer_k_quant_and_cache_ref(keys, cache, slots, D, fmt)
    raw = cache.reshape(nb, -1)
    touched = torch.zeros(nb, bs * (D + 4), dtype=torch.bool)
    for i, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        blk, off = divmod(s, bs)
        vals = raw[blk, off * D:(off + 1) * D].view(FP8).double()
        scale = raw[blk, bs * D + 4 * off:bs * D + 4 * off + 4].view(torch.float32).double().item()
        touched[blk, off * D:(off + 1) * D] = True
        touched[blk, bs * D + 4 * off:bs * D + 4 * off + 4] = True
        amax = max(keys[i].double().abs().max().item(), 1e-4)
        if fmt == "ue8m0":
            assert math.log2(scale) == round(math.log2(scale)) and amax / 448 <= scale < amax / 224
        else:
            assert scale == pytest.approx(amax / 448, rel=1e-6)
        err = (vals * scale - keys[i].double()).abs()
        assert (err <= keys[i].double().abs() / 16 + scale * 2.0 ** -9).all()
    assert torch.equal(raw[~touched], before.reshape(nb, -1)[~touched])


@ix.triton.jit
def _decode_bytes_kernel(x_ptr, o_ptr):
    r = ix.tl.arange(0, 256)
    ix.tl.store(o_ptr + r, ix._e4m3_bytes_to_f32(ix.tl.load(x_ptr + r)))


def test_e4m3_byte_decoder_is_exact_for_every_code():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    out = torch.empty(256, dtype=torch.float32)
    _decode_bytes_kernel[(1,)](codes, out)
    want = codes.view(FP8).float()
    finite = ~torch.isnan(want)
    assert finite.sum() == 254
    assert torch.equal(out[finite], want[finite])


def test_fp8_fp4_names_are_the_fp8_path_and_reject_fp4():
    q, kv, w, ks, ke = _prefill_case(71, 5, 40, 4)
    a = ix.fp8_mqa_logits(q, kv, w, ks, ke, True)
    assert torch.equal(ix.fp8_fp4_mqa_logits((q, None), kv, w, ks, ke, True), a)
    with pytest.raises(NotImplementedError, match="MXFP4"):
        ix.fp8_fp4_mqa_logits((q.view(torch.uint8), torch.ones(5, 4)), kv, w, ks, ke, True)
    with pytest.raises(NotImplementedError, match="MXFP4"):
        ix.fp8_fp4_mqa_logits((q, None), (kv[0].view(torch.int8), kv[1]), w, ks, ke, True)

    qd, cache, wd, cl, tables = _paged_case(72, 2, 1, 4, 16, [20, 9])
    a = ix.fp8_paged_mqa_logits(qd, cache, wd, cl, tables, None, 32, True)
    b = ix.fp8_fp4_paged_mqa_logits((qd, None), cache, wd, cl[:, None].contiguous(), tables,
                                    None, 32, True)
    assert torch.equal(a, b)
    fp4_cache = torch.zeros(4, 16, 1, D // 2 + D // 32, dtype=torch.uint8)
    with pytest.raises(NotImplementedError, match="MXFP4"):
        ix.fp8_fp4_paged_mqa_logits((qd, None), fp4_cache, wd, cl, tables, None, 32, True)


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
    q, cache, w, cl, tables = _paged_case(81, 2, 2, 4, 16, [20, 9])
    with pytest.raises(ValueError, match="kv_cache last dim"):
        ix.fp8_paged_mqa_logits(q, cache[..., :D + 2], w, cl, tables, None, 32, True)
    with pytest.raises(ValueError, match="context_lens must be"):
        ix.fp8_paged_mqa_logits(q, cache, w, cl[:1], tables, None, 32, True)
    with pytest.raises(ValueError, match="context_lens must be int32"):
        ix.fp8_paged_mqa_logits(q, cache, w, cl.long(), tables, None, 32, True)
    with pytest.raises(ValueError, match="weights must be"):
        ix.fp8_paged_mqa_logits(q, cache, w[:2], cl, tables, None, 32, True)
