"""Float64 references for the kernel tests, written from the documented layouts and the definitions alone.

Nothing here imports overlay/: the caches are decoded from their bytes (IEEE bit fields, little-endian), every
query token and head is computed, and invalid inputs are handled as the public docstrings say. The kernels
and the module-level references (`sparse_mla_reference`, `fp8_*_logits_ref`) are checked against these.

Layouts (the docstrings of `sparse_mla_attention` and `fp8_paged_mqa_logits`; the indexer cache's was measured
against vLLM 0.23.0's `indexer_k_quant_and_cache` and DeepGEMM on an H200):
- sparse-MLA cache, slot s = block s // block_size, offset s % block_size; bf16: 576 values per slot
  (512 kv_c, 64 rope); fp8_ds_mla: 656 bytes per slot, 512 float8_e4m3fn, 4 float32 scales (scale i for
  values 128i..128i+127), 64 bfloat16 rope values.
- indexer cache [num_blocks, block_size, (1,) D + 4] uint8, per block: block_size * D e4m3 bytes (token t
  at byte t * D), then block_size float32 scales (token t at byte block_size * D + 4 t).
"""

from __future__ import annotations

import math

import torch

NOPE, ROPE = 512, 64
FP8_DS_MLA_BYTES = NOPE + 4 * 4 + 2 * ROPE  # 656
INDEXER_D = 128


# ------------------------------------------------------------------------------------------------
# Bit-level decoders (float64 results)
# ------------------------------------------------------------------------------------------------
def _le_words(raw: torch.Tensor, nbytes: int) -> torch.Tensor:
    """uint8 [..., n * nbytes] -> int64 [..., n], little-endian words."""
    b = raw.to(torch.int64).reshape(*raw.shape[:-1], -1, nbytes)
    return (b << (8 * torch.arange(nbytes, device=raw.device))).sum(-1)


def _ieee(bits: torch.Tensor, exp_bits: int, man_bits: int, *, e4m3fn: bool = False) -> torch.Tensor:
    """IEEE-754 style decode of integer bit patterns: sign, biased exponent, mantissa, subnormals.
    e4m3fn: no infinities, only S.1111.111 is NaN (float8_e4m3fn)."""
    bias = (1 << (exp_bits - 1)) - 1
    sign = (bits >> (exp_bits + man_bits)) & 1
    e = (bits >> man_bits) & ((1 << exp_bits) - 1)
    m = bits & ((1 << man_bits) - 1)
    frac = m.to(torch.float64) / (1 << man_bits)
    val = torch.where(e == 0, torch.ldexp(frac, torch.tensor(1.0 - bias, dtype=torch.float64)),
                      torch.ldexp(1.0 + frac, (e - bias).to(torch.float64)))
    top = (1 << exp_bits) - 1
    if e4m3fn:
        val = torch.where((e == top) & (m == (1 << man_bits) - 1), math.nan, val)
    else:
        val = torch.where(e == top, torch.where(m == 0, math.inf, math.nan), val)
    return torch.where(sign == 1, -val, val)


def e4m3(codes: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn codes (uint8, or a float8 tensor) -> float64 values."""
    return _ieee(codes.contiguous().view(torch.uint8).to(torch.int64), 4, 3, e4m3fn=True)


def f32_le(raw: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 4n] little-endian float32 -> float64 [..., n]."""
    return _ieee(_le_words(raw, 4), 8, 23)


def bf16_le(raw: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 2n] little-endian bfloat16 -> float64 [..., n]."""
    return _ieee(_le_words(raw, 2), 8, 7)


def raw_bytes(x: torch.Tensor) -> torch.Tensor:
    """The bytes of x's elements in logical order (last dim times element size)."""
    return x.contiguous().view(torch.uint8)


# ------------------------------------------------------------------------------------------------
# Sparse MLA
# ------------------------------------------------------------------------------------------------
def mla_slots(kv_cache: torch.Tensor, kv_format: str) -> torch.Tensor:
    """Every slot of a sparse-MLA cache ([num_blocks, block_size, (1,) W], [num_slots, (1,) W]) decoded to
    float64 [num_slots, 576] (512 kv_c then 64 rope), slot s = block s // block_size, offset s % block_size."""
    x = kv_cache
    if x.dim() == 4:
        x = x[:, :, 0]
    if x.dim() == 2:
        x = x[:, None]
    nb, bs, w = x.shape
    raw = raw_bytes(x.reshape(nb * bs, w))
    if kv_format == "bf16":
        assert raw.shape[-1] == 2 * (NOPE + ROPE), raw.shape
        return bf16_le(raw)
    assert kv_format == "fp8_ds_mla" and raw.shape[-1] == FP8_DS_MLA_BYTES, (kv_format, raw.shape)
    n = raw.shape[0]
    nope = e4m3(raw[:, :NOPE]).view(n, 4, 128) * f32_le(raw[:, NOPE:NOPE + 16])[:, :, None]
    rope = bf16_le(raw[:, NOPE + 16:])
    return torch.cat([nope.reshape(n, NOPE), rope], dim=1)


def sparse_mla_ref64(q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, softmax_scale: float,
                     kv_format: str = "bf16"):
    """The definition, in float64, for every query token and head.

    Returns (out [T, H, 512], lse [T, H], value_scale [T], score_scale [T, H]): out = softmax over the valid
    selected slots (0 <= id < num_slots, each occurrence counted) of softmax_scale * q . kv, times kv[:512];
    lse natural log; a token without any valid id gets out 0 and lse -inf. The magnitudes errors are measured
    against: value_scale[t] = max |kv_c| over token t's valid slots, score_scale[t, h] = softmax_scale *
    max_j |q| . |kv_j| (0 if none)."""
    q = q.detach().cpu().double()
    idx = indices.detach().cpu().long()
    if idx.dim() == 3:
        idx = idx[:, 0]
    rows = mla_slots(kv_cache.detach().cpu(), kv_format)
    n = rows.shape[0]
    T, H, _ = q.shape
    out = torch.zeros(T, H, NOPE, dtype=torch.float64)
    lse = torch.full((T, H), -math.inf, dtype=torch.float64)
    vscale = torch.zeros(T, dtype=torch.float64)
    sscale = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        sel = idx[t][(idx[t] >= 0) & (idx[t] < n)]
        if sel.numel() == 0:
            continue
        kv = rows[sel]                                        # [k, 576]
        s = (q[t] @ kv.T) * softmax_scale                     # [H, k]
        m = s.max(dim=1, keepdim=True).values
        w = torch.exp(s - m)
        z = w.sum(dim=1, keepdim=True)
        out[t] = (w @ kv[:, :NOPE]) / z
        lse[t] = (m + torch.log(z))[:, 0]
        vscale[t] = kv[:, :NOPE].abs().max()
        sscale[t] = (q[t].abs() @ kv.abs().T).max(dim=1).values * abs(softmax_scale)
    return out, lse, vscale, sscale


# ------------------------------------------------------------------------------------------------
# Indexer
# ------------------------------------------------------------------------------------------------
def _logits_row(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor):
    """q [H, D], w [H], k [n, D] (dequantised) -> (sum_h w[h] relu(q[h] . k[n]), sum_h |w| |q[h]| . |k[n]|)."""
    s = (q @ k.T).clamp_min(0)
    return w @ s, w.abs() @ (q.abs() @ k.abs().T)


def mqa_logits_ref64(q: torch.Tensor, k: torch.Tensor, k_scales: torch.Tensor, weights: torch.Tensor,
                     ks: torch.Tensor, ke: torch.Tensor):
    """Prefill indexer logits from first principles, float64: logits[m, n] = sum_h w[m, h] *
    relu(q[m, h] . (k[n] * k_scales[n])) for max(ks[m], 0) <= n < min(ke[m], N), -inf elsewhere (an empty or
    reversed range gives a row of -inf). Returns (logits [M, N], magnitude [M, N]: the same sum over
    absolute values, 0 outside the range)."""
    qd = e4m3(q.detach().cpu())                                          # [M, H, D]
    kd = e4m3(k.detach().cpu()) * k_scales.detach().cpu().double().reshape(-1, 1)
    w = weights.detach().cpu().double()
    M, N = qd.shape[0], kd.shape[0]
    out = torch.full((M, N), -math.inf, dtype=torch.float64)
    mag = torch.zeros(M, N, dtype=torch.float64)
    for m in range(M):
        lo, hi = max(int(ks[m]), 0), min(int(ke[m]), N)
        if lo < hi:
            out[m, lo:hi], mag[m, lo:hi] = _logits_row(qd[m], w[m], kd[lo:hi])
    return out, mag


def visible_len(context_lens: torch.Tensor, b: int, j: int, next_n: int, max_model_len: int) -> int:
    """Keys token j of request b sees: context_lens[b, j] (2-D) or context_lens[b] - next_n + j + 1 (1-D),
    clipped to [0, max_model_len]."""
    cl = context_lens.detach().cpu().long()
    vis = int(cl[b, j]) if cl.dim() == 2 else int(cl[b]) - next_n + j + 1
    return min(max(vis, 0), max_model_len)


def paged_mqa_logits_ref64(q: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor,
                           context_lens: torch.Tensor, block_tables: torch.Tensor, max_model_len: int):
    """Decode indexer logits from first principles, float64, reading the cache's bytes in vLLM's block
    layout. Row b * next_n + j, column n < visible_len(b, j): sum_h w[row, h] relu(q[b, j, h] . k_n), where
    k_n = e4m3 values * float32 scale of logical position n (physical block block_tables[b, n // bs]);
    -inf elsewhere. Returns (logits [B * next_n, max_model_len], magnitude, same shape)."""
    B, next_n, H, D = q.shape
    x = kv_cache.detach().cpu()
    if x.dim() == 4:
        x = x[:, :, 0]
    nb, bs, w = x.shape
    assert w == D + 4 and x.dtype == torch.uint8, (x.shape, x.dtype)
    blocks = x.reshape(nb, bs * w)                            # the bytes of each physical block
    qd = e4m3(q.detach().cpu())
    wt = weights.detach().cpu().double()
    tables = block_tables.detach().cpu().long()
    out = torch.full((B * next_n, max_model_len), -math.inf, dtype=torch.float64)
    mag = torch.zeros(B * next_n, max_model_len, dtype=torch.float64)
    for b in range(B):
        for j in range(next_n):
            vis = visible_len(context_lens, b, j, next_n, max_model_len)
            if vis == 0:
                continue
            pos = torch.arange(vis)
            phys, off = tables[b, pos // bs], pos % bs
            vals = blocks[phys[:, None], off[:, None] * D + torch.arange(D)]
            scale = f32_le(blocks[phys[:, None], bs * D + 4 * off[:, None] + torch.arange(4)])
            k = e4m3(vals) * scale
            r = b * next_n + j
            out[r, :vis], mag[r, :vis] = _logits_row(qd[b, j], wt[r], k)
    return out, mag


def write_indexer_cache(keys: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, *, ue8m0: bool = True,
                        interleaved: bool = False) -> None:
    """Quantise keys [n, D] per token (scale = max(amax, 1e-4) / 448, rounded up to a power of two with
    ue8m0; values saturated to e4m3) and write them at `slots` (< 0: skipped) in the block layout above.
    interleaved=True writes the wrong, per-token layout (D bytes then 4 scale bytes per token; what a reader
    that slices per token assumes): for mutation tests only."""
    x = cache[:, :, 0] if cache.dim() == 4 else cache
    assert x.is_contiguous() and x.dtype == torch.uint8
    nb, bs, w = x.shape
    D = w - 4
    flat = x.view(nb, bs * w)
    keep = slots >= 0
    k = keys[keep].float()
    s = slots[keep].long()
    scale = k.abs().amax(-1).clamp_min(1e-4) / 448.0
    if ue8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    vals = (k / scale[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    blk, off = s // bs, s % bs
    if interleaved:
        v0, s0 = off * w, off * w + D
    else:
        v0, s0 = off * D, bs * D + 4 * off
    flat[blk[:, None], v0[:, None] + torch.arange(D)] = vals
    flat[blk[:, None], s0[:, None] + torch.arange(4)] = scale.contiguous().view(torch.uint8).view(-1, 4)
