"""Where vLLM's sparse-attention indexer gets its fp8 MQA logits: DeepGEMM or the Triton kernels.

The hooks in `sparse_attn_indexer.py` and `v1/attention/backends/mla/indexer.py` call these
functions instead of `vllm.utils.deep_gemm`'s. They have the same signatures as the wrappers of
the running vLLM release (0.16.0-0.19.1: `fp8_mqa_logits`, `fp8_paged_mqa_logits`; 0.20.0 on:
`fp8_fp4_mqa_logits`, `fp8_fp4_paged_mqa_logits`, fp8 query path, `indices=` from 0.28.0; 0.33.0's
row-compressed prefill logits as `fp8_fp4_mqa_logits_compressed`, its paged call without `clean_logits`)
and dispatch per call:

* DeepGEMM when it is usable: installed, on compute capability 9.x/10.x, the portable switch
  (`DSA_OVERLAY_PORTABLE=1`) off, and the indexer head count one DeepGEMM's kernels accept
  (32 or 64; measured asserting otherwise on the H200);
* otherwise the overlay's Triton kernels (`kernels/indexer.py`), which take any head count and
  run on every capability >= 8.0.

One exception: from vLLM 0.33.0 on sm_100, vLLM writes the indexer's K cache with DeepGEMM's MX scales
(`mqa_logits_use_mx_scales()`: UE8M0 bytes where the Triton kernels read a float32 scale), so there the
indexer stays on DeepGEMM whatever the switches say (`deep_gemm_format_required`).

`fill_paged_mqa_logits_metadata` replaces the decode builder's DeepGEMM scheduling call; on the
Triton path it never touches DeepGEMM.

`cuda_dsa_module_supported` gates vLLM 0.29.0+'s CUDA model module for DeepSeek-V3.2 / GLM-5
(`vllm/models/deepseek_v32/nvidia/`), whose Triton kernels (`models/deepseek_v32/common/kernels.py`: `fused_norm_rope`,
`fused_q`) always store fp8; below sm_89 the hook in `vllm/models/deepseek_v32/__init__.py` serves the generic
`deepseek_v2` classes instead, as upstream does on CPU and XPU.

`fused_q_quant_supported` gates upstream's fused indexer-query kernel (0.25.0 on:
`_fused_indexer_q_rope_quant_kernel` in `sparse_attn_indexer.py`, RoPE + fp8 quant in one Triton
kernel). It stores float8_e4m3fn, which Triton compiles only for compute capability >= 8.9 (fp8e4nv);
below that the hook in `deepseek_v2.py` keeps upstream's unfused path (torch RoPE, then vLLM's CUDA
`per_token_group_fp8_quant`).

Diagnostics: `DSA_OVERLAY_INDEXER=triton` sends the indexer to the Triton kernels while leaving the
attention backend choice alone (e.g. FLASHMLA_SPARSE attention + Triton indexer on a Hopper GPU, to
isolate a mismatch); `auto` or unset is the normal dispatch above.
"""

from __future__ import annotations

import functools
import os

DEEP_GEMM_INDEX_HEADS = (32, 64)
DEEP_GEMM_MAJORS = (9, 10)
# Triton stores float8_e4m3fn (fp8e4nv) only from here on; below it raises at compile time.
TRITON_FP8E4NV_MIN_CAPABILITY = (8, 9)
INDEXER_ENV = "DSA_OVERLAY_INDEXER"


def forced_triton(environ=None) -> bool:
    """`DSA_OVERLAY_INDEXER=triton`: Triton logits whatever the attention backend (diagnostics)."""
    env = os.environ if environ is None else environ
    value = env.get(INDEXER_ENV, "").strip().lower()
    if value in ("", "auto"):
        return False
    if value == "triton":
        return True
    raise ValueError(
        f"{INDEXER_ENV}={env.get(INDEXER_ENV)!r} is not understood; set it to triton (force the "
        "Triton indexer kernels) or auto / unset it"
    )


def deep_gemm_usable_for(
    capability_major: int | None, installed: bool, portable: bool, force_triton: bool = False,
    format_required: bool = False,
) -> bool:
    """Pure part of the decision (unit-tested): may the indexer use DeepGEMM on this device?
    `format_required`: the K cache is in DeepGEMM's MX format (vLLM 0.33.0+ on sm_100), which only
    DeepGEMM reads; the switches cannot send it elsewhere."""
    if format_required and installed:
        return True
    return (
        installed and not portable and not force_triton and capability_major in DEEP_GEMM_MAJORS
    )


@functools.cache
def deep_gemm_format_required() -> bool:
    """vLLM 0.33.0 on: does the running release keep the indexer's K cache and logits inputs in
    DeepGEMM's MX format on this device (sm_100)? False for older releases (no such switch)."""
    try:
        from vllm.utils.deep_gemm import mqa_logits_use_mx_scales
    except ImportError:
        return False
    return bool(mqa_logits_use_mx_scales())


@functools.cache
def use_deep_gemm() -> bool:
    """Per process: DeepGEMM usable on this device and not switched off by the portable switch."""
    from vllm.platforms import current_platform

    from .selection import portable_switch

    if not current_platform.is_cuda():
        return False
    try:
        from vllm.utils.import_utils import has_deep_gemm
    except ImportError:  # older layouts
        from vllm.utils.deep_gemm import has_deep_gemm
    cap = current_platform.get_device_capability()
    return deep_gemm_usable_for(
        cap.major if cap else None, has_deep_gemm(), portable_switch(), forced_triton(),
        deep_gemm_format_required(),
    )


def logits_available() -> bool:
    """The indexer can compute logits on this device (DeepGEMM or Triton): always, on CUDA."""
    return True


def triton_fp8_store_supported(capability: tuple[int, int] | None) -> bool:
    """Pure part (unit-tested): can a Triton kernel that stores float8_e4m3fn run on `capability`?"""
    return capability is not None and tuple(capability) >= TRITON_FP8E4NV_MIN_CAPABILITY


def fused_q_quant_supported() -> bool:
    """Per call (the indexer layer's __init__): may upstream's fused indexer-query RoPE + fp8 quant
    kernel run on this device? False off CUDA and below sm_89 (the unfused path runs instead)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        return False
    cap = current_platform.get_device_capability()
    return triton_fp8_store_supported((cap.major, cap.minor) if cap is not None else None)


def cuda_dsa_module_supported() -> bool:
    """At import of `vllm.models.deepseek_v32` (0.29.0+): serve DeepSeek-V3.2 / GLM-5 from upstream's
    CUDA module? Only on CUDA at sm_89+, where its fp8-storing Triton kernels compile; the same rule
    as `fused_q_quant_supported`."""
    return fused_q_quant_supported()


def _triton():
    from .kernels import indexer
    return indexer


def _deep_gemm():
    import vllm.utils.deep_gemm as dg

    return dg


def _heads(q) -> int:
    values = q[0] if isinstance(q, tuple) else q
    return int(values.shape[-2])


def _on_deep_gemm(heads: int) -> bool:
    # MX-format caches (0.33.0+, sm_100) go to DeepGEMM whatever the head count: it says so if it can't.
    return use_deep_gemm() and (heads in DEEP_GEMM_INDEX_HEADS or deep_gemm_format_required())


def _impl(name: str, heads: int):
    return getattr(_deep_gemm() if _on_deep_gemm(heads) else _triton(), name)


# --- vLLM 0.20.0+ names -----------------------------------------------------------------------


def fp8_fp4_mqa_logits(q, kv, weights, cu_seqlen_ks, cu_seqlen_ke, clean_logits):
    return _impl("fp8_fp4_mqa_logits", _heads(q))(
        q, kv, weights, cu_seqlen_ks, cu_seqlen_ke, clean_logits=clean_logits
    )


def fp8_fp4_mqa_logits_compressed(q, kv, weights, cu_seqlen_ks, cu_seqlen_ke, max_seqlen_k):
    """vLLM 0.33.0's prefill logits (its `fp8_fp4_mqa_logits` signature): row-compressed
    [M, max_seqlen_k], row m holding keys [ks[m], ke[m]) from column 0, the tails unspecified."""
    if _on_deep_gemm(_heads(q)):
        return _deep_gemm().fp8_fp4_mqa_logits(q, kv, weights, cu_seqlen_ks, cu_seqlen_ke, max_seqlen_k)
    return _triton().fp8_fp4_mqa_logits(
        q, kv, weights, cu_seqlen_ks, cu_seqlen_ke, clean_logits=False, max_seqlen_k=max_seqlen_k
    )


def fp8_fp4_paged_mqa_logits(
    q, kv_cache, weights, context_lens, block_tables, schedule_metadata, max_model_len,
    clean_logits=None, indices=None,
):
    """`indices` (0.28.0 on): the request of each flattened varlen decode row, a scheduling hint for
    DeepGEMM's SM100 kernel, passed to DeepGEMM only when given. The Triton kernel does not need it: the
    flattened rows already carry their own context length and block-table row. `clean_logits`: passed by
    0.20.0-0.32.0, not by 0.33.0 (whose DeepGEMM wrapper has no such argument; then it is not passed on)."""
    on_dg = _on_deep_gemm(_heads(q))
    extra = {"indices": indices} if indices is not None and on_dg else {}
    if clean_logits is not None or not on_dg:
        extra["clean_logits"] = bool(clean_logits)
    return (_deep_gemm() if on_dg else _triton()).fp8_fp4_paged_mqa_logits(
        q, kv_cache, weights, context_lens, block_tables, schedule_metadata,
        max_model_len=max_model_len, **extra,
    )


# --- vLLM 0.16.0-0.19.1 names ---------------------------------------------------------------


def fp8_mqa_logits(q, kv, weights, cu_seqlen_ks, cu_seqlen_ke, clean_logits):
    return _impl("fp8_mqa_logits", _heads(q))(
        q, kv, weights, cu_seqlen_ks, cu_seqlen_ke, clean_logits=clean_logits
    )


def fp8_paged_mqa_logits(
    q_fp8, kv_cache_fp8, weights, context_lens, block_tables, schedule_metadata, max_model_len,
    clean_logits,
):
    return _impl("fp8_paged_mqa_logits", _heads(q_fp8))(
        q_fp8, kv_cache_fp8, weights, context_lens, block_tables, schedule_metadata,
        max_model_len=max_model_len, clean_logits=clean_logits,
    )


# --- decode scheduling metadata --------------------------------------------------------------


def fill_paged_mqa_logits_metadata(buffer, context_lens, block_size: int, num_sms: int, indices=None):
    """Fill the builder's fixed-address schedule buffer for the paged logits kernel; returns the part
    of it that holds the schedule (what the decode metadata keeps).

    DeepGEMM path: DeepGEMM's `get_paged_mqa_logits_metadata` (as upstream does), into the buffer's first
    rows (0.28.0 on, the schedule may be shorter than the buffer; `indices` is passed on when given).
    Triton path: the Triton module's own `get_paged_mqa_logits_metadata` when it has one of the buffer's
    shape; otherwise the buffer is left as is (the Triton kernel schedules itself).
    """
    if use_deep_gemm():
        extra = {} if indices is None else {"indices": indices}
        meta = _deep_gemm().get_paged_mqa_logits_metadata(context_lens, block_size, num_sms, **extra)
        view = buffer[: meta.shape[0]]
        view[:] = meta
        return view
    make = getattr(_triton(), "get_paged_mqa_logits_metadata", None)
    if make is None:
        return buffer
    meta = make(context_lens, block_size, num_sms)
    if meta is not None and tuple(meta.shape) == tuple(buffer.shape):
        buffer.copy_(meta)
    return buffer
