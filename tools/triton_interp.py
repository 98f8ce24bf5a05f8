"""Load a kernel file under Triton's CPU interpreter, whatever this pytest process imported before.

Shared by the kernel tests, the backend integration test and the benchmarks' --cpu-smoke runs (bench never
imports tests/); self-contained, so it can be loaded by path in a vLLM venv's interpreter. Importing it sets
TRITON_INTERPRET=1 (read when @triton.jit decorates), so only CPU runs import it; the
cross-compile tests, which need compiled kernels, run in a subprocess without it.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"


def numpy24_fix() -> None:
    """Triton 3.5/3.6's interpreter turns a scalar into an int with ``int(ndarray of shape (1,))``, which
    numpy >= 2.4 rejects ("only 0-dimensional arrays can be converted to Python scalars"), so every
    ``for i in range(runtime_value)`` in a kernel fails on the CPU (triton-lang/triton#9171, fixed after
    3.6). Convert through the single element instead."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_dsa_numpy24_fix", False):
        return

    def index(self):
        return int(self.handle.data.reshape(-1)[0])

    def patched(tensor, *scope):  # Triton 3.6 passes a patch scope, 3.5 sets attributes directly
        original(tensor, *scope)
        if scope:
            scope[0].set_attr(tensor, "__index__", index)
        else:
            tensor.__index__ = index

    patched._dsa_numpy24_fix = True
    interpreter._patch_lang_tensor = patched


def fp8_downcast_fix() -> None:
    """Triton's interpreter (3.5-3.9) rounds a float down to fp8 by adding the cut-off bit to the mantissa and
    OR-ing the result into the exponent bits, so a carry out of the mantissa is lost: fp32 124 <= |x| < 128 becomes
    64 in e4m3 (seen in upstream's fp8_ds_mla cache writer of vLLM 0.29+, run in the interpreter). The GPU rounds
    to nearest even and saturates (`cvt.rn.satfinite`). Convert float -> float8e4nv / float8e5 through torch,
    clamped to the format's largest finite value first (NaN stays NaN); every other conversion as before."""
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter._convert_float
    if getattr(original, "_dsa_fp8_fix", False):
        return
    targets = {tl.float8e4nv: (torch.float8_e4m3fn, 448.0), tl.float8e5: (torch.float8_e5m2, 57344.0)}
    sources = (tl.float32, tl.float16, tl.bfloat16)

    def fixed(input, input_dtype, output_dtype, rounding_mode):
        if output_dtype not in targets or input_dtype not in sources:
            return original(input, input_dtype, output_dtype, rounding_mode)
        fp8, largest = targets[output_dtype]
        raw = np.ascontiguousarray(input)
        x = torch.from_numpy(raw.view(np.int16) if input_dtype == tl.bfloat16 else raw)
        x = (x.view(torch.bfloat16) if input_dtype == tl.bfloat16 else x).float()
        x = torch.where(x.isnan(), x, x.clamp(-largest, largest))
        return x.to(fp8).view(torch.uint8).numpy().reshape(input.shape)

    fixed._dsa_fp8_fix = True
    interpreter._convert_float = fixed


@contextlib.contextmanager
def bf16_rounding():
    """Within the block, Triton's interpreter rounds float32 -> bfloat16 casts to nearest even, as the GPU does
    (`cvt.rn.bf16.f32`); the interpreter (3.5-3.9) truncates the mantissa (`.to(tl.bfloat16)` passes no rounding
    mode), 1 ulp off for half the values. Restores the interpreter's own conversion afterwards, so tests that
    compare two interpreted kernels bit for bit see one rule throughout."""
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter._convert_float

    def fixed(input, input_dtype, output_dtype, rounding_mode):
        if input_dtype != tl.float32 or output_dtype != tl.bfloat16:
            return original(input, input_dtype, output_dtype, rounding_mode)
        x = torch.from_numpy(np.ascontiguousarray(input).view(np.float32))
        return x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16).reshape(input.shape)

    interpreter._convert_float = fixed
    try:
        yield
    finally:
        interpreter._convert_float = original


def load_interpreted(path: Path, name: str):
    """Import the kernel file at `path` as a private module `name` with interpreted kernels. It is imported as
    a member of a private package over its folder, so that its relative imports (``from .launch import``) load
    their files from beside it, interpreted too."""
    numpy24_fix()
    path = Path(path)
    package = f"_dsa_interp_{name}"
    if package not in sys.modules:
        spec = importlib.machinery.ModuleSpec(package, None, is_package=True)
        spec.submodule_search_locations = [str(path.parent)]
        sys.modules[package] = importlib.util.module_from_spec(spec)
    spec = importlib.util.spec_from_file_location(f"{package}.{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
