# SPDX-License-Identifier: Apache-2.0
"""Sparse MLA attention for sm_90 (H100/H200) in Gluon: the 64-head tile with explicit warpgroup layouts.

Same computation, arguments and outputs as ``sparse_mla._sparse_mla_fwd_kernel`` (bf16 or fp8_ds_mla cache, slot
ids, with or without top-k splits); :func:`sparse_mla.sparse_mla_attention` launches it for a config with
``gluon=True``. fp8_ds_mla: the raw e4m3 bytes are gathered (two buffers) and dequantised once per block into one
bf16 operand that both dots read (the Triton tile keeps them in registers and stores them to shared memory per dot).
On the H200 that path is correct but 8-12% slower than the Triton tile (the dequantisation sits between two CTA
barriers with nothing to overlap it), so only bf16 is a default; fp8_ds_mla is a benchmark candidate.

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
bf16 cache, 64-head bucket, batches of at least GLUON_MIN_ROWS rows; DSA_OVERLAY_GLUON=0 turns it off).
"""

from __future__ import annotations

try:  # Gluon arrived in Triton 3.5; its Hopper API (warpgroup_mma, async_copy) is the same in 3.5 - 3.9
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait
    # cp.async gather into shared memory: async_copy_global_to_shared up to Triton 3.6, async_load from 3.7
    # CTA-wide barrier (bar.sync): gl.thread_barrier up to Triton 3.6, gl.barrier from 3.7
    _barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    _cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
except ImportError:  # pragma: no cover - older Triton
    gluon = None

GLUON = gluon is not None


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
    def _gather_block_fp8(kv_ptr, idx_row, n0, end, num_slots, block_size, stride_kvb, stride_kvt,
                          raw_s, kr_s, buf, BLOCK_N: gl.constexpr, LD: gl.constexpr, LDB: gl.constexpr):
        """fp8_ds_mla cache: start the cp.async gathers of rows idx[n0 : n0 + BLOCK_N] (one commit group): the 512
        e4m3 bytes into raw_s[buf] (dequantised after they land), the 64 bf16 rope values into kr_s[buf] (a wgmma
        operand as they are). Invalid slots read nothing, as in _gather_block."""
        row, valid = _rows(idx_row, n0, end, num_slots, block_size, stride_kvb, stride_kvt, BLOCK_N, LDB)
        b = gl.arange(0, 512, layout=gl.SliceLayout(0, LDB))
        _cp_async(raw_s.index(buf), kv_ptr + row[:, None] + b[None, :], mask=valid[:, None])
        row, valid = _rows(idx_row, n0, end, num_slots, block_size, stride_kvb, stride_kvt, BLOCK_N, LD)
        r = gl.arange(0, 64, layout=gl.SliceLayout(0, LD))
        rope = (kv_ptr + row + 528).to(gl.pointer_type(gl.bfloat16))
        _cp_async(kr_s.index(buf), rope[:, None] + r[None, :], mask=valid[:, None])
        async_copy.commit_group()

    @gluon.jit
    def _dequant_block(kv_ptr, idx_row, n0, end, num_slots, block_size, stride_kvb, stride_kvt, raw, kN_s,
                       BLOCK_N: gl.constexpr, LD8: gl.constexpr):
        """fp8_ds_mla: the landed e4m3 bytes of block n0 (raw, [BLOCK_N, 512]) times their row's tile scale (read
        from global memory: 16 bytes per row) into the four bf16 [BLOCK_N, 128] wgmma operands kN_s[0..3].
        Invalid rows were zero-filled and get scale 0."""
        row, valid = _rows(idx_row, n0, end, num_slots, block_size, stride_kvb, stride_kvt, BLOCK_N, LD8)
        sc = (kv_ptr + row + 512).to(gl.pointer_type(gl.float32))
        for c in gl.static_range(4):
            x = raw.slice(c * 128, 128, dim=1).load(LD8).to(gl.float8e4nv, bitcast=True).to(gl.float32)
            scale = gl.load(sc + c, mask=valid, other=0.0)
            kN_s.index(c).store((x * scale[:, None]).to(gl.bfloat16))

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
        P_SWIZZLE: gl.constexpr = 128,
    ):
        # P_SWIZZLE: the swizzle of P's [64, BLOCK_N] bf16 rows, min(128, 2 * BLOCK_N) bytes (the launcher's).
        # The Triton kernel's argument list, so one launch plan serves both; the variants it has and this one
        # has not are refused at compile time (the config check refuses them first).
        gl.static_assert(not IS_FP8 or (NUM_BUF == 2 and FP8_NATIVE), "fp8_ds_mla: 2 buffers, native e4m3")
        gl.static_assert(not PAGED, "the sm_90 Gluon kernel reads slot ids")
        gl.static_assert(DV_SPLIT == 1, "the sm_90 Gluon kernel has no dv_split")
        gl.static_assert(BLOCK_H == 64, "the sm_90 Gluon kernel is a 64-head tile")
        gl.static_assert(NUM_BUF >= 2, "NUM_BUF >= 2")

        # Register layouts: LD for gathers and global loads (16-byte vectors, 8 per 128-byte row segment);
        # S_L scores (warpgroup w: key columns [w * BLOCK_N/2, ...)); O_L each 128-column output tile
        # (warpgroup w: columns [64 w, 64 w + 64) of it). Shared layouts: 128-byte swizzled wgmma operands.
        LD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
        LD8: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [8, 1], [1, 0])  # fp8 bytes: [BLOCK_N, 128] tiles
        LDB: gl.constexpr = gl.BlockedLayout([1, 16], [1, 32], [8, 1], [1, 0])  # fp8 bytes: [BLOCK_N, 512] rows
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

        # KV operands. bf16: NUM_BUF buffers of the gathered rows, each a wgmma operand as it lands. fp8_ds_mla: two
        # buffers of raw e4m3 bytes (and of the bf16 rope values), dequantised into one bf16 operand per block.
        kr_s = gl.allocate_shared_memory(gl.bfloat16, [NUM_BUF, BLOCK_N, 64], SH)
        if IS_FP8:
            raw_s = gl.allocate_shared_memory(gl.uint8, [2, BLOCK_N, 512],
                                              gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2))
            kN_s = gl.allocate_shared_memory(gl.bfloat16, [4, BLOCK_N, 128], SH)
        else:
            kA_s = gl.allocate_shared_memory(gl.bfloat16, [NUM_BUF, BLOCK_N, 128], SH)
            kB_s = gl.allocate_shared_memory(gl.bfloat16, [NUM_BUF, BLOCK_N, 128], SH)
            kC_s = gl.allocate_shared_memory(gl.bfloat16, [NUM_BUF, BLOCK_N, 128], SH)
            kD_s = gl.allocate_shared_memory(gl.bfloat16, [NUM_BUF, BLOCK_N, 128], SH)
        p_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, BLOCK_N], P_SH)

        start = sp * split_len
        end = gl.minimum(start + split_len, topk)
        idx_row = idx_ptr + t.to(gl.int64) * stride_it
        # Trailing invalid indices change nothing (a prompt's first tokens have fewer than top-k keys; the indexer
        # pads their lists with -1): the loop ends after this split's last valid index (none: no iteration).
        n_iter = gl.cdiv(end - start, BLOCK_N)
        if SKIP_TAIL:
            scan = gl.arange(0, 1024, layout=gl.BlockedLayout([4], [32], [8], [0]))  # 4 indices per thread
            last = start - 1
            for i0 in range(start, end, 1024):
                offs = i0 + scan
                inside = offs < end
                slot = gl.load(idx_row + offs, mask=inside, other=-1)
                last = gl.maximum(last, gl.max(gl.where(inside & (slot >= 0) & (slot < num_slots), offs, -1), 0))
            n_iter = gl.cdiv(last + 1 - start, BLOCK_N)
        for j in gl.static_range(NUM_BUF - 1):  # prologue: the first NUM_BUF - 1 blocks in flight
            if IS_FP8:
                _gather_block_fp8(kv_ptr, idx_row, start + j * BLOCK_N, end, num_slots, block_size, stride_kvb,
                                  stride_kvt, raw_s, kr_s, j, BLOCK_N, LD, LDB)
            else:
                _gather_block(kv_ptr, idx_row, start + j * BLOCK_N, end, num_slots, block_size, stride_kvb,
                              stride_kvt, kA_s, kB_s, kC_s, kD_s, kr_s, j, BLOCK_N, LD)
        fence_async_shared()  # Q's shared-memory stores before the first wgmma reads them

        m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_L))
        l_i = gl.full([BLOCK_H], 0.0, gl.float32, layout=gl.SliceLayout(1, S_L))
        accA = gl.full([BLOCK_H, 128], 0.0, gl.float32, layout=O_L)
        accB = gl.full([BLOCK_H, 128], 0.0, gl.float32, layout=O_L)
        accC = gl.full([BLOCK_H, 128], 0.0, gl.float32, layout=O_L)
        accD = gl.full([BLOCK_H, 128], 0.0, gl.float32, layout=O_L)
        s_zero = gl.full([BLOCK_H, BLOCK_N], 0.0, gl.float32, layout=S_L)
        for i in range(n_iter):
            buf = i % NUM_BUF
            n0 = start + i * BLOCK_N
            # Block i has landed once at most NUM_BUF - 2 newer groups are pending; the barrier also means every
            # warp is done with iteration i - 1 (its wgmmas read the buffer refilled below, P and fp8's operand).
            async_copy.wait_group(NUM_BUF - 2)
            fence_async_shared()
            _barrier()
            if IS_FP8:
                _gather_block_fp8(kv_ptr, idx_row, n0 + BLOCK_N, end, num_slots, block_size, stride_kvb, stride_kvt,
                                  raw_s, kr_s, (i + 1) % 2, BLOCK_N, LD, LDB)
                _dequant_block(kv_ptr, idx_row, n0, end, num_slots, block_size, stride_kvb, stride_kvt,
                               raw_s.index(buf), kN_s, BLOCK_N, LD8)
                fence_async_shared()  # the dequantised stores before the wgmmas read them
                _barrier()
                kA = kN_s.index(0)
                kB = kN_s.index(1)
                kC = kN_s.index(2)
                kD = kN_s.index(3)
            else:
                _gather_block(kv_ptr, idx_row, n0 + (NUM_BUF - 1) * BLOCK_N, end, num_slots, block_size, stride_kvb,
                              stride_kvt, kA_s, kB_s, kC_s, kD_s, kr_s, (i + NUM_BUF - 1) % NUM_BUF, BLOCK_N, LD)
                kA = kA_s.index(buf)
                kB = kB_s.index(buf)
                kC = kC_s.index(buf)
                kD = kD_s.index(buf)
            s = warpgroup_mma(qr_s, kr_s.index(buf).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s = warpgroup_mma(qA_s, kA.permute((1, 0)), s, is_async=True)
            s = warpgroup_mma(qB_s, kB.permute((1, 0)), s, is_async=True)
            s = warpgroup_mma(qC_s, kC.permute((1, 0)), s, is_async=True)
            s = warpgroup_mma(qD_s, kD.permute((1, 0)), s, is_async=True)
            s = warpgroup_mma_wait(0, deps=[s])

            _, valid = _slots(idx_row, n0, end, num_slots, BLOCK_N, gl.SliceLayout(0, S_L))
            s = gl.where(valid[None, :], s * sm_scale_log2, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, 1))
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # all-invalid so far: avoid -inf - -inf
            alpha = gl.exp2(m_i - m_use)
            p = gl.exp2(s - m_use[:, None])
            l_i = l_i * alpha + gl.sum(p, 1)
            m_i = m_new

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
else:  # pragma: no cover
    _sparse_mla_fwd_sm90_kernel = None
