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
* `plan_fp8_prefill` / `Segment` / `fp8_workspace`: with an fp8_ds_mla cache, the requests of a step that
  prefill enough tokens against a short enough context are read through a bf16 copy of their context
  (kernels/fp8_workspace.py, then the bf16 tile), the rest straight from the fp8 cache, as vLLM's
  FLASHMLA_SPARSE does for its fp8 prefills. `sparse_mla_forward(segments=...)` runs such a plan.
"""

from __future__ import annotations

from dataclasses import dataclass

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


# fp8_ds_mla prefills through a bf16 workspace. A request takes it when its step has at least FP8_WS_MIN_QUERY query
# tokens and its context is at most FP8_WS_ROWS_PER_TOKEN rows per query token: up-converting a row costs ~0.5 ns
# of copy bandwidth on the H200 (656 B read, 1152 B written), the bf16 tile saves 0.2-0.6 us per token and 64 heads
# over the fp8 tile (bench/RESULTS.md), so 256 rows per token stays a clear gain. Decodes (one token, a long context)
# never qualify, so a captured decode graph holds no plan. Workspace rows: FP8_WS_CONTEXTS x max_model_len, the size
# upstream reserves (a larger group of requests splits into segments; a request that does not fit reads fp8).
FP8_WS_MIN_QUERY = 64
FP8_WS_ROWS_PER_TOKEN = 256
FP8_WS_CONTEXTS = 5
FP8_WS_ENV = "DSA_OVERLAY_FP8_PREFILL_BF16"


@dataclass(frozen=True)
class Segment:
    """Tokens tok_start..tok_end (requests req_start..req_end) of a step, read one way."""
    tok_start: int
    tok_end: int
    req_start: int
    req_end: int
    ws_blocks: int = 0  # 0: straight from the fp8 cache; else the workspace blocks this segment fills
    block_table: torch.Tensor | None = None  # int32 [requests, max blocks]: workspace block ids, -1 past a request's
    req_id: torch.Tensor | None = None  # int32 [tokens]: each token's request within the segment


def fp8_workspace_enabled(environ=None) -> bool:
    from .kernels.launch import env_switch
    return env_switch(FP8_WS_ENV, "fp8_ds_mla prefills read the fp8 cache directly", environ)


def plan_fp8_prefill(query_start_loc_cpu: torch.Tensor, seq_lens_cpu: torch.Tensor, block_size: int,
                     capacity_blocks: int, device=None, *, min_query: int | None = None,
                     rows_per_token: int | None = None) -> list[Segment] | None:
    """Which requests of a step read their context through the bf16 workspace (None: none do).

    query_start_loc_cpu: [num_reqs + 1] cumulative query starts; seq_lens_cpu: [>= num_reqs] context lengths
    (this step's tokens included; an upper bound is enough). The segments cover tokens 0..query_start_loc[-1] in
    order; consecutive workspace requests share a segment while their blocks fit in capacity_blocks. Tables are
    made on the host and moved to `device`.
    """
    min_query = FP8_WS_MIN_QUERY if min_query is None else min_query
    rows_per_token = FP8_WS_ROWS_PER_TOKEN if rows_per_token is None else rows_per_token
    qsl = [int(x) for x in query_start_loc_cpu.tolist()]
    num_reqs = len(qsl) - 1
    nbs = [-(-int(s) // block_size) for s in seq_lens_cpu[:num_reqs].tolist()]
    worthy = [0 < nb <= capacity_blocks and qsl[r + 1] - qsl[r] >= min_query
              and nb * block_size <= rows_per_token * (qsl[r + 1] - qsl[r]) for r, nb in enumerate(nbs)]
    if not any(worthy):
        return None
    segments, r = [], 0
    while r < num_reqs:
        end, used = r, 0
        if not worthy[r]:
            while end < num_reqs and not worthy[end]:
                end += 1
            if qsl[end] > qsl[r]:
                segments.append(Segment(qsl[r], qsl[end], r, end))
            r = end
            continue
        while end < num_reqs and worthy[end] and used + nbs[end] <= capacity_blocks:
            used += nbs[end]
            end += 1
        width = max(nbs[r:end])
        table = torch.full((end - r, width), -1, dtype=torch.int32)
        base = 0
        for i, nb in enumerate(nbs[r:end]):
            table[i, :nb] = torch.arange(base, base + nb, dtype=torch.int32)
            base += nb
        lengths = torch.tensor([qsl[k + 1] - qsl[k] for k in range(r, end)])
        req_id = torch.repeat_interleave(torch.arange(end - r, dtype=torch.int32), lengths)
        segments.append(Segment(qsl[r], qsl[end], r, end, used, table.to(device), req_id.to(device)))
        r = end
    return segments


_WORKSPACES: dict = {}


def fp8_workspace(num_blocks: int, block_size: int, device) -> torch.Tensor:
    """The bf16 workspace [>= num_blocks, block_size, 576] of `device`, shared by every layer (one layer runs at a
    time). `reserve_fp8_workspace` makes it at model build, before vLLM measures memory; it only grows here."""
    key = (torch.device(device), block_size)
    ws = _WORKSPACES.get(key)
    if ws is None or ws.shape[0] < num_blocks:
        ws = _WORKSPACES[key] = torch.empty((num_blocks, block_size, HEAD_SIZE), dtype=torch.bfloat16,
                                            device=device)
    return ws


def reserve_fp8_workspace(max_model_len: int, block_size: int, device) -> int:
    """Make the workspace for FP8_WS_CONTEXTS contexts of max_model_len rows; returns its size in rows."""
    blocks = -(-FP8_WS_CONTEXTS * max_model_len // block_size)
    fp8_workspace(blocks, block_size, device)
    return blocks * block_size


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
    segments: list[Segment] | None = None,
    with_lse: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sparse MLA for a batch of query tokens: (out [T, H, 512] bf16, lse [T, H] fp32). with_lse=False (the
    backend: vLLM reads no lse): the Triton kernel writes the lse into scratch, one allocation less per call, and
    lse may come back None.

    `attention` defaults to the Triton kernel `sparse_mla_attention`, which reads the (ql_nope, q_pe) pair in
    place and converts the request-local indices (its block_table / req_id arguments): as it reads them for
    decode-sized batches (one launch, no slot tensor), by one small launch first otherwise; never a
    concatenation. Tests pass a reference, which gets the concatenated q and global slot ids from
    `convert_req_index_to_global`. `segments` (fp8_ds_mla, from `plan_fp8_prefill`): the workspace segments read
    a bf16 copy of their requests' blocks, every other token the fp8 cache (tokens past the plan, e.g. CUDA-graph
    padding, included).
    """
    kv = kv_slots(kv_cache, kv_format)
    if segments is not None and attention is None and kv.shape[1] == block_size:
        return _forward_segments(q, kv, local_indices, req_id, block_table, block_size, softmax_scale, segments)
    if attention is None and kv.shape[1] == block_size:
        return _kernel()(q if isinstance(q, tuple) else q.contiguous(), kv, local_indices, softmax_scale,
                         kv_format=kv_format, block_table=block_table, req_id=req_id, with_lse=with_lse)
    q = concat_q(q)
    num_tokens = q.shape[0]
    slots = convert_req_index_to_global(
        req_id[:num_tokens], block_table, local_indices[:num_tokens], block_size
    )
    fn = attention if attention is not None else _kernel()
    return fn(q, kv, slots, softmax_scale, kv_format=kv_format)


def _forward_segments(q, kv, local_indices, req_id, block_table, block_size, softmax_scale, segments):
    from .kernels.fp8_workspace import upconvert_blocks

    attention = _kernel()
    qn = q[0] if isinstance(q, tuple) else q
    T, H = qn.shape[:2]

    def rows(a, b):  # q rows a..b, as a pair or one tensor (read in place)
        return (q[0][a:b], q[1][a:b]) if isinstance(q, tuple) else q[a:b]

    out = torch.empty((T, H, KV_LORA_RANK), dtype=torch.bfloat16, device=qn.device)
    lse = torch.empty((T, H), dtype=torch.float32, device=qn.device)

    def from_fp8(a, b):  # tokens a..b straight from the fp8 cache
        attention(rows(a, b), kv, local_indices[a:b], softmax_scale, kv_format="fp8_ds_mla", out=out[a:b],
                  lse=lse[a:b], block_table=block_table, req_id=req_id[a:])

    done = 0
    for seg in segments:
        if seg.tok_start >= T:
            break
        a, b = seg.tok_start, min(seg.tok_end, T)
        if seg.ws_blocks and b == seg.tok_end:
            ws = fp8_workspace(seg.ws_blocks, block_size, qn.device)[: seg.ws_blocks]
            upconvert_blocks(kv, block_table, seg.req_start, seg.block_table, ws)
            attention(rows(a, b), ws, local_indices[a:b], softmax_scale, kv_format="bf16", out=out[a:b],
                      lse=lse[a:b], block_table=seg.block_table, req_id=seg.req_id)
        else:
            from_fp8(a, b)
        done = b
    if done < T:  # tokens past the plan (CUDA-graph padding) read the cache as before
        from_fp8(done, T)
    return out, lse
