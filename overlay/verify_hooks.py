"""What the patched vLLM selects for a GLM-5 attention layer on each GPU generation.

Called by the engine's `verify.py` inside the target environment (vLLM importable and patched;
works on a CPU-only machine given a stub libcuda). For compute capabilities 8.0, 8.6, 8.9, 9.0,
10.0, 12.0 and 12.1, kv-cache dtypes `auto`, `bfloat16` and `fp8_ds_mla` and index_topk 2048, 256
and 200, it asks the patched `CudaPlatformBase.get_attn_backend_cls` for a GLM-5 config (head_size
576, MLA, sparse, bf16, 64 heads; the index_topk in a model config in context, where upstream's
validations read it) three ways: as shipped (switch off), with `DSA_OVERLAY_PORTABLE=1`, and with
an explicit `--attention-backend TRITON_MLA_SPARSE`.

    print(report())             # markdown table; raises SelectionTableError listing wrong rows
    rep = selection_report()    # the rows, rep.ok, rep.problems

Expectations checked: sm_8x (no upstream sparse kernel in any release) gets TRITON_MLA_SPARSE; the
other capabilities get what the policy (`selection.choose_sparse_backend`) makes of the release's own
candidates: upstream's where one validates (FLASHMLA_SPARSE on 9.x/10.x, from 0.24.0
FLASHINFER_MLA_SPARSE_SM120 on 12.x for fp8 caches at index_topk 2048, ...), TRITON_MLA_SPARSE
otherwise; the portable switch and the explicit choice give TRITON_MLA_SPARSE everywhere.

From 0.29.0 a second table says which model code serves DeepSeek-V3.2 / GLM-5 per capability (the hook in
`vllm/models/deepseek_v32/__init__.py`: upstream's CUDA module from sm_89, the generic classes below).

On a machine without a GPU some upstream candidates cannot even be imported (FlashInfer allocates
a CUDA tensor at import). When upstream's own loop fails that way, the row shows the first
candidate that validates, marked "(by validation)".
"""

from __future__ import annotations

import contextlib
import inspect
import os
import types
from dataclasses import dataclass, field

from .selection import BACKEND_NAME, PORTABLE_ENV, choose_sparse_backend, measured_limits, upstream_validation

CAPABILITIES = ((8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0), (12, 1))
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8_ds_mla")
# GLM-5 / DeepSeek-V3.2 (2048); small models (256); not a multiple of 128 (FlashMLA refuses it).
INDEX_TOPKS = (2048, 256, 200)
GLM5_HEADS = 64
# The GLM-5 fields upstream's sparse validations read from the model config (besides index_topk).
GLM5_HF_FIELDS = {"model_type": "glm_moe_dsa", "qk_nope_head_dim": 192, "qk_rope_head_dim": 64,
                  "kv_lora_rank": 512, "v_head_dim": 256}


@dataclass
class SelectionReport:
    rows: list[dict] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def __str__(self) -> str:
        lines = [
            "| cc | kv cache | index_topk | selected | with DSA_OVERLAY_PORTABLE=1 | explicit TRITON_MLA_SPARSE |",
            "|---|---|---|---|---|---|",
        ]
        for r in self.rows:
            lines.append(
                f"| {r['cc']} | {r['kv_cache_dtype']} | {r['index_topk']} | {r['default']} | {r['portable']} | "
                f"{r['explicit']} |"
            )
        return "\n".join(lines)


def _platform_at(capability):
    from vllm.platforms.cuda import CudaPlatformBase
    from vllm.platforms.interface import DeviceCapability

    cap = DeviceCapability(*capability)
    return type(
        f"CudaAt{capability[0]}{capability[1]}",
        (CudaPlatformBase,),
        {"get_device_capability": classmethod(lambda cls, device_id=0: cap)},
    )


def _glm5_config(kv_cache_dtype):
    import torch
    from vllm.v1.attention.selector import AttentionSelectorConfig

    return AttentionSelectorConfig(
        head_size=576,
        dtype=torch.bfloat16,
        kv_cache_dtype=kv_cache_dtype,
        block_size=None,
        use_mla=True,
        use_sparse=True,
    )


@contextlib.contextmanager
def _glm5_model(index_topk):
    """A vLLM config in context whose model is GLM-5 with `index_topk` (no checkpoint needed: the model
    config is a stand-in carrying the fields the selection reads)."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config

    config = VllmConfig(device_config=DeviceConfig(device="cpu"))
    hf = types.SimpleNamespace(**GLM5_HF_FIELDS, index_topk=index_topk)
    object.__setattr__(config, "model_config", types.SimpleNamespace(hf_config=hf, hf_text_config=hf))
    with set_current_vllm_config(config):
        yield


def _name_of(path: str) -> str:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    for member in AttentionBackendEnum:
        try:
            if member.get_path() == path:
                return member.name
        except ValueError:  # CUSTOM, unregistered
            continue
    return path


def _select(capability, kv_cache_dtype, explicit=None, portable=False) -> str:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    platform = _platform_at(capability)
    cfg = _glm5_config(kv_cache_dtype)
    selected = AttentionBackendEnum[explicit] if explicit else None
    kwargs = {}
    if "num_heads" in inspect.signature(platform.get_attn_backend_cls).parameters:
        kwargs["num_heads"] = GLM5_HEADS
    old = os.environ.get(PORTABLE_ENV)
    os.environ[PORTABLE_ENV] = "1" if portable else "0"
    try:
        return _name_of(platform.get_attn_backend_cls(selected, cfg, **kwargs))
    except ValueError as e:
        return f"error: {str(e).splitlines()[0][:120]}"
    except Exception as e:  # upstream's own candidate loop could not import a backend here
        from vllm.platforms.interface import DeviceCapability

        up = upstream_validation(DeviceCapability(*capability), cfg, GLM5_HEADS)
        valid = [name for name, reasons in up.items() if not reasons]
        if valid:
            return f"{valid[0]} (by validation)"
        return f"error: {type(e).__name__}: {str(e)[:100]}"
    finally:
        if old is None:
            os.environ.pop(PORTABLE_ENV, None)
        else:
            os.environ[PORTABLE_ENV] = old


def _expected(capability, kv_cache_dtype) -> str:
    """What the policy makes of this release's own candidates here (the hook's contract)."""
    from vllm.platforms.interface import DeviceCapability

    up = upstream_validation(DeviceCapability(*capability), _glm5_config(kv_cache_dtype), GLM5_HEADS)
    decision = choose_sparse_backend(capability, True, kv_cache_dtype, up, limits=measured_limits(up))
    if decision.backend is not None:
        return decision.backend
    return next((name for name, reasons in up.items() if not reasons), "error")


def _problems_for(row, capability, expected) -> list[str]:
    where = f"cc {row['cc']}, kv {row['kv_cache_dtype']}, index_topk {row['index_topk']}"
    want = BACKEND_NAME if capability[0] == 8 else expected
    out = []
    if row["default"].split(" (")[0] != want:
        out.append(f"{where}: expected {want}, got {row['default']}")
    for col in ("portable", "explicit"):
        if row[col] != BACKEND_NAME:
            out.append(f"{where} ({col}): expected {BACKEND_NAME}, got {row[col]}")
    return out


def selection_report(capabilities=CAPABILITIES, kv_cache_dtypes=KV_CACHE_DTYPES,
                     index_topks=INDEX_TOPKS) -> SelectionReport:
    rep = SelectionReport()
    for cap in capabilities:
        for kv in kv_cache_dtypes:
            for topk in index_topks:
                with _glm5_model(topk):
                    row = {
                        "cc": f"{cap[0]}.{cap[1]}",
                        "kv_cache_dtype": kv,
                        "index_topk": topk,
                        "default": _select(cap, kv),
                        "portable": _select(cap, kv, portable=True),
                        "explicit": _select(cap, kv, explicit=BACKEND_NAME),
                    }
                    expected = _expected(cap, kv)
                rep.rows.append(row)
                rep.problems.extend(_problems_for(row, cap, expected))
    return rep


class SelectionTableError(RuntimeError):
    pass


DSA_MODEL_PACKAGE = "vllm.models.deepseek_v32"   # 0.29.0+: DeepSeek-V3.2 / GLM-5 model code by platform
DSA_MODEL_HOOK = "_dsa_ix.cuda_dsa_module_supported()"


def model_module_report(capabilities=CAPABILITIES) -> tuple[str, list[str]]:
    """0.29.0+: which model code serves DeepSeek-V3.2 / GLM-5 at each capability (upstream's CUDA module,
    whose Triton kernels store fp8, from sm_89; the generic deepseek_v2 classes below), read from the
    hooked `vllm/models/deepseek_v32/__init__.py` without importing it (its CUDA branch imports upstream's CUDA
    kernels). ("", []) for releases whose registry does not serve GLM-5 from that package (before 0.29.0); a
    problem when the hook is missing."""
    import importlib.util

    from .indexer_ops import triton_fp8_store_supported

    try:
        spec = importlib.util.find_spec(DSA_MODEL_PACKAGE)
    except ModuleNotFoundError:  # 0.16-0.24: no vllm.models package
        spec = None
    if spec is None or spec.origin is None:
        return "", []
    with open(spec.origin, encoding="utf-8") as f:
        source = f.read()
    if "GlmMoeDsaForCausalLM" not in source:  # 0.25-0.28: the package exists, the registry serves deepseek_v2
        return "", []
    if DSA_MODEL_HOOK not in source:
        return "", [f"{spec.origin}: the model-module hook ({DSA_MODEL_HOOK}) is missing; re-run apply"]
    lines = ["| cc | DeepSeek-V3.2 / GLM-5 model code |", "|---|---|"]
    for cap in capabilities:
        code = ("upstream CUDA module (deepseek_v32/nvidia)" if triton_fp8_store_supported(cap)
                else "generic deepseek_v2 classes (upstream's fp8-storing Triton kernels need sm_89+)")
        lines.append(f"| {cap[0]}.{cap[1]} | {code} |")
    return "\n".join(lines), []


def report() -> str:
    """verify.py's hook: the markdown table(s); raises (one line per problem) when a row is wrong."""
    rep = selection_report()
    models, problems = model_module_report()
    problems = rep.problems + problems
    if problems:
        raise SelectionTableError("; ".join(problems))
    return str(rep) + ("\n\n" + models if models else "")
