"""GPU tests of the compiled kernels (tests/kernels/gpu_checks.py), each group in a fresh pytest process.

Triton decides once per process, when `triton.language` is first imported, whether @triton.jit functions
(its own `tl.min`, `tl.max`, ... included) are interpreted or compiled; the interpreter tests of this suite
need the former, the GPU tests the latter. So every test here runs one test function of gpu_checks.py in a
subprocess without TRITON_INTERPRET, shows its output, and fails with it. Needs CUDA (`gpu` marker: skipped
with a reason elsewhere). This module imports nothing from Triton.
"""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CHECKS = HERE / "gpu_checks.py"

GROUPS = [
    "test_sparse_mla_heuristic_launch",
    "test_sparse_mla_every_sm90_tile",
    "test_sparse_mla_every_mma_sync_tile",
    "test_sparse_mla_gluon_long_lists",
    "test_sparse_mla_fp8_bit_path_on_gpu",
    "test_gpu_tolerance_catches_a_dropped_key",
    "test_gpu_tolerance_catches_a_mis_scaled_fp8_tile",
    "test_indexer_prefill",
    "test_indexer_paged",
    "test_gpu_indexer_tolerance_catches_a_dropped_head",
    "test_sm90_indexer_default_is_the_gluon_kernel_where_the_table_says",
    "test_direct_launch_is_bit_identical_to_the_jit_entry",
    "test_backend_forward_with_request_local_indices",
    "test_pdl_launches_compute_what_ordinary_ones_do",
    "test_fp8_prefill_workspace_on_gpu",
    "test_sparse_mla_fp8_prefetch_tile",
    "test_every_e4m3_code_decodes_exactly_on_gpu",
]


# Groups built as for sm_80-sm_120 (mma.sync instead of wgmma on an sm_90 card), in their own Triton cache; those of
# BOTH_BUILDS run once each way.
MMA_SYNC_GROUPS = {"test_sparse_mla_every_mma_sync_tile"}
BOTH_BUILDS = {"test_sparse_mla_fp8_prefetch_tile", "test_every_e4m3_code_decodes_exactly_on_gpu",
               "test_sparse_mla_fp8_bit_path_on_gpu", "test_indexer_prefill", "test_indexer_paged"}
# The only skips a group may report (shapes a kernel does not take); any other skip fails the group.
ALLOWED_SKIPS = ("the Gluon decode kernel: sm_90, T x padded heads <= 128",)
RUNS = [(name, False) for name in GROUPS if name not in MMA_SYNC_GROUPS] + \
       [(name, True) for name in GROUPS if name in MMA_SYNC_GROUPS | BOTH_BUILDS]


def test_every_gpu_check_is_run():
    """Runs everywhere: GROUPS names every test function of gpu_checks.py (read without importing it)."""
    tree = ast.parse(CHECKS.read_text())
    found = [n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")]
    assert sorted(found) == sorted(GROUPS)


@pytest.mark.gpu
@pytest.mark.parametrize("name,mma_sync", RUNS, ids=[n + ("-mma.sync" if m else "") for n, m in RUNS])
def test_gpu_checks(name, mma_sync, request, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if mma_sync:
        env.update(DISABLE_MMA_V3="1", TRITON_CACHE_DIR=str(tmp_path / "triton-cache-mma-sync"))
    # --noconftest: tests/conftest.py sets TRITON_INTERPRET=1 for this suite, and gpu_checks.py needs compiled kernels
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "--noconftest",
                           f"{CHECKS}::{name}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    summary = [line for line in out.splitlines() if line.startswith("  ") and "(" in line and ":" in line
               and ("mla gpu" in line or "indexer gpu" in line)]
    tr = request.config.pluginmanager.getplugin("terminalreporter")
    if tr is not None and summary:
        with request.config.pluginmanager.getplugin("capturemanager").global_and_fixture_disabled():
            for line in [f"{name}: largest measured errors (tolerance):"] + summary:
                tr.write_line(line)
    assert proc.returncode == 0, f"{name} failed on the GPU:\n{out[-8000:]}"
    assert " passed" in out, f"{name}: nothing ran?\n{out[-3000:]}"
    skips = [line for line in out.splitlines() if line.startswith("SKIPPED")]
    assert all(any(why in line for why in ALLOWED_SKIPS) for line in skips), f"{name}: skipped\n" + "\n".join(skips)
