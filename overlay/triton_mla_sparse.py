"""TRITON_MLA_SPARSE: DeepSeek sparse MLA attention through the overlay's Triton kernel.

Laid out like vLLM's `flashmla_sparse.py`: a backend class that only declares what it supports, a
metadata builder that turns scheduler state into tensors once per step, and an impl whose
`forward_mqa` moves tensors into the kernel (the tensor work is in `triton_mla_sparse_ops.py`).

Differences from FLASHMLA_SPARSE, by design: every CUDA capability >= 8.0; any number of heads
(no padding to 64/128); any index_topk (no multiple-of-128 rule); the fp8_ds_mla cache is read by
the same kernel for prefill and decode (no bf16 up-conversion workspace). One code path serves
decode, prefill and chunked prefill: each query token attends to its own top-k cached slots, and
the current chunk's KV is already in the cache when `forward_mqa` runs.

The same file serves every supported release. Its bases are picked by what the installed vLLM
provides: 0.26+ has `SparseMLACommonImpl` / `SparseMLACommonMetadataBuilder` (sparse_mla_attention.py),
which FLASHMLA_SPARSE and FLASH_ATTN_MLA_SPARSE subclass there too: the builder splits decodes from
prefills and builds the dense-MHA prefill metadata, the impl inherits `forward_mha`, and vLLM sends
prefills no longer than top-k through dense MHA and every other token to `forward_mqa`. 0.16-0.25
have `SparseMLAAttentionImpl`, and the builder here does the whole step itself (every token through
`forward_mqa`). Layers without an indexer (GLM-5.2's `index_topk_freq` > 1 reuses the previous
layer's top-k) read the shared `topk_indices_buffer` vLLM passes them (0.24+).
It is imported by vLLM through `AttentionBackendEnum.TRITON_MLA_SPARSE`; imported from a checkout
without vLLM, only the declarative backend class is usable (its bases become plain placeholders).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import ClassVar

import torch

from . import triton_mla_sparse_ops as ops
from .selection import BACKEND_NAME, MIN_CAPABILITY, SUPPORTED_KV_CACHE_DTYPES

try:
    from vllm.config import VllmConfig
    from vllm.v1.attention.backend import (
        AttentionBackend,
        AttentionCGSupport,
        AttentionLayer,
        AttentionMetadata,
        AttentionMetadataBuilder,
        CommonAttentionMetadata,
    )
    from vllm.v1.kv_cache_interface import AttentionSpec

    HAVE_VLLM = True
except ImportError:  # a checkout without vLLM: keep the declarations importable and testable
    HAVE_VLLM = False

    class _Placeholder:
        def __class_getitem__(cls, item):
            return cls

    AttentionBackend = AttentionMetadata = AttentionMetadataBuilder = _Placeholder
    AttentionCGSupport = AttentionLayer = CommonAttentionMetadata = None
    VllmConfig = AttentionSpec = None

SPARSE_COMMON_MODULE = "vllm.model_executor.layers.attention.sparse_mla_attention"  # vLLM 0.26+


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package this release does not have
        return False


# 0.26+: the bases upstream's sparse backends share (dense-MHA prefill included); 0.16-0.25: the sparse
# impl base and the plain builder. Chosen by the module's presence, so an import error inside it shows.
SHARED_SPARSE_BASES = HAVE_VLLM and _has_module(SPARSE_COMMON_MODULE)
if SHARED_SPARSE_BASES:
    from vllm.model_executor.layers.attention.sparse_mla_attention import (
        SparseMLACommonImpl as _ImplBase,
    )
    from vllm.model_executor.layers.attention.sparse_mla_attention import (
        SparseMLACommonMetadataBuilder as _BuilderBase,
    )
elif HAVE_VLLM:
    from vllm.v1.attention.backend import SparseMLAAttentionImpl as _ImplBase

    _BuilderBase = AttentionMetadataBuilder
else:
    _ImplBase = _BuilderBase = _Placeholder

BLOCK_SIZE = 64  # what vLLM's sparse indexer (DeepseekV32IndexerBackend) requires on CUDA


class TritonMLASparseBackend(AttentionBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[str]] = list(SUPPORTED_KV_CACHE_DTYPES)

    @staticmethod
    def get_supported_kernel_block_sizes() -> list[int]:
        return [BLOCK_SIZE]

    @classmethod
    def supports_block_size(cls, block_size: int | None) -> bool:
        return block_size is None or block_size == BLOCK_SIZE

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_builder_cls() -> type[TritonMLASparseMetadataBuilder]:
        return TritonMLASparseMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type[TritonMLASparseImpl]:
        return TritonMLASparseImpl

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [ops.HEAD_SIZE]  # 512 latent + 64 rope

    @classmethod
    def is_mla(cls) -> bool:
        return True

    @classmethod
    def is_sparse(cls) -> bool:
        return True

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        return (capability.major, capability.minor) >= MIN_CAPABILITY

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,  # 1 for MLA
        head_size: int,
        cache_dtype_str: str = "auto",
    ) -> tuple[int, ...]:
        if cache_dtype_str == "fp8_ds_mla":
            return (num_blocks, block_size, ops.FP8_DS_MLA_BYTES)
        return (num_blocks, block_size, head_size)


@dataclass
class TritonMLASparseMetadata(AttentionMetadata):
    num_reqs: int
    max_query_len: int
    max_seq_len: int
    num_actual_tokens: int  # excluding CUDA-graph padding
    query_start_loc: torch.Tensor
    slot_mapping: torch.Tensor
    block_table: torch.Tensor  # int32 [num_reqs, max_blocks]
    req_id_per_token: torch.Tensor  # int32 [>= num tokens], fixed address (CUDA graphs)
    block_size: int = BLOCK_SIZE
    topk_tokens: int = 2048
    # Read by 0.26+'s MLAAttention (decodes first, then the prefills it may send to dense MHA) and
    # filled by SparseMLACommonMetadataBuilder.build; on 0.16-0.25 they keep these defaults.
    num_decodes: int = 0
    num_prefills: int = 0
    num_decode_tokens: int = 0
    decode_max_query_len: int = 0   # 0.30+
    seq_lens: torch.Tensor | None = None
    prefill_max_seq_len: int = 0
    prefill: object | None = None  # MLACommonPrefillMetadata
    cp_kv_cache_interleave_size: int = 1


class TritonMLASparseMetadataBuilder(_BuilderBase[TritonMLASparseMetadata]):
    # Every step is one kernel launch over fixed-address buffers: uniform decode batches can be
    # captured in full CUDA graphs.
    _cudagraph_support: ClassVar = AttentionCGSupport.UNIFORM_BATCH if HAVE_VLLM else None
    metadata_cls = TritonMLASparseMetadata  # what SparseMLACommonMetadataBuilder.build makes (0.26+)

    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: list[str],
        vllm_config: VllmConfig,
        device: torch.device,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        # Decodes first, like the sparse indexer's builder (the kernel itself takes mixed batches).
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=True)
        if SHARED_SPARSE_BASES:  # the base made topk_tokens and req_id_per_token_buffer
            return
        self.model_config = vllm_config.model_config
        self.topk_tokens = self.model_config.hf_config.index_topk
        self.req_id_per_token_buffer = torch.zeros(
            (vllm_config.scheduler_config.max_num_batched_tokens,),
            dtype=torch.int32,
            device=device,
        )

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> TritonMLASparseMetadata:
        if SHARED_SPARSE_BASES:  # 0.26+: the shared builder, prefill split and MHA metadata included
            return super().build(common_prefix_len, common_attn_metadata, fast_build)
        cm = common_attn_metadata
        req_ids = ops.req_id_per_token(cm.query_start_loc_cpu)
        # Zero the tail so CUDA-graph padding tokens read request 0's (valid) block table row.
        self.req_id_per_token_buffer.fill_(0)
        self.req_id_per_token_buffer[: req_ids.shape[0]].copy_(req_ids, non_blocking=True)
        return TritonMLASparseMetadata(
            num_reqs=cm.num_reqs,
            max_query_len=cm.max_query_len,
            max_seq_len=cm.max_seq_len,
            num_actual_tokens=cm.num_actual_tokens,
            query_start_loc=cm.query_start_loc,
            slot_mapping=cm.slot_mapping,
            block_table=cm.block_table_tensor,
            req_id_per_token=self.req_id_per_token_buffer,
            block_size=self.kv_cache_spec.block_size,
            topk_tokens=self.topk_tokens,
        )


class TritonMLASparseImpl(_ImplBase[TritonMLASparseMetadata]):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None,
        attn_type: str,
        kv_sharing_target_layer_name: str | None,
        # MLA specific arguments. The indexer's buffer is the one its layer fills; a layer without an
        # indexer (GLM-5.2, index_topk_freq > 1) reuses the previous layer's through the shared
        # `topk_indices_buffer` (0.24+; 0.16.0 names it `topk_indice_buffer`).
        indexer=None,
        topk_indices_buffer: torch.Tensor | None = None,
        **mla_args,
    ) -> None:
        if any((alibi_slopes, sliding_window, logits_soft_cap)):
            raise NotImplementedError(
                f"{BACKEND_NAME} does not support alibi_slopes, sliding_window or logits_soft_cap"
            )
        shared = topk_indices_buffer
        if shared is None:
            shared = mla_args.pop("topk_indice_buffer", None)
        if SHARED_SPARSE_BASES:  # 0.26+: the base keeps MLA dims and kv_b_proj for forward_mha
            super().__init__(
                num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
                kv_cache_dtype, logits_soft_cap, attn_type, kv_sharing_target_layer_name,
                indexer=indexer, topk_indices_buffer=shared, **mla_args,
            )
        else:
            self.num_heads = num_heads
            self.head_size = head_size
            self.scale = float(scale)
            self.num_kv_heads = num_kv_heads
            self.kv_cache_dtype = kv_cache_dtype
            self.kv_lora_rank = mla_args["kv_lora_rank"]
            self.topk_indices_buffer = indexer.topk_indices_buffer if indexer is not None else shared
        if self.topk_indices_buffer is None:
            raise ValueError(
                f"{BACKEND_NAME} needs the model's sparse indexer or the shared topk_indices_buffer "
                "(a sparse model, index_topk set)"
            )
        self.softmax_scale = float(scale)
        self.kv_format = ops.kv_format_for(kv_cache_dtype)
        self.supports_quant_query_input = False  # the kernel takes the bf16 (ql_nope, q_pe) pair

    def forward_mqa(
        self,
        q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        kv_c_and_k_pe_cache: torch.Tensor,
        attn_metadata: TritonMLASparseMetadata,
        layer: AttentionLayer,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        out, _lse = ops.sparse_mla_forward(
            q,
            kv_c_and_k_pe_cache,
            self.topk_indices_buffer,
            attn_metadata.req_id_per_token,
            attn_metadata.block_table,
            attn_metadata.block_size,
            self.softmax_scale,
            self.kv_format,
        )
        return out, None
