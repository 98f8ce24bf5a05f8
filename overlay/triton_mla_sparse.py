"""TRITON_MLA_SPARSE: DeepSeek sparse MLA attention through the overlay's Triton kernel.

Laid out like vLLM's `flashmla_sparse.py`: a backend class that only declares what it supports, a
metadata builder that turns scheduler state into tensors once per step, and an impl whose
`forward_mqa` moves tensors into the kernel (the tensor work is in `triton_mla_sparse_ops.py`).

Differences from FLASHMLA_SPARSE, by design: every CUDA capability >= 8.0; any number of heads
(no padding to 64/128); any index_topk (no multiple-of-128 rule); the fp8_ds_mla cache is read by
the same kernel for decode and for prefills against long contexts; a step's requests that prefill
enough tokens against a short enough context read a bf16 copy of their context instead, as
FLASHMLA_SPARSE does (triton_mla_sparse_ops.plan_fp8_prefill; DSA_OVERLAY_FP8_PREFILL_BF16=0: never). One
code path serves decode, prefill and chunked prefill: each query token attends to its own top-k cached
slots, and the current chunk's KV is already in the cache when `forward_mqa` runs.

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
    # Host copies for the fp8_ds_mla prefill plan (ops.plan_fp8_prefill), made once per step by the first layer
    # that needs it and kept here for the others.
    query_start_loc_cpu: torch.Tensor | None = None
    seq_lens_cpu: torch.Tensor | None = None  # an upper bound is enough; None: read seq_lens when needed
    fp8_segments: list | None = None
    fp8_planned: bool = False


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
        cm = common_attn_metadata
        host_seq_lens = getattr(cm, "seq_lens_cpu_upper_bound", None)
        if host_seq_lens is None:
            host_seq_lens = getattr(cm, "_seq_lens_cpu", None)  # 0.16-0.22: set by the model runner
        if SHARED_SPARSE_BASES:  # 0.26+: the shared builder, prefill split and MHA metadata included
            md = super().build(common_prefix_len, cm, fast_build)
            md.query_start_loc_cpu, md.seq_lens_cpu = cm.query_start_loc_cpu, host_seq_lens
            return md
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
            seq_lens=cm.seq_lens,
            query_start_loc_cpu=cm.query_start_loc_cpu,
            seq_lens_cpu=host_seq_lens,
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
        # fp8_ds_mla: the prefill workspace, made now so that vLLM's memory profile sees it (one per device, shared)
        self.fp8_ws_rows = 0
        if self.kv_format == "fp8_ds_mla" and ops.fp8_workspace_enabled():
            self.fp8_ws_rows = _reserve_fp8_workspace()

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
            segments=self._fp8_segments(attn_metadata, kv_c_and_k_pe_cache),
            with_lse=False,  # vLLM's sparse MLA layer reads no lse
        )
        return out, None

    def _fp8_segments(self, md: TritonMLASparseMetadata, kv_cache: torch.Tensor) -> list | None:
        """The step's fp8_ds_mla prefill plan (None: every token reads the fp8 cache), made by the first layer."""
        if not self.fp8_ws_rows or md.max_query_len < ops.FP8_WS_MIN_QUERY or md.query_start_loc_cpu is None:
            return None
        if not md.fp8_planned:
            seq_lens = md.seq_lens_cpu if md.seq_lens_cpu is not None else md.seq_lens.cpu()
            md.fp8_segments = ops.plan_fp8_prefill(md.query_start_loc_cpu, seq_lens, md.block_size,
                                                   self.fp8_ws_rows // md.block_size, kv_cache.device)
            md.fp8_planned = True
        return md.fp8_segments


def _reserve_fp8_workspace() -> int:
    """Reserve the fp8_ds_mla prefill workspace for the engine being built; returns its size in cache rows."""
    import vllm.config as vc

    try:  # 0.32+ raises outside an engine's config context (and has the _or_none twin)
        config = getattr(vc, "get_current_vllm_config_or_none", vc.get_current_vllm_config)()
    except AssertionError:
        config = None
    model, cache = getattr(config, "model_config", None), getattr(config, "cache_config", None)
    max_model_len, block_size = getattr(model, "max_model_len", None), getattr(cache, "block_size", None)
    if not max_model_len or not block_size or not torch.cuda.is_available():
        # no engine being built (a unit test): made on first use, for contexts of up to 4096 rows
        return ops.FP8_WS_CONTEXTS * (max_model_len or 4096)
    return ops.reserve_fp8_workspace(max_model_len, block_size, torch.device("cuda", torch.cuda.current_device()))
