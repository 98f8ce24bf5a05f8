# SPDX-License-Identifier: Apache-2.0
"""Paged indexer logits (decode) for sm_90 in Gluon: the key tile's wgmma overlapped with the last tile's epilogue.

Same computation, arguments, work split and outputs as ``indexer._paged_mqa_logits_kernel`` with NESTED (the
per-request walk); :func:`indexer.fp8_paged_mqa_logits` launches it for a config with ``GLUON=True``.

Why it exists: the Triton kernel waits for each tile's score wgmma before its epilogue (ReLU, head weights, the sum
over each token's heads, the key scale, the store) and only then issues the next tile's MMA, so the tensor cores
and the epilogue's ALU work take turns. With two query tokens (next_n = 2, MTP) the [BLOCK_N, 2 x 64] score tile
doubles both, and on the H200 the Triton kernel ran at 0.61x DeepGEMM there (bench/RESULTS.md). Here each program
is one warpgroup that keeps two score tiles: tile i's wgmma is issued asynchronously, then tile i - 1's epilogue
runs while it multiplies (``warpgroup_mma_wait(1)``); the keys are gathered by cp.async NUM_BUF - 1 tiles ahead
into NUM_BUF shared buffers (one 16-byte vector per thread and row chunk, masked rows read nothing) and Q stays in
shared memory for the whole request.

Gluon only compiles for NVIDIA GPUs: correctness is checked on a GPU (tests/kernels/gpu_checks.py against the
float references) and the kernel is cross-compiled for sm_90 by tests/kernels/test_indexer_xcompile.py.
"""

from __future__ import annotations

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait
    _barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    _cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
except ImportError:  # pragma: no cover - older Triton
    gluon = None

from .pdl import pdl_enter_gluon  # noqa: E402

GLUON = gluon is not None


if GLUON:
    @gluon.jit
    def _request_tiles_g(cl_ptr, b0, B, stride_cb, stride_cj, tok, tok_ok, vis_shift, max_model_len, clean,
                         BLOCK_B: gl.constexpr, BLOCK_N: gl.constexpr, L2: gl.constexpr):
        """Work items (key tiles, at least 1) of requests [b0, b0 + BLOCK_B); 0 past B (as the Triton kernel)."""
        rb = b0 + gl.arange(0, BLOCK_B, layout=gl.SliceLayout(1, L2))
        b_ok = rb < B
        vis = gl.load(cl_ptr + rb[:, None] * stride_cb + tok[None, :] * stride_cj,
                      mask=b_ok[:, None] & tok_ok[None, :], other=0) + vis_shift[None, :]
        vis = gl.where(tok_ok[None, :], vis, 0)
        length = gl.minimum(gl.max(vis, axis=1), max_model_len)
        length = gl.where(clean != 0, max_model_len, length)
        return gl.where(b_ok, gl.maximum(gl.cdiv(length, BLOCK_N), 1), 0)

    @gluon.jit
    def _add(a, b):
        return a + b

    @gluon.jit
    def _phys(bt_row, tt, kv_len, block_size, BLOCK_N: gl.constexpr, L1: gl.constexpr, ONE: gl.constexpr):
        """Physical block of each key of tile tt (layout L1; 0 past kv_len), or with ONE (the tile lies in one cache
        block) that block's, one scalar. Loaded an iteration before the gather or scale load that uses it, so no
        thread waits on a block-table read right before issuing a copy."""
        if ONE:
            phys = gl.load(bt_row + (tt * BLOCK_N) // block_size, mask=tt * BLOCK_N < kv_len, other=0)
        else:
            n = tt * BLOCK_N + gl.arange(0, BLOCK_N, layout=L1)
            phys = gl.load(bt_row + n // block_size, mask=n < kv_len, other=0)
        return phys

    @gluon.jit
    def _gather_keys(kvv_ptr, phys, tt, kv_len, block_size, stride_blk, k_buf,
                     BLOCK_N: gl.constexpr, D: gl.constexpr, LK: gl.constexpr):
        """Start the cp.async copies of key tile tt ([BLOCK_N, D] e4m3 rows; ``phys``: their blocks, from _phys)
        into k_buf; rows past kv_len read nothing. One commit group."""
        n = tt * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LK))
        n_ok = n < kv_len
        d = gl.arange(0, D, layout=gl.SliceLayout(0, LK))
        rows = kvv_ptr + (phys.to(gl.int64) * stride_blk + (n % block_size) * D)[:, None]
        _cp_async(k_buf, rows + d[None, :], mask=n_ok[:, None])
        async_copy.commit_group()

    @gluon.jit
    def _tile_scales(kvs_ptr, phys, tt, kv_len, block_size, stride_blk_f, scale_base,
                     BLOCK_N: gl.constexpr, LS: gl.constexpr):
        """Per-key fp32 scales of tile tt (``phys``: their blocks in layout LS); 0 past kv_len."""
        n = tt * BLOCK_N + gl.arange(0, BLOCK_N, layout=LS)
        return gl.load(kvs_ptr + phys.to(gl.int64) * stride_blk_f + scale_base + n % block_size, mask=n < kv_len,
                       other=0.0)

    @gluon.jit
    def _epilogue(s, w, ksc, tt, vis0, vis1, tok_ok0, tok_ok1, out0, out1, max_model_len,
                  BLOCK_N: gl.constexpr, T: gl.constexpr, HP: gl.constexpr, ACC: gl.constexpr):
        """Tile tt's scores [BLOCK_N, T * HP] -> per token: key scale * sum over its heads of w * relu(s); keys a
        token does not see get -inf; stored for keys < max_model_len of the tokens that exist."""
        p = gl.maximum(s, 0.0) * w[None, :]
        n = tt * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ACC))
        n_st = n < max_model_len
        if T == 1:
            l0 = gl.sum(p, axis=1) * ksc
            gl.store(out0 + n, gl.where(n < vis0, l0, float("-inf")), mask=n_st & tok_ok0)
        else:
            col = gl.arange(0, T * HP, layout=gl.SliceLayout(0, ACC))
            first = (col < HP)[None, :]
            l0 = gl.sum(gl.where(first, p, 0.0), axis=1) * ksc
            l1 = gl.sum(gl.where(first, 0.0, p), axis=1) * ksc
            gl.store(out0 + n, gl.where(n < vis0, l0, float("-inf")), mask=n_st & tok_ok0)
            gl.store(out1 + n, gl.where(n < vis1, l1, float("-inf")), mask=n_st & tok_ok1)

    @gluon.jit
    def _paged_mqa_logits_sm90_kernel(
        q_ptr, kv_ptr, w_ptr, cl_ptr, bt_ptr, out_ptr,
        B, H, next_n, j0, max_model_len, is_1d, clean, block_size, num_programs,
        stride_qb, stride_qn, stride_qh, stride_wm, stride_wh, stride_cb, stride_cj, stride_btb,
        stride_blk, stride_om,
        D: gl.constexpr, HP: gl.constexpr, T: gl.constexpr, BLOCK_N: gl.constexpr,
        BLOCK_B: gl.constexpr, NUM_BUF: gl.constexpr = 4, BS: gl.constexpr = 0, PDL: gl.constexpr = False,
    ):
        pdl_enter_gluon(PDL)  # launched with PDL: nothing is read before the previous kernel is done (pdl.py)
        block_size = BS if BS > 0 else block_size   # a constant block size: its divisions become shifts
        ONE: gl.constexpr = BS % BLOCK_N == 0 if BS > 0 else False   # every tile inside one cache block
        gl.static_assert(T == 1 or T == 2, "one or two query tokens per program")
        gl.static_assert(NUM_BUF >= 2, "NUM_BUF >= 2")
        gl.static_assert(D == 128, "index head dim 128")
        # One warpgroup. ACC: the score wgmma's accumulator [BLOCK_N, T * HP] (keys as M); LK: 16-byte vectors,
        # 8 lanes across a 128-byte key row; L2: [BLOCK_B, 2] request scans; LT: the (up to 2) tokens.
        ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, T * HP, 32])
        LK: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
        L2: gl.constexpr = gl.BlockedLayout([1, 2], [32, 1], [4, 1], [1, 0])
        LT: gl.constexpr = gl.SliceLayout(0, L2)
        SH: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
        LB: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])   # the scan over requests

        pid = gl.program_id(0)
        kvs_ptr = kv_ptr.to(gl.pointer_type(gl.float32))
        kvv_ptr = kv_ptr.to(gl.pointer_type(gl.float8e4nv))
        rt = gl.arange(0, 2, layout=LT)
        tok = j0 + rt
        tok_ok = (tok < next_n) & (rt < T)
        vis_shift = is_1d * (tok + 1 - next_n)

        total = 0
        for b0 in range(0, B, BLOCK_B):
            total += gl.sum(_request_tiles_g(cl_ptr, b0, B, stride_cb, stride_cj, tok, tok_ok, vis_shift,
                                             max_model_len, clean, BLOCK_B, BLOCK_N, L2), axis=0)
        total = total.to(gl.int64)
        w_start = (pid * total // num_programs).to(gl.int32)
        w_end = ((pid + 1) * total // num_programs).to(gl.int32)
        b = 0
        before = 0
        run = 0
        for b0 in range(0, B, BLOCK_B):
            tiles = gl.convert_layout(_request_tiles_g(cl_ptr, b0, B, stride_cb, stride_cj, tok, tok_ok, vis_shift,
                                                       max_model_len, clean, BLOCK_B, BLOCK_N, L2), LB)
            done = (gl.associative_scan(tiles, 0, _add) + run) <= w_start
            b += gl.sum(done.to(gl.int32), axis=0)
            before += gl.sum(gl.where(done, tiles, 0), axis=0)
            run += gl.sum(tiles, axis=0)
        t = w_start - before

        LQ: gl.constexpr = LK
        cols = gl.arange(0, T * HP, layout=gl.SliceLayout(1, LQ))
        col_tok = j0 + cols // HP
        col_head = cols % HP
        col_ok = (col_tok < next_n) & (col_head < H)
        dq = gl.arange(0, D, layout=gl.SliceLayout(0, LQ))
        wcols = gl.arange(0, T * HP, layout=gl.SliceLayout(0, ACC))
        wtok = j0 + wcols // HP
        whead = wcols % HP
        w_ok = (wtok < next_n) & (whead < H)
        LS: gl.constexpr = gl.SliceLayout(1, ACC)
        scale_base = block_size * D // 4
        stride_blk_f = stride_blk // 4
        s_zero = gl.zeros([BLOCK_N, T * HP], gl.float32, layout=ACC)

        q_s = gl.allocate_shared_memory(gl.float8e4nv, [T * HP, D], SH)
        k_s = gl.allocate_shared_memory(gl.float8e4nv, [NUM_BUF, BLOCK_N, D], SH)

        todo = w_end - w_start
        while todo > 0:
            vis = gl.load(cl_ptr + b * stride_cb + tok * stride_cj, mask=tok_ok, other=0) + vis_shift
            vis = gl.where(tok_ok, gl.minimum(vis, max_model_len), 0)
            kv_len = gl.max(vis, axis=0)
            vis0 = gl.sum(gl.where(rt == 0, vis, 0), axis=0)
            vis1 = gl.sum(gl.where(rt == 1, vis, 0), axis=0)
            ok0 = j0 < next_n
            ok1 = (j0 + 1 < next_n) & (T == 2)
            len_b = gl.where(clean != 0, max_model_len, kv_len)
            t_end = gl.minimum(gl.maximum(gl.cdiv(len_b, BLOCK_N), 1), t + todo)
            b64 = b.to(gl.int64)
            bt_row = bt_ptr + b64 * stride_btb
            out0 = out_ptr + (b64 * next_n + j0) * stride_om
            out1 = out0 + stride_om
            # the request's keys start streaming before Q is stored
            KR: gl.constexpr = gl.SliceLayout(1, LK)
            for j in gl.static_range(NUM_BUF - 1):
                _gather_keys(kvv_ptr, _phys(bt_row, t + j, kv_len, block_size, BLOCK_N, KR, ONE), t + j, kv_len,
                             block_size, stride_blk, k_s.index(j), BLOCK_N, D, LK)
            phys_g = _phys(bt_row, t + NUM_BUF - 1, kv_len, block_size, BLOCK_N, KR, ONE)
            q = gl.load(q_ptr + b64 * stride_qb + col_tok[:, None] * stride_qn + col_head[:, None] * stride_qh
                        + dq[None, :], mask=col_ok[:, None], other=0.0)
            q_s.store(q)
            w = gl.load(w_ptr + (b64 * next_n + wtok) * stride_wm + whead * stride_wh, mask=w_ok,
                        other=0.0).to(gl.float32)
            ksc = _tile_scales(kvs_ptr, _phys(bt_row, t, kv_len, block_size, BLOCK_N, LS, ONE), t, kv_len,
                               block_size, stride_blk_f, scale_base, BLOCK_N, LS)
            phys_s = _phys(bt_row, t + 1, kv_len, block_size, BLOCK_N, LS, ONE)
            # tile t: issue its MMA; nothing to finish before it
            async_copy.wait_group(NUM_BUF - 2)
            fence_async_shared()
            _barrier()
            s_prev = warpgroup_mma(k_s.index(0), q_s.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            _gather_keys(kvv_ptr, phys_g, t + NUM_BUF - 1, kv_len, block_size, stride_blk, k_s.index(NUM_BUF - 1),
                         BLOCK_N, D, LK)
            phys_g = _phys(bt_row, t + NUM_BUF, kv_len, block_size, BLOCK_N, KR, ONE)
            ksc_prev = ksc
            for tt in range(t + 1, t_end):
                i = tt - t
                ksc = _tile_scales(kvs_ptr, phys_s, tt, kv_len, block_size, stride_blk_f, scale_base, BLOCK_N, LS)
                phys_s = _phys(bt_row, tt + 1, kv_len, block_size, BLOCK_N, LS, ONE)
                async_copy.wait_group(NUM_BUF - 2)   # tile tt landed (this thread's rows)
                fence_async_shared()
                _barrier()                           # ... and every thread's
                s = warpgroup_mma(k_s.index(i % NUM_BUF), q_s.permute((1, 0)), s_zero, use_acc=False,
                                  is_async=True)
                s_prev = warpgroup_mma_wait(1, deps=[s_prev])   # tile tt - 1 done; tt multiplies on
                # tile tt - 1's buffer is free: refill it NUM_BUF - 1 tiles ahead
                _gather_keys(kvv_ptr, phys_g, tt + NUM_BUF - 1, kv_len, block_size, stride_blk,
                             k_s.index((i + NUM_BUF - 1) % NUM_BUF), BLOCK_N, D, LK)
                phys_g = _phys(bt_row, tt + NUM_BUF, kv_len, block_size, BLOCK_N, KR, ONE)
                _epilogue(s_prev, w, ksc_prev, tt - 1, vis0, vis1, ok0, ok1, out0, out1, max_model_len,
                          BLOCK_N, T, HP, ACC)
                s_prev = s
                ksc_prev = ksc
            s_prev = warpgroup_mma_wait(0, deps=[s_prev])
            _epilogue(s_prev, w, ksc_prev, t_end - 1, vis0, vis1, ok0, ok1, out0, out1, max_model_len,
                      BLOCK_N, T, HP, ACC)
            async_copy.wait_group(0)   # the copies issued past the request's last tile (masked)
            _barrier()                 # every thread's wgmma reads of Q and the buffers are done
            todo -= t_end - t
            b += 1
            t = t * 0
else:  # pragma: no cover
    _paged_mqa_logits_sm90_kernel = None
