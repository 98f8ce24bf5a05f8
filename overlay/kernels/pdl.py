# SPDX-License-Identifier: Apache-2.0
"""Programmatic dependent launch (PDL), the device side: what a kernel launched with PDL does first.

A kernel launched with Triton's ``launch_pdl=True`` option (``cudaLaunchKernelEx`` with programmatic stream
serialization) may start while the kernel before it on the stream is still draining; ``griddepcontrol.wait``
blocks until that kernel has finished and its memory is visible. Then ``griddepcontrol.launch_dependents`` lets
the kernel after it (if that one is launched with PDL: our split merge, a vLLM kernel) be scheduled as soon as
every program of this one has started, instead of when the last one exits; that kernel waits in turn before it
reads what this one writes. Every kernel a launch plan can start with PDL (attention, slot conversion, split
merge, both indexer kernels; Triton and sm_90 Gluon) calls :func:`pdl_enter` (or, in Gluon code,
:func:`pdl_enter_gluon`) before its first load, so a PDL launch reads nothing early; with ``PDL`` False (every GPU
before sm_90, the interpreter, and sm_90+ unless ``DSA_OVERLAY_PDL=1``: ``launch.pdl_launch``) it compiles to
nothing. A kernel without the wait (fp8_workspace's up-conversion) is never launched with PDL.

Self-contained: triton only.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

try:  # Gluon arrived in Triton 3.5
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
except ImportError:  # pragma: no cover - older Triton
    gluon = gl = None

__all__ = ["pdl_enter", "pdl_enter_gluon"]


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """Where launched with PDL: wait for the previous kernel on the stream (and its memory), then release the next
    one's launch. Nothing otherwise."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


if gluon is not None:
    @gluon.jit
    def pdl_enter_gluon(PDL: gl.constexpr):
        """pdl_enter for Gluon kernels (Triton's gdc_* are Triton-language builtins; these are their instructions)."""
        if PDL:
            gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False,
                                      pack=1)
            gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                                      is_pure=False, pack=1)
else:  # pragma: no cover
    pdl_enter_gluon = None
