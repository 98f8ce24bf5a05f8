"""Cross-compile a Triton kernel for a CUDA target on a machine without a GPU, and measure it.

Generic helper for the kernel tests (no kernel-specific knowledge here). Works with Triton 3.5 and 3.6:
``triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", cc, 32), options)``
runs the whole pipeline down to PTX and a cubin; register use and spills are not in the metadata without
a driver, so they are read from ``ptxas -v`` (the ptxas Triton itself uses for that architecture).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import types
from dataclasses import dataclass


def torch_or_stub() -> None:
    """Cross-compiling needs no torch, but the kernel files import it and read three dtypes at import. Where
    torch is absent (the Triton 3.5.1 venv of test_xcompile_triton35.py), put a stub module in its place whose
    every attribute is an inert named placeholder: enough to import the kernel files, and any real use fails."""
    try:
        import torch  # noqa: F401
    except ImportError:
        class Placeholder:
            def __init__(self, name):
                self.name = name

            def __repr__(self):
                return f"<stub {self.name}>"

        stub = types.ModuleType("torch", "stand-in for cross-compiling without torch")
        stub.__getattr__ = lambda name: Placeholder(f"torch.{name}")
        sys.modules["torch"] = stub


torch_or_stub()  # before triton: it must not find the stub half-made

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

# Opt-in shared memory per block (cudaDevAttrMaxSharedMemoryPerBlockOptin), bytes: 163 KB on sm_80, 99 KB on
# sm_86/89 and on consumer Blackwell (sm_120 RTX 50xx / RTX PRO 6000, sm_121 DGX Spark), 227 KB on sm_90 and
# datacenter Blackwell (sm_100 B200/GB200: 228 KB per SM, 227 KB usable by one block, as on Hopper).
SHARED_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448, 100: 232448, 120: 101376, 121: 101376}


@dataclass
class Compiled:
    cc: int
    shared: int          # bytes of shared memory per block (Triton metadata)
    registers: int       # per thread (ptxas -v)
    spill_stores: int    # bytes (ptxas -v)
    spill_loads: int     # bytes (ptxas -v)
    ptxas: str           # path of the ptxas that produced the numbers
    ptxas_log: str
    traps: int = 0       # `trap;` instructions in the PTX: Triton lowers a construct it cannot compile for
    wgmma: dict = None   # {"m64n32k16": count, ...}: warpgroup MMA instructions in the PTX, by shape
                         # the target to a lone trap (the kernel then compiles, fits, never spills, and dies)
    cubin: bytes = b""   # the cubin Triton built (bench/sass_mix.py disassembles it)

    @property
    def spills(self) -> int:
        return self.spill_stores + self.spill_loads


def ptxas_path(cc: int) -> str:
    try:  # Triton >= 3.4 picks ptxas-blackwell for sm_100+ itself
        from triton.backends.nvidia.compiler import get_ptxas

        try:
            return get_ptxas(cc).path
        except TypeError:
            return get_ptxas().path
    except Exception:  # pragma: no cover - fallback for layouts we do not know
        import triton.backends.nvidia as nv

        name = "ptxas-blackwell" if cc >= 100 else "ptxas"
        path = os.path.join(os.path.dirname(nv.__file__), "bin", name)
        return path if os.path.exists(path) else os.path.join(os.path.dirname(nv.__file__), "bin", "ptxas")


def signature(fn, pointer_types: dict, floats: tuple[str, ...] = ()) -> dict:
    """{argument: Triton type} of a (Gluon or Triton) JIT function: constexpr parameters "constexpr", those in
    ``pointer_types`` their pointer type, those in ``floats`` "fp32", the rest "i32"."""
    return {p.name: "constexpr" if p.is_constexpr else pointer_types.get(p.name, "fp32" if p.name in floats else "i32")
            for p in fn.params}


def cross_compile(fn, signature: dict, constexprs: dict, cc: int, *, num_warps: int, num_stages: int,
                  divisible_by_16: tuple[str, ...] = ()) -> Compiled:
    """Compile ``fn`` (a non-interpreted JITFunction, or a Gluon one) for sm_<cc> and run ptxas -v on its PTX.

    signature: {arg name: Triton type string ("*bf16", "i32", "fp32", "constexpr")} for every argument.
    constexprs: {arg name: value} for the constexpr arguments.
    divisible_by_16: argument names to specialise as 16-divisible (aligned pointers, strides), as a real
        launch would for typical inputs.
    """
    names = list(signature)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible_by_16}
    source = ASTSource
    if type(fn).__name__ == "GluonJITFunction":  # Gluon code has its own front end (layouts, no passes that pick them)
        from triton.experimental.gluon._runtime import GluonASTSource as source
    src = source(fn=fn, signature=signature, constexprs=dict(constexprs), attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", cc, 32),
                            options={"num_warps": num_warps, "num_stages": num_stages})
    ptx = kernel.asm["ptx"]
    m = re.search(r"^\.target\s+(\S+)", ptx, re.M)
    arch = m.group(1).rstrip(",") if m else f"sm_{cc}"
    tool = ptxas_path(cc)
    with tempfile.TemporaryDirectory() as tmp:
        p = os.path.join(tmp, "k.ptx")
        with open(p, "w") as f:
            f.write(ptx)
        res = subprocess.run([tool, "-v", f"--gpu-name={arch}", p, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True)
    log = res.stdout + res.stderr
    if res.returncode != 0:
        raise RuntimeError(f"ptxas failed for {arch}:\n{log}")
    regs = re.search(r"Used (\d+) registers", log)
    st = re.search(r"(\d+) bytes spill stores", log)
    ld = re.search(r"(\d+) bytes spill loads", log)
    if not (regs and st and ld):
        raise RuntimeError(f"could not parse ptxas -v output:\n{log}")
    return Compiled(cc, int(kernel.metadata.shared), int(regs.group(1)), int(st.group(1)),
                    int(ld.group(1)), tool, log, count_traps(ptx), count_wgmma(ptx), kernel.asm["cubin"])


def count_wgmma(ptx: str) -> dict:
    """wgmma.mma_async instructions in PTX by shape, e.g. {"m64n32k16": 36}."""
    counts: dict = {}
    for shape in re.findall(r"wgmma\.mma_async\.\S*?\.(m\d+n\d+k\d+)\.", ptx):
        counts[shape] = counts.get(shape, 0) + 1
    return counts


def count_traps(ptx: str) -> int:
    """Number of `trap;` instructions in PTX (none of our kernels asserts, so any trap is a failed lowering)."""
    return len(re.findall(r"^\s*trap;", ptx, re.M))
