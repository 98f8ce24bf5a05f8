"""Programmatic dependent launch (DSA_OVERLAY_PDL=1), cross-compiled without a GPU: every kernel a launch plan can
start with PDL waits (``griddepcontrol.wait``) before its first global load and then, once, releases the next
kernel's launch (``griddepcontrol.launch_dependents``), carries Triton's ``launch_pdl``
option in its metadata (what makes its launcher use ``cudaLaunchKernelEx`` with programmatic stream
serialization), and assembles for sm_90 and sm_120 (ptxas runs inside ``triton.compile``); without PDL, and on
sm_80 where PDL does not exist, neither instruction is emitted.

Run as a fresh subprocess without TRITON_INTERPRET (the suite's pytest interprets). On a GPU the check that a PDL
launch computes the same as an ordinary one is gpu_checks.py::test_pdl_launches_compute_what_ordinary_ones_do.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
_FIRST_LOAD = re.compile(r"\bld\.global|\bcp\.async\.c[ag]\.shared\.global|\bld\.volatile\.global")


def _builds(cc: int):
    """(name, kernel, pointer types, 16-divisible arguments, constexprs, options): one build of every PDL-capable
    kernel for sm_<cc>."""
    from _sparse_mla_args import DIVISIBLE, fwd_pointer_types

    from overlay.kernels import indexer as IX
    from overlay.kernels import sparse_mla as SM
    from overlay.kernels import sparse_mla_sm90 as S90

    cap = (cc // 10, cc % 10)
    fwd = dict(IS_FP8=False, FP8_NATIVE=True, SPLIT=True, DOT_F32=False, BLOCK_H=16, BLOCK_N=32, PAGED=True)
    pre = IX.prefill_config(cap, 32)
    dec = IX.decode_config(cap, 32, 1, 128, 4096, 132, gluon=False)
    idx_ptrs = {"q_ptr": "*fp8e4nv", "k_ptr": "*fp8e4nv", "kv_ptr": "*u8", "kstart_ptr": "*i32", "kend_ptr": "*i32",
                "cl_ptr": "*i32", "bt_ptr": "*i32", "ksc_ptr": "*fp32", "w_ptr": "*fp32", "out_ptr": "*fp32"}
    if pre.DOT_MODE != IX.DOT_FP8:   # sm_80/86: raw bytes
        idx_ptrs.update(q_ptr="*u8", k_ptr="*u8")
    # aligned pointers and 16-divisible strides, as vLLM's launches specialise them (the Gluon cp.async needs it)
    idx_div = tuple(idx_ptrs) + ("stride_qm", "stride_qh", "stride_kn", "stride_qb", "stride_qn", "stride_blk")
    out = [
        ("attention", SM._sparse_mla_fwd_kernel, fwd_pointer_types("bf16", True), DIVISIBLE, fwd,
         dict(num_warps=4, num_stages=2)),
        ("combine", SM._sparse_mla_combine_kernel,
         {"po_ptr": "*fp32", "plse_ptr": "*fp32", "out_ptr": "*bf16", "lse_ptr": "*fp32"}, (),
         dict(CHUNK_S=8, BLOCK_D=512), dict(num_warps=4, num_stages=1)),
        ("request slots", SM._request_slots_kernel,
         {"idx_ptr": "*i32", "req_ptr": "*i32", "bt_ptr": "*i32", "slot_ptr": "*i32"}, (),
         dict(BLOCK=SM._SLOTS_BLOCK), dict(num_warps=4, num_stages=1)),
        ("prefill logits", IX._mqa_logits_kernel, idx_ptrs, idx_div, dict(D=IX.HEAD_DIM, **pre.constexprs()),
         dict(num_warps=pre.num_warps, num_stages=pre.num_stages)),
        ("paged logits", IX._paged_mqa_logits_kernel, idx_ptrs, idx_div,
         dict(D=IX.HEAD_DIM, BS=64, **dec.constexprs()), dict(num_warps=dec.num_warps, num_stages=dec.num_stages)),
    ]
    if cc == 90 and S90.GLUON:
        g = IX.DECODE_GLUON[(2, 32)]
        out.append(("paged logits, sm_90 Gluon", IX._paged_mqa_logits_sm90_kernel, idx_ptrs, idx_div,
                    dict(D=IX.HEAD_DIM, BS=64, **g.constexprs()), dict(num_warps=4, num_stages=1)))
        g90 = dict(fwd, BLOCK_H=64, BLOCK_N=64, PAGED=False, NUM_BUF=2, P_SWIZZLE=128)
        out.append(("attention, sm_90 Gluon", S90._sparse_mla_fwd_sm90_kernel, fwd_pointer_types("bf16", True),
                    DIVISIBLE, g90, dict(num_warps=8, num_stages=1)))
        if S90.WS:
            out.append(("attention, sm_90 warp-specialised", S90._sparse_mla_fwd_sm90_ws_kernel,
                        fwd_pointer_types("bf16", True), DIVISIBLE, g90, dict(num_warps=4, num_stages=1)))
    return out


def _worker(cc: int) -> None:
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(HERE))
    import triton
    from _xcompile import signature
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    for name, fn, ptrs, div, consts, opts in _builds(cc):
        source = ASTSource
        if type(fn).__name__ == "GluonJITFunction":
            from triton.experimental.gluon._runtime import GluonASTSource as source
        sig = signature(fn, ptrs, ("sm_scale_log2",))
        attrs = {(list(sig).index(n),): [["tt.divisibility", 16]] for n in div if n in sig}
        consts = {**{q.name: q.default for q in fn.params if q.is_constexpr and q.has_default}, **consts}
        for pdl in ((False,) if cc < 90 else (False, True)):
            k = triton.compile(source(fn=fn, signature=sig, constexprs={**consts, "PDL": pdl}, attrs=attrs),
                               target=GPUTarget("cuda", cc, 32), options={**opts, "launch_pdl": pdl})
            ptx = k.asm["ptx"]
            waits = [m.start() for m in re.finditer(r"griddepcontrol\.wait", ptx)]
            load = _FIRST_LOAD.search(ptx)
            release = [m.start() for m in re.finditer(r"griddepcontrol\.launch_dependents", ptx)]
            print(json.dumps(dict(name=name, cc=cc, pdl=pdl, waits=len(waits), launch_pdl=bool(k.metadata.launch_pdl),
                                  releases=len(release), release_after_wait=bool(waits and release
                                                                                 and waits[0] < release[0]),
                                  wait_before_first_load=bool(waits and load and waits[0] < load.start()),
                                  has_load=load is not None)), flush=True)


@pytest.mark.parametrize("cc", [90, 120, 80])
def test_pdl_builds_wait_before_their_first_load(cc):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, __file__, str(cc)], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    names = {r["name"] for r in rows}
    assert {"attention", "combine", "request slots", "prefill logits", "paged logits"} <= names
    if cc == 90:
        assert {"paged logits, sm_90 Gluon", "attention, sm_90 Gluon"} <= names
    for r in rows:
        assert r["has_load"], r
        if r["pdl"]:
            assert r["waits"] == 1 and r["wait_before_first_load"] and r["launch_pdl"], r
            assert r["releases"] == 1 and r["release_after_wait"], r
        else:
            assert r["waits"] == 0 and r["releases"] == 0 and not r["launch_pdl"], r
    assert any(r["pdl"] for r in rows) == (cc >= 90)


if __name__ == "__main__":
    _worker(int(sys.argv[1]))
