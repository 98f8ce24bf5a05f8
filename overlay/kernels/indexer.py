"""DSA indexer logits without DeepGEMM: Triton fp8 MQA logits for prefill and paged decode.

What it computes: DeepSeek Sparse Attention picks, for every query token, the top-k key positions by
an "indexer" score,

    logits[m, n] = scale_k[n] * sum_h weights[m, h] * relu(q[m, h, :] . k[n, :])

with q and k in fp8 e4m3 (D = 128) and one fp32 dequantisation scale per key.  The scale is applied
after the ReLU and the head sum, like DeepGEMM; the two forms agree because every vLLM writer of the
indexer cache stores positive scales (`max(amax, 1e-4) / 448`, optionally rounded up to a power of 2).
vLLM computes it with DeepGEMM (`fp8_mqa_logits`, `fp8_paged_mqa_logits`), which exists only for
compute capability 9.x/10.x and only for 32 or 64 index heads; these kernels run on sm_80, sm_86,
sm_89, sm_90 and sm_120, any head count.

Public functions (drop-in for `vllm.utils.deep_gemm`):

* vLLM 0.16.0 names: `fp8_mqa_logits`, `fp8_paged_mqa_logits`, `get_paged_mqa_logits_metadata`.
* vLLM 0.23.0 names: `fp8_fp4_mqa_logits`, `fp8_fp4_paged_mqa_logits` (fp8 query path only; an
  MXFP4 query or cache raises `NotImplementedError`), `get_paged_mqa_logits_metadata`.
* Float references and a cache writer for tests: `fp8_mqa_logits_ref`, `fp8_paged_mqa_logits_ref`,
  `indexer_k_quant_and_cache_ref`.
* The launch heuristic: `prefill_config`, `decode_config`, `launch_configs`.

Input layouts: the paged cache as vLLM's `indexer_k_quant_and_cache` writes it (measured on an H200
against DeepGEMM) is allocated as uint8 `[num_blocks, block_size, D + 4]` and handed to the logits
kernel as the view `[num_blocks, block_size, 1, D + 4]`, but it is *not* token-interleaved.  Each
physical block (`kv_cache.stride(0)` bytes apart) holds `block_size * D` fp8 bytes (token t's values
at byte `t * D`), followed by `block_size` little-endian float32 scales (token t's at byte
`block_size * D + 4 * t`).  Every argument is documented on the public functions.

How the kernels work: a tile of BLOCK_N keys is multiplied by all heads of a few query tokens at once
(`K[BLOCK_N, D] @ Q[T * H, D]^T`, the key rows as the MMA's M dimension), then ReLU, head weights and
a sum over each token's heads reduce it to `[BLOCK_N, T]` (the ReLU is per head, the weights may
be negative).  The dot runs natively in fp8 on sm_89+; on sm_80/86, where Triton has no e4m3 type,
the raw bytes are decoded in registers to bf16 (exact: every e4m3 value is a bf16 value); under
`TRITON_INTERPRET=1` it runs in fp32, because Triton's interpreted bf16 dot is broken.  Products are
exact and accumulate in fp32 (on sm_90 with wgmma's fp8 accumulator, like DeepGEMM).  Decode is a
persistent kernel that splits the total number of key tiles of all requests evenly over its
programs, so it needs no scheduling metadata and stays CUDA-graph safe (its grid depends only on
the device).

Launch configuration: a `PrefillConfig` / `DecodeConfig` (named fields, the kernels' constexprs
among them), picked per launch by `prefill_config` / `decode_config` from the named tuning tables
`PREFILL_TUNING` / `DECODE_TUNING`, keyed by GPU family, and the shape.  No autotuning.
Measurements behind the tables: bench/RESULTS.md.

Self-contained: torch, triton (3.5 and 3.6) and launch.py beside it: `apply` drops this file into vLLM as
`vllm/_dsa_overlay/kernels/indexer.py`.  Runs on the CPU when `TRITON_INTERPRET=1` is set before
import (`INTERPRETED`; tests).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from .indexer_sm90 import GLUON as _GLUON
from .indexer_sm90 import _paged_mqa_logits_sm90_kernel
from .launch import DirectLauncher as _Launcher
from .launch import KeptLaunch as _Kept
from .launch import PlanTable
from .launch import build_failed as _build_failed
from .launch import build_failure_text as _build_failure_text
from .launch import GLUON_ENV
from .launch import gluon_wanted as _gluon_wanted
from .launch import contiguous_strides as _contiguous_strides
from .launch import off_device as _off_device
from .launch import tensor_key as _tensor_key
from .launch import pdl_kwargs as _pdl_kwargs
from .e4m3 import e4m3_as_f16_bits
from .pdl import pdl_enter

__all__ = [
    "HEAD_DIM",
    "fp8_mqa_logits",
    "fp8_paged_mqa_logits",
    "get_paged_mqa_logits_metadata",
    "fp8_fp4_mqa_logits",
    "fp8_fp4_paged_mqa_logits",
    "fp8_mqa_logits_ref",
    "fp8_paged_mqa_logits_ref",
    "indexer_k_quant_and_cache_ref",
    "dot_mode_for_capability",
    "launch_configs",
    "INTERPRETED",
    "DOT_FP8",
    "DOT_BF16",
    "DOT_FP32",
    "DOT_BYTES_FP32",
    "prefill_config",
    "decode_config",
    "PrefillConfig",
    "DecodeConfig",
    "PrefillTuning",
    "DecodeTuning",
    "PREFILL_TUNING",
    "DECODE_TUNING",
]

HEAD_DIM = 128
FP8_MAX = 448.0

# How the kernels multiply (constexpr DOT_MODE):
#   DOT_FP8       fp8 tiles, native fp8 MMA (sm_89 and newer);
#   DOT_BF16      raw e4m3 bytes decoded in registers to float16 (x 2^-8, exact; sm_80/86: Triton has no e4m3
#                 type there; the name is historical);
#   DOT_FP32      fp8 tiles upcast to fp32 (TRITON_INTERPRET=1: Triton's interpreted bf16 dot is broken);
#   DOT_BYTES_FP32 raw bytes decoded to fp32 (interpreter check of DOT_BF16's decoder).
DOT_FP8, DOT_BF16, DOT_FP32, DOT_BYTES_FP32 = 0, 1, 2, 3


# --------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------


# The decoded e4m3 codes of DOT_BF16 / DOT_BYTES_FP32 are the values times 2^-8 (E4M3_SCALED); the product of two is
# scaled back by the weights, in _score_tile.
E4M3_SCALED = 2.0 ** -8


@triton.jit
def _e4m3_bytes_to_f16(x):
    """fp8 e4m3fn codes held as uint8 (sm_80/86 have no fp8 type) -> float16 of value x E4M3_SCALED, exactly,
    subnormals included: sign, exponent and mantissa bits moved to their float16 places (exponent bias 7 -> 15 is
    the 2^-8).  Two masks, two shifts and an or per element.  0x7f/0xff (NaN) decode as +-480 (scaled); vLLM's
    writers saturate, so they never store them."""
    x = x.to(tl.int16)   # zero-extended
    return (((x & 0x80) << 8) | ((x & 0x7F) << 7)).to(tl.float16, bitcast=True)


@triton.jit
def _dot_operand(x, DOT_MODE: tl.constexpr):
    """Loaded fp8 tile (fp8 for modes 0 and 2, raw uint8 codes for modes 1 and 3) -> MMA operand (modes 1 and 3:
    the values x E4M3_SCALED)."""
    if DOT_MODE == 0:
        return x
    elif DOT_MODE == 1:
        return _e4m3_bytes_to_f16(x)
    elif DOT_MODE == 2:
        return x.to(tl.float32)
    else:
        return _e4m3_bytes_to_f16(x).to(tl.float32)


@triton.jit
def _k_operand(x, DOT_MODE: tl.constexpr, OPAQUE: tl.constexpr = False):
    """A loaded key tile -> its MMA operand; DOT_BF16 decodes with e4m3.e4m3_as_f16_bits (a PTX block per 4 bytes;
    compiled kernels only: the interpreter runs modes 2 and 3)."""
    if DOT_MODE == 1:
        return e4m3_as_f16_bits(x, OPAQUE)
    else:
        return _dot_operand(x, DOT_MODE)


@triton.jit
def _score_tile(k, q, w, DOT_MODE: tl.constexpr, BLOCK_N: tl.constexpr, T: tl.constexpr,
                HP: tl.constexpr, DECODED: tl.constexpr = False):
    """k [BLOCK_N, D] loaded keys (DECODED: already `_dot_operand`), q [T * HP, D] query operand (already
    `_dot_operand`), w [T * HP] fp32 -> [BLOCK_N, T] fp32: sum over each token's HP heads of w * relu(k . q)."""
    if DECODED:
        kk = k
    else:
        kk = _dot_operand(k, DOT_MODE)
    if DOT_MODE >= 2:
        s = tl.dot(kk, tl.trans(q), input_precision="ieee")
    else:
        s = tl.dot(kk, tl.trans(q))
    if DOT_MODE % 2 == 1:   # both operands decoded x E4M3_SCALED: relu and the head sum are linear in s
        w = w * 65536.0
    p = tl.maximum(s, 0.0) * w[None, :]
    return tl.sum(tl.reshape(p, (BLOCK_N, T, HP)), axis=2)


@triton.jit
def _mqa_logits_kernel(
    q_ptr, k_ptr, ksc_ptr, w_ptr, kstart_ptr, kend_ptr, out_ptr,
    M, N, H,
    stride_qm, stride_qh, stride_kn, stride_wm, stride_wh, stride_om,
    n_per_split, clean, out_width,
    D: tl.constexpr, HP: tl.constexpr, BT: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_MODE: tl.constexpr, COMPRESS: tl.constexpr = False, PDL: tl.constexpr = False, K_AHEAD: tl.constexpr = False,
    Q_OPAQUE: tl.constexpr = False,
):
    """Prefill: program (pid_m, pid_s) scores query tokens [pid_m * BT, +BT) against the keys of
    split pid_s ([pid_s * n_per_split, +n_per_split)) that lie in the union of the tokens' ranges.
    COMPRESS (DeepGEMM's layout from vLLM 0.33.0): token m's key n goes to column n - ks[m] of an
    `out_width`-wide row and only [ks[m], ke[m]) is written; otherwise to column n (width N)."""
    pdl_enter(PDL)  # launched with PDL: nothing is read before the previous kernel is done (pdl.py)
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    m0 = pid_m * BT

    toks = m0 + tl.arange(0, BT)
    tok_ok = toks < M
    ks = tl.maximum(tl.load(kstart_ptr + toks, mask=tok_ok, other=N), 0)
    ke = tl.minimum(tl.load(kend_ptr + toks, mask=tok_ok, other=0), N)
    lo = tl.min(ks, axis=0)
    hi = tl.max(ke, axis=0)

    s_lo = pid_s * n_per_split
    s_hi = tl.minimum(s_lo + n_per_split, N)
    c_lo = tl.maximum(lo, s_lo) // BLOCK_N * BLOCK_N
    c_hi = tl.minimum(hi, s_hi)

    # All heads of BT tokens: rows (token, head) of a [BT * HP, D] tile; padded heads load zeros and
    # weigh 0.
    cols = tl.arange(0, BT * HP)
    col_tok = m0 + cols // HP
    col_head = cols % HP
    col_ok = (col_tok < M) & (col_head < H)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + col_tok.to(tl.int64)[:, None] * stride_qm + col_head[:, None] * stride_qh
                + d[None, :], mask=col_ok[:, None], other=0.0)
    if Q_OPAQUE:
        q = _k_operand(q, DOT_MODE, True)
    else:
        q = _dot_operand(q, DOT_MODE)
    w = tl.load(w_ptr + col_tok.to(tl.int64) * stride_wm + col_head * stride_wh, mask=col_ok,
                other=0.0).to(tl.float32)

    out_rows = out_ptr + toks.to(tl.int64)[None, :] * stride_om
    if COMPRESS:  # row m's column 0 is key ks[m]; keys past ks[m] + out_width are cut
        out_rows -= ks[None, :]
        ke_out = tl.minimum(ke, ks + out_width)
    rn = tl.arange(0, BLOCK_N)
    if K_AHEAD:   # as in the decode kernel: each next key tile loaded at the top of an iteration, decoded at its end
        k_next = _k_operand(tl.load(k_ptr + (c_lo + rn).to(tl.int64)[:, None] * stride_kn + d[None, :],
                                    mask=(c_lo + rn < c_hi)[:, None], other=0.0), DOT_MODE)
    for n0 in range(c_lo, c_hi, BLOCK_N):
        n = n0 + rn
        n_ok = n < N
        if K_AHEAD:
            k = k_next
            raw_next = tl.load(k_ptr + (n + BLOCK_N).to(tl.int64)[:, None] * stride_kn + d[None, :],
                               mask=(n + BLOCK_N < c_hi)[:, None], other=0.0)
        else:
            k = tl.load(k_ptr + n.to(tl.int64)[:, None] * stride_kn + d[None, :], mask=n_ok[:, None],
                        other=0.0)
        ksc = tl.load(ksc_ptr + n, mask=n_ok, other=0.0)
        logits = _score_tile(k, q, w, DOT_MODE, BLOCK_N, BT, HP, K_AHEAD) * ksc[:, None]
        valid = (n[:, None] >= ks[None, :]) & (n[:, None] < ke[None, :])
        logits = tl.where(valid, logits, float("-inf"))
        if COMPRESS:
            tl.store(out_rows + n[:, None], logits,
                     mask=valid & (n[:, None] < ke_out[None, :]) & tok_ok[None, :])
        else:
            tl.store(out_rows + n[:, None], logits, mask=n_ok[:, None] & tok_ok[None, :])
        if K_AHEAD:
            k_next = _k_operand(raw_next, DOT_MODE)

    if clean:
        # -inf over the split's columns no token of this group can see.
        p_end = c_lo + tl.cdiv(tl.maximum(c_hi - c_lo, 0), BLOCK_N) * BLOCK_N
        neg = tl.full((BLOCK_N, BT), float("-inf"), tl.float32)
        for n0 in range(s_lo, tl.minimum(c_lo, s_hi), BLOCK_N):
            n = n0 + rn
            tl.store(out_rows + n[:, None], neg, mask=(n < s_hi)[:, None] & tok_ok[None, :])
        for n0 in range(tl.maximum(p_end, s_lo), s_hi, BLOCK_N):
            n = n0 + rn
            tl.store(out_rows + n[:, None], neg, mask=(n < s_hi)[:, None] & tok_ok[None, :])


@triton.jit
def _request_tiles(cl_ptr, b0, B, stride_cb, stride_cj, tok, tok_ok, vis_shift, max_model_len,
                   clean, BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr):
    """Work items (key tiles, at least 1) of requests [b0, b0 + BLOCK_B); 0 past B."""
    rb = b0 + tl.arange(0, BLOCK_B)
    b_ok = rb < B
    vis = tl.load(cl_ptr + rb[:, None] * stride_cb + tok[None, :] * stride_cj,
                  mask=b_ok[:, None] & tok_ok[None, :], other=0) + vis_shift[None, :]
    vis = tl.where(tok_ok[None, :], vis, 0)
    length = tl.minimum(tl.max(vis, axis=1), max_model_len)
    length = tl.where(clean != 0, max_model_len, length)
    return tl.where(b_ok, tl.maximum(tl.cdiv(length, BLOCK_N), 1), 0)


@triton.jit
def _rows(bt_row, n0, rn, kv_len, block_size, BS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Cache block (int64, from the request's block-table row) and offset in it of key rows n0 + rn, n0 a multiple
    of BLOCK_N; rows past kv_len read block 0.  With the block size a constant (BS > 0) and whole tiles in one block,
    one block-table entry per tile (a scalar); else one per key row (an entry per block for tiles of whole blocks
    was slower: bench/RESULTS.md, stop 37)."""
    if BS > 0 and BS % BLOCK_N == 0:
        phys = tl.load(bt_row + n0 // BS, mask=n0 < kv_len, other=0).to(tl.int64)
        off = n0 % BS + rn
    else:
        n = n0 + rn
        phys = tl.load(bt_row + n // block_size, mask=n < kv_len, other=0).to(tl.int64)
        off = n % block_size
    return phys, off


@triton.jit
def _paged_mqa_logits_kernel(
    q_ptr, kv_ptr, w_ptr, cl_ptr, bt_ptr, out_ptr,
    B, H, next_n, j0, max_model_len, is_1d, clean, block_size, num_programs,
    stride_qb, stride_qn, stride_qh, stride_wm, stride_wh, stride_cb, stride_cj, stride_btb,
    stride_blk, stride_om,
    D: tl.constexpr, HP: tl.constexpr, T: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr, DOT_MODE: tl.constexpr, SCALES_AHEAD: tl.constexpr = False, HOIST_Q: tl.constexpr = True,
    NESTED: tl.constexpr = True, BS: tl.constexpr = 0, PDL: tl.constexpr = False, K_AHEAD: tl.constexpr = False,
    Q_OPAQUE: tl.constexpr = False,
):
    """Decode, persistent: work item = (request b, key tile t) for query tokens [j0, j0 + T) of b.
    Request b has max(1, cdiv(len_b, BLOCK_N)) items (len_b: the furthest position any of its
    tokens sees, or max_model_len when cleaning); program p takes items
    [p * total / P, (p + 1) * total / P) in request-major order.  kv_ptr is the uint8 cache.
    BS: the cache block size as a constant (its divisions become shifts), 0: block_size at run time."""
    pdl_enter(PDL)  # launched with PDL: nothing is read before the previous kernel is done (pdl.py)
    block_size = BS if BS > 0 else block_size
    pid = tl.program_id(0)
    kvs_ptr = kv_ptr.to(tl.pointer_type(tl.float32))
    if DOT_MODE % 2 == 0:   # DOT_FP8 / DOT_FP32 load e4m3 tiles; the others decode raw bytes
        kvv_ptr = kv_ptr.to(tl.pointer_type(tl.float8e4nv))
    else:
        kvv_ptr = kv_ptr
    rt = tl.arange(0, T)
    tok = j0 + rt
    tok_ok = tok < next_n
    # Visible length of token j of request b: context_lens[b, j] (2-D), or
    # context_lens[b] - next_n + j + 1 (1-D; stride_cj is 0 then).
    vis_shift = is_1d * (tok + 1 - next_n)

    # Work items per request, summed over all requests in chunks of BLOCK_B ...
    total = 0
    for b0 in range(0, B, BLOCK_B):
        total += tl.sum(_request_tiles(cl_ptr, b0, B, stride_cb, stride_cj, tok, tok_ok, vis_shift,
                                       max_model_len, clean, BLOCK_B, BLOCK_N), axis=0)
    total = total.to(tl.int64)
    w_start = (pid * total // num_programs).to(tl.int32)
    w_end = ((pid + 1) * total // num_programs).to(tl.int32)
    # ... then this program's first item: the requests whose items all lie before w_start (each
    # has at least one item, so the running sum is strictly increasing), and the tile within b.
    b = 0
    before = 0
    run = 0
    for b0 in range(0, B, BLOCK_B):
        tiles = _request_tiles(cl_ptr, b0, B, stride_cb, stride_cj, tok, tok_ok, vis_shift,
                               max_model_len, clean, BLOCK_B, BLOCK_N)
        done = (tl.cumsum(tiles, axis=0) + run) <= w_start
        b += tl.sum(done.to(tl.int32), axis=0)
        before += tl.sum(tl.where(done, tiles, 0), axis=0)
        run += tl.sum(tiles, axis=0)
    t = w_start - before

    cols = tl.arange(0, T * HP)
    col_tok = j0 + cols // HP
    col_head = cols % HP
    col_ok = (col_tok < next_n) & (col_head < H)
    d = tl.arange(0, D)
    rn = tl.arange(0, BLOCK_N)
    scale_base = block_size * D // 4
    stride_blk_f = stride_blk // 4

    if NESTED:
        # Walk the items request by request: per request, its query tile, weights, visible lengths
        # and block-table row are loaded once, then a plain loop over its key tiles (which Triton
        # software-pipelines: the block-table entries and the key/scale loads of later tiles are in
        # flight while the current tile is multiplied).
        todo = w_end - w_start
        while todo > 0:
            vis = tl.load(cl_ptr + b * stride_cb + tok * stride_cj, mask=tok_ok, other=0) + vis_shift
            vis = tl.where(tok_ok, tl.minimum(vis, max_model_len), 0)
            kv_len = tl.max(vis, axis=0)
            len_b = tl.where(clean != 0, max_model_len, kv_len)
            t_end = tl.minimum(tl.maximum(tl.cdiv(len_b, BLOCK_N), 1), t + todo)
            b64 = b.to(tl.int64)
            q_ptrs = (q_ptr + b64 * stride_qb + col_tok[:, None] * stride_qn
                      + col_head[:, None] * stride_qh + d[None, :])
            if HOIST_Q:   # the query operand stays in registers for all of the request's tiles
                if Q_OPAQUE:
                    q = _k_operand(tl.load(q_ptrs, mask=col_ok[:, None], other=0.0), DOT_MODE, True)
                else:
                    q = _dot_operand(tl.load(q_ptrs, mask=col_ok[:, None], other=0.0), DOT_MODE)
            w = tl.load(w_ptr + (b64 * next_n + col_tok) * stride_wm + col_head * stride_wh,
                        mask=col_ok, other=0.0).to(tl.float32)
            bt_row = bt_ptr + b64 * stride_btb
            out_row = out_ptr + ((b64 * next_n + tok) * stride_om)[None, :]
            if SCALES_AHEAD:
                # Software prefetch of the per-key scales one tile ahead (block-table entries two
                # ahead), so the scale load is off the critical path of the tile's epilogue.
                phys_a, off_a = _rows(bt_row, t * BLOCK_N, rn, kv_len, block_size, BS, BLOCK_N)
                ksc_next = tl.load(kvs_ptr + phys_a * stride_blk_f + scale_base + off_a,
                                   mask=t * BLOCK_N + rn < kv_len, other=0.0)
                phys_next, off_next = _rows(bt_row, (t + 1) * BLOCK_N, rn, kv_len, block_size, BS, BLOCK_N)
            if K_AHEAD:
                # Decoded ahead (sm_80/86: see _k_operand): the first tile here, each next one after the
                # current tile's MMA, so the loop carries the 16-bit operand and its gathers overlap the MMA.
                phys_k, off_k = _rows(bt_row, t * BLOCK_N, rn, kv_len, block_size, BS, BLOCK_N)
                k_next = _k_operand(tl.load(kvv_ptr + (phys_k * stride_blk + off_k * D)[:, None] + d[None, :],
                                            mask=(t * BLOCK_N + rn < kv_len)[:, None], other=0.0), DOT_MODE)
            for tt in range(t, t_end):
                n = tt * BLOCK_N + rn
                n_ok = n < kv_len
                phys, off = _rows(bt_row, tt * BLOCK_N, rn, kv_len, block_size, BS, BLOCK_N)
                if K_AHEAD:
                    k = k_next
                    phys_k, off_k = _rows(bt_row, (tt + 1) * BLOCK_N, rn, kv_len, block_size, BS, BLOCK_N)
                    raw_next = tl.load(kvv_ptr + (phys_k * stride_blk + off_k * D)[:, None] + d[None, :],
                                       mask=(n + BLOCK_N < kv_len)[:, None], other=0.0)
                else:
                    k = tl.load(kvv_ptr + (phys * stride_blk + off * D)[:, None] + d[None, :],
                                mask=n_ok[:, None], other=0.0)
                if SCALES_AHEAD:
                    ksc = ksc_next
                    ksc_next = tl.load(kvs_ptr + phys_next * stride_blk_f + scale_base + off_next,
                                       mask=n + BLOCK_N < kv_len, other=0.0)
                    phys_next, off_next = _rows(bt_row, (tt + 2) * BLOCK_N, rn, kv_len, block_size, BS,
                                                BLOCK_N)
                else:
                    ksc = tl.load(kvs_ptr + phys * stride_blk_f + scale_base + off, mask=n_ok,
                                  other=0.0)
                if HOIST_Q:
                    qd = q
                else:         # sm_80/86: reloaded per tile (L1/L2 hit), registers go to the decoder
                    qd = _dot_operand(tl.load(q_ptrs, mask=col_ok[:, None], other=0.0), DOT_MODE)
                logits = _score_tile(k, qd, w, DOT_MODE, BLOCK_N, T, HP, K_AHEAD) * ksc[:, None]
                logits = tl.where(n[:, None] < vis[None, :], logits, float("-inf"))
                tl.store(out_row + n[:, None], logits,
                         mask=(n < max_model_len)[:, None] & tok_ok[None, :])
                if K_AHEAD:
                    k_next = _k_operand(raw_next, DOT_MODE)
            todo -= t_end - t
            b += 1
            t = t * 0
    else:
        # One work item per iteration (sm_80/86/89/120: the register profile the cross-compile
        # test proves spill-free there).
        for _ in range(w_start, w_end):
            vis = tl.load(cl_ptr + b * stride_cb + tok * stride_cj, mask=tok_ok, other=0) + vis_shift
            vis = tl.where(tok_ok, tl.minimum(vis, max_model_len), 0)
            kv_len = tl.max(vis, axis=0)
            q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + col_tok[:, None] * stride_qn
                        + col_head[:, None] * stride_qh + d[None, :], mask=col_ok[:, None], other=0.0)
            q = _dot_operand(q, DOT_MODE)
            wrow = b.to(tl.int64) * next_n + col_tok
            w = tl.load(w_ptr + wrow * stride_wm + col_head * stride_wh, mask=col_ok,
                        other=0.0).to(tl.float32)

            n = t * BLOCK_N + rn
            n_ok = n < kv_len
            phys, off = _rows(bt_ptr + b.to(tl.int64) * stride_btb, t * BLOCK_N, rn, kv_len, block_size, BS,
                              BLOCK_N)
            k = tl.load(kvv_ptr + (phys * stride_blk + off * D)[:, None] + d[None, :],
                        mask=n_ok[:, None], other=0.0)
            ksc = tl.load(kvs_ptr + phys * stride_blk_f + scale_base + off, mask=n_ok, other=0.0)
            logits = _score_tile(k, q, w, DOT_MODE, BLOCK_N, T, HP) * ksc[:, None]
            logits = tl.where(n[:, None] < vis[None, :], logits, float("-inf"))
            orow = b.to(tl.int64) * next_n + tok
            tl.store(out_ptr + orow[None, :] * stride_om + n[:, None], logits,
                     mask=(n < max_model_len)[:, None] & tok_ok[None, :])

            # Advance to the next item; every request owns at least one.
            len_b = tl.where(clean != 0, max_model_len, kv_len)
            t += 1
            nxt = t >= tl.maximum(tl.cdiv(len_b, BLOCK_N), 1)
            b = tl.where(nxt, b + 1, b)
            t = tl.where(nxt, 0, t)


# --------------------------------------------------------------------------------------------------
# Launch configuration
# --------------------------------------------------------------------------------------------------


# Kernels decorated while TRITON_INTERPRET=1 was set run on the CPU (Triton reads it at decoration).
# The interpreter's bf16 dot is wrong (Triton 3.6 + numpy 2.x), so the kernels then multiply in fp32
# (DOT_FP32).
INTERPRETED = type(_mqa_logits_kernel).__name__ == "InterpretedFunction"

# Host launch cost: cached CompiledKernels launched past Triton's JIT entry (overlay/kernels/launch.py).
_prefill_launch = _Launcher(_mqa_logits_kernel)
_decode_launch = _Launcher(_paged_mqa_logits_kernel)
_decode_gluon_launch = _Launcher(_paged_mqa_logits_sm90_kernel) if _GLUON else None
LAUNCHERS = [_prefill_launch, _decode_launch] + ([_decode_gluon_launch] if _GLUON else [])
# The sm_90 Gluon decode kernel (indexer_sm90.py) where decode_config picks it; DSA_OVERLAY_GLUON=0 (the switch the
# Gluon attention tile reads too) keeps the Triton kernel everywhere.
GLUON_DEFAULT = _GLUON and not INTERPRETED and _gluon_wanted()
# fp8_paged_mqa_logits plans a call once per (shapes, strides, dtypes, devices, lengths) key, as
# sparse_mla_attention does (see there): on where every launcher launches directly.
_PAGED_PLANS = PlanTable(LAUNCHERS)
_PREFILL_PLANS = PlanTable(LAUNCHERS)  # fp8_mqa_logits: the same, keyed on shapes, strides, dtypes and max_seqlen_k

MAX_HEADS = 128
SUPPORTED_CAPABILITIES = ((8, 0), (8, 6), (8, 9), (9, 0), (12, 0))


@dataclass(frozen=True)
class PrefillConfig:
    """Launch configuration of the prefill kernel (`fp8_mqa_logits`).  Upper-case fields are the
    kernel's constexprs of the same name.

    HP: index heads padded to a power of two >= 16 (masked); BT: query tokens per program, so one
    MMA is [BLOCK_N, D] x [D, BT * HP]; BLOCK_N: keys per tile; DOT_MODE: how the MMA multiplies
    (DOT_FP8 / DOT_BF16 / DOT_FP32 / DOT_BYTES_FP32); num_warps, num_stages: Triton launch options;
    splits: programs over the keys (None: the launcher aims for 4 programs per SM); COMPRESS: row-compressed
    output (`max_seqlen_k=`, vLLM 0.33.0 on); K_AHEAD: each next key tile decoded ahead (DecodeConfig; sm_80/86);
    Q_OPAQUE: as DecodeConfig's.
    """

    HP: int
    BT: int
    BLOCK_N: int
    DOT_MODE: int
    num_warps: int
    num_stages: int
    splits: int | None = None
    COMPRESS: bool = False
    K_AHEAD: bool = False
    Q_OPAQUE: bool = False

    def constexprs(self) -> dict:
        """The kernel's constexpr arguments (but D)."""
        return dict(HP=self.HP, BT=self.BT, BLOCK_N=self.BLOCK_N, DOT_MODE=self.DOT_MODE,
                    COMPRESS=bool(self.COMPRESS), K_AHEAD=bool(self.K_AHEAD), Q_OPAQUE=bool(self.Q_OPAQUE))


@dataclass(frozen=True)
class DecodeConfig:
    """Launch configuration of the paged decode kernel (`fp8_paged_mqa_logits`).  Upper-case fields
    are the kernel's constexprs of the same name.

    HP: padded index heads; T: query tokens per launch (next_n > T runs as several launches);
    BLOCK_N: keys per tile; BLOCK_B: requests counted per step of the work split; DOT_MODE: as
    PrefillConfig; SCALES_AHEAD: prefetch each tile's key scales one tile ahead; HOIST_Q: keep a
    request's query operand in registers for all its tiles; NESTED: walk request by request with a
    pipelined inner tile loop (else one work item per iteration); num_warps, num_stages: Triton
    launch options; per_sm: persistent programs per SM; programs: an explicit program count instead;
    GLUON: the sm_90 Gluon kernel (indexer_sm90.py: NESTED's walk with the next tile's wgmma over this
    one's epilogue; num_stages is its number of key buffers; T * HP <= 128, 4 warps, DOT_FP8); maxnreg:
    ptxas's register cap per thread (None: its own choice), so that more programs are resident per SM;
    CONST_BS: compile the cache's block size in (its divisions become shifts, and the Gluon kernel reads one
    block-table entry per tile where a tile lies in one block; one binary per block size), else read it at run time;
    on by default everywhere but sm_90's flat walk (H100: 6-30% at batch 128 on sm_90's picks, 1.1-1.3x on the
    mma.sync targets' picks built for mma.sync; bench/RESULTS.md, stops 35 and 37); K_AHEAD (NESTED only): load each
    next key tile at the top of an iteration and turn it into the MMA operand after this one's MMA, so the loop
    carries the 16-bit operand (sm_80/86: decoded by e4m3.e4m3_as_f16_bits, half the loop's instructions of decoding
    a tile loaded in the same iteration; bench/RESULTS.md, stop 48); Q_OPAQUE (DOT_BF16, HOIST_Q): decode the query
    with e4m3.e4m3_as_f16_bits declared impure, so the MMA operands are laid out as 16-bit ones (kWidth 2) instead of
    as the 8-bit load behind the query (kWidth 4); cross-compiled for sm_80 with K_AHEAD it cuts another 24-44% of the
    inner loop's instructions per key, not yet timed, so off by default (stop 48).
    """

    HP: int
    T: int
    BLOCK_N: int
    BLOCK_B: int
    DOT_MODE: int
    SCALES_AHEAD: bool
    HOIST_Q: bool
    NESTED: bool
    num_warps: int
    num_stages: int
    per_sm: int
    programs: int | None = None
    GLUON: bool = False
    maxnreg: int | None = None
    CONST_BS: bool = False
    K_AHEAD: bool = False
    Q_OPAQUE: bool = False

    def constexprs(self) -> dict:
        """The kernel's constexpr arguments (but D)."""
        if self.GLUON:
            return dict(HP=self.HP, T=self.T, BLOCK_N=self.BLOCK_N, BLOCK_B=self.BLOCK_B, NUM_BUF=self.num_stages)
        return dict(HP=self.HP, T=self.T, BLOCK_N=self.BLOCK_N, BLOCK_B=self.BLOCK_B,
                    DOT_MODE=self.DOT_MODE, SCALES_AHEAD=bool(self.SCALES_AHEAD),
                    HOIST_Q=bool(self.HOIST_Q), NESTED=bool(self.NESTED), K_AHEAD=bool(self.K_AHEAD),
                    Q_OPAQUE=bool(self.Q_OPAQUE))


@dataclass(frozen=True)
class PrefillTuning:
    """Prefill tuning-table entry of a GPU family: MMA columns (BT * HP) to aim for, the key tile and
    the launch options."""

    mma_cols: int
    block_n: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class DecodeTuning:
    """Decode tuning-table entry of a GPU family: the most MMA columns (T * HP), the key tile (and the
    larger one used when the batch fills every program with it), the launch options and the
    persistent programs per SM."""

    max_mma_cols: int
    block_n: int
    block_n_large: int
    num_warps: int
    num_stages: int
    programs_per_sm: int
    programs_per_sm_t2: int   # with T = 2 query tokens per program (next_n >= 2: MTP speculative decoding)


def dot_mode_for_capability(capability) -> int:
    """DOT_FP8 on sm_89 and newer (fp8 MMA), DOT_BF16 on sm_80/86; `capability` is (major, minor)
    or None for the interpreter (DOT_FP32; DOT_BYTES_FP32 is chosen only by tests)."""
    if capability is None:
        return DOT_FP32
    return DOT_FP8 if tuple(capability) >= (8, 9) else DOT_BF16


def _next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def _padded_heads(heads: int) -> int:
    return max(16, _next_pow2(heads))


# Tuning tables, keyed by GPU family (see _family).  "hopper" is measured on the H200 (GLM-5 shapes,
# bench/bench_indexer.py and its --focus mode); the other families keep tiles the cross-compile test
# (tests/kernels/test_indexer_xcompile.py) proves spill-free, not tuned on their GPUs (the walk and CONST_BS were
# chosen on an H100 built for mma.sync, decode_config).
# tile choice measured: bench/RESULTS.md#tuning-notes-moved-from-the-kernel-sources
PREFILL_TUNING: dict[str, PrefillTuning] = {
    "hopper": PrefillTuning(mma_cols=256, block_n=64, num_warps=4, num_stages=4),
    "fp8": PrefillTuning(mma_cols=128, block_n=64, num_warps=8, num_stages=3),    # mma.sync, 99 KB smem
    "bf16": PrefillTuning(mma_cols=128, block_n=64, num_warps=8, num_stages=3),   # e4m3 decoded in registers
    "interp": PrefillTuning(mma_cols=128, block_n=64, num_warps=8, num_stages=3),
}
DECODE_TUNING: dict[str, DecodeTuning] = {
    "hopper": DecodeTuning(max_mma_cols=256, block_n=64, block_n_large=128, num_warps=4, num_stages=3,
                           programs_per_sm=4, programs_per_sm_t2=8),
    "fp8": DecodeTuning(max_mma_cols=128, block_n=64, block_n_large=64, num_warps=4, num_stages=3,
                        programs_per_sm=4, programs_per_sm_t2=4),
    # 4 warps since the key tiles are decoded ahead (K_AHEAD): fewer instructions per key than 8 at every shape (sm_80,
    # 32 heads x 1 / 2 tokens: 36.4 / 51.8 against 38.4 / 66.9), no spills where 8 warps spill (sm_86, 32 heads x 2
    # tokens: 24 B); up to 168 registers, so three programs resident per SM. Timed on the H100 built for mma.sync
    # (bench/RESULTS.md, stop 48): 1.6-2.3x faster than the 8-warp walk without K_AHEAD at batch >= 8; with K_AHEAD at
    # 8 warps (two programs per SM) 1.1-1.35x slower than at 4
    "bf16": DecodeTuning(max_mma_cols=64, block_n=64, block_n_large=64, num_warps=4, num_stages=3,
                         programs_per_sm=3, programs_per_sm_t2=3),
    "interp": DecodeTuning(max_mma_cols=256, block_n=64, block_n_large=64, num_warps=4, num_stages=3,
                           programs_per_sm=4, programs_per_sm_t2=4),
}


# The sm_90 Gluon decode kernel's launch per (T, HP): key tile, key buffers (num_stages), programs per SM, register
# cap. Measured on an H100 with the block size compiled in (CONST_BS; vLLM 0.26.0's DeepGEMM in the same run,
# bench_indexer.py --focus, 2026-12-05, bench/RESULTS.md stop 35), ctx 16K, B = 32 / 128: two tokens x 32 heads (GLM-5
# with MTP) 40.3 / 120.4 us against the Triton kernel's 45.6 / 133.5 (DeepGEMM 36.0 / 111.5); two tokens x 64 heads
# (DeepSeek-V3.2 with MTP), 4 key buffers and 2 programs per SM, 46.8 / 144.3 against 53.9 / 167.8 (DeepGEMM
# 36.5 / 113.6; capped at 168 registers for three programs per SM it ran 45.5 / 146.0 but spills with Triton's
# ptxas). One token: the Triton kernel is 3-12% faster from batch 8 on, the Gluon kernel 12-18% at batch 1 (32 and
# 64 heads; also before CONST_BS, on the H100 and the H200): DECODE_GLUON_BATCH1.
_GLUON_DECODE = DecodeConfig(HP=64, T=1, BLOCK_N=64, BLOCK_B=128, DOT_MODE=DOT_FP8, SCALES_AHEAD=False,
                             HOIST_Q=True, NESTED=True, num_warps=4, num_stages=3, per_sm=3, GLUON=True,
                             CONST_BS=True)
DECODE_GLUON: dict[tuple[int, int], DecodeConfig] = {
    (2, 32): replace(_GLUON_DECODE, T=2, HP=32),
    (2, 64): replace(_GLUON_DECODE, T=2, HP=64, num_stages=4, per_sm=2),
}
DECODE_GLUON_BATCH1: dict[tuple[int, int], DecodeConfig] = {
    (1, 32): replace(_GLUON_DECODE, HP=32),
    (1, 64): _GLUON_DECODE,
}


def _family(capability) -> str:
    """Tuning-table family of a (major, minor) capability, by how the MMA multiplies: "hopper" (sm_90,
    wgmma), "fp8" (sm_89 / sm_12x, fp8 mma.sync), "bf16" (sm_80 / sm_86, e4m3 decoded to bf16),
    "interp" (None: the interpreter)."""
    if capability is None:
        return "interp"
    if dot_mode_for_capability(capability) == DOT_BF16:
        return "bf16"
    return "hopper" if tuple(capability)[0] == 9 else "fp8"


@functools.cache
def prefill_config(capability, heads: int) -> PrefillConfig:
    """Tile choice of the prefill kernel for a device of `capability` ((major, minor), or None for
    the interpreter) and `heads` index heads.  BT query tokens share each key tile, so one MMA is
    [BLOCK_N, D] x [D, BT * HP] with HP the padded head count (at most MAX_HEADS).  Cached (the
    result is frozen).  sm_80/86 decode each key tile ahead (K_AHEAD; cross-compiled for sm_80, 32 / 64 heads: 41.5 /
    74.6 -> 26.2 / 44.6 loop instructions per key and token; at 128 heads it spills 16 B; on the fp8 MMA targets it
    only adds conversions)."""
    hp = _padded_heads(heads)
    fam = _family(capability)
    tune = PREFILL_TUNING[fam]
    return PrefillConfig(HP=hp, BT=max(1, min(8, tune.mma_cols // hp)), BLOCK_N=tune.block_n,
                         DOT_MODE=dot_mode_for_capability(capability), num_warps=tune.num_warps,
                         num_stages=tune.num_stages, K_AHEAD=fam == "bf16" and hp <= 64)


@functools.cache
def decode_config(capability, heads: int, next_n: int, batch: int | None = None,
                  max_len: int | None = None, num_sms: int | None = None, *,
                  gluon: bool | None = None) -> DecodeConfig:
    """Tile choice of the paged decode kernel: T query tokens of one request (1 or 2, what vLLM
    passes natively; a larger next_n runs as several launches of T tokens) against BLOCK_N cached
    keys, with the requests' work counted BLOCK_B at a time, on `per_sm` * SMs persistent programs.
    Cached (the result is frozen).

    The key tile grows (fewer, larger tiles: less per-tile overhead, more bytes in flight) when the
    batch could fill every program with large tiles: batch * cdiv(max_len, BLOCK_N_large) >=
    programs.  The context lengths live on the GPU (CUDA graphs), so `max_len` is the launch's
    max_model_len, an upper bound; batch=None picks the large tile.

    On sm_90 the Gluon kernel's config where it has one for (T, HP) (DECODE_GLUON; at batch 1 also
    DECODE_GLUON_BATCH1) and ``gluon`` (default GLUON_DEFAULT) allows it."""
    hp = _padded_heads(heads)
    fam = _family(capability)
    tune = DECODE_TUNING[fam]
    # Register budget (no spills, checked by the cross-compile test): sm_80/86 decode e4m3 in
    # registers, sm_89/120 keep the mma.sync accumulator there; Hopper's wgmma affords more.
    t = max(1, min(_next_pow2(next_n), 2, tune.max_mma_cols // hp))
    block_n = 32 if fam == "bf16" and t * hp > 64 else tune.block_n
    if tune.block_n_large > tune.block_n and block_n == tune.block_n and t * hp <= 128:
        big_enough = (batch is None or max_len is None or num_sms is None
                      or batch * -(-int(max_len) // tune.block_n_large) >= tune.programs_per_sm * num_sms)
        block_n = tune.block_n_large if big_enough else block_n
    # The per-request walk (q hoisted, pipelined tile loop) where it fits the registers (no spills, cross-compiled)
    # and was faster (H100, the mma.sync build standing in for sm_80-sm_120; bench/RESULTS.md, stop 37): sm_90 up
    # to 128 MMA columns, the fp8 mma.sync targets from 64 to 128 (1.05-1.1x faster; at 32 columns 3-12% slower),
    # sm_80/86 from 32 heads (1.3-1.6x at batch >= 32, 1.2x at batch 1); else the flat one-item-per-iteration loop.
    # sm_80/86 decode each key tile ahead (K_AHEAD): cross-compiled, half the loop's instructions per key or less
    # (sm_80, 32 heads x 1 / 2 tokens: 73.5 / 137.8 -> 38.4 / 66.9; 16 heads: the nested walk then spills nothing, and
    # 101 -> 33 against the flat walk; bench/RESULTS.md, stop 48), so they take the nested walk at every head count.
    nested = (fam in ("interp", "bf16") or (fam == "hopper" and t * hp <= 128)
              or (fam == "fp8" and 64 <= t * hp <= 128))
    # Scale prefetch with the large tile only (it loses with the small one).
    # measured: bench/RESULTS.md#tuning-notes-moved-from-the-kernel-sources
    ahead = fam == "hopper" and nested and block_n == tune.block_n_large
    if fam == "hopper" and (GLUON_DEFAULT if gluon is None else gluon):
        if (t, hp) in DECODE_GLUON:
            return DECODE_GLUON[(t, hp)]
        if batch == 1 and (t, hp) in DECODE_GLUON_BATCH1:
            return DECODE_GLUON_BATCH1[(t, hp)]
    per_sm = tune.programs_per_sm_t2 if t == 2 else tune.programs_per_sm
    if fam == "hopper" and t * hp > 64:
        # 128 MMA columns: the [BLOCK_N, 128] fp32 scores take the tile to 253 registers, two programs resident per
        # SM; more programs only queue (H100, 64 heads x 2 tokens: 175.5 us at 2 per SM, 189.7 at 8)
        per_sm = 2
    return DecodeConfig(HP=hp, T=t, BLOCK_N=block_n, BLOCK_B=128, DOT_MODE=dot_mode_for_capability(capability),
                        SCALES_AHEAD=ahead, HOIST_Q=nested, NESTED=nested, num_warps=tune.num_warps,
                        num_stages=tune.num_stages, per_sm=per_sm,
                        CONST_BS=fam in ("fp8", "bf16") or (fam == "hopper" and nested), K_AHEAD=fam == "bf16")


def launch_configs(capability) -> list[tuple[str, PrefillConfig | DecodeConfig]]:
    """Every (kernel name, config) the launchers can pick on `capability`: all head counts up to
    MAX_HEADS, every next_n (next_n > 2 reuses T = 2), small and large decode tiles, and on sm_90
    the scale-prefetching decode variant (SCALES_AHEAD; the default there for the large tile).  Used
    by the cross-compile test to check shared memory and spills.  Prefill comes in both output layouts
    (full rows, and COMPRESS for vLLM 0.33.0's row-compressed logits)."""
    out = []
    hp = 16
    while hp <= MAX_HEADS:
        pre = prefill_config(capability, hp)
        cands = [("prefill", pre), ("prefill", replace(pre, COMPRESS=True))]
        for n in (1, 2):
            for batch in (1, None):
                cfg = decode_config(capability, hp, n, batch, 1, 1)
                cands.append(("decode", cfg))
                if cfg.NESTED and _family(capability) == "hopper":   # spills elsewhere
                    cands.append(("decode", replace(cfg, SCALES_AHEAD=True)))
        for c in cands:
            if c not in out:
                out.append(c)
        hp *= 2
    return out


def _with_overrides(cfg, overrides):
    """`cfg` with the `_config` test/benchmark overrides applied (a dict of field values, or a whole
    config of the same kind)."""
    if not overrides:
        return cfg
    if isinstance(overrides, type(cfg)):
        return overrides
    return replace(cfg, **overrides)


@functools.cache
def _cuda_info(device_index: int) -> tuple[tuple[int, int], int]:
    props = torch.cuda.get_device_properties(device_index)
    return (props.major, props.minor), props.multi_processor_count


def _device_info(device: torch.device):
    """(capability or None, number of SMs) the tables are read for on `device`; the interpreter
    plans for 4 SMs."""
    if INTERPRETED:
        return None, 4
    if device.type != "cuda":
        _fail(f"tensors are on {device}; the Triton indexer needs CUDA tensors (or "
              "TRITON_INTERPRET=1 set before this module is imported, for CPU tests)")
    return _cuda_info(device.index if device.index is not None else torch.cuda.current_device())


# --------------------------------------------------------------------------------------------------
# Input checks
# --------------------------------------------------------------------------------------------------

_FP8 = torch.float8_e4m3fn
_PACKED_FP4 = (torch.int8, torch.uint8)


def _cdiv(a: int, b: int) -> int:
    """triton.cdiv without its per-call JIT-callable overhead (host launch path)."""
    return -(-a // b)


def _fail(msg: str):
    raise ValueError(f"dsa-overlay indexer: {msg}")


def _fp4_unsupported(what: str):
    raise NotImplementedError(
        f"dsa-overlay indexer: {what} is MXFP4; the Triton indexer implements the fp8 path only. "
        "Run without the FP4 indexer cache (attention_config.use_fp4_indexer_cache=False).")


def _result(out, shape, device) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=torch.float32, device=device)
    if not (tuple(out.shape) == tuple(shape) and out.dtype == torch.float32 and out.stride(1) == 1):
        _fail(f"_out must be {list(shape)} float32 with contiguous rows, got {tuple(out.shape)} "
              f"{out.dtype}")
    return out


def _unpack_q(q, name: str) -> torch.Tensor:
    """0.23.0 passes q as (values, scales_or_None); None scales means the fp8 path."""
    if isinstance(q, (tuple, list)):
        if len(q) != 2:
            _fail(f"{name} must be (values, scales) or a tensor")
        values, scales = q
        if scales is not None or values.dtype in _PACKED_FP4:
            _fp4_unsupported(name)
        return values
    return q


# --------------------------------------------------------------------------------------------------
# Prefill
# --------------------------------------------------------------------------------------------------


def fp8_mqa_logits(
    q: torch.Tensor,
    kv: tuple[torch.Tensor, torch.Tensor],
    weights: torch.Tensor,
    cu_seqlen_ks: torch.Tensor,
    cu_seqlen_ke: torch.Tensor,
    clean_logits: bool,
    *,
    max_seqlen_k: int | None = None,
    _config: dict | PrefillConfig | None = None,
    _out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Indexer logits of M query tokens against N contiguous keys (prefill; DeepGEMM drop-in).

    Args:
        q: [M, H, D] torch.float8_e4m3fn, D = 128; any H >= 1.  Query token m, index head h.
            The last dimension must be contiguous.
        kv: (k, k_scales). k: [N, D] torch.float8_e4m3fn, rows may be strided, last dim contiguous;
            k_scales: [N] (or [N, 1]) torch.float32, the positive dequantisation scale of key n.
        weights: [M, H] float32 (bf16/fp16 accepted), head weights of each query token (vLLM folds
            the query's own scale and softmax scale in here).
        cu_seqlen_ks: [M] int32, first key (inclusive) query m may see.
        cu_seqlen_ke: [M] int32, end key (exclusive) query m may see.  Ranges may be empty
            (ks >= ke); they are clipped to [0, N).
        clean_logits: True: every position outside [ks[m], ke[m]) is -inf.  False (what vLLM
            passes): positions outside the range are unspecified (vLLM's top-k reads only the range).
        max_seqlen_k: None, or DeepGEMM's row-compressed layout (vLLM 0.33.0 on): the result is
            [M, max_seqlen_k], row m holds keys [ks[m], ke[m]) from column 0 and the rest of the row
            is unspecified; every range must fit (ke - ks <= max_seqlen_k; longer ones are cut).
            clean_logits must be False then.

    Returns:
        logits: [M, N] float32, logits[m, n] = k_scales[n] * sum_h weights[m, h] *
        relu(q[m, h] . k[n]) for ks[m] <= n < ke[m] (compressed: logits[m, n - ks[m]]).

    `_config` (a PrefillConfig, or a dict of its fields to override in the default) and `_out` (a
    preallocated [M, N] or [M, max_seqlen_k] float32 result) are for tests and benchmarks.
    """
    key = _prefill_key(q, kv, weights, cu_seqlen_ks, cu_seqlen_ke, clean_logits, max_seqlen_k, _config, _out)
    plan = _PREFILL_PLANS.get(key)
    if plan is None:  # checks every argument; a repeat call with the same key (every layer of a chunk) reuses it
        plan = _PREFILL_PLANS.keep(key, _PrefillPlan(q, kv, weights, cu_seqlen_ks, cu_seqlen_ke, clean_logits,
                                                     max_seqlen_k, _config, _out))
    return plan.run(q, kv, weights, cu_seqlen_ks, cu_seqlen_ke, _out)


def _prefill_key(q, kv, weights, ks, ke, clean_logits, max_seqlen_k, config, out):
    if not _PREFILL_PLANS.on or config is not None:
        return None
    try:
        k, k_scales = kv
        key = (*map(_tensor_key, (q, k, k_scales, weights, ks, ke, out)), bool(clean_logits),
               None if max_seqlen_k is None else int(max_seqlen_k))
    except (AttributeError, TypeError, ValueError):  # not tensors: no plan (the checks say what is wrong)
        return None
    return key


class _PrefillPlan:
    """One fp8_mqa_logits call's checked arguments and launch (one per distinct shape: in vLLM every layer of a
    prefill chunk repeats the first layer's call)."""

    def __init__(self, q, kv, weights, cu_seqlen_ks, cu_seqlen_ke, clean_logits, max_seqlen_k, config, out):
        k, k_scales = kv
        if q.dim() != 3:
            _fail(f"q must be [M, H, D], got shape {tuple(q.shape)}")
        M, H, D = q.shape
        if D != HEAD_DIM:
            _fail(f"q head dim must be {HEAD_DIM}, got {D}")
        if not (1 <= H <= MAX_HEADS):
            _fail(f"q must have 1..{MAX_HEADS} index heads, got {H}")
        if q.dtype in _PACKED_FP4 or k.dtype in _PACKED_FP4:
            _fp4_unsupported("q" if q.dtype in _PACKED_FP4 else "kv")
        if q.dtype != _FP8:
            _fail(f"q must be torch.float8_e4m3fn, got {q.dtype}")
        if k.dtype != _FP8:
            _fail(f"kv[0] (k) must be torch.float8_e4m3fn, got {k.dtype}")
        if not (k.dim() == 2 and k.shape[1] == D):
            _fail(f"kv[0] (k) must be [N, {D}], got {tuple(k.shape)}")
        N = k.shape[0]
        k_scales = k_scales.reshape(-1)
        if not (k_scales.numel() == N and k_scales.dtype == torch.float32):
            _fail(f"kv[1] (k_scales) must be [N={N}] float32, got {tuple(k_scales.shape)} {k_scales.dtype}")
        if weights.shape != (M, H):
            _fail(f"weights must be [M={M}, H={H}], got {tuple(weights.shape)}")
        if not (cu_seqlen_ks.shape == (M,) and cu_seqlen_ke.shape == (M,)):
            _fail(f"cu_seqlen_ks/cu_seqlen_ke must be [M={M}], got {tuple(cu_seqlen_ks.shape)} "
                  f"and {tuple(cu_seqlen_ke.shape)}")
        wrong = _off_device(q.device, k=k, k_scales=k_scales, weights=weights, cu_seqlen_ks=cu_seqlen_ks,
                            cu_seqlen_ke=cu_seqlen_ke, out=out)
        if wrong:
            _fail(f"{wrong} (q's device): every tensor of a call must be on one device")
        if max_seqlen_k is not None:
            if clean_logits:
                _fail("clean_logits=True has no meaning with max_seqlen_k (the compressed rows' tails are "
                      "never read)")
            if int(max_seqlen_k) < 0:
                _fail(f"max_seqlen_k must be >= 0, got {max_seqlen_k}")
        # what a call copies or converts (fixed by the key's strides and dtypes)
        self.copy_q, self.copy_k = q.stride(2) != 1, k.stride(1) != 1
        self.copy_ks = not k_scales.is_contiguous()
        self.int_ks = not (cu_seqlen_ks.dtype == torch.int32 and cu_seqlen_ks.is_contiguous())
        self.int_ke = not (cu_seqlen_ke.dtype == torch.int32 and cu_seqlen_ke.is_contiguous())
        width = N if max_seqlen_k is None else int(max_seqlen_k)
        self.shape = (M, width)
        if out is not None:
            _result(out, self.shape, q.device)
        self.empty = M == 0 or N == 0 or width == 0
        if self.empty:
            return
        q_strides = _contiguous_strides(q) if self.copy_q else q.stride()  # what the call's copy will have
        k_stride = _contiguous_strides(k)[0] if self.copy_k else k.stride(0)
        capability, num_sms = _device_info(q.device)
        cfg = _with_overrides(prefill_config(capability, H), config)
        if max_seqlen_k is not None:
            cfg = replace(cfg, COMPRESS=True)
        bn, bt = cfg.BLOCK_N, cfg.BT
        m_groups = _cdiv(M, bt)
        n_tiles = _cdiv(N, bn)
        splits = cfg.splits or max(1, min(n_tiles, _cdiv(4 * num_sms, m_groups)))
        n_per_split = _cdiv(n_tiles, splits) * bn
        splits = _cdiv(N, n_per_split)
        self.u8 = cfg.DOT_MODE in (DOT_BF16, DOT_BYTES_FP32)  # sm_80/86 Triton has no e4m3 type: raw bytes
        out_stride = width if out is None else out.stride(0)
        self.grid = (m_groups, splits)
        self.ints = (M, N, H, q_strides[0], q_strides[1], k_stride, weights.stride(0), weights.stride(1),
                     out_stride, n_per_split, int(bool(clean_logits)), width)
        self.kw = dict(D=D, **cfg.constexprs(), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                       **_pdl_kwargs(capability))
        self.kept = _Kept(_prefill_launch)

    def run(self, q, kv, weights, cu_seqlen_ks, cu_seqlen_ke, out):
        logits = torch.empty(self.shape, dtype=torch.float32, device=q.device) if out is None else out
        if self.empty:
            return logits
        k, k_scales = kv
        k_scales = k_scales.reshape(-1)
        if self.copy_q:
            q = q.contiguous()
        if self.copy_k:
            k = k.contiguous()
        if self.copy_ks:
            k_scales = k_scales.contiguous()
        ks = cu_seqlen_ks.to(torch.int32).contiguous() if self.int_ks else cu_seqlen_ks
        ke = cu_seqlen_ke.to(torch.int32).contiguous() if self.int_ke else cu_seqlen_ke
        if self.u8:
            q, k = q.view(torch.uint8), k.view(torch.uint8)
        t = (q, k, k_scales, weights, ks, ke, logits)
        self.kept(self.grid, t, t + self.ints, self.kw)
        return logits


def fp8_fp4_mqa_logits(
    q: tuple[torch.Tensor, torch.Tensor | None],
    kv: tuple[torch.Tensor, torch.Tensor],
    weights: torch.Tensor,
    cu_seqlen_ks: torch.Tensor,
    cu_seqlen_ke: torch.Tensor,
    clean_logits: bool = False,
    *,
    max_seqlen_k: int | None = None,
) -> torch.Tensor:
    """vLLM 0.23.0 name of `fp8_mqa_logits`: q is (q_values [M, H, D] float8_e4m3fn, None).

    A packed MXFP4 query (int8/uint8 values, or a non-None q scale) or MXFP4 keys raise
    NotImplementedError.  Everything else as `fp8_mqa_logits` (`max_seqlen_k`: vLLM 0.33.0's
    row-compressed result).
    """
    return fp8_mqa_logits(_unpack_q(q, "q"), kv, weights, cu_seqlen_ks, cu_seqlen_ke, clean_logits,
                          max_seqlen_k=max_seqlen_k)


# --------------------------------------------------------------------------------------------------
# Paged decode
# --------------------------------------------------------------------------------------------------


def get_paged_mqa_logits_metadata(context_lens: torch.Tensor, block_size: int,
                                  num_sms: int) -> torch.Tensor:
    """Scheduling metadata slot for `fp8_paged_mqa_logits` (DeepGEMM drop-in).

    Args:
        context_lens: [B] or [B, next_n] int32 context lengths (only its device is used).
        block_size: cache block size in tokens (unused).
        num_sms: number of SMs vLLM sized its metadata buffer for.

    Returns:
        zeros [num_sms + 1, 2] int32 on context_lens' device: the shape of vLLM's
        `scheduler_metadata_buffer`, which assigns this result in place.  The Triton decode kernel
        balances its work itself and ignores the value, so a stale or never-filled buffer (vLLM
        0.23.0 fills it only when DeepGEMM is installed) is harmless.
    """
    return torch.zeros((int(num_sms) + 1, 2), dtype=torch.int32, device=context_lens.device)


def _check_paged_cache(kv_cache: torch.Tensor, D: int):
    """(block_size, bytes per block) of a paged indexer cache, after checking its layout."""
    if kv_cache.dtype != torch.uint8:
        _fail(f"kv_cache must be torch.uint8, got {kv_cache.dtype}")
    if kv_cache.dim() == 4:
        if kv_cache.shape[2] != 1:
            _fail(f"kv_cache must be [num_blocks, block_size, 1, {D + 4}], "
                  f"got {tuple(kv_cache.shape)}")
    shape, strides = tuple(kv_cache.shape), kv_cache.stride()
    if len(shape) == 4:  # drop the size-1 head axis without a torch op (host launch path)
        shape, strides = shape[:2] + shape[3:], strides[:2] + strides[3:]
    if len(shape) != 3:
        _fail(f"kv_cache must be [num_blocks, block_size, 1, {D + 4}], got "
              f"{tuple(kv_cache.shape)}")
    nb, block_size, width = shape
    if width == D // 2 + D // 32:
        _fp4_unsupported("kv_cache")
    if width != D + 4:
        _fail(f"kv_cache last dim must be D + 4 = {D + 4} (fp8 values + fp32 scale), "
              f"got {width}")
    if not (strides[2] == 1 and strides[1] == width):
        _fail(f"kv_cache must be contiguous inside a block, got strides {kv_cache.stride()}")
    stride_blk = strides[0]
    if stride_blk % 16 != 0:
        _fail(f"kv_cache block stride must be a multiple of 16 bytes, got "
              f"{stride_blk}")
    if kv_cache.data_ptr() % 16 != 0:
        _fail("kv_cache must start 16-byte aligned")
    return block_size, stride_blk


def fp8_paged_mqa_logits(
    q_fp8: torch.Tensor,
    kv_cache_fp8: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    schedule_metadata: torch.Tensor | None,
    max_model_len: int,
    clean_logits: bool,
    *,
    _config: dict | DecodeConfig | None = None,
    _out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Indexer logits of next_n query tokens per request against the paged fp8 indexer cache
    (decode; DeepGEMM drop-in).

    Args:
        q_fp8: [B, next_n, H, D] torch.float8_e4m3fn, D = 128, any H >= 1, next_n >= 1 (next_n > 1
            for speculative decoding: token j is the j-th of the request's last next_n tokens).
        kv_cache_fp8: [num_blocks, block_size, 1, D + 4] (or [num_blocks, block_size, D + 4]) uint8,
            vLLM's indexer cache.  Per physical block (kv_cache.stride(0) bytes apart, a multiple of
            16): block_size * D fp8 e4m3 bytes (token t at byte t * D), then block_size float32
            scales (token t at byte block_size * D + 4 * t).  See `indexer_k_quant_and_cache_ref`.
        weights: [B * next_n, H] float32, head weights; row b * next_n + j belongs to token j of
            request b.
        context_lens: int32, either [B]: the request's context length L (keys 0..L-1 are cached;
            token j sees keys n < L - next_n + j + 1, vLLM 0.16.0), or [B, next_n]: the number of
            keys token j sees (vLLM 0.23.0 passes [B, 1] or [B, next_n]).  0 for padded requests.
        block_tables: [B, max_blocks] int32, logical block i of request b is physical block
            block_tables[b, i]; entries past a request's context are never read.
        schedule_metadata: ignored (see `get_paged_mqa_logits_metadata`); may be None.
        max_model_len: number of logits columns; visible lengths are clipped to it.
        clean_logits: True: every column a token does not see is -inf.  False (what vLLM passes):
            columns at or past a token's visible length are unspecified (vLLM's top-k is bounded
            by the context lengths).

    Returns:
        logits: [B * next_n, max_model_len] float32, row b * next_n + j, column n <
        visible(b, j): k_scale[n] * sum_h weights[row, h] * relu(q[b, j, h] . k[n]).

    `_config` (a DecodeConfig, or a dict of its fields to override in the default) and `_out` (a
    preallocated result) are for tests and benchmarks.
    """
    key = _paged_key(q_fp8, kv_cache_fp8, weights, context_lens, block_tables, max_model_len, clean_logits,
                     _config, _out)
    plan = _PAGED_PLANS.get(key)
    if plan is None:  # checks every argument; a repeat call with the same key reuses it
        plan = _PAGED_PLANS.keep(key, _PagedPlan(q_fp8, kv_cache_fp8, weights, context_lens, block_tables,
                                                 max_model_len, clean_logits, _config, _out))
    try:
        return plan.run(q_fp8, kv_cache_fp8, weights, context_lens, block_tables, _out)
    except Exception as e:  # noqa: BLE001 - only a failed build of the heuristic's Gluon kernel is handled
        if not (plan.default_gluon and _build_failed(e)):
            raise
        _stop_gluon(e)
    return fp8_paged_mqa_logits(q_fp8, kv_cache_fp8, weights, context_lens, block_tables, schedule_metadata,
                                max_model_len, clean_logits, _config=_config, _out=_out)


# The heuristic's Gluon decode kernel is built at its first launch. If this Triton cannot build it, that call and
# every later one run the Triton kernel: one warning in the log, never a failed forward (as sparse_mla.py does for
# its Gluon tile). A config that names the Gluon kernel itself still raises.
_log = logging.getLogger(__name__)


def _stop_gluon(e: BaseException) -> None:
    global GLUON_DEFAULT
    GLUON_DEFAULT = False
    decode_config.cache_clear()
    _PAGED_PLANS.reset()
    _log.warning("dsa-overlay: the sm_90 Gluon indexer kernel did not build with Triton %s (%s: %s); the Triton "
                 "kernel runs instead from now on (%s=0 skips the attempt)", triton.__version__,
                 type(e).__name__, _build_failure_text(e), GLUON_ENV)


def _paged_key(q, kv_cache, weights, context_lens, block_tables, max_model_len, clean_logits, config, out):
    if not _PAGED_PLANS.on or config is not None:
        return None
    try:
        key = (*map(_tensor_key, (q, kv_cache, weights, context_lens, block_tables, out)), int(max_model_len),
               bool(clean_logits))
    except (AttributeError, TypeError, ValueError):  # not tensors: no plan (the checks say what is wrong)
        return None
    return key


class _PagedPlan:
    """One fp8_paged_mqa_logits call's checked arguments and launches (one per group of T draft tokens)."""

    def __init__(self, q, kv_cache_fp8, weights, context_lens, block_tables, max_model_len, clean_logits,
                 config, out):
        if q.dim() != 4:
            _fail(f"q_fp8 must be [B, next_n, H, D], got shape {tuple(q.shape)}")
        B, next_n, H, D = q.shape
        if D != HEAD_DIM:
            _fail(f"q_fp8 head dim must be {HEAD_DIM}, got {D}")
        if not (1 <= H <= MAX_HEADS):
            _fail(f"q_fp8 must have 1..{MAX_HEADS} index heads, got {H}")
        if q.dtype in _PACKED_FP4:
            _fp4_unsupported("q")
        if q.dtype != _FP8:
            _fail(f"q_fp8 must be torch.float8_e4m3fn, got {q.dtype}")
        block_size, stride_blk = _check_paged_cache(kv_cache_fp8, D)
        if weights.shape != (B * next_n, H):
            _fail(f"weights must be [B * next_n = {B * next_n}, H = {H}], got {tuple(weights.shape)}")
        if context_lens.dim() == 1:
            if context_lens.shape[0] != B:
                _fail(f"context_lens must be [B={B}] or [B, next_n], got "
                      f"{tuple(context_lens.shape)}")
            is_1d, stride_cb, stride_cj = 1, context_lens.stride(0), 0
        else:
            if not (context_lens.dim() == 2 and context_lens.shape == (B, next_n)):
                _fail(f"context_lens must be [B={B}] or [B, next_n={next_n}], got "
                      f"{tuple(context_lens.shape)}")
            is_1d, stride_cb, stride_cj = 0, context_lens.stride(0), context_lens.stride(1)
        if context_lens.dtype != torch.int32:
            _fail(f"context_lens must be int32, got "
                  f"{context_lens.dtype}")
        if not (block_tables.dim() == 2 and block_tables.shape[0] >= B
               and block_tables.dtype == torch.int32 and block_tables.stride(1) == 1):
            _fail(f"block_tables must be [B={B}, max_blocks] int32 with contiguous rows, got "
                  f"{tuple(block_tables.shape)} {block_tables.dtype}")
        wrong = _off_device(q.device, kv_cache=kv_cache_fp8, weights=weights, context_lens=context_lens,
                            block_tables=block_tables, out=out)
        if wrong:
            _fail(f"{wrong} (q_fp8's device): every tensor of a call must be on one device")
        self.copy_q = q.stride(3) != 1
        q_strides = _contiguous_strides(q) if self.copy_q else q.stride()  # what the call's copy will have
        max_model_len = int(max_model_len)
        self.shape = (B * next_n, max_model_len)
        out_stride = max_model_len if out is None else _result(out, self.shape, q.device).stride(0)
        self.empty = B == 0 or max_model_len == 0
        self.default_gluon = False
        if self.empty:
            return
        capability, num_sms = _device_info(q.device)
        cfg = _with_overrides(decode_config(capability, H, next_n, B, max_model_len, num_sms), config)
        if cfg.GLUON and not (_GLUON and not INTERPRETED and tuple(capability)[0] == 9 and cfg.DOT_MODE == DOT_FP8
                              and cfg.T * cfg.HP <= 128 and cfg.num_warps == 4 and cfg.num_stages >= 2):
            _fail(f"the Gluon decode kernel runs on sm_90 with DOT_FP8, T x HP <= 128, 4 warps and >= 2 buffers; "
                  f"got capability {capability}, {cfg}")
        programs = cfg.programs or cfg.per_sm * num_sms
        self.default_gluon = cfg.GLUON and config is None
        self.u8 = cfg.DOT_MODE in (DOT_BF16, DOT_BYTES_FP32)  # sm_80/86 Triton has no e4m3 type: raw bytes
        self.grid = (programs,)
        self.kw = dict(D=D, **cfg.constexprs(), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                       **_pdl_kwargs(capability))
        if cfg.CONST_BS:
            self.kw["BS"] = block_size
        if cfg.maxnreg:
            self.kw["maxnreg"] = cfg.maxnreg
        self.launches = [
            ((B, H, next_n, j0, max_model_len, is_1d, int(bool(clean_logits)), block_size, programs,
              q_strides[0], q_strides[1], q_strides[2], weights.stride(0), weights.stride(1),
              stride_cb, stride_cj, block_tables.stride(0), stride_blk, out_stride),
             _Kept(_decode_gluon_launch if cfg.GLUON else _decode_launch))
            for j0 in range(0, next_n, cfg.T)]

    def run(self, q, kv_cache_fp8, weights, context_lens, block_tables, out):
        if self.copy_q:
            q = q.contiguous()
        if kv_cache_fp8.data_ptr() % 16 != 0:  # the one checked property a plan key cannot hold
            _fail("kv_cache must start 16-byte aligned")
        logits = torch.empty(self.shape, dtype=torch.float32, device=q.device) if out is None else out
        if self.empty:
            return logits
        if self.u8:
            q = q.view(torch.uint8)
        t = (q, kv_cache_fp8, weights, context_lens, block_tables, logits)
        for ints, kept in self.launches:
            kept(self.grid, t, t + ints, self.kw)
        return logits


def fp8_fp4_paged_mqa_logits(
    q: tuple[torch.Tensor, torch.Tensor | None],
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    schedule_metadata: torch.Tensor | None,
    max_model_len: int,
    clean_logits: bool = False,
) -> torch.Tensor:
    """vLLM 0.23.0 name of `fp8_paged_mqa_logits`: q is (q_values [B, next_n, H, D]
    float8_e4m3fn, None); context_lens [B], [B, 1] or [B, next_n].

    MXFP4 (packed int8/uint8 q values, a q scale tensor, or a cache of D/2 + D/32 bytes per token)
    raises NotImplementedError.  Everything else as `fp8_paged_mqa_logits`.
    """
    q_values = _unpack_q(q, "q")
    return fp8_paged_mqa_logits(q_values, kv_cache, weights, context_lens, block_tables,
                                schedule_metadata, max_model_len, clean_logits)


# --------------------------------------------------------------------------------------------------
# References (torch, float64 math, float32 result) and the cache writer
# --------------------------------------------------------------------------------------------------


def fp8_mqa_logits_ref(q, kv, weights, cu_seqlen_ks, cu_seqlen_ke) -> torch.Tensor:
    """Plain torch `fp8_mqa_logits` (same arguments) with clean_logits=True semantics: [M, N]
    float32, -inf outside [ks[m], ke[m]).  Computed in float64 with the ReLU applied to
    scale * dot (the textbook form), so it also checks the kernel's scale-after-ReLU order."""
    k, ks = kv
    qd = q.to(torch.float64)
    kd = k.to(torch.float64) * ks.reshape(-1, 1).to(torch.float64)
    s = torch.einsum("mhd,nd->mhn", qd, kd).clamp_min(0)
    logits = (s * weights.to(torch.float64)[:, :, None]).sum(1)
    n = torch.arange(k.shape[0], device=q.device)
    valid = (n[None, :] >= cu_seqlen_ks[:, None].long()) & (n[None, :] < cu_seqlen_ke[:, None].long())
    return logits.masked_fill(~valid, float("-inf")).to(torch.float32)


def _read_paged_cache(kv_cache: torch.Tensor, D: int = HEAD_DIM):
    """(values [num_blocks, block_size, D] float8_e4m3fn, scales [num_blocks, block_size] float32):
    views of the paged cache in vLLM's block layout (no copy)."""
    block_size, stride_blk = _check_paged_cache(kv_cache, D)
    nb = kv_cache.shape[0]
    flat = kv_cache.as_strided(((nb - 1) * stride_blk + block_size * (D + 4),), (1,))
    vals = torch.as_strided(flat.view(_FP8), (nb, block_size, D), (stride_blk, D, 1))
    f32 = flat.view(torch.float32)
    scales = torch.as_strided(f32, (nb, block_size), (stride_blk // 4, 1),
                              storage_offset=f32.storage_offset() + block_size * D // 4)
    return vals, scales


def fp8_paged_mqa_logits_ref(q, kv_cache, weights, context_lens, block_tables,
                             max_model_len) -> torch.Tensor:
    """Plain torch `fp8_paged_mqa_logits` (same arguments, no schedule metadata) with
    clean_logits=True semantics: [B * next_n, max_model_len] float32, -inf where a token does not
    see the key.  Reads the cache through vLLM's block layout, one request at a time; float64."""
    B, next_n, H, D = q.shape
    vals, scales = _read_paged_cache(kv_cache, D)
    block_size = vals.shape[1]
    out = torch.full((B * next_n, max_model_len), float("-inf"), dtype=torch.float64,
                     device=q.device)
    cl = context_lens.long()
    for b in range(B):
        for j in range(next_n):
            vis = int(cl[b, j]) if cl.dim() == 2 else int(cl[b]) - next_n + j + 1
            vis = min(max(vis, 0), max_model_len)
            if vis == 0:
                continue
            pos = torch.arange(vis, device=q.device)
            phys = block_tables[b, pos // block_size].long()
            k = (vals[phys, pos % block_size].to(torch.float64)
                 * scales[phys, pos % block_size].to(torch.float64)[:, None])
            s = (q[b, j].to(torch.float64) @ k.T).clamp_min(0)              # [H, vis]
            out[b * next_n + j, :vis] = (s * weights[b * next_n + j].to(torch.float64)[:, None]).sum(0)
    return out.to(torch.float32)


def indexer_k_quant_and_cache_ref(k: torch.Tensor, kv_cache: torch.Tensor,
                                  slot_mapping: torch.Tensor, quant_block_size: int = HEAD_DIM,
                                  scale_fmt: str | None = "ue8m0") -> None:
    """Write keys into the paged indexer cache exactly like vLLM's `ops.indexer_k_quant_and_cache`.

    Args:
        k: [num_tokens, D] bf16/fp16/fp32 keys.
        kv_cache: [num_blocks, block_size, D + 4 * D // quant_block_size] uint8 (a 4-D
            [.., 1, ..] view is accepted), written in place.
        slot_mapping: [num_tokens] int64, slot = physical_block * block_size + offset; < 0 skips
            the token (padding).
        quant_block_size: values per scale (vLLM uses D = 128: one scale per token).
        scale_fmt: "ue8m0" rounds each scale up to a power of two; anything else keeps
            max(amax, 1e-4) / 448.

    Per token and quant block: scale = max(amax, 1e-4) / 448 (ue8m0: 2 ** ceil(log2(scale))),
    values = saturate(k / scale) to e4m3.  Layout per block: block_size * D value bytes, then the
    float32 scales (token t, quant block g at byte block_size * D + 4 * (t * D / qbs + g)).
    """
    if kv_cache.dim() == 4:
        kv_cache = kv_cache.squeeze(2)
    T, D = k.shape
    nb, block_size, _ = kv_cache.shape
    groups = D // quant_block_size
    valid = slot_mapping >= 0
    if not bool(valid.any()):
        return
    k = k[valid].to(torch.float32)
    slots = slot_mapping[valid].long()
    kg = k.reshape(-1, groups, quant_block_size)
    scale = kg.abs().amax(-1).clamp_min(1e-4) / FP8_MAX
    if scale_fmt == "ue8m0":
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    vals = (kg / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(_FP8).reshape(-1, D)
    blk, off = slots // block_size, slots % block_size
    flat = kv_cache.reshape(nb, -1) if kv_cache.is_contiguous() else None
    if flat is None:
        _fail("indexer_k_quant_and_cache_ref needs a contiguous cache")
    val_idx = (off * D)[:, None] + torch.arange(D, device=k.device)[None, :]
    flat[blk[:, None], val_idx] = vals.view(torch.uint8)
    scale_bytes = scale.contiguous().view(torch.uint8).reshape(-1, groups * 4)
    sc_idx = block_size * D + (off * groups * 4)[:, None] + torch.arange(groups * 4, device=k.device)
    flat[blk[:, None], sc_idx] = scale_bytes
