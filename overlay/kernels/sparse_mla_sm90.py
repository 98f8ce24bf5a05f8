# SPDX-License-Identifier: Apache-2.0
"""Sparse MLA attention for sm_90 (H100/H200) in Gluon: the 64-head tile with explicit warpgroup layouts.

Same computation, arguments and outputs as ``sparse_mla._sparse_mla_fwd_kernel`` (bf16 or fp8_ds_mla cache, slot
ids, with or without top-k splits); :func:`sparse_mla.sparse_mla_attention` launches it for a config with
``gluon=True``. fp8_ds_mla: the raw e4m3 bytes are gathered NUM_BUF blocks ahead and block i + 1 is dequantised
into the one bf16 operand while block i's P.V wgmmas run (each warpgroup rewrites only the columns its own P.V
reads, chunk by chunk as its wgmmas finish); on the H200 that took the fp8 tile from 1.1x the Triton tile's time
(dequantising between two barriers) to 0.71-0.80x of it (bench/RESULTS.md, 2026-12-04).

Why it exists: in the plain Triton kernel a 64-head tile needs 8 warps (the [64, 512] fp32 accumulator is 128
registers per thread over two warpgroups), and Triton gives a dot whose result feeds another dot all its warps
along M (``warpsPerTileV3``'s "chained dot" rule, made for attention with 128-row tiles). With 64 rows that is
two warpgroups over the same 64 rows: both compute the whole [64, BLOCK_N] score tile and its softmax, and only
P.V is split. Here the layouts are written out: the score wgmma uses warps_per_cta [4, 2] (warpgroup w computes
the scores of keys [w * BLOCK_N/2, (w + 1) * BLOCK_N/2) for all 64 heads), the row max and sum cross the two
warpgroups through shared memory, P is written to shared memory once, and each warpgroup then computes its
half of every 128-column output tile with P as the shared-memory A operand (FlashMLA's P exchange). The KV rows
are gathered with cp.async into NUM_BUF shared buffers, NUM_BUF - 1 blocks ahead of the one being computed.

Gluon only compiles for NVIDIA GPUs (no interpreter): correctness is checked on a GPU (tests/kernels/gpu_checks.py
against float64 references, bench/bench_sparse_mla.py's reference check) and the kernel is cross-compiled for sm_90
under every Triton the tests meet (tests/kernels/test_sparse_mla_sm90.py: 3.5.1, 3.6, and the newest vLLM venv's).
``GLUON`` is False where this Triton has no Gluon for Hopper. Where it runs: sparse_mla.py's _GLUON_TUNING (sm_90,
bf16 and fp8_ds_mla caches, 64-head bucket, batches of at least GLUON_MIN_ROWS[format] rows; DSA_OVERLAY_GLUON=0
turns it off). A second kernel here, ``_sparse_mla_fwd_sm90_ws_kernel``, is the warp-specialised tile (FlashMLA's
sm_90 schedules; ``WS`` says whether this Triton builds it), picked from GLUON_WS_MIN_ROWS rows (_GLUON_WS_TUNING).
bf16: a producer warpgroup gathers and two math warpgroups score one 64-key block each. fp8_ds_mla: a producer
warpgroup dequantises each block into a bf16 buffer, one math warpgroup scores every block, and both multiply P with
their half of the value columns.
"""

from __future__ import annotations

import inspect

import triton

try:  # Gluon arrived in Triton 3.5; its Hopper API (warpgroup_mma, async_copy) is the same in 3.5 - 3.9
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    # cp.async gather into shared memory: async_copy_global_to_shared up to Triton 3.6, async_load from 3.7
    # CTA-wide barrier (bar.sync): gl.thread_barrier up to Triton 3.6, gl.barrier from 3.7
    _barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    _cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
except ImportError:  # pragma: no cover - older Triton
    gluon = None

from .pdl import pdl_enter_gluon  # noqa: E402

GLUON = gluon is not None
# The warp-specialised tile needs warp_specialize([(function, args), ...], ...) (Triton 3.6 on); Triton 3.5 has another
# signature for it, and there the 8-warp tile stays the only sm_90 one.
WS = GLUON and "functions_and_args" in inspect.signature(gl.warp_specialize).parameters
# Its fp8_ds_mla schedule compiles without spills under Triton 3.6 (measured and shipped there: bench/RESULTS.md, stop
# 40). Triton 3.9 (vLLM 0.28 on) spills 48-56 bytes of the scoring warpgroup's arguments at every register split that
# leaves the producer enough (cross-compiled); there fp8_ds_mla keeps the 8-warp tile until that is tuned on a GPU.
WS_FP8 = WS and tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 9)


SHARED_LIMIT = 232448  # bytes of shared memory one block may use on sm_90 (227 KB)
SCRATCH_BYTES = 512  # the compiler's own scratch for the cross-warpgroup row reductions (measured: sm_90 builds)


def shared_bytes(is_fp8: bool, block_n: int, num_buf: int) -> int:
    """Shared memory of one program: Q [64, 576] and P [64, block_n] in bf16, num_buf buffers of the gathered
    rows (bf16: [block_n, 576]; fp8_ds_mla: the 512 e4m3 bytes and the 64 bf16 rope values) and, for
    fp8_ds_mla, the one bf16 operand [block_n, 512] blocks are dequantised into; plus the compiler's scratch."""
    q, p = 64 * 576 * 2, 64 * block_n * 2
    rows = num_buf * block_n * ((512 + 128) if is_fp8 else 576 * 2)
    operand = block_n * 512 * 2 if is_fp8 else 0
    return q + p + rows + operand + SCRATCH_BYTES


WS_SCRATCH_BYTES = 328  # the compiler's own scratch in the warp-specialised tile (measured: sm_90 builds, Triton 3.6)


def ws_shared_bytes(is_fp8: bool) -> int:
    """Shared memory of one program of the warp-specialised tile: Q [64, 576] and two 64-row key buffers [64, 576] in
    bf16, and the compiler's scratch; bf16: P1 [64, 64] in bf16 (P0 lives in buffer 0's rope columns), four [64]
    float32 row vectors (maxima and sums crossing the math warpgroups) and fourteen mbarriers; fp8_ds_mla: four
    [64] float32 row vectors (the rescale factor per buffer, the final max and sum) and seven mbarriers."""
    own = 4 * 64 * 4 + 7 * 8 if is_fp8 else 64 * 64 * 2 + 4 * 64 * 4 + 14 * 8
    return 3 * 64 * 576 * 2 + own + WS_SCRATCH_BYTES


if GLUON:
    @gluon.jit
    def _slots(idx_row, n0, end, num_slots, BLOCK_N: gl.constexpr, V: gl.constexpr):
        """(slot, valid) of idx[n0 : n0 + BLOCK_N] in the 1-D layout V: past the end, negative or past the cache
        is invalid."""
        offs_n = n0 + gl.arange(0, BLOCK_N, layout=V)
        nmask = offs_n < end
        slot = gl.load(idx_row + offs_n, mask=nmask, other=-1)
        return slot, nmask & (slot >= 0) & (slot < num_slots)

    @gluon.jit
    def _last_valid(idx_row, start, end, num_slots, WARPS: gl.constexpr):
        """The position of the last valid slot id in idx[start : end] (start - 1 if none), 1024 ids at a time over
        WARPS warps. Trailing invalid ids change nothing (a prompt's first tokens have fewer than top-k keys; the
        indexer pads their lists with -1): a loop may end after it."""
        scan = gl.arange(0, 1024, layout=gl.BlockedLayout([1024 // (32 * WARPS)], [32], [WARPS], [0]))
        last = start - 1
        for i0 in range(start, end, 1024):
            offs = i0 + scan
            inside = offs < end
            slot = gl.load(idx_row + offs, mask=inside, other=-1)
            last = gl.maximum(last, gl.max(gl.where(inside & (slot >= 0) & (slot < num_slots), offs, -1), 0))
        return last

    @gluon.jit
    def _rows(idx_row, n0, end, num_slots, block_size, stride_kvb, stride_kvt, BLOCK_N: gl.constexpr,
              L: gl.constexpr):
        """(row offset from kv_ptr, valid) of slots idx[n0 : n0 + BLOCK_N], as rows of layout L (elements for
        bf16, bytes for fp8_ds_mla). Invalid and past-the-end slots: valid False, offset 0."""
        slot, valid = _slots(idx_row, n0, end, num_slots, BLOCK_N, gl.SliceLayout(1, L))
        slot = gl.where(valid, slot, 0)
        blk = slot // block_size
        off = slot - blk * block_size
        return blk.to(gl.int64) * stride_kvb + off.to(gl.int64) * stride_kvt, valid

    @gluon.jit
    def _gather_block(kv_ptr, idx_row, n0, end, num_slots, block_size, stride_kvb, stride_kvt,
                      kA_s, kB_s, kC_s, kD_s, kr_s, buf, BLOCK_N: gl.constexpr, LD: gl.constexpr):
        """bf16 cache: start the cp.async gathers of KV rows idx[n0 : n0 + BLOCK_N] into buffer ``buf`` (one commit
        group). Invalid or past-the-end slots read nothing (their rows are zero-filled; their scores are masked to
        -inf): a padded top-k list (a prompt's first tokens have fewer than top-k keys) must not send every program
        to one address (unmasked, they read row 0: 2x slower when every index is invalid, on the H200)."""
        row, valid = _rows(idx_row, n0, end, num_slots, block_size, stride_kvb, stride_kvt, BLOCK_N, LD)
        d = gl.arange(0, 128, layout=gl.SliceLayout(0, LD))
        r = gl.arange(0, 64, layout=gl.SliceLayout(0, LD))
        base = kv_ptr + row[:, None]
        m = valid[:, None]
        _cp_async(kA_s.index(buf), base + d[None, :], mask=m)
        _cp_async(kB_s.index(buf), base + (128 + d[None, :]), mask=m)
        _cp_async(kC_s.index(buf), base + (256 + d[None, :]), mask=m)
        _cp_async(kD_s.index(buf), base + (384 + d[None, :]), mask=m)
        _cp_async(kr_s.index(buf), base + (512 + r[None, :]), mask=m)
        async_copy.commit_group()

    @gluon.jit
    def _row_offsets(slot, valid, block_size, stride_kvb, stride_kvt):
        """Byte (element) offsets of the cache rows of ``slot`` (block slot // block_size, row slot % block_size);
        an invalid slot's offset is slot 0's (its reads are masked)."""
        s = gl.where(valid, slot, 0)
        blk = s // block_size
        return blk.to(gl.int64) * stride_kvb + (s - blk * block_size).to(gl.int64) * stride_kvt

    @gluon.jit
    def _row_scales(kv_ptr, row, valid):
        """The four fp32 tile scales of each row at offset ``row`` (16 bytes after its e4m3 bytes); 0 for invalid
        rows."""
        sc = (kv_ptr + row + 512).to(gl.pointer_type(gl.float32))
        return (gl.load(sc, mask=valid, other=0.0), gl.load(sc + 1, mask=valid, other=0.0),
                gl.load(sc + 2, mask=valid, other=0.0), gl.load(sc + 3, mask=valid, other=0.0))

    @gluon.jit
    def _e4m3_times(x, scale):
        """e4m3 bytes (uint8) times their row scales, as the bf16 wgmma operand."""
        return (x.to(gl.float8e4nv, bitcast=True).to(gl.float32) * scale[:, None]).to(gl.bfloat16)

    @gluon.jit
    def _gather_block_fp8(kv_ptr, slot, valid, slot_r, valid_r, block_size, stride_kvb, stride_kvt,
                          rawA_s, rawB_s, rawC_s, rawD_s, kr_s, buf, DQ: gl.constexpr, LR: gl.constexpr):
        """fp8_ds_mla cache: start the cp.async gathers of one block's rows (one commit group): the 512 e4m3 bytes
        as four [BLOCK_N, 128] chunks into rawA_s[buf] .. rawD_s[buf] in the layout DQ that dequantises them (each thread
        later reads the bytes it copied), the 64 bf16 rope values into kr_s[buf] (a wgmma operand as they are).
        ``slot`` / ``valid``: the block's slots in SliceLayout(1, DQ) and (``_r``) SliceLayout(1, LR); an invalid
        slot reads nothing (zero-filled), as in _gather_block."""
        row = _row_offsets(slot, valid, block_size, stride_kvb, stride_kvt)
        b = gl.arange(0, 128, layout=gl.SliceLayout(0, DQ))
        base = kv_ptr + row[:, None] + b[None, :]
        m = valid[:, None]
        _cp_async(rawA_s.index(buf), base, mask=m)
        _cp_async(rawB_s.index(buf), base + 128, mask=m)
        _cp_async(rawC_s.index(buf), base + 256, mask=m)
        _cp_async(rawD_s.index(buf), base + 384, mask=m)
        row = _row_offsets(slot_r, valid_r, block_size, stride_kvb, stride_kvt)
        r = gl.arange(0, 64, layout=gl.SliceLayout(0, LR))
        rope = (kv_ptr + row + 528).to(gl.pointer_type(gl.bfloat16))
        _cp_async(kr_s.index(buf), rope[:, None] + r[None, :], mask=valid_r[:, None])
        async_copy.commit_group()

    @gluon.jit
    def _scales(kv_ptr, slot, valid, block_size, stride_kvb, stride_kvt):
        """The four fp32 tile scales of each row of a block; 0 for invalid rows."""
        return _row_scales(kv_ptr, _row_offsets(slot, valid, block_size, stride_kvb, stride_kvt), valid)

    @gluon.jit
    def _dequant_chunk(raw, kN, scale, DQ: gl.constexpr):
        """One 128-column chunk of a block: its e4m3 bytes (raw, [BLOCK_N, 128]) times their row scales into the
        bf16 wgmma operand kN. In the layout DQ warpgroup w reads and writes columns [64 w, 64 w + 64) only: the
        columns of kN that its own P.V wgmma reads, so it may overwrite them as soon as its own wgmma is done."""
        kN.store(_e4m3_times(raw.load(DQ), scale))

    @gluon.jit
    def _softmax_step(s, valid, m_i, l_i, sm_scale_log2):
        """One block of the online softmax (base 2): (P, the rescale factor of what came before, new max, new sum).
        Invalid keys score -inf; a row with no valid key so far keeps max -inf and sum 0 (no -inf - -inf)."""
        s = gl.where(valid[None, :], s * sm_scale_log2, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(s - m_use[:, None])
        return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)

    @gluon.constexpr_function
    def _warpgroup_columns_layout(rows, cols, vec):
        """[rows, cols] over 8 warps, ``vec`` consecutive elements per thread (16 bytes), 4 lanes across a
        warp's cols / 2 columns and 8 down the rows: warps 0-3 (warpgroup 0) hold columns [0, cols / 2), warps
        4-7 the rest (a BlockedLayout orders warps and lanes alike, so it cannot put contiguous vectors along
        the columns and a warpgroup's warps down the rows)."""
        reg = [[0, 1 << k] for k in range(vec.bit_length() - 1)] + [[r, 0] for r in (32, 64, 128) if r < rows]
        lane = [[0, vec], [0, 2 * vec], [1, 0], [2, 0], [4, 0]]
        return gl.DistributedLinearLayout(reg_bases=reg, lane_bases=lane, warp_bases=[[8, 0], [16, 0], [0, cols // 2]],
                                          block_bases=[], shape=[rows, cols])

    @gluon.jit
    def _sparse_mla_fwd_sm90_kernel(
        q_ptr, qr_ptr, kv_ptr, idx_ptr, req_ptr, bt_ptr, out_ptr, lse_ptr, po_ptr, plse_ptr,
        H, topk, num_slots, block_size, split_len, num_head_groups, num_splits, max_blocks,
        stride_qt, stride_qh, stride_rt, stride_rh, rope_off,
        stride_kvb, stride_kvt,
        stride_it, stride_btr,
        stride_ot, stride_oh, stride_lt, stride_lh,
        sm_scale_log2,
        IS_FP8: gl.constexpr, FP8_NATIVE: gl.constexpr, SPLIT: gl.constexpr, DOT_F32: gl.constexpr,
        BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, DV_SPLIT: gl.constexpr = 1, FP8_POST: gl.constexpr = False,
        PAGED: gl.constexpr = False, SKIP_TAIL: gl.constexpr = True, NUM_BUF: gl.constexpr = 2,
        P_SWIZZLE: gl.constexpr = 128, PDL: gl.constexpr = False,
    ):
        pdl_enter_gluon(PDL)  # launched with PDL: nothing is read before the previous kernel is done (pdl.py)
        # P_SWIZZLE: the swizzle of P's [64, BLOCK_N] bf16 rows, min(128, 2 * BLOCK_N) bytes (the launcher's).
        # The Triton kernel's argument list, so one launch plan serves both; the variants it has and this one
        # has not are refused at compile time (the config check refuses them first).
        gl.static_assert(not IS_FP8 or FP8_NATIVE, "fp8_ds_mla: native e4m3 conversion (sm_90)")
        gl.static_assert(not PAGED, "the sm_90 Gluon kernel reads slot ids")
        gl.static_assert(DV_SPLIT == 1, "the sm_90 Gluon kernel has no dv_split")
        gl.static_assert(BLOCK_H == 64, "the sm_90 Gluon kernel is a 64-head tile")
        gl.static_assert(NUM_BUF >= 2, "NUM_BUF >= 2")

        # Register layouts: LD for gathers and global loads (16-byte vectors, 8 per 128-byte row segment);
        # S_L scores (warpgroup w: key columns [w * BLOCK_N/2, ...)); O_L each 128-column output tile
        # (warpgroup w: columns [64 w, 64 w + 64) of it). Shared layouts: 128-byte swizzled wgmma operands.
        LD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
        S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                      instr_shape=[16, BLOCK_N // 2, 16])
        O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 64, 16])
        SH: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        P_SH: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=P_SWIZZLE, element_bitwidth=16, rank=2)

        pid = gl.program_id(0)
        hg = pid % num_head_groups
        rest = pid // num_head_groups
        sp = rest % num_splits
        t = rest // num_splits

        # Q: [64, 576] in shared memory for the whole loop (four 128-column tiles and the rope tile).
        offs_h = hg * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, LD))
        hmask = offs_h < H
        d = gl.arange(0, 128, layout=gl.SliceLayout(0, LD))
        r = gl.arange(0, 64, layout=gl.SliceLayout(0, LD))
        q_row = q_ptr + t.to(gl.int64) * stride_qt + offs_h.to(gl.int64) * stride_qh
        qr_row = qr_ptr + t.to(gl.int64) * stride_rt + offs_h.to(gl.int64) * stride_rh + rope_off
        qA_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, 128], SH,
                                         gl.load(q_row[:, None] + d[None, :], mask=hmask[:, None], other=0.0))
        qB_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, 128], SH,
                                         gl.load(q_row[:, None] + (128 + d[None, :]), mask=hmask[:, None], other=0.0))
        qC_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, 128], SH,
                                         gl.load(q_row[:, None] + (256 + d[None, :]), mask=hmask[:, None], other=0.0))
        qD_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, 128], SH,
                                         gl.load(q_row[:, None] + (384 + d[None, :]), mask=hmask[:, None], other=0.0))
        qr_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, 64], SH,
                                         gl.load(qr_row[:, None] + r[None, :], mask=hmask[:, None], other=0.0))

        # KV operands. bf16: NUM_BUF buffers of the gathered rows, each a wgmma operand as it lands. fp8_ds_mla:
        # NUM_BUF buffers of raw e4m3 bytes (four [BLOCK_N, 128] chunks each) and of the bf16 rope values, and one
        # bf16 operand that block i + 1 is dequantised into while block i's P.V runs (see the fp8 loop below).
        kr_s = gl.allocate_shared_memory(gl.bfloat16, [NUM_BUF, BLOCK_N, 64], SH)
        if IS_FP8:
            # one allocation per 128-column chunk: the compiler's shared-memory hazard analysis (which puts a CTA
            # barrier between accesses to one allocation that may conflict) then sees that chunk c's copies, stores
            # and wgmmas do not touch chunk c + 1
            SH8: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
            rawA_s = gl.allocate_shared_memory(gl.uint8, [NUM_BUF, BLOCK_N, 128], SH8)
            rawB_s = gl.allocate_shared_memory(gl.uint8, [NUM_BUF, BLOCK_N, 128], SH8)
            rawC_s = gl.allocate_shared_memory(gl.uint8, [NUM_BUF, BLOCK_N, 128], SH8)
            rawD_s = gl.allocate_shared_memory(gl.uint8, [NUM_BUF, BLOCK_N, 128], SH8)
            kNA_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, 128], SH)
            kNB_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, 128], SH)
            kNC_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, 128], SH)
            kND_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, 128], SH)
        else:
            kA_s = gl.allocate_shared_memory(gl.bfloat16, [NUM_BUF, BLOCK_N, 128], SH)
            kB_s = gl.allocate_shared_memory(gl.bfloat16, [NUM_BUF, BLOCK_N, 128], SH)
            kC_s = gl.allocate_shared_memory(gl.bfloat16, [NUM_BUF, BLOCK_N, 128], SH)
            kD_s = gl.allocate_shared_memory(gl.bfloat16, [NUM_BUF, BLOCK_N, 128], SH)
        p_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, BLOCK_N], P_SH)

        start = sp * split_len
        end = gl.minimum(start + split_len, topk)
        idx_row = idx_ptr + t.to(gl.int64) * stride_it
        # the loop ends after this split's last valid index (none: no iteration; see _last_valid)
        n_iter = gl.cdiv(end - start, BLOCK_N)
        if SKIP_TAIL:
            n_iter = gl.cdiv(_last_valid(idx_row, start, end, num_slots, 8) + 1 - start, BLOCK_N)
        m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_L))
        l_i = gl.full([BLOCK_H], 0.0, gl.float32, layout=gl.SliceLayout(1, S_L))
        accA = gl.full([BLOCK_H, 128], 0.0, gl.float32, layout=O_L)
        accB = gl.full([BLOCK_H, 128], 0.0, gl.float32, layout=O_L)
        accC = gl.full([BLOCK_H, 128], 0.0, gl.float32, layout=O_L)
        accD = gl.full([BLOCK_H, 128], 0.0, gl.float32, layout=O_L)
        s_zero = gl.full([BLOCK_H, BLOCK_N], 0.0, gl.float32, layout=S_L)
        if IS_FP8:
            # fp8_ds_mla. Block i's scores read the bf16 operand kN_s (block i dequantised) and rope buffer i; then,
            # while block i's P.V wgmmas run, each warpgroup dequantises block i + 1 into the columns of kN_s that
            # its own P.V reads, one 128-column chunk as soon as its wgmma on that chunk is done (the layout DQ
            # gives warpgroup w columns [64 w, 64 w + 64) of each chunk, as the P.V output layout O_L does). The
            # raw bytes are gathered NUM_BUF blocks ahead, each thread copying the bytes it later dequantises, so
            # only the rope values (a wgmma operand) need the barrier. Index, mask and scale loads are issued
            # while the score wgmmas run. Two CTA barriers per block; nothing waits on global memory in between.
            DQ: gl.constexpr = _warpgroup_columns_layout(BLOCK_N, 128, 16)
            LR: gl.constexpr = _warpgroup_columns_layout(BLOCK_N, 64, 8)
            ROWS: gl.constexpr = gl.SliceLayout(1, DQ)
            ROWS_R: gl.constexpr = gl.SliceLayout(1, LR)
            for j in gl.static_range(NUM_BUF):  # prologue: the first NUM_BUF blocks in flight
                g, gv = _slots(idx_row, start + j * BLOCK_N, end, num_slots, BLOCK_N, ROWS)
                gr, grv = _slots(idx_row, start + j * BLOCK_N, end, num_slots, BLOCK_N, ROWS_R)
                _gather_block_fp8(kv_ptr, g, gv, gr, grv, block_size, stride_kvb, stride_kvt, rawA_s, rawB_s, rawC_s, rawD_s, kr_s, j, DQ, LR)
            g, gv = _slots(idx_row, start, end, num_slots, BLOCK_N, ROWS)
            sc0, sc1, sc2, sc3 = _scales(kv_ptr, g, gv, block_size, stride_kvb, stride_kvt)
            async_copy.wait_group(NUM_BUF - 1)  # block 0 (and its rope values) landed
            _dequant_chunk(rawA_s.index(0), kNA_s, sc0, DQ)
            _dequant_chunk(rawB_s.index(0), kNB_s, sc1, DQ)
            _dequant_chunk(rawC_s.index(0), kNC_s, sc2, DQ)
            _dequant_chunk(rawD_s.index(0), kND_s, sc3, DQ)
            fence_async_shared()  # Q, block 0's operand and rope stores before the first wgmma reads them
            _barrier()
            for i in range(n_iter):
                buf = i % NUM_BUF
                n0 = start + i * BLOCK_N
                s = warpgroup_mma(qr_s, kr_s.index(buf).permute((1, 0)), s_zero, use_acc=False, is_async=True)
                s = warpgroup_mma(qA_s, kNA_s.permute((1, 0)), s, is_async=True)
                s = warpgroup_mma(qB_s, kNB_s.permute((1, 0)), s, is_async=True)
                s = warpgroup_mma(qC_s, kNC_s.permute((1, 0)), s, is_async=True)
                s = warpgroup_mma(qD_s, kND_s.permute((1, 0)), s, is_async=True)
                _, valid = _slots(idx_row, n0, end, num_slots, BLOCK_N, gl.SliceLayout(0, S_L))
                g, gv = _slots(idx_row, n0 + BLOCK_N, end, num_slots, BLOCK_N, ROWS)
                sc0, sc1, sc2, sc3 = _scales(kv_ptr, g, gv, block_size, stride_kvb, stride_kvt)
                g, gv = _slots(idx_row, n0 + NUM_BUF * BLOCK_N, end, num_slots, BLOCK_N, ROWS)
                gr, grv = _slots(idx_row, n0 + NUM_BUF * BLOCK_N, end, num_slots, BLOCK_N, ROWS_R)
                s = warpgroup_mma_wait(0, deps=[s])
                p, alpha, m_i, l_i = _softmax_step(s, valid, m_i, l_i, sm_scale_log2)
                p_s.store(p.to(gl.bfloat16))
                fence_async_shared()
                _barrier()  # P whole; both warpgroups' scores of block i done: raw and rope buffer ``buf`` are free
                _gather_block_fp8(kv_ptr, g, gv, gr, grv, block_size, stride_kvb, stride_kvt, rawA_s, rawB_s, rawC_s, rawD_s, kr_s, buf, DQ, LR)
                alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
                accA = warpgroup_mma(p_s, kNA_s, accA * alpha_o, is_async=True)
                accB = warpgroup_mma(p_s, kNB_s, accB * alpha_o, is_async=True)
                accC = warpgroup_mma(p_s, kNC_s, accC * alpha_o, is_async=True)
                accD = warpgroup_mma(p_s, kND_s, accD * alpha_o, is_async=True)
                async_copy.wait_group(NUM_BUF - 1)  # block i + 1 landed (this thread's bytes; the rope: barrier below)
                nb = (i + 1) % NUM_BUF
                accA = warpgroup_mma_wait(3, deps=[accA])
                _dequant_chunk(rawA_s.index(nb), kNA_s, sc0, DQ)
                accB = warpgroup_mma_wait(2, deps=[accB])
                _dequant_chunk(rawB_s.index(nb), kNB_s, sc1, DQ)
                accC = warpgroup_mma_wait(1, deps=[accC])
                _dequant_chunk(rawC_s.index(nb), kNC_s, sc2, DQ)
                accD = warpgroup_mma_wait(0, deps=[accD])
                _dequant_chunk(rawD_s.index(nb), kND_s, sc3, DQ)
                fence_async_shared()  # block i + 1's operand and rope values before the next scores read them
                _barrier()
        else:
            for j in gl.static_range(NUM_BUF - 1):  # prologue: the first NUM_BUF - 1 blocks in flight
                _gather_block(kv_ptr, idx_row, start + j * BLOCK_N, end, num_slots, block_size, stride_kvb,
                              stride_kvt, kA_s, kB_s, kC_s, kD_s, kr_s, j, BLOCK_N, LD)
            fence_async_shared()  # Q's shared-memory stores before the first wgmma reads them
            for i in range(n_iter):
                buf = i % NUM_BUF
                n0 = start + i * BLOCK_N
                # Block i has landed once at most NUM_BUF - 2 newer groups are pending; the barrier also means every
                # warp is done with iteration i - 1 (its wgmmas read the buffer refilled below, and P).
                async_copy.wait_group(NUM_BUF - 2)
                fence_async_shared()
                _barrier()
                kA = kA_s.index(buf)
                kB = kB_s.index(buf)
                kC = kC_s.index(buf)
                kD = kD_s.index(buf)
                s = warpgroup_mma(qr_s, kr_s.index(buf).permute((1, 0)), s_zero, use_acc=False, is_async=True)
                s = warpgroup_mma(qA_s, kA.permute((1, 0)), s, is_async=True)
                s = warpgroup_mma(qB_s, kB.permute((1, 0)), s, is_async=True)
                s = warpgroup_mma(qC_s, kC.permute((1, 0)), s, is_async=True)
                s = warpgroup_mma(qD_s, kD.permute((1, 0)), s, is_async=True)
                # while the scores run: the gather NUM_BUF - 1 blocks ahead (its index load) and block i's mask
                _gather_block(kv_ptr, idx_row, n0 + (NUM_BUF - 1) * BLOCK_N, end, num_slots, block_size, stride_kvb,
                              stride_kvt, kA_s, kB_s, kC_s, kD_s, kr_s, (i + NUM_BUF - 1) % NUM_BUF, BLOCK_N, LD)
                _, valid = _slots(idx_row, n0, end, num_slots, BLOCK_N, gl.SliceLayout(0, S_L))
                s = warpgroup_mma_wait(0, deps=[s])
                p, alpha, m_i, l_i = _softmax_step(s, valid, m_i, l_i, sm_scale_log2)
                p_s.store(p.to(gl.bfloat16))
                fence_async_shared()
                _barrier()
                alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
                accA = warpgroup_mma(p_s, kA, accA * alpha_o, is_async=True)
                accB = warpgroup_mma(p_s, kB, accB * alpha_o, is_async=True)
                accC = warpgroup_mma(p_s, kC, accC * alpha_o, is_async=True)
                accD = warpgroup_mma(p_s, kD, accD * alpha_o, is_async=True)
                accA, accB, accC, accD = warpgroup_mma_wait(0, deps=[accA, accB, accC, accD])
        async_copy.wait_group(0)  # the prefetches past the end (masked rows) before the program exits

        has = l_i > 0.0
        inv_l = gl.where(has, 1.0 / gl.where(has, l_i, 1.0), 0.0)
        lse = gl.where(has, (m_i + gl.log2(gl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
        inv_o = gl.convert_layout(inv_l, gl.SliceLayout(1, O_L))[:, None]
        offs_ho = hg * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, O_L))
        hmask_o = (offs_ho < H)[:, None]
        d_o = gl.arange(0, 128, layout=gl.SliceLayout(0, O_L))[None, :]
        offs_hl = hg * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, S_L))
        if SPLIT:
            prow = (t.to(gl.int64) * H + offs_ho) * num_splits + sp
            po = po_ptr + prow[:, None] * 512 + d_o
            gl.store(po, accA * inv_o, mask=hmask_o)
            gl.store(po + 128, accB * inv_o, mask=hmask_o)
            gl.store(po + 256, accC * inv_o, mask=hmask_o)
            gl.store(po + 384, accD * inv_o, mask=hmask_o)
            gl.store(plse_ptr + (t.to(gl.int64) * H + offs_hl) * num_splits + sp, lse, mask=offs_hl < H)
        else:
            o = out_ptr + t.to(gl.int64) * stride_ot + offs_ho.to(gl.int64)[:, None] * stride_oh + d_o
            oty = out_ptr.dtype.element_ty
            gl.store(o, (accA * inv_o).to(oty), mask=hmask_o)
            gl.store(o + 128, (accB * inv_o).to(oty), mask=hmask_o)
            gl.store(o + 256, (accC * inv_o).to(oty), mask=hmask_o)
            gl.store(o + 384, (accD * inv_o).to(oty), mask=hmask_o)
            gl.store(lse_ptr + t.to(gl.int64) * stride_lt + offs_hl.to(gl.int64) * stride_lh, lse, mask=offs_hl < H)

    # ---- the warp-specialised tile (bf16 caches; FlashMLA's sm_90 schedule) ------------------------------------
    # Three warpgroups (gl.warp_specialize): a producer (the default partition, 4 warps, the registers left over)
    # gathers with cp.async into two 64-key buffers, each in two halves (L: value columns 0-255; R: 256-511 and the
    # rope columns) that it refills as soon as their readers are done (mbarriers: ready / free per half); math
    # warpgroup WG0 scores the even key blocks, WG1 the odd ones, each over all 64 heads (m64n64 score wgmmas: half
    # the shared-memory reads of the 8-warp tile's m64n32 ones); WG0 keeps output columns [0, 256), WG1 [256, 512).
    # Per pair of blocks: WG0 posts its row max and starts its own P.V at once (P from registers); WG1 makes the max
    # final; WG0 rescales its P to it and hands it over in shared memory; each multiplies the other's P with its own
    # columns of the other's block. 232 registers per math warpgroup, no spill (tests/kernels/test_sparse_mla_sm90.py).
    WS_MATH_REGS: gl.constexpr = gl.constexpr(232)

    # one math warpgroup's layouts: a [64, 64] score tile, 128-column output tiles
    WS_S_L = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16]))
    WS_O_L = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 16]))

    @gluon.jit
    def _ws_state():
        """A math warpgroup's running row max (finite: no -inf - -inf), row sum and two 128-column accumulators."""
        m_run = gl.full([64], -1.0e30, gl.float32, layout=gl.SliceLayout(1, WS_S_L))
        l_i = gl.full([64], 0.0, gl.float32, layout=gl.SliceLayout(1, WS_S_L))
        acc0 = gl.full([64, 128], 0.0, gl.float32, layout=WS_O_L)
        acc1 = gl.full([64, 128], 0.0, gl.float32, layout=WS_O_L)
        return m_run, l_i, acc0, acc1

    @gluon.jit
    def _ws_scores(qA_s, qB_s, qC_s, qD_s, qr_s, kA, kB, kC, kD, kr, rdy_first, rdy_second, ph, S_L: gl.constexpr,
                   L_FIRST: gl.constexpr):
        """S = Q K^T of one buffered block, the half that lands first issued first (L: columns 0-255)."""
        zero = gl.full([64, 64], 0.0, gl.float32, layout=S_L)
        mbarrier.wait(rdy_first, ph)
        if L_FIRST:
            s = warpgroup_mma(qA_s, kA.permute((1, 0)), zero, use_acc=False, is_async=True)
            s = warpgroup_mma(qB_s, kB.permute((1, 0)), s, is_async=True)
            mbarrier.wait(rdy_second, ph)
            s = warpgroup_mma(qC_s, kC.permute((1, 0)), s, is_async=True)
            s = warpgroup_mma(qD_s, kD.permute((1, 0)), s, is_async=True)
            s = warpgroup_mma(qr_s, kr.permute((1, 0)), s, is_async=True)
        else:
            s = warpgroup_mma(qC_s, kC.permute((1, 0)), zero, use_acc=False, is_async=True)
            s = warpgroup_mma(qD_s, kD.permute((1, 0)), s, is_async=True)
            s = warpgroup_mma(qr_s, kr.permute((1, 0)), s, is_async=True)
            mbarrier.wait(rdy_second, ph)
            s = warpgroup_mma(qA_s, kA.permute((1, 0)), s, is_async=True)
            s = warpgroup_mma(qB_s, kB.permute((1, 0)), s, is_async=True)
        return s

    @gluon.jit
    def _ws_store(acc0, acc1, col0, l_tot, m_run, WG: gl.constexpr, out_ptr, lse_ptr, po_ptr, plse_ptr, t, hg, sp,
                  H, num_splits, stride_ot, stride_oh, stride_lt, stride_lh, S_L: gl.constexpr, O_L: gl.constexpr):
        """Write this warpgroup's 256 output columns [col0, col0 + 256) (and, WG1, the lse): to the split partials
        where num_splits > 1, else to out / lse. (A flag, not a constexpr: a partition gets its arguments as values,
        and a branch on one around these stores does not lower; the stores are predicated instead.)"""
        has = l_tot > 0.0
        inv_l = gl.where(has, 1.0 / gl.where(has, l_tot, 1.0), 0.0)
        inv_o = gl.convert_layout(inv_l, gl.SliceLayout(1, O_L))[:, None]
        offs_ho = hg * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, O_L))
        d_o = col0 + gl.arange(0, 128, layout=gl.SliceLayout(0, O_L))[None, :]
        offs_hl = hg * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, S_L))
        lse = gl.where(has, (m_run + gl.log2(gl.where(has, l_tot, 1.0))) * 0.6931471805599453, float("-inf"))
        split = num_splits > 1
        hmask_p = ((offs_ho < H) & split)[:, None]
        hmask_o = ((offs_ho < H) & (not split))[:, None]
        prow = (t.to(gl.int64) * H + offs_ho) * num_splits + sp
        po = po_ptr + prow[:, None] * 512 + d_o
        o0 = acc0 * inv_o
        o1 = acc1 * inv_o
        gl.store(po, o0, mask=hmask_p)
        gl.store(po + 128, o1, mask=hmask_p)
        o = out_ptr + t.to(gl.int64) * stride_ot + offs_ho.to(gl.int64)[:, None] * stride_oh + d_o
        oty = out_ptr.dtype.element_ty
        gl.store(o, o0.to(oty), mask=hmask_o)
        gl.store(o + 128, o1.to(oty), mask=hmask_o)
        if WG == 1:
            gl.store(plse_ptr + (t.to(gl.int64) * H + offs_hl) * num_splits + sp, lse, mask=(offs_hl < H) & split)
            gl.store(lse_ptr + t.to(gl.int64) * stride_lt + offs_hl.to(gl.int64) * stride_lh, lse,
                     mask=(offs_hl < H) & (not split))

    @gluon.jit
    def _ws_math(WG: gl.constexpr, qN_s, qR_s, kA_s, kB_s, kC_s, kD_s, kr_s, p1_s, m0_s, m1_s, l0_s, l1_s, bars,
                 idx_row, start, end, num_slots, n_pairs, sm_scale_log2,
                 out_ptr, lse_ptr, po_ptr, plse_ptr, t, hg, sp, H, num_splits,
                 stride_ot, stride_oh, stride_lt, stride_lh):
        """Math warpgroup WG (0: even blocks, output columns 0-255; 1: odd blocks, columns 256-511)."""
        S_L: gl.constexpr = WS_S_L
        O_L: gl.constexpr = WS_O_L
        PA_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
        ROW: gl.constexpr = gl.SliceLayout(1, S_L)
        m_run, l_i, acc0, acc1 = _ws_state()
        if WG == 0:  # my values: chunks A, B (columns 0-255)
            v0_s = kA_s
            v1_s = kB_s
        else:
            v0_s = kC_s
            v1_s = kD_s
        for j in range(n_pairs):
            ph = j & 1
            n0 = start + (2 * j + WG) * 64
            # always 0, but not to the compiler: buffer addresses are then formed per iteration instead of being
            # hoisted out of the loop (72 hoisted 64-bit wgmma descriptors spill)
            dyn = j >> 30
            b0 = dyn
            b1 = dyn + 1
            qA = qN_s.index(dyn)
            qB = qN_s.index(dyn + 1)
            qC = qN_s.index(dyn + 2)
            qD = qN_s.index(dyn + 3)
            if WG == 0:  # buffer 0, L half first
                s = _ws_scores(qA, qB, qC, qD, qR_s.index(dyn), kA_s.index(b0), kB_s.index(b0), kC_s.index(b0),
                               kD_s.index(b0), kr_s.index(b0), bars.index(0), bars.index(1), ph, S_L, True)
            else:  # buffer 1, R half first (the L half is freed last, by WG0's P.V on it)
                s = _ws_scores(qA, qB, qC, qD, qR_s.index(dyn), kA_s.index(b1), kB_s.index(b1), kC_s.index(b1),
                               kD_s.index(b1), kr_s.index(b1), bars.index(3), bars.index(2), ph, S_L, False)
            _, valid = _slots(idx_row, n0, end, num_slots, 64, gl.SliceLayout(0, S_L))
            s = warpgroup_mma_wait(0, deps=[s])
            s = gl.where(valid[None, :], s * sm_scale_log2, float("-inf"))
            if WG == 0:
                # WG0: its max (over what came before and its block) first; its own P.V starts at once; P0 is
                # rescaled to WG1's final max before it is handed over (buffer 0's L half frees early)
                m_new = gl.maximum(m_run, gl.max(s, 1))
                m0_s.store(m_new)
                mbarrier.arrive(bars.index(8))
            else:
                mx = gl.max(s, 1)
                mbarrier.wait(bars.index(8), ph)
                m_new = gl.maximum(m0_s.load(ROW), mx)
                m1_s.store(m_new)
                mbarrier.arrive(bars.index(9))
            p = gl.exp2(s - m_new[:, None])
            alpha = gl.exp2(m_run - m_new)
            l_i = l_i * alpha + gl.sum(p, 1)
            alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
            pb = p.to(gl.bfloat16)
            pa = gl.convert_layout(pb, PA_L)
            acc0 = warpgroup_mma(pa, v0_s.index(dyn + WG), acc0 * alpha_o, is_async=True)
            acc1 = warpgroup_mma(pa, v1_s.index(dyn + WG), acc1 * alpha_o, is_async=True)
            if WG == 0:
                mbarrier.wait(bars.index(9), ph)
                m_fin = m1_s.load(ROW)
                beta = gl.exp2(m_new - m_fin)
                kr_s.index(b0).store((pb.to(gl.float32) * beta[:, None]).to(gl.bfloat16))
                fence_async_shared()
                mbarrier.arrive(bars.index(10))
                acc0, acc1 = warpgroup_mma_wait(0, deps=[acc0, acc1])
                mbarrier.arrive(bars.index(4))  # buffer 0, L half: my scores and my P.V are done with it
                l_i = l_i * beta
                beta_o = gl.convert_layout(beta, gl.SliceLayout(1, O_L))[:, None]
                acc0 = acc0 * beta_o
                acc1 = acc1 * beta_o
                m_run = m_fin
                mbarrier.wait(bars.index(11), ph)
                acc0 = warpgroup_mma(p1_s, v0_s.index(b1), acc0, is_async=True)
                acc1 = warpgroup_mma(p1_s, v1_s.index(b1), acc1, is_async=True)
                acc0, acc1 = warpgroup_mma_wait(0, deps=[acc0, acc1])
                mbarrier.arrive(bars.index(6))  # buffer 1, L half: the other's block, my columns
            else:
                m_run = m_new
                p1_s.store(pb)
                fence_async_shared()
                mbarrier.arrive(bars.index(11))
                mbarrier.wait(bars.index(10), ph)
                acc0 = warpgroup_mma(kr_s.index(b0), v0_s.index(b0), acc0, is_async=True)
                acc1 = warpgroup_mma(kr_s.index(b0), v1_s.index(b0), acc1, is_async=True)
                acc0, acc1 = warpgroup_mma_wait(2, deps=[acc0, acc1])
                mbarrier.arrive(bars.index(7))  # buffer 1, R half
                acc0, acc1 = warpgroup_mma_wait(0, deps=[acc0, acc1])
                mbarrier.arrive(bars.index(5))  # buffer 0, R half (and P0)
        # row sums: each warpgroup has its own blocks'; add the other's
        if WG == 0:
            l0_s.store(l_i)
            mbarrier.arrive(bars.index(12))
            mbarrier.wait(bars.index(13), 0)
            l_tot = l_i + l1_s.load(ROW)
        else:
            l1_s.store(l_i)
            mbarrier.arrive(bars.index(13))
            mbarrier.wait(bars.index(12), 0)
            l_tot = l_i + l0_s.load(ROW)
        _ws_store(acc0, acc1, WG * 256, l_tot, m_run, WG, out_ptr, lse_ptr, po_ptr, plse_ptr, t, hg, sp, H,
                  num_splits, stride_ot, stride_oh, stride_lt, stride_lh, S_L, O_L)

    @gluon.jit
    def _ws_math0(qN_s, qR_s, kA_s, kB_s, kC_s, kD_s, kr_s, p1_s, m0_s, m1_s, l0_s, l1_s, bars, idx_row, start, end,
                  num_slots, n_pairs, sm_scale_log2, out_ptr, lse_ptr, po_ptr, plse_ptr, t, hg, sp, H, num_splits,
                  stride_ot, stride_oh, stride_lt, stride_lh):
        _ws_math(0, qN_s, qR_s, kA_s, kB_s, kC_s, kD_s, kr_s, p1_s, m0_s, m1_s, l0_s, l1_s, bars, idx_row, start, end,
                 num_slots, n_pairs, sm_scale_log2, out_ptr, lse_ptr, po_ptr, plse_ptr, t, hg, sp, H, num_splits,
                 stride_ot, stride_oh, stride_lt, stride_lh)

    @gluon.jit
    def _ws_math1(qN_s, qR_s, kA_s, kB_s, kC_s, kD_s, kr_s, p1_s, m0_s, m1_s, l0_s, l1_s, bars, idx_row, start, end,
                  num_slots, n_pairs, sm_scale_log2, out_ptr, lse_ptr, po_ptr, plse_ptr, t, hg, sp, H, num_splits,
                  stride_ot, stride_oh, stride_lt, stride_lh):
        _ws_math(1, qN_s, qR_s, kA_s, kB_s, kC_s, kD_s, kr_s, p1_s, m0_s, m1_s, l0_s, l1_s, bars, idx_row, start, end,
                 num_slots, n_pairs, sm_scale_log2, out_ptr, lse_ptr, po_ptr, plse_ptr, t, hg, sp, H, num_splits,
                 stride_ot, stride_oh, stride_lt, stride_lh)

    @gluon.jit
    def _ws_gather_half(kv_ptr, row, valid, k0, k1, k2, rdy, LOWER: gl.constexpr, L: gl.constexpr):
        """cp.async one half of a block's rows (LOWER: columns 0-255 into k0, k1; else 256-511 into k0, k1 and the
        rope columns into k2), then let the mbarrier ``rdy`` see them land (every producer thread arrives)."""
        d = gl.arange(0, 128, layout=gl.SliceLayout(0, L))
        base = kv_ptr + row[:, None]
        m = valid[:, None]
        if LOWER:
            _cp_async(k0, base + d[None, :], mask=m)
            _cp_async(k1, base + (128 + d[None, :]), mask=m)
        else:
            r = gl.arange(0, 64, layout=gl.SliceLayout(0, L))
            _cp_async(k0, base + (256 + d[None, :]), mask=m)
            _cp_async(k1, base + (384 + d[None, :]), mask=m)
            _cp_async(k2, base + (512 + r[None, :]), mask=m)
        async_copy.mbarrier_arrive(rdy, increment_count=False)

    @gluon.jit
    def _ws_producer(kv_ptr, idx_row, start, end, num_slots, block_size, stride_kvb, stride_kvt, n_pairs,
                     kA_s, kB_s, kC_s, kD_s, kr_s, bars):
        """The gathers: per pair of blocks, buffer 0's L half, buffer 1's R half, buffer 0's R, buffer 1's L (the
        order their readers free them in), each after its free mbarrier (parity 1 first: free from the start)."""
        LP: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        for j in range(n_pairs):
            ph = (j & 1) ^ 1
            n0 = start + 2 * j * 64
            row0, v0 = _rows(idx_row, n0, end, num_slots, block_size, stride_kvb, stride_kvt, 64, LP)
            row1, v1 = _rows(idx_row, n0 + 64, end, num_slots, block_size, stride_kvb, stride_kvt, 64, LP)
            mbarrier.wait(bars.index(4), ph)
            _ws_gather_half(kv_ptr, row0, v0, kA_s.index(0), kB_s.index(0), kr_s.index(0), bars.index(0), True, LP)
            mbarrier.wait(bars.index(7), ph)
            _ws_gather_half(kv_ptr, row1, v1, kC_s.index(1), kD_s.index(1), kr_s.index(1), bars.index(3), False, LP)
            mbarrier.wait(bars.index(5), ph)
            _ws_gather_half(kv_ptr, row0, v0, kC_s.index(0), kD_s.index(0), kr_s.index(0), bars.index(1), False, LP)
            mbarrier.wait(bars.index(6), ph)
            _ws_gather_half(kv_ptr, row1, v1, kA_s.index(1), kB_s.index(1), kr_s.index(1), bars.index(2), True, LP)

    # ---- the warp-specialised tile on fp8_ds_mla caches (FlashMLA's sm_90 fp8 schedule) -------------------------
    # The producer (the default partition, the registers left over: 128) dequantises: it loads a block's e4m3 bytes,
    # tile scales and rope values into registers (the loads go out before it waits for the buffer to be free),
    # multiplies them out into the bf16 key buffer and posts it (ready). Math warpgroup WG0 scores every block over
    # all 64 heads, keeps the softmax, and multiplies P (from registers) with output columns 0-255; it leaves P in
    # the buffer's rope columns (read only by its own scores) and the rescale factor beside it for WG1, which
    # multiplies them with columns 256-511. Both free the buffer. Two buffers; the warpgroups meet only at their
    # mbarriers. (The bf16 schedule, two warpgroups scoring a block each, would leave the producer 48 registers.)
    WS8_SCORE_REGS: gl.constexpr = gl.constexpr(216)  # WG0: scores, softmax, half the output
    WS8_PV_REGS: gl.constexpr = gl.constexpr(160)  # WG1: half the output (the producer: the rest, 128)

    @gluon.jit
    def _ws8_producer(kv_ptr, idx_row, start, end, num_slots, block_size, stride_kvb, stride_kvt, n_blocks,
                      kA_s, kB_s, kC_s, kD_s, kr_s, bars):
        """Per block: its slots (loaded one block ahead), raw bytes, scales and rope values into registers; wait
        until buffer j % 2 is free (parity 1 first: free from the start); dequantise into it; post it."""
        DQ: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
        LR: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        ROWS: gl.constexpr = gl.SliceLayout(1, DQ)
        cb = gl.arange(0, 128, layout=gl.SliceLayout(0, DQ))
        cr = gl.arange(0, 64, layout=gl.SliceLayout(0, LR))
        slot, valid = _slots(idx_row, start, end, num_slots, 64, ROWS)
        for j in range(n_blocks):
            b = j & 1
            row = _row_offsets(slot, valid, block_size, stride_kvb, stride_kvt)
            base = kv_ptr + row[:, None] + cb[None, :]
            m = valid[:, None]
            xA = gl.load(base, mask=m, other=0)
            xB = gl.load(base + 128, mask=m, other=0)
            xC = gl.load(base + 256, mask=m, other=0)
            xD = gl.load(base + 384, mask=m, other=0)
            s0, s1, s2, s3 = _row_scales(kv_ptr, row, valid)
            row_r = gl.convert_layout(row, gl.SliceLayout(1, LR))
            valid_r = gl.convert_layout(valid, gl.SliceLayout(1, LR))
            rope = (kv_ptr + row_r + 528).to(gl.pointer_type(gl.bfloat16))
            xr = gl.load(rope[:, None] + cr[None, :], mask=valid_r[:, None], other=0.0)
            slot, valid = _slots(idx_row, start + (j + 1) * 64, end, num_slots, 64, ROWS)  # the next block's
            mbarrier.wait(bars.index(2 + b), ((j >> 1) & 1) ^ 1)
            kA_s.index(b).store(_e4m3_times(xA, s0))
            kB_s.index(b).store(_e4m3_times(xB, s1))
            kC_s.index(b).store(_e4m3_times(xC, s2))
            kD_s.index(b).store(_e4m3_times(xD, s3))
            kr_s.index(b).store(xr)
            fence_async_shared()
            mbarrier.arrive(bars.index(b))

    @gluon.jit
    def _ws8_math(WG: gl.constexpr, qN_s, qR_s, kA_s, kB_s, kC_s, kD_s, kr_s, a_s, ml_s, bars,
                  idx_row, start, end, num_slots, n_blocks, sm_scale_log2,
                  out_ptr, lse_ptr, po_ptr, plse_ptr, t, hg, sp, H, num_splits,
                  stride_ot, stride_oh, stride_lt, stride_lh):
        """WG0: scores, softmax and output columns 0-255 of every block; WG1: columns 256-511 with WG0's P."""
        S_L: gl.constexpr = WS_S_L
        O_L: gl.constexpr = WS_O_L
        PA_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
        ROW: gl.constexpr = gl.SliceLayout(1, S_L)
        m_run, l_i, acc0, acc1 = _ws_state()
        for j in range(n_blocks):
            ph = (j >> 1) & 1
            dyn = j >> 30  # always 0, but not to the compiler (see _ws_math)
            b = (j & 1) + dyn
            if WG == 0:
                _, valid = _slots(idx_row, start + j * 64, end, num_slots, 64, gl.SliceLayout(0, S_L))
                s = _ws_scores(qN_s.index(dyn), qN_s.index(dyn + 1), qN_s.index(dyn + 2), qN_s.index(dyn + 3),
                               qR_s.index(dyn), kA_s.index(b), kB_s.index(b), kC_s.index(b), kD_s.index(b),
                               kr_s.index(b), bars.index(b), bars.index(b), ph, S_L, True)
                s = warpgroup_mma_wait(0, deps=[s])
                s = gl.where(valid[None, :], s * sm_scale_log2, float("-inf"))
                m_new = gl.maximum(m_run, gl.max(s, 1))
                p = gl.exp2(s - m_new[:, None])
                alpha = gl.exp2(m_run - m_new)
                l_i = l_i * alpha + gl.sum(p, 1)
                m_run = m_new
                pb = p.to(gl.bfloat16)
                kr_s.index(b).store(pb)  # P for WG1, in the rope columns this block's scores are done with
                a_s.index(b).store(alpha)
                fence_async_shared()
                mbarrier.arrive(bars.index(4 + b))
                alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
                pa = gl.convert_layout(pb, PA_L)
                acc0 = warpgroup_mma(pa, kA_s.index(b), acc0 * alpha_o, is_async=True)
                acc1 = warpgroup_mma(pa, kB_s.index(b), acc1 * alpha_o, is_async=True)
            else:
                mbarrier.wait(bars.index(4 + b), ph)
                alpha_o = a_s.index(b).load(gl.SliceLayout(1, O_L))[:, None]
                acc0 = warpgroup_mma(kr_s.index(b), kC_s.index(b), acc0 * alpha_o, is_async=True)
                acc1 = warpgroup_mma(kr_s.index(b), kD_s.index(b), acc1 * alpha_o, is_async=True)
            acc0, acc1 = warpgroup_mma_wait(0, deps=[acc0, acc1])
            mbarrier.arrive(bars.index(2 + b))  # this warpgroup is done with buffer b
        if WG == 0:
            ml_s.index(0).store(m_run)
            ml_s.index(1).store(l_i)
            mbarrier.arrive(bars.index(6))
        else:
            mbarrier.wait(bars.index(6), 0)
            m_run = ml_s.index(0).load(ROW)
            l_i = ml_s.index(1).load(ROW)
        _ws_store(acc0, acc1, WG * 256, l_i, m_run, WG, out_ptr, lse_ptr, po_ptr, plse_ptr, t, hg, sp, H,
                  num_splits, stride_ot, stride_oh, stride_lt, stride_lh, S_L, O_L)

    @gluon.jit
    def _ws8_math0(qN_s, qR_s, kA_s, kB_s, kC_s, kD_s, kr_s, a_s, ml_s, bars, idx_row, start, end, num_slots,
                   n_blocks, sm_scale_log2, out_ptr, lse_ptr, po_ptr, plse_ptr, t, hg, sp, H, num_splits,
                   stride_ot, stride_oh, stride_lt, stride_lh):
        _ws8_math(0, qN_s, qR_s, kA_s, kB_s, kC_s, kD_s, kr_s, a_s, ml_s, bars, idx_row, start, end, num_slots,
                  n_blocks, sm_scale_log2, out_ptr, lse_ptr, po_ptr, plse_ptr, t, hg, sp, H, num_splits,
                  stride_ot, stride_oh, stride_lt, stride_lh)

    @gluon.jit
    def _ws8_math1(qN_s, qR_s, kA_s, kB_s, kC_s, kD_s, kr_s, a_s, ml_s, bars, idx_row, start, end, num_slots,
                   n_blocks, sm_scale_log2, out_ptr, lse_ptr, po_ptr, plse_ptr, t, hg, sp, H, num_splits,
                   stride_ot, stride_oh, stride_lt, stride_lh):
        _ws8_math(1, qN_s, qR_s, kA_s, kB_s, kC_s, kD_s, kr_s, a_s, ml_s, bars, idx_row, start, end, num_slots,
                  n_blocks, sm_scale_log2, out_ptr, lse_ptr, po_ptr, plse_ptr, t, hg, sp, H, num_splits,
                  stride_ot, stride_oh, stride_lt, stride_lh)

    @gluon.jit
    def _sparse_mla_fwd_sm90_ws_kernel(
        q_ptr, qr_ptr, kv_ptr, idx_ptr, req_ptr, bt_ptr, out_ptr, lse_ptr, po_ptr, plse_ptr,
        H, topk, num_slots, block_size, split_len, num_head_groups, num_splits, max_blocks,
        stride_qt, stride_qh, stride_rt, stride_rh, rope_off,
        stride_kvb, stride_kvt,
        stride_it, stride_btr,
        stride_ot, stride_oh, stride_lt, stride_lh,
        sm_scale_log2,
        IS_FP8: gl.constexpr, FP8_NATIVE: gl.constexpr, SPLIT: gl.constexpr, DOT_F32: gl.constexpr,
        BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, DV_SPLIT: gl.constexpr = 1, FP8_POST: gl.constexpr = False,
        PAGED: gl.constexpr = False, SKIP_TAIL: gl.constexpr = True, NUM_BUF: gl.constexpr = 2,
        P_SWIZZLE: gl.constexpr = 128, PDL: gl.constexpr = False,
    ):
        pdl_enter_gluon(PDL)  # launched with PDL: nothing is read before the previous kernel is done (pdl.py)
        gl.static_assert(not IS_FP8 or FP8_NATIVE, "fp8_ds_mla: native e4m3 conversion (sm_90)")
        gl.static_assert(not PAGED, "the sm_90 Gluon kernel reads slot ids")
        gl.static_assert(DV_SPLIT == 1, "the sm_90 Gluon kernel has no dv_split")
        gl.static_assert(BLOCK_H == 64 and BLOCK_N == 64, "the warp-specialised kernel is a 64-head x 64-key tile")
        gl.static_assert(NUM_BUF == 2, "two key buffers (one per math warpgroup)")
        LD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        SH: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        V1: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])

        pid = gl.program_id(0)
        hg = pid % num_head_groups
        rest = pid // num_head_groups
        sp = rest % num_splits
        t = rest // num_splits

        offs_h = hg * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, LD))
        hmask = offs_h < H
        d = gl.arange(0, 128, layout=gl.SliceLayout(0, LD))
        r = gl.arange(0, 64, layout=gl.SliceLayout(0, LD))
        q_row = q_ptr + t.to(gl.int64) * stride_qt + offs_h.to(gl.int64) * stride_qh
        qr_row = qr_ptr + t.to(gl.int64) * stride_rt + offs_h.to(gl.int64) * stride_rh + rope_off
        # Q as [4, 64, 128] + [1, 64, 64] so that the loop can index it (see _ws_math's dyn)
        qN_s = gl.allocate_shared_memory(gl.bfloat16, [4, 64, 128], SH)
        for c in gl.static_range(4):
            qN_s.index(c).store(gl.load(q_row[:, None] + (c * 128 + d[None, :]), mask=hmask[:, None], other=0.0))
        qR_s = gl.allocate_shared_memory(gl.bfloat16, [1, 64, 64], SH)
        qR_s.index(0).store(gl.load(qr_row[:, None] + r[None, :], mask=hmask[:, None], other=0.0))
        kA_s = gl.allocate_shared_memory(gl.bfloat16, [2, 64, 128], SH)
        kB_s = gl.allocate_shared_memory(gl.bfloat16, [2, 64, 128], SH)
        kC_s = gl.allocate_shared_memory(gl.bfloat16, [2, 64, 128], SH)
        kD_s = gl.allocate_shared_memory(gl.bfloat16, [2, 64, 128], SH)
        kr_s = gl.allocate_shared_memory(gl.bfloat16, [2, 64, 64], SH)
        start = sp * split_len
        end = gl.minimum(start + split_len, topk)
        idx_row = idx_ptr + t.to(gl.int64) * stride_it
        n_blocks = gl.cdiv(end - start, 64)
        if SKIP_TAIL:
            n_blocks = gl.cdiv(_last_valid(idx_row, start, end, num_slots, 4) + 1 - start, 64)
        if IS_FP8:
            # alpha per buffer (WG0's rescale factor for WG1), the final row max and sum; mbarriers 0/1: buffer
            # ready (the producer), 2/3: buffer free (both math warpgroups), 4/5: P and alpha of the buffer's block
            # (WG0), 6: the row max and sum (WG0)
            a_s = gl.allocate_shared_memory(gl.float32, [2, 64], V1)
            ml_s = gl.allocate_shared_memory(gl.float32, [2, 64], V1)
            bars = gl.allocate_shared_memory(gl.int64, [7, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(7):
                mbarrier.init(bars.index(i), count=2 if i == 2 or i == 3 else 1)
            fence_async_shared()
            _barrier()
            math_args = (qN_s, qR_s, kA_s, kB_s, kC_s, kD_s, kr_s, a_s, ml_s, bars,
                         idx_row, start, end, num_slots, n_blocks, sm_scale_log2,
                         out_ptr, lse_ptr, po_ptr, plse_ptr, t, hg, sp, H, num_splits,
                         stride_ot, stride_oh, stride_lt, stride_lh)
            prod_args = (kv_ptr, idx_row, start, end, num_slots, block_size, stride_kvb, stride_kvt, n_blocks,
                         kA_s, kB_s, kC_s, kD_s, kr_s, bars)
            gl.warp_specialize([(_ws8_producer, prod_args), (_ws8_math0, math_args), (_ws8_math1, math_args)],
                               [4, 4], [WS8_SCORE_REGS, WS8_PV_REGS])
        else:
            # P0 (WG0's block, read by WG1's P.V) lives in buffer 0's rope columns: only WG0's scores read those,
            # and the producer refills them after WG1's P.V is done (FlashMLA does the same); P1 has its own buffer
            p1_s = gl.allocate_shared_memory(gl.bfloat16, [64, 64], SH)
            m0_s = gl.allocate_shared_memory(gl.float32, [64], V1)
            m1_s = gl.allocate_shared_memory(gl.float32, [64], V1)
            l0_s = gl.allocate_shared_memory(gl.float32, [64], V1)
            l1_s = gl.allocate_shared_memory(gl.float32, [64], V1)
            # 0-3: ready (buffer 0 L, 0 R, 1 L, 1 R; every producer thread arrives), 4-7: free (same order),
            # 8/9: WG0's max / the final max, 10/11: P0 / P1 in shared memory, 12/13: row sums
            bars = gl.allocate_shared_memory(gl.int64, [14, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(4):
                mbarrier.init(bars.index(i), count=128)
            for i in gl.static_range(4, 14):
                mbarrier.init(bars.index(i), count=1)
            n_pairs = gl.cdiv(n_blocks, 2)
            fence_async_shared()
            _barrier()
            math_args = (qN_s, qR_s, kA_s, kB_s, kC_s, kD_s, kr_s, p1_s, m0_s, m1_s, l0_s, l1_s, bars,
                         idx_row, start, end, num_slots, n_pairs, sm_scale_log2,
                         out_ptr, lse_ptr, po_ptr, plse_ptr, t, hg, sp, H, num_splits,
                         stride_ot, stride_oh, stride_lt, stride_lh)
            prod_args = (kv_ptr, idx_row, start, end, num_slots, block_size, stride_kvb, stride_kvt, n_pairs,
                         kA_s, kB_s, kC_s, kD_s, kr_s, bars)
            # (a partition gets its arguments as values: the math warpgroup's number reaches it through its function)
            gl.warp_specialize([(_ws_producer, prod_args), (_ws_math0, math_args), (_ws_math1, math_args)],
                               [4, 4], [WS_MATH_REGS, WS_MATH_REGS])
else:  # pragma: no cover
    _sparse_mla_fwd_sm90_kernel = None
    _sparse_mla_fwd_sm90_ws_kernel = None
