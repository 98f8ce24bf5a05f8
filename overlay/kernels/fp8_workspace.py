# SPDX-License-Identifier: Apache-2.0
"""Up-convert the cache blocks a prefill reads from an fp8_ds_mla cache into a bf16 workspace.

A prefill chunk of q tokens reads at most its requests' whole contexts, and every one of its tokens reads
top-k of them: dequantising the context once (656 bytes read, 1152 written per row) and running the bf16
attention tile over the copy costs less than dequantising each gathered row top-k x q / context times inside
the attention kernel. vLLM's FLASHMLA_SPARSE does the same for fp8_ds_mla prefills (its "separate prefill and
decode" mode, `cp_gather_and_upconvert_fp8_kv_cache`); the decision of which requests go this way is
`triton_mla_sparse_ops.plan_fp8_prefill`.

``upconvert_blocks(kv_cache, src_block_table, req_start, dst_block_table, workspace)``: for request i of the
destination table and block b, workspace block ``dst_block_table[i, b]`` (skipped where < 0) gets cache block
``src_block_table[req_start + i, b]`` dequantised to bf16, 576 values per slot (512 kv_c, then the 64 rope
values as stored). The dequantisation is the attention kernel's own (``_load_nope_tile``: e4m3 -> float32 x tile
scale -> bf16, bit-manipulated on sm_80/86), so the workspace holds exactly the values the fp8 tile computes.
Self-contained beside sparse_mla.py (torch + triton).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import DirectLauncher as _Launcher
from . import sparse_mla as _SM
from .sparse_mla import FP8_DS_MLA_BYTES, HEAD_DIM, _load_nope_tile, _load_rope_tile

ROWS = 16  # cache slots per program (a 64-slot block is four programs)


@triton.jit
def _upconvert_blocks_kernel(kv_ptr, src_bt_ptr, dst_bt_ptr, ws_ptr, req_start, src_width, num_blocks, block_size,
                             stride_kb, stride_kt, stride_sbt, stride_dbt, stride_wb, stride_wt,
                             FP8_NATIVE: tl.constexpr, ROWS: tl.constexpr):
    i = tl.program_id(0)
    b = tl.program_id(1)
    dst = tl.load(dst_bt_ptr + i * stride_dbt + b)
    if dst >= 0:
        r = tl.program_id(2) * ROWS + tl.arange(0, ROWS)
        in_block = r < block_size
        # the block id loaded into every lane (not as a scalar: Triton 3.9's interpreter rejects a mask that
        # combines a tensor with a scalar comparison)
        lane_b = b + tl.zeros([ROWS], dtype=tl.int32)
        src = tl.load(src_bt_ptr + (req_start + i).to(tl.int64) * stride_sbt + lane_b, mask=lane_b < src_width,
                      other=-1)
        valid = in_block & (src >= 0) & (src < num_blocks)
        row = src.to(tl.int64) * stride_kb + r.to(tl.int64) * stride_kt  # bytes
        out = ws_ptr + dst.to(tl.int64) * stride_wb + r.to(tl.int64)[:, None] * stride_wt
        d = tl.arange(0, 128)
        for c in tl.static_range(4):
            x, _ = _load_nope_tile(kv_ptr, row, valid, c * 128, True, FP8_NATIVE, False, tl.bfloat16)
            tl.store(out + c * 128 + d[None, :], x, mask=in_block[:, None])
        rope = _load_rope_tile(kv_ptr, row, valid, True, tl.bfloat16)
        tl.store(out + 512 + tl.arange(0, 64)[None, :], rope, mask=in_block[:, None])


_upconvert_launch = _Launcher(_upconvert_blocks_kernel)  # past Triton's JIT entry once a call's binary is known
LAUNCHERS = [_upconvert_launch]


def upconvert_blocks(kv_cache: torch.Tensor, src_block_table: torch.Tensor, req_start: int,
                     dst_block_table: torch.Tensor, workspace: torch.Tensor, *, fp8_native: bool | None = None) -> None:
    """Dequantise requests' cache blocks into workspace blocks (see the module docstring).

    kv_cache: [num_blocks, block_size, 656] fp8_ds_mla (any 1-byte dtype), last dimension contiguous.
    src_block_table: vLLM's int32 [num_reqs, max_blocks]; rows req_start .. req_start + n are read.
    dst_block_table: int32 [n, max_nb] workspace block ids, -1 where nothing is converted.
    workspace: bf16 [num_ws_blocks, block_size, 576], last dimension contiguous.
    A source entry < 0 or >= num_blocks (or past the table's width) with a destination gives a zero-filled block.
    """
    if kv_cache.dim() != 3 or kv_cache.shape[-1] != FP8_DS_MLA_BYTES or kv_cache.stride(-1) != 1:
        raise ValueError(f"upconvert_blocks: kv_cache must be [num_blocks, block_size, {FP8_DS_MLA_BYTES}] "
                         f"with a contiguous last dimension, got {tuple(kv_cache.shape)}")
    bs = kv_cache.shape[1]
    if (workspace.dim() != 3 or workspace.shape[1:] != (bs, HEAD_DIM) or workspace.dtype != torch.bfloat16
            or workspace.stride(-1) != 1):
        raise ValueError(f"upconvert_blocks: workspace must be bf16 [n, {bs}, {HEAD_DIM}], got "
                         f"{workspace.dtype} {tuple(workspace.shape)}")
    for name, t in (("src_block_table", src_block_table), ("dst_block_table", dst_block_table)):
        if t.dim() != 2 or t.dtype != torch.int32 or t.stride(1) != 1:
            raise ValueError(f"upconvert_blocks: {name} must be int32 [rows, blocks] with contiguous rows")
    n, max_nb = dst_block_table.shape
    if n == 0 or max_nb == 0:
        return
    if req_start < 0 or req_start + n > src_block_table.shape[0]:
        raise ValueError(f"upconvert_blocks: requests {req_start}..{req_start + n} are not all in the block table "
                         f"({src_block_table.shape[0]} rows)")
    kv = kv_cache.view(torch.uint8)
    if fp8_native is None:  # as the attention kernel decides it, from its cached (capability, SMs) lookup
        fp8_native = _SM._device_info(kv.device)[0] >= (8, 9)
    grid = (n, max_nb, triton.cdiv(bs, ROWS))
    _upconvert_launch(
        grid, kv, src_block_table, dst_block_table, workspace, req_start, src_block_table.shape[1], kv.shape[0], bs,
        kv.stride(0), kv.stride(1), src_block_table.stride(0), dst_block_table.stride(0),
        workspace.stride(0), workspace.stride(1), FP8_NATIVE=bool(fp8_native), ROWS=ROWS, num_warps=4)

