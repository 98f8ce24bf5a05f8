# SPDX-License-Identifier: Apache-2.0
"""Sparse MLA attention (DeepSeek Sparse Attention, absorbed/MQA form) in Triton.

What it computes, per query token ``t`` and head ``h`` (MLA with the up-projections absorbed: one latent
KV row of 576 = 512 "nope" (kv_lora_rank) + 64 "rope" values per cached token, shared by all heads):

    S_t      = the valid slots among indices[t, :]        (duplicates count as many times as they appear)
    score[j] = softmax_scale * <q[t, h, :576], kv[S_t[j], :576]>
    out[t,h] = sum_j softmax(score)[j] * kv[S_t[j], :512]
    lse[t,h] = log(sum_j exp(score[j]))                     (natural log)

Public functions: ``sparse_mla_attention`` (the kernel; FlashMLA's sparse decode/prefill in one call),
``sparse_mla_reference`` (plain torch, float32), ``choose_config`` / ``split_count`` / ``candidate_tiles``
(the launch heuristic and the tiles it can pick).

Input layouts: the KV cache is bf16 [.., 576] or vLLM's ``fp8_ds_mla`` [.., 656] bytes per token (512
float8_e4m3fn values in four 128-value tiles, four float32 tile scales, 64 bf16 rope values); every argument
is documented on :func:`sparse_mla_attention`.

How the kernels work: one program per (token, group of BLOCK_H heads, split of the top-k list). Heads are
the M dimension of ``tl.dot`` (padded to BLOCK_H >= 16 with masks, never by the caller), BLOCK_N gathered
KV rows are N (for Q.K^T) and K (for P.V); the 512-wide nope part is handled as four 128-wide tiles, which
is also the fp8 quantisation tile, so dequantisation (uint8 -> float8e4nv -> x per-row tile scale) happens
in registers right after the gather (sm_80/86, which have no e4m3 type, decode the bits by hand). q is read
where vLLM leaves it (one [T, H, 576] tensor, or the (q_nope, q_pe) pair: two pointers, never concatenated).
Request-local top-k positions (the indexer's output, with block_table / req_id) become cache rows inside the
loop (PAGED: one block-table gather per BLOCK_N rows) in the latency regime (decode-sized batches); elsewhere, and
for the 64-head tiles at the register limit, one small launch converts them first (INLINE_PAGED_MAX_BLOCK_H).
Online
softmax runs in fp32 with exp2. With ``num_splits > 1`` every split writes a normalised fp32 partial
output and its lse, and a second small kernel merges the splits by lse (one pass with an online max; one
program per row over all 512 columns, the split reduction inside each thread, up to 16 splits; 32 splits
x 128 columns, four programs per row, above that). Two constexpr variants exist for the tables to pick:
``dv_split=2`` gives each row's 512 output columns to two programs (each recomputes the 576-wide scores;
half the fp32 accumulator), and ``fp8_post_scale`` applies the fp8 tile scales to the [heads, rows]
scores and to P instead of to the [rows, 512] tile. Both are correct everywhere (interpreter tests); both
measured slower on the H200 (bench/RESULTS.md), so no table uses them.

Launch configuration: a :class:`SparseMLAConfig` (named fields; tile sizes are constexprs, the number of
splits a runtime argument, so a new batch size never recompiles), picked per launch by
:func:`choose_config` from the named tuning tables below, keyed by GPU family and head bucket. No
autotuning. Measurements behind the tables: bench/RESULTS.md.

sm_90 with a bf16 cache runs a Gluon kernel for the 64-head tile where batches are large enough (sparse_mla_sm90.py:
the same arguments and results, explicit warpgroup layouts; see _GLUON_TUNING).

Self-contained: torch, triton (3.5 and 3.6), launch.py and sparse_mla_sm90.py beside it: ``apply`` drops this
file into vLLM as ``vllm/_dsa_overlay/kernels/sparse_mla.py``. Runs on every NVIDIA GPU from sm_80 on (A100,
A6000/RTX 30xx sm_86, L40S/RTX 40xx sm_89, H100/H200 sm_90, RTX 50xx/RTX PRO 6000 sm_120), and on the CPU when
``TRITON_INTERPRET=1`` is set before import (``INTERPRETED``; tests).
"""

from __future__ import annotations

import functools
import math
import logging
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
import triton
import triton.language as tl

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
from .sparse_mla_sm90 import GLUON as _GLUON
from .sparse_mla_sm90 import WS as _WS
from .sparse_mla_sm90 import WS_FP8 as _WS_FP8
from .sparse_mla_sm90 import _sparse_mla_fwd_sm90_kernel, _sparse_mla_fwd_sm90_ws_kernel
from .sparse_mla_sm90 import SHARED_LIMIT as _SM90_SHARED
from .sparse_mla_sm90 import shared_bytes as _gluon_shared_bytes

__all__ = [
    "SparseMLAConfig",
    "sparse_mla_attention",
    "sparse_mla_reference",
    "choose_config",
    "split_count",
    "candidate_tiles",
    "SparseMLATuning",
    "FOCUS_CONFIGS",
    "INTERPRETED",
    "KV_FORMATS",
    "FP8_DS_MLA_BYTES",
]

KV_LORA_RANK = 512  # "nope" width, also the output width (d_v)
ROPE_DIM = 64
HEAD_DIM = KV_LORA_RANK + ROPE_DIM  # 576
FP8_TILE = 128  # fp8_ds_mla quantisation tile (one float32 scale per 128 values)
FP8_DS_MLA_BYTES = KV_LORA_RANK + 4 * (KV_LORA_RANK // FP8_TILE) + 2 * ROPE_DIM  # 512 + 16 + 128 = 656
KV_FORMATS = ("bf16", "fp8_ds_mla")

_TRITON_VERSION = tuple(int(x) for x in triton.__version__.split(".")[:2] if x.isdigit())
_LOG2E = 1.4426950408889634


# ----------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------
@triton.jit
def _load_nope_raw(kv_ptr, row, valid, col, IS_FP8: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """The stored nope columns col .. col+127 of BLOCK_N rows and their scale: fp8 -> (raw bytes [BLOCK_N, 128],
    float32 tile scale [BLOCK_N]); bf16 -> (the tile in DOT_DTYPE, 1)."""
    d = tl.arange(0, 128)
    if IS_FP8:
        raw = tl.load(kv_ptr + row[:, None] + col + d[None, :], mask=valid[:, None], other=0)
        scale = tl.load((kv_ptr + row + (512 + 4 * (col // 128))).to(tl.pointer_type(tl.float32)),
                        mask=valid, other=0.0)
        return raw, scale
    else:
        t = tl.load(kv_ptr + row[:, None] + col + d[None, :], mask=valid[:, None], other=0.0).to(DOT_DTYPE)
        return t, tl.full(row.shape, 1.0, tl.float32)


@triton.jit
def _decode_nope(raw, scale, FP8_NATIVE: tl.constexpr, FP8_POST: tl.constexpr, DOT_DTYPE: tl.constexpr,
                 BITS_ASM: tl.constexpr = False):
    """Raw e4m3 bytes and tile scale (_load_nope_raw) -> (tile in DOT_DTYPE, scale), as _load_nope_tile says."""
    if FP8_NATIVE:
        x = raw.to(tl.float8e4nv, bitcast=True)
    else:
        # sm_80/86 have no e4m3 conversion: place sign/exponent/mantissa into an fp16 bit pattern
        # (exponent bias 15 instead of 7, subnormals included) and fold the 2^8 into the scale.
        if BITS_ASM:
            x = e4m3_as_f16_bits(raw)
        else:
            r16 = raw.to(tl.uint16)
            bits = ((r16 & 0x80) << 8) | ((r16 & 0x7F) << 7)
            x = bits.to(tl.float16, bitcast=True)
        scale = scale * 256.0
    if FP8_POST:
        return x.to(DOT_DTYPE), scale
    else:
        return (x.to(tl.float32) * scale[:, None]).to(DOT_DTYPE), scale


@triton.jit
def _load_nope_tile(kv_ptr, row, valid, col, IS_FP8: tl.constexpr, FP8_NATIVE: tl.constexpr,
                    FP8_POST: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Gather nope columns col .. col+127 (col a multiple of 128) of BLOCK_N rows.

    Returns (tile [BLOCK_N, 128] DOT_DTYPE, scale [BLOCK_N] float32). ``row`` is each row's offset from
    ``kv_ptr`` (elements for bf16, bytes for fp8); invalid rows read 0. bf16: scale is unused (1).
    fp8 with FP8_POST=False: the tile is dequantised (x * scale) before the cast, scale is unused.
    fp8 with FP8_POST=True: the tile holds the raw e4m3 values (exact in bf16, one conversion) and the
    caller applies the per-row tile scale to the [BLOCK_H, BLOCK_N] scores and to P instead
    (s_j = (q_j . x_j) * scale_j;  P.V_j = (P * scale_j) . x_j), which is less work when BLOCK_H < 128.
    """
    t, scale = _load_nope_raw(kv_ptr, row, valid, col, IS_FP8, DOT_DTYPE)
    if IS_FP8:
        return _decode_nope(t, scale, FP8_NATIVE, FP8_POST, DOT_DTYPE)
    else:
        return t, scale


@triton.jit
def _load_rope_tile(kv_ptr, row, valid, IS_FP8: tl.constexpr, DOT_DTYPE: tl.constexpr):
    r = tl.arange(0, 64)
    if IS_FP8:
        ptr = (kv_ptr + row + 528).to(tl.pointer_type(tl.bfloat16))
    else:
        ptr = kv_ptr + row + 512
    return tl.load(ptr[:, None] + r[None, :], mask=valid[:, None], other=0.0).to(DOT_DTYPE)


@triton.jit
def _qk_tile(s, q, k, scale, POST: tl.constexpr):
    """s += q . k^T for one 128-wide nope tile (times the per-row fp8 tile scale when POST)."""
    if POST:
        return s + tl.dot(q, tl.trans(k)) * scale[None, :]
    else:
        return tl.dot(q, tl.trans(k), s)


@triton.jit
def _pv_tile(acc, alpha, p, v, scale, POST: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """acc * alpha + P . V for one 128-wide output tile (P's columns times the fp8 tile scale when POST)."""
    if POST:
        return tl.dot((p * scale[None, :]).to(DOT_DTYPE), v, acc * alpha[:, None])
    else:
        return tl.dot(p.to(DOT_DTYPE), v, acc * alpha[:, None])


@triton.jit
def _kv_rows(idx_row, bt_row, n0, end, num_slots, num_blocks, block_size, max_blocks, stride_kvb, stride_kvt,
             BLOCK_N: tl.constexpr, PAGED: tl.constexpr):
    """(valid [BLOCK_N], row offset [BLOCK_N] int64) of top-k positions n0 .. n0 + BLOCK_N - 1 (see the kernel)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    nmask = offs_n < end
    if PAGED:
        pos = tl.load(idx_row + offs_n, mask=nmask, other=-1)
        lblk = tl.maximum(pos, 0) // block_size
        blk = tl.load(bt_row + lblk, mask=nmask & (pos >= 0) & (lblk < max_blocks), other=-1)
        valid = (blk >= 0) & (blk < num_blocks)
        blk = tl.where(valid, blk, 0)
        off = tl.where(valid, pos - lblk * block_size, 0)
    else:
        slot = tl.load(idx_row + offs_n, mask=nmask, other=-1)
        valid = nmask & (slot >= 0) & (slot < num_slots)
        slot = tl.where(valid, slot, 0)
        blk = slot // block_size
        off = slot - blk * block_size
    return valid, blk.to(tl.int64) * stride_kvb + off.to(tl.int64) * stride_kvt


@triton.jit
def _gather_raw(kv_ptr, idx_row, bt_row, n0, end, num_slots, num_blocks, block_size, max_blocks, stride_kvb,
                stride_kvt, cA, cB, cC, cD, BLOCK_N: tl.constexpr, PAGED: tl.constexpr, IS_FP8: tl.constexpr,
                DOT_DTYPE: tl.constexpr):
    """(valid, row, then raw tile and scale of columns cA, cB, cC, cD) of top-k positions n0 .. n0 + BLOCK_N - 1."""
    valid, row = _kv_rows(idx_row, bt_row, n0, end, num_slots, num_blocks, block_size, max_blocks, stride_kvb,
                          stride_kvt, BLOCK_N, PAGED)
    rA, sA = _load_nope_raw(kv_ptr, row, valid, cA, IS_FP8, DOT_DTYPE)
    rB, sB = _load_nope_raw(kv_ptr, row, valid, cB, IS_FP8, DOT_DTYPE)
    rC, sC = _load_nope_raw(kv_ptr, row, valid, cC, IS_FP8, DOT_DTYPE)
    rD, sD = _load_nope_raw(kv_ptr, row, valid, cD, IS_FP8, DOT_DTYPE)
    return valid, row, rA, sA, rB, sB, rC, sC, rD, sD


@triton.jit
def _decode_block(g, FP8_NATIVE: tl.constexpr, FP8_POST: tl.constexpr, DOT_DTYPE: tl.constexpr,
                  BITS_ASM: tl.constexpr):
    """_gather_raw's tuple with its four raw tiles decoded (_decode_nope)."""
    valid, row, rA, sA, rB, sB, rC, sC, rD, sD = g
    kA, sA = _decode_nope(rA, sA, FP8_NATIVE, FP8_POST, DOT_DTYPE, BITS_ASM)
    kB, sB = _decode_nope(rB, sB, FP8_NATIVE, FP8_POST, DOT_DTYPE, BITS_ASM)
    kC, sC = _decode_nope(rC, sC, FP8_NATIVE, FP8_POST, DOT_DTYPE, BITS_ASM)
    kD, sD = _decode_nope(rD, sD, FP8_NATIVE, FP8_POST, DOT_DTYPE, BITS_ASM)
    return valid, row, kA, sA, kB, sB, kC, sC, kD, sD


@triton.jit
def _sparse_mla_fwd_kernel(
    q_ptr, qr_ptr,               # nope queries [T, H, 512..]; rope queries at qr_ptr + rope_off (q itself or q_pe)
    kv_ptr, idx_ptr,
    req_ptr, bt_ptr,             # PAGED: request row per token [>= T], block table [num_reqs, max_blocks]
    out_ptr, lse_ptr,            # final outputs (SPLIT=False)
    po_ptr, plse_ptr,            # fp32 partials [T, H, S, 512] / [T, H, S] contiguous (SPLIT=True)
    H, topk, num_slots, block_size, split_len, num_head_groups, num_splits, max_blocks,
    stride_qt, stride_qh, stride_rt, stride_rh, rope_off,
    stride_kvb, stride_kvt,
    stride_it, stride_btr,
    stride_ot, stride_oh, stride_lt, stride_lh,
    sm_scale_log2,
    IS_FP8: tl.constexpr, FP8_NATIVE: tl.constexpr, SPLIT: tl.constexpr, DOT_F32: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DV_SPLIT: tl.constexpr = 1, FP8_POST: tl.constexpr = False,
    PAGED: tl.constexpr = False, SKIP_TAIL: tl.constexpr = True, PDL: tl.constexpr = False,
    PREFETCH: tl.constexpr = 0,
):
    pdl_enter(PDL)  # launched with PDL: nothing is read before the previous kernel is done (pdl.py)
    # program -> (token, split, value half, head group), head group fastest: programs that share a
    # token's KV rows run side by side and hit L2 for each other.
    # PAGED: idx holds request-local positions p; the row read is block_table[req[t], p // block_size] at offset
    # p % block_size (p < 0, a block past max_blocks, a negative or out-of-cache block: skipped), so the backend's
    # conversion to slot ids costs no launch of its own.
    # DV_SPLIT = 2: each program computes the full 576-wide scores but only 256 of the 512 output columns
    # (half the [BLOCK_H, 512] fp32 accumulator; the two halves of a row are two programs).
    pid = tl.program_id(0)
    hg = pid % num_head_groups
    rest = pid // num_head_groups
    if DV_SPLIT == 1:
        c0 = 0
    else:
        c0 = (rest % 2) * 256
        rest = rest // 2
    sp = rest % num_splits
    t = rest // num_splits
    # Column order: the program's own output tiles first (A, B), then (C, D); the score is a sum over
    # all four in any order. DV_SPLIT = 1: A, B, C, D = 0, 128, 256, 384.
    cA = c0
    cB = c0 + 128
    cC = 256 - c0
    cD = 384 - c0
    POST: tl.constexpr = IS_FP8 and FP8_POST
    # PREFETCH (fp8_ds_mla): 1 carries the next block's raw tiles across iterations, 2 its decoded tiles (and, on
    # sm_80/86, decodes with _e4m3_as_f16_bits: a PTX block the interpreter cannot run, so it keeps the Triton form)
    AHEAD: tl.constexpr = PREFETCH == 2
    BITS_ASM: tl.constexpr = AHEAD and not DOT_F32

    DOT_DTYPE: tl.constexpr = tl.float32 if DOT_F32 else tl.bfloat16

    offs_h = hg * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = offs_h < H
    d = tl.arange(0, 128)
    r = tl.arange(0, 64)

    q_row = q_ptr + t.to(tl.int64) * stride_qt + offs_h.to(tl.int64) * stride_qh
    qA = tl.load(q_row[:, None] + cA + d[None, :], mask=hmask[:, None], other=0.0).to(DOT_DTYPE)
    qB = tl.load(q_row[:, None] + cB + d[None, :], mask=hmask[:, None], other=0.0).to(DOT_DTYPE)
    qC = tl.load(q_row[:, None] + cC + d[None, :], mask=hmask[:, None], other=0.0).to(DOT_DTYPE)
    qD = tl.load(q_row[:, None] + cD + d[None, :], mask=hmask[:, None], other=0.0).to(DOT_DTYPE)
    qr_row = qr_ptr + t.to(tl.int64) * stride_rt + offs_h.to(tl.int64) * stride_rh + rope_off
    qr = tl.load(qr_row[:, None] + r[None, :], mask=hmask[:, None], other=0.0).to(DOT_DTYPE)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    accA = tl.zeros([BLOCK_H, 128], dtype=tl.float32)
    accB = tl.zeros([BLOCK_H, 128], dtype=tl.float32)
    if DV_SPLIT == 1:
        accC = tl.zeros([BLOCK_H, 128], dtype=tl.float32)
        accD = tl.zeros([BLOCK_H, 128], dtype=tl.float32)

    start = sp * split_len
    end = start + split_len
    end = tl.where(end < topk, end, topk)
    idx_row = idx_ptr + t.to(tl.int64) * stride_it
    if SKIP_TAIL:
        # Trailing invalid indices change nothing (the indexer pads a list with -1 where a token has fewer than
        # top-k keys: a prompt's first tokens, every token of a shorter context): the loop ends after this split's
        # last valid index, and a split past it does no work.
        last = start - 1
        for i0 in range(start, end, 1024):  # not c0: that is the program's value half, read again at the store
            offs = i0 + tl.arange(0, 1024)
            inside = offs < end
            v = tl.load(idx_row + offs, mask=inside, other=-1)
            if PAGED:
                ok = inside & (v >= 0)
            else:
                ok = inside & (v >= 0) & (v < num_slots)
            last = tl.maximum(last, tl.max(tl.where(ok, offs, -1), 0))
        end = last + 1
    if PAGED:
        bt_row = bt_ptr + tl.load(req_ptr + t).to(tl.int64) * stride_btr
        num_blocks = num_slots // block_size
    else:
        bt_row = bt_ptr
        num_blocks = num_slots
    if PREFETCH:
        nxt = _gather_raw(kv_ptr, idx_row, bt_row, start, end, num_slots, num_blocks, block_size, max_blocks,
                          stride_kvb, stride_kvt, cA, cB, cC, cD, BLOCK_N, PAGED, IS_FP8, DOT_DTYPE)
        if AHEAD:
            nxt = _decode_block(nxt, FP8_NATIVE, FP8_POST, DOT_DTYPE, BITS_ASM)
    for n0 in range(start, end, BLOCK_N):
        if AHEAD:
            # fp8: this block's tiles were loaded and decoded by the previous iteration; the next block's gathers
            # are issued here and decoded after this block's math, so they land meanwhile, and the decode (no
            # longer waiting on them) is free to issue between the dots. The dots read 16-bit loop-carried tiles.
            valid, row, kA, sA, kB, sB, kC, sC, kD, sD = nxt
            raw_next = _gather_raw(kv_ptr, idx_row, bt_row, n0 + BLOCK_N, end, num_slots, num_blocks, block_size,
                                   max_blocks, stride_kvb, stride_kvt, cA, cB, cC, cD, BLOCK_N, PAGED, IS_FP8,
                                   DOT_DTYPE)
        elif PREFETCH:
            # fp8: this block's raw tiles were loaded by the previous iteration; load the next block's now, so
            # the gathers overlap this block's math. Decoding a loop-carried value also keeps Triton from seeing
            # the 8-bit load behind the dot operands (it would pick kWidth 4 and byte-wise shared loads).
            cur = nxt
            nxt = _gather_raw(kv_ptr, idx_row, bt_row, n0 + BLOCK_N, end, num_slots, num_blocks, block_size,
                              max_blocks, stride_kvb, stride_kvt, cA, cB, cC, cD, BLOCK_N, PAGED, IS_FP8, DOT_DTYPE)
            valid, row, kA, sA, kB, sB, kC, sC, kD, sD = _decode_block(cur, FP8_NATIVE, FP8_POST, DOT_DTYPE, False)
        else:
            valid, row = _kv_rows(idx_row, bt_row, n0, end, num_slots, num_blocks, block_size, max_blocks,
                                  stride_kvb, stride_kvt, BLOCK_N, PAGED)
            kA, sA = _load_nope_tile(kv_ptr, row, valid, cA, IS_FP8, FP8_NATIVE, FP8_POST, DOT_DTYPE)
            kB, sB = _load_nope_tile(kv_ptr, row, valid, cB, IS_FP8, FP8_NATIVE, FP8_POST, DOT_DTYPE)
            kC, sC = _load_nope_tile(kv_ptr, row, valid, cC, IS_FP8, FP8_NATIVE, FP8_POST, DOT_DTYPE)
            kD, sD = _load_nope_tile(kv_ptr, row, valid, cD, IS_FP8, FP8_NATIVE, FP8_POST, DOT_DTYPE)
        kr = _load_rope_tile(kv_ptr, row, valid, IS_FP8, DOT_DTYPE)

        s = tl.dot(qr, tl.trans(kr))
        s = _qk_tile(s, qA, kA, sA, POST)
        s = _qk_tile(s, qB, kB, sB, POST)
        s = _qk_tile(s, qC, kC, sC, POST)
        s = _qk_tile(s, qD, kD, sD, POST)
        s = tl.where(valid[None, :], s * sm_scale_log2, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # all-invalid so far: avoid -inf - -inf
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        accA = _pv_tile(accA, alpha, p, kA, sA, POST, DOT_DTYPE)
        accB = _pv_tile(accB, alpha, p, kB, sB, POST, DOT_DTYPE)
        if DV_SPLIT == 1:
            accC = _pv_tile(accC, alpha, p, kC, sC, POST, DOT_DTYPE)
            accD = _pv_tile(accD, alpha, p, kD, sD, POST, DOT_DTYPE)
        m_i = m_new
        if AHEAD:
            nxt = _decode_block(raw_next, FP8_NATIVE, FP8_POST, DOT_DTYPE, BITS_ASM)

    has = l_i > 0.0
    inv_l = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    if DV_SPLIT == 1:
        lmask = hmask
    else:
        lmask = hmask & (c0 == 0)  # both halves hold the same lse: one stores it
    if SPLIT:
        prow = (t.to(tl.int64) * H + offs_h) * num_splits + sp
        po = po_ptr + prow[:, None] * 512 + d[None, :]
        tl.store(po + cA, accA * inv_l[:, None], mask=hmask[:, None])
        tl.store(po + cB, accB * inv_l[:, None], mask=hmask[:, None])
        if DV_SPLIT == 1:
            tl.store(po + cC, accC * inv_l[:, None], mask=hmask[:, None])
            tl.store(po + cD, accD * inv_l[:, None], mask=hmask[:, None])
        tl.store(plse_ptr + prow, lse, mask=lmask)
    else:
        o = out_ptr + t.to(tl.int64) * stride_ot + offs_h.to(tl.int64) * stride_oh
        o = o[:, None] + d[None, :]
        tl.store(o + cA, (accA * inv_l[:, None]).to(out_ptr.dtype.element_ty), mask=hmask[:, None])
        tl.store(o + cB, (accB * inv_l[:, None]).to(out_ptr.dtype.element_ty), mask=hmask[:, None])
        if DV_SPLIT == 1:
            tl.store(o + cC, (accC * inv_l[:, None]).to(out_ptr.dtype.element_ty), mask=hmask[:, None])
            tl.store(o + cD, (accD * inv_l[:, None]).to(out_ptr.dtype.element_ty), mask=hmask[:, None])
        tl.store(lse_ptr + t.to(tl.int64) * stride_lt + offs_h.to(tl.int64) * stride_lh, lse, mask=lmask)


@triton.jit
def _request_slots_kernel(idx_ptr, req_ptr, bt_ptr, slot_ptr, topk, block_size, max_blocks, stride_it, stride_btr,
                          BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Request-local top-k positions -> global slot ids (-1 where invalid), BLOCK of one token's per program:
    slot = block_table[req_id[t], p // block_size] * block_size + p % block_size; p < 0, a block past the table
    or a negative table entry give -1 (the attention kernel skips it). One launch instead of the torch ops of
    the backend's conversion (host launch cost). Used where the attention kernel does not convert inline (PAGED):
    outside the latency regime, and for tiles too large to do it without spilling (see INLINE_PAGED_MAX_BLOCK_H)."""
    pdl_enter(PDL)
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < topk
    local = tl.load(idx_ptr + t.to(tl.int64) * stride_it + offs, mask=m, other=-1)
    pos = tl.where(local >= 0, local, 0)
    lblk = pos // block_size
    inside = m & (local >= 0) & (lblk < max_blocks)
    row = bt_ptr + tl.load(req_ptr + t).to(tl.int64) * stride_btr
    phys = tl.load(row + lblk, mask=inside, other=-1)
    slot = tl.where(inside & (phys >= 0), phys * block_size + (pos - lblk * block_size), -1)
    tl.store(slot_ptr + t.to(tl.int64) * topk + offs, slot, mask=m)


@triton.jit
def _sparse_mla_combine_kernel(
    po_ptr, plse_ptr, out_ptr, lse_ptr,
    H, num_splits,
    stride_ot, stride_oh, stride_lt, stride_lh,
    CHUNK_S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False,
):
    """Merge the num_splits normalised partials of one (token, head) row by their lse, for BLOCK_D of the
    512 output columns (program axis 1).

    One pass with an online max: each chunk of CHUNK_S splits loads its lse values and its [CHUNK_S,
    BLOCK_D] partial tile together (independent loads, one memory round trip per chunk; the launcher picks
    CHUNK_S >= the split count, so a single chunk). With BLOCK_D = 512 at 4 warps, Triton puts the warps
    on the columns and the split axis inside each thread: the reduction over splits is register adds, with
    no shared memory and no barrier (BLOCK_D = 128 puts the warps on the split axis instead: a
    shared-memory reduction, kept only for > 16 splits, where rows are few). CHUNK_S is fixed per bucket,
    so a new split count never recompiles. Every split's partial is written by the forward kernel (zeros
    for an empty split, whose lse is -inf and weight 0)."""
    pdl_enter(PDL)
    pid = tl.program_id(0)
    pd = tl.program_id(1)
    t = pid // H
    h = pid % H
    base = pid.to(tl.int64) * num_splits
    offs_c = tl.arange(0, CHUNK_S)
    d = pd * BLOCK_D + tl.arange(0, BLOCK_D)
    m = tl.max(tl.full([CHUNK_S], float("-inf"), dtype=tl.float32), 0)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    wsum = tl.sum(tl.zeros([CHUNK_S], dtype=tl.float32), 0)
    for s0 in range(0, num_splits, CHUNK_S):
        smask = s0 + offs_c < num_splits
        ls = tl.load(plse_ptr + base + s0 + offs_c, mask=smask, other=float("-inf"))
        o = tl.load(po_ptr + (base + s0 + offs_c)[:, None] * 512 + d[None, :], mask=smask[:, None], other=0.0)
        m_new = tl.maximum(m, tl.max(ls, 0))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing valid yet: avoid -inf - -inf
        alpha = tl.exp(m - m_use)  # 0 while m is -inf
        w = tl.exp(ls - m_use)  # 0 for an empty split (lse -inf) and for masked lanes
        acc = acc * alpha + tl.sum(w[:, None] * o, 0)
        wsum = wsum * alpha + tl.sum(w, 0)
        m = m_new
    has = wsum > 0.0
    m_use = tl.where(m == float("-inf"), 0.0, m)
    res = acc * tl.where(has, 1.0 / tl.where(has, wsum, 1.0), 0.0)
    lse = tl.where(has, m_use + tl.log(tl.where(has, wsum, 1.0)), float("-inf"))
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + h.to(tl.int64) * stride_oh + d,
             res.to(out_ptr.dtype.element_ty))
    if pd == 0:
        tl.store(lse_ptr + t.to(tl.int64) * stride_lt + h.to(tl.int64) * stride_lh, lse)


# ----------------------------------------------------------------------------------------------------
# Launch configuration
# ----------------------------------------------------------------------------------------------------
# Kernels decorated while TRITON_INTERPRET=1 was set run on the CPU (Triton reads it at decoration). The
# interpreter's tl.dot on bf16 operands is wrong (Triton 3.6 + numpy 2.x), so the launcher then upcasts
# the dot operands to float32 (DOT_F32); on a GPU the dots stay bf16.
INTERPRETED = type(_sparse_mla_fwd_kernel).__name__ == "InterpretedFunction"


def _interpreting() -> bool:
    """The old name of INTERPRETED, kept for the kernel tests that still call it."""
    return INTERPRETED


# Host launch cost: cached CompiledKernels launched past Triton's JIT entry (overlay/kernels/launch.py).
_fwd_launch = _Launcher(_sparse_mla_fwd_kernel)
_combine_launch = _Launcher(_sparse_mla_combine_kernel)
_slots_launch = _Launcher(_request_slots_kernel)
LAUNCHERS = [_fwd_launch, _combine_launch, _slots_launch]
_gluon_launch = _Launcher(_sparse_mla_fwd_sm90_kernel) if _GLUON else None
if _gluon_launch is not None:
    LAUNCHERS.append(_gluon_launch)
_gluon_ws_launch = _Launcher(_sparse_mla_fwd_sm90_ws_kernel) if _WS else None
if _gluon_ws_launch is not None:
    LAUNCHERS.append(_gluon_ws_launch)


@dataclass(frozen=True)
class SparseMLAConfig:
    """Launch configuration of :func:`sparse_mla_attention`.

    block_h: heads per program (tl.dot M; 16, 32 or 64). H is padded up to it with masks.
    block_n: gathered KV rows per loop iteration (tl.dot N for Q.K^T, K for P.V; 16, 32 or 64).
    num_splits: programs the top-k list of one (token, head group) is split across (runtime value:
        changing it never recompiles). 1 writes the outputs directly, > 1 adds a merge kernel.
    num_warps, num_stages: Triton launch options (num_stages > 1 software-pipelines the gathers).
    dv_split: 1, or 2 = each program computes the full scores but only 256 of the 512 output columns
        (two programs per row: half the fp32 accumulator in registers, twice the score work).
    fp8_post_scale: fp8_ds_mla only: apply the per-row tile scales to the scores and to P after/before
        the dots instead of dequantising the [BLOCK_N, 512] tile (no effect on bf16).
    gluon: sm_90 only, block_h 64, dv_split 1: a Gluon kernel of sparse_mla_sm90.py. 8 warps: the two-warpgroup
        tile (bf16 or fp8_ds_mla; explicit warpgroup layouts, no duplicated score work), num_stages its number of
        gather buffers. 4 warps (``ws``): the warp-specialised tile (block_n 64, num_stages 2: its two key buffers; 4
        warps gather, or dequantise fp8_ds_mla, and two more warpgroups of 4 compute; its top-k splits are whole pairs
        of blocks).
    fp8_prefetch: fp8_ds_mla only, Triton tiles: 1 = each iteration loads the next block's raw e4m3 tiles into
        registers while it computes this block (a software pipeline of the gathers Triton does not build for a decoded
        load; it also lets Triton feed the dots from 16-bit shared memory via ldmatrix instead of byte-wise loads);
        2 = the same gathers, decoded at the end of the iteration, so the loop carries the decoded 16-bit tiles
        instead of one register per raw byte (and sm_80/86 decode with a 3-instruction PTX block per 2 values).
        True reads as 1. The same arithmetic either way (bit for bit under the interpreter): only the schedule
        differs.
    String form (benchmarks, tests): h<block_h>n<block_n>s<splits>w<warps>p<stages>[d2][f][g][r|a],
        e.g. 'h64n64s1w8p3d2' (dv_split=2), 'h16n32s8w4p2f' (fp8_post_scale), 'h64n64s1w8p2g' (gluon),
        'h32n32s1w8p2r' (fp8_prefetch=1) or 'h32n32s1w8p2a' (fp8_prefetch=2: decoded ahead).
    Tuple form (``tile``, :func:`candidate_tiles`): everything but num_splits, in field order.
    """

    block_h: int = 16
    block_n: int = 32
    num_splits: int = 1
    num_warps: int = 4
    num_stages: int = 2
    dv_split: int = 1
    fp8_post_scale: bool = False
    gluon: bool = False
    fp8_prefetch: int = 0

    def __post_init__(self):
        if self.fp8_prefetch not in (0, 1, 2):
            raise ValueError(f"SparseMLAConfig: fp8_prefetch must be 0, 1 (raw tiles) or 2 (decoded tiles), got "
                             f"{self.fp8_prefetch!r}")

    @property
    def ws(self) -> bool:
        """The warp-specialised sm_90 Gluon tile (gluon with 4 launch warps)."""
        return self.gluon and self.num_warps == 4

    @property
    def split_unit(self) -> int:
        """Top-k entries a split's length is a multiple of: block_n, or a pair of blocks for the ws tile (one per
        math warpgroup)."""
        return 2 * self.block_n if self.ws else self.block_n

    @property
    def tile(self) -> tuple[int, int, int, int, int, bool, bool, int]:
        """Everything but the split count (what one compile depends on), as a tuple."""
        return (self.block_h, self.block_n, self.num_warps, self.num_stages, self.dv_split,
                self.fp8_post_scale, self.gluon, self.fp8_prefetch)

    def __str__(self) -> str:  # compact form, parsed back by from_string (benchmark sweeps)
        return (f"h{self.block_h}n{self.block_n}s{self.num_splits}"
                f"w{self.num_warps}p{self.num_stages}"
                f"{'d%d' % self.dv_split if self.dv_split != 1 else ''}{'f' if self.fp8_post_scale else ''}"
                f"{'g' if self.gluon else ''}{('', 'r', 'a')[self.fp8_prefetch]}")

    @classmethod
    def from_string(cls, s: str) -> "SparseMLAConfig":
        import re

        m = re.fullmatch(r"h(\d+)n(\d+)s(\d+)w(\d+)p(\d+)(?:d(\d+))?(f)?(g)?([ra])?", s.strip())
        if not m:
            raise ValueError(f"bad sparse-MLA config {s!r}: expected e.g. 'h16n32s8w4p2' "
                             "(block_h, block_n, num_splits, num_warps, num_stages, optional d2, f, g and r or a)")
        g = m.groups()
        return cls(*(int(x) for x in g[:5]), int(g[5] or 1), g[6] == "f", g[7] == "g", "-ra".find(g[8] or "-"))

    @classmethod
    def from_tile(cls, tile: "tuple | SparseMLAConfig", num_splits: int = 1) -> "SparseMLAConfig":
        """The config of a tile (tuple form or a config) with ``num_splits`` splits."""
        if isinstance(tile, SparseMLAConfig):
            return replace(tile, num_splits=num_splits)
        bh, bn, nw, ns, dv, post, *rest = tile
        gluon, prefetch = (list(rest) + [False, 0])[:2]
        return cls(bh, bn, num_splits, nw, ns, dv, post, bool(gluon), int(prefetch))


@dataclass(frozen=True)
class SparseMLATuning:
    """One tuning-table entry: a tile (a config whose num_splits :func:`choose_config` fills in) and the
    number of its programs per SM the split rule aims for (2 where two fit on an SM and that measured
    faster, else 1)."""

    config: SparseMLAConfig
    programs_per_sm: int = 1


class CombineBucket(NamedTuple):
    """A launch bucket of the split merge: the first bucket whose max_splits holds the split count is used
    (max_splits None: any count; the kernel then loops over chunks of chunk_s splits). A tuple, so tests
    and the cross-compile test can unpack it."""

    max_splits: int | None
    chunk_s: int  # CHUNK_S: splits loaded per chunk
    block_d: int  # BLOCK_D: output columns per program (512: one program per row; 128: four)


# Up to 16 splits: one program per (token, head) row over all 512 columns, the split reduction inside each
# thread, one memory round trip. Above (the latency regime, T * H small; 32 splits at T = 1): 32 splits x
# 128 columns, four programs per row. The heuristic never emits more than 32 splits at the top-k of 2048.
# bucket layouts measured: bench/RESULTS.md#tuning-notes-moved-from-the-kernel-sources
_COMBINE_BUCKETS: tuple[CombineBucket, ...] = (
    CombineBucket(max_splits=2, chunk_s=2, block_d=512),
    CombineBucket(max_splits=4, chunk_s=4, block_d=512),
    CombineBucket(max_splits=8, chunk_s=8, block_d=512),
    CombineBucket(max_splits=16, chunk_s=16, block_d=512),
    CombineBucket(max_splits=None, chunk_s=32, block_d=128),
)


def _combine_bucket(num_splits: int) -> tuple[int, int]:
    """(CHUNK_S, BLOCK_D) of the split merge for a split count (see _COMBINE_BUCKETS)."""
    b = next(b for b in _COMBINE_BUCKETS if b.max_splits is None or num_splits <= b.max_splits)
    return b.chunk_s, b.block_d


# Tuning tables of SparseMLATuning entries, keyed by GPU family (see _family) and format, plus the head
# bucket (16 / 32 / 64 heads) for the throughput table. Two regimes (choose_config):
#   latency    - few (token, 16-head) rows (<= sm_count / 8): 16-head tiles, the top-k split into many
#                short splits, one program per SM (_LATENCY_TUNING);
#   throughput - otherwise: the head bucket's tile (_THROUGHPUT_TUNING), split only until the programs
#                fill programs_per_sm x sm_count.
# Every tile is cross-compiled for its targets by tests/kernels/test_sparse_mla_xcompile.py (shared-memory
# limit, zero ptxas spills but for its SPILL_OUTSIDE_LOOP_OK entry). BLOCK_H=64 with fp8 dequantisation spills on
# every mma.sync target (sm_80/86/89/120) unless the raw tiles are prefetched (fp8_prefetch), and then fits only
# sm_80's shared memory (112 KB), so sm_8x use two 32-head groups; BLOCK_H=64 x BLOCK_N=32 bf16 spills on sm_8x.
# fp8_ds_mla Triton tiles prefetch the next block's raw tiles (stop 46, H100 on both builds): on the mma.sync build
# 19-26% faster than the same tile without (T=128 x 64 heads 488 against 631 us), sm_80's h64n32w8p2r 1.8x (350); on
# sm_90's Triton tiles 7-21% (16 heads, T=1 latency tiles).
# sm90 entries are the H200 sweep's fastest; tile choice measured:
# bench/RESULTS.md#tuning-notes-moved-from-the-kernel-sources. The sm80 / sm8x 64-head bf16 tile (stop 45) is
# h32n32w4p2: 2.4x faster than the spill-free h64n16w8p2 on the mma.sync build (260 against 614 us at T=128 x 64
# heads, 7381 against 19251 at T=4096) for 16-28 spilled bytes, nearly all outside the main loop (the xcompile test
# bounds both).
def _tuning(*, block_h: int, block_n: int, num_warps: int, num_stages: int,
            programs_per_sm: int = 1, fp8_prefetch: int = 0) -> SparseMLATuning:
    return SparseMLATuning(SparseMLAConfig(block_h=block_h, block_n=block_n, num_warps=num_warps,
                                           num_stages=num_stages, fp8_prefetch=fp8_prefetch), programs_per_sm)


_TRITON_36 = _TRITON_VERSION >= (3, 6)
_LATENCY_TUNING: dict[tuple[str, str], SparseMLATuning] = {
    ("sm90", "bf16"): _tuning(block_h=16, block_n=64, num_warps=8, num_stages=2),
    ("sm90", "fp8_ds_mla"): _tuning(block_h=16, block_n=64, num_warps=8, num_stages=2, fp8_prefetch=True),
    # 8 warps spill 4 B with Triton 3.5 here
    ("sm80", "bf16"): _tuning(block_h=16, block_n=64, num_warps=4, num_stages=2),
    ("sm80", "fp8_ds_mla"): _tuning(block_h=16, block_n=64, num_warps=8, num_stages=2, fp8_prefetch=True),
    # 8 warps spill 4 B on sm_120 (ptxas 12.9)
    ("sm8x", "bf16"): _tuning(block_h=16, block_n=32, num_warps=4, num_stages=2),
    # prefetching: Triton 3.5 spills 4 B on sm_86
    ("sm8x", "fp8_ds_mla"): _tuning(block_h=16, block_n=32, num_warps=8, num_stages=2, fp8_prefetch=_TRITON_36),
}
# Triton 3.5 (vLLM 0.16.0's torch) spills 120-130+ B at 64 heads x n64p3 on sm_90 (bf16 and fp8
# dequantisation); Triton 3.6 does not. The 3.5 fallbacks are the next-best spill-free tiles.
_THROUGHPUT_TUNING: dict[tuple[str, str, int], SparseMLATuning] = {
    ("sm90", "bf16", 16): _tuning(block_h=16, block_n=64, num_warps=4, num_stages=2, programs_per_sm=2),
    ("sm90", "bf16", 32): _tuning(block_h=32, block_n=64, num_warps=8, num_stages=2),
    ("sm90", "bf16", 64): (_tuning(block_h=64, block_n=64, num_warps=8, num_stages=3) if _TRITON_36
                           else _tuning(block_h=64, block_n=32, num_warps=8, num_stages=2)),
    ("sm90", "fp8_ds_mla", 16): _tuning(block_h=16, block_n=32, num_warps=4, num_stages=2, programs_per_sm=2,
                                        fp8_prefetch=True),
    ("sm90", "fp8_ds_mla", 32): _tuning(block_h=32, block_n=32, num_warps=8, num_stages=2),
    ("sm90", "fp8_ds_mla", 64): (_tuning(block_h=64, block_n=64, num_warps=8, num_stages=3) if _TRITON_36
                                 else _tuning(block_h=32, block_n=32, num_warps=8, num_stages=2)),
    ("sm80", "bf16", 16): _tuning(block_h=16, block_n=64, num_warps=4, num_stages=2),
    ("sm80", "bf16", 32): _tuning(block_h=32, block_n=64, num_warps=8, num_stages=2),
    ("sm80", "bf16", 64): _tuning(block_h=32, block_n=32, num_warps=4, num_stages=2),
    ("sm80", "fp8_ds_mla", 16): _tuning(block_h=16, block_n=64, num_warps=8, num_stages=2, fp8_prefetch=True),
    ("sm80", "fp8_ds_mla", 32): _tuning(block_h=32, block_n=32, num_warps=8, num_stages=2, fp8_prefetch=True),
    ("sm80", "fp8_ds_mla", 64): _tuning(block_h=64, block_n=32, num_warps=8, num_stages=2, fp8_prefetch=True),
    ("sm8x", "bf16", 16): _tuning(block_h=16, block_n=32, num_warps=4, num_stages=2),
    ("sm8x", "bf16", 32): _tuning(block_h=32, block_n=32, num_warps=8, num_stages=2),
    ("sm8x", "bf16", 64): _tuning(block_h=32, block_n=32, num_warps=4, num_stages=2),
    ("sm8x", "fp8_ds_mla", 16): _tuning(block_h=16, block_n=32, num_warps=8, num_stages=2, fp8_prefetch=_TRITON_36),
    ("sm8x", "fp8_ds_mla", 32): _tuning(block_h=32, block_n=32, num_warps=8, num_stages=2, fp8_prefetch=True),
    ("sm8x", "fp8_ds_mla", 64): _tuning(block_h=32, block_n=32, num_warps=8, num_stages=2, fp8_prefetch=True),
}
# sm_10x (B200/GB200; tcgen05 instead of wgmma): the sm80 tiles, except the 64-head ones (bf16 and fp8_ds_mla):
# 64-head tiles with DV_SPLIT=1 lower to a lone `trap` for sm_100 (tests/kernels/test_sparse_mla_xcompile.py checks
# every target). Untuned: no sm_10x hardware here.
for _table in (_LATENCY_TUNING, _THROUGHPUT_TUNING):
    _table.update({("sm100", *key[1:]): entry for key, entry in list(_table.items()) if key[0] == "sm80"})
_THROUGHPUT_TUNING[("sm100", "bf16", 64)] = _tuning(block_h=32, block_n=32, num_warps=8, num_stages=2)
_THROUGHPUT_TUNING[("sm100", "fp8_ds_mla", 64)] = _tuning(block_h=32, block_n=32, num_warps=8, num_stages=2,
                                                          fp8_prefetch=True)

# sm_90, 64-head bucket: the Gluon kernel (sparse_mla_sm90.py; num_stages = its gather buffers) wherever
# the batch has at least GLUON_MIN_ROWS[format] (token, 64-head group) rows (checked before the latency regime). On the
# H200 (bench/RESULTS.md) bf16 took 30-34% off the Triton tile's time at T=128 (H=64 and 128) and at T=4096, 17%
# at T=32; fp8_ds_mla (2026-12-04) 20-29% at T=32 and T=128. Small batches (bench/small_batch.py, 2026-12-05,
# timed as the backend calls them): bf16 from 5 rows (10-27% faster than the Triton tile at 5-16 rows; at 4 rows
# even with the latency tile, which converts request-local positions inline and so launches once less);
# fp8_ds_mla from 10 rows (6-8% faster than the Triton tile there; at 5-8 rows within 2% of it: its dequantisation
# is not overlapped there but its gathers are pipelined three deep).
# Used where GLUON_DEFAULT holds: a Triton with Gluon for Hopper, compiled kernels (not the interpreter), and
# DSA_OVERLAY_GLUON unset or 1 (0: the Triton tiles everywhere, e.g. for a Triton whose Gluon differs).
_GLUON_TUNING: dict[tuple[str, str, int], SparseMLATuning] = {
    ("sm90", "bf16", 64): SparseMLATuning(SparseMLAConfig(block_h=64, block_n=64, num_warps=8, num_stages=2,
                                                          gluon=True)),
    ("sm90", "fp8_ds_mla", 64): SparseMLATuning(SparseMLAConfig(block_h=64, block_n=64, num_warps=8, num_stages=2,
                                                                gluon=True)),
}
GLUON_MIN_ROWS: dict[str, int] = {"bf16": 5, "fp8_ds_mla": 10}
# sm_90, 64-head bucket, from GLUON_WS_MIN_ROWS[format] rows: the warp-specialised Gluon tile (sparse_mla_sm90.py,
# 4 launch warps: a producer warpgroup and two math warpgroups; Triton 3.6 on), checked before GLUON_MIN_ROWS. On the
# H100 (bench/RESULTS.md): bf16 (stop 39) 1.04-1.08x the 8-warp tile's speed at T=128 x 64 heads, 1.24-1.25x at 128
# heads, 1.01-1.07x at 24-64 rows but a tie at 32 (0.96-0.99x), 0.94-0.95x below 24 rows; a T=4096 prefill 0.99-1.09x
# (the noisy row). fp8_ds_mla (stop 40) 1.09-1.31x the 8-warp tile at 8-4096 tokens and 1.09-1.32x the Triton tile at
# 3-16 rows (a tie at 2 rows, where the latency tile stays).
_GLUON_WS_TUNING: dict[tuple[str, str, int], SparseMLATuning] = {
    ("sm90", "bf16", 64): SparseMLATuning(SparseMLAConfig(block_h=64, block_n=64, num_warps=4, num_stages=2,
                                                          gluon=True)),
    ("sm90", "fp8_ds_mla", 64): SparseMLATuning(SparseMLAConfig(block_h=64, block_n=64, num_warps=4, num_stages=2,
                                                                gluon=True)),
}
GLUON_WS_MIN_ROWS: dict[str, int] = {"bf16": 24, "fp8_ds_mla": 3}
# The latency tile (16 heads) at 64+ heads runs ceil(H / 16) head groups over the same rows: for fp8_ds_mla each
# group gathers and dequantises every row again. On the H200 (bench/small_batch.py, 2026-12-05, backend calls)
# it took 27.2 / 34.9 us at 3 / 4 rows (64 heads) and 34.0 at 4 (128 heads), where the 64-head Triton tile took
# 23.7 / 26.1 / 25.0, and won at 1-2 rows (4-32%): there the latency regime ends at this many rows. bf16 keeps the
# sm_count / 8 rule (its latency tile was 11-35% faster than the 64-head Triton tile at 1-3 rows).
_LATENCY_MAX_ROWS64: dict[tuple[str, str], int] = {("sm90", "fp8_ds_mla"): 2}
GLUON_DEFAULT = _GLUON and not INTERPRETED and _gluon_wanted()

# Variants the benchmark's --focus mode times on sm_90 beside the table tiles (bench/bench_sparse_mla.py);
# cross-compiled for sm_90 by tests/kernels/test_sparse_mla_xcompile.py so that a faster one can enter
# _THROUGHPUT_TUNING knowing it fits and does not spill there (with Triton 3.6; under Triton 3.5 the
# 64-head ones spill, so a promoted one needs a 3.5 fallback like the bucket-64 entries).
# fp8_post_scale with 64 heads (n64p3, d1 and d2) and with h16n32w4 spills on sm_90 (Triton 3.6).
# The 128-head d2 tiles (H > 64 only): Triton gives a chained dot's warpgroups whole rows of S (warpsPerCTA
# [num_warps, 1]), so a 64-head tile at 8 warps computes Q.K^T and the softmax twice, once per warpgroup (the
# sm_90 TTGIR: warpsPerCTA [8, 1] for 64 rows); 128 heads give each warpgroup 64 heads of its own, and d2 keeps
# the accumulator at 128 x 256 (226 registers, 221 KB of shared memory, no spill on sm_90 with Triton 3.6).
# Measured 9-10% slower than h64n64w8p3 at T=128 H=128 on the H200 (the value split gathers every row twice):
# benchmark candidates only (bench/RESULTS.md). The fix that worked is the Gluon tile (sparse_mla_sm90.py), whose
# score wgmma is laid out by hand over the two warpgroups by keys; its n32 variants with 3-4 buffers lost to n64 x 2.
FOCUS_CONFIGS: dict[str, tuple[SparseMLAConfig, ...]] = {
    "bf16": (SparseMLAConfig(block_h=64, block_n=64, num_warps=8, num_stages=3, dv_split=2),
             SparseMLAConfig(block_h=64, block_n=32, num_warps=8, num_stages=5),
             SparseMLAConfig(block_h=64, block_n=32, num_warps=8, num_stages=4, dv_split=2),
             SparseMLAConfig(block_h=16, block_n=32, num_warps=4, num_stages=3),
             SparseMLAConfig(block_h=128, block_n=32, num_warps=8, num_stages=2, dv_split=2),
             SparseMLAConfig(block_h=128, block_n=16, num_warps=8, num_stages=2, dv_split=2),
             # sm_90 Gluon kernel (sparse_mla_sm90.py): the score wgmma split over the two warpgroups by keys
             SparseMLAConfig(block_h=64, block_n=64, num_warps=8, num_stages=2, gluon=True),
             SparseMLAConfig(block_h=64, block_n=32, num_warps=8, num_stages=3, gluon=True),
             SparseMLAConfig(block_h=64, block_n=32, num_warps=8, num_stages=4, gluon=True),
             # the warp-specialised Gluon tile (a producer and two math warpgroups)
             SparseMLAConfig(block_h=64, block_n=64, num_warps=4, num_stages=2, gluon=True)),
    # the Gluon tile on an fp8_ds_mla cache (block i + 1 dequantised while block i's P.V runs; num_stages = raw
    # gather buffers: 2 fit at block_n 64, up to 5 at 32)
    "fp8_ds_mla": (SparseMLAConfig(block_h=64, block_n=64, num_warps=8, num_stages=2, gluon=True),
                   SparseMLAConfig(block_h=64, block_n=32, num_warps=8, num_stages=3, gluon=True),
                   SparseMLAConfig(block_h=64, block_n=32, num_warps=8, num_stages=4, gluon=True),
                   SparseMLAConfig(block_h=16, block_n=64, num_warps=8, num_stages=2, fp8_post_scale=True),
                   SparseMLAConfig(block_h=64, block_n=64, num_warps=8, num_stages=3, dv_split=2),
                   SparseMLAConfig(block_h=64, block_n=32, num_warps=8, num_stages=5),
                   SparseMLAConfig(block_h=16, block_n=32, num_warps=4, num_stages=3),
                   SparseMLAConfig(block_h=128, block_n=32, num_warps=8, num_stages=2, dv_split=2),
                   # the warp-specialised tile (a producer warpgroup dequantises, two math warpgroups)
                   SparseMLAConfig(block_h=64, block_n=64, num_warps=4, num_stages=2, gluon=True),
                   # the 16-head throughput and the latency tile with the next block's raw tiles prefetched
                   SparseMLAConfig(block_h=16, block_n=32, num_warps=4, num_stages=2, fp8_prefetch=True),
                   SparseMLAConfig(block_h=16, block_n=64, num_warps=8, num_stages=2, fp8_prefetch=True),
                   SparseMLAConfig(block_h=32, block_n=32, num_warps=8, num_stages=2, fp8_prefetch=True),
                   SparseMLAConfig(block_h=64, block_n=32, num_warps=8, num_stages=2, fp8_prefetch=True),
                   # the same two 16-head tiles and the 32-head one decoding the next block's tiles one iteration
                   # ahead (fp8_prefetch 2; their mma.sync loops, cross-compiled for sm_90: 1227 -> 946, 1199 -> 914
                   # and 926 -> 763 instructions against the raw-tile prefetch)
                   SparseMLAConfig(block_h=16, block_n=32, num_warps=4, num_stages=2, fp8_prefetch=2),
                   SparseMLAConfig(block_h=16, block_n=64, num_warps=8, num_stages=2, fp8_prefetch=2),
                   SparseMLAConfig(block_h=32, block_n=32, num_warps=8, num_stages=2, fp8_prefetch=2)),
}
# The same in tuple form (the benchmark and the kernel tests concatenate it with candidate_tiles()).
FOCUS_TILES: dict[str, list[tuple]] = {fmt: [c.tile for c in cs] for fmt, cs in FOCUS_CONFIGS.items()}


def _family(capability: tuple[int, int]) -> str:
    """Tuning-table family of a (major, minor) capability, by shared memory per block: "sm90" (Hopper,
    227 KB), "sm100" (datacenter Blackwell, 227 KB, tcgen05), "sm80" (A100, 163 KB), "sm8x" (sm_86 / sm_87 / sm_89 / sm_12x and anything unknown: the small
    99 KB budget of the consumer and workstation parts, DGX Spark)."""
    major, minor = capability
    if major == 9:
        return "sm90"
    if major == 10:
        return "sm100"
    if major == 8 and minor == 0:
        return "sm80"
    return "sm8x"


def _head_bucket(num_heads: int) -> int:
    return 16 if num_heads <= 16 else (32 if num_heads <= 32 else 64)


def candidate_tiles(capability: tuple[int, int], kv_format: str) -> list[tuple]:
    """Every tile (block_h, block_n, num_warps, num_stages, dv_split, fp8_post_scale, gluon) that
    :func:`choose_config` can return for a target, with or without Gluon (SparseMLAConfig.from_tile turns
    one into a config)."""
    fam = _family(capability)
    tiles = {e.config.tile for table in (_THROUGHPUT_TUNING, _GLUON_TUNING, _GLUON_WS_TUNING)
             for (f, fmt, _), e in table.items() if f == fam and fmt == kv_format}
    tiles.add(_LATENCY_TUNING[(fam, kv_format)].config.tile)
    return sorted(tiles)


@functools.cache
def choose_config(num_tokens: int, num_heads: int, topk: int, kv_format: str = "bf16", *,
                  sm_count: int = 132, capability: tuple[int, int] = (9, 0),
                  gluon: bool | None = None) -> SparseMLAConfig:
    """Heuristic launch configuration (no autotuning: nothing recompiles when the batch size changes;
    cached, the result is frozen).

    Where ``gluon`` (default GLUON_DEFAULT) allows it: the head bucket's warp-specialised Gluon tile
    (_GLUON_WS_TUNING) where this Triton builds it and T x ceil(H / 64) >= GLUON_WS_MIN_ROWS[kv_format], else its
    Gluon tile (_GLUON_TUNING) from GLUON_MIN_ROWS[kv_format] such rows. Otherwise, in the latency regime
    (T x ceil(H / 16) <= sm_count / 8, e.g. T = 1 at any H, T = 8 at H <= 16; at 64+ heads also at most
    _LATENCY_MAX_ROWS64[(family, kv_format)] (token, 64-head) rows where that is set): the 16-head latency tile;
    else the head bucket's throughput tile. Then the top-k list is split so
    that T x head groups x splits fills the tile's programs-per-SM x sm_count (waves over the SMs), at
    most one split per BLOCK_N tile and never an empty split; splits are merged by lse in a second kernel.
    """
    fam = _family(capability)
    gluon = GLUON_DEFAULT if gluon is None else gluon
    key = (fam, kv_format, _head_bucket(num_heads))
    rows64 = rows_of_64_heads(num_tokens, num_heads)
    latency_cap = _LATENCY_MAX_ROWS64.get((fam, kv_format)) if key[2] == 64 else None
    if gluon and ws_builds(kv_format) and key in _GLUON_WS_TUNING and rows64 >= GLUON_WS_MIN_ROWS[kv_format]:
        entry = _GLUON_WS_TUNING[key]
    elif gluon and key in _GLUON_TUNING and rows64 >= GLUON_MIN_ROWS[kv_format]:
        entry = _GLUON_TUNING[key]
    elif latency_regime(num_tokens, num_heads, sm_count) and (latency_cap is None or rows64 <= latency_cap):
        entry = _LATENCY_TUNING[(fam, kv_format)]
    else:
        entry = _THROUGHPUT_TUNING[key]
    splits = split_count(num_tokens, num_heads, topk, entry.config, entry.programs_per_sm, sm_count)
    return replace(entry.config, num_splits=splits)


def ws_builds(kv_format: str) -> bool:
    """Whether this Triton builds the warp-specialised sm_90 tile for this cache format (sparse_mla_sm90.WS, WS_FP8)."""
    return _WS_FP8 if kv_format == "fp8_ds_mla" else _WS


def rows_of_64_heads(num_tokens: int, num_heads: int) -> int:
    """(token, 64-head group) rows of a batch, T x ceil(H / 64): what GLUON_MIN_ROWS and _LATENCY_MAX_ROWS64
    count."""
    return max(1, num_tokens) * _cdiv(num_heads, 64)


def latency_regime(num_tokens: int, num_heads: int, sm_count: int = 132) -> bool:
    """Few (token, 16-head) rows: T x ceil(H / 16) <= sm_count / 8 (T = 1 at any H, T <= 16 at H <= 16)."""
    return max(1, num_tokens) * _cdiv(num_heads, 16) <= max(1, sm_count // 8)


def split_count(num_tokens: int, num_heads: int, topk: int, tile: "tuple | SparseMLAConfig",
                programs_per_sm: int = 1, sm_count: int = 132) -> int:
    """Splits of the top-k list so that T x head groups x dv_split x splits programs fill
    programs_per_sm x sm_count (at most one split per BLOCK_N tile, no empty split). ``tile``: a config
    or its tuple form."""
    if not isinstance(tile, SparseMLAConfig):
        tile = SparseMLAConfig.from_tile(tile)
    rows = max(1, num_tokens) * triton.cdiv(num_heads, tile.block_h) * tile.dv_split
    unit = tile.split_unit
    n_tiles = triton.cdiv(max(topk, 1), unit)
    splits = max(1, min(n_tiles, (programs_per_sm * sm_count) // rows))
    # Re-derive from the split length so that no split is empty.
    split_len = triton.cdiv(triton.cdiv(max(topk, 1), splits), unit) * unit
    return triton.cdiv(max(topk, 1), split_len)


@functools.cache
def _cuda_info(device_index: int) -> tuple[tuple[int, int], int]:
    props = torch.cuda.get_device_properties(device_index)
    return (props.major, props.minor), props.multi_processor_count


def _device_info(device: torch.device) -> tuple[tuple[int, int], int]:
    """(capability, number of SMs) that choose_config plans for on ``device``; the interpreter plans for
    an H200 (sm_90, 132 SMs)."""
    if INTERPRETED:
        return (9, 0), 132
    if device.type != "cuda":
        raise ValueError(f"sparse_mla_attention: tensors are on {device}; the Triton kernel needs CUDA tensors "
                         "(or TRITON_INTERPRET=1 set before this module is imported, for CPU tests)")
    return _cuda_info(device.index if device.index is not None else torch.cuda.current_device())


# ----------------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------------
def _slot_view(kv_cache: torch.Tensor, kv_format: str) -> tuple[torch.Tensor, int, int, int, int]:
    """Return (cache as one flat row per slot, stride_block, stride_token, block_size, num_slots)."""
    width = HEAD_DIM if kv_format == "bf16" else FP8_DS_MLA_BYTES
    if kv_cache.dim() == 4:  # [num_blocks, block_size, 1, width] (FlashMLA's num_heads_k = 1 view)
        if kv_cache.shape[2] != 1:
            raise ValueError(f"sparse_mla_attention: kv_cache {tuple(kv_cache.shape)} has "
                             f"{kv_cache.shape[2]} KV heads; MLA has exactly one")
        kv_cache = kv_cache[:, :, 0]
    if kv_cache.dim() == 2:  # [num_slots, width]
        kv_cache = kv_cache.unsqueeze(1)
    if kv_cache.dim() != 3 or kv_cache.shape[-1] != width:
        raise ValueError(f"sparse_mla_attention: kv_cache shape {tuple(kv_cache.shape)} does not match "
                         f"kv_format={kv_format!r}; expected [num_blocks, block_size, {width}]")
    if kv_cache.stride(-1) != 1:
        raise ValueError("sparse_mla_attention: kv_cache must be contiguous in its last dimension")
    num_blocks, block_size, _ = kv_cache.shape
    stride_b, stride_t = kv_cache.stride(0), kv_cache.stride(1)
    if block_size == 1:
        stride_t = 0
    if num_blocks == 1:
        stride_b = 0
    return kv_cache, stride_b, stride_t, block_size, num_blocks * block_size


_SLOTS_BLOCK = 1024  # top-k positions per program of _request_slots_kernel
# Request-local indices are converted inside the attention kernel (PAGED) in the latency regime (latency_regime:
# few rows, many short splits, where a launch's host and GPU cost is what a call pays) for tiles of up to this many
# heads; everywhere else one small launch converts them first. Measured on the H200: inline the dependent
# block-table gather costs 13-14 us of GPU time at T=128 (16 or 8 heads, bf16, 95 -> 109 us), more than the
# conversion launch; at T=1 it costs 0.1-0.7 us and saves a launch. The 64-head tiles run at 255 registers, where the
# inline conversion's extra live values spill (4-56 B on sm_90 with Triton 3.6, tests/kernels/test_sparse_mla_xcompile.py).
INLINE_PAGED_MAX_BLOCK_H = 32
INLINE_PAGED = True  # False: always the conversion launch (benchmarks compare the two; reset_plans() after a change)
SKIP_TAIL = True  # False: the kernels walk every index of a split, -1 tail included (benchmarks; reset_plans() after)
# The tail scan costs a dependent index load before a program's loop (~1 us): measured on the H200 (bench/RESULTS.md)
# 7-9% slower at T=1 (32 splits of one 64-row block), 5-29% faster where splits hold 8+ blocks (T=32, T=128 at 16
# heads with a 500-700-entry context, a causal 4096-token prompt). Splits of fewer blocks than this walk the tail.
SKIP_TAIL_MIN_BLOCKS = 4


def _check_gluon(config: SparseMLAConfig, kv_format: str, capability: tuple[int, int]) -> None:
    """A gluon=True config runs sparse_mla_sm90.py's kernel: refuse what it does not do, in one line."""
    why = None
    if not _GLUON:
        why = f"Triton {triton.__version__} has no Gluon for Hopper"
    elif INTERPRETED:
        why = "Gluon kernels do not run in Triton's interpreter"
    elif capability[0] != 9:
        why = f"it is an sm_90 kernel (this GPU is sm_{capability[0]}{capability[1]})"
    elif kv_format not in KV_FORMATS:
        why = f"it reads a bf16 or fp8_ds_mla cache, not {kv_format}"
    elif config.ws:
        if not _WS:
            why = f"Triton {triton.__version__}'s Gluon has no warp_specialize([(function, args), ...]) (3.6 on)"
        elif not ws_builds(kv_format):
            why = (f"its fp8_ds_mla schedule spills under Triton {triton.__version__} (it is built with Triton 3.6-3.8; "
                   "the 8-warp tile h64n64s*w8p2g runs there)")
        elif (config.block_h, config.block_n, config.num_stages, config.dv_split, config.fp8_post_scale) != (
                64, 64, 2, 1, False):
            why = "the warp-specialised tile (4 warps) is h64n64 with 2 buffers (p2), without d2 or f"
    elif (config.block_h, config.num_warps, config.dv_split, config.fp8_post_scale) != (64, 8, 1, False):
        why = "it is the 64-head tile of 8 warps (or 4: the warp-specialised one) without d2 or f"
    elif config.block_n not in (32, 64) or config.num_stages < 2:
        why = "block_n must be 32 or 64 and num_stages (gather buffers) >= 2"
    elif (need := _gluon_shared_bytes(kv_format == "fp8_ds_mla", config.block_n, config.num_stages)) > _SM90_SHARED:
        why = (f"{config.num_stages} gather buffers of {config.block_n} rows need {need} B of shared memory, "
               f"more than sm_90's {_SM90_SHARED}")
    if why:
        raise ValueError(f"sparse_mla_attention: config {config} (gluon) cannot run: {why}; "
                         "leave config unset for the default")


def _cdiv(a: int, b: int) -> int:
    """triton.cdiv without its per-call JIT-callable overhead (host launch path)."""
    return -(-a // b)


def _q_parts(q) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(nope queries, rope queries, offset of the rope values in the second) of q = [T, H, 576] or the pair
    (q_nope [T, H, 512], q_pe [T, H, 64]) that vLLM's MLA layer hands over (no concatenation)."""
    if isinstance(q, (tuple, list)):
        if len(q) != 2 or not all(isinstance(x, torch.Tensor) for x in q):
            raise ValueError("sparse_mla_attention: q must be a tensor [T, H, 576] or the pair (q_nope, q_pe)")
        qn, qr = q
        if (qn.dim() != 3 or qr.dim() != 3 or qn.shape[-1] != KV_LORA_RANK or qr.shape[-1] != ROPE_DIM
                or qn.shape[:2] != qr.shape[:2]):
            raise ValueError(f"sparse_mla_attention: q must be the pair (q_nope [T, H, {KV_LORA_RANK}], q_pe [T, H, "
                             f"{ROPE_DIM}]), got {tuple(qn.shape)} and {tuple(qr.shape)}")
        if qn.dtype != qr.dtype or qn.device != qr.device:
            raise ValueError(f"sparse_mla_attention: q_nope and q_pe differ in dtype or device ({qn.dtype} on "
                             f"{qn.device}, {qr.dtype} on {qr.device})")
        return qn, qr, 0
    if not isinstance(q, torch.Tensor) or q.dim() != 3 or q.shape[-1] != HEAD_DIM:
        raise ValueError(f"sparse_mla_attention: q must be [T, H, {HEAD_DIM}] (or the pair q_nope, q_pe), got "
                         f"{tuple(getattr(q, 'shape', ()))}")
    return q, q, KV_LORA_RANK


def _check_paged(q, indices, block_table, req_id) -> bool:
    """True when request-local indices come with their block table (see sparse_mla_attention)."""
    if block_table is None and req_id is None:
        return False
    if block_table is None or req_id is None:
        raise ValueError("sparse_mla_attention: block_table and req_id go together (request-local indices)")
    if block_table.dim() != 2 or block_table.dtype != torch.int32 or block_table.stride(1) != 1:
        raise ValueError(f"sparse_mla_attention: block_table must be [num_reqs, max_blocks] int32 with contiguous "
                         f"rows, got {tuple(block_table.shape)} {block_table.dtype}")
    if req_id.dim() != 1 or req_id.dtype != torch.int32 or req_id.shape[0] < q.shape[0] or req_id.stride(0) != 1:
        raise ValueError(f"sparse_mla_attention: req_id must be a contiguous int32 [>= T={q.shape[0]}], got "
                         f"{tuple(req_id.shape)} {req_id.dtype}")
    return True


def _check_inputs(q, kv_cache, indices, kv_format, paged=False):
    """Checks shared by the kernel and the reference; q is [T, H, 576] or its nope part [T, H, 512]."""
    if kv_format not in KV_FORMATS:
        raise ValueError(f"sparse_mla_attention: kv_format must be one of {KV_FORMATS}, got {kv_format!r}")
    if q.dim() != 3 or q.shape[-1] not in (HEAD_DIM, KV_LORA_RANK):
        raise ValueError(f"sparse_mla_attention: q must be [T, H, {HEAD_DIM}], got {tuple(q.shape)}")
    if not 1 <= q.shape[1] <= 128:
        raise ValueError(f"sparse_mla_attention: H must be in 1..128, got {q.shape[1]}")
    if indices.dim() == 3 and indices.shape[1] == 1:  # FlashMLA's [T, h_kv=1, topk]
        indices = indices[:, 0]
    rows_ok = indices.shape[0] >= q.shape[0] if paged and indices.dim() == 2 else indices.shape[0] == q.shape[0]
    if indices.dim() != 2 or not rows_ok or indices.shape[1] < 1:
        raise ValueError(f"sparse_mla_attention: indices must be [T={q.shape[0]}, topk>=1], "
                         f"got {tuple(indices.shape)}")
    if indices.dtype != torch.int32:
        raise ValueError(f"sparse_mla_attention: indices must be int32, got {indices.dtype}")
    if kv_format == "bf16" and kv_cache.dtype != torch.bfloat16:
        raise ValueError(f"sparse_mla_attention: kv_format='bf16' needs a bfloat16 kv_cache, got {kv_cache.dtype}")
    if kv_format == "fp8_ds_mla" and kv_cache.element_size() != 1:
        raise ValueError("sparse_mla_attention: kv_format='fp8_ds_mla' needs a 1-byte (uint8) kv_cache, "
                         f"got {kv_cache.dtype}")
    return indices


def sparse_mla_attention(
    q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float,
    kv_format: str = "bf16",
    *,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    config: SparseMLAConfig | None = None,
    block_table: torch.Tensor | None = None,
    req_id: torch.Tensor | None = None,
    with_lse: bool = True,
    _fp8_native: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sparse MLA attention over a paged latent KV cache (decode and prefill alike).

    Arguments:
        q: [T, H, 576] torch.bfloat16. Absorbed queries: 512 "nope" values (q_nope @ W_UK) then 64 rope
            values. T is the number of query tokens (any T >= 0), H any head count in 1..128. The last
            dimension must be contiguous; T and H may be strided. Or the pair (q_nope [T, H, 512], q_pe
            [T, H, 64]), each bfloat16 with a contiguous last dimension (vLLM's MLA layer hands q over
            this way; read in place, never concatenated).
        kv_cache: the paged latent cache, viewed as one row per slot. Shapes accepted:
            [num_blocks, block_size, W], [num_blocks, block_size, 1, W] (FlashMLA's view),
            [num_slots, 1, W] or [num_slots, W]; the last dimension contiguous, blocks may be strided.
            kv_format="bf16": torch.bfloat16, W = 576 (512 kv_c values, then 64 k_pe values).
            kv_format="fp8_ds_mla": torch.uint8 (any 1-byte dtype), W = 656 bytes per token:
                bytes [0, 512):   512 float8_e4m3fn values (kv_c quantised in 4 tiles of 128),
                bytes [512, 528): 4 float32 scales, scale i dequantises values [128*i, 128*i+128),
                                  value = float(fp8) * scale,
                bytes [528, 656): 64 bfloat16 k_pe (rope) values, not quantised.
            Slot s lives at block s // block_size, offset s % block_size.
        indices: [T, topk] (or [T, 1, topk]) torch.int32 slot ids; any topk >= 1. An id < 0 or
            >= num_blocks * block_size is skipped. Duplicated ids are attended once per occurrence.
        softmax_scale: float multiplying q . k before the softmax (e.g. 1/sqrt(576) times any yarn mscale).
        kv_format: "bf16" or "fp8_ds_mla" (the layout above, as written by vLLM's FlashMLA sparse path).
        out: optional [T, H, 512] bfloat16 (or float16/float32) tensor to write the output into;
            last dimension contiguous.
        lse: optional [T, H] float32 tensor to write the log-sum-exp into (any strides).
        config: optional :class:`SparseMLAConfig`; default :func:`choose_config` for this device.
        block_table, req_id: give both to pass request-local indices (vLLM's indexer output) instead of
            slot ids: ``indices[t, j]`` is then a position p in token t's request, read from slot
            ``block_table[req_id[t], p // block_size] * block_size + p % block_size`` (block_size: the
            cache's); p < 0, a block past the table's width or a negative table entry is skipped.
            block_table: [num_reqs, max_blocks] int32, rows contiguous; req_id: [>= T] int32 (rows past
            T unread); indices may then have more than T rows (a fixed-address buffer; rows past T are
            unread). Same result as converting the indices first; for decode-sized calls the kernel converts each
            position as it reads it (no launch or allocation of its own), otherwise one small launch converts
            them first (see INLINE_PAGED_MAX_BLOCK_H).
        with_lse: False (and no ``lse`` given): the caller does not want the log-sum-exp; the kernel writes it
            into a per-stream scratch buffer instead of a tensor allocated per call, and None is returned.
        _fp8_native: testing hook: force (True) or avoid (False) the native e4m3 conversion
            (default: native on sm_89+ and in the interpreter, bit-manipulation on sm_80/86).

    Returns:
        out: [T, H, 512], the attention output (bfloat16 unless ``out`` was given).
        lse: [T, H] float32, natural-log log-sum-exp of the scaled scores over the valid indices (None with
            with_lse=False and no ``lse`` given).
        A row without any valid index gets out = 0 and lse = -inf (never NaN).
    """
    with_lse = bool(with_lse) or lse is not None
    key = _plan_key(q, kv_cache, indices, kv_format, out, lse, config, block_table, req_id, _fp8_native, with_lse)
    plan = _PLANS.get(key)
    if plan is None:  # validates every argument; a repeat call with the same key reuses it
        plan = _PLANS.keep(key, _Plan(q, kv_cache, indices, kv_format, out, lse, config, block_table, req_id,
                                      _fp8_native, with_lse))
    try:
        return plan.run(q, kv_cache, indices, softmax_scale, out, lse, block_table, req_id)
    except Exception as e:  # noqa: BLE001 - only a failed build of the heuristic's Gluon tile is handled
        if not (plan.default_gluon and _build_failed(e)):
            raise
        _stop_gluon(e)
    return sparse_mla_attention(q, kv_cache, indices, softmax_scale, kv_format, out=out, lse=lse,
                                block_table=block_table, req_id=req_id, with_lse=with_lse, _fp8_native=_fp8_native)


# The heuristic's Gluon tile is built at its first launch. If this Triton cannot build it (a Gluon API that moved,
# a compiler error, a resource limit), that launch falls back to the Triton tile, and so does every later call: one
# warning in the log, never a failed forward. A config that names the Gluon tile itself still raises.
_log = logging.getLogger(__name__)


def _stop_gluon(e: BaseException) -> None:
    global GLUON_DEFAULT
    GLUON_DEFAULT = False
    choose_config.cache_clear()
    _PLANS.reset()
    _log.warning("dsa-overlay: the sm_90 Gluon attention tile did not build with Triton %s (%s: %s); the Triton "
                 "tile runs instead from now on (%s=0 skips the attempt)", triton.__version__, type(e).__name__,
                 _build_failure_text(e), GLUON_ENV)


# ----------------------------------------------------------------------------------------------------
# Launch plans: host cost of a repeat call
# ----------------------------------------------------------------------------------------------------
# Everything sparse_mla_attention derives from its arguments (checks, views, config, split, grid, strides,
# constexprs) depends on their shapes, strides, dtypes and devices only, so it is planned once per such key
# and a repeat call (every decode step of every layer) allocates its outputs and launches. Each launch keeps
# the launcher's entry (overlay/kernels/launch.py) and the 16-byte alignment of its tensors: a repeat whose
# pointers align the same way launches that binary without Triton's per-argument specialisation (every other
# argument it specialises on is fixed by the plan key); any other goes through the launcher as before.
# Planning is on where every launcher launches directly (not in the interpreter, not with
# DSA_OVERLAY_DIRECT_LAUNCH=0: overlay/kernels/launch.py's PlanTable); the plan is also what an unplanned call
# builds and runs once.
_PLANS = PlanTable(LAUNCHERS)


def _plan_key(q, kv_cache, indices, kv_format, out, lse, config, block_table, req_id, fp8_native, with_lse):
    if not _PLANS.on:
        return None
    try:
        qkey = tuple(map(_tensor_key, q)) if isinstance(q, tuple) else _tensor_key(q)
        key = (qkey, _tensor_key(kv_cache), _tensor_key(indices), kv_format, config, fp8_native, _tensor_key(out),
               _tensor_key(lse), _tensor_key(req_id), with_lse,  # a plan reads the block table's width, not rows
               None if block_table is None else (block_table.shape[1:], block_table.stride(), block_table.dtype,
                                                 block_table.device))
    except (AttributeError, TypeError, IndexError, ValueError):  # not tensors: no plan (the checks say what is wrong)
        return None
    return key


class _Partials:
    """Grow-only float32 scratch for what a call writes and reads back itself (the split partials po / plse, the
    converted slot ids) or never reads (the lse of a call made with_lse=False), one buffer per (device, CUDA
    stream), as FlashMLA keeps its metadata buffer: each torch.empty costs ~4 us of host time on the H200 and
    slicing views of a shared buffer nearly as much (bench/RESULTS.md), so a plan keeps its views and re-slices
    only when the buffer it sliced was replaced (``gen``). Calls on one stream run in stream order, so they may
    share it (a call's kernels write each part before the next kernel of the call reads it); another stream
    gets its own buffer. Never used while a CUDA graph is captured: a capture takes fresh tensors from
    the graph's private pool, which live as long as the graph (a grown, freed buffer would not)."""

    def __init__(self):
        self.bufs: dict = {}
        self.gen = 0

    def get(self, where, numel: int, device) -> torch.Tensor:
        buf = self.bufs.get(where)
        if buf is None or buf.numel() < numel:
            grow = max(numel, 2 * buf.numel()) if buf is not None else numel
            self.bufs[where] = buf = torch.empty(grow, dtype=torch.float32, device=device)
            self.gen += 1
        return buf


_PARTIALS = _Partials()


def _current_stream(device) -> int:
    """The raw current stream of a CUDA device (what Triton's launcher reads per launch, ~0.3 us), 0 elsewhere."""
    return torch._C._cuda_getCurrentRawStream(device.index) if device.type == "cuda" else 0


class _Plan:
    """One call's checked arguments and derived launches (see the comment above)."""

    def __init__(self, q, kv_cache, indices, kv_format, out, lse, config, block_table, req_id, fp8_native,
                 with_lse=True):
        q, qr, self.rope_off = _q_parts(q)
        paged = _check_paged(q, indices, block_table, req_id)
        wrong = _off_device(q.device, kv_cache=kv_cache, indices=indices, out=out, lse=lse, block_table=block_table,
                            req_id=req_id)
        if wrong:
            raise ValueError(f"sparse_mla_attention: {wrong} (q's device); every tensor of a call must be on one "
                             "device")
        self.squeeze_idx = indices.dim() == 3
        indices = _check_inputs(q, kv_cache, indices, kv_format, paged)
        self.u8 = kv_format == "fp8_ds_mla" and kv_cache.dtype != torch.uint8
        if self.u8:
            kv_cache = kv_cache.view(torch.uint8)
        kv, stride_b, stride_t, block_size, num_slots = _slot_view(kv_cache, kv_format)
        self.kv_view = kv_cache.dim()  # 4: drop the KV-head axis, 2: one slot per block, 3: as given
        if q.dtype != torch.bfloat16:
            raise ValueError(f"sparse_mla_attention: q must be bfloat16, got {q.dtype}")
        if q.stride(-1) != 1 or qr.stride(-1) != 1:
            raise ValueError("sparse_mla_attention: q must be contiguous in its last dimension")
        self.copy_idx = indices.stride(-1) != 1
        idx_row = _contiguous_strides(indices)[0] if self.copy_idx else indices.stride(0)  # as the call's copy
        T, H, _ = q.shape
        topk = indices.shape[1]
        if out is not None and (out.shape != (T, H, KV_LORA_RANK) or out.stride(-1) != 1):
            raise ValueError(f"sparse_mla_attention: out must be [T, H, 512] with a contiguous last dimension, "
                             f"got {tuple(out.shape)}")
        if lse is not None and (lse.shape != (T, H) or lse.dtype != torch.float32):
            raise ValueError(f"sparse_mla_attention: lse must be float32 [T, H], got {lse.dtype} {tuple(lse.shape)}")
        self.T, self.H, self.topk = T, H, topk
        self.with_lse = with_lse or lse is not None
        self.kept = (_Kept(_fwd_launch), _Kept(_combine_launch), _Kept(_slots_launch))
        self.default_gluon = False  # the heuristic (no config given) picked the Gluon tile
        self.scratch = None  # (stream, _PARTIALS.gen, (po, plse, lse, slots)) of the workspace views last used
        self.split = self.convert = False
        if T == 0:
            return
        capability, sm_count = _device_info(q.device)
        pdl = _pdl_kwargs(capability)
        if config is None:
            config = choose_config(T, H, topk, kv_format, sm_count=sm_count, capability=capability)
            self.default_gluon = config.gluon
        bh, bn = config.block_h, config.block_n
        if config.gluon:
            _check_gluon(config, kv_format, capability)
            self.kept = (_Kept(_gluon_ws_launch if config.ws else _gluon_launch),) + self.kept[1:]
        # request-local positions: the attention kernel reads the block table itself (inline) in the latency regime
        # for tiles of up to INLINE_PAGED_MAX_BLOCK_H heads; otherwise one small launch converts them to slot ids first
        self.inline = (paged and INLINE_PAGED and bh <= INLINE_PAGED_MAX_BLOCK_H and not config.gluon
                       and latency_regime(T, H, sm_count))
        self.convert = paged and not self.inline
        max_blocks, stride_btr = (block_table.shape[1], block_table.stride(0)) if self.inline else (0, 0)
        idx_stride = topk if self.convert else idx_row  # the slots tensor, or the indices
        if self.convert:
            self.slots_grid = (T, _cdiv(topk, _SLOTS_BLOCK))
            self.slots_ints = (topk, block_size, block_table.shape[1], idx_row, block_table.stride(0))
            self.slots_kw = dict(BLOCK=_SLOTS_BLOCK, num_warps=4, num_stages=1, **pdl)
        if bh not in (16, 32, 64, 128) or bn not in (16, 32, 64, 128):
            raise ValueError(f"sparse_mla_attention: bad config {config}: block_h and block_n must be 16..128, "
                             "powers of two")
        if config.dv_split not in (1, 2):
            raise ValueError(f"sparse_mla_attention: bad config {config}: dv_split must be 1 or 2")
        unit = config.split_unit
        num_splits = max(1, min(config.num_splits, _cdiv(topk, unit)))
        split_len = _cdiv(_cdiv(topk, num_splits), unit) * unit
        num_splits = _cdiv(topk, split_len)
        num_head_groups = _cdiv(H, bh)
        fp8_native = (capability >= (8, 9)) if fp8_native is None else bool(fp8_native)
        self.split, self.num_splits = num_splits > 1, num_splits
        out_s = (H * KV_LORA_RANK, KV_LORA_RANK) if out is None else (out.stride(0), out.stride(1))
        lse_s = (H, 1) if lse is None else (lse.stride(0), lse.stride(1))
        self.grid = (T * num_splits * config.dv_split * num_head_groups,)
        self.fwd_ints = (H, topk, num_slots, block_size, split_len, num_head_groups, num_splits, max_blocks,
                         q.stride(0), q.stride(1), qr.stride(0), qr.stride(1), self.rope_off, stride_b, stride_t,
                         idx_stride, stride_btr) + out_s + lse_s
        self.fwd_kw = dict(
            # (the warp-specialised tile predicates its stores on num_splits: one build serves both)
            IS_FP8=(kv_format == "fp8_ds_mla"), FP8_NATIVE=fp8_native, SPLIT=self.split and not config.ws,
            DOT_F32=INTERPRETED,
            BLOCK_H=bh, BLOCK_N=bn, DV_SPLIT=config.dv_split,
            FP8_POST=bool(config.fp8_post_scale) and kv_format == "fp8_ds_mla", PAGED=self.inline,
            SKIP_TAIL=SKIP_TAIL and split_len >= SKIP_TAIL_MIN_BLOCKS * bn,
            num_warps=config.num_warps, num_stages=config.num_stages, **pdl)
        if config.fp8_prefetch and kv_format == "fp8_ds_mla" and not config.gluon:
            self.fwd_kw.update(PREFETCH=int(config.fp8_prefetch))
        if config.gluon:  # its gather buffers are num_stages; Triton does not software-pipeline Gluon code
            self.fwd_kw.update(NUM_BUF=config.num_stages, P_SWIZZLE=min(128, 2 * bn), num_stages=1)
        if self.split:
            chunk, block_d = _combine_bucket(num_splits)
            self.comb_grid = (T * H, KV_LORA_RANK // block_d)
            self.comb_ints = (H, num_splits) + out_s + lse_s
            self.comb_kw = dict(CHUNK_S=chunk, BLOCK_D=block_d, num_warps=4, num_stages=1, **pdl)

    def run(self, q, kv_cache, indices, softmax_scale, out, lse, block_table, req_id):
        T, H = self.T, self.H
        q, qr = q if self.rope_off == 0 else (q, q)
        if self.u8:
            kv_cache = kv_cache.view(torch.uint8)
        kv = kv_cache[:, :, 0] if self.kv_view == 4 else kv_cache.unsqueeze(1) if self.kv_view == 2 else kv_cache
        if self.squeeze_idx:
            indices = indices[:, 0]
        if self.copy_idx:
            indices = indices.contiguous()
        if out is None:
            out = torch.empty((T, H, KV_LORA_RANK), dtype=torch.bfloat16, device=q.device)
        if lse is None and self.with_lse:
            lse = torch.empty((T, H), dtype=torch.float32, device=q.device)
        if T == 0:
            return out, lse
        returned = lse
        if self.split or self.convert or lse is None:
            po, plse, lse_scratch, slots = self._scratch(q.device)
            if lse is None:
                lse = lse_scratch
        if not self.split:
            po = plse = out  # unused (SPLIT=False)
        if self.convert:
            t = (indices, req_id, block_table, slots)
            self.kept[2](self.slots_grid, t, t + self.slots_ints, self.slots_kw)
            indices = slots
        if not self.inline:
            req_id = block_table = indices  # unread (PAGED=False)
        t = (q, qr, kv, indices, req_id, block_table, out, lse, po, plse)
        self.kept[0](self.grid, t, t + self.fwd_ints + (float(softmax_scale) * _LOG2E,), self.fwd_kw)
        if self.split:
            t = (po, plse, out, lse)
            self.kept[1](self.comb_grid, t, t + self.comb_ints, self.comb_kw)
        return out, returned

    def _scratch_parts(self):
        """[(shape, dtype) or None] of po [T, H, S, 512] and plse [T, H, S] (split calls), the unreturned lse
        [T, H] (with_lse=False) and the converted slot ids [T, topk] int32 (request-local indices converted by a
        launch of their own)."""
        T, H, S = self.T, self.H, self.num_splits
        f32 = torch.float32
        return [((T, H, S, KV_LORA_RANK), f32) if self.split else None, ((T, H, S), f32) if self.split else None,
                None if self.with_lse else ((T, H), f32), ((T, self.topk), torch.int32) if self.convert else None]

    def _scratch(self, device):
        """(po, plse, lse, slots), each a view of the stream's workspace (see _Partials) or None where the call
        needs none; fresh tensors while a CUDA graph is being captured (they must live as long as the graph)."""
        parts = self._scratch_parts()
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return tuple(None if p is None else torch.empty(p[0], dtype=p[1], device=device) for p in parts)
        stream = _current_stream(device)
        kept = self.scratch
        if kept is None or kept[0] != stream or kept[1] != _PARTIALS.gen:
            sizes = [0 if p is None else math.prod(p[0]) for p in parts]
            offsets = [0]
            for n in sizes:  # every part starts 64-byte aligned (4-byte elements)
                offsets.append(offsets[-1] + -(-n // 16) * 16)
            buf = _PARTIALS.get((device, stream), offsets[-1], device)
            views = tuple(None if p is None else (buf[o:o + n] if p[1] == torch.float32 else
                                                  buf[o:o + n].view(p[1])).view(p[0])
                          for p, o, n in zip(parts, offsets, sizes))
            kept = self.scratch = (stream, _PARTIALS.gen, views)
        return kept[2]


def dequantize_fp8_ds_mla(kv_rows: torch.Tensor) -> torch.Tensor:
    """[..., 656] uint8 rows in the fp8_ds_mla layout -> [..., 576] float32 (512 kv_c, then 64 rope)."""
    rows = kv_rows.view(torch.uint8)
    lead = rows.shape[:-1]
    nope = rows[..., :KV_LORA_RANK].contiguous().view(torch.float8_e4m3fn).to(torch.float32)
    scales = rows[..., KV_LORA_RANK:KV_LORA_RANK + 16].contiguous().view(torch.float32)
    nope = (nope.view(*lead, 4, FP8_TILE) * scales.view(*lead, 4, 1)).view(*lead, KV_LORA_RANK)
    rope = rows[..., KV_LORA_RANK + 16:].contiguous().view(torch.bfloat16).to(torch.float32)
    return torch.cat([nope, rope], dim=-1)


def sparse_mla_reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float,
    kv_format: str = "bf16",
    *,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    max_chunk_bytes: int = 1 << 29,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch float32 reference with the same arguments and semantics as
    :func:`sparse_mla_attention`. Returns out [T, H, 512] float32 (or written into ``out``, cast) and
    lse [T, H] float32. Works on any device; processes tokens in chunks of at most ``max_chunk_bytes``
    of gathered float32 rows."""
    qn, qr, rope_off = _q_parts(q)
    q = qn if rope_off else torch.cat([qn, qr], dim=-1)
    indices = _check_inputs(q, kv_cache, indices, kv_format)
    if kv_format == "fp8_ds_mla" and kv_cache.dtype != torch.uint8:
        kv_cache = kv_cache.view(torch.uint8)
    kv, _, _, _, num_slots = _slot_view(kv_cache, kv_format)
    T, H, _ = q.shape
    topk = indices.shape[1]
    flat = kv.reshape(num_slots, kv.shape[-1])  # copies only for strided block layouts
    res_o = torch.zeros((T, H, KV_LORA_RANK), dtype=torch.float32, device=q.device)
    res_l = torch.full((T, H), float("-inf"), dtype=torch.float32, device=q.device)
    chunk = max(1, max_chunk_bytes // max(1, topk * HEAD_DIM * 4))
    for t0 in range(0, T, chunk):
        idx = indices[t0:t0 + chunk].long()
        valid = (idx >= 0) & (idx < num_slots)
        rows = flat[torch.where(valid, idx, 0)]
        rows = dequantize_fp8_ds_mla(rows) if kv_format == "fp8_ds_mla" else rows.float()
        qc = q[t0:t0 + chunk].float()
        s = torch.einsum("thd,tkd->thk", qc, rows) * softmax_scale
        s = s.masked_fill(~valid[:, None, :], float("-inf"))
        l = torch.logsumexp(s, dim=-1)  # -inf for all-invalid rows
        p = torch.exp(s - torch.where(torch.isinf(l), 0.0, l)[..., None])
        res_o[t0:t0 + chunk] = torch.einsum("thk,tkd->thd", p, rows[..., :KV_LORA_RANK])
        res_l[t0:t0 + chunk] = l
    if out is not None:
        out.copy_(res_o)
        res_o = out
    if lse is not None:
        lse.copy_(res_l)
        res_l = lse
    return res_o, res_l
