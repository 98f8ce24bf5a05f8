"""Load a kernel file under Triton's CPU interpreter, whatever this pytest process imported before.

Shared by the kernel tests, the backend integration test and the benchmarks' --cpu-smoke runs (bench never
imports tests/); self-contained, so it can be loaded by path in a vLLM venv's interpreter. Importing it sets
TRITON_INTERPRET=1 (read when @triton.jit decorates), so only CPU runs import it; the
cross-compile tests, which need compiled kernels, run in a subprocess without it.
"""

from __future__ import annotations

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
