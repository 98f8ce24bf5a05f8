"""The kernel self-test (overlay/kernels/selftest.py) on the CPU under Triton's interpreter: every check
passes on the real kernels, and every check reports FAIL when the kernels are broken on purpose.

Each run is a fresh subprocess with TRITON_INTERPRET=1 (the cross-compile tests of the same pytest run need
compiled kernels), calling `selftest.main()` as verify.py does and printing its return value.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHECKS = ["sparse_mla bf16", "sparse_mla fp8_ds_mla", "indexer prefill", "indexer decode"]

RUN = """
import sys
sys.path.insert(0, {root!r})
from tests.kernels._interp import numpy24_fix
numpy24_fix()
import torch
from overlay.kernels import indexer, selftest, sparse_mla
{mutation}
print("RETURNED", selftest.main({args}))
"""

# Each kernel broken on purpose, through the module attributes the self-test calls.
MUTATIONS = """
attention, prefill, decode = (sparse_mla.sparse_mla_attention, indexer.fp8_mqa_logits,
                              indexer.fp8_paged_mqa_logits)

def attention_broken(q, kv_cache, indices, scale, kv_format, **kw):
    if kv_format == "bf16":          # drop the first selected key of every token
        indices = indices.clone()
        indices[:, 0] = -1
    else:                            # the scale of every row's second fp8 tile doubled
        kv_cache = kv_cache.clone()
        kv_cache.view(-1, 656)[:, 516:520].view(torch.float32).mul_(2)
    return attention(q, kv_cache, indices, scale, kv_format, **kw)

def prefill_broken(q, kv, *args, **kw):
    k, k_scale = kv                  # the scales of the first 16 keys doubled
    k_scale = k_scale.clone()
    k_scale[:16] *= 2
    return prefill(q, (k, k_scale), *args, **kw)

def decode_broken(q, kv_cache, *args, **kw):
    kv_cache = kv_cache.clone()      # the scale of the first key of every block doubled
    bs = kv_cache.shape[1]
    kv_cache.view(kv_cache.shape[0], -1)[:, bs * 128:bs * 128 + 4].view(torch.float32).mul_(2)
    return decode(q, kv_cache, *args, **kw)

sparse_mla.sparse_mla_attention = attention_broken
indexer.fp8_mqa_logits = prefill_broken
indexer.fp8_paged_mqa_logits = decode_broken
"""


def _run(mutation: str = "", args: str = "") -> tuple[list[str], str]:
    env = dict(os.environ, TRITON_INTERPRET="1")
    code = RUN.format(root=str(ROOT), mutation=mutation, args=args)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    return proc.stdout.splitlines(), proc.stdout


def _check_lines(lines: list[str]) -> dict[str, str]:
    """{check name: PASS/FAIL} from the lines `PASS|FAIL  <name, 22 wide> <errors and tolerances>  <s> s`."""
    return {line[6:28].strip(): line[:4] for line in lines if line[:6] in ("PASS  ", "FAIL  ")}


def test_every_check_passes_on_the_real_kernels():
    lines, text = _run()
    assert re.match(r"kernel self-test: seed \d+, CPU \(Triton interpreter\)", lines[0]), text
    assert _check_lines(lines) == dict.fromkeys(CHECKS, "PASS"), text
    for line in lines[1:1 + len(CHECKS)]:  # error, tolerance and time on every line
        assert re.search(r"max abs err .*\d\.\d+e[-+]\d+ \(tol \d.*\)  \d+\.\d\d s$", line), line
    assert lines[-2:] == [f"kernel self-test: {len(CHECKS)}/{len(CHECKS)} checks passed", "RETURNED 0"], text


def test_every_check_fails_on_broken_kernels():
    lines, text = _run(MUTATIONS, "seed=1")  # a fixed seed: the dropped key matters in some row
    assert _check_lines(lines) == dict.fromkeys(CHECKS, "FAIL"), text
    assert lines[-1] == f"RETURNED {len(CHECKS)}", text
