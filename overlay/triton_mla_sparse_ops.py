"""The tensor work of the TRITON_MLA_SPARSE backend, in plain torch (no vLLM import).

`triton_mla_sparse.py` holds the vLLM-facing classes (backend declaration, metadata builder,
impl); everything here is what they call, unit-tested from a checkout:

* `req_id_per_token`: which request each scheduled token belongs to (from `query_start_loc`).
* `convert_req_index_to_global`: the indexer's top-k is request-local (token positions inside the
  request's sequence, -1 for "none"); the kernel wants global slot ids of the paged cache
  (`block_table[req, pos // block_size] * block_size + pos % block_size`). Any index that is
  negative or falls outside the request's block table becomes -1, which the kernel skips.
  Works for any top-k width (upstream's Triton converter needs a multiple of 128), allocates
  only [T, topk] and never synchronises with the host, so it can be captured in a CUDA graph.
* `kv_slots`: checks the per-layer paged cache ([num_blocks, block_size, 576] bf16 or 656 bytes
  fp8_ds_mla) and hands it to the kernel without copying (slot s = block s // bs, offset s % bs).
* `sparse_mla_forward`: one kernel call for the whole batch (prefill, chunked prefill and decode
  tokens alike: each query token carries its own top-k of cached slots); the kernel reads vLLM's
  (ql_nope, q_pe) pair in place and, for decode-sized batches, converts the request-local top-k as it reads
  it, so a layer costs the host one launch (two with a split top-k) and the output allocations; larger
  batches add one small conversion launch (bench/launch_census.py).
"""

from __future__ import annotations

import torch

KV_LORA_RANK = 512
ROPE_DIM = 64
HEAD_SIZE = KV_LORA_RANK + ROPE_DIM  # 576
FP8_DS_MLA_BYTES = 656  # 512 fp8 + 4 fp32 scales + 64 bf16 rope


def kv_format_for(kv_cache_dtype: str) -> str:
    """vLLM's kv-cache dtype string -> the kernel's kv_format."""
    if kv_cache_dtype in ("auto", "bfloat16"):
        return "bf16"
    if kv_cache_dtype == "fp8_ds_mla":
        return "fp8_ds_mla"
    raise ValueError(
        f"TRITON_MLA_SPARSE: kv-cache dtype {kv_cache_dtype!r} is not supported; "
        "use auto/bfloat16 or fp8_ds_mla"
    )


def req_id_per_token(query_start_loc_cpu: torch.Tensor) -> torch.Tensor:
    """[num_reqs + 1] cumulative query starts (CPU) -> int32 [num_tokens] request index per token."""
    starts = query_start_loc_cpu.to(torch.int64)
    lengths = starts[1:] - starts[:-1]
    reqs = torch.arange(lengths.numel(), dtype=torch.int32)
    return torch.repeat_interleave(reqs, lengths)


def convert_req_index_to_global(
    req_id: torch.Tensor,
    block_table: torch.Tensor,
    local_indices: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """Request-local top-k positions -> global slot ids (int32, -1 where invalid).

    req_id: int [T] request row of each token in `block_table`.
    block_table: int32 [num_reqs, max_blocks] physical block ids per request.
    local_indices: int [T, topk] positions inside the request's sequence (-1 = none).
    """
    if local_indices.dim() != 2 or req_id.shape[0] != local_indices.shape[0]:
        raise ValueError(
            f"top-k indices {tuple(local_indices.shape)} do not match {req_id.shape[0]} tokens"
        )
    max_blocks = block_table.shape[1]
    local = local_indices.to(torch.int64)
    block = torch.div(local, block_size, rounding_mode="floor")
    valid = (local >= 0) & (block < max_blocks)
    flat = req_id.to(torch.int64).unsqueeze(1) * max_blocks + torch.where(valid, block, 0)
    physical = torch.take(block_table, flat).to(torch.int64)
    slots = physical * block_size + (local - block * block_size)
    return torch.where(valid & (physical >= 0), slots, -1).to(torch.int32)


def kv_slots(kv_cache: torch.Tensor, kv_format: str) -> torch.Tensor:
    """Check one layer's paged cache and give it to the kernel as is (never a copy).

    [num_blocks, block_size, width]: width 576 bf16, or 656 bytes for fp8_ds_mla (viewed as uint8).
    Blocks may be strided (e.g. a cross-layer allocation); the last dimension must be contiguous.
    """
    width = FP8_DS_MLA_BYTES if kv_format == "fp8_ds_mla" else HEAD_SIZE
    if kv_cache.dim() != 3 or kv_cache.shape[-1] != width or kv_cache.stride(-1) != 1:
        raise ValueError(
            f"{kv_format} kv cache must be [num_blocks, block_size, {width}] with a contiguous "
            f"last dimension, got shape {tuple(kv_cache.shape)} strides {kv_cache.stride()}"
        )
    if kv_format == "fp8_ds_mla":
        if kv_cache.element_size() != 1:
            raise ValueError(f"fp8_ds_mla kv cache must have 1-byte elements, got {kv_cache.dtype}")
        return kv_cache.view(torch.uint8)
    if kv_cache.dtype != torch.bfloat16:
        raise ValueError(f"bf16 kv cache must be bfloat16, got {kv_cache.dtype}")
    return kv_cache


def concat_q(q) -> torch.Tensor:
    """vLLM hands q as [T, H, 576] or as the pair (ql_nope [T, H, 512], q_pe [T, H, 64])."""
    if isinstance(q, tuple):
        q = torch.cat(q, dim=-1)
    return q.contiguous()


def _kernel():
    from .kernels import sparse_mla
    return sparse_mla.sparse_mla_attention


def sparse_mla_forward(
    q,
    kv_cache: torch.Tensor,
    local_indices: torch.Tensor,
    req_id: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    softmax_scale: float,
    kv_format: str,
    attention=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA for a batch of query tokens: (out [T, H, 512] bf16, lse [T, H] fp32).

    `attention` defaults to the Triton kernel `sparse_mla_attention`, which reads the (ql_nope, q_pe) pair in
    place and converts the request-local indices (its block_table / req_id arguments): as it reads them for
    decode-sized batches (one launch, no slot tensor), by one small launch first otherwise; never a
    concatenation. Tests pass a reference, which gets the concatenated q and global slot ids from
    `convert_req_index_to_global`.
    """
    kv = kv_slots(kv_cache, kv_format)
    if attention is None and kv.shape[1] == block_size:
        return _kernel()(q if isinstance(q, tuple) else q.contiguous(), kv, local_indices, softmax_scale,
                         kv_format=kv_format, block_table=block_table, req_id=req_id)
    q = concat_q(q)
    num_tokens = q.shape[0]
    slots = convert_req_index_to_global(
        req_id[:num_tokens], block_table, local_indices[:num_tokens], block_size
    )
    fn = attention if attention is not None else _kernel()
    return fn(q, kv, slots, softmax_scale, kv_format=kv_format)
