"""Every launch configuration of the indexer kernels compiles for sm_80, sm_86, sm_89, sm_90, sm_100,
sm_120 and sm_121, with this interpreter's Triton and with Triton 3.5.1 (a cached venv,
tests/kernels/_triton35.py), fits the target's shared memory, does not spill registers and is not
lowered to a trap.

No GPU needed: `triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))` runs the whole
pipeline to PTX on the CPU; shared memory comes from Triton's metadata, registers and spills from
`ptxas -v` (the ptxas Triton ships).  The compiling runs in a subprocess without TRITON_INTERPRET,
because the interpreter tests of the same pytest run decorate the kernels for the CPU.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
HERE = pathlib.Path(__file__).resolve().parent
TARGETS = (80, 86, 89, 90, 100, 120, 121)
# Shared memory a block may opt into (cudaDevAttrMaxSharedMemoryPerBlockOptin), bytes.
SHARED_LIMIT = {80: 163 * 1024, 86: 101376, 89: 101376, 90: 227 * 1024, 100: 227 * 1024, 120: 101376,
                121: 101376}

# vLLM's indexer cache block size (DeepGEMM's paged kernel requires 64; the overlay keeps it).
VLLM_BLOCK_SIZE = 64

# Arguments a real launch sees as multiples of 16 (Triton specialises them): every pointer (torch
# allocations, and the cache is checked 16-byte aligned), head-dim multiples, cache geometry.
_DIV16 = {"stride_qm", "stride_qh", "stride_kn", "stride_qb", "stride_qn", "stride_blk",
          "n_per_split"}


def _ptxas(cc: int) -> str:
    from triton.backends.nvidia import compiler as nv

    try:
        return nv.get_ptxas(cc).path
    except TypeError:  # Triton 3.5: no arch argument
        return nv.get_ptxas().path


def _signature(fn, dot_mode: int, fp8_mode: int):
    sig, div = {}, []
    for p in fn.params:
        name = p.name
        if p.is_constexpr:
            sig[name] = "constexpr"
            continue
        if name.endswith("_ptr"):
            if name in ("q_ptr", "k_ptr"):
                sig[name] = "*fp8e4nv" if dot_mode == fp8_mode else "*u8"
            elif name == "kv_ptr":       # the uint8 paged cache, reinterpreted inside the kernel
                sig[name] = "*u8"
            elif name in ("kstart_ptr", "kend_ptr", "cl_ptr", "bt_ptr"):
                sig[name] = "*i32"
            else:
                sig[name] = "*fp32"
            div.append(name)
        else:
            sig[name] = "i32"
            if name in _DIV16:
                div.append(name)
    return sig, div


def _compile_one(ix, name: str, cfg: dict, cc: int) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = ix._mqa_logits_kernel if name == "prefill" else ix._paged_mqa_logits_kernel
    source = ASTSource
    if cfg.get("GLUON"):   # the sm_90 Gluon decode kernel (indexer_sm90.py): its own front end
        from triton.experimental.gluon._runtime import GluonASTSource as source

        fn = ix._paged_mqa_logits_sm90_kernel
    sig, div = _signature(fn, cfg["DOT_MODE"], ix.DOT_FP8)
    constexpr_names = [p.name for p in fn.params if p.is_constexpr]
    consts = {k: v for k, v in cfg.items() if k in constexpr_names}
    consts["D"] = ix.HEAD_DIM
    if cfg.get("GLUON"):
        consts["NUM_BUF"] = cfg["num_stages"]
    if name == "decode":   # the block size compiled in, as every vLLM launch has it (0: read at run time)
        consts["BS"] = VLLM_BLOCK_SIZE if cfg.get("CONST_BS") else 0
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in div}
    kernel = triton.compile(source(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                            target=GPUTarget("cuda", cc, 32),
                            options={"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"],
                                     **({"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {})})
    ptx = kernel.asm["ptx"]
    arch = re.search(r"^\.target\s+(\S+)", ptx, re.M).group(1).rstrip(",")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        res = subprocess.run([_ptxas(cc), "-v", f"--gpu-name={arch}", path, "-o", path + ".o"],
                             capture_output=True, text=True)
    log = res.stdout + res.stderr
    regs = re.search(r"Used (\d+) registers", log)
    return dict(kernel=name, cc=cc, cfg=cfg, shared=int(kernel.metadata.shared), arch=arch,
                wgmma=len(re.findall(r"wgmma\.mma_async", ptx)),
                traps=len(re.findall(r"^\s*trap;", ptx, re.M)),   # a construct Triton could not lower
                ptxas_rc=res.returncode, registers=int(regs.group(1)) if regs else -1,
                spill_bytes=sum(int(x) for x in re.findall(r"(\d+) bytes spill", log)),
                log=log[-2000:])


def _worker() -> list[dict]:
    assert not os.environ.get("TRITON_INTERPRET"), "cross-compiling needs the compiled kernels"
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(HERE))
    from _xcompile import torch_or_stub

    torch_or_stub()
    from overlay.kernels import indexer as ix

    assert not ix.INTERPRETED
    out = []
    for cc in TARGETS:
        for name, cfg in ix.launch_configs((cc // 10, cc % 10)):
            try:
                out.append(_compile_one(ix, name, dataclasses.asdict(cfg), cc))
            except Exception as e:  # reported per target: the others still count
                out.append(dict(kernel=name, cc=cc, cfg=dataclasses.asdict(cfg), error=repr(e)[-1500:]))
    return out


# The Triton the worker runs under: this interpreter's, and 3.5.1 from a cached venv (tests/kernels/_triton35.py).
@pytest.fixture(scope="module", params=["installed", "3.5.1"], ids=lambda t: f"triton-{t}")
def compiled(request):
    if request.param == "installed":
        python = sys.executable
    else:
        from tests.kernels import _triton35

        python = _triton35.python()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([python, __file__, "--worker"], env=env, capture_output=True,
                          text=True, timeout=900, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr[-6000:]
    return request.param, json.loads(proc.stdout.strip().splitlines()[-1])


# Known failures, strict: the test turns red again (XPASS) once the launch tables stop emitting the config.
KNOWN_BAD = {
    ("3.5.1", 121): "Triton 3.5.1 ships ptxas 12.8, which has no sm_121a (added in CUDA 12.9)",
}


@pytest.mark.parametrize("cc", TARGETS)
def test_every_config_compiles_fits_and_does_not_spill(compiled, cc, request):
    tri, rows = compiled
    if (tri, cc) in KNOWN_BAD:
        request.applymarker(pytest.mark.xfail(strict=True, reason=KNOWN_BAD[tri, cc]))
    rows = [r for r in rows if r["cc"] == cc]
    kernels = {r["kernel"] for r in rows}
    assert kernels == {"prefill", "decode"}, f"sm_{cc}: compiled only {kernels}"
    # Both head counts that matter (GLM-5: 32, DeepSeek-V3.2: 64) and a tiny model's (<= 16) are in.
    assert {16, 32, 64} <= {r["cfg"]["HP"] for r in rows}
    for r in rows:
        what = f"triton {tri} sm_{cc} {r['kernel']} {r['cfg']}"
        assert "error" not in r, f"{what}: does not compile: {r.get('error')}"
        assert r["ptxas_rc"] == 0, f"{what}: ptxas failed\n{r['log']}"
        assert r["arch"].startswith(f"sm_{cc}"), f"{what}: PTX targets {r['arch']}"
        assert 0 < r["shared"] <= SHARED_LIMIT[cc], f"{what}: {r['shared']} B shared memory"
        assert 0 < r["registers"] <= 255, f"{what}: {r['registers']} registers"
        assert r["spill_bytes"] == 0, f"{what}: spills {r['spill_bytes']} bytes\n{r['log']}"
        assert r["traps"] == 0, f"{what}: lowered to {r['traps']} trap(s): Triton cannot compile it there"


def test_sm90_decode_has_the_gluon_kernel_where_the_table_picks_it(compiled):
    """On sm_90 two query tokens x 32 or 64 index heads (GLM-5 / DeepSeek-V3.2 with MTP) and, at batch 1, one token
    launch the Gluon kernel, and it multiplies with wgmma; nowhere else does a launch table pick it."""
    tri, rows = compiled
    gluon = [r for r in rows if r["kernel"] == "decode" and r["cfg"].get("GLUON")]
    assert {(r["cc"], r["cfg"]["T"], r["cfg"]["HP"]) for r in gluon} == {(90, 2, 32), (90, 2, 64), (90, 1, 32),
                                                                         (90, 1, 64)}, f"triton {tri}"
    assert all(r["wgmma"] > 0 for r in gluon), f"triton {tri}: the Gluon decode kernel has no wgmma"


def test_native_fp8_dot_only_where_the_target_has_it(compiled):
    from_cfg = {(r["cc"], r["cfg"]["DOT_MODE"]) for r in compiled[1]}
    modes = {cc: {m for c, m in from_cfg if c == cc} for cc in TARGETS}
    assert modes[80] == modes[86] == {1}          # DOT_BF16: e4m3 bytes decoded in registers
    assert modes[89] == modes[90] == modes[100] == modes[120] == modes[121] == {0}   # DOT_FP8


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    print(json.dumps(_worker()))
