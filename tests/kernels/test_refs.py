"""The independent references of tests/kernels/_refs.py against the definitions, computed the slowest way:
bit decoders against torch's own conversions, the sparse-MLA reference against a scalar loop over every token,
head and key, the indexer references against per-logit scalar sums, and the indexer cache writer against the
documented byte offsets. No kernel and nothing from overlay/ is involved."""

from __future__ import annotations

import math
import random

import pytest
import torch

from tests.kernels import _cases as C
from tests.kernels import _refs as R


def test_e4m3_decoder_matches_torch_for_every_code():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    mine, torchs = R.e4m3(codes), codes.view(torch.float8_e4m3fn).double()
    assert torch.equal(torch.isnan(mine), torch.isnan(torchs)) and int(torch.isnan(mine).sum()) == 2
    fin = ~torch.isnan(mine)
    assert torch.equal(mine[fin], torchs[fin])
    assert R.e4m3(torch.tensor([0x01, 0x08, 0x7E], dtype=torch.uint8)).tolist() == [2.0 ** -9, 2.0 ** -6, 448.0]


def test_float32_and_bfloat16_decoders_match_torch():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4000, generator=g) * torch.logspace(-44, 38, 4000)
    x[:4] = torch.tensor([0.0, -0.0, math.inf, -math.inf])
    assert torch.equal(R.f32_le(R.raw_bytes(x)), x.double())
    y = x.to(torch.bfloat16)
    assert torch.equal(R.bf16_le(R.raw_bytes(y)), y.double())
    assert torch.isnan(R.f32_le(torch.full((4,), 0xFF, dtype=torch.uint8))).all()


def _scalar_mla(q, rows, idx, scale):
    """Every token, head and selected key one at a time, with Python floats."""
    T, H, _ = q.shape
    n = rows.shape[0]
    out = [[[0.0] * 512 for _ in range(H)] for _ in range(T)]
    lse = [[-math.inf] * H for _ in range(T)]
    for t in range(T):
        sel = [int(i) for i in idx[t] if 0 <= int(i) < n]
        for h in range(H):
            if not sel:
                continue
            s = [scale * sum(float(a) * float(b) for a, b in zip(q[t, h].tolist(), rows[j].tolist())) for j in sel]
            m = max(s)
            w = [math.exp(v - m) for v in s]
            z = sum(w)
            lse[t][h] = m + math.log(z)
            for jj, j in enumerate(sel):
                for d in range(512):
                    out[t][h][d] += w[jj] * float(rows[j, d]) / z
    return torch.tensor(out, dtype=torch.float64), torch.tensor(lse, dtype=torch.float64)


@pytest.mark.parametrize("fmt", ["bf16", "fp8_ds_mla"])
def test_sparse_mla_reference_is_the_definition(fmt):
    """Every token and head, duplicates, every kind of invalid id and an all-invalid token."""
    case = C.mla_case(31, fmt, H=3, topk=9, T=4, block_size=4, num_blocks=3)
    rows = R.mla_slots(case.cache, fmt)
    assert rows.shape == (12, 576)
    out, lse, vscale, sscale = case.ref()
    lo, ll = _scalar_mla(case.q.double(), rows, case.idx, case.scale)
    assert torch.equal(torch.isinf(ll), torch.isinf(lse)) and torch.isinf(lse).any()
    assert not torch.isinf(lse).all()
    fin = torch.isfinite(ll)
    assert (out - lo).abs().max().item() < 1e-12 * max(1.0, lo.abs().max().item())
    assert (lse[fin] - ll[fin]).abs().max().item() < 1e-12
    assert (out[~fin] == 0).all() and (vscale > 0).sum() == (~torch.isinf(lse).all(1)).sum()


def test_mla_slots_follow_the_documented_layout():
    """Slot s = block s // block_size, offset s % block_size; bytes 0..511 e4m3, 512..527 four float32
    scales, 528..655 bfloat16 rope, whatever the cache view."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 576, generator=g)
    packed, exact = C.quantize_fp8_ds_mla(x)
    assert torch.equal(R.mla_slots(packed.view(3, 2, 656), "fp8_ds_mla"), exact)
    assert torch.equal(R.mla_slots(packed.view(3, 2, 1, 656), "fp8_ds_mla"), exact)
    assert torch.equal(R.mla_slots(packed.view(6, 1, 656), "fp8_ds_mla"), exact)
    r = packed[4]
    v = r[:512].view(torch.float8_e4m3fn).double().view(4, 128) * r[512:528].view(torch.float32).double()[:, None]
    assert torch.equal(exact[4, :512], v.reshape(512))
    assert torch.equal(exact[4, 512:], r[528:].view(torch.bfloat16).double())
    bf = x.to(torch.bfloat16)
    padded = torch.full((3, 3, 576), float("nan"), dtype=torch.bfloat16)
    padded[:, :2] = bf.view(3, 2, 576)
    assert torch.equal(R.mla_slots(padded[:, :2], "bf16"), bf.double())


def test_prefill_indexer_reference_is_the_definition():
    case = C.prefill_case(5, M=8, N=23, H=3)
    logits, mag = case.ref()
    q = case.q.double()
    k = case.k.double() * case.k_scales.double()[:, None]
    for m in range(8):
        lo, hi = max(int(case.ks[m]), 0), min(int(case.ke[m]), 23)
        for n in range(23):
            if not lo <= n < hi:
                assert logits[m, n] == -math.inf and mag[m, n] == 0
                continue
            want = sum(float(case.w[m, h]) * max(0.0, float(q[m, h] @ k[n])) for h in range(3))
            assert logits[m, n].item() == pytest.approx(want, rel=1e-12, abs=1e-12)
    assert torch.isinf(logits[3]).all()                     # ks > ke
    assert torch.isfinite(logits[4, int(case.ks[4]):]).all()   # ke > N, clipped
    assert torch.isfinite(logits[5, :int(case.ke[5])]).all()   # ks < 0, clipped


def test_indexer_cache_writer_follows_the_block_layout():
    """Token at slot s: e4m3 bytes at block s // bs, byte (s % bs) * D; its float32 scale at byte
    bs * D + 4 (s % bs) of the same block; nothing else written; ue8m0 scales are powers of two that keep
    the amax inside e4m3's range."""
    g = torch.Generator().manual_seed(61)
    bs, nb, D = 16, 5, 128
    cache = torch.randint(0, 256, (nb, bs, D + 4), generator=g, dtype=torch.uint8)
    before = cache.clone()
    keys = (torch.randn(9, D, generator=g) * 3).bfloat16()
    keys[4] = 0                                              # amax below the 1e-4 floor
    slots = torch.tensor([0, 17, 31, 5, 33, -1, 79, 48, 2], dtype=torch.int64)
    R.write_indexer_cache(keys, cache, slots)
    raw = cache.reshape(nb, -1)
    touched = torch.zeros_like(raw, dtype=torch.bool)
    for i, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        blk, off = divmod(s, bs)
        vals = R.e4m3(raw[blk, off * D:(off + 1) * D])
        scale = R.f32_le(raw[blk, bs * D + 4 * off:bs * D + 4 * off + 4]).item()
        touched[blk, off * D:(off + 1) * D] = True
        touched[blk, bs * D + 4 * off:bs * D + 4 * off + 4] = True
        amax = max(keys[i].double().abs().max().item(), 1e-4)
        assert math.log2(scale) == round(math.log2(scale)) and amax / 448 <= scale < amax / 224
        assert ((vals * scale - keys[i].double()).abs() <= keys[i].double().abs() / 16 + scale * 2.0 ** -9).all()
    assert torch.equal(raw[~touched], before.reshape(nb, -1)[~touched])


def test_paged_indexer_reference_reads_the_keys_back():
    """The paged reference of a cache written by the writer equals the prefill reference over each request's
    own (unpaged) quantised keys, row by row, with 1-D and 2-D context lengths and contexts past
    max_model_len."""
    lens = [40, 0, 17, 33]
    for two_d, mml in ((False, 60), (True, 60), (False, 30)):
        case = C.paged_case(7, 4, 2, 3, 16, lens, two_d=two_d, max_model_len=mml)
        logits, mag = case.ref()
        C.assert_paged_visibility(case, logits)
        for b, L in enumerate(lens):
            if L == 0:
                assert torch.isinf(logits[2 * b:2 * b + 2]).all()
                continue
            k, ksc = C.quant_keys(case.keys[b])
            for j in range(2):
                vis = R.visible_len(case.cl, b, j, 2, mml)
                ks = torch.zeros(1, dtype=torch.int32)
                ke = torch.tensor([vis], dtype=torch.int32)
                row, _ = R.mqa_logits_ref64(case.q[b, j:j + 1], k[:max(vis, 1)], ksc[:max(vis, 1)],
                                            case.w[2 * b + j:2 * b + j + 1], ks, ke)
                assert torch.equal(logits[2 * b + j, :vis], row[0, :vis])


def test_draw_indices_has_every_kind_of_invalid_id():
    idx = C.draw_indices(random.Random(3), 6, 200, 50, all_invalid_rows=(2,))
    assert ((idx[2] < 0) | (idx[2] >= 50)).all()
    ok = torch.cat([idx[:2], idx[3:]])
    assert (ok == -1).any() and (ok < -1).any() and (ok >= 50).any() and ((ok >= 0) & (ok < 50)).any()
