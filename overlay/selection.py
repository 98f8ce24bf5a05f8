"""Which sparse-MLA attention backend a DSA model gets, and why.

Two layers, kept apart so the policy is unit-tested without vLLM:

* `choose_sparse_backend(...)` is the pure policy. It sees the device's compute capability, whether
  the model needs sparse MLA, the kv-cache dtype, the upstream candidates' own validation results
  (backend name -> list of reasons it refused; empty list = it accepts this configuration), the
  user's explicit `--attention-backend` choice and the portable switch, and returns a `Decision`
  (backend name or None = "leave upstream's answer alone", plus a one-line reason).
* `vllm_select(...)` is the glue called from the hook in vLLM's `platforms/cuda.py`
  (`get_attn_backend_cls`). It asks vLLM's own candidates to validate, applies the measured upstream
  limits vLLM does not declare (FlashMLA's `index_topk % 128 == 0`), calls the policy and, when the
  policy picks TRITON_MLA_SPARSE, logs one line saying why and returns the backend's class path.
  vLLM is imported lazily, only there.

Which upstream candidates exist is the running release's business: `upstream_validation` asks the
release's own priority list. From vLLM 0.24.0 that list has a sparse backend on SM12x,
FLASHINFER_MLA_SPARSE_SM120, whose validation accepts kv caches auto / fp8 / fp8_e4m3 / fp8_ds_mla (it
stores all four as fp8_ds_mla) with index_topk == 2048 and FlashInfer's sparse MLA API present; the
policy keeps it there (unless the switch or an explicit choice forces Triton) and picks TRITON_MLA_SPARSE
for the rest (`--kv-cache-dtype bfloat16`, any other index_topk, sm_8x, releases before 0.24.0).

The portable switch: `DSA_OVERLAY_PORTABLE=1` makes a GPU where FlashMLA/DeepGEMM work (Hopper,
Blackwell datacenter) behave like one where they do not: TRITON_MLA_SPARSE for attention and the
Triton logits kernels in the sparse indexer (see `indexer_ops.py`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

BACKEND_NAME = "TRITON_MLA_SPARSE"
PORTABLE_ENV = "DSA_OVERLAY_PORTABLE"
# kv-cache dtypes the Triton kernel reads: the model dtype (bf16) or DeepSeek's 656-byte fp8 layout.
SUPPORTED_KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8_ds_mla")
MIN_CAPABILITY = (8, 0)
# Upstream sparse backends whose kernels need index_topk % 128 == 0 (FlashMLA's sparse path asserts
# it: seen on the H200 with vLLM 0.23.0). vLLM's validate_configuration cannot know index_topk.
TOPK_MULTIPLE_OF_128 = ("FLASHMLA_SPARSE",)

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}


def portable_switch(environ: Mapping[str, str] | None = None) -> bool:
    """True when `DSA_OVERLAY_PORTABLE` asks for the portable path (1/true/yes/on).

    An unrecognised value is an error rather than a silent "off": the user meant something."""
    env = os.environ if environ is None else environ
    value = env.get(PORTABLE_ENV, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(
        f"{PORTABLE_ENV}={env.get(PORTABLE_ENV)!r} is not understood; set it to 1 (portable "
        "Triton path) or 0 / unset it (vendor kernels where available)"
    )


@dataclass(frozen=True)
class Decision:
    backend: str | None  # None: keep upstream's selection (or its error)
    reason: str


def _cc_str(capability: tuple[int, int]) -> str:
    return f"{capability[0]}.{capability[1]}"


def supports_capability(capability: tuple[int, int]) -> bool:
    """TRITON_MLA_SPARSE runs on every CUDA capability >= 8.0 (bf16 tl.dot, cp.async)."""
    return tuple(capability) >= MIN_CAPABILITY


def supports_kv_cache_dtype(kv_cache_dtype: str | None) -> bool:
    return kv_cache_dtype is None or kv_cache_dtype in SUPPORTED_KV_CACHE_DTYPES


def upstream_extra_reasons(backend: str, index_topk: int | None) -> list[str]:
    """Limits of upstream sparse kernels that their validate_configuration does not check."""
    reasons = []
    if backend in TOPK_MULTIPLE_OF_128 and index_topk is not None and index_topk % 128:
        reasons.append(f"index_topk {index_topk} is not a multiple of 128")
    return reasons


def choose_sparse_backend(
    capability: tuple[int, int],
    use_sparse: bool,
    kv_cache_dtype: str | None,
    upstream: Mapping[str, Sequence[str]],
    explicit: str | None = None,
    portable: bool = False,
    limits: Mapping[str, Sequence[str]] | None = None,
) -> Decision:
    """The selection policy (pure).

    upstream: every candidate vLLM would consider, in its priority order, mapped to the reasons it
    refused this configuration (an empty sequence means it accepts it), the measured `limits` included.
    limits: the part of those reasons that vLLM's own validation does not see (`upstream_extra_reasons`):
    where vLLM's own first pick is refused only by them, the first candidate that accepts is named
    (e.g. FLASHINFER_MLA_SPARSE over FLASHMLA_SPARSE for index_topk 200 on sm_100, bf16 cache).
    """
    if not use_sparse:
        return Decision(None, "model does not use sparse MLA")
    if explicit is not None:
        # vLLM validates and honours an explicit choice itself; TRITON_MLA_SPARSE validates on cc>=8.0.
        return Decision(None, f"explicit --attention-backend {explicit}")
    cc = _cc_str(capability)
    if not supports_capability(capability):
        return Decision(None, f"compute capability {cc} is below 8.0 (no Triton sparse MLA)")
    valid = [name for name, reasons in upstream.items() if not reasons]
    if valid and not portable:
        limits = limits or {}
        own = next(name for name, reasons in upstream.items()
                   if not reasons or list(reasons) == list(limits.get(name, ())))
        if own != valid[0]:
            return Decision(valid[0], f"upstream's own pick {own} cannot run this model "
                                      f"({', '.join(limits[own])}); {valid[0]} validates on cc {cc}")
        return Decision(None, f"upstream {valid[0]} validates on cc {cc}")
    if not supports_kv_cache_dtype(kv_cache_dtype):
        return Decision(
            None,
            f"kv-cache dtype {kv_cache_dtype} is not one TRITON_MLA_SPARSE reads "
            f"({', '.join(SUPPORTED_KV_CACHE_DTYPES)}); use --kv-cache-dtype fp8_ds_mla",
        )
    if portable:
        return Decision(BACKEND_NAME, f"{PORTABLE_ENV}=1 is set (portable Triton path on cc {cc})")
    sparse_refusals = {
        name: list(reasons)
        for name, reasons in upstream.items()
        if not any("sparse not supported" in r for r in reasons)
    }
    detail = "; ".join(f"{n}: {', '.join(r)}" for n, r in sparse_refusals.items())
    return Decision(
        BACKEND_NAME,
        f"no upstream sparse MLA backend validates on cc {cc}"
        + (f" ({detail})" if detail else ""),
    )


# --------------------------------------------------------------------------------------------
# Glue for vLLM (imports vLLM lazily). Called by the hook in platforms/cuda.py.
# --------------------------------------------------------------------------------------------


def _current_index_topk() -> int | None:
    """The model's `index_topk`, or None where there is none: no vLLM config in context (the selection
    table of verify_hooks.py, profiling tools), no model config in it, or a model without the attribute
    (or with `index_topk: null`). Any other value that is not a positive integer is an error."""
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    model_config = getattr(config, "model_config", None)
    topk = getattr(getattr(model_config, "hf_config", None), "index_topk", None)
    if topk is None:
        return None
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise ValueError(f"the model config's index_topk={topk!r} is not a positive integer; fix the model's "
                         "config.json (or the GGUF's glm-dsa.attention.indexer.top_k)")
    return topk


def upstream_validation(device_capability, attn_selector_config, num_heads=None):
    """Ask each upstream candidate of this vLLM's CUDA platform to validate the configuration.

    Returns {backend name: [reasons it refuses]} in upstream priority order (empty list: accepts),
    plus the limits from `upstream_extra_reasons`. Works with the priority-function signatures of
    0.16.0 (use_mla, capability) and 0.23.0 (+ num_heads, kv_cache_dtype). A candidate that fails
    to import (ImportError, or e.g. a CUDA call at import on a machine without a GPU) is reported
    as refusing, with the exception's name.
    """
    import inspect

    from vllm.platforms import cuda as cuda_platform

    priorities = cuda_platform._get_backend_priorities
    params = inspect.signature(priorities).parameters
    kwargs = {}
    if "num_heads" in params:
        kwargs["num_heads"] = num_heads
    if "kv_cache_dtype" in params:
        kwargs["kv_cache_dtype"] = attn_selector_config.kv_cache_dtype
    candidates = priorities(attn_selector_config.use_mla, device_capability, **kwargs)
    topk = _current_index_topk()
    result: dict[str, list[str]] = {}
    for backend in candidates:
        try:
            reasons = list(
                backend.get_class().validate_configuration(
                    device_capability=device_capability, **attn_selector_config._asdict()
                )
            )
        except ImportError:
            reasons = ["ImportError"]
        except Exception as e:  # noqa: BLE001 - a candidate that cannot even load cannot run
            reasons = [f"{type(e).__name__} at import"]
        result[backend.name] = reasons + upstream_extra_reasons(backend.name, topk)
    return result


def measured_limits(upstream: Mapping[str, Sequence[str]]) -> dict[str, list[str]]:
    """{candidate: the reasons of `upstream_validation` that are the overlay's measured limits}."""
    topk = _current_index_topk()
    return {name: upstream_extra_reasons(name, topk) for name in upstream}


def vllm_select(platform_cls, selected_backend, attn_selector_config, num_heads, device_capability):
    """Hook body: the class path of the backend the policy names (TRITON_MLA_SPARSE, or the upstream
    candidate that can run the model where vLLM's own pick cannot), else None.

    platform_cls is the calling CUDA platform class (kept for the hook's stable signature)."""
    if not getattr(attn_selector_config, "use_sparse", False) or selected_backend is not None:
        return None
    from vllm.logger import init_logger
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    capability = (device_capability.major, device_capability.minor)
    upstream = upstream_validation(device_capability, attn_selector_config, num_heads)
    decision = choose_sparse_backend(
        capability,
        use_sparse=True,
        kv_cache_dtype=attn_selector_config.kv_cache_dtype,
        upstream=upstream,
        explicit=None,
        portable=portable_switch(),
        limits=measured_limits(upstream),
    )
    logger = init_logger("vllm._dsa_overlay.selection")
    if decision.backend is None:
        if any(not reasons for reasons in upstream.values()):
            logger.debug("dsa-overlay: keeping upstream sparse MLA selection: %s", decision.reason)
        else:  # upstream is about to fail: say why the Triton backend could not step in
            logger.warning("dsa-overlay: %s not usable: %s.", BACKEND_NAME, decision.reason)
        return None
    logger.info("dsa-overlay: using %s attention backend: %s.", decision.backend, decision.reason)
    return AttentionBackendEnum[decision.backend].get_path()
