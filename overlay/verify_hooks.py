"""What the patched vLLM selects for a GLM-5 attention layer on each GPU generation.

Called by the engine's `verify.py` inside the target environment (vLLM importable and patched;
works on a CPU-only machine given a stub libcuda). For compute capabilities 8.0, 8.6, 8.9, 9.0,
10.0, 12.0 and 12.1 and kv-cache dtypes bf16 (`auto`) and `fp8_ds_mla`, it asks the patched
`CudaPlatformBase.get_attn_backend_cls` for a GLM-5 config (head_size 576, MLA, sparse, bf16,
64 heads) three ways: as shipped (switch off), with `DSA_OVERLAY_PORTABLE=1`, and with an explicit
`--attention-backend TRITON_MLA_SPARSE`.

    print(report())             # markdown table; raises SelectionTableError listing wrong rows
    rep = selection_report()    # the rows, rep.ok, rep.problems

Expectations checked: capabilities without an upstream sparse kernel (8.x, 12.x) get
TRITON_MLA_SPARSE; 9.0 and 10.0 keep upstream's choice; the portable switch and the explicit choice
give TRITON_MLA_SPARSE everywhere.

On a machine without a GPU some upstream candidates cannot even be imported (FlashInfer allocates
a CUDA tensor at import). When upstream's own loop fails that way, the row shows the first
candidate that validates, marked "(by validation)".
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass, field

from .selection import BACKEND_NAME, PORTABLE_ENV, upstream_validation

CAPABILITIES = ((8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0), (12, 1))
KV_CACHE_DTYPES = ("auto", "fp8_ds_mla")
UPSTREAM_SPARSE_MAJORS = (9, 10)
GLM5_HEADS = 64


@dataclass
class SelectionReport:
    rows: list[dict] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def __str__(self) -> str:
        lines = [
            "| cc | kv cache | selected | with DSA_OVERLAY_PORTABLE=1 | explicit TRITON_MLA_SPARSE |",
            "|---|---|---|---|---|",
        ]
        for r in self.rows:
            lines.append(
                f"| {r['cc']} | {r['kv_cache_dtype']} | {r['default']} | {r['portable']} | "
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


def _problems_for(row, capability) -> list[str]:
    where = f"cc {row['cc']}, kv {row['kv_cache_dtype']}"
    out = []
    if capability[0] in UPSTREAM_SPARSE_MAJORS:
        if row["default"].startswith(BACKEND_NAME) or row["default"].startswith("error"):
            out.append(f"{where}: expected an upstream sparse backend, got {row['default']}")
    elif row["default"] != BACKEND_NAME:
        out.append(f"{where}: expected {BACKEND_NAME}, got {row['default']}")
    for col in ("portable", "explicit"):
        if row[col] != BACKEND_NAME:
            out.append(f"{where} ({col}): expected {BACKEND_NAME}, got {row[col]}")
    return out


def selection_report(capabilities=CAPABILITIES, kv_cache_dtypes=KV_CACHE_DTYPES) -> SelectionReport:
    rep = SelectionReport()
    for cap in capabilities:
        for kv in kv_cache_dtypes:
            row = {
                "cc": f"{cap[0]}.{cap[1]}",
                "kv_cache_dtype": "bf16 (auto)" if kv == "auto" else kv,
                "default": _select(cap, kv),
                "portable": _select(cap, kv, portable=True),
                "explicit": _select(cap, kv, explicit=BACKEND_NAME),
            }
            rep.rows.append(row)
            rep.problems.extend(_problems_for(row, cap))
    return rep


class SelectionTableError(RuntimeError):
    pass


def report() -> str:
    """verify.py's hook: the markdown table; raises (one line per problem) when a row is wrong."""
    rep = selection_report()
    if not rep.ok:
        raise SelectionTableError("; ".join(rep.problems))
    return str(rep)
